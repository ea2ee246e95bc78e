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
cannot work is a ConfigError naming the field: at config load for the placement and run.mode
(config_problem), at start-up for the device; false never sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from megatron_rl.config import ConfigError
from megatron_rl.publish.vllm_adapters import sleep_blocked

log = logging.getLogger(__name__)

FIELD = "rollout.sleep_mode"
LEVEL = 1  # weights to host memory, KV cache discarded (see the docstring for why not 2)

CPU_REASON = ("vLLM 0.32's CPU platform has no sleep mode (is_sleep_mode_available() is False, "
              "enable_sleep_mode raises, the CPU worker's sleep/wake_up are no-ops)")


def _config_why_not(placement: str, mode: str) -> str | None:
    """Why sleep cannot work whatever the device (known when the config is loaded)."""
    if placement != "colocated":
        return "run.placement 'disaggregated': the engines have GPUs of their own, nothing to free"
    if mode != "sync":
        return (f"run.mode {mode!r} generates while the learner learns (the producer does not wait for the "
                f"next version), and a sleeping engine cannot generate; only run.mode 'sync' can sleep")
    return None


def _why_not(placement: str, device: str, mode: str) -> str | None:
    if device != "cuda":
        return CPU_REASON
    return _config_why_not(placement, mode)


def config_problem(*, placement: str, mode: str, requested: bool | None) -> str | None:
    """The message for `rollout.sleep_mode: true` where no device could make it work (checked with
    the config, train/config.py, before anything starts); None when it may work."""
    why_not = _config_why_not(placement, mode) if requested is True else None
    return None if why_not is None else f"{FIELD} true cannot work here: {why_not} (leave it unset or set it false)"


def choose_sleep(*, placement: str, device: str, mode: str, requested: bool | None = None,
                 adapter: dict | None = None) -> tuple[bool, str]:
    """(use sleep mode?, why), decided once at start-up; `requested` None follows the rule,
    True where it cannot work is a ConfigError naming rollout.sleep_mode, False is off.  `adapter`: what the
    engines serve (RolloutConfig.adapter); a LoRA run's never sleep (publish/vllm_adapters.py sleep_blocked)."""
    if requested is False:
        return False, f"{FIELD} is false"
    why_not = _why_not(placement, device, mode) or sleep_blocked(adapter)
    if why_not is None:
        return True, "colocated on GPUs in sync mode: engines sleep while the learner learns"
    if requested is True:
        raise ConfigError(f"{FIELD} true cannot work here: {why_not} (leave it unset or set it false)")
    return False, why_not


def engine_sleep(worker):
    """The rollout worker's sleep (RolloutWorker.sleep(level)), as a Ray actor method."""
    return worker.sleep


def engine_wake_up(worker):
    """The rollout worker's wake_up (RolloutWorker.wake_up(tags)), as a Ray actor method."""
    return worker.wake_up


def ray_call(workers: list, method: Callable, *args) -> list:
    """Call `method(worker)` (engine_sleep, engine_wake_up) on every RolloutWorker actor at once; per worker,
    its result or the exception it raised (one engine failing does not hide whether the others slept or woke)."""
    import ray

    refs = [method(w).remote(*args) for w in workers]
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except Exception as err:  # noqa: BLE001 - returned to the caller, which raises it
            out.append(err)
    return out


class SleepCycle:
    """Puts the rollout engines to sleep before a learner step and wakes them before the refit.

    The state is per engine: the cycle remembers which worker actors it put to sleep.  The fleet
    replaces the actor of a group whose engine died (rollout/fleet.py), and a restarted engine
    comes back awake, so a worker the cycle never put to sleep is awake: the next before_learn
    sleeps it, and before_refit wakes only the workers that sleep now.  Calls are idempotent per
    phase (a second before_learn while asleep does nothing), so a retried step or a publication
    attempt repeated after a refusal never sleeps or wakes an engine twice.  An engine whose wake
    failed stays asleep for the cycle and is woken again at the next refit.  Disabled, it does
    nothing and says why once.
    """

    def __init__(self, workers: Callable[[], list], *, enabled: bool, reason: str,
                 call: Callable[..., list] | None = None) -> None:
        self.workers, self.enabled, self.reason = workers, enabled, reason  # workers(): the live fleet
        self.call = call or ray_call
        self.sleeping: list = []  # the live workers this cycle put to sleep and has not woken
        self.sleeps = 0  # how many times the engines were put to sleep (metrics, tests)
        log.debug("vLLM sleep mode %s: %s", "on" if enabled else "off", reason)

    @property
    def asleep(self) -> bool:
        """Whether some engine of the live fleet sleeps."""
        return bool(self._live_sleeping())

    def _live_sleeping(self) -> list:
        """Forget workers the fleet replaced (their engines are gone); the sleeping ones left."""
        live = list(self.workers())
        self.sleeping = [w for w in self.sleeping if w in live]
        return self.sleeping

    def _apply(self, workers: list, method: Callable, *args) -> tuple[list, BaseException | None]:
        """Call `method` on `workers`: the workers it succeeded on, and the first failure (or None)."""
        if not workers:
            return [], None
        results = self.call(workers, method, *args)
        done = [w for w, r in zip(workers, results) if not isinstance(r, BaseException)]
        errors = [r for r in results if isinstance(r, BaseException)]
        return done, (errors[0] if errors else None)

    def before_learn(self) -> None:
        """The learner is about to learn: free the engines' GPU memory (nothing generates now)."""
        if not self.enabled:
            return
        sleeping = self._live_sleeping()
        awake = [w for w in self.workers() if w not in sleeping]
        if not awake:
            return
        done, err = self._apply(awake, engine_sleep, LEVEL)
        self.sleeping.extend(done)
        if done:
            self.sleeps += 1
        if err is not None:
            raise err

    def before_refit(self) -> None:
        """Weights are about to be published (or the engines are about to generate): wake them."""
        if not self.enabled:
            return
        sleeping = list(self._live_sleeping())
        done, err = self._apply(sleeping, engine_wake_up, None)
        self.sleeping = [w for w in self.sleeping if w not in done]
        if err is not None:
            raise err

    before_generation = before_refit
