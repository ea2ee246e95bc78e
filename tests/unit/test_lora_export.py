"""The learner's LoRA adapters in PEFT's names and layout (megatron_rl/conversion/lora_export.py).

    python -m pytest tests/unit/test_lora_export.py -q

Pure tensor tests on a tiny GQA Qwen2 config (q/k/v bias, 4 query heads in 2 KV groups): every HF
module of each target gets an A and a B of its own shape; the fused qkv and fc1 adapters, once split,
add to each HF weight exactly the rows of (alpha / r) B A that the fused Megatron weight gets; bad
input is refused by name.  With PEFT installed (the `test` extra), a random transformers Qwen2 with the
exported adapter directory loaded by PeftModel gives the logits of the same model with the adapters
merged into its weights (merge_into_hf), and the logits differ from the base's.
"""

import json

import pytest
import torch

from megatron_rl.conversion import mapping
from megatron_rl.conversion.lora_export import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, merge_into_hf, peft_config,
                                                peft_tensors, write_peft_dir)
from megatron_rl.models.hf_config import load_hf_config
from megatron_rl.models.lora import LoraConfig

QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 97, "hidden_size": 32,
         "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "torch_dtype": "float32"}
LORA = LoraConfig(enabled=True, rank=4, alpha=8.0)
_LINEARS = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
            "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}


def _mcore_adapters(cfg, lora=LORA, seed=0, prefix=""):
    """Random TP1 adapters (B not zero) under canonical names, shaped from the fused Megatron weights."""
    gen = torch.Generator().manual_seed(seed)
    shapes = mapping.mcore_shapes(cfg, padded_vocab=cfg.vocab_size)
    out = {}
    for i in range(cfg.num_layers):
        for target in lora.target_modules:
            name = f"decoder.layers.{i}.{_LINEARS[target]}"
            rows, cols = shapes[f"{name}.weight"]
            out[f"{prefix}{name}.adapter.lora_a"] = torch.randn(lora.rank, cols, generator=gen)
            out[f"{prefix}{name}.adapter.lora_b"] = torch.randn(rows, lora.rank, generator=gen)
    return out


@pytest.fixture(scope="module")
def cfg():
    return load_hf_config(QWEN2)


def test_every_hf_module_gets_its_own_shaped_pair(cfg):
    tensors = peft_tensors(_mcore_adapters(cfg), LORA, cfg)
    shapes = mapping.hf_shapes(cfg)
    modules = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    expected = {f"base_model.model.model.layers.{i}.{m}.lora_{ab}.weight"
                for i in range(cfg.num_layers) for m in modules for ab in "AB"}
    assert set(tensors) == expected
    for i in range(cfg.num_layers):
        for m in modules:
            out_f, in_f = shapes[f"model.layers.{i}.{m}.weight"]
            stem = f"base_model.model.model.layers.{i}.{m}"
            assert tuple(tensors[f"{stem}.lora_A.weight"].shape) == (LORA.rank, in_f)
            assert tuple(tensors[f"{stem}.lora_B.weight"].shape) == (out_f, LORA.rank)


def test_split_adapters_add_what_the_fused_adapter_adds(cfg):
    """(s B A) of the fused Megatron layer, split like its weight, is each HF module's merged delta."""
    adapters = _mcore_adapters(cfg, prefix="module.")  # a DDP wrapper's prefix is ignored
    tensors = peft_tensors(adapters, LORA, cfg)
    for i in range(cfg.num_layers):
        for target, linear in _LINEARS.items():
            a = adapters[f"module.decoder.layers.{i}.{linear}.adapter.lora_a"]
            b = adapters[f"module.decoder.layers.{i}.{linear}.adapter.lora_b"]
            fused_delta = {f"decoder.layers.{i}.{linear}.weight": LORA.scaling * (b @ a)}
            group = dict(mapping.mcore_to_hf_group(cfg, f"layer.{i}", _with_other_layer_tensors(cfg, i, fused_delta)))
            for hf_name in _hf_names_of(cfg, i, linear):
                merged = merge_into_hf(hf_name, torch.zeros_like(group[hf_name]), tensors, LORA)
                torch.testing.assert_close(merged, group[hf_name], rtol=1e-5, atol=1e-5)


def _hf_names_of(cfg, layer, linear):
    return next(e.hf for e in mapping.name_table(cfg) if e.mcore == f"decoder.layers.{layer}.{linear}.weight")


def _with_other_layer_tensors(cfg, layer, given):
    """A whole layer group for mcore_to_hf_group: `given`, and zeros for the rest."""
    shapes = mapping.mcore_shapes(cfg, padded_vocab=cfg.vocab_size)
    return {e.mcore: given.get(e.mcore, torch.zeros(shapes[e.mcore])) for e in mapping.name_table(cfg)
            if e.group == f"layer.{layer}"}


def test_unadapted_weights_pass_through_and_merge_keeps_dtype(cfg):
    proj_only = LoraConfig(enabled=True, rank=2, target_modules=["proj"])
    tensors = peft_tensors(_mcore_adapters(cfg, lora=proj_only), proj_only, cfg)
    w = torch.ones(cfg.hidden_size, cfg.hidden_size, dtype=torch.bfloat16)
    assert merge_into_hf("model.layers.0.self_attn.q_proj.weight", w, tensors, LORA) is w
    merged = merge_into_hf("model.layers.0.self_attn.o_proj.weight", w, tensors, LORA)
    assert merged.dtype == torch.bfloat16 and not torch.equal(merged, w)


@pytest.mark.parametrize("change, words", [
    (lambda a: a.pop("decoder.layers.1.mlp.linear_fc2.adapter.lora_b"), "layer 1 fc2: the adapter's lora_b is missing"),
    (lambda a: a.__setitem__("decoder.layers.0.mlp.linear_fc2.adapter.lora_a", torch.zeros(3, 48)),
     "for learner.lora.rank 4"),
    (lambda a: a.__setitem__("decoder.layers.0.mlp.linear_fc2.adapter.lora_a", torch.zeros(4, 40)),
     "do not fit model.layers.0.mlp.down_proj.weight"),
    (lambda a: a.__setitem__("decoder.layers.5.mlp.linear_fc2.adapter.lora_a", torch.zeros(4, 48)),
     "layer 5 is past the model's 2 layers"),
    (lambda a: a.__setitem__("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(4, 48)),
     "is not a LoRA adapter tensor name"),
])
def test_bad_adapters_are_refused_by_name(cfg, change, words):
    adapters = _mcore_adapters(cfg)
    change(adapters)
    with pytest.raises(ValueError, match=words):
        peft_tensors(adapters, LORA, cfg)


def test_adapter_config_says_what_peft_needs():
    config = peft_config(LoraConfig(enabled=True, rank=8, alpha=16, target_modules=["qkv", "fc2"]), "org/base")
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["base_model_name_or_path"] == "org/base"
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"]
    assert not config["use_rslora"]  # PEFT's scale is then lora_alpha / r, the learner's


def _random_hf_model(seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in QWEN2.items() if k != "architectures"})
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_peft_loads_the_export_and_computes_the_merged_model(cfg, tmp_path):
    peft = pytest.importorskip("peft")
    lora = LoraConfig(enabled=True, rank=4, alpha=6.0)
    tensors = peft_tensors({k: v * 0.1 for k, v in _mcore_adapters(cfg, lora, seed=3).items()}, lora, cfg)
    base = _random_hf_model(0)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    write_peft_dir(tmp_path / "adapter", tensors, peft_config(lora, "random-qwen2"))
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["r"] == 4
    assert (tmp_path / "adapter" / ADAPTER_WEIGHTS).is_file()
    tokens = torch.randint(0, QWEN2["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base_logits = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        peft_logits = adapted(tokens).logits
        merged = _random_hf_model(0)
        merged.load_state_dict({k: merge_into_hf(k, v, tensors, lora) for k, v in base_state.items()})
        merged_logits = merged(tokens).logits
    assert (peft_logits - base_logits).abs().max() > 1e-2  # the adapters were applied
    torch.testing.assert_close(peft_logits, merged_logits, atol=1e-4, rtol=0)
