"""A pool of grader processes with a per-response timeout; hung or dead workers are replaced.

    with VerifierPool(RewardConfig(timeout_s=2.0, num_workers=2)) as pool:
        scores = pool.score(responses, references)          # list[Score], same order
        pool.counters()  # {"scored": .., "timeout": .., "crash": .., "grader_error": .., "replaced": ..}

Each worker is a separate process fed through its own pipe.  A response whose grading runs
past `timeout_s` gets `Score.error == "timeout"`; its worker is killed (SIGKILL) and a fresh
one started, so a hung grader never blocks the pool.  A worker that dies mid-task gives
`error == "crash"`; an exception raised by the grader gives `error == "grader_error"`.
Errored scores carry no reward value (None), never a zero.

`grader` is any picklable top-level function `(response, reference, cfg, length[, context]) -> Score`
(default: reward/math_verifier.grade, the math verifier or the config's own reward function; `context` is
passed only when the caller gives one).  Tests pass doubles that sleep or exit to inject failures.
Processes start with the "spawn" method by default, so the calling script needs an
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_conn
import threading
import time
from typing import Any, Callable, Sequence

from megatron_rl.reward.function import callable_payloads
from megatron_rl.reward.math_verifier import RewardConfig, Score, grade

logger = logging.getLogger(__name__)

ERROR_CODES = ("timeout", "crash", "grader_error")
_READY = "ready"
STARTUP_TIMEOUT_S = 120.0
Grader = Callable[[str, str, RewardConfig, "int | None"], Score]


def _worker_main(conn: mp_conn.Connection, grader: Grader, cfg: RewardConfig, callables: dict) -> None:
    """Worker loop: receive (index, response, reference, length, context), send back (index, status, payload).
    `callables`: the reward functions handed to the Python API as callables (reward/function.py)."""
    from megatron_rl.fault_hooks import drill_spec, hangs, record_injection
    from megatron_rl.reward.function import install_callables

    install_callables(callables)

    drill = drill_spec("verifier_timeout")  # `megatron-rl drill verifier_timeout`: a share of calls hang
    conn.send(_READY)  # grading timeouts start only once the worker is up
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        index, response, reference, length, context = task
        if drill is not None and hangs(drill, response, reference):
            record_injection(drill, response=response[:40])
            time.sleep(3600)  # the pool's timeout kills this process
        try:
            result: Any = grader(response, reference, cfg, length, *(() if context is None else (context,)))
            status = "ok"
        except Exception as err:  # a grader bug must come back as an error code, not kill the worker
            result, status = f"{type(err).__name__}: {err}", "grader_error"
        conn.send((index, status, result))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: mp_conn.Connection
    task: int | None = None
    deadline: float = 0.0


class VerifierPool:
    """Grade responses in `cfg.num_workers` processes with a per-response timeout."""

    def __init__(self, cfg: RewardConfig, *, grader: Grader = grade, start_method: str = "spawn") -> None:
        self.cfg = cfg
        self.grader = grader
        self.grader_version = cfg.grader_version()
        self._ctx = mp.get_context(start_method)
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._workers: list[_Worker] = [self._start_worker() for _ in range(cfg.num_workers)]
        self._closed = False

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main, args=(child, self.grader, self.cfg, callable_payloads()),
                                 daemon=True,
                                 name="megatron-rl-grader")
        proc.start()
        child.close()  # only the worker holds its end: its death makes our end readable (EOF)
        # Wait for the worker to come up, so process start-up never counts against timeout_s.
        try:
            ready = parent.poll(STARTUP_TIMEOUT_S) and parent.recv() == _READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            proc.kill()
            proc.join(timeout=5.0)
            raise RuntimeError(
                f"grader worker did not start within {STARTUP_TIMEOUT_S} s (exit code {proc.exitcode}); "
                f"is the grader {getattr(self.grader, '__qualname__', self.grader)!r} importable by name?"
            )
        return _Worker(proc, parent)

    def _replace(self, slot: int, reason: str) -> None:
        old = self._workers[slot]
        if old.process.is_alive():
            old.process.kill()
        old.process.join(timeout=5.0)
        old.conn.close()
        self._counts["replaced"] += 1
        logger.warning("grader worker pid %s %s; replaced", old.process.pid, reason)
        self._workers[slot] = self._start_worker()

    def score(self, responses: Sequence[str], references: Sequence[str],
              lengths: Sequence[int] | None = None, contexts: Sequence[dict] | None = None) -> list[Score]:
        """Grade responses[i] against references[i]; lengths[i] (tokens) feeds the overlong penalty;
        contexts[i] (prompt text and the example's fields) goes to a reward function (reward/function.py)."""
        if len(responses) != len(references):
            raise ValueError(f"{len(responses)} responses but {len(references)} references")
        if lengths is not None and len(lengths) != len(responses):
            raise ValueError(f"{len(lengths)} lengths but {len(responses)} responses")
        if contexts is not None and len(contexts) != len(responses):
            raise ValueError(f"{len(contexts)} contexts but {len(responses)} responses")
        if self._closed:
            raise RuntimeError("VerifierPool is closed")
        with self._lock:
            return self._score_locked(responses, references, lengths, contexts)

    def _score_locked(self, responses, references, lengths, contexts) -> list[Score]:
        results: list[Score | None] = [None] * len(responses)
        pending = collections.deque(range(len(responses)))
        while pending or any(w.task is not None for w in self._workers):
            for slot in range(len(self._workers)):
                if self._workers[slot].task is None and pending:
                    i = pending[0]
                    task = (i, responses[i], references[i], None if lengths is None else lengths[i],
                            None if contexts is None else contexts[i])
                    try:
                        self._workers[slot].conn.send(task)
                    except (BrokenPipeError, ConnectionResetError):
                        self._counts["crash"] += 1
                        self._replace(slot, "was found dead while idle")
                        continue  # item stays pending for the fresh worker
                    pending.popleft()
                    w = self._workers[slot]
                    w.task, w.deadline = i, time.monotonic() + self.cfg.timeout_s
            busy = [(slot, w) for slot, w in enumerate(self._workers) if w.task is not None]
            wait_s = max(0.0, min(w.deadline for _, w in busy) - time.monotonic())
            ready = set(mp_conn.wait([w.conn for _, w in busy] + [w.process.sentinel for _, w in busy], timeout=wait_s))
            now = time.monotonic()
            for slot, w in busy:
                index = w.task
                if w.conn in ready or w.process.sentinel in ready:
                    results[index] = self._collect(slot, w)
                elif now >= w.deadline:
                    results[index] = Score.failed("timeout", self.grader_version, f"over {self.cfg.timeout_s} s")
                    self._counts["timeout"] += 1
                    self._replace(slot, f"timed out on item {index}")
        return [r for r in results if r is not None]

    def _collect(self, slot: int, w: _Worker) -> Score:
        index = w.task
        w.task = None
        try:
            got_index, status, payload = w.conn.recv() if w.conn.poll() else (None, "crash", None)
        except (EOFError, OSError):
            got_index, status, payload = None, "crash", None
        if status == "crash" or got_index != index:
            code = w.process.exitcode
            self._counts["crash"] += 1
            self._replace(slot, f"died on item {index} (exit code {code})")
            return Score.failed("crash", self.grader_version, f"worker exit code {code}")
        if status == "grader_error":
            self._counts["grader_error"] += 1
            logger.warning("grader raised on item %d: %s", index, payload)
            return Score.failed("grader_error", self.grader_version, str(payload))
        self._counts["scored"] += 1
        return payload

    def counters(self) -> dict[str, int]:
        """Running totals: scored, timeout, crash, grader_error, replaced."""
        return {k: int(self._counts.get(k, 0)) for k in ("scored", *ERROR_CODES, "replaced")}

    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass  # already gone
        for w in self._workers:
            w.process.join(timeout=2.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=2.0)
            w.conn.close()

    def __enter__(self) -> "VerifierPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def summarize_scores(scores: Sequence[Score]) -> dict[str, float]:
    """Means of each reward component over valid scores, plus error counts (metric-ready, no panel prefix).
    A value a grader does not give (a reward function's format) has mean NaN."""
    valid = [s for s in scores if s.ok]
    out: dict[str, float] = {"count": float(len(scores)), "valid": float(len(valid))}
    for name in ("reward", "correctness", "format", "overlong"):
        vals = [getattr(s, name) for s in valid if getattr(s, name) is not None]
        out[f"{name}_mean"] = sum(vals) / len(vals) if vals else float("nan")
    for code in ERROR_CODES:
        out[f"error_{code}"] = float(sum(1 for s in scores if s.error == code))
    return out
