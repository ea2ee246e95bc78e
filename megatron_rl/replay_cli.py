"""`megatron-rl replay RUN_DIR`: re-run a run's learner side from its log and say whether every step and
checkpoint is bit-identical (megatron_rl/replay.py).

    megatron-rl replay RUN_DIR [--to-step N] [--json]
    megatron-rl replay RUN_DIR --from-step K --set loss.clip_eps_high=0.28     # a counterfactual from checkpoint K

Exit 0 identical, 1 a step or checkpoint differs (the first one is named), 2 a run directory replay cannot use.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_replay(args: argparse.Namespace) -> int:
    from megatron_rl.replay import replay

    report = replay(Path(args.run_dir), to_step=args.to_step, from_step=args.from_step, overrides=args.set)
    if args.json:
        print(json.dumps(report))
    else:
        for row in report["steps"]:
            mark = "identical" if row["identical"] else "DIFFERS: " + ", ".join(row["differs"] or ["weights"])
            print(f"step {row['step']:>4}  loss {row['loss']!r:<24} recorded {row['recorded_loss']!r:<24} "
                  f"grad_norm {row['grad_norm']!r:<24} recorded {row['recorded_grad_norm']!r:<24} {mark}")
        for name, same in report["checkpoints"].items():
            print(f"{name}: weights and optimizer {'identical' if same else 'DIFFER'}")
        first = report["first_difference"]
        print("replay: identical at every step and checkpoint" if first is None
              else f"replay: first difference at step {first}")
    return 0 if report["identical"] else 1


def register(sub) -> None:
    p = sub.add_parser("replay", help="re-run a run's learner side from its log; bit-identical or the first step "
                                      "that differs")
    p.add_argument("run_dir", help="the run directory (consumed.jsonl, queue.db, metrics, checkpoints)")
    p.add_argument("--to-step", type=int, default=None, help="last step to replay (default: the run's last)")
    p.add_argument("--from-step", type=int, default=0, help="start from this step's checkpoint (default 0: the start)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config key for the replay only (a counterfactual; repeatable)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.set_defaults(func=_cmd_replay)
