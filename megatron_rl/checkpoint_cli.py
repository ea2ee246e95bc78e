"""`megatron-rl checkpoint verify RUN_DIR`: the state of every checkpoint of a run.

    megatron-rl checkpoint verify runs/exp1            # one line per step directory, newest first
    megatron-rl checkpoint verify runs/exp1 --json     # one JSON object

Each step directory is "intact" (committed, every file matches the sha256 in its COMMITTED
manifest), "corrupt" (the problem names the file) or "uncommitted" (no COMMITTED).  RUN_DIR
may be the run directory or its checkpoints/ directory.  Exit 0 when the newest step
directory is intact, 1 otherwise (also when there is none): a resume would not start from it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _verify(args: argparse.Namespace) -> int:
    from megatron_rl.checkpoint import checkpoint_status

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"RUN_DIR {run_dir} is not a directory")
    ckpts = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    rows = checkpoint_status(ckpts)
    intact = [r for r in rows if r["status"] == "intact"]
    ok = bool(rows) and rows[0]["status"] == "intact"
    if args.json:
        print(json.dumps({"checkpoints_dir": str(ckpts), "newest_intact": ok,
                          "resume_from": intact[0]["path"] if intact else None, "checkpoints": rows}))
    else:
        if not rows:
            print(f"{ckpts}: no step directories")
        for r in rows:
            print(f"step {r['step']:>8}  {r['status']:<11}  {r['path']}" + (f"  ({r['problem']})" if r["problem"] else ""))
        print(f"resume would start from: {intact[0]['path'] if intact else 'nothing (no intact checkpoint)'}")
    return 0 if ok else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("checkpoint", help="inspect a run's checkpoints")
    sub = p.add_subparsers(dest="checkpoint_command", metavar="WHAT", required=True)
    v = sub.add_parser("verify", help="sha256-check every step directory against its COMMITTED manifest")
    v.add_argument("run_dir", metavar="RUN_DIR", help="run directory (or its checkpoints/ directory)")
    v.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    v.set_defaults(func=_verify)
