"""The GRPO step's metrics and the lag guard: from the summed statistics of grpo_loss (over every
micro-batch and data-parallel rank) to batch-wide metrics and the weight of the step's gradient.

    loss, stats = grpo_loss(...)                 # per micro-batch (megatron_rl/grpo/loss.py)
    metrics = grpo_metrics(summed_stats, cfg)    # {"pg_loss", "clip_fraction", "d_lag", "d_lag/p95", ...}
    weight, metrics = grpo_step_weight(summed_stats, cfg)   # the learner's hook before the optimizer step

D_lag = (1/N) Σ_i Σ_t m_it |log π_θ - log μ| (the learner-to-behavior lag, see loss.py's
docstring).  Over `cfg.lag_threshold` the step is quarantined (weight 0: no optimizer step) or
its gradient is scaled by threshold / D_lag (`cfg.lag_action`).
"""

from __future__ import annotations

import logging
from typing import Mapping

import torch

from megatron_rl.grpo.loss import GRPOLossConfig, kl_metric_name
from megatron_rl.metrics import percentiles

logger = logging.getLogger(__name__)


def _scalar(value) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _vector(value) -> list[float]:
    if isinstance(value, torch.Tensor):
        return value.detach().double().flatten().tolist()
    return [float(v) for v in value]


def grpo_metrics(stats: Mapping, cfg: GRPOLossConfig) -> dict[str, float]:
    """Batch-wide metrics from the SUMMED statistics of grpo_loss (tensors, floats or lists).

    pg_loss / the KL term are their numerators over N (token) or S (sequence aggregation);
    loss = pg_loss + β KL term (the guard's weight not applied); clip_fraction, ratio_mean,
    entropy, tis_* are token means; ratio_max the batch max; advantage_mean the mean over rows;
    d_lag = Σ|Δ| / N and d_lag/p50, /p95, /p99 over the sequences in the loss; kl_ref_estimate the token
    mean of k3's value (KL(π_θ‖π_ref) per token, unbiased; the penalty's own value need not be);
    entropy_coef the entropy bonus's β_H in `cfg` (the step's, when it decays).
    """
    tokens, sequences = _scalar(stats["tokens"]), _scalar(stats["sequences"])
    count = max(tokens if cfg.aggregation == "token" else sequences, 1.0)
    per_token = max(tokens, 1.0)
    out = {"tokens": tokens, "sequences": sequences, "pg_loss": _scalar(stats["pg_sum"]) / count}
    out["loss"] = out["pg_loss"]
    if "kl_sum" in stats:
        kl = _scalar(stats["kl_sum"]) / count
        out[kl_metric_name(cfg.kl_estimator)] = kl
        if cfg.kl_coef > 0:
            out["loss"] += cfg.kl_coef * kl
            out["kl_coef"] = cfg.kl_coef  # β this step used (the adaptive controller's, grpo/kl_control.py)
    if "kl_value_sum" in stats:  # KL(π_θ‖π_ref) in nats per token, k3 (unbiased), whatever the penalty
        out["kl_ref_estimate"] = _scalar(stats["kl_value_sum"]) / per_token
    if "kl_out_of_support_sum" in stats:  # tokens masked out of the KL term (loss.py: no finite log-ratio)
        out["kl_out_of_support_tokens"] = _scalar(stats["kl_out_of_support_sum"])
    out["clip_fraction"] = _scalar(stats["clip_sum"]) / per_token
    out["ratio_mean"] = _scalar(stats["ratio_sum"]) / per_token if tokens else 1.0
    n_b, lag_b, rmax_b = _vector(stats["seq_tokens"]), _vector(stats["seq_lag_sum"]), _vector(stats["seq_ratio_max"])
    out["ratio_max"] = max((r for r, n in zip(rmax_b, n_b) if n > 0), default=1.0)
    out["advantage_mean"] = _scalar(stats["adv_sum"]) / max(_scalar(stats["rows"]), 1.0)
    if tokens:  # no token in the loss: D_lag was not measured (absent, not 0)
        out["d_lag"] = sum(lag_b) / per_token
        out.update(percentiles([d / n for d, n in zip(lag_b, n_b) if n > 0], "d_lag"))
    if cfg.entropy_coef > 0:  # β_H this step used (on its schedule: GRPOLossConfig.at_step)
        out["entropy_coef"] = cfg.entropy_coef
    for key, name in (("entropy_sum", "entropy"), ("tis_weight_sum", "tis_weight_mean"),
                      ("tis_truncated_sum", "tis_truncated_fraction"),
                      ("off_policy_masked_sum", "off_policy_masked_fraction")):
        if key in stats:
            out[name] = _scalar(stats[key]) / per_token
    return out


def lag_guard_weight(d_lag: float, cfg: GRPOLossConfig) -> float:
    """Weight of this step's gradient: 1 under the threshold, else 0 (quarantine) or threshold / D_lag."""
    if cfg.lag_threshold is None or not d_lag > cfg.lag_threshold:
        return 1.0
    return 0.0 if cfg.lag_action == "quarantine" else cfg.lag_threshold / d_lag


def grpo_step_weight(stats: Mapping, cfg: GRPOLossConfig) -> tuple[float, dict[str, float]]:
    """The learner's step hook: (gradient weight from the batch-wide lag guard, metrics)."""
    metrics = grpo_metrics(stats, cfg)
    weight = lag_guard_weight(metrics.get("d_lag", 0.0), cfg)  # no token in the loss: nothing to guard
    if weight != 1.0:
        logger.warning("batch lag D_lag=%.4g > lag_threshold=%.4g: %s (gradient weight %.3g)",
                       metrics["d_lag"], cfg.lag_threshold, cfg.lag_action, weight)
    metrics.update(lag_weight=weight, lag_quarantined=float(weight == 0.0))
    return weight, metrics
