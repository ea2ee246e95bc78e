"""Sync vs one-step-off vs fully-async GRPO on the tiny recipe, side by side in one run.

    .venv/bin/python benchmarks/bench_modes.py [--steps 30] [--config configs/tiny_cpu_scratch.yaml]

Every mode trains the same number of steps, so it generates the same number of tokens
(prompts_per_step x group_size x max_tokens per step).  Printed per mode: wall time of the
training loop (from the first to the last step's metrics, so start-up is excluded), wall time
relative to sync, final greedy reward on the hidden test split, and the mean version lag of
the batches learned from.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"sync": [], "one_step_off": [], "async": ["coordinator.max_staleness=2"]}  # run.mode sets the bound


def run(mode: str, steps: int, config: str, root: Path) -> dict:
    run_dir = root / mode
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", config, f"run.dir={run_dir}",
           f"run.mode={mode}", f"run.steps={steps}", "run.eval_every=0", "run.checkpoint_every=0", *MODES[mode]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in (run_dir / "metrics" / "metrics.jsonl").read_text().splitlines()]
    learn = [r for r in rows if "learn/loss" in r]
    loop_s = learn[-1]["time"] - learn[0]["time"]
    dv = sum(r["queue/taken_dv/p50"] for r in learn) / len(learn)
    return {"loop_s": loop_s, "steps": len(learn), "final": summary["final_test_reward"],
            "initial": summary["initial_test_reward"], "dv": dv}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu_scratch.yaml"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, args.steps, args.config, Path(tmp)) for mode in MODES}
    base = results["sync"]["loop_s"]
    print(f"{'mode':<14}{'steps':>6}{'loop s':>9}{'vs sync':>9}{'test reward':>13}{'(start)':>9}{'mean dv':>9}")
    for mode, r in results.items():
        print(f"{mode:<14}{r['steps']:>6}{r['loop_s']:>9.1f}{r['loop_s'] / base:>9.2f}{r['final']:>13.3f}"
              f"{r['initial']:>9.3f}{r['dv']:>9.2f}")


if __name__ == "__main__":
    main()
