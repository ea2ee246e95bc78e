"""The per-step console line: the numbers of the step, and "-" where a metric is missing."""

from __future__ import annotations

import pytest

from megatron_rl.reporting.telemetry import progress_line

pytestmark = pytest.mark.unit


def test_progress_line_shows_the_steps_numbers_and_eta():
    metrics = {"learn/reward_mean": 0.625, "learn/reward_correctness": 0.125, "learn/kl_ref_k2_grad_theta_ref": 0.0123,
               "queue/taken_dv/p95": 1.0, "learn/d_lag/p95": 2.5e-7, "system/esr": 0.5,
               "system/generated_tokens_per_s": 812.4, "queue/version": 12.0}
    line = progress_line(12, 60, metrics, seconds_per_step=2.5)
    assert line == ("step 12/60 v12 | reward 0.625 correct 0.125 | kl 0.0123 dv95 1 lag95 2.5e-07 | esr 0.50 "
                    "gen 812 tok/s | eta 2m00s")


def test_missing_or_nonfinite_metrics_are_dashes_not_zeros():
    line = progress_line(1, 2, {"learn/reward_mean": float("nan")}, seconds_per_step=1.0)
    assert "v- | reward - correct - | kl - dv95 - lag95 -" in line and "eta 0m01s" in line


def test_sft_and_experiment_progress_lines():
    from megatron_rl.experiment.runner import run_progress_line
    from megatron_rl.reporting.telemetry import sft_progress_line

    out = {"loss": 1.25, "nll_sum": 30.0, "tokens": 12.0, "grad_norm": 0.5}
    assert sft_progress_line(3, 10, out, seconds_per_step=9.0, tokens_per_s=120.0) == (
        "sft step 3/10 | loss 1.2500 nll/token 2.5000 grad 0.5 | 120 tok/s | eta 1m03s")
    assert "nll/token -" in sft_progress_line(1, 1, {"loss": 1.0, "nll_sum": 0.0, "tokens": 0}, 1.0, 0.0)
    assert run_progress_line(2, 6, "grpo", 1, wall_s=125.0, eta_s=3700.0) == (
        "experiment run 2/6 | grpo seed 1 done in 2m05s | eta 61m40s")
