"""Check a conversion numerically: the same tokens through transformers and through Megatron.

    megatron-rl convert verify --hf MODEL_DIR --mcore MCORE_DIR --tp 2 --pp 1
    # {"max_abs_diff": 2.3e-06, "mean_abs_diff": 3.1e-07, "tp": 2, "pp": 1, ..., "tolerance": 0.001, "ok": true}
    # exit 1 when max_abs_diff exceeds the tolerance: --tolerance, else DEFAULT_TOLERANCE by the
    # stored dtype (fp32 1e-3, bf16 1.0, fp16 0.25; see below for why)

    from megatron_rl.conversion.verify import verify_conversion
    report = verify_conversion(hf_dir, mcore_dir, tp=1, pp=2)

The Megatron model is built at the requested TP x PP (gloo ranks on CPU), loads the
distributed checkpoint, and runs one forward pass with hidden states handed between pipeline
stages by point-to-point sends.  Logits are compared over the real (unpadded) vocabulary.
Shapes: tokens [B, T]; hidden between stages [T, B, H]; logits [B, T, V].
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megatron_rl.conversion.model_io import HF_DIR, WEIGHTS_DIR, load_model, read_manifest, run_on_ranks
from megatron_rl.config import ConfigError

logger = logging.getLogger(__name__)

# Default pass bound on max |Δlogit|, by the dtype the Megatron checkpoint stores.  Measured on
# the tiny Llama (random tokens, 2 x 16): fp32 conversions differ by ~4e-6 (summation order only),
# bf16 by ~0.06 (mean 0.01), while two unrelated models differ by ~5.5-6 (argmax agreement ~0).
# The bounds leave >100x margin for fp32 and ~15x for bf16 (larger models have larger logits and
# longer sums) yet stay far below what a wrong mapping or another model gives.  fp16 keeps 3 more
# mantissa bits than bf16, hence a tighter bound.
DEFAULT_TOLERANCE = {"fp32": 1e-3, "bf16": 1.0, "fp16": 0.25}


def default_tolerance(mcore_dir: str | Path) -> float:
    """DEFAULT_TOLERANCE for the dtype recorded in a converted directory's manifest."""
    dtype = read_manifest(mcore_dir).get("dtype", "fp32")
    if dtype not in DEFAULT_TOLERANCE:
        raise ConfigError(f"{mcore_dir}: manifest dtype {dtype!r} has no default tolerance; pass --tolerance")
    return DEFAULT_TOLERANCE[dtype]


def sample_tokens(vocab_size: int, batch: int = 2, seq_len: int = 16, seed: int = 0) -> torch.Tensor:
    """Deterministic random token ids [B, T] below `vocab_size`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g)


@torch.no_grad()
def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' fp32 logits [B, T, V] for `tokens` [B, T]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    return model(input_ids=tokens).logits.float()


@torch.no_grad()
def _forward_rank(rank: int, world_size: int, mcore_dir: str, tokens: torch.Tensor, layouts: list) -> dict:
    """Run `tokens` [B, T] through the checkpoint at each (tp, pp[, ep]) layout, one after another.

    Returns {layout: logits [B, T, V]} on the rank that is last stage, TP rank 0 and DP
    rank 0 of a layout; nothing for that layout elsewhere.  Every DP rank runs the same tokens
    (with EP > 1 the expert-parallel ranks exchange them in the MoE layers).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    root = Path(mcore_dir)
    manifest = read_manifest(root)
    cfg = load_hf_config(root / HF_DIR)
    platform = detect_platform("cpu", manifest["dtype"])
    B, T = tokens.shape
    out_by_layout = {}
    for layout in layouts:
        tp, pp, ep = (tuple(layout) + (1,))[:3]
        with parallel_scope(tp=tp, pp=pp, ep=ep):
            model = build_gpt_model(cfg, platform=platform, tp=tp, pp=pp, parallel_output=False,
                                    perform_initialization=False)
            load_model(model, root / WEIGHTS_DIR)
            model.eval()
            position_ids = torch.arange(T).unsqueeze(0).expand(B, T)  # [B, T]
            if not ps.is_pipeline_first_stage():
                hidden = torch.empty(T, B, cfg.hidden_size, dtype=platform.dtype)  # [T, B, H]
                dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            out = model(tokens, position_ids, attention_mask=None)
            if not ps.is_pipeline_last_stage():
                dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            elif ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                out_by_layout[tuple(layout)] = out[..., : cfg.vocab_size].float()  # [B, T, V]
            del model
    return out_by_layout


def mcore_logits(mcore_dir: str | Path, tokens: torch.Tensor, layouts=((1, 1),)) -> dict:
    """Megatron's logits {layout: [B, T, V]} for `tokens` [B, T], the checkpoint loaded at each layout.

    A layout is (tp, pp) or (tp, pp, ep) (ep: MoE expert parallel, within data parallel).  All
    layouts run in one launch of max(tp * pp * ep) ranks (smaller layouts run data-parallel).
    """
    from megatron_rl.models.hf_config import check_parallel_layout, load_hf_config

    root = Path(mcore_dir)
    read_manifest(root)
    cfg = load_hf_config(root / HF_DIR)
    layouts = [tuple(x) for x in layouts]
    full = [(tuple(x) + (1,))[:3] for x in layouts]
    world = max(tp * pp * ep for tp, pp, ep in full)
    for tp, pp, ep in full:
        if world % (tp * pp * ep):
            raise ValueError(f"layout TP{tp} PP{pp} EP{ep} does not divide the {world} ranks of this batch of layouts")
        check_parallel_layout(cfg, tp, pp, dp=world // (tp * pp), ep=ep)
    merged: dict = {}
    for result in run_on_ranks(_forward_rank, world, str(root), tokens, layouts):
        merged.update(result)
    return merged


def verify_conversion(hf_dir: str | Path, mcore_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                      tokens: torch.Tensor | None = None, seed: int = 0, batch: int = 2, seq_len: int = 16,
                      tolerance: float | None = None) -> dict:
    """Max and mean absolute logit difference between transformers and Megatron.

    report["ok"] is max_abs_diff <= tolerance (default: DEFAULT_TOLERANCE for the stored dtype).
    """
    from megatron_rl.models.hf_config import load_hf_config

    if tolerance is None:
        tolerance = default_tolerance(mcore_dir)
    cfg = load_hf_config(hf_dir)
    if tokens is None:
        tokens = sample_tokens(cfg.vocab_size, batch, seq_len, seed)
    ref = hf_logits(hf_dir, tokens)
    got = mcore_logits(mcore_dir, tokens, [(tp, pp, ep)])[(tp, pp, ep)]
    if got.shape != ref.shape:
        raise ValueError(f"logit shapes differ: transformers {tuple(ref.shape)}, Megatron {tuple(got.shape)}")
    diff = (got - ref).abs()
    report = {"max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(), "tp": tp, "pp": pp, "ep": ep,
              "batch": tokens.shape[0], "seq_len": tokens.shape[1],
              "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    report.update(tolerance=tolerance, ok=bool(report["max_abs_diff"] <= tolerance))
    logger.info("verify %s vs %s: %s", hf_dir, mcore_dir, report)
    return report
