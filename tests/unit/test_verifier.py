"""Math verifier (extraction, comparison, reward components) and the grader pool's failure handling.

    python -m pytest tests/unit/test_verifier.py -q
"""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.reward import (
    RewardConfig,
    VerifierPool,
    answers_match,
    extract_answer,
    overlong_penalty,
    parse_number,
    score_response,
    summarize_scores,
)

pytestmark = pytest.mark.unit


def failing_grader(response, reference, cfg, length):
    """Test double: hangs, dies or raises on marker responses; grades normally otherwise."""
    if response == "HANG":
        time.sleep(600)
    if response == "DIE":
        os._exit(3)
    if response == "RAISE":
        raise RuntimeError("grader bug")
    return score_response(response, reference, cfg, length)


@pytest.mark.parametrize(
    "response, extractors, want",
    [
        ("so \\boxed{\\frac{1}{2}} and \\boxed{7}", ["boxed"], ("7", "boxed")),
        ("x \\boxed{{a}+1} done", ["boxed"], ("{a}+1", "boxed")),
        ("The answer is 42.", ["boxed", "answer_is"], ("42", "answer_is")),
        ("Answer: -3/4", ["answer_is"], ("-3/4", "answer_is")),
        ("7x#", ["leading_number"], ("7", "leading_number")),
        ("x7", ["leading_number"], (None, None)),
        ("1, then 2, total 1,234.5 ok", ["last_number"], ("1,234.5", "last_number")),
        ("no numbers", ["boxed", "last_number"], (None, None)),
    ],
)
def test_extraction_order(response, extractors, want):
    assert extract_answer(response, extractors) == want


def test_numeric_comparison():
    assert parse_number("\\frac{3}{4}") == parse_number("0.75") == parse_number("3/4")
    assert answers_match("1,000", "1000")
    assert answers_match("$-2.50$", "-5/2")
    assert answers_match("007", "7")
    assert not answers_match("0.33", "1/3")
    assert not answers_match("8", "7")
    assert answers_match("x + 1", "x+1")  # string fallback
    assert parse_number("1/0") is None and parse_number("abc") is None


def test_overlong_penalty_ramp():
    assert overlong_penalty(10, None, 0) == 0.0
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert overlong_penalty(100, 100, 20) == pytest.approx(-1.0)
    assert overlong_penalty(101, 100, 20) == -1.0
    assert overlong_penalty(101, 100, 0) == -1.0


def test_reward_components_and_control():
    cfg = RewardConfig(format_weight=0.5, overlong_limit=20, overlong_buffer=10)
    s = score_response("the answer is \\boxed{12}", "12", cfg)
    # len 24 > L_max 20: full penalty; reward = 1 + 0.5 - 1.
    assert (s.correctness, s.format, s.overlong) == (1.0, 1.0, -1.0)
    assert s.reward == pytest.approx(0.5) and s.extracted == "12"
    control = score_response("the answer is \\boxed{12}", "12", RewardConfig(correctness_only=True, overlong_limit=20))
    assert control.reward == 1.0 and control.overlong == -1.0


def test_reward_weights():
    cfg = RewardConfig(format_weight=0.5, overlong_limit=30, overlong_buffer=10)
    s = score_response("answer: 13 and \\boxed{12}", "13", cfg, length=25)
    assert (s.correctness, s.format, s.overlong) == (0.0, 1.0, -0.5)
    assert s.reward == pytest.approx(0.5 - 0.5)
    s2 = score_response("answer: 13", "13", cfg, length=5)
    assert (s2.correctness, s2.format, s2.reward) == (1.0, 0.0, 1.0)
    assert s.grader_version == cfg.grader_version() and s.grader_version.startswith("math-1:")
    assert RewardConfig(format_weight=0.2).grader_version() != cfg.grader_version()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="extractors: unknown extractor 'regex'"):
        RewardConfig(extractors=["regex"])
    with pytest.raises(ValueError, match="format_extractors"):
        RewardConfig(extractors=["last_number"], format_extractors=["boxed"])
    with pytest.raises(ValueError, match="overlong_buffer"):
        RewardConfig(overlong_limit=10, overlong_buffer=10)


def test_pool_scores_and_survives_timeout_crash_and_raise():
    cfg = RewardConfig(extractors=["leading_number"], format_extractors=["leading_number"],
                       timeout_s=2.0, num_workers=2)
    responses = ["7", "HANG", "3x", "DIE", "RAISE", "9", "12"]
    references = ["7", "1", "4", "1", "1", "9", "12"]
    with VerifierPool(cfg, grader=failing_grader) as pool:
        first_pids = set(pool.worker_pids())
        scores = pool.score(responses, references)
        assert [s.error for s in scores] == [None, "timeout", None, "crash", "grader_error", None, None]
        assert [s.correctness for s in scores] == [1.0, None, 0.0, None, None, 1.0, 1.0]
        for s in scores:
            assert s.grader_version == cfg.grader_version()
            if not s.ok:
                assert s.reward is None  # never scored as zero
        counts = pool.counters()
        assert counts == {"scored": 4, "timeout": 1, "crash": 1, "grader_error": 1, "replaced": 2}
        # The hung and the dead worker were replaced; the pool still grades.
        assert len(set(pool.worker_pids()) - first_pids) >= 1
        again = pool.score(["5"], ["5"])
        assert again[0].ok and again[0].reward == pytest.approx(1.1)
        summary = summarize_scores(scores)
        assert summary["error_timeout"] == 1 and summary["valid"] == 4
        assert summary["correctness_mean"] == pytest.approx(3 / 4)
        # A worker killed while idle is replaced on the next call; its item is still graded.
        os.kill(pool.worker_pids()[0], 9)
        pool._workers[0].process.join(5)
        after_kill = pool.score(["4", "6"], ["4", "6"])
        assert [s.correctness for s in after_kill] == [1.0, 1.0]
        assert pool.counters()["replaced"] == 3
        pids = pool.worker_pids()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
