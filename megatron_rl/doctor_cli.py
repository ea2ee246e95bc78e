"""`megatron-rl doctor RUN_DIR [--json]`: RUNBOOK.md's diagnosis tree applied to a run.

Prints each finding with its evidence (metric, step, value) and runbook leaf (megatron_rl/doctor.py
does the diagnosis), and whether this node can run the policy code's sandbox (bubblewrap); exit 0 healthy,
1 findings.
"""

from __future__ import annotations

import argparse
import json

from megatron_rl.doctor import Finding, diagnose


def sandbox_line(status: dict) -> str:
    """This node's sandbox for the policy's code, in one line (envs/bwrap.py probe)."""
    if status["runs"]:
        return f"sandbox on this node: bubblewrap {status['version']} runs ({status['user']})"
    return f"sandbox on this node: NOT AVAILABLE: {status['error']} (`megatron-rl sandbox check`)"


def _cmd_doctor(args: argparse.Namespace) -> int:
    from megatron_rl.envs.bwrap import probe

    report = diagnose(args.run_dir)
    report["sandbox"] = probe()
    if args.json:
        print(json.dumps(report))
    else:
        print(sandbox_line(report["sandbox"]))
        print(f"{report['run_dir']}: {report['steps']} training steps, "
              f"{'healthy' if report['healthy'] else str(len(report['findings'])) + ' finding(s)'}")
        for f in report["findings"]:
            print(Finding(**f).render())
    return 0 if report["healthy"] else 1


def register(sub) -> None:
    p = sub.add_parser("doctor", help="apply RUNBOOK.md's diagnosis tree to a run's metrics; exit 1 on findings")
    p.add_argument("run_dir", help="the run directory (run.dir) holding metrics/metrics.jsonl")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=_cmd_doctor)
