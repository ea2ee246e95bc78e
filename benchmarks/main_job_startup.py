"""The main job's start-up share, before and after a change, side by side: the seconds from the command's
start to the beginning of GRPO's first learner step, and their share of the whole run's wall time.

    git worktree add /tmp/before <commit before the change>
    python -m benchmarks.main_job_startup --before /tmp/before [--rounds 3] [--config configs/tiny_cpu.yaml]

Each round runs the main job (`megatron-rl train --config CONFIG`, SFT then GRPO) once from the `--before`
checkout and once from this one, alternating which goes first, each in a fresh run directory; the
checkouts share this interpreter (the venv), each imports its own `megatron_rl` (PYTHONPATH, cwd).  GRPO's
first step begins at its metrics row's time less the step's own seconds (system/time_step_s).  Printed:
per run the start-up seconds, the wall seconds and the share; per round the ratio after/before of the
start-up seconds and of the wall time; then their ranges over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_main_job(checkout: Path, config: str, run_dir: Path) -> dict:
    """One main job from `checkout`: start-up and wall seconds, and its final JSON line."""
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", config, f"run.dir={run_dir}"],
                          cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"the main job from {checkout} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    first = next(r for r in rows if "learn/loss" in r)
    startup = first["time"] - first["system/time_step_s"] - started
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    sft_evals = len(list((run_dir / "sft" / "eval").glob("test_step_*.jsonl")))  # which code ran: SFT's own eval?
    return {"startup_s": startup, "wall_s": wall, "share": startup / wall, "sft_evals": sft_evals,
            "baseline": final.get("baseline_test_correctness"), "final": final.get("final_test_correctness")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="a checkout of the commit before the change")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--config", default="configs/tiny_cpu.yaml")
    args = ap.parse_args(argv)
    arms = {"before": args.before.resolve(), "after": REPO}
    ratios: dict[str, list[float]] = {"startup": [], "wall": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            got = {arm: run_main_job(arms[arm], args.config, Path(tmp) / f"{arm}_{r}") for arm in order}
            for arm in ("before", "after"):
                g = got[arm]
                print(f"round {r + 1} {arm:>6}: start-up {g['startup_s']:6.1f} s of {g['wall_s']:6.1f} s "
                      f"(share {g['share']:.2f}); SFT-stage test evals {g['sft_evals']}; test correctness "
                      f"{g['baseline']} -> {g['final']}", flush=True)
            ratios["startup"].append(got["after"]["startup_s"] / got["before"]["startup_s"])
            ratios["wall"].append(got["after"]["wall_s"] / got["before"]["wall_s"])
            print(f"round {r + 1} after/before: start-up {ratios['startup'][-1]:.2f}, wall {ratios['wall'][-1]:.2f}",
                  flush=True)
    print(f"after/before over {args.rounds} rounds: start-up {min(ratios['startup']):.2f}-{max(ratios['startup']):.2f}, "
          f"wall {min(ratios['wall']):.2f}-{max(ratios['wall']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
