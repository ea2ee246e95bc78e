"""A LoRA checkpoint resumes only on its own base and with its own adapters (models/lora_checkpoint.py).

    python -m pytest tests/unit/test_lora_checkpoint.py -q

Pure file tests (no Megatron): the base digest follows the base's weight bytes; a committed checkpoint
recording one base's digest is refused by train/resume.py check_lora (which open_run_dir runs before
anything starts) for a run on another base, with both digests and the model directory in the message,
and accepted on its own; a full-parameter checkpoint is refused by a LoRA run and the reverse; other
adapter settings are refused by field.  (tests/dist/test_lora_parallel_equivalence.py saves and resumes
real adapters.)
"""

import types

import pytest
import torch
from safetensors.torch import save_file

from megatron_rl.checkpoint import CheckpointError, save_checkpoint
from megatron_rl.config import ConfigError
from megatron_rl.models.lora import LoraConfig
from megatron_rl.conversion.lora_io import base_digest
from megatron_rl.models.lora_checkpoint import BASE_DIGEST, check_adapter_record, write_adapter_record
from megatron_rl.train.resume import check_lora

CONFIG = ('{"architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16, '
          '"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, '
          '"max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}')


def _base(path, bump=0.0):
    from megatron_rl.conversion import mapping
    from megatron_rl.models.hf_config import load_hf_config

    path.mkdir()
    (path / "config.json").write_text(CONFIG)
    shapes = mapping.hf_shapes(load_hf_config(path))
    gen = torch.Generator().manual_seed(0)
    save_file({n: torch.randn(s, generator=gen) + bump for n, s in shapes.items()}, str(path / "model.safetensors"))
    return path


def _cfg(lora):
    return types.SimpleNamespace(learner=types.SimpleNamespace(lora=lora))


@pytest.fixture
def lora_run(tmp_path):
    base, other = _base(tmp_path / "base"), _base(tmp_path / "other", bump=1e-3)
    run_dir = tmp_path / "run"
    lora = LoraConfig(enabled=True, rank=4)
    digest = check_lora(None, _cfg(lora), base)

    def save_fn(tmp):
        (tmp / "weights").mkdir()
        write_adapter_record(tmp / "weights", lora)

    ckpt = save_checkpoint(run_dir / "checkpoints", 3, policy_version=3, config_hash="c", save_fn=save_fn,
                           extra={BASE_DIGEST: digest})
    return types.SimpleNamespace(base=base, other=other, ckpt=ckpt, lora=lora, digest=digest)


def test_digest_follows_the_base_weights(lora_run):
    assert lora_run.digest.startswith("blake3:") and lora_run.digest == base_digest(lora_run.base)
    assert base_digest(lora_run.other) != lora_run.digest
    assert check_lora(None, _cfg(LoraConfig(enabled=False)), lora_run.base) is None


def test_resume_on_another_base_is_refused_naming_both(lora_run):
    cfg = _cfg(lora_run.lora)
    with pytest.raises(CheckpointError) as err:
        check_lora(lora_run.ckpt, cfg, lora_run.other)
    for words in ("step_000003", lora_run.digest, base_digest(lora_run.other), str(lora_run.other), "LoRA adapters"):
        assert words in str(err.value)
    assert check_lora(lora_run.ckpt, cfg, lora_run.base) == lora_run.digest


def test_a_full_parameter_checkpoint_is_refused_by_a_lora_resume(tmp_path, lora_run):
    full = save_checkpoint(tmp_path / "full" / "checkpoints", 1, policy_version=1, config_hash="c",
                           save_fn=lambda tmp: (tmp / "weights").mkdir())
    with pytest.raises(CheckpointError, match="records no LoRA base digest"):
        check_lora(full, _cfg(lora_run.lora), lora_run.base)
    with pytest.raises(ConfigError, match="a full-parameter checkpoint"):
        check_adapter_record(full / "weights", lora_run.lora)
    assert check_lora(full, _cfg(LoraConfig(enabled=False)), lora_run.base) is None  # full on full: fine


@pytest.mark.parametrize("lora, words", [
    (LoraConfig(enabled=False), "holds LoRA adapters only"),
    (LoraConfig(enabled=True, rank=8), "learner.lora.rank 4, this run has 8"),
    (LoraConfig(enabled=True, rank=4, target_modules=["qkv"]), "learner.lora.target_modules"),
])
def test_adapters_load_only_into_a_learner_with_their_settings(lora_run, lora, words):
    weights = lora_run.ckpt / "weights"
    check_adapter_record(weights, lora_run.lora)
    with pytest.raises(ConfigError, match=words):
        check_adapter_record(weights, lora)


def test_other_adapter_settings_or_none_are_refused_by_the_resume_check(lora_run):
    with pytest.raises(ConfigError, match="learner.lora.rank 4, this run has 8"):
        check_lora(lora_run.ckpt, _cfg(LoraConfig(enabled=True, rank=8)), lora_run.base)
    with pytest.raises(ConfigError, match="holds LoRA adapters only"):
        check_lora(lora_run.ckpt, _cfg(LoraConfig(enabled=False)), lora_run.base)
