"""Threads that run environment steps: reused, never shared by two calls at once, never joined at exit,
retired after a while idle.

    threads = StepThreads()
    value = threads.call(lambda: env.step(text), timeout_s=30)   # blocking; StepTimeout past the limit
    value = await threads.run(fn, arg)                          # from an event loop, which keeps running
    first, value, seconds = await threads.run_timed(step, 30, before=lookup)   # value may be the error / StepTimeout

Every call gets a thread of its own for as long as it runs, so a slow tool makes no other call wait
(a fixed pool of N threads queued the tool calls of more than N episodes: benchmarks/multiturn_throughput.md).
A thread whose call finished goes back to the idle stack and takes the next call, so a turn costs a
hand-off, not a thread start.  A call that outlives its timeout keeps its thread until it returns (then
the thread is idle again); the threads are daemons, so a tool stuck for good never holds the process at
exit.  A thread idle for `idle_s` (60 s) ends, so a burst of many episodes at once leaves no crowd of
idle threads behind for the rest of the run.  Hand-offs cost more than they look: on a 2-core VM one
thread waking another on the other core took ~240 us (24 us on one core), so an awaited step takes one
hand-off out and one back, and its timeout is watched by the event loop, not by a third thread.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import Any, Callable


class StepTimeout(Exception):
    """An environment step ran past the per-step timeout."""


class _Box:
    """One call's outcome, handed from the thread that ran it to the caller."""

    __slots__ = ("done", "value", "error")

    def __init__(self):
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class StepThreads:
    """An elastic set of daemon threads; idle ones are reused, a busy one is never waited for."""

    def __init__(self, name: str = "env-step", idle_s: float = 60.0):
        if not idle_s > 0:
            raise ValueError(f"StepThreads idle_s must be > 0 seconds, got {idle_s!r}")
        self.name, self.idle_s = name, idle_s
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()
        self._count = itertools.count()

    def submit(self, fn: Callable[[], Any], notify: Callable[[_Box], None] | None = None) -> _Box:
        """Start fn() on an idle thread (or a new one); `notify(box)` is called on that thread when it ends."""
        box = _Box()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=f"{self.name}-{next(self._count)}",
                             daemon=True).start()
        inbox.put((fn, box, notify))
        return box

    def call(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """fn()'s value, its exception re-raised, or StepTimeout after timeout_s (its thread left to it)."""
        box = self.submit(fn)
        if not box.done.wait(timeout_s):
            raise StepTimeout(f"environment step still running after {timeout_s:g} s")
        return box.outcome()

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on a step thread, awaited from the running event loop (which goes on meanwhile)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def wake(box: _Box) -> None:
            loop.call_soon_threadsafe(_settle, future, box)

        self.submit(lambda: fn(*args), wake)
        return await future

    async def run_timed(self, step: Callable[[], Any], timeout_s: float,
                        before: Callable[[], Any] | None = None) -> tuple[Any, Any, float]:
        """before() (unbounded: it may wait for work of this loop), then step() bounded by timeout_s, on one
        thread, awaited from the running loop: (before's value, step's value or the exception it raised or a
        StepTimeout, the step's seconds).  An exception of before() is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        began: list[tuple[float, Any]] = []

        def job() -> tuple[Any, Any, float]:
            first = before() if before is not None else None
            began.append((time.monotonic(), first))
            try:
                value = step()
            except BaseException as err:  # the step's failure is its caller's to judge
                value = _as_failure(err)
            return first, value, time.monotonic() - began[0][0]

        self.submit(job, lambda box: loop.call_soon_threadsafe(_settle, future, box))
        try:
            wait = timeout_s
            while not (await asyncio.wait({future}, timeout=wait))[0]:
                if began:  # the step is running: its own clock
                    wait = began[0][0] + timeout_s - time.monotonic()
                    if wait <= 0:
                        late = StepTimeout(f"environment step still running after {timeout_s:g} s")
                        return began[0][1], late, time.monotonic() - began[0][0]
            return future.result()
        finally:
            if not future.done():  # timed out, or this task was cancelled: nobody takes the outcome
                future.cancel()

    @property
    def alive(self) -> int:
        """Threads of this pool alive now, busy or idle."""
        return sum(t.name.startswith(f"{self.name}-") for t in threading.enumerate())

    def _next(self, inbox: queue.SimpleQueue) -> tuple | None:
        """The next call for this thread, or None once it has been idle for idle_s and may end."""
        while True:
            try:
                return inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody took it: off the stack, so nobody can
                        self._idle.remove(inbox)
                        return None
                # submit() took this inbox and puts its call right after: wait for it

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (item := self._next(inbox)) is not None:
            fn, box, notify = item
            try:
                box.value = fn()
            except BaseException as err:  # handed to the caller, which decides
                box.error = _as_failure(err)
            box.done.set()
            if notify is not None:
                notify(box)
            with self._lock:  # only now free: a call that timed out never got here while it ran
                self._idle.append(inbox)


def _as_failure(err: BaseException) -> Exception:
    """What a call raised, as its caller gets it: sys.exit / KeyboardInterrupt inside a step are still the
    environment's failure, not the caller's."""
    return err if isinstance(err, Exception) else RuntimeError(f"step ended with {type(err).__name__}: {err}")


def _settle(future: asyncio.Future, box: _Box) -> None:
    if future.done():  # the awaiting task was cancelled meanwhile
        return
    if box.error is not None:
        future.set_exception(box.error)
    else:
        future.set_result(box.value)


_SHARED = StepThreads()


def shared_step_threads() -> StepThreads:
    """The process's one pool (environment steps of every runner and player in it)."""
    return _SHARED
