"""GRPO policy loss: clipped surrogate against behavior logprobs, TIS, reference KL, lag guard.

    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.01, kl_estimator="k3")
    loss, metrics = grpo_loss(logprobs_bt, behavior_logprobs_bt, ref_logprobs_bt, adv_b, mask_bt, cfg)
    loss.backward()

Shape legend: B = sequences in the micro-batch, T = response tokens (padded).  Every *_bt
tensor holds the log-probability of the *sampled* token at each response position; mask_bt
is 1 on real response tokens and 0 on padding (and on rows dropped by the caller).

Notation: π_θ = learner policy being optimised (`logprobs_bt`, carries grad); μ = behavior
policy that generated the tokens (vLLM's logprobs, `behavior_logprobs_bt`); π_old = optional
proximal policy (`old_logprobs_bt`, learner before this update); π_ref = frozen reference.

Surrogate (PPO, Schulman et al. 2017, eq. 7; asymmetric "clip-higher" from DAPO,
Yu et al. 2025, sec. 3.1).  The anchor a is π_old when given, else μ:

    r_t = exp(log π_θ - log a)
    L_t^pg = -min(r_t Â, clip(r_t, 1 - ε_low, 1 + ε_high) Â)

Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training"; decoupled PPO, Hilton et al. 2022).  Needs π_old: the
rollout engine's μ differs from the learner's π_old, so each token is re-weighted by

    w_t = min(exp(log π_old - log μ), C)          (no gradient)
    L_t^pg <- w_t L_t^pg

With one optimiser step per batch pass `old_logprobs_bt=logprobs_bt.detach()`: r_t = 1 in
value and the update is w_t Â ∇log π_θ.

Reference KL (Schulman 2020, "Approximating KL Divergence"), samples from π_θ, with
δ_t = log π_ref - log π_θ:
    k1 = -δ                 (unbiased, can be negative)
    k2 = δ² / 2             (biased, ≥ 0)
    k3 = exp(δ) - 1 - δ     (unbiased, ≥ 0)
    L_t = L_t^pg + β k_t

Aggregation: "token" averages L_t over all unmasked tokens of the batch (DAPO, Yu et al. 2025, sec. 3.3);
"sequence" averages within each sequence, then over sequences (GRPO, Shao et al. 2024,
eq. 3).

Learner-to-behavior lag (not the reference KL): D_lag = mean_t |log π_θ - log μ| over
unmasked tokens.  When D_lag exceeds `lag_threshold` the whole batch is quarantined (loss
weight 0) or down-weighted by lag_threshold / D_lag.  Metric names keep the two apart:
`kl_ref` is to the reference model, `d_lag` is to the behavior policy.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import torch

from megatron_rl.grpo.advantages import group_advantages

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class GRPOLossConfig:
    clip_eps_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - ε_low (acts when Â < 0)."""
    clip_eps_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (acts when Â > 0); DAPO uses 0.28."""
    aggregation: Literal["token", "sequence"] = "token"
    """"token": mean over all unmasked tokens; "sequence": mean per sequence, then over sequences."""
    tis_cap: float | None = None
    """C for truncated importance weights min(π_old/μ, C); None disables TIS.  Needs old_logprobs_bt."""
    kl_coef: float = 0.0
    """β, weight of the KL penalty to the reference model; 0 disables it (ref logprobs unused)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Which of Schulman's estimators of KL(π_θ || π_ref) to use."""
    adv_eps: float = 1e-6
    """ε floor of the group std in the advantage normalisation (used by compute_advantages)."""
    filter_zero_variance: bool = False
    """Drop samples of zero-variance groups from the loss (used by compute_advantages)."""
    lag_threshold: float | None = None
    """D_lag above which a batch is quarantined or down-weighted; None disables the guard."""
    lag_action: Literal["quarantine", "downweight"] = "quarantine"
    """"quarantine": loss weight 0; "downweight": loss weight lag_threshold / D_lag."""

    def __post_init__(self) -> None:
        for name in ("clip_eps_low", "clip_eps_high"):
            value = getattr(self, name)
            if not 0.0 <= value:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.clip_eps_low >= 1.0:
            raise ValueError(f"clip_eps_low must be < 1 (the lower clip bound 1 - ε must stay > 0), got {self.clip_eps_low}")
        if self.aggregation not in ("token", "sequence"):
            raise ValueError(f"aggregation must be 'token' or 'sequence', got {self.aggregation!r}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k2", "k3"):
            raise ValueError(f"kl_estimator must be one of 'k1', 'k2', 'k3', got {self.kl_estimator!r}")
        if not self.adv_eps > 0:
            raise ValueError(f"adv_eps must be > 0, got {self.adv_eps}")
        if self.lag_threshold is not None and not self.lag_threshold > 0:
            raise ValueError(f"lag_threshold must be > 0 or None, got {self.lag_threshold}")
        if self.lag_action not in ("quarantine", "downweight"):
            raise ValueError(f"lag_action must be 'quarantine' or 'downweight', got {self.lag_action!r}")


def compute_advantages(
    rewards_ng: torch.Tensor, valid_ng: torch.Tensor | None, cfg: GRPOLossConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """group_advantages with this config's ε and zero-variance filter.

    Returns (adv_ng [N, G], keep_ng [N, G] bool, stats).  Flatten to [B = N*G] for grpo_loss and
    zero the mask rows of dropped samples: `mask_bt * keep_ng.reshape(-1, 1)`.
    """
    return group_advantages(rewards_ng, valid_ng, eps=cfg.adv_eps, filter_zero_variance=cfg.filter_zero_variance)


def kl_estimate(logprobs_bt: torch.Tensor, ref_logprobs_bt: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from tokens sampled by π_θ: [B, T] -> [B, T]."""
    delta = ref_logprobs_bt - logprobs_bt  # log(π_ref / π_θ)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta**2
    if estimator == "k3":
        return torch.expm1(delta) - delta
    raise ValueError(f"kl_estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}")


def _aggregate(values_bt: torch.Tensor, mask_bt: torch.Tensor, how: str, token_denominator: float | None) -> torch.Tensor:
    """Masked mean of [B, T] values by token or by sequence -> scalar."""
    if how == "token":
        denom = mask_bt.sum() if token_denominator is None else torch.as_tensor(token_denominator, dtype=values_bt.dtype)
        return (values_bt * mask_bt).sum() / denom.clamp(min=1)
    per_seq_b = (values_bt * mask_bt).sum(dim=1) / mask_bt.sum(dim=1).clamp(min=1)  # [B]
    has_tokens_b = (mask_bt.sum(dim=1) > 0).to(values_bt.dtype)
    return (per_seq_b * has_tokens_b).sum() / has_tokens_b.sum().clamp(min=1)


def _check_shapes(mask_bt: torch.Tensor, advantages_b: torch.Tensor, **named: torch.Tensor | None) -> None:
    if mask_bt.dim() != 2:
        raise ValueError(f"mask_bt must be [B, T], got shape {tuple(mask_bt.shape)}")
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != mask_bt.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != mask_bt shape {tuple(mask_bt.shape)}")
    if advantages_b.shape != mask_bt.shape[:1]:
        raise ValueError(f"advantages_b shape {tuple(advantages_b.shape)} != [B] = {tuple(mask_bt.shape[:1])}")


def grpo_loss(
    logprobs_bt: torch.Tensor,
    behavior_logprobs_bt: torch.Tensor,
    ref_logprobs_bt: torch.Tensor | None,
    advantages_b: torch.Tensor,
    mask_bt: torch.Tensor,
    cfg: GRPOLossConfig,
    *,
    old_logprobs_bt: torch.Tensor | None = None,
    entropy_bt: torch.Tensor | None = None,
    token_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss (scalar, differentiable w.r.t. logprobs_bt) and float metrics.

    logprobs_bt [B, T] (grad), behavior_logprobs_bt [B, T], ref_logprobs_bt [B, T] or None,
    advantages_b [B], mask_bt [B, T] (0/1), old_logprobs_bt [B, T] or None (proximal policy,
    needed for TIS), entropy_bt [B, T] or None (metric only).  token_denominator replaces the
    local masked-token count in "token" aggregation (e.g. the global count across
    data-parallel ranks and micro-batches).
    """
    _check_shapes(
        mask_bt,
        advantages_b,
        logprobs_bt=logprobs_bt,
        behavior_logprobs_bt=behavior_logprobs_bt,
        ref_logprobs_bt=ref_logprobs_bt,
        old_logprobs_bt=old_logprobs_bt,
        entropy_bt=entropy_bt,
    )
    if cfg.tis_cap is not None and old_logprobs_bt is None:
        raise ValueError(
            "tis_cap is set but old_logprobs_bt is None: TIS weights min(π_old/μ, C) need the proximal "
            "policy's logprobs (pass logprobs_bt.detach() for one optimiser step per batch)"
        )
    if cfg.kl_coef > 0 and ref_logprobs_bt is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs ref_logprobs_bt, got None")
    mask = mask_bt.to(logprobs_bt.dtype)
    n_tokens = mask.sum()
    # Padding may hold anything (e.g. -inf): zero it before exp() so no NaN leaks into grads.
    keep_bt = mask > 0
    logprobs_bt = torch.where(keep_bt, logprobs_bt, torch.zeros_like(logprobs_bt))
    behavior = torch.where(keep_bt, behavior_logprobs_bt.detach().to(mask.dtype), torch.zeros_like(mask))
    if ref_logprobs_bt is not None:
        ref_logprobs_bt = torch.where(keep_bt, ref_logprobs_bt.detach().to(mask.dtype), torch.zeros_like(mask))
    if old_logprobs_bt is not None:
        old_logprobs_bt = torch.where(keep_bt, old_logprobs_bt.detach().to(mask.dtype), torch.zeros_like(mask))
    adv_bt = advantages_b.to(logprobs_bt.dtype)[:, None].expand_as(logprobs_bt)
    anchor = behavior if old_logprobs_bt is None else old_logprobs_bt

    # Clipped surrogate, per token.
    ratio_bt = torch.exp(logprobs_bt - anchor)
    clipped_bt = ratio_bt.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg_bt = -torch.minimum(ratio_bt * adv_bt, clipped_bt * adv_bt)
    with torch.no_grad():
        clip_active_bt = ((adv_bt > 0) & (ratio_bt > 1.0 + cfg.clip_eps_high)) | (
            (adv_bt < 0) & (ratio_bt < 1.0 - cfg.clip_eps_low)
        )

    metrics: dict[str, float] = {}
    if cfg.tis_cap is not None:
        with torch.no_grad():
            raw_w_bt = torch.exp(anchor - behavior)
            tis_w_bt = raw_w_bt.clamp(max=cfg.tis_cap)
        pg_bt = pg_bt * tis_w_bt
        metrics["tis_weight_mean"] = _masked_mean(tis_w_bt, mask)
        metrics["tis_truncated_fraction"] = _masked_mean((raw_w_bt > cfg.tis_cap).to(mask.dtype), mask)

    pg_loss = _aggregate(pg_bt, mask, cfg.aggregation, token_denominator)
    loss = pg_loss
    if ref_logprobs_bt is not None:
        kl_bt = kl_estimate(logprobs_bt, ref_logprobs_bt, cfg.kl_estimator)
        kl_loss = _aggregate(kl_bt, mask, cfg.aggregation, token_denominator)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
        metrics["kl_ref"] = _masked_mean(kl_bt.detach(), mask)

    # Learner-to-behavior lag guard.
    with torch.no_grad():
        d_lag = _masked_mean((logprobs_bt.detach() - behavior).abs(), mask)
    lag_weight = 1.0
    if cfg.lag_threshold is not None and d_lag > cfg.lag_threshold:
        lag_weight = 0.0 if cfg.lag_action == "quarantine" else cfg.lag_threshold / d_lag
        logger.warning(
            "batch lag D_lag=%.4g > lag_threshold=%.4g: %s (loss weight %.3g)",
            d_lag, cfg.lag_threshold, cfg.lag_action, lag_weight,
        )
    loss = loss * lag_weight

    with torch.no_grad():
        ratio_masked = ratio_bt.detach()[mask > 0]
        metrics.update(
            {
                "loss": float(loss.detach()),
                "pg_loss": float(pg_loss.detach()),
                "clip_fraction": _masked_mean(clip_active_bt.to(mask.dtype), mask),
                "ratio_mean": float(ratio_masked.mean()) if ratio_masked.numel() else 1.0,
                "ratio_max": float(ratio_masked.max()) if ratio_masked.numel() else 1.0,
                "d_lag": d_lag,
                "lag_weight": lag_weight,
                "lag_quarantined": float(lag_weight == 0.0),
                "tokens": float(n_tokens),
                "advantage_mean": float(advantages_b.float().mean()) if advantages_b.numel() else 0.0,
            }
        )
        if entropy_bt is not None:
            metrics["entropy"] = _masked_mean(entropy_bt.detach().to(mask.dtype), mask)
    return loss, metrics


def _masked_mean(values_bt: torch.Tensor, mask_bt: torch.Tensor) -> float:
    picked = torch.where(mask_bt > 0, values_bt, torch.zeros_like(values_bt))
    return float(picked.sum() / mask_bt.sum().clamp(min=1))
