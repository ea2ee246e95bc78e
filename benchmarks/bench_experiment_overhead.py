"""Per-run overhead of the experiment runner: start-up until the first result, as a share of wall time.

    .venv/bin/python benchmarks/bench_experiment_overhead.py runs/exp_grpo_vs_sft        # a finished experiment
    /work/heavy .venv/bin/python benchmarks/bench_experiment_overhead.py --run benchmarks/overhead_experiment.yaml

Reads an experiment directory written by `megatron-rl experiment`: for every run, `result.json`
(when the runner launched it and its wall time) and the run's `metrics/metrics.jsonl` (wall-clock
time of every logged row).  The start-up of a run is the time from its launch until its first
logged row (the first SFT step, or GRPO's step-0 eval of the hidden test split, which needs the
engine, the learner and the coordinator up); the rest is work.  Prints one row per run and the
share over all runs; the goal is <= 20%.

`--run EXP.yaml` first runs that experiment in a fresh directory (`--out`, default
runs/bench_overhead_<time>; its `dir:` is replaced) and then measures it;
benchmarks/overhead_experiment.yaml is experiments/grpo_vs_sft.yaml's three seeds (SFT, then GRPO
from it: ~6 minutes on 2 cores).  Any further `KEY=VALUE` arguments set top-level fields of the
experiment (values read as YAML), e.g. `shared_ray=false engine_in_process=false runner=process` to measure the
runner without what it shares, `runner=in_process` without the engine/learner pool, `'seeds=[0]'` for single cold runs
(nothing for the pool to serve).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run_overhead(run_dir: Path) -> dict | None:
    result_file, metrics_file = run_dir / "result.json", run_dir / "metrics" / "metrics.jsonl"
    if not (result_file.is_file() and metrics_file.is_file()):
        return None
    result = json.loads(result_file.read_text())
    # Runs finished before the runner recorded launched_at: launch = end of the run - its wall time.
    launched = result.get("launched_at", result_file.stat().st_mtime - result["wall_s"])
    with metrics_file.open() as f:
        first = json.loads(next(line for line in f if line.strip()))
    startup = first["time"] - launched
    return {"run": f"{run_dir.parent.name}/{run_dir.name}", "arm": result["arm"], "seed": result["seed"],
            "startup_s": startup, "wall_s": result["wall_s"], "share": startup / result["wall_s"]}


def run_experiment(config: Path, out: Path, fields: list[str]) -> Path:
    """Run `megatron-rl experiment` on a copy of CONFIG whose dir is OUT (and FIELDS set); returns OUT."""
    import yaml

    exp = yaml.safe_load(config.read_text())
    base = Path(exp["base"])
    exp["base"] = str(base if base.is_absolute() else (config.parent / base).resolve())
    exp["dir"] = str(out.resolve())
    for field in fields:
        key, value = field.split("=", 1)
        exp[key] = yaml.safe_load(value)
    out.mkdir(parents=True, exist_ok=True)
    copy = out / "experiment.yaml"
    copy.write_text(yaml.safe_dump(exp, sort_keys=False))
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "megatron_rl.cli", "experiment", "--config", str(copy)], check=True)
    print(f"experiment wall {time.time() - t0:.1f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exp_dir", type=Path, nargs="?", help="an experiment directory (megatron-rl experiment)")
    parser.add_argument("--run", type=Path, help="run this experiment file first, in a fresh directory")
    parser.add_argument("--out", type=Path, help="the fresh directory for --run")
    parser.add_argument("fields", nargs="*", default=[], help="KEY=VALUE: top-level experiment fields to set")
    args = parser.parse_args()
    if args.exp_dir is not None and "=" in str(args.exp_dir):
        args.fields.insert(0, str(args.exp_dir))
        args.exp_dir = None
    if args.run is not None:
        args.exp_dir = run_experiment(args.run, args.out or Path(f"runs/bench_overhead_{int(time.time())}"),
                                      args.fields)
    if args.exp_dir is None:
        parser.error("give an experiment directory or --run EXP.yaml")
    rows = [r for d in sorted((args.exp_dir / "runs").glob("*/seed_*")) if (r := run_overhead(d)) is not None]
    if not rows:
        raise SystemExit(f"no finished runs under {args.exp_dir / 'runs'}")
    print(f"{'run':<22} {'start-up s':>10} {'wall s':>8} {'share':>6}")
    for r in rows:
        print(f"{r['run']:<22} {r['startup_s']:>10.1f} {r['wall_s']:>8.1f} {r['share']:>6.1%}")
    startup, wall = sum(r["startup_s"] for r in rows), sum(r["wall_s"] for r in rows)
    print(json.dumps({"runs": len(rows), "startup_s": round(startup, 1), "wall_s": round(wall, 1),
                      "overhead_share": round(startup / wall, 3), "goal": 0.2}))


if __name__ == "__main__":
    main()
