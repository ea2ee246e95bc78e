"""Every fault drill of `megatron-rl drill` on the tiny recipe, one table row per drill.

    .venv/bin/python benchmarks/drills.py [--config configs/tiny_cpu_scratch.yaml] [--only oom,worker_crash] [--json]

Each drill is a real training run (megatron_rl/drill/; a few steps, ~70 s of start-up per
training attempt on 2 CPU cores) with its fault injected through MEGATRON_RL_DRILL or by damaging
a checkpoint.  Columns: recovered ("after clean stop" when the protocol is a clean stop with its
own exit code and a rerun with the documented remedy),
trajectories lost and duplicated (consumed.jsonl against the WAL), versions continuous (steps and
checkpoint versions with no gap or repeat), time to recover (injection -> first step learned
after it, restarts included), steps redone, and the attempts' exit codes.  The whole table takes
~10 minutes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAN = {  # drill -> extra CLI arguments
    "bad_checkpoint": [],
    "oom": [],
    "oom_twice": ["--at-step", "2", "--steps", "3"],
    "verifier_timeout": ["--variant", "0.05", "--steps", "3"],
    "worker_crash": ["run.learner_timeout_s=60"],
    "engine_crash": ["--at-step", "1", "--steps", "3"],
    "bad_refit": ["--at-step", "1", "--steps", "3"],
    "partition": ["--at-step", "1", "--steps", "12"],  # 2 rollout groups; one stopped 15 s (tiny steps ~1 s)
    "coordinator_stop": ["--at-step", "1", "--steps", "3"],  # the coordinator stopped 10 s
    "refit_mid_generation": [],  # streaming, long responses: publications land mid-response
    "refit_stale_kv": ["--at-step", "1", "--steps", "6"],  # the stale-cache bug from publication 2 on; the audit stops the run
    "refit_engine_death": ["--at-step", "1", "--steps", "5"],  # the engine core dies paused in a refit
}


def run_drill(name: str, config: str, root: Path) -> dict:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "drill", name, "--config", config,
           "--run-dir", str(root / name), *PLAN[name]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"fault": name, "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    return json.loads(lines[-1])


def render(records: list[dict]) -> str:
    head = ["drill", "recovered", "lost", "duplicated", "versions continuous", "time to recover (s)",
            "steps redone", "exits"]
    rows = [head]
    for r in records:
        if "error" in r:
            rows.append([r["fault"], "ERROR: " + " ".join(r["error"]), "", "", "", "", "", ""])
            continue
        outcome = ("after clean stop" if r.get("clean_stop") else "yes") if r.get("recovered") else "NO"
        ttr = r.get("time_to_recover_s")
        rows.append([r["fault"], outcome, str(r["trajectories_lost"]), str(r["trajectories_duplicated"]),
                     "yes" if r["versions_continuous"] else "NO", "-" if ttr is None else f"{ttr:.1f}",
                     str(r["steps_redone"]), ",".join(str(a["exit"]) for a in r["attempts"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    out = [" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu_scratch.yaml"))
    ap.add_argument("--only", default=",".join(PLAN), help="comma-separated drills (default: all)")
    ap.add_argument("--json", action="store_true", help="also print every record as a JSON line")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in PLAN]
    if unknown:
        ap.error(f"--only: unknown drill(s) {unknown}; choose from {', '.join(PLAN)}")
    with tempfile.TemporaryDirectory(prefix="drills_") as tmp:
        records = [run_drill(n, args.config, Path(tmp)) for n in names]
    if args.json:
        for r in records:
            print(json.dumps(r))
    print(render(records))
    ok = all(("error" not in r) and r.get("recovered") and r["trajectories_lost"] == 0
             and r["trajectories_duplicated"] == 0 for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
