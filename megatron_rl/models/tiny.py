"""Make small random Hugging Face checkpoints locally, with no network.

    megatron-rl make-tiny-model --arch llama --out /tmp/tiny
    megatron-rl make-tiny-model --arch qwen2 --size medium --out /tmp/medium --seed 3
    megatron-rl make-tiny-model --arch llama3 --out /tmp/l3     # Llama-3.x rope scaling
    megatron-rl make-tiny-model --arch qwen3 --out /tmp/q3      # QK-norm, head_dim 2x hidden/heads
    megatron-rl make-tiny-model --arch qwen3_moe --out /tmp/qm  # Qwen3-MoE: 8 experts, top-2, norm_topk_prob

    from megatron_rl.models.tiny import make_tiny_model
    path = make_tiny_model(tmp_path / "m", arch="qwen2", size="tiny", seed=0)

The directory holds exactly what `AutoModelForCausalLM`, `AutoTokenizer` and vLLM load:
config.json (LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM; qwen2 has QKV bias; qwen3
has q/k RMSNorm and a head_dim twice hidden/heads; llama3 is a Llama with `rope_type: llama3`
whose original_max_position_embeddings is small (64) so that the scaling changes most rotary
frequencies of a tiny model; qwen3_moe is a Qwen3 whose MLPs are 8 experts of width ffn/4 (rounded up to 128) with
a top-2 router (norm_topk_prob, as Qwen3-30B-A3B); tiny experts are 128 wide; GQA; rope_theta),
model.safetensors (random init built by transformers' own classes, deterministic by seed),
generation_config.json and a character-level tokenizer (see `megatron_rl.models.tokenizer`).

Vocabulary: the tokenizer has ~100 tokens (printable ASCII + specials).  The model's
embedding is padded to `vocab_size` rows (default 128, a multiple of 64 as Megatron pads);
rows past the tokenizer are never produced by it.  The bigger presets grow in width and
depth only, so their parameter counts come from the transformer blocks, not the embedding.
Pass `vocab_size` / `--vocab-size` for a wider embedding.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.models.tokenizer import build_tokenizer
from megatron_rl.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["SIZES", "ARCHS", "make_tiny_model"]

ARCHS = ("llama", "qwen2", "llama3", "qwen3", "qwen3_moe")
# Qwen3-MoE tiny shape: experts per layer, experts per token; expert width is ffn // MOE_FFN_DIVISOR rounded
# up to a multiple of MOE_FFN_ALIGN: vLLM's CPU MoE kernel pads narrower experts (88 -> 96), and its
# layerwise weight reload (publication) then refuses the checkpoint-shaped tensors.
MOE_EXPERTS, MOE_TOP_K, MOE_FFN_DIVISOR, MOE_FFN_ALIGN = 8, 2, 4, 128
# Llama-3.1's rope scaling, except original_max_position_embeddings: 8192 would leave a tiny
# model's short-wavelength frequencies untouched; 64 puts its rotary dims in all three bands.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
DEFAULT_VOCAB_SIZE = 128


@dataclass(frozen=True)
class SizePreset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_positions: int


# Head dim is hidden/heads (qwen3: twice that); vLLM's CPU attention needs it in {32, 64, 80, 96, 128, ...}.
SIZES = {
    "tiny": SizePreset(hidden=128, layers=2, heads=4, kv_heads=2, ffn=352, max_positions=1024),  # ~0.4M
    # twice tiny's width and depth: a CPU testbed's policy that can learn a multi-step task (~2.9M)
    "mini": SizePreset(hidden=256, layers=4, heads=4, kv_heads=2, ffn=704, max_positions=1024),
    "small": SizePreset(hidden=512, layers=8, heads=8, kv_heads=4, ffn=1408, max_positions=2048),  # ~24M
    "medium": SizePreset(hidden=1024, layers=24, heads=16, kv_heads=8, ffn=2816, max_positions=2048),  # ~283M
    # medium's width at half its depth: ~142M llama, ~302M qwen3_moe (the MoE conversion benchmark's size).
    "medium_half": SizePreset(hidden=1024, layers=12, heads=16, kv_heads=8, ffn=2816, max_positions=2048),
}


def build_config(arch: str, size: str, *, tie_embeddings: bool = False, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The transformers config object for (arch, size); ids match the char tokenizer."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch not in ARCHS:
        raise ConfigError(f"arch {arch!r} is not one of {list(ARCHS)}")
    if size not in SIZES:
        raise ConfigError(f"size {size!r} is not one of {list(SIZES)}")
    tok_len = len(build_tokenizer())
    if vocab_size < tok_len:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok_len} tokens")
    p = SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=p.hidden,
        intermediate_size=p.ffn,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.hidden // p.heads,
        max_position_embeddings=p.max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        # Wider than HF's 0.02 so the random model's next-token distributions are not flat.
        initializer_range=0.1,
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(attention_bias=False, **common)
    if arch == "llama3":
        rope = dict(LLAMA3_ROPE, rope_theta=common.pop("rope_theta"))
        return LlamaConfig(attention_bias=False, rope_parameters=rope, **common)
    if arch == "qwen3":
        # head_dim independent of hidden/heads, as in Qwen3-0.6B (1024 hidden, 16 heads, head_dim 128).
        common["head_dim"] = 2 * p.hidden // p.heads
        return Qwen3Config(attention_bias=False, use_sliding_window=False, **common)
    if arch == "qwen3_moe":
        common["head_dim"] = 2 * p.hidden // p.heads
        return Qwen3MoeConfig(attention_bias=False, use_sliding_window=False, num_experts=MOE_EXPERTS,
                              num_experts_per_tok=MOE_TOP_K,
                              moe_intermediate_size=-(-p.ffn // MOE_FFN_DIVISOR // MOE_FFN_ALIGN) * MOE_FFN_ALIGN,
                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              router_aux_loss_coef=0.001, **common)
    # Qwen2 always has a bias on q/k/v projections (not on o_proj).
    return Qwen2Config(use_sliding_window=False, **common)


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    tie_embeddings: bool = False,
    force: bool = False,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Path:
    """Write a random HF checkpoint + char tokenizer to `out_dir`; returns the path.

    Refuses an existing non-empty `out_dir` unless `force`.  Files are written to a
    temporary sibling directory and renamed into place, so a crash leaves no half model.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"output directory {out} exists and is not empty (use --force to replace it)")
    config = build_config(arch, size, tie_embeddings=tie_embeddings, vocab_size=vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0, do_sample=True).save_pretrained(tmp)
        build_tokenizer().save_pretrained(tmp)
        _write_special_tokens_map(tmp)
        n_params = sum(t.numel() for t in model.parameters())
        tmp.chmod(0o755)  # mkdtemp makes it private; a checkpoint is shared read-only
        for f in tmp.iterdir():
            f.chmod(0o644)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote %s %s model (%.2fM params, seed %d) to %s", arch, size, n_params / 1e6, seed, out)
    return out


def _write_special_tokens_map(path: Path) -> None:
    """transformers 5 no longer writes special_tokens_map.json; older loaders still read it."""
    import json

    target = path / "special_tokens_map.json"
    if not target.exists():
        target.write_text(json.dumps({"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2))
