"""vLLM sleep mode around learning phases: colocated engines give the GPU to the learner.

    from megatron_rl.rollout.sleep import SleepCycle, choose_sleep
    on, why = choose_sleep(placement="colocated", device="cuda", mode="sync", requested=None)
    cycle = SleepCycle(lambda: fleet.workers, enabled=on, reason=why)
    cycle.before_learn()      # engines sleep (level 1: weights to host memory, KV cache freed)
    learner.train_step(...)
    cycle.before_refit()      # engines wake (weights back, KV cache re-allocated, scheduling on)
    learner.publish(...)      # the load and the refit check run on a wide-awake engine

Level 1, not 2: a publication can still be refused after checking (vllm_engine.VerifiedCommit),
and the engine must then keep serving the version it had; level 2 would discard those weights.
Waking happens before the refit, not after it, because the refit check scores probe sequences
on the engine (it needs its KV cache) before the group commits.

When it is used (choose_sleep):
  cuda + colocated + sync   on: nothing generates while the learner learns (the producer waits
                            for the next version before it starts a round).
  run.mode one_step_off / async   off: the producer generates while the learner learns.
  disaggregated             off: the engines have GPUs of their own.
  cpu                       off: vLLM 0.32's CPU platform has no sleep mode.  Its
                            `is_sleep_mode_available()` is False (platforms/interface.py: CUDA,
                            ROCm and XPU only), so `enable_sleep_mode=True` makes ModelConfig
                            raise "Sleep mode is not supported on current platform", and the CPU
                            worker's sleep()/wake_up() only log "not supported on CPU, ignore it".
rollout.sleep_mode unset (None) follows that rule and logs the reason when off; true where it
cannot work is a ConfigError naming the field; false never sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron_rl.config import ConfigError

log = logging.getLogger(__name__)

FIELD = "rollout.sleep_mode"
LEVEL = 1  # weights to host memory, KV cache discarded (see the docstring for why not 2)

CPU_REASON = ("vLLM 0.32's CPU platform has no sleep mode (is_sleep_mode_available() is False, "
              "enable_sleep_mode raises, the CPU worker's sleep/wake_up are no-ops)")


def _why_not(placement: str, device: str, mode: str) -> str | None:
    if device != "cuda":
        return CPU_REASON
    if placement != "colocated":
        return "run.placement 'disaggregated': the engines have GPUs of their own, nothing to free"
    if mode != "sync":
        return f"run.mode {mode!r} generates while the learner learns; a sleeping engine cannot"
    return None


def choose_sleep(*, placement: str, device: str, mode: str, requested: bool | None = None) -> tuple[bool, str]:
    """(use sleep mode?, why), decided once at start-up; `requested` None follows the rule,
    True where it cannot work is a ConfigError naming rollout.sleep_mode, False is off."""
    if requested is False:
        return False, f"{FIELD} is false"
    why_not = _why_not(placement, device, mode)
    if why_not is None:
        return True, "colocated on GPUs in sync mode: engines sleep while the learner learns"
    if requested is True:
        raise ConfigError(f"{FIELD} true cannot work here: {why_not} (leave it unset or set it false)")
    return False, why_not


def ray_call(workers: list, method: str, *args) -> list:
    """Call `method` on every RolloutWorker actor and wait for all of them."""
    import ray

    return ray.get([getattr(w, method).remote(*args) for w in workers])


class SleepCycle:
    """Puts the rollout engines to sleep before a learner step and wakes them before the refit.

    Calls are idempotent per phase (a second before_learn while asleep does nothing), so a retried
    step or a publication attempt repeated after a refusal never sleeps or wakes twice.  Disabled,
    it does nothing and says why once.
    """

    def __init__(self, workers: Callable[[], list], *, enabled: bool, reason: str,
                 call: Callable[..., list] | None = None) -> None:
        self.workers, self.enabled, self.reason = workers, enabled, reason  # workers(): the live fleet
        self.call = call or ray_call
        self.asleep = False
        self.sleeps = 0  # how many times the engines were put to sleep (metrics, tests)
        log.debug("vLLM sleep mode %s: %s", "on" if enabled else "off", reason)

    def before_learn(self) -> None:
        """The learner is about to learn: free the engines' GPU memory (nothing generates now)."""
        if not self.enabled or self.asleep:
            return
        self.call(self.workers(), "sleep", LEVEL)
        self.asleep = True
        self.sleeps += 1

    def before_refit(self) -> None:
        """Weights are about to be published (or the engines are about to generate): wake them."""
        if not self.enabled or not self.asleep:
            return
        self.call(self.workers(), "wake_up", None)
        self.asleep = False

    before_generation = before_refit
