"""The rollout fleet the driver uses; it lives in megatron_rl/rollout/fleet.py (restart and refit of
dead engines included).  Kept so `from megatron_rl.train.rollout_fleet import RolloutFleet` works.

    from megatron_rl.train.rollout_fleet import RolloutFleet
"""

from megatron_rl.rollout.fleet import PendingRollout, RolloutFailed, RolloutFleet

__all__ = ["PendingRollout", "RolloutFailed", "RolloutFleet"]
