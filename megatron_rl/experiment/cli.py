"""`megatron-rl experiment`: run an experiment's arms x seeds and write its report.

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml [--dry-run]
    megatron-rl experiment --config experiments/grpo_vs_sft.yaml --slurm [--dry-run] [--time 04:00:00 ...]

See the package's docstring (megatron_rl/experiment/__init__.py): config.py (the file), runs.py (each
run's overrides), runner.py (running them), report.py (analysis) and slurm.py (one array job per arm,
then the report).
`--dry-run` validates every run's config and prints the command lines (with --slurm: the sbatch
scripts); nothing starts.  `--task ARM` is what an array task of `--slurm` runs: the run of ARM
whose seed is at position SLURM_ARRAY_TASK_ID.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from megatron_rl.experiment.config import load_experiment
from megatron_rl.experiment.runner import run_all
from megatron_rl.experiment.runs import plan_runs

logger = logging.getLogger(__name__)


def _cmd_experiment(args) -> int:
    from megatron_rl.console import end_progress
    from megatron_rl.experiment.report import write_report

    cfg = load_experiment(args.config)
    if args.task is not None:
        from megatron_rl.experiment.slurm import run_task

        return run_task(cfg, args.task)
    runs = plan_runs(cfg)  # every run's config loads
    if args.slurm:
        return _submit(cfg, args)
    if args.dry_run:
        print(json.dumps({"dir": cfg.dir, "order": cfg.order(), "seeds": cfg.seeds, "runner": cfg.runner,
                          "runs": [[*([f"MEGATRON_RL_DRILL='{run.faults}'"] if run.faults else []), "megatron-rl",
                                    *run.argv()] for run in runs]}, indent=2))
        return 0
    ran = run_all(cfg)
    logger.info("experiment %s: %d runs now, %d skipped", cfg.dir, len(ran),
                len(cfg.arms) * len(cfg.seeds) - len(ran))
    report = write_report(cfg)
    end_progress()
    print(json.dumps({arm: {k: e.get(k) for k in ("test_correctness_mean", "difference", "ci", "verdict")}
                      for arm, e in report["arms"].items()}))
    return 0


def _submit(cfg, args) -> int:
    from megatron_rl.experiment.slurm import SlurmOptions, submit

    opts = SlurmOptions(nodes=args.nodes, tasks_per_node=args.tasks_per_node, cpus_per_task=args.cpus_per_task,
                        gpus_per_task=args.gpus_per_task, time_limit=args.time, signal_seconds=args.signal_seconds,
                        extra=args.sbatch_arg)
    out = submit(cfg, Path(args.config), opts, dry_run=args.dry_run)
    if args.dry_run:
        for name, text in out["scripts"].items():
            print(f"# ---- {name}.sbatch ----\n{text}")
        return 0
    print(json.dumps(out["jobs"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("experiment", help="arms x seeds of real runs, pre-registered, paired-bootstrap report")
    p.add_argument("--config", required=True, help="experiment YAML (base config, arms, seeds, preregistration)")
    p.add_argument("--dry-run", action="store_true", help="validate and print the runs (or scripts); start nothing")
    p.add_argument("--slurm", action="store_true", help="submit one Slurm array job per arm, then the report job")
    p.add_argument("--task", metavar="ARM", help="(Slurm array task) run ARM's run at SLURM_ARRAY_TASK_ID")
    p.add_argument("--nodes", type=int, default=1, help="--slurm: nodes per run")
    p.add_argument("--tasks-per-node", type=int, default=1, help="--slurm: Ray nodes per Slurm node")
    p.add_argument("--cpus-per-task", type=int, default=2, help="--slurm")
    p.add_argument("--gpus-per-task", type=int, default=0, help="--slurm")
    p.add_argument("--time", default="04:00:00", help="--slurm: time limit per run")
    p.add_argument("--signal-seconds", type=int, default=300, help="--slurm: USR1 this long before the limit")
    p.add_argument("--sbatch-arg", action="append", default=[], help="--slurm: extra #SBATCH line, e.g. --partition=gpu")
    p.set_defaults(func=_cmd_experiment)
