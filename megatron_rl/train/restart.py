"""The restart protocol's checks (issue #12): a shadow forward on resume and a canary first step.

    save_probe(learner, cfg, tmp_ckpt_dir)          # in every checkpoint: probe tokens + their logprobs
    shadow_forward(learner, ckpt, tolerance)        # on resume, after the weights are loaded
    check_canary(metrics)                           # after the first step of a resumed run

Order on resume (Checkpointer.resume, train/checkpointing.py): the learner first (weights,
optimizer, RNG), then the queue (the checkpoint's WAL snapshot; the coordinator replays it and
dedupes by trajectory id),
then the **shadow forward**: the learner's logprobs of a fixed probe batch, saved with the
checkpoint (PROBE_FILE, hashed into its COMMITTED manifest like every file), are recomputed from
the loaded weights; a difference beyond `run.shadow_tolerance` means the weights are not the ones
that were saved (e.g. altered and the manifest rewritten to match, or loaded into the wrong
layout), and the run refuses to continue.  Then the **canary**: the first step after a restart
runs at `run.canary_lr_scale` times the learning rate, and its loss and grad norm must be finite,
else the run stops (exit 88) without checkpointing, so a rerun resumes from the same checkpoint.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from megatron_rl.checkpoint import CheckpointError

logger = logging.getLogger(__name__)

PROBE_FILE = "probe_logprobs.pt"
PROBE_LEN = 16
EXIT_CANARY = 88


class CanaryFailed(RuntimeError):
    """The first step after a restart gave a nonfinite loss or grad norm."""


def probe_tokens(rows: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The fixed probe batch: [rows, PROBE_LEN] token ids drawn from a fixed generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (rows, PROBE_LEN), generator=gen)


def save_probe(learner, rows: int, vocab_size: int, ckpt_dir: Path) -> None:
    """Write the probe tokens and the learner's logprobs of them into a checkpoint being saved."""
    tokens_bt = probe_tokens(rows, vocab_size)
    logprobs_bt = learner.forward_logprobs(tokens_bt)  # [B, T-1]
    torch.save({"tokens": tokens_bt, "logprobs": logprobs_bt}, ckpt_dir / PROBE_FILE)


def shadow_forward(learner, ckpt: Path, tolerance: float) -> float | None:
    """Recompute the probe logprobs from the loaded weights; returns max |Δ| (None for a checkpoint
    saved without a probe).  Raises CheckpointError past `tolerance`."""
    path = Path(ckpt) / PROBE_FILE
    if not path.is_file():
        logger.warning("shadow forward skipped: %s has no %s (saved before probes were stored)", ckpt, PROBE_FILE)
        return None
    saved = torch.load(path, weights_only=True)
    now = learner.forward_logprobs(saved["tokens"])
    delta = float((now.float() - saved["logprobs"].float()).abs().max())
    if not delta <= tolerance:  # also NaN
        raise CheckpointError(
            f"shadow forward: the weights loaded from {ckpt} give logprobs on the probe batch that differ from the "
            f"ones saved with it by max |Δ| = {delta:.3g} > run.shadow_tolerance = {tolerance:g}: they are not "
            "the weights that were checkpointed; refusing to continue (move this checkpoint aside to resume "
            "from an older one)")
    logger.info("shadow forward on %s: max |Δ logprob| %.3g <= %g", ckpt, delta, tolerance)
    return delta


def check_canary(step: int, learn: dict) -> None:
    """Raise CanaryFailed unless the canary step's loss and grad norm are finite."""
    loss, grad_norm = float(learn.get("loss", float("nan"))), float(learn.get("grad_norm", float("nan")))
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise CanaryFailed(f"canary step {step} after the restart: loss {loss}, grad norm {grad_norm} "
                           "(not finite); stopped without checkpointing, the newest checkpoint is unchanged")
    logger.info("canary step %d after the restart: loss %.4g, grad norm %.4g: continuing at full speed",
                step, loss, grad_norm)
