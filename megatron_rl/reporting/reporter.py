"""What a training run reports: step metrics, held-out evals, the console progress line, stop rules,
and the log of what each learner step consumed.

    reporter = Reporter(run_dir, MetricsLogger(run_dir / "metrics"), StopRules(cfg.stop), evaluator, steps=100)
    reporter.log_step(step, rnd, trajs, taken, learn, phases, queue=coord.metrics(), verifier=scorer.counters())
    reporter.log_sft_step(step, out, seconds)  # an SFT run's step (train/sft.py: no stop rules, its own evaluator)
    reporter.log_eval(step, split="dev")       # greedy pass@1 on a held-out split
    reporter.final_eval(step)                  # the test split at the end, logged once across resumes
    condition = reporter.stop_condition()      # reporting/stop.py

Metrics are grouped by TensorBoard panel (reporting/telemetry.py); every dict logged is also fed to the
stop rules.  `consumed.jsonl` has one line per learner step and attempt (the drills count lost and
duplicated trajectories from it, megatron_rl/drill/accounting.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.console import progress
from megatron_rl.data.dataset import PromptTemplate
from megatron_rl.metrics import MetricsLogger, logged_test_evals
from megatron_rl.sampling.producer import Round
from megatron_rl.rollout.fleet import RolloutFleet
from megatron_rl.reporting.stop import STOP_FILE, StopCondition, StopConfig, StopRules
from megatron_rl.reporting.telemetry import Telemetry, progress_line, sft_progress_line, sft_step_metrics

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_rl.reward.pool import VerifierPool

logger = logging.getLogger(__name__)

CONSUMED_LOG = "consumed.jsonl"  # the trajectory ids each learner step learned from


class Evaluator:
    """Greedy pass@1 of the policy the fleet serves, on the first `eval_size` examples of a split."""

    def __init__(self, fleet: RolloutFleet, verifier: VerifierPool, splits: dict, template: PromptTemplate,
                 tokenizer: PreTrainedTokenizerBase, *,
                 eval_size: int, out_dir: Path, env: dict | None = None):
        self.fleet, self.verifier, self.splits, self.env = fleet, verifier, splits, env
        self.template, self.tokenizer, self.eval_size, self.out_dir = template, tokenizer, eval_size, out_dir

    def run(self, step: int, split: str) -> dict:
        """The eval summary ({"reward", "correctness", "format", "verifier_errors", ...}); the test
        split's per-example outcomes go to out_dir/test_step_N.jsonl (paired comparisons need them)."""
        from megatron_rl.evaluation import Decoding, evaluate

        ds = self.splits[split]
        examples = [ds[i] for i in range(min(self.eval_size, len(ds)))]
        result = evaluate(self.fleet, self.verifier, examples, self.template, self.tokenizer, Decoding(), split=split,
                          env=self.env)
        if split == "test":
            result.write(self.out_dir / f"test_step_{step:06d}.jsonl")
        summary = result.summary()
        if summary["verifier_errors"]:
            logger.warning("eval step %d on %s: %d of %d responses could not be graded (excluded from the means)",
                           step, split, summary["verifier_errors"], len(examples))
        return summary


class Reporter:
    """Owns the metrics logger, the telemetry window, the stop rules and the evals' results.  The evaluator
    is anything with `run(step, split) -> summary` (Evaluator here; SFT's export and fresh engine, train/sft.py);
    `stop_rules` None: the run has none (SFT)."""

    def __init__(self, run_dir: Path, metrics: MetricsLogger, stop_rules: StopRules | None, evaluator, *,
                 steps: int):
        self.run_dir, self.metrics, self.stop_rules, self.evaluator, self.steps = \
            run_dir, metrics, stop_rules, evaluator, steps
        self.telemetry = Telemetry()
        self.initial_eval: dict | None = None
        """The step-0 eval of the hidden test split: {"reward", "correctness", "format"}."""
        self.last_eval: dict | None = None
        self._logged_test: dict[int, dict] = {}  # step -> the test eval an earlier attempt logged there
        self._step_seconds: list[float] = []

    @classmethod
    def create(cls, stop: StopConfig, *, steps: int, eval_size: int, run_dir: Path, fleet: RolloutFleet,
               verifier: VerifierPool, splits: dict, template: PromptTemplate,
               tokenizer: PreTrainedTokenizerBase, env: dict | None = None, tracking=None,
               config: dict | None = None) -> "Reporter":
        """Metrics under run_dir/metrics (and W&B with the `tracking:` section, given the resolved `config`), the
        `stop:` section's rules, evals of `eval_size` examples (multi-turn episodes with `env`, the `env:`
        section as a dict)."""
        evaluator = Evaluator(fleet, verifier, splits, template, tokenizer, eval_size=eval_size,
                              out_dir=run_dir / "eval", env=env)
        return cls(run_dir, metrics_logger(run_dir, tracking, config), StopRules(stop), evaluator, steps=steps)

    def rewind(self, step: int) -> None:
        """Steps after `step` are redone by a resumed run: drop what an earlier attempt logged of them,
        then count the generated tokens of those kept (stop.max_generated_tokens across resumes)."""
        self.metrics.rewind(step if step else -1)
        if self.stop_rules is not None:
            self.stop_rules.restore(self.run_dir / "metrics" / "metrics.jsonl")
        self._logged_test = logged_test_evals(self.run_dir / "metrics" / "metrics.jsonl")

    def final_eval(self, step: int) -> dict:
        """The hidden test eval at the run's last step.  A run resumed at the step where an earlier
        attempt already ended (run.steps reached, or its token budget spent) and logged this eval
        takes that result and logs nothing: metrics.jsonl and TensorBoard hold it once."""
        if step in self._logged_test:
            self.last_eval = dict(self._logged_test[step])
            logger.info("the final test eval at step %d was logged by an earlier attempt: reward %.3f",
                        step, self.last_eval["reward"])
        else:
            self.log_eval(step, split="test")
        return self.last_eval

    def log_step(self, step: int, rnd: Round, trajs: list, taken: list, learn: dict, phases: dict, *,
                 queue: dict, verifier: dict, audit=None) -> None:
        """Log one learner step's metrics (panels of reporting/telemetry.py) and its console line; `audit`: the
        step's AuditOutcome (megatron_rl/audit/auditor.py), whose failure is a stop condition."""
        metrics = self.telemetry.step_metrics(rnd.samples, trajs, taken, learn, phases, queue, verifier,
                                              sampling=rnd.stats or None)
        metrics.update(self.evaluator.fleet.counters())  # engine restarts, retried requests (rollout/fleet.py)
        if audit is not None:
            metrics.update(audit.metrics)
        self.metrics.log(step, metrics)
        self.stop_rules.observe(step, metrics)
        if audit is not None and audit.failure is not None:
            failed = audit.failure
            self.stop_rules.hold(StopCondition("audit", failed.step, failed.metric, failed.value, failed.threshold))
        self._step_seconds.append(phases["step"])
        progress(progress_line(step, self.steps, metrics, sum(self._step_seconds) / len(self._step_seconds)),
                 step=step, total=self.steps)

    def log_sft_step(self, step: int, out: dict, seconds: float) -> None:
        """Log one SFT learner step (the `sft/` panel, reporting/telemetry.py) and its console line."""
        self.metrics.log(step, sft_step_metrics(out, seconds))
        self._step_seconds.append(seconds)
        progress(sft_progress_line(step, self.steps, out, sum(self._step_seconds) / len(self._step_seconds),
                                   float(out["tokens"]) / max(seconds, 1e-9)), step=step, total=self.steps)

    def log_eval(self, step: int, split: str) -> float:
        """Greedy pass@1 on a held-out split (dev during training, the hidden test split at the
        ends); logs reward, correctness and format apart, returns the mean reward."""
        self.last_eval = s = self.evaluator.run(step, split)
        metrics = {f"eval/{split}_reward": s["reward"], f"eval/{split}_correctness": s["correctness"],
                   f"eval/{split}_format": s["format"], f"eval/{split}_verifier_errors": float(s["verifier_errors"])}
        # A reward function without a "correct" component has no correctness (nor format): nothing is
        # logged under those names rather than its reward.
        metrics = {k: v for k, v in metrics.items() if v is not None}
        self.metrics.log(step, metrics)
        if self.stop_rules is not None:
            self.stop_rules.observe(step, metrics)
        if step == 0 and split == "test" and self.initial_eval is None:
            self.initial_eval = {k: s[k] for k in ("reward", "correctness", "format")}
        logger.info("eval step %d on %s: mean reward %.3f, correctness %s", step, split, s["reward"],
                    "n/a (the reward function has no 'correct')" if s["correctness"] is None
                    else f"{s['correctness']:.3f}")
        return s["reward"]

    def budget_spent(self) -> bool:
        """The run's token budget is spent (restored on resume): no more steps."""
        return self.stop_rules.budget_spent()

    def stop_condition(self) -> StopCondition | None:
        """The stop condition (reporting/stop.py) the metrics logged so far meet, or None; one that
        holds is also written to RUN_DIR/stop_condition.json (for `megatron-rl doctor`)."""
        condition = self.stop_rules.triggered
        if condition is not None:
            (self.run_dir / STOP_FILE).write_text(json.dumps(condition.to_dict()))
        return condition

    def record_consumed(self, step: int, taken: list) -> None:
        """Append the ids learner step `step` learned from to RUN_DIR/consumed.jsonl (one line per
        step and attempt; after a resume the last line of a step is the one that counts)."""
        row = {"step": step, "pid": os.getpid(), "time": time.time(), "ids": [t.id for t in taken]}
        with open(self.run_dir / CONSUMED_LOG, "a") as fh:
            fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.metrics.close()


def metrics_logger(run_dir: Path, tracking=None, config: dict | None = None) -> MetricsLogger:
    """TensorBoard and metrics.jsonl under run_dir/metrics, plus the sinks `tracking` asks for (W&B)."""
    from megatron_rl.tracking import tracking_sinks

    return MetricsLogger(run_dir / "metrics", sinks=tracking_sinks(tracking, run_dir, config or {}))
