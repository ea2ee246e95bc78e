"""The GRPO loss's configuration: clipping, TIS, reference KL, advantages, entropy bonus, lag guard.

    cfg = GRPOLossConfig(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.01, entropy_coef=0.1)
    step_cfg = cfg.at_step(learner_step)      # what that step uses (the entropy bonus's schedule)

The formulas each field enters are documented in grpo/loss.py, which re-exports these names.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

KL_GRADIENT = {"k1": "none", "k2": "theta_ref", "k3": "ref_theta"}
"""Divergence whose gradient each estimator's penalty follows in expectation (see grpo/loss.py's
docstring): "theta_ref" = ∇KL(π_θ‖π_ref), "ref_theta" = ∇KL(π_ref‖π_θ), "none" = 0."""


def kl_metric_name(estimator: str) -> str:
    """Metric key of the KL penalty, naming the divergence its gradient follows."""
    return f"kl_ref_{estimator}_grad_{KL_GRADIENT[estimator]}"


@dataclasses.dataclass(kw_only=True)
class GRPOLossConfig:
    clip_eps_low: float = 0.2
    """ε_low: the ratio is clipped below at 1 - ε_low (acts when Â < 0)."""
    clip_eps_high: float = 0.2
    """ε_high: the ratio is clipped above at 1 + ε_high (acts when Â > 0); DAPO uses 0.28."""
    aggregation: Literal["token", "sequence"] = "token"
    """"token": mean over all unmasked tokens of the batch; "sequence": mean per sequence, then over
    the batch's sequences in the loss."""
    tis_cap: float | None = None
    """C for truncated importance weights min(π_old/μ, C); None disables TIS.  Needs old_logprobs_bt."""
    off_policy_mask: Literal["icepop", "m2po"] | None = None
    """Tokens whose train/behavior mismatch is extreme leave the policy-gradient term (grpo/loss.py):
    "icepop" (Ring-1T's IcePop): weight k = π_old/μ where icepop_low <= k <= icepop_high, 0 outside (instead of
    TIS's truncation); "m2po" (M2PO): the tokens of largest (log π_θ/μ)² are masked until the second moment of
    the rest is <= m2po_threshold.  Masked tokens are counted (off_policy_masked_fraction).  None: off."""
    icepop_low: float = 0.5
    """α of "icepop": tokens with π_old/μ below it are masked."""
    icepop_high: float = 5.0
    """β of "icepop": tokens with π_old/μ above it are masked."""
    m2po_threshold: float = 0.04
    """τ_M2 of "m2po": the largest mean (log π_θ/μ)² over the tokens kept in the loss."""
    kl_coef: float = 0.0
    """β, weight of the KL penalty to the reference model; 0 disables it (ref logprobs unused).  The
    reference is scored at rollout.temperature, untruncated (no top-k/top-p: every token has a
    probability); tokens still without a finite log-ratio are left out of the term and counted
    (metric kl_out_of_support_tokens; grpo/loss.py)."""
    kl_control: Literal["fixed", "adaptive"] = "fixed"
    """"fixed": β is kl_coef at every step; "adaptive": β starts at kl_coef and follows a proportional
    controller toward kl_target (grpo/kl_control.py), its value kept in every checkpoint."""
    kl_target: float | None = None
    """With kl_control "adaptive": the KL(π_θ‖π_ref) per token, in nats, the controller steers toward."""
    kl_horizon: int = 10
    """With kl_control "adaptive": learner steps over which β reacts (one step moves it by at most a factor
    1 ± 0.2 / kl_horizon)."""
    kl_measure: bool = False
    """Score the reference even at kl_coef 0: KL(π_θ‖π_ref) is measured and logged (learn/kl_ref_estimate)
    but adds nothing to the loss, for one reference forward per micro-batch (a no-penalty arm made
    comparable).  A run with kl_coef > 0 measures it anyway."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    """Schulman's estimator used as the penalty.  Expected gradient: k2 ∇KL(π_θ‖π_ref) (default),
    k3 ∇KL(π_ref‖π_θ), k1 zero on-policy."""
    kl_importance_correction: bool = True
    """Weight each token's KL term by sg(π_θ/μ) (truncated at tis_cap) so off-policy tokens give
    the on-policy expected gradient; 1 on-policy."""
    adv_eps: float = 1e-6
    """ε floor of the group std in the advantage normalisation (used by compute_advantages)."""
    filter_zero_variance: bool = False
    """Drop samples of zero-variance groups from the loss (used by compute_advantages)."""
    entropy_coef: float = 0.0
    """β_H of the entropy bonus: each token's advantage gains β_H x (-log μ(a_t)), its surprisal under the
    policy that sampled it, whose expected gradient ascends the policy's entropy (see grpo_loss)."""
    entropy_coef_final: float | None = None
    """With entropy_decay_steps: β_H falls linearly from entropy_coef at learner step 0 to this at step
    entropy_decay_steps, then stays there (exploration early, less pull on reward-free tokens late)."""
    entropy_decay_steps: int = 0
    """Learner steps of the entropy bonus's linear decay; 0: β_H is entropy_coef throughout."""
    advantage_baseline: Literal["group", "batch"] = "group"
    """"group": GRPO, (R - group mean) / group std; "batch": REINFORCE++, (R - batch mean) / batch std,
    so groups whose rewards are all equal still carry signal (see grpo/advantages.py)."""
    lag_threshold: float | None = None
    """Batch-wide D_lag above which the step is quarantined or down-weighted; None disables the guard."""
    lag_action: Literal["quarantine", "downweight"] = "quarantine"
    """"quarantine": no optimizer step for this batch; "downweight": gradient x lag_threshold / D_lag."""

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
        self._check_off_policy_mask()
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        self._check_kl_control()
        if self.kl_estimator not in KL_GRADIENT:
            raise ValueError(f"kl_estimator must be one of 'k1', 'k2', 'k3', got {self.kl_estimator!r}")
        if not self.adv_eps > 0:
            raise ValueError(f"adv_eps must be > 0, got {self.adv_eps}")
        if self.lag_threshold is not None and not self.lag_threshold > 0:
            raise ValueError(f"lag_threshold must be > 0 or None, got {self.lag_threshold}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.entropy_decay_steps < 0:
            raise ValueError(f"entropy_decay_steps must be >= 0, got {self.entropy_decay_steps}")
        if (self.entropy_decay_steps > 0) != (self.entropy_coef_final is not None):
            raise ValueError("entropy_coef_final and entropy_decay_steps go together: set both for a decaying "
                             f"entropy bonus, neither for a constant one (got entropy_coef_final="
                             f"{self.entropy_coef_final}, entropy_decay_steps={self.entropy_decay_steps})")
        if self.entropy_coef_final is not None and not self.entropy_coef_final >= 0:
            raise ValueError(f"entropy_coef_final must be >= 0, got {self.entropy_coef_final}")
        if self.advantage_baseline not in ("group", "batch"):
            raise ValueError(f"advantage_baseline must be 'group' or 'batch', got {self.advantage_baseline!r}")
        if self.advantage_baseline == "batch" and self.filter_zero_variance:
            raise ValueError("filter_zero_variance drops equal-reward groups, which the 'batch' advantage_baseline "
                             "exists to learn from; use one or the other")
        if self.lag_action not in ("quarantine", "downweight"):
            raise ValueError(f"lag_action must be 'quarantine' or 'downweight', got {self.lag_action!r}")

    def _check_off_policy_mask(self) -> None:
        if self.off_policy_mask not in (None, "icepop", "m2po"):
            raise ValueError(f"off_policy_mask must be 'icepop', 'm2po' or null, got {self.off_policy_mask!r}")
        if self.off_policy_mask == "icepop" and self.tis_cap is not None:
            raise ValueError("off_policy_mask 'icepop' replaces TIS's truncation by masking: set tis_cap or "
                             "icepop, not both")
        if not 0 <= self.icepop_low < 1 < self.icepop_high:
            raise ValueError(f"icepop_low / icepop_high must satisfy 0 <= low < 1 < high, got "
                             f"{self.icepop_low} / {self.icepop_high}")
        if not self.m2po_threshold > 0:
            raise ValueError(f"m2po_threshold must be > 0, got {self.m2po_threshold}")

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the loss takes π_old (TIS and IcePop weigh by π_old/μ)."""
        return self.tis_cap is not None or self.off_policy_mask == "icepop"

    def _check_kl_control(self) -> None:
        if self.kl_control not in ("fixed", "adaptive"):
            raise ValueError(f"kl_control must be 'fixed' or 'adaptive', got {self.kl_control!r}")
        if self.kl_control == "fixed":
            if self.kl_target is not None:
                raise ValueError(f"kl_target ({self.kl_target}) applies to kl_control 'adaptive' only; set "
                                 "kl_control: adaptive, or drop kl_target")
            return
        if not self.kl_coef > 0:
            raise ValueError(f"kl_control 'adaptive' scales kl_coef from its starting value, so kl_coef must be > 0, "
                             f"got {self.kl_coef}")
        if self.kl_target is None or isinstance(self.kl_target, bool) or not self.kl_target > 0:
            raise ValueError(f"kl_control 'adaptive' needs kl_target > 0 (the KL per token, in nats, it steers "
                             f"toward), got {self.kl_target!r}")
        if isinstance(self.kl_horizon, bool) or not isinstance(self.kl_horizon, int) or self.kl_horizon < 1:
            raise ValueError(f"kl_horizon must be an int >= 1 (learner steps), got {self.kl_horizon!r}")

    def kl_controller(self):
        """A new KLController (grpo/kl_control.py) for a run of this config: β for each learner step."""
        from megatron_rl.grpo.kl_control import KLController

        return KLController(self)

    def without_kl(self) -> "GRPOLossConfig":
        """This config with no KL penalty (SFT's learner: no reference model)."""
        return dataclasses.replace(self, kl_coef=0.0, kl_control="fixed", kl_target=None, kl_measure=False)

    @property
    def has_reference(self) -> bool:
        """Whether a run of this config scores the reference model (a KL penalty, or kl_measure)."""
        return self.kl_coef > 0 or self.kl_measure

    def at_step(self, step: int) -> "GRPOLossConfig":
        """This config as learner step `step` uses it: β_H on its schedule, as a constant (itself when
        constant already).  The learner's step counter is checkpointed, so a resumed run continues it."""
        if not self.entropy_decay_steps:
            return self
        frac = min(max(step, 0) / self.entropy_decay_steps, 1.0)
        coef = self.entropy_coef + frac * (self.entropy_coef_final - self.entropy_coef)
        return dataclasses.replace(self, entropy_coef=coef, entropy_coef_final=None, entropy_decay_steps=0)
