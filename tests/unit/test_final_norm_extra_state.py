"""A converted checkpoint loads into a model whose final norm carries TE's `_extra_state` (issue 18, defect 7).

    python -m pytest tests/unit/test_final_norm_extra_state.py -q

On the TE platform the final norm is TE's (TENorm, platform.final_norm), and TE modules save an
`_extra_state`.  TE does not import on a CPU machine,
so the final norm is swapped for a test double: the local norm plus an (empty) extra state, the one
property of TENorm at stake.  A checkpoint written by the converter's DistCheckpointWriter (which
does not write it) must still load (strictly, every weight back) into that model.
"""

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

# The fast tier (`-m unit`) is given by tests/unit/conftest.py: every test here but the slow ones.

TINY = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32}


def _write_then_load(rank, world, weights_dir):
    from megatron_rl.conversion.dist_ckpt import DistCheckpointWriter
    from megatron_rl.conversion.model_io import canonical_params, load_model
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg = load_hf_config(TINY)
    with parallel_scope(tp=1, pp=1, seed=3):
        model = build_gpt_model(cfg, platform=detect_platform("cpu"), tp=1, pp=1)
        params = canonical_params(model)
        writer = DistCheckpointWriter(weights_dir, num_layers=cfg.num_layers)
        for name, p in params.items():
            writer.add(name, p.detach())
        writer.close()
        saved = {name: p.detach().clone() for name, p in params.items()}

        norm = model.decoder.final_layernorm

        class NormWithExtraState(type(norm)):  # what TENorm adds: an _extra_state entry
            def get_extra_state(self):
                return None

            def set_extra_state(self, state):
                pass

        norm.__class__ = NormWithExtraState
        assert "decoder.final_layernorm._extra_state" in model.sharded_state_dict()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_model(model, weights_dir)
        return [name for name, p in canonical_params(model).items() if not torch.equal(p, saved[name])]


@pytest.mark.slow
def test_converted_checkpoint_loads_into_te_final_norm(tmp_path):
    (differing,) = run_distributed(_write_then_load, 1, str(tmp_path / "weights"))
    assert differing == []
