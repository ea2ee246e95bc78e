"""The analysis of an experiment (megatron_rl.experiment): paired bootstrap, costs, verdict, plots.

    report = write_report(cfg)    # DIR/report.json, DIR/report.md, DIR/test_correctness.png, DIR/dev_curves.png

Per arm: mean hidden-test correctness (over seeds, each the mean over the test examples), the
95% paired-bootstrap CI of the difference to the baseline arm (pairs = (seed, example)), and
the costs the runs logged: wall time, CPU-hours, generated, informative and learned tokens, ESR, generated
and effective TPS, clip fraction, D_lag, where the run ended up (KL to the reference, response length); a few
wrong hidden-test answers of each arm (failure samples); and what was estimated or not run, named.  The
verdict is read against the pre-registration.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from megatron_rl.experiment.config import MIN_SEEDS, ExperimentConfig
from megatron_rl.experiment.runs import run_dir
from megatron_rl.run_files import read_json, read_jsonl


def test_outcomes(path: Path) -> dict[str, float]:
    """example id -> correctness of a run's final hidden-test eval (its newest test_step_*.jsonl)."""
    files = sorted((path / "eval").glob("test_step_*.jsonl"))
    if not files:
        raise FileNotFoundError(f"{path}: no eval/test_step_*.jsonl (did the run finish its final eval?)")
    out = {}
    for o in read_jsonl(files[-1], strict=True):
        graded = [c for c in o["correctness"] if c is not None]
        if graded:  # an ungraded example (verifier error) has no pair
            out[o["id"]] = float(np.mean(graded))
    return out


def paired_difference_ci(arm: np.ndarray, base: np.ndarray, *, alpha: float, seed: int = 0,
                         resamples: int = 9999) -> tuple[float, float, float]:
    """Mean of arm - base and its (1 - alpha) paired-bootstrap CI (SciPy, BCa; percentile when the
    differences are degenerate).  arm[i] and base[i] are the same (seed, example)."""
    from scipy.stats import bootstrap

    arm, base = np.asarray(arm, float), np.asarray(base, float)
    if arm.shape != base.shape or arm.ndim != 1 or arm.size < 2:
        raise ValueError(f"paired samples must be two 1-d arrays of the same length >= 2, got {arm.shape}, {base.shape}")
    diff = arm - base
    mean = float(diff.mean())
    if np.all(diff == diff[0]):
        return mean, mean, mean
    res = bootstrap((arm, base), lambda a, b, axis: np.mean(a - b, axis=axis), paired=True, vectorized=True,
                    confidence_level=1 - alpha, n_resamples=resamples, method="BCa", random_state=seed)
    lo, hi = res.confidence_interval
    if not (math.isfinite(lo) and math.isfinite(hi)):
        res = bootstrap((arm, base), lambda a, b, axis: np.mean(a - b, axis=axis), paired=True, vectorized=True,
                        confidence_level=1 - alpha, n_resamples=resamples, method="percentile", random_state=seed)
        lo, hi = res.confidence_interval
    return mean, float(lo), float(hi)


def run_costs(path: Path) -> dict[str, float]:
    """What one run spent and how its samples fared, from its metrics, config and result."""
    rows = read_jsonl(path / "metrics" / "metrics.jsonl", key="step")  # a damaged line: skipped, with a warning
    cfg, result = read_json(path / "config.json"), read_json(path / "result.json")
    per_step = cfg["run"]["prompts_per_step"] * cfg["run"]["group_size"]

    def mean(key):
        return finite_mean(rows, key)

    # system/generated_tokens: what the step generated, dynamic sampling's discarded groups included
    # (older runs' metrics lack it: their mean response length times the samples per step)
    generated = sum(r.get("system/generated_tokens", r.get("learn/response_length", 0.0) * per_step) for r in rows)
    return {"wall_s": result["wall_s"], "cpu_hours": result["wall_s"] * (os.cpu_count() or 1) / 3600,
            "generated_tokens": float(generated), "generated_tokens_per_s": mean("system/generated_tokens_per_s"),
            "esr": mean("system/esr"),
            "effective_tokens_per_s": mean("system/effective_tokens_per_s"),
            "clip_fraction": mean("learn/clip_fraction"), "d_lag": mean("learn/d_lag"),
            "informative_tokens": sum(r.get("system/generated_tokens", 0.0) * r["system/esr"] for r in rows
                                      if isinstance(r.get("system/esr"), (int, float)) and math.isfinite(r["system/esr"])),
            "learned_tokens": sum(r["system/learned_tokens_per_s"] * r.get("system/time_learn_s", 0.0) for r in rows
                                  if "system/learned_tokens_per_s" in r),
            "kl_last10": finite_mean(rows, "learn/kl_ref_estimate", last=10),
            "kl_coef_last10": finite_mean(rows, "learn/kl_coef", last=10),
            "response_length_first10": finite_mean(rows[::-1], "learn/response_length", last=10),
            "response_length_last10": finite_mean(rows, "learn/response_length", last=10),
            "response_length_max": max(finite_values(rows, "learn/response_length_max"), default=float("nan")),
            "step_time_p99_s": finite_percentile(rows, "system/time_step_s", 99),
            "loop_s": sum(finite_values(rows, "system/time_step_s"))}


def finite_mean(rows: list[dict], key: str, last: int | None = None) -> float:
    """The mean of `key` over the rows that hold a finite value of it, or over the `last` of them (where a run
    ended up: the KL to the reference, β, the response length); NaN when none does."""
    vals = finite_values(rows, key)
    vals = vals[-last:] if last else vals
    return float(np.mean(vals)) if vals else float("nan")


def finite_percentile(rows: list[dict], key: str, q: float) -> float:
    """The `q`-th percentile of `key` over the rows that hold a finite value of it; NaN when none does."""
    vals = finite_values(rows, key)
    return float(np.percentile(vals, q)) if vals else float("nan")


def finite_values(rows: list[dict], key: str) -> list[float]:
    """`key`'s values, in row order, of the rows that hold a finite number under it."""
    return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def failure_samples(path: Path, n: int = 3) -> list[dict]:
    """Up to `n` examples a run's final hidden-test eval got wrong: id, reference answer, the response."""
    files = sorted((path / "eval").glob("test_step_*.jsonl"))
    out = []
    for o in read_jsonl(files[-1], strict=True) if files else []:
        wrong = [r for r, c in zip(o.get("responses", []), o["correctness"]) if c is not None and c < 1]
        if wrong:
            out.append({"id": o["id"], "answer": o.get("answer"), "response": wrong[0]})
        if len(out) == n:
            break
    return out


def analyse(cfg: ExperimentConfig) -> dict:
    pre = cfg.preregistration
    base_name = pre.baseline_arm
    outcomes = {(a, s): test_outcomes(run_dir(cfg, a, s)) for a in cfg.arms for s in cfg.seeds}
    arms = {}
    for arm in cfg.order():
        per_seed = [float(np.mean(list(outcomes[(arm, s)].values()))) for s in cfg.seeds]
        costs = [run_costs(run_dir(cfg, arm, s)) for s in cfg.seeds]
        entry = {"test_correctness_mean": float(np.mean(per_seed)), "test_correctness_per_seed": per_seed,
                 "costs": {k: _nanmean([c[k] for c in costs]) for k in costs[0]},
                 "failures": failure_samples(run_dir(cfg, arm, cfg.seeds[0]))}
        if arm != base_name:
            pairs = [(outcomes[(arm, s)][e], outcomes[(base_name, s)][e]) for s in cfg.seeds
                     for e in sorted(outcomes[(arm, s)]) if e in outcomes[(base_name, s)]]
            a, b = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
            diff, lo, hi = paired_difference_ci(a, b, alpha=pre.alpha)
            entry.update(difference=diff, ci=[lo, hi], pairs=len(pairs), verdict=verdict(diff, lo, hi, pre, cfg))
        arms[arm] = entry
    return {"preregistration": read_json(Path(cfg.dir) / "preregistration.json"),
            "baseline_arm": base_name, "seeds": cfg.seeds, "arms": arms, "not_run": list(cfg.not_run)}


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else float("nan")


def verdict(diff: float, lo: float, hi: float, pre, cfg: ExperimentConfig) -> str:
    """The registered test's verdict on one arm's CI [lo, hi] against the baseline (module docstring)."""
    if len(cfg.seeds) < MIN_SEEDS:
        return "exploratory"
    if pre.test == "non_inferiority":
        if lo > -pre.minimal_effect:
            return "supported"
        return "contradicted" if hi < -pre.minimal_effect else "inconclusive"
    if lo > 0 and diff >= pre.minimal_effect:
        return "supported"
    if hi < 0:
        return "contradicted"
    return "inconclusive"


def write_report(cfg: ExperimentConfig) -> dict:
    report = analyse(cfg)
    out = Path(cfg.dir)
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True))
    pre = report["preregistration"]["preregistration"]
    lines = [f"# Experiment {out.name}", "", f"Hypothesis (registered {report['preregistration']['registered_at']}): "
             f"{pre['hypothesis']}", "", f"Primary metric: hidden-test correctness (greedy pass@1); baseline arm "
             f"`{report['baseline_arm']}`; minimal effect {pre['minimal_effect']}; alpha {pre['alpha']}; seeds "
             f"{report['seeds']}.", "",
             "| arm | test correctness | diff vs baseline | 95% CI | verdict | wall s | step s P99 | gen. tokens "
             "| gen. TPS | ESR | eff. TPS | clip | D_lag | KL, last 10 steps | length, first -> last 10 steps (max) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, e in report["arms"].items():
        c = e["costs"]
        ci = f"[{e['ci'][0]:+.3f}, {e['ci'][1]:+.3f}]" if "ci" in e else "-"
        diff = f"{e['difference']:+.3f}" if "difference" in e else "-"
        lines.append(f"| {arm} | {e['test_correctness_mean']:.3f} | {diff} | {ci} | {e.get('verdict', 'baseline')} | "
                     f"{c['wall_s']:.0f} | {c['step_time_p99_s']:.2f} | {c['generated_tokens']:.0f} | "
                     f"{c['generated_tokens_per_s']:.1f} | {c['esr']:.3f} | "
                     f"{c['effective_tokens_per_s']:.1f} | {c['clip_fraction']:.3f} | {c['d_lag']:.2e} | "
                     f"{c['kl_last10']:.3f} | {c['response_length_first10']:.2f} -> {c['response_length_last10']:.2f} "
                     f"({c['response_length_max']:.0f}) |")
    lines += _cost_and_failures(report)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    _plots(cfg, report)
    return report


def _cost_and_failures(report: dict) -> list[str]:
    """The report's cost table, failure samples and what was estimated or not run."""
    lines = ["", "## Cost (per run, mean over seeds)", "",
             "| arm | CPU-hours | generated tokens | informative tokens | learned tokens (prompt + response) "
             "| training loop s | informative tokens / loop s |", "|---|---|---|---|---|---|---|"]
    for arm, e in report["arms"].items():
        c = e["costs"]
        lines.append(f"| {arm} | {c['cpu_hours']:.3f} | {c['generated_tokens']:.0f} | "
                     f"{c['informative_tokens']:.0f} | {c['learned_tokens']:.0f} | {c['loop_s']:.0f} | "
                     f"{c['informative_tokens'] / c['loop_s'] if c['loop_s'] else float('nan'):.1f} |")
    lines += ["", f"## Failure samples (seed {report['seeds'][0]}: wrong hidden-test answers, up to 3 per arm)", ""]
    for arm, e in report["arms"].items():
        shown = "; ".join(f"`{f['id']}` answer {f['answer']!r}, response {f['response']!r}" for f in e["failures"])
        lines.append(f"- {arm}: {shown or 'none wrong'}")
    lines += ["", "## Estimated or not run", "",
              "- CPU-hours are estimated: wall time x the machine's CPU count, not measured per process.",
              "- Informative tokens are each step's generated tokens x its ESR; learned tokens each step's learned "
              "tokens per second x its learn time.",
              "- The training loop is the sum of the steps' times (start-up and evals left out); its informative "
              "tokens per second are the system's effective TPS.  The main table's gen. and eff. TPS divide by the "
              "time the driver waited for rollouts, which overlapped generation hides.",
              *(f"- Not run: {item}" for item in report["not_run"])]
    return lines


def _plots(cfg: ExperimentConfig, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["arms"])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for i, arm in enumerate(names):
        per_seed = report["arms"][arm]["test_correctness_per_seed"]
        ax.scatter([i] * len(per_seed), per_seed, color="gray", s=12)
        ax.bar(i, report["arms"][arm]["test_correctness_mean"], alpha=0.6)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("hidden-test correctness")
    fig.tight_layout()
    fig.savefig(Path(cfg.dir) / "test_correctness.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for arm in names:
        curves = []
        for s in cfg.seeds:
            rows = read_jsonl(run_dir(cfg, arm, s) / "metrics" / "metrics.jsonl", key="step", warn=False)
            curves.append({r["step"]: r["eval/dev_correctness"] for r in rows if "eval/dev_correctness" in r})
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if steps:
            vals = np.array([[c[t] for t in steps] for c in curves])
            ax.plot(steps, vals.mean(0), label=arm)
            ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("dev correctness (seed band)")
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(Path(cfg.dir) / "dev_curves.png", dpi=120)
    plt.close(fig)
