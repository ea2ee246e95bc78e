"""The KL penalty's coefficient β over a run: fixed, or adapted toward a target KL.

    kl = KLController(loss_cfg)          # loss.kl_control, loss.kl_coef (β at step 0), kl_target, kl_horizon
    coef = kl.coef                       # the β this learner step's loss uses
    kl.update(measured)                  # after the step: its KL(π_θ‖π_ref) in nats per token
    state = kl.state_dict(); kl.load_state_dict(state)     # kept in every checkpoint (train/checkpointing.py)

`fixed` (the default): β is `loss.kl_coef` throughout.

`adaptive`: a proportional controller (the rule of Ziegler et al. 2019, one update per learner step).  With
the step's measured KL (`learn/kl_ref_estimate`, k3's unbiased token mean, grpo/step_metrics.py),

    e = clip(KL / kl_target - 1, -0.2, 0.2)
    β <- β (1 + e / kl_horizon)

β grows while the policy is further from the reference than the target and shrinks while it is closer.  The
clip bounds one step's change to a factor 1 ± 0.2 / kl_horizon, so over n steps β moves at most by about
exp(±0.2 n / kl_horizon): kl_horizon (learner steps) is how slowly it reacts.  β stays positive (it starts at
loss.kl_coef > 0 and is multiplied by factors > 0), so the reference model is always there to measure KL.
A step that measured no KL (no token in the loss, a non-finite value) leaves β as it was.  The β a step used
is logged as `learn/kl_coef`.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)

ERROR_CLIP = 0.2
"""The largest relative error one update acts on (the proportional rule's saturation)."""


class KLController:
    """β for the next learner step, and its update from the step's measured KL (module docstring)."""

    def __init__(self, cfg):
        self.control = cfg.kl_control
        self.target = cfg.kl_target
        self.horizon = cfg.kl_horizon
        self.coef = float(cfg.kl_coef)

    @property
    def adaptive(self) -> bool:
        return self.control == "adaptive"

    def update(self, measured: float | None) -> float:
        """Move β after a step that measured `measured` nats per token; returns the β the next step uses."""
        if not self.adaptive or measured is None or not math.isfinite(measured):
            return self.coef
        error = min(max(measured / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        self.coef *= 1.0 + error / self.horizon
        return self.coef

    def state_dict(self) -> dict:
        return {"control": self.control, "coef": self.coef}

    def load_state_dict(self, state: dict | None) -> None:
        """Continue from a checkpoint's β.  A checkpoint without one (written before the controller existed, or
        by a fixed run) leaves β at loss.kl_coef; a fixed run ignores what an adaptive one had reached."""
        if not self.adaptive:
            return
        if not state or state.get("control") != "adaptive":
            logger.info("KL controller: the checkpoint holds no adaptive β; starting from loss.kl_coef %g", self.coef)
            return
        coef = float(state["coef"])
        if not (coef > 0 and math.isfinite(coef)):
            raise ValueError(f"the checkpoint's adaptive KL coefficient is {coef!r}, not a positive number")
        self.coef = coef
