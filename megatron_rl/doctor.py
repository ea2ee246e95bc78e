"""`megatron-rl doctor RUN_DIR [--json]`: apply RUNBOOK.md's diagnosis tree to a run.

    megatron-rl doctor runs/tiny_cpu            # findings, each with its evidence and runbook leaf
    megatron-rl doctor runs/tiny_cpu --json     # {"run_dir", "healthy", "steps", "findings": [...]}

Reads RUN_DIR/metrics/metrics.jsonl (the step rows and eval rows the driver logs),
RUN_DIR/stop_condition.json (written when a stop condition ended the run, reporting/stop.py),
RUN_DIR/config.json (run.steps, prompts per step, the stop.* and coordinator.backpressure_*
limits, which override the defaults below) and the checkpoint directories.  Each check is one
leaf of the runbook (`RUNBOOK.md#<leaf>`); a finding names the metric, the step and the value
that tripped it.  Exit 0: no findings; 1: findings; 2: no metrics to read.

Checks that judge a trend (reward flat, format without correctness, step time growing) need at
least MIN_TREND_STEPS step rows, so a short healthy run raises no alarm.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RUNBOOK = "RUNBOOK.md"
MIN_TREND_STEPS = 10
"""Step rows needed before a trend (flat, rising, growing) is judged."""
DEFAULTS = {
    "flat_reward_rise": 0.02,        # reward-flat: late mean minus early mean below this
    "format_rise": 0.1,              # format-not-correctness: format rises at least this ...
    "correctness_rise": 0.01,        # ... while correctness rises less than this
    "zero_variance_share": 0.5,      # zero-variance-groups: median share of groups over the recent window
    "d_lag_p95": 0.05,               # lag-rising: learn/d_lag/p95 (stop.d_lag_p95_max / backpressure limit win)
    "backpressure_share": 0.5,       # lag-rising: share of recent steps under backpressure
    "clip_fraction": 0.2,            # clip-fraction-high: median over the recent window
    "kl": 10.0,                      # kl-exploding: KL to the reference (stop.kl_max wins)
    "entropy_ratio": 0.2,            # entropy-collapse: late mean below this share of the early mean
    "verifier_error_share": 0.01,    # verifier-errors: ungraded share of all graded responses
    "esr": 0.25,                     # throughput: median effective sample ratio below this
    "step_time_growth": 3.0,         # throughput: late step time over early step time
}
WINDOW = 10
"""Steps in the 'recent' window of median checks; trends compare the first and last quarter."""


@dataclass
class Finding:
    leaf: str
    """The runbook leaf (RUNBOOK.md#<leaf>) with the check, the evidence to gather and the action."""
    summary: str
    metric: str
    step: int | None
    value: float | None

    def render(self) -> str:
        where = f" at step {self.step}" if self.step is not None else ""
        value = "" if self.value is None else f" = {self.value:.6g}"
        return f"[{self.leaf}] {self.summary}\n    evidence: {self.metric}{value}{where}\n    runbook: {RUNBOOK}#{self.leaf}"


class History:
    """metrics.jsonl as per-metric series of (step, value), in logged order."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.series: dict[str, list[tuple[int, float]]] = {}
        for row in rows:
            for key, value in row.items():
                if key in ("step", "time") or not isinstance(value, (int, float)):
                    continue
                self.series.setdefault(key, []).append((int(row["step"]), float(value)))

    @classmethod
    def read(cls, path: Path) -> "History":
        """A line that is not a metrics record (a torn write, damaged bytes) is skipped, with one warning."""
        from megatron_rl.run_files import read_jsonl

        return cls(read_jsonl(path, key="step"))

    def get(self, key: str) -> list[tuple[int, float]]:
        return self.series.get(key, [])

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.series if k.startswith(prefix))

    @property
    def train_steps(self) -> list[int]:
        return [s for s, _ in self.get("learn/reward_mean")]


def _early_late(series: list[tuple[int, float]]) -> tuple[float, float, int]:
    """Mean of the first and last quarter (at least 3 points each) and the last step."""
    values = [v for _, v in series if math.isfinite(v)]
    k = max(3, len(values) // 4)
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:]), series[-1][0]


def _recent_median(series: list[tuple[int, float]]) -> float:
    return statistics.median(v for _, v in series[-WINDOW:])


def _first(series: list[tuple[int, float]], pred) -> tuple[int, float] | None:
    return next(((s, v) for s, v in series if pred(v)), None)


# ---- the leaves, in RUNBOOK.md order ----------------------------------------------------------------


def check_nonfinite(h: History, lim: dict) -> list[Finding]:
    out = []
    for key in h.keys("numerics/nonfinite_"):
        hit = _first(h.get(key), lambda v: v > 0)
        if hit:
            out.append(Finding("nonfinite", f"non-finite values first seen at step {hit[0]}", key, *hit))
    return out


def check_reward_flat(h: History, lim: dict) -> list[Finding]:
    s = h.get("learn/reward_mean")
    if len(s) < MIN_TREND_STEPS:
        return []
    early, late, step = _early_late(s)
    if late - early < lim["flat_reward_rise"]:
        return [Finding("reward-flat", f"training reward did not rise: {early:.3f} early, {late:.3f} late",
                        "learn/reward_mean", step, late)]
    return []


def check_format_not_correctness(h: History, lim: dict) -> list[Finding]:
    fmt, cor = h.get("learn/reward_format"), h.get("learn/reward_correctness")
    if len(fmt) < MIN_TREND_STEPS or len(cor) < MIN_TREND_STEPS:
        return []
    f0, f1, step = _early_late(fmt)
    c0, c1, _ = _early_late(cor)
    if f1 - f0 >= lim["format_rise"] and c1 - c0 < lim["correctness_rise"]:
        return [Finding("format-not-correctness", f"format reward rose {f0:.3f} -> {f1:.3f} while correctness "
                        f"stayed {c0:.3f} -> {c1:.3f}", "learn/reward_correctness", step, c1)]
    return []


def check_zero_variance(h: History, lim: dict, prompts_per_step: int) -> list[Finding]:
    s = h.get("learn/zero_variance_groups")
    if len(s) < 3:
        return []
    share = _recent_median(s) / max(prompts_per_step, 1)
    if share >= lim["zero_variance_share"]:
        return [Finding("zero-variance-groups", f"{share:.0%} of groups (median, last {min(WINDOW, len(s))} steps) "
                        f"have one reward for every sample: no learning signal", "learn/zero_variance_groups",
                        s[-1][0], s[-1][1])]
    return []


def check_lag(h: History, lim: dict) -> list[Finding]:
    out = []
    hit = _first(h.get("learn/d_lag/p95"), lambda v: not v <= lim["d_lag_p95"])
    if hit:
        out.append(Finding("lag-rising", f"learner/behaviour lag P95 above {lim['d_lag_p95']:g}",
                           "learn/d_lag/p95", *hit))
    bp = h.get("queue/backpressure")
    if len(bp) >= 3 and statistics.fmean(v for _, v in bp[-WINDOW:]) >= lim["backpressure_share"]:
        out.append(Finding("lag-rising", "admission was throttled by backpressure on most recent steps",
                           "queue/backpressure", bp[-1][0], bp[-1][1]))
    return out


def check_clip_fraction(h: History, lim: dict) -> list[Finding]:
    s = h.get("learn/clip_fraction")
    if len(s) >= 3 and _recent_median(s) > lim["clip_fraction"]:
        return [Finding("clip-fraction-high", f"median clip fraction {_recent_median(s):.3f} over the recent steps "
                        f"(> {lim['clip_fraction']:g})", "learn/clip_fraction", s[-1][0], s[-1][1])]
    return []


def check_kl(h: History, lim: dict) -> list[Finding]:
    out = []
    for key in h.keys("learn/kl_ref_"):
        hit = _first(h.get(key), lambda v: not v <= lim["kl"])
        if hit:
            out.append(Finding("kl-exploding", f"KL to the reference above {lim['kl']:g}", key, *hit))
    return out


def check_entropy(h: History, lim: dict) -> list[Finding]:
    s = h.get("learn/entropy_estimate")
    out = []
    if lim.get("entropy_min") is not None:
        hit = _first(s, lambda v: v < lim["entropy_min"])
        if hit:
            out.append(Finding("entropy-collapse", f"entropy below stop.entropy_min {lim['entropy_min']:g}",
                               "learn/entropy_estimate", *hit))
    if not out and len(s) >= MIN_TREND_STEPS:
        early, late, step = _early_late(s)
        if early > 0 and late < lim["entropy_ratio"] * early:
            out.append(Finding("entropy-collapse", f"entropy fell from {early:.3f} to {late:.3f}",
                               "learn/entropy_estimate", step, late))
    return out


def check_verifier(h: History, lim: dict) -> list[Finding]:
    errors = {k: h.get(k)[-1] for k in ("latency/verifier_timeout", "latency/verifier_crash",
                                        "latency/verifier_grader_error") if h.get(k)}
    scored = h.get("latency/verifier_scored")
    out = []
    if errors and scored:
        total_err = sum(v for _, v in errors.values())
        share = total_err / max(total_err + scored[-1][1], 1.0)
        if total_err and share >= lim["verifier_error_share"]:
            key = max(errors, key=lambda k: errors[k][1])
            out.append(Finding("verifier-errors", f"{share:.1%} of graded responses failed to grade "
                               f"({int(total_err)} so far)", key, *errors[key]))
    if lim.get("verifier_error_rate_max") is not None:
        hit = _first(h.get("latency/verifier_error_rate"), lambda v: v > lim["verifier_error_rate_max"])
        if hit:
            out.append(Finding("verifier-errors", "a step's ungraded share passed stop.verifier_error_rate_max",
                               "latency/verifier_error_rate", *hit))
    for key in h.keys("eval/"):
        if key.endswith("_verifier_errors"):
            hit = _first(h.get(key), lambda v: v > 0)
            if hit:
                out.append(Finding("verifier-errors", "an evaluation had ungraded responses", key, *hit))
    return out


def check_queue_drops(h: History, lim: dict) -> list[Finding]:
    out = []
    for key in h.keys("queue/dropped") + ["queue/leases_expired", "queue/conflicts"]:
        s = h.get(key)
        if s and s[-1][1] > 0:
            first = _first(s, lambda v: v > 0)
            out.append(Finding("queue-drops", f"{int(s[-1][1])} trajectories by step {s[-1][0]} "
                               f"(first at step {first[0]})", key, *s[-1]))
    return out


def check_throughput(h: History, lim: dict) -> list[Finding]:
    out = []
    esr = h.get("system/esr")
    if len(esr) >= 3 and _recent_median(esr) < lim["esr"]:
        out.append(Finding("throughput", f"median effective sample ratio {_recent_median(esr):.3f}: most generated "
                           f"tokens teach nothing", "system/esr", esr[-1][0], esr[-1][1]))
    t = h.get("system/time_step_s")
    if len(t) >= MIN_TREND_STEPS:
        early, late, step = _early_late(t)
        if early > 0 and late > lim["step_time_growth"] * early:
            out.append(Finding("throughput", f"step time grew from {early:.2f} s to {late:.2f} s",
                               "system/time_step_s", step, late))
    return out


STOP_LEAF = {"nonfinite": "nonfinite", "dev_eval_falling": "reward-flat", "kl_out_of_bounds": "kl-exploding",
             "entropy_out_of_bounds": "entropy-collapse", "lag_p95": "lag-rising", "verifier_errors": "verifier-errors",
             "audit": "audit-failed"}
"""The runbook leaf of each stop condition (megatron_rl/reporting/stop.py)."""


def read_stop(run_dir: Path, h: History) -> dict | None:
    """RUN_DIR/stop_condition.json if the run's last step is the one it stopped at (not resumed past it)."""
    path = run_dir / "stop_condition.json"
    try:
        stop = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    steps = h.train_steps
    return stop if steps and int(stop.get("step", -1)) == steps[-1] else None


def check_stopped(stop: dict | None) -> list[Finding]:
    if stop is None:
        return []
    return [Finding(STOP_LEAF.get(stop.get("stopped"), "publication-refused"),
                    f"the run stopped on condition {stop.get('stopped')} (exit {stop.get('exit_code')}): "
                    f"{stop.get('threshold')}", stop.get("metric", "?"), stop.get("step"), stop.get("value"))]


def check_publication(h: History, lim: dict, planned_steps: int | None, stopped: bool = False) -> list[Finding]:
    """The coordinator's version follows each publication: queue/version must equal the step; a
    run that ended before run.steps without its final test eval crashed or was stopped."""
    out = []
    hit = next(((s, v) for s, v in h.get("queue/version") if int(v) != s), None)
    if hit:
        out.append(Finding("publication-refused", f"the coordinator's version {hit[1]:g} is not the step's "
                           f"version {hit[0]}", "queue/version", *hit))
    steps = h.train_steps
    final_eval = any(s == planned_steps for s, _ in h.get("eval/test_reward"))
    if planned_steps and steps and steps[-1] < planned_steps and not final_eval and not stopped:
        out.append(Finding("publication-refused", f"the run ended at step {steps[-1]} of {planned_steps} without "
                           f"its final test eval (crash, refused publication, stop condition or signal)",
                           "learn/reward_mean", steps[-1], None))
    return out


def check_checkpoints(run_dir: Path, h: History, checkpoint_every: int) -> list[Finding]:
    ckpts = run_dir / "checkpoints"
    out = []
    committed: list[int] = []
    if ckpts.is_dir():
        for child in sorted(ckpts.iterdir()):
            if child.name.startswith(".tmp.step_"):
                out.append(Finding("checkpoint-problems", f"leftover temporary checkpoint {child.name} (a save "
                                   f"was interrupted)", "checkpoints", None, None))
            elif child.name.startswith("step_") and child.is_dir():
                manifest = child / "COMMITTED"
                try:
                    json.loads(manifest.read_text())
                    committed.append(int(child.name.split("_")[1]))
                except (OSError, ValueError):
                    out.append(Finding("checkpoint-problems", f"{child.name} has no readable COMMITTED manifest "
                                       f"(incomplete: resume skips it)", "checkpoints", int(child.name[5:]), None))
    steps = h.train_steps
    if steps and not committed:
        out.append(Finding("checkpoint-problems", f"no COMMITTED checkpoint after {steps[-1]} steps: nothing to "
                           f"resume from", "checkpoints", steps[-1], None))
    elif steps and checkpoint_every and steps[-1] - max(committed) >= 2 * checkpoint_every:
        out.append(Finding("checkpoint-problems", f"newest COMMITTED checkpoint is step {max(committed)}, "
                           f"{steps[-1] - max(committed)} steps behind (run.checkpoint_every {checkpoint_every})",
                           "checkpoints", max(committed), None))
    return out


def diagnose(run_dir: str | Path) -> dict:
    """Every finding for the run in RUN_DIR; raises FileNotFoundError without metrics.jsonl, ConfigError (naming
    the file) for a config.json that cannot be read."""
    from megatron_rl.run_files import read_json

    run_dir = Path(run_dir)
    path = run_dir / "metrics" / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a run directory, or the run logged nothing yet")
    h = History.read(path)
    cfg = read_json(run_dir / "config.json") if (run_dir / "config.json").is_file() else {}
    run, stop, coord = cfg.get("run", {}), cfg.get("stop", {}), cfg.get("coordinator", {})
    lim = dict(DEFAULTS)
    lag_limits = [v for v in (stop.get("d_lag_p95_max"), coord.get("backpressure_d_lag_p95")) if v is not None]
    if lag_limits:
        lim["d_lag_p95"] = min(lag_limits)
    if stop.get("kl_max") is not None:
        lim["kl"] = stop["kl_max"]
    lim["entropy_min"] = stop.get("entropy_min")
    lim["verifier_error_rate_max"] = stop.get("verifier_error_rate_max")
    stop_file = read_stop(run_dir, h)
    findings = [*check_stopped(stop_file), *check_nonfinite(h, lim), *check_reward_flat(h, lim), *check_format_not_correctness(h, lim),
                *check_zero_variance(h, lim, int(run.get("prompts_per_step", 8))), *check_lag(h, lim),
                *check_clip_fraction(h, lim), *check_kl(h, lim), *check_entropy(h, lim), *check_verifier(h, lim),
                *check_queue_drops(h, lim), *check_throughput(h, lim), *check_publication(h, lim, run.get("steps"), stop_file is not None),
                *check_checkpoints(run_dir, h, int(run.get("checkpoint_every", 0)))]
    return {"run_dir": str(run_dir), "healthy": not findings, "steps": len(h.train_steps),
            "findings": [asdict(f) for f in findings]}

