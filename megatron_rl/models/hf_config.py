"""Read a HuggingFace config.json (Llama / Llama-3.x / Qwen2 / Qwen3 / Qwen3-MoE) into the few numbers the learner needs.

    cfg = load_hf_config("path/to/model_dir")        # or the config.json path, or a dict
    cfg.num_kv_heads, cfg.head_dim, cfg.qkv_bias      # GQA layout, Qwen2's q/k/v bias
    cfg.qk_layernorm, cfg.rope_scaling                # Qwen3's q/k RMSNorm, Llama-3.x rope scaling
    cfg.moe                                           # Qwen3-MoE: experts, top-k, expert FFN, norm_topk_prob
    padded_vocab_size(cfg.vocab_size, tp=2)          # Megatron pads the embedding table
    check_parallel_layout(cfg, tp=2, pp=2, ep=2)     # ValueError naming what does not divide

Anything the Megatron builder does not implement (rope types other than plain and `llama3`,
sliding windows, biases other than Qwen2's q/k/v, activations other than SiLU) is refused here
with the field named, rather than built into a model whose logits silently differ from the
checkpoint's.  Qwen3-MoE is accepted when every layer is sparse (`decoder_sparse_step` 1, no
`mlp_only_layers`) and has no shared expert; anything else is refused by field.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe"}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.x frequency-dependent RoPE scaling (`rope_type: llama3`), as transformers defines it.

    Frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor are
    divided by `factor`; those shorter than .../high_freq_factor are kept; the band between is
    interpolated smoothly.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Qwen3-MoE's sparse MLP: every layer routes each token to `top_k` of `num_experts` SwiGLU experts.

    Router (HF `Qwen3MoeTopKRouter`): p = softmax(W_gate h) over all experts, keep the top_k; with
    norm_topk_prob the kept probabilities are divided by their sum (= a softmax over the top_k logits).
    """

    num_experts: int
    top_k: int
    """num_experts_per_tok."""
    ffn_hidden_size: int
    """moe_intermediate_size: each expert's SwiGLU width."""
    norm_topk_prob: bool
    router_aux_loss_coef: float


@dataclasses.dataclass(frozen=True)
class HFModelConfig:
    """The architecture of a Llama-family decoder, as read from config.json."""

    arch: str
    """"llama" or "qwen2"."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads (GQA); equals num_heads for plain multi-head attention."""
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on the q/k/v projections (Qwen2); no other linear layer has a bias."""
    max_position_embeddings: int
    torch_dtype: str
    """dtype the checkpoint was saved in ("float32", "bfloat16", ...)."""
    qk_layernorm: bool = False
    """RMSNorm over head_dim on each query and key head before RoPE (Qwen3)."""
    rope_scaling: Llama3RopeScaling | None = None
    """Llama-3.x rope scaling; None for plain RoPE."""
    moe: MoEConfig | None = None
    """Qwen3-MoE's experts and router; None for a dense MLP."""
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """The config.json contents, untouched."""


def _read(source: str | Path | dict) -> tuple[dict, str]:
    if isinstance(source, dict):
        return source, "<dict>"
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"HF config not found: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a JSON object, got {type(data).__name__}")
    return data, str(path)


def _arch(data: dict, where: str) -> str:
    archs = data.get("architectures")
    if archs:
        if len(archs) != 1 or archs[0] not in ARCHITECTURES:
            raise ConfigError(f"{where}: unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")
        return ARCHITECTURES[archs[0]]
    model_type = data.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"{where}: unsupported model_type {model_type!r} (no 'architectures'); supported: {sorted(MODEL_TYPES)}")
    return MODEL_TYPES[model_type]


def _rope(data: dict, where: str) -> tuple[float, Llama3RopeScaling | None]:
    """(rope_theta, llama3 scaling or None) from transformers 5 `rope_parameters` or the older fields."""
    params = data.get("rope_parameters")
    if params is None:
        params = dict(data.get("rope_scaling") or {})
        params.setdefault("rope_theta", data.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters must be an object, got {type(params).__name__}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope scaling {rope_type!r} is not implemented (supported rope_type: {list(ROPE_TYPES)})")
    theta = float(params.get("rope_theta", data.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    values = {}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{where}: rope_scaling.{key} must be a positive number for rope_type 'llama3', got {value!r}")
        values[key] = value
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ConfigError(f"{where}: rope_scaling.high_freq_factor {values['high_freq_factor']} must exceed "
                         f"low_freq_factor {values['low_freq_factor']}")
    return theta, Llama3RopeScaling(factor=float(values["factor"]), low_freq_factor=float(values["low_freq_factor"]),
                                    high_freq_factor=float(values["high_freq_factor"]),
                                    original_max_position_embeddings=int(values["original_max_position_embeddings"]))


def _moe(data: dict, where: str) -> MoEConfig:
    """Qwen3-MoE's expert fields; refuses dense layers mixed in and shared experts (not built)."""
    if "num_experts" not in data and "num_local_experts" in data:
        data = dict(data, num_experts=data["num_local_experts"])
    experts = _need(data, "num_experts", where)
    top_k = _need(data, "num_experts_per_tok", where)
    if top_k > experts:
        raise ConfigError(f"{where}: num_experts_per_tok {top_k} exceeds num_experts {experts}")
    if data.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"{where}: decoder_sparse_step {data['decoder_sparse_step']!r} is not supported "
                          "(only 1: every layer is a MoE layer)")
    if data.get("mlp_only_layers"):
        raise ConfigError(f"{where}: mlp_only_layers {data['mlp_only_layers']!r} is not supported (dense layers "
                          "between MoE layers are not built)")
    if data.get("shared_expert_intermediate_size"):
        raise ConfigError(f"{where}: shared_expert_intermediate_size is not supported (no shared expert)")
    return MoEConfig(num_experts=experts, top_k=top_k, ffn_hidden_size=_need(data, "moe_intermediate_size", where),
                     norm_topk_prob=bool(data.get("norm_topk_prob", False)),
                     router_aux_loss_coef=float(data.get("router_aux_loss_coef", 0.0)))


def _need(data: dict, key: str, where: str) -> Any:
    if data.get(key) is None:
        raise ConfigError(f"{where}: missing field {key!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return value


def load_hf_config(source: str | Path | dict) -> HFModelConfig:
    """Parse a model directory, a config.json path, or an already-loaded dict."""
    data, where = _read(source)
    arch = _arch(data, where)
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported (only 'silu' / SwiGLU)")
    if data.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported")
    if arch in ("llama", "qwen3", "qwen3_moe") and data.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true is not supported for {arch} (o_proj bias)")
    if data.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported")
    hidden = _need(data, "hidden_size", where)
    heads = _need(data, "num_attention_heads", where)
    kv_heads = data.get("num_key_value_heads") or heads
    head_dim = data.get("head_dim") or hidden // heads
    if data.get("head_dim") is None and hidden % heads:
        raise ConfigError(f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    if heads % kv_heads:
        raise ConfigError(f"{where}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")
    rope_theta, rope_scaling = _rope(data, where)
    return HFModelConfig(
        arch=arch,
        vocab_size=_need(data, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=(_need(data, "intermediate_size", where) if arch != "qwen3_moe"
                           else int(data.get("intermediate_size") or 0)),
        num_layers=_need(data, "num_hidden_layers", where),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rope_theta=rope_theta,
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2",
        max_position_embeddings=int(data.get("max_position_embeddings", 2048)),
        torch_dtype=str(data.get("torch_dtype") or data.get("dtype") or "float32"),
        qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        rope_scaling=rope_scaling,
        moe=_moe(data, where) if arch == "qwen3_moe" else None,
        raw=data,
    )


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Round vocab_size up to a multiple of multiple*tp (Megatron's make_vocab_size_divisible_by)."""
    if vocab_size < 1 or tp < 1 or multiple < 1:
        raise ConfigError(f"vocab_size, tp and multiple must be positive, got {vocab_size}, {tp}, {multiple}")
    step = multiple * tp
    return -(-vocab_size // step) * step


def check_parallel_layout(cfg: HFModelConfig, tp: int, pp: int, dp: int = 1, ep: int = 1) -> None:
    """Raise ValueError naming the number that a TP/PP/DP/EP layout does not divide.

    EP (expert parallel) splits a MoE model's experts over `ep` ranks of the data-parallel dimension
    (so dp must be a multiple of ep); a dense model accepts only ep 1.
    """
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if cfg.num_heads % tp:
        raise ConfigError(f"num_heads {cfg.num_heads} is not divisible by tensor parallel size {tp}")
    if cfg.num_kv_heads % tp:
        raise ConfigError(f"num_kv_heads {cfg.num_kv_heads} is not divisible by tensor parallel size {tp}")
    if cfg.moe is None and cfg.intermediate_size % tp:
        raise ConfigError(f"intermediate_size {cfg.intermediate_size} is not divisible by tensor parallel size {tp}")
    if cfg.moe is None and ep != 1:
        raise ConfigError(f"expert parallel size {ep} needs a MoE model; {cfg.arch} is dense (use ep 1)")
    if cfg.moe is not None:
        if cfg.moe.num_experts % ep:
            raise ConfigError(f"num_experts {cfg.moe.num_experts} is not divisible by expert parallel size {ep}")
        if cfg.moe.ffn_hidden_size % tp:
            raise ConfigError(f"moe_intermediate_size {cfg.moe.ffn_hidden_size} is not divisible by tensor parallel size {tp}")
        if dp % ep:
            raise ConfigError(f"data parallel size {dp} is not a multiple of expert parallel size {ep}")
    if cfg.num_layers % pp:
        raise ConfigError(f"num_layers {cfg.num_layers} is not divisible by pipeline parallel size {pp}")
