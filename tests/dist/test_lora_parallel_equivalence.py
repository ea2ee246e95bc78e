"""One LoRA optimizer step at TP2 (and PP2) computes what it computes at TP1.

    python -m pytest tests/dist/test_lora_parallel_equivalence.py -q

One launch of 2 gloo processes builds a tiny random Qwen3 at TP1 with adapters on qkv, proj, fc1 and
fc2, and gives it random adapters (B too, so that A's gradient B^T dy x^T is not zero and every path
of the TP rule in megatron_rl/models/lora.py carries a gradient).  Each layout (TP1 DP2, TP2, PP2)
loads its shard of those weights (base and adapters split by conversion/tp_layout.py) and runs one
Learner step (Adam, weight decay, clip_grad, distributed optimizer).  Against TP1, within 1e-5:
logprobs before and after the step, loss, grad norm and the updated adapters.  Also: each layout's
own freshly initialised adapters are the shards of TP1's (one seeding rule for every layout), and
the base weights do not move.
"""

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks; the first (TP1, DP2) is the one compared against
OPT = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, clip_grad=0.1)
LORA = dict(enabled=True, rank=4, alpha=8.0, target_modules=["qkv", "proj", "fc1", "fc2"], seed=11)
SEED = 7


def _tokens():
    return torch.randint(0, TINY["vocab_size"], (4, 12), generator=torch.Generator().manual_seed(3))


def _nll(logprobs_bt, mb):
    return -logprobs_bt.mean(), {"tokens": float(logprobs_bt.numel())}


def _learner(cfg, platform, tp, pp):
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.lora import LoraConfig

    return Learner(LearnerConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, micro_batch_size=1,
                                 global_batch_size=4, seed=SEED, use_distributed_optimizer=True,
                                 lora=LoraConfig(**LORA), **OPT), cfg, platform)


def _full_start(cfg, platform):
    """The TP1 model's state with its own initial adapters, and the same with random B's (the start)."""
    from megatron_rl.platform.parallel import parallel_scope

    with parallel_scope(tp=1, pp=1, seed=SEED):
        from megatron_rl.models.builder import build_gpt_model
        from megatron_rl.models.lora import LoraConfig

        model = build_gpt_model(cfg, platform=platform, tp=1, pp=1, lora=LoraConfig(**LORA))
        initial = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    gen = torch.Generator().manual_seed(5)
    start = {k: (torch.randn(v.shape, generator=gen) * 0.2 if k.endswith("lora_b") else v)
             for k, v in initial.items()}
    return initial, start


def _equivalence(rank, world):
    from megatron.core import parallel_state as ps

    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.lora import LoraConfig, adapter_parameters
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.reshard import shard_state_dict
    from megatron_rl.publish.adapter_source import AdapterSource

    cfg, platform, tokens = load_hf_config(TINY), detect_platform("cpu"), _tokens()
    initial, start = _full_start(cfg, platform)
    out, expected_after = {}, None
    for tp, pp in LAYOUTS:
        learner = _learner(cfg, platform, tp, pp)
        module = learner.model[0].module
        where = dict(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=pp,
                     pp_rank=ps.get_pipeline_model_parallel_rank(), num_layers=cfg.num_layers,
                     tie_word_embeddings=cfg.tie_word_embeddings, vocab_size=cfg.vocab_size)
        adapters = adapter_parameters(module)
        own_init = shard_state_dict(initial, **where)
        result = {"init_diff": max((p - own_init[n]).abs().max().item() for n, p in adapters.items()),
                  "n_adapters": len(adapters)}
        local = shard_state_dict(start, **where)
        missing, unexpected = module.load_state_dict(local, strict=False)
        assert not unexpected and not [k for k in missing if not k.endswith("_extra_state")], (missing, unexpected)
        learner.optimizer.reload_model_params()  # the distributed optimizer keeps its own fp32 copy
        base_before = {n: p.detach().clone() for n, p in module.named_parameters() if n not in adapters}
        result["logprobs"] = learner.forward_logprobs(tokens)
        metrics = learner.train_step({"tokens": tokens}, _nll)
        result.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"], adapter_norm=metrics["adapter_norm"],
                      adapter_update_ratio=metrics["adapter_update_ratio"],
                      logprobs_after=learner.forward_logprobs(tokens))
        # What a LoRA run publishes after the step: PEFT tensors gathered over TP and PP, on global rank 0.
        result["published"] = dict(AdapterSource(module, cfg, LoraConfig(**LORA)))
        result["base_moved"] = [n for n, p in module.named_parameters() if n in base_before
                                and not torch.equal(p, base_before[n])]
        if expected_after is None:  # TP1 PP1: every rank holds the whole model
            expected_after = {k: v.detach().clone() for k, v in module.state_dict().items() if k in start}
        expected = shard_state_dict(expected_after, **where)
        result["max_adapter_diff"] = max((p - expected[n]).abs().max().item() for n, p in adapters.items())
        result["min_adapter_step"] = min((p - local[n]).abs().max().item() for n, p in adapters.items())
        learner.close()
        out[(tp, pp)] = result
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_equivalence, 2, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda l: f"tp{l[0]}pp{l[1]}")
def test_lora_step_matches_tp1(runs, layout):
    ref = runs[0][LAYOUTS[0]]
    assert ref["grad_norm"] > OPT["clip_grad"], "the step must actually clip"
    for rank, out in enumerate(runs):
        got = out[layout]
        torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        torch.testing.assert_close(got["logprobs_after"], ref["logprobs_after"], atol=1e-5, rtol=0)
        assert got["max_adapter_diff"] < 1e-5, f"rank {rank} layout {layout}: {got['max_adapter_diff']}"
        assert got["adapter_norm"] == pytest.approx(ref["adapter_norm"], rel=1e-5)
        assert got["adapter_update_ratio"] == pytest.approx(ref["adapter_update_ratio"], rel=1e-4)
    published, want = runs[0][layout]["published"], ref["published"]  # rank 0 sends; the others yield nothing
    assert sorted(published) == sorted(want) and len(want) > 0 and runs[1][layout]["published"] == {}
    for name, tensor in want.items():
        torch.testing.assert_close(published[name], tensor, atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}pp{l[1]}")
def test_adapters_start_alike_train_and_the_base_stays(runs, layout):
    for rank, out in enumerate(runs):
        got = out[layout]
        assert got["n_adapters"] > 0
        assert got["init_diff"] == 0.0, f"rank {rank} layout {layout}: initial adapters differ from TP1's shard"
        assert got["min_adapter_step"] > 1e-5  # the step moved every adapter tensor, A's too (B is not zero)
        assert got["base_moved"] == []
        assert not torch.equal(got["logprobs_after"], got["logprobs"])
