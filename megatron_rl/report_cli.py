"""`megatron-rl report RUN_DIR`: PNG plots and a Markdown summary of a run (megatron_rl/report.py).

    megatron-rl report runs/tiny_cpu [--out DIR] [--json]

Prints where summary.md and the PNGs went, and names the series the run never logged.
Exit 0 when the report was written, 2 when RUN_DIR has no metrics/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json


def _cmd_report(args: argparse.Namespace) -> int:
    from megatron_rl.report import write_report

    result = write_report(args.run_dir, args.out)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['summary']}: {len(result['plots'])} plots over {result['steps']} steps")
    if result["missing"]:
        print(f"missing series ({len(result['missing'])}): " + "; ".join(result["missing"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("report", help="PNG plots and a Markdown summary of a run's metrics")
    p.add_argument("run_dir", help="run directory (reads RUN_DIR/metrics/metrics.jsonl)")
    p.add_argument("--out", default=None, help="output directory (default RUN_DIR/report)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    p.set_defaults(func=_cmd_report)
