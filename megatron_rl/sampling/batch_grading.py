"""Grading the prompt groups that finish together in one verifier call (a streaming producer's grader).

    grader = GradeBatcher(scorer.grade)      # grade(samples) -> their Scores, in order
    scores = grader(samples)                 # from any group's thread; blocks until this group is graded
    grader.take_calls()                      # (calls, groups) graded since the last take: the batching achieved

A group whose last sample ends while another group is being graded does not start a call of its own: it
waits, and when the call under way returns, one of the waiting threads grades every group that queued
meanwhile in one call (group commit), then hands each thread its own group's scores.  One group alone is
graded at once, as before; groups finishing together cost one verifier round trip instead of one each, and
no group waits longer than one call's length for a call to start.  A call that raises fails every group in it
(each thread raises the error, as its own grading would have).
"""

from __future__ import annotations

import threading
from typing import Callable


class _Pending:
    def __init__(self, samples: list) -> None:
        self.samples = samples
        self.scores: list | None = None
        self.error: BaseException | None = None
        self.done = False


class GradeBatcher:
    """One verifier call at a time; each call grades every group queued when it starts."""

    def __init__(self, grade: Callable[[list], list]) -> None:
        self.grade = grade
        self._cond = threading.Condition()
        self._queued: list[_Pending] = []
        self._grading = False
        self._calls = self._groups = 0

    def __call__(self, samples: list) -> list:
        mine = _Pending(samples)
        with self._cond:
            self._queued.append(mine)
            while self._grading and not mine.done:
                self._cond.wait()
            if not mine.done:  # no call under way: this thread grades everything queued, its own group included
                batch, self._queued, self._grading = self._queued, [], True
        if not mine.done:
            self._grade_all(batch)
        if mine.error is not None:
            raise mine.error
        return mine.scores

    def _grade_all(self, batch: list[_Pending]) -> None:
        scores, error = None, None
        samples = [s for p in batch for s in p.samples]
        try:
            scores = self.grade(samples)
            if len(scores) != len(samples):
                raise RuntimeError(f"the grader returned {len(scores)} scores for {len(samples)} samples")
        except BaseException as err:  # every group of the call fails with it
            error = err
        with self._cond:
            first = 0
            for p in batch:
                if error is None:
                    p.scores = list(scores[first:first + len(p.samples)])
                    first += len(p.samples)
                p.error, p.done = error, True
            self._calls += 1
            self._groups += len(batch)
            self._grading = False
            self._cond.notify_all()

    def take_calls(self) -> tuple[int, int]:
        """(verifier calls, groups graded) since the last take."""
        with self._cond:
            taken, self._calls, self._groups = (self._calls, self._groups), 0, 0
        return taken
