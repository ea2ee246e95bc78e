"""After a resume at step S the abandoned attempt's steps > S are not counted twice (issue #12).

    python -m pytest tests/unit/test_metrics_resume.py -q

Attempt 1 logs steps 0..4 and dies after its checkpoint at step 2; attempt 2 opens the same
directory, rewinds to 2 and logs 3..5 with other values.  metrics.jsonl and TensorBoard (read
back with its own EventAccumulator) must hold each step once, with attempt 2's values.
"""

from __future__ import annotations

import json
import time

import pytest

from megatron_rl.metrics import MetricsLogger

pytestmark = pytest.mark.unit


def _two_attempts(tmp_path, keep_through: int):
    with MetricsLogger(tmp_path) as log:
        for step in range(5):
            log.log(step, {"learn/loss": 1.0 + step})
    time.sleep(1.1)  # event file names carry whole seconds
    with MetricsLogger(tmp_path) as log:
        log.rewind(keep_through)
        for step in range(keep_through + 1, 6):
            log.log(step, {"learn/loss": 10.0 + step})


def test_jsonl_keeps_each_step_once(tmp_path):
    _two_attempts(tmp_path, 2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["learn/loss"]) for r in rows] == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 13.0), (4, 14.0),
                                                           (5, 15.0)]


def test_tensorboard_purges_the_abandoned_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _two_attempts(tmp_path, 2)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("learn/loss")] == [(0, 1.0), (1, 2.0), (2, 3.0), (3, 13.0),
                                                                     (4, 14.0), (5, 15.0)]


def test_fresh_start_forgets_everything_and_a_torn_line(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(0, {"eval/test_reward": 0.1})
        log.log(1, {"learn/loss": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "learn/lo')  # a crash mid-write
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.rewind(-1)
        log.log(0, {"eval/test_reward": 0.2})
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "time": rows[0]["time"], "eval/test_reward": 0.2}]


def test_test_evals_read_back_after_a_rewind(tmp_path):
    """The final test eval an attempt logged at its last step is found again after a rewind to that
    step (a resumed run that already ended takes it instead of evaluating and logging once more);
    one logged after the rewind point is not."""
    from megatron_rl.metrics import logged_test_evals

    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(0, {"eval/test_reward": 0.5, "eval/test_correctness": 0.25, "eval/test_format": 1.0})
        log.log(3, {"learn/loss": 1.0})
        log.log(3, {"eval/test_reward": 1.5, "eval/test_correctness": 0.75, "eval/test_format": 1.0,
                    "eval/test_verifier_errors": 0.0})
        log.log(4, {"eval/test_reward": 2.0, "eval/test_correctness": 1.0, "eval/test_format": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "eval/test_rew')  # torn line
    with MetricsLogger(tmp_path, tensorboard=False) as log:
        log.rewind(3)
    assert logged_test_evals(tmp_path / "metrics.jsonl") == {
        0: {"reward": 0.5, "correctness": 0.25, "format": 1.0}, 3: {"reward": 1.5, "correctness": 0.75, "format": 1.0}}
    assert logged_test_evals(tmp_path / "missing.jsonl") == {}
