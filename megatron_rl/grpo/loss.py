"""GRPO policy loss: clipped surrogate against behavior logprobs, TIS, reference KL, lag guard.

    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.01, kl_estimator="k2")
    loss, stats = grpo_loss(logprobs_bt, behavior_logprobs_bt, ref_logprobs_bt, adv_b, mask_bt, cfg)
    loss.backward()
    metrics = grpo_metrics(stats, cfg)          # grpo/step_metrics.py: {"pg_loss", "clip_fraction", "d_lag", ...}

Shape legend: B = sequences in the micro-batch, T = response tokens (padded).  Every *_bt
tensor holds the log-probability of the *sampled* token at each response position; mask_bt
is 1 on real response tokens and 0 on padding (and on rows dropped by the caller).

Notation: π_θ = learner policy being optimised (`logprobs_bt`, carries grad); μ = behavior
policy that generated the tokens (vLLM's logprobs, `behavior_logprobs_bt`); π_old = optional
proximal policy (`old_logprobs_bt`, learner before this update); π_ref = frozen reference;
sg(.) = stop-gradient.

Surrogate (PPO, Schulman et al. 2017, eq. 7; asymmetric "clip-higher" from DAPO,
Yu et al. 2025, sec. 3.1).  The anchor a is π_old when given, else μ:

    r_t = exp(clamp(log π_θ - log a, -R, R))              R = LOG_RATIO_BOUND = 20
    L_t^pg = -min(r_t Â, clip(r_t, 1 - ε_low, 1 + ε_high) Â)

The clamp keeps exp() finite (an overflow would give 0·inf = NaN gradients even on clipped
tokens); beyond ±R the ratio is constant, so such a token passes no gradient.  R = 20 is
a ratio of 4.9e8, far outside any trust region.

Truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training"; decoupled PPO, Hilton et al. 2022).  Needs π_old: the
rollout engine's μ differs from the learner's π_old, so each token is re-weighted by

    w_t = min(exp(clamp(log π_old - log μ, -R, R)), C)          (no gradient)
    L_t^pg <- w_t L_t^pg

With one optimiser step per batch pass `old_logprobs_bt=logprobs_bt.detach()`: r_t = 1 in
value and the update is w_t Â ∇log π_θ.

Masking extreme tokens instead (`off_policy_mask`; each masked token leaves the pg term, counted in
`off_policy_masked_sum`):
- "icepop" (IcePop, Ring-1T report, Ling team 2025): like TIS with π_old, but the weight is masked rather
  than truncated, k_t = exp(log π_old - log μ):

      w_t = k_t · 1[α <= k_t <= β]          (α = icepop_low, β = icepop_high; no gradient)

- "m2po" (M2PO, Zheng et al. 2025, "Prosperity before Collapse"): with s_t = (log π_θ - log μ)² (no
  gradient) over the micro-batch's tokens, the k largest s_t are masked, k the smallest count for which the
  mean of the rest, M2 = (1/(n-k)) Σ_rest s_t, is <= τ_M2 (`m2po_threshold`).  A batch whose M2 is within τ
  already loses nothing; stale batches lose only their outliers.  The paper computes M2 over the batch; here
  it is per micro-batch (the same when a step is one micro-batch).

Reference KL (Schulman 2020, "Approximating KL Divergence"), δ_t = log π_ref - log π_θ:

    k1 = -δ                 value: unbiased for KL(π_θ‖π_ref) under x ~ π_θ, can be < 0
    k2 = δ² / 2             value: biased (second order), ≥ 0
    k3 = exp(δ) - 1 - δ     value: unbiased for KL(π_θ‖π_ref) under x ~ π_θ, ≥ 0
                            (δ is clamped to ±R before exp, as above)

What the penalty *optimises* is the expectation of its gradient, not its value.  The tokens
are data (no score-function term), so with π = π_θ and x ~ π:

    ∇k1 = ∇log π(x)                 E_π[∇k1] = Σ_x ∇π(x) = 0
    ∇k2 = -δ ∇log π(x)              E_π[∇k2] = Σ_x ∇π(x) log(π/π_ref)(x) = ∇KL(π_θ‖π_ref)
    ∇k3 = (1 - π_ref/π)(x) ∇log π   E_π[∇k3] = -Σ_x π_ref(x) ∇log π(x)   = ∇KL(π_ref‖π_θ)

(the middle line uses ∇KL(π‖π_ref) = Σ ∇π log(π/π_ref) + Σ π ∇log π and Σ π ∇log π = 0).
So only k2 descends KL(π_θ‖π_ref), the divergence this penalty is documented to be; it is
the default.  k3 descends the reverse divergence KL(π_ref‖π_θ) (mass-covering: it pushes
π_θ up wherever π_ref has mass), and k1 adds no expected gradient at all on-policy (only
variance).  The reported metric names the divergence whose gradient is followed:
`kl_ref_k2_grad_theta_ref`, `kl_ref_k3_grad_ref_theta`, `kl_ref_k1_grad_none` (values: the
estimator's mean, i.e. the penalty's value).  That value is not the KL for k2 once log-ratios are
large: E[δ²/2] is KL's second-order term only (with |δ| ~ 5 it overstates KL ~3x; k1 and k3 are
unbiased).  So, whatever the estimator, the step also reports `kl_ref_estimate`, the token mean of
k3's value (≥ 0, unbiased; importance-weighted as below): the KL in nats per token.

Reference KL under a truncating sampler (rollout.top_k / top_p).  π_θ is the distribution the
engine samples from: tempered, truncated to the support S_θ (top-k, then top-p) and renormalised
(megatron_rl/learner/logprobs.py).  π_ref is the reference at the same temperature, untruncated
(ranks/build.py `Reference`, `SamplingConfig.untruncated`): π_ref(x) > 0 for every x, so

    KL(π_θ‖π_ref) = Σ_{x∈S_θ} π_θ(x) log(π_θ(x) / π_ref(x))

is finite, and k1's and k2's gradient statements above hold with π = π_θ on S_θ (the mask carries
no gradient).  k3's value is then biased low by π_ref(outside S_θ): E[exp(δ)] = π_ref(S_θ) < 1.
Scoring the reference truncated too would give every sampled token outside the *reference's*
top-k/top-p set OUT_OF_SUPPORT_LOGPROB (-87.3), δ ≈ 80 and a k2 term of ~3000 nats per token.
A token whose log-probability is still at or below OUT_OF_SUPPORT_LOGPROB (under π_θ: the policy
moved since sampling and the token left its support; under π_ref: a -inf logit) has no finite
log-ratio: it is masked out of the KL term (contributes 0 and no gradient; the normaliser does not
change) and counted (`kl_out_of_support_sum` -> metric `kl_out_of_support_tokens`).  Without
truncation no token scores that low and nothing is masked.

Off-policy the tokens come from μ, not π_θ.  With `kl_importance_correction` (default) each
token's KL term is weighted by ρ_t = sg(exp(clamp(log π_θ - log μ, -R, R))) (truncated at C
when TIS is on), so E_μ[ρ ∇k] = E_π[∇k] per token and the directions above hold.  As for
the surrogate this corrects each token's own distribution given its prefix, not the
distribution of the prefix (the usual per-token approximation); on-policy ρ_t = 1.

    L_t = L_t^pg + β ρ_t k_t

Aggregation, over the GLOBAL batch (all micro-batches of all data-parallel ranks):

    "token"    (DAPO, Yu et al. 2025, sec. 3.3):  L = (1/N) Σ_i Σ_t m_it L_it,
               N = Σ_it m_it (tokens in the loss)
    "sequence" (GRPO, Shao et al. 2024, eq. 3):   L = (1/S) Σ_i (1/n_i) Σ_t m_it L_it,
               n_i = Σ_t m_it, S = #{i : n_i > 0} (sequences in the loss)

A micro-batch only sees its own rows, so the caller passes the global normaliser divided by
the number K of micro-batches in the step (`token_denominator` = N / K,
`sequence_denominator` = S / K): Megatron's schedule averages the K_local micro-batch losses
of a rank and DDP averages the dp ranks (K = K_local · dp, the same K_local on every rank),
so the mean of the K micro-batch losses is exactly L, wherever the micro-batch boundaries
fall.  K is the step's actual count: with a token budget it varies from step to step, so the
learner hands it to every micro-batch (`num_micro_batches`) and the loss function divides the
batch's N and S (`tokens_in_loss`, `sequences_in_loss` from megatron_rl.train.batch) by it
(megatron_rl.grpo.micro_loss.grpo_micro_batch_loss).  Masked rows
(verifier errors, filtered groups) are in neither N nor S.

Learner-to-behavior lag (not the reference KL), over the global batch:

    D_lag = (1/N) Σ_i Σ_t m_it |log π_θ - log μ|

grpo_loss returns additive statistics (sums over its micro-batch, plus per-sequence sums
Σ_t |Δ| and n_i), the learner sums them over micro-batches and data-parallel ranks, and
`grpo_step_weight` (megatron_rl/grpo/step_metrics.py) turns them into D_lag (and its P50/P95/P99 over sequences) before the
optimizer step.  When D_lag exceeds `lag_threshold` the whole step is quarantined (no
optimizer step: weights, Adam moments and the LR schedule stay as they were; a zero loss
would not do, Adam's momentum would still move the weights) or its gradient is multiplied
by lag_threshold / D_lag (the same as scaling the batch loss; note that Adam is nearly
invariant to a gradient scale, so this mostly reduces the batch's share of the moments).
Metric names keep the two apart: `kl_ref_*` is to the reference model, `d_lag` is to the
behavior policy.
"""

from __future__ import annotations

import torch

from megatron_rl.grpo.advantages import batch_advantages, group_advantages
from megatron_rl.grpo.loss_config import KL_GRADIENT, GRPOLossConfig, kl_metric_name  # noqa: F401 - re-exported
from megatron_rl.learner.logprobs import OUT_OF_SUPPORT_LOGPROB

LOG_RATIO_BOUND = 20.0
"""R: every log-ratio is clamped to [-R, R] before exp() (ratios within [2e-9, 4.9e8])."""


def compute_advantages(
    rewards_ng: torch.Tensor, valid_ng: torch.Tensor | None, cfg: GRPOLossConfig
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """group_advantages (or batch_advantages) with this config's baseline, ε and zero-variance filter.

    Returns (adv_ng [N, G], keep_ng [N, G] bool, stats).  Flatten to [B = N*G] for grpo_loss and
    zero the mask rows of dropped samples: `mask_bt * keep_ng.reshape(-1, 1)`.
    """
    if cfg.advantage_baseline == "batch":
        return batch_advantages(rewards_ng, valid_ng, eps=cfg.adv_eps)
    return group_advantages(rewards_ng, valid_ng, eps=cfg.adv_eps, filter_zero_variance=cfg.filter_zero_variance)


def kl_estimate(logprobs_bt: torch.Tensor, ref_logprobs_bt: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token k1/k2/k3 from tokens sampled by π_θ: [B, T] -> [B, T] (see the module docstring
    for the value each estimates and the gradient each gives)."""
    delta = ref_logprobs_bt - logprobs_bt  # log(π_ref / π_θ)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta**2
    if estimator == "k3":
        delta = delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.expm1(delta) - delta
    raise ValueError(f"kl_estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}")


def _aggregate_sum(values_bt: torch.Tensor, mask_bt: torch.Tensor, how: str) -> torch.Tensor:
    """Numerator of the aggregation: Σ_it m L (token) or Σ_i (1/n_i) Σ_t m L (sequence)."""
    if how == "token":
        return (values_bt * mask_bt).sum()
    return ((values_bt * mask_bt).sum(dim=1) / mask_bt.sum(dim=1).clamp(min=1)).sum()


def _check_shapes(mask_bt: torch.Tensor, advantages_b: torch.Tensor, **named: torch.Tensor | None) -> None:
    if mask_bt.dim() != 2:
        raise ValueError(f"mask_bt must be [B, T], got shape {tuple(mask_bt.shape)}")
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != mask_bt.shape:
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != mask_bt shape {tuple(mask_bt.shape)}")
    if advantages_b.shape != mask_bt.shape[:1]:
        raise ValueError(f"advantages_b shape {tuple(advantages_b.shape)} != [B] = {tuple(mask_bt.shape[:1])}")


def _exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


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
    sequence_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO loss of one micro-batch (scalar, differentiable w.r.t. logprobs_bt) and its statistics.

    logprobs_bt [B, T] (grad), behavior_logprobs_bt [B, T], ref_logprobs_bt [B, T] or None,
    advantages_b [B], mask_bt [B, T] (0/1), old_logprobs_bt [B, T] or None (proximal policy,
    needed for TIS), entropy_bt [B, T] or None (metric only).  token_denominator /
    sequence_denominator replace the local token / sequence count of the "token" / "sequence"
    aggregation: pass N/K and S/K of the global batch (module docstring); None = this call is
    the whole batch.

    The statistics are tensors on the loss's device, additive over micro-batches and ranks:
    0-dim sums (tokens, sequences, rows, pg_sum, kl_sum, clip_sum, ratio_sum, adv_sum, ...) and
    per-sequence [B] vectors (seq_tokens n_i, seq_lag_sum Σ_t |log π_θ - log μ|, seq_ratio_max).
    `grpo_metrics` turns their batch-wide sums into metrics; the lag guard is not applied here.
    """
    _check_shapes(mask_bt, advantages_b, logprobs_bt=logprobs_bt, behavior_logprobs_bt=behavior_logprobs_bt,
                  ref_logprobs_bt=ref_logprobs_bt, old_logprobs_bt=old_logprobs_bt, entropy_bt=entropy_bt)
    _check_inputs(cfg, ref_logprobs_bt, old_logprobs_bt)
    mask = mask_bt.to(device=logprobs_bt.device, dtype=logprobs_bt.dtype)
    # Padding may hold anything (e.g. -inf): zero it before exp() so no NaN leaks into grads.
    keep_bt = mask > 0
    zeros = torch.zeros_like(mask)

    def masked(t: torch.Tensor) -> torch.Tensor:
        return torch.where(keep_bt, t.detach().to(mask), zeros)

    logprobs_bt = torch.where(keep_bt, logprobs_bt, zeros)
    behavior = masked(behavior_logprobs_bt)
    ref = masked(ref_logprobs_bt) if ref_logprobs_bt is not None else None
    old = masked(old_logprobs_bt) if old_logprobs_bt is not None else None
    anchor = behavior if old is None else old
    stats: dict[str, torch.Tensor] = {}
    pg_bt, ratio_bt, adv_bt = _clipped_surrogate(logprobs_bt, anchor, behavior, advantages_b, mask, cfg, stats)
    denom = _denominator(mask, cfg.aggregation, token_denominator, sequence_denominator)
    pg_sum = _aggregate_sum(pg_bt, mask, cfg.aggregation)
    loss = pg_sum / denom
    stats["pg_sum"] = pg_sum.detach()
    if ref is not None:
        kl_sum = _kl_to_reference(logprobs_bt, ref, behavior, mask, cfg, stats)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_sum / denom

    with torch.no_grad():
        stats.update(_batch_stats(logprobs_bt, behavior, ratio_bt, adv_bt, advantages_b, mask, cfg))
        if entropy_bt is not None:
            stats["entropy_sum"] = masked(entropy_bt).mul(mask).sum()
    return loss, stats


def _clipped_surrogate(logprobs_bt, anchor, behavior, advantages_b, mask, cfg: GRPOLossConfig, stats: dict):
    """Per-token policy-gradient loss (clipped surrogate around `anchor`, TIS-weighted when cfg.tis_cap),
    the ratio π_θ/anchor and the per-token advantages (entropy bonus included); TIS sums go to `stats`."""
    keep_bt = mask > 0
    adv_bt = advantages_b.to(mask)[:, None].expand_as(logprobs_bt)
    if cfg.entropy_coef:
        # Entropy bonus as a per-token advantage: E_a[-log π(a) ∇log π(a)] = ∇H(π) (score function;
        # E[∇log π] = 0), so adding β_H x surprisal of the sampled token ascends the entropy.
        # Capped at 20 nats: a token outside a truncated (top-k/top-p) set scores -87.3 (learner/logprobs.py).
        adv_bt = adv_bt + cfg.entropy_coef * torch.where(keep_bt, -anchor, torch.zeros_like(mask)).clamp(max=20.0)
    ratio_bt = _exp_log_ratio(logprobs_bt - anchor)
    clipped_bt = ratio_bt.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    pg_bt = -torch.minimum(ratio_bt * adv_bt, clipped_bt * adv_bt)
    if cfg.tis_cap is not None:
        with torch.no_grad():
            raw_w_bt = _exp_log_ratio(anchor - behavior)
            tis_w_bt = raw_w_bt.clamp(max=cfg.tis_cap)
        pg_bt = pg_bt * tis_w_bt
        stats["tis_weight_sum"] = (tis_w_bt * mask).sum()
        stats["tis_truncated_sum"] = ((raw_w_bt > cfg.tis_cap).to(mask) * mask).sum()
    if cfg.off_policy_mask is not None:
        with torch.no_grad():
            weight_bt = off_policy_weights(logprobs_bt.detach(), anchor, behavior, mask, cfg)
        pg_bt = pg_bt * weight_bt
        stats["off_policy_masked_sum"] = ((weight_bt == 0).to(mask) * mask).sum()
    return pg_bt, ratio_bt, adv_bt


def off_policy_weights(logprobs_bt, anchor, behavior, mask, cfg: GRPOLossConfig) -> torch.Tensor:
    """[B, T] per-token weights of `off_policy_mask` (module docstring): IcePop's masked k_t, or M2PO's 0/1."""
    keep_bt = mask > 0
    if cfg.off_policy_mask == "icepop":
        k_bt = _exp_log_ratio(anchor - behavior)
        inside = (k_bt >= cfg.icepop_low) & (k_bt <= cfg.icepop_high)
        return torch.where(inside & keep_bt, k_bt, torch.zeros_like(k_bt))
    s_bt = (logprobs_bt - behavior).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) ** 2
    values = s_bt[keep_bt]
    n = values.numel()
    weight_bt = keep_bt.to(mask)
    if n == 0:
        return weight_bt
    ordered, order = values.sort(descending=True)
    # rest_mean[k] = mean of ordered[k:], k = 0..n-1: the second moment after masking the k largest
    suffix = ordered.flip(0).cumsum(0).flip(0)
    rest_mean = suffix / torch.arange(n, 0, -1, dtype=suffix.dtype, device=suffix.device)
    within = (rest_mean <= cfg.m2po_threshold).nonzero()
    k = int(within[0]) if within.numel() else n
    flat = weight_bt[keep_bt]
    flat[order[:k]] = 0.0
    weight_bt[keep_bt] = flat
    return weight_bt


def _check_inputs(cfg: GRPOLossConfig, ref_logprobs_bt, old_logprobs_bt) -> None:
    if cfg.off_policy_mask == "icepop" and old_logprobs_bt is None:
        raise ValueError("off_policy_mask 'icepop' weighs by π_old/μ: pass old_logprobs_bt (logprobs_bt.detach() "
                         "for one optimiser step per batch)")
    if cfg.tis_cap is not None and old_logprobs_bt is None:
        raise ValueError(
            "tis_cap is set but old_logprobs_bt is None: TIS weights min(π_old/μ, C) need the proximal "
            "policy's logprobs (pass logprobs_bt.detach() for one optimiser step per batch)"
        )
    if cfg.kl_coef > 0 and ref_logprobs_bt is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs ref_logprobs_bt, got None")


def _denominator(mask: torch.Tensor, aggregation: str, token_denominator, sequence_denominator) -> torch.Tensor:
    """What the micro-batch's summed loss is divided by: the local token / sequence count, or the
    global batch's share passed in (module docstring)."""
    if token_denominator is None and sequence_denominator is None:
        denominators = {"token": mask.sum().clamp(min=1), "sequence": (mask.sum(dim=1) > 0).to(mask).sum().clamp(min=1)}
    else:
        denominators = {"token": token_denominator, "sequence": sequence_denominator}
    denom = denominators[aggregation]
    if denom is None:
        raise ValueError(f"aggregation={aggregation!r} needs {aggregation}_denominator")
    return torch.as_tensor(denom, dtype=mask.dtype, device=mask.device).clamp(min=1e-12)


def in_kl_support(logprobs_bt: torch.Tensor, ref_logprobs_bt: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: tokens with a finite log-ratio, both log-probabilities above OUT_OF_SUPPORT_LOGPROB
    (module docstring, "Reference KL under a truncating sampler")."""
    return (logprobs_bt.detach() > OUT_OF_SUPPORT_LOGPROB) & (ref_logprobs_bt > OUT_OF_SUPPORT_LOGPROB)


def _kl_to_reference(logprobs_bt, ref, behavior, mask, cfg: GRPOLossConfig, stats: dict) -> torch.Tensor:
    """The penalty's aggregated KL estimate (differentiable); records it, the KL's value (k3) and the
    tokens out of support (masked out of both) in `stats`."""
    support_bt = in_kl_support(logprobs_bt, ref)
    stats["kl_out_of_support_sum"] = (mask * ~support_bt).sum()
    # Out of support both sides read 0: δ = 0, every estimator 0, no gradient to the token.
    zeros = torch.zeros_like(mask)
    logprobs_bt = torch.where(support_bt, logprobs_bt, zeros)
    ref = torch.where(support_bt, ref, zeros)
    rho_bt = None
    if cfg.kl_importance_correction:
        with torch.no_grad():
            rho_bt = _exp_log_ratio(logprobs_bt.detach() - behavior)
            if cfg.tis_cap is not None:
                rho_bt = rho_bt.clamp(max=cfg.tis_cap)
    kl_bt = kl_estimate(logprobs_bt, ref, cfg.kl_estimator)
    if rho_bt is not None:
        kl_bt = kl_bt * rho_bt
    kl_sum = _aggregate_sum(kl_bt, mask, cfg.aggregation)
    stats["kl_sum"] = kl_sum.detach()
    with torch.no_grad():  # the KL's value, whatever the penalty: k3, unbiased at any divergence
        value_bt = kl_estimate(logprobs_bt.detach(), ref, "k3")
        stats["kl_value_sum"] = ((value_bt if rho_bt is None else value_bt * rho_bt) * mask).sum()
    return kl_sum


def _batch_stats(logprobs_bt, behavior, ratio_bt, adv_bt, advantages_b, mask, cfg: GRPOLossConfig) -> dict:
    """The additive statistics of a micro-batch (grpo_loss's docstring), without grad."""
    keep_bt = mask > 0
    clip_active_bt = ((adv_bt > 0) & (ratio_bt > 1.0 + cfg.clip_eps_high)) | (
        (adv_bt < 0) & (ratio_bt < 1.0 - cfg.clip_eps_low)
    )
    seq_tokens_b = mask.sum(dim=1)
    ratio_d = ratio_bt.detach()
    return dict(
        tokens=seq_tokens_b.sum(),
        sequences=(seq_tokens_b > 0).to(mask).sum(),
        rows=torch.tensor(float(mask.shape[0]), dtype=mask.dtype, device=mask.device),
        clip_sum=(clip_active_bt.to(mask) * mask).sum(),
        ratio_sum=(ratio_d * mask).sum(),
        adv_sum=advantages_b.detach().to(mask).sum(),
        seq_tokens=seq_tokens_b,
        seq_lag_sum=((logprobs_bt.detach() - behavior).abs() * mask).sum(dim=1),
        seq_ratio_max=torch.where(keep_bt, ratio_d, torch.zeros_like(mask)).amax(dim=1) if mask.shape[1] else seq_tokens_b * 0,
    )
