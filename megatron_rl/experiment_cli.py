"""`megatron-rl experiment`: run an experiment's arms x seeds and write its report.

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml [--dry-run]

See megatron_rl/experiment.py (runs, pre-registration) and experiment_report.py (analysis).
`--dry-run` validates every run's config and prints the command lines; nothing starts.
"""

from __future__ import annotations

import json
import logging

from megatron_rl.experiment import command_for, load_experiment, run_all, validate_runs

logger = logging.getLogger(__name__)


def _cmd_experiment(args) -> int:
    from megatron_rl.console import end_progress
    from megatron_rl.experiment_report import write_report

    cfg = load_experiment(args.config)
    validate_runs(cfg)
    if args.dry_run:
        print(json.dumps({"dir": cfg.dir, "order": cfg.order(), "seeds": cfg.seeds,
                          "runs": [["megatron-rl", *command_for(cfg, a, s)] for a in cfg.order() for s in cfg.seeds]},
                         indent=2))
        return 0
    ran = run_all(cfg)
    logger.info("experiment %s: %d runs now, %d skipped", cfg.dir, len(ran),
                len(cfg.arms) * len(cfg.seeds) - len(ran))
    report = write_report(cfg)
    end_progress()
    print(json.dumps({arm: {k: e.get(k) for k in ("test_correctness_mean", "difference", "ci", "verdict")}
                      for arm, e in report["arms"].items()}))
    return 0


def register(sub) -> None:
    p = sub.add_parser("experiment", help="arms x seeds of real runs, pre-registered, paired-bootstrap report")
    p.add_argument("--config", required=True, help="experiment YAML (base config, arms, seeds, preregistration)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the runs; start nothing")
    p.set_defaults(func=_cmd_experiment)
