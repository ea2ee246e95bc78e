"""Stop conditions: end a run that has gone wrong, checkpointed, with the condition named.

    rules = StopRules(cfg.stop)
    rules.observe(step, metrics)          # every dict the run logs (step metrics, dev evals)
    condition = rules.triggered           # a StopCondition, or None
    raise StopConditionMet(condition)     # SystemExit with the condition's own exit code

The driver asks once per step (`Reporter.stop_condition()`, reporting/reporter.py), after the
step's metrics and any dev eval are logged; when a condition holds it writes a checkpoint (COMMITTED last), stops the
producer and exits with that condition's code.  The CLI prints a final JSON line
{"stopped": NAME, "exit_code": N, "checkpointed": true, "step": S, "metric": ..., "value": ...}
and the log has one line "stop condition NAME at step S: ..."; the same JSON is written to
RUN_DIR/stop_condition.json, which `megatron-rl doctor` reads.

Conditions (the `stop:` config section; all off by default except `nonfinite`):

  name                 exit  metric it watches                    set with
  nonfinite            81    numerics/nonfinite_loss, _grad_norm   stop.nonfinite (default true)
  dev_eval_falling     82    eval/dev_<stop.dev_eval_metric>       stop.dev_eval_drops (e.g. 2)
  kl_out_of_bounds     83    learn/kl_ref_*                        stop.kl_max
  entropy_out_of_bounds 84   learn/entropy_estimate                stop.entropy_min / stop.entropy_max
  lag_p95              85    learn/d_lag/p95                       stop.d_lag_p95_max
  verifier_errors      86    latency/verifier_error_rate           stop.verifier_error_rate_max
  audit                89    numerics/audit_worst_abs_delta        audit.every, audit.tolerance (megatron_rl/audit/)

Other exit codes of `megatron-rl train`: 0 done, 1 crashed, 2 bad input, 75 stopped by a
signal after checkpointing (requeue).  Threshold conditions (kl, entropy, lag, verifier) must
hold for `stop.patience` consecutive steps; `dev_eval_falling` needs the dev eval to fall
`dev_eval_drops` evals in a row (run.eval_every > 0).  The rules keep their history in memory:
after a resume they start afresh, except the generated-token count (`StopRules.restore`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, Optional

from megatron_rl.config import ConfigError
from megatron_rl.run_files import read_jsonl

logger = logging.getLogger(__name__)

EXIT_CODES = {
    "nonfinite": 81,
    "dev_eval_falling": 82,
    "kl_out_of_bounds": 83,
    "entropy_out_of_bounds": 84,
    "lag_p95": 85,
    "verifier_errors": 86,
    "audit": 89,
}
"""The exit code of each stop condition (distinct from 0, 1, 2 = bad input and 75 = requeue)."""
BUDGETS = ("max_generated_tokens",)
"""Conditions that end a run normally (exit 0, final test eval): budgets, not faults."""
STOP_FILE = "stop_condition.json"
"""RUN_DIR/stop_condition.json: the condition a run stopped on (StopCondition.to_dict())."""


@dataclass(kw_only=True)
class StopConfig:
    nonfinite: bool = True
    """Stop when the loss or the grad norm is NaN/Inf (exit 81)."""
    dev_eval_drops: int = 0
    """Stop when the dev eval falls this many evaluations in a row (exit 82; 0 = off, e.g. 2)."""
    dev_eval_metric: Literal["reward", "correctness"] = "correctness"
    """Which dev eval metric dev_eval_drops watches: eval/dev_reward or eval/dev_correctness."""
    kl_max: Optional[float] = None
    """Stop when the KL to the reference (learn/kl_ref_*) exceeds this (exit 83; None = off)."""
    entropy_min: Optional[float] = None
    """Stop when learn/entropy_estimate falls below this, i.e. entropy collapse (exit 84; None = off)."""
    entropy_max: Optional[float] = None
    """Stop when learn/entropy_estimate rises above this (exit 84; None = off)."""
    d_lag_p95_max: Optional[float] = None
    """Stop when learn/d_lag/p95 (behaviour-vs-learner lag, P95 over sequences) exceeds this (exit 85; None = off)."""
    verifier_error_rate_max: Optional[float] = None
    """Stop when the step's share of ungraded samples (latency/verifier_error_rate) exceeds this (exit 86; None = off)."""
    max_generated_tokens: Optional[int] = None
    """Budget: end the run normally (exit 0, final test eval) once it has generated this many tokens (None = off)."""
    patience: int = 1
    """Consecutive steps a threshold (kl, entropy, lag, verifier) must be crossed before the run stops."""

    def __post_init__(self) -> None:
        if not isinstance(self.nonfinite, bool):
            raise ConfigError(f"stop.nonfinite must be true or false, got {self.nonfinite!r}")
        for name in ("dev_eval_drops", "patience"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if name == "patience" else 0):
                raise ConfigError(f"stop.{name} must be an int >= {1 if name == 'patience' else 0}, got {value!r}")
        if self.dev_eval_metric not in ("reward", "correctness"):
            raise ConfigError(f"stop.dev_eval_metric must be 'reward' or 'correctness', got {self.dev_eval_metric!r}")
        for name in ("kl_max", "entropy_min", "entropy_max", "d_lag_p95_max", "verifier_error_rate_max"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"stop.{name} must be a finite number >= 0 (or null = off), got {value!r}")
        budget = self.max_generated_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ConfigError(f"stop.max_generated_tokens must be an int >= 1 (or null = off), got {budget!r}")
        if self.verifier_error_rate_max is not None and self.verifier_error_rate_max >= 1:
            raise ConfigError(f"stop.verifier_error_rate_max must be < 1 (a share of samples), "
                              f"got {self.verifier_error_rate_max!r}")
        if self.entropy_min is not None and self.entropy_max is not None and self.entropy_min >= self.entropy_max:
            raise ConfigError(f"stop.entropy_min ({self.entropy_min}) must be below stop.entropy_max "
                              f"({self.entropy_max})")


@dataclass(frozen=True)
class StopCondition:
    """Why a run stopped: the condition, its exit code and the evidence."""

    name: str
    step: int
    metric: str
    value: float
    threshold: str
    """The bound that was crossed, in words, e.g. '> 0.5 for 2 steps'."""

    @property
    def exit_code(self) -> int:
        return 0 if self.ends_run else EXIT_CODES[self.name]

    @property
    def ends_run(self) -> bool:
        """A budget reached: the run ends as if it had reached run.steps (final eval, exit 0)."""
        return self.name in BUDGETS

    def describe(self) -> str:
        return (f"stop condition {self.name} at step {self.step}: {self.metric} = {self.value:.6g} "
                f"({self.threshold}); exit code {self.exit_code}")

    def to_dict(self) -> dict:
        return {"stopped": self.name, "exit_code": self.exit_code, "step": self.step, "metric": self.metric,
                "value": self.value, "threshold": self.threshold}


class StopConditionMet(SystemExit):
    """Raised by the driver after the checkpoint; its exit status is the condition's code."""

    def __init__(self, condition: StopCondition):
        super().__init__(condition.exit_code)
        self.condition = condition


class StopRules:
    """Fed every logged metrics dict; `triggered` is the first condition that held (sticky)."""

    def __init__(self, cfg: StopConfig):
        self.cfg = cfg
        self.triggered: StopCondition | None = None
        self._streak: dict[str, int] = {}  # threshold rule -> consecutive steps over it
        self._dev: list[float] = []  # dev eval values, in order
        self._drops = 0
        self.generated_tokens = 0.0  # summed over the run's steps (system/generated_tokens), resumes included

    def restore(self, metrics_jsonl: Path) -> float:
        """Resume the generated-token count from the run's logged steps (after the metrics rewind).
        A run that had already spent its budget is still over it: `triggered` says so at once."""
        self.generated_tokens, last_step = 0.0, 0
        if metrics_jsonl.is_file():
            for row in read_jsonl(metrics_jsonl, key="step"):  # a torn or damaged line: skipped (the rewind drops it)
                try:
                    if "system/generated_tokens" in row:
                        self.generated_tokens += float(row["system/generated_tokens"])
                        last_step = max(last_step, row["step"])
                except (ValueError, TypeError):
                    continue
        budget = self.cfg.max_generated_tokens
        if budget is not None and self.generated_tokens >= budget:
            self.triggered = StopCondition("max_generated_tokens", last_step, "system/generated_tokens",
                                           self.generated_tokens, f">= budget {budget}")
        return self.generated_tokens

    def budget_spent(self) -> bool:
        """A budget ended the run (it runs no more steps, resumed or not)."""
        return self.triggered is not None and self.triggered.ends_run

    def summary(self) -> dict:
        """For the run's final JSON line: tokens generated, and the budget that ended it if one did."""
        out = {"generated_tokens": int(self.generated_tokens)}
        if self.triggered is not None and self.triggered.ends_run:
            out.update(stopped=self.triggered.name, stopped_at_step=self.triggered.step)
        return out

    def observe(self, step: int, metrics: Mapping[str, float]) -> StopCondition | None:
        if self.triggered is None:
            for condition in self._evaluate(step, metrics):
                if condition is not None:
                    self.triggered = condition
                    logger.log(logging.INFO if condition.ends_run else logging.ERROR, "%s", condition.describe())
                    break
        return self.triggered

    def hold(self, condition: StopCondition) -> StopCondition:
        """A condition a component judged on its own evidence (the audit, megatron_rl/audit/auditor.py)."""
        if self.triggered is None:
            self.triggered = condition
            logger.error("%s", condition.describe())
        return self.triggered

    def _evaluate(self, step: int, m: Mapping[str, float]):
        cfg = self.cfg
        if "system/generated_tokens" in m:
            self.generated_tokens += float(m["system/generated_tokens"])
            if cfg.max_generated_tokens is not None and self.generated_tokens >= cfg.max_generated_tokens:
                yield StopCondition("max_generated_tokens", step, "system/generated_tokens", self.generated_tokens,
                                    f">= budget {cfg.max_generated_tokens}")
        if cfg.nonfinite:
            for key in ("numerics/nonfinite_loss", "numerics/nonfinite_grad_norm"):
                if m.get(key, 0.0) > 0:
                    raw = key.replace("numerics/nonfinite_", "learn/")
                    yield StopCondition("nonfinite", step, raw, float(m.get(raw, math.nan)), "NaN/Inf")
        dev_key = f"eval/dev_{cfg.dev_eval_metric}"
        if cfg.dev_eval_drops and dev_key in m:
            value = float(m[dev_key])
            self._drops = self._drops + 1 if self._dev and value < self._dev[-1] else 0
            self._dev.append(value)
            if self._drops >= cfg.dev_eval_drops:
                yield StopCondition("dev_eval_falling", step, dev_key, value,
                                    f"fell {self._drops} evals in a row: {self._dev[-cfg.dev_eval_drops - 1:]}")
        kl_keys = sorted(k for k in m if k.startswith("learn/kl_ref_"))
        if cfg.kl_max is not None and kl_keys:
            key = max(kl_keys, key=lambda k: float(m[k]) if math.isfinite(m[k]) else math.inf)
            yield self._threshold("kl_out_of_bounds", step, key, m[key], above=cfg.kl_max)
        ent = "learn/entropy_estimate"
        if ent in m and (cfg.entropy_min is not None or cfg.entropy_max is not None):
            value = float(m[ent])
            low = cfg.entropy_min is not None and value < cfg.entropy_min
            yield self._threshold("entropy_out_of_bounds", step, ent, value,
                                  below=cfg.entropy_min if low or cfg.entropy_max is None else None,
                                  above=None if low else cfg.entropy_max)
        if cfg.d_lag_p95_max is not None and "learn/d_lag/p95" in m:
            yield self._threshold("lag_p95", step, "learn/d_lag/p95", m["learn/d_lag/p95"], above=cfg.d_lag_p95_max)
        if cfg.verifier_error_rate_max is not None and "latency/verifier_error_rate" in m:
            yield self._threshold("verifier_errors", step, "latency/verifier_error_rate",
                                  m["latency/verifier_error_rate"], above=cfg.verifier_error_rate_max)

    def _threshold(self, name: str, step: int, key: str, value: float, *, above: float | None = None,
                   below: float | None = None) -> StopCondition | None:
        value = float(value)
        crossed = (above is not None and not value <= above) or (below is not None and not value >= below)
        self._streak[name] = self._streak.get(name, 0) + 1 if crossed else 0
        if self._streak[name] < self.cfg.patience:
            return None
        bound = f"> {above:g}" if above is not None and not value <= above else f"< {below:g}"
        if self.cfg.patience > 1:
            bound += f" for {self.cfg.patience} steps"
        return StopCondition(name, step, key, value, bound)
