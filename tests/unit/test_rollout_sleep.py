"""The order of vLLM sleep/wake around learning phases (rollout/sleep.py SleepCycle).

    python -m pytest tests/unit/test_rollout_sleep.py -q

Sleep needs CUDA (vLLM 0.32's CPU platform has none), so the engines' side cannot run here.  What
is tested is the order the driver asks for, recorded at the one place where it reaches the
engines (SleepCycle's `call`): sleep before every learner step, wake before every refit, never
twice in a row, nothing when disabled, a wake that fails is not forgotten, and the state is per
engine (an engine the fleet restarted comes back awake).
"""

import pytest

from megatron_rl.rollout.sleep import LEVEL, SleepCycle

pytestmark = pytest.mark.unit


class MethodName:
    """A stand-in worker whose every method is its name."""

    def __getattr__(self, name):
        return name


class Engines:
    """Records each call the cycle makes on the fleet (the real one goes through Ray, ray_call).
    `fail_wake` whole calls raise; `fail` maps (method, worker) to how many of its calls fail (the
    worker's result is then the exception, as ray_call returns it)."""

    def __init__(self, fail_wake: int = 0, fail: dict | None = None):
        self.calls, self.fail_wake, self.fail = [], fail_wake, dict(fail or {})

    def __call__(self, workers, method, *args):
        method = method(MethodName())  # engine_sleep / engine_wake_up pick a worker's method: record its name
        if method == "wake_up" and self.fail_wake:
            self.fail_wake -= 1
            raise RuntimeError("engine died while waking (injected)")
        self.calls.append((tuple(workers), method, args))
        out = []
        for w in workers:
            if self.fail.get((method, w)):
                self.fail[(method, w)] -= 1
                out.append(RuntimeError(f"{w} failed to {method} (injected)"))
            else:
                out.append(None)
        return out


def drive(cycle, steps, publish_attempts=1):
    """The driver's order per step (train/driver.py through roles.learn / roles.publish)."""
    for _ in range(steps):
        cycle.before_learn()              # roles.learn, before learner.train_step
        for _ in range(publish_attempts):
            cycle.before_refit()          # roles.publish, before the weights go out


def test_sleep_before_each_learn_wake_before_each_refit():
    engines = Engines()
    cycle = SleepCycle(lambda: ["g0", "g1"], enabled=True, reason="test", call=engines)
    drive(cycle, steps=3)
    assert [(m, a) for _, m, a in engines.calls] == [("sleep", (LEVEL,)), ("wake_up", (None,))] * 3
    assert all(w == ("g0", "g1") for w, _, _ in engines.calls)
    assert cycle.sleeps == 3 and not cycle.asleep


def test_repeated_phases_do_not_sleep_or_wake_twice():
    """A publication retried after a refused refit check wakes once; a retried learner step sleeps once."""
    engines = Engines()
    cycle = SleepCycle(lambda: ["g0"], enabled=True, reason="test", call=engines)
    cycle.before_refit()  # start-up: the engines are awake, nothing to wake
    cycle.before_learn()
    cycle.before_learn()
    drive(cycle, steps=1, publish_attempts=2)
    assert [m for _, m, _ in engines.calls] == ["sleep", "wake_up"]


def test_disabled_cycle_never_calls_the_engines():
    engines = Engines()
    cycle = SleepCycle(lambda: ["g0"], enabled=False, reason="cpu", call=engines)
    drive(cycle, steps=2)
    assert engines.calls == [] and cycle.sleeps == 0


def test_failed_wake_is_retried_at_the_next_refit():
    """An engine that failed to wake is still asleep for the cycle: the next refit wakes it again
    instead of publishing into a sleeping engine."""
    engines = Engines(fail_wake=1)
    cycle = SleepCycle(lambda: ["g0"], enabled=True, reason="test", call=engines)
    cycle.before_learn()
    with pytest.raises(RuntimeError, match="injected"):
        cycle.before_refit()
    assert cycle.asleep
    cycle.before_refit()
    assert [m for _, m, _ in engines.calls] == ["sleep", "wake_up"] and not cycle.asleep


def test_the_live_fleet_is_asked_each_time():
    """A fleet whose engines were restarted between phases is called with its new workers: the
    replaced engine is gone and the restarted one came back awake, so nothing is woken; the next
    learner step puts the new one to sleep."""
    engines, fleet = Engines(), {"workers": ["old"]}
    cycle = SleepCycle(lambda: fleet["workers"], enabled=True, reason="test", call=engines)
    cycle.before_learn()
    fleet["workers"] = ["new"]
    assert not cycle.asleep
    cycle.before_refit()
    cycle.before_learn()
    assert [(w, m) for w, m, _ in engines.calls] == [(("old",), "sleep"), (("new",), "sleep")]


def test_an_engine_restarted_while_the_others_sleep_is_not_woken_but_put_to_sleep():
    """rollout/fleet.py restarts a dead group's engine; the new one is awake.  The refit wakes only
    the engines that sleep (a wake_up on an awake engine is not asked for), and a learner step
    retried after the restart sleeps the new engine instead of leaving it holding GPU memory."""
    engines, fleet = Engines(), {"workers": ["g0", "g1"]}
    cycle = SleepCycle(lambda: fleet["workers"], enabled=True, reason="test", call=engines)
    cycle.before_learn()
    fleet["workers"] = ["g0", "g1-restarted"]
    cycle.before_learn()                  # the step is retried: the restarted engine must sleep too
    cycle.before_refit()
    assert [(w, m) for w, m, _ in engines.calls] == [
        (("g0", "g1"), "sleep"), (("g1-restarted",), "sleep"), (("g0", "g1-restarted"), "wake_up")]
    fleet["workers"] = ["g0", "g1-again"]   # restarted while awake (during generation)
    cycle.before_refit()                  # nothing sleeps: no call
    cycle.before_learn()
    assert engines.calls[3:] == [(("g0", "g1-again"), "sleep", (LEVEL,))]


def test_a_partly_failed_wake_retries_only_the_engine_that_failed():
    engines = Engines(fail={("wake_up", "g1"): 1})
    cycle = SleepCycle(lambda: ["g0", "g1"], enabled=True, reason="test", call=engines)
    cycle.before_learn()
    with pytest.raises(RuntimeError, match="g1 failed to wake_up"):
        cycle.before_refit()
    assert cycle.sleeping == ["g1"]
    cycle.before_refit()
    assert [(w, m) for w, m, _ in engines.calls] == [
        (("g0", "g1"), "sleep"), (("g0", "g1"), "wake_up"), (("g1",), "wake_up")]
    assert not cycle.asleep
