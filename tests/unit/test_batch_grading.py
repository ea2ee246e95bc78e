"""The streaming producer's grader (sampling/batch_grading.py): groups that finish while a verifier call is
under way are graded together in the next call, each thread gets its own group's scores, and an error reaches
every group of the call that raised it."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_rl.sampling.batch_grading import GradeBatcher

pytestmark = pytest.mark.unit


class _SlowGrader:
    """A test double for the verifier pool: the first call blocks until released; records every call."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.calls: list[list[str]] = []
        self.release = threading.Event()
        self.fail_on = fail_on

    def __call__(self, samples: list) -> list:
        self.calls.append(list(samples))
        if len(self.calls) == 1:
            assert self.release.wait(10)
        if self.fail_on in samples:
            raise ValueError(f"grader crashed on {self.fail_on}")
        return [f"score({s})" for s in samples]


def _in_thread(grader: GradeBatcher, samples: list, out: dict, key: str) -> threading.Thread:
    def run():
        try:
            out[key] = grader(samples)
        except BaseException as err:  # noqa: BLE001 -- the test reads it
            out[key] = err
    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_queued(grader: GradeBatcher, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(grader._queued) < n:
        assert time.monotonic() < deadline, "the groups never queued"
        time.sleep(0.01)


def test_a_group_alone_is_graded_at_once_with_its_own_scores():
    grade = _SlowGrader()
    grade.release.set()
    grader = GradeBatcher(grade)
    assert grader(["a1", "a2"]) == ["score(a1)", "score(a2)"]
    assert grader(["b1"]) == ["score(b1)"]
    assert grade.calls == [["a1", "a2"], ["b1"]] and grader.take_calls() == (2, 2)
    assert grader.take_calls() == (0, 0)  # counted since the last take


def test_groups_finishing_during_a_call_are_graded_together_in_the_next_one():
    grade = _SlowGrader()
    grader, out = GradeBatcher(grade), {}
    first = _in_thread(grader, ["a1", "a2"], out, "a")
    deadline = time.monotonic() + 10
    while not grade.calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    later = [_in_thread(grader, ["b1", "b2"], out, "b"), _in_thread(grader, ["c1", "c2"], out, "c")]
    _wait_queued(grader, 2)  # both wait behind the call under way
    grade.release.set()
    for t in (first, *later):
        t.join(10)
    assert len(grade.calls) == 2 and grade.calls[0] == ["a1", "a2"]
    assert sorted(grade.calls[1]) == ["b1", "b2", "c1", "c2"]  # one call for both
    assert out == {"a": ["score(a1)", "score(a2)"], "b": ["score(b1)", "score(b2)"], "c": ["score(c1)", "score(c2)"]}
    assert grader.take_calls() == (2, 3)


def test_an_error_reaches_every_group_of_its_call_and_not_the_others():
    grade = _SlowGrader(fail_on="c1")
    grader, out = GradeBatcher(grade), {}
    first = _in_thread(grader, ["a1"], out, "a")
    while not grade.calls:
        time.sleep(0.01)
    later = [_in_thread(grader, ["b1"], out, "b"), _in_thread(grader, ["c1"], out, "c")]
    _wait_queued(grader, 2)
    grade.release.set()
    for t in (first, *later):
        t.join(10)
    assert out["a"] == ["score(a1)"]
    assert isinstance(out["b"], ValueError) and isinstance(out["c"], ValueError) and "c1" in str(out["c"])
    assert grader(["d1"]) == ["score(d1)"]  # the grader goes on after a failed call


def test_a_grader_returning_the_wrong_number_of_scores_fails_the_call():
    grader = GradeBatcher(lambda samples: ["one score"])
    with pytest.raises(RuntimeError, match="returned 1 scores for 2 samples"):
        grader(["a1", "a2"])
