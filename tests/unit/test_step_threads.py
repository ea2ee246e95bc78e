"""StepThreads (envs/step_threads.py): environment calls off the caller's thread, reused, bounded by a timeout."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from megatron_rl.envs.step_threads import StepThreads, StepTimeout


def test_a_finished_call_hands_its_thread_to_the_next_one():
    threads = StepThreads("t-reuse")
    names = {threads.call(lambda: threading.current_thread().name, 5) for _ in range(20)}
    assert len(names) == 1 and threading.current_thread().name not in names


def test_calls_in_flight_never_wait_for_each_other():
    threads, n = StepThreads("t-wide"), 24
    barrier = threading.Barrier(n, timeout=5)  # breaks unless all n run at the same time
    boxes = [threads.submit(barrier.wait) for _ in range(n)]
    for box in boxes:
        assert box.done.wait(10)
        box.outcome()  # a BrokenBarrierError here: some call waited for another's thread


def test_a_call_past_its_timeout_raises_and_its_thread_returns_to_the_pool_when_it_ends():
    threads = StepThreads("t-late")
    release = threading.Event()
    with pytest.raises(StepTimeout, match="still running after 0.1 s"):
        threads.call(release.wait, 0.1)
    assert threads.call(lambda: 7, 5) == 7  # another thread served it meanwhile
    release.set()
    time.sleep(0.2)
    assert len(threads._idle) == 2


def test_errors_come_back_as_they_were_raised_and_an_exit_as_a_runtime_error():
    threads = StepThreads("t-err")
    with pytest.raises(KeyError, match="tool"):
        threads.call(lambda: {}["tool"], 5)
    with pytest.raises(RuntimeError, match="step ended with SystemExit"):
        threads.call(lambda: exit(3), 5)


def test_run_timed_returns_the_step_outcome_and_keeps_the_loop_running():
    threads = StepThreads("t-async")

    async def main():
        ticks = 0

        async def tick():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        first, value, seconds = await threads.run_timed(lambda: time.sleep(0.2) or "obs", 5, before=lambda: "w")
        failed = await threads.run_timed(lambda: 1 / 0, 5)
        ticker.cancel()
        return ticks, first, value, seconds, failed

    ticks, first, value, seconds, failed = asyncio.run(main())
    assert (first, value) == ("w", "obs") and 0.19 < seconds < 2
    assert ticks >= 5  # the loop went on while the step slept
    assert failed[0] is None and isinstance(failed[1], ZeroDivisionError)


def test_run_timed_starts_the_steps_clock_when_the_step_starts_not_before():
    threads = StepThreads("t-clock")

    async def main():
        slow_before = await threads.run_timed(lambda: "ok", 0.2, before=lambda: time.sleep(0.5) or "w")
        stuck = threading.Event()
        late = await threads.run_timed(stuck.wait, 0.2, before=lambda: "w2")
        stuck.set()
        return slow_before, late

    slow_before, late = asyncio.run(main())
    assert slow_before[:2] == ("w", "ok")  # 0.5 s in before() is not the step's time
    assert late[0] == "w2" and isinstance(late[1], StepTimeout) and 0.15 < late[2] < 2


def test_run_timed_raises_what_before_raised():
    threads = StepThreads("t-before")

    def refused():
        raise LookupError("refit check refused")

    async def main():
        await threads.run_timed(lambda: "never", 5, before=refused)

    with pytest.raises(LookupError, match="refit check refused"):
        asyncio.run(main())


def test_threads_idle_past_idle_s_end_and_the_pool_still_serves():
    threads, n = StepThreads("t-retire", idle_s=0.05), 8
    barrier = threading.Barrier(n, timeout=5)
    for box in [threads.submit(barrier.wait) for _ in range(n)]:
        assert box.done.wait(10)
    assert threads.alive >= n - 1  # a burst of n calls at once: n threads (one may be retiring already)
    deadline = time.monotonic() + 5
    while threads.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert threads.alive == 0 and threads._idle == []
    assert threads.call(lambda: 7, 5) == 7  # a new thread for the next call


def test_a_call_handed_to_a_thread_as_it_retires_is_never_lost():
    threads = StepThreads("t-race", idle_s=0.001)  # each thread times out about as often as it is handed a call
    for i in range(300):
        assert threads.call(lambda i=i: i, 5) == i
        time.sleep(0.001 * (i % 3))


def test_idle_s_must_be_positive():
    with pytest.raises(ValueError, match="idle_s"):
        StepThreads("t-bad", idle_s=0)
