"""`megatron-rl train`, `megatron-rl sft` and `megatron-rl reconcile`.

    megatron-rl train --config configs/tiny_cpu.yaml [dotted.key=value ...] [--dry-run]
    megatron-rl sft --config configs/tiny_cpu.yaml run.dir=runs/sft [sft.steps=50 ...]
    megatron-rl reconcile --config configs/tiny_cpu.yaml [--json]

`train --dry-run` validates the whole config (types, cross-section rules, parallel layout
against the model, data files) and prints the plan without starting Ray, vLLM or Megatron.
The console shows one progress line per step (a bar on a terminal) and the project's own
messages; library and engine logs go to RUN_DIR/logs/ (`--verbose` shows them; megatron_rl/console.py).
Exit codes: 0 done, 1 a bug (its traceback), 2 bad input, 75 stopped by a signal after checkpointing (requeue me),
81-86 and 89 a stop condition held and the run checkpointed and stopped (megatron_rl/reporting/stop.py:
81 nonfinite, 82 dev_eval_falling, 83 kl_out_of_bounds, 84 entropy_out_of_bounds, 85 lag_p95,
86 verifier_errors, 89 audit: megatron_rl/audit/); the final JSON line names it.  75 also ends a run
whose rollout engine or learner rank died (rerun to resume); 87 a learner step that ran out of memory at the configured and
at half the micro-batch size (nothing of it applied).  Fault drills: `megatron-rl drill`.
`--summary-out PATH` writes the run's final JSON line (its summary, or the stop that ended it) to PATH too: how
the experiment runner and the drills receive it from a run in its own process.  Inside the runner's process it calls `run_one`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

from megatron_rl.console import attach_run_dir, end_progress


def plan_or_attach(cfg, dry_run: bool) -> None:
    """Check the whole config and plan the run (train/dry_run.py); with --dry-run print the plan (and nothing
    else happens), else library and engine logs go to RUN_DIR/logs/ from here on (megatron_rl/console.py)."""
    from megatron_rl.train.dry_run import check_and_plan

    plan = check_and_plan(cfg)
    if dry_run:
        print(json.dumps(plan, indent=2))
    else:
        attach_run_dir(cfg.run.dir)


def run_one(command: str, cfg, pool=None) -> dict:
    """One `train` or `sft` run of a checked config (plan_or_attach); returns its summary, the dict the
    command prints as its final JSON line.  `pool`: the experiment runner's EnginePool (train/engine_pool.py),
    whose placement, engines and learner actors the run takes and leaves back; None, the run owns its own.
    A stop condition or a signal ends the run with its SystemExit, after printing its own JSON line."""
    if command == "sft":
        from megatron_rl.train.sft import sft

        return sft(cfg, pool)
    from megatron_rl.train.driver import EXIT_REQUEUE, StopFlag, train
    from megatron_rl.reporting.stop import StopConditionMet

    from megatron_rl.train.run_setup import start_ray

    baseline = None
    own_ray = cfg.sft.first and start_ray(cfg)  # SFT then GRPO: one Ray for both stages
    stop = StopFlag()
    stop.install()
    try:
        with contextlib.ExitStack() as stages:
            if cfg.sft.first:  # SFT, then GRPO from its result: the baseline the run is measured against
                from megatron_rl.train.engine_pool import engine_pool
                from megatron_rl.train.sft import sft_baseline

                # SFT's learner actors (placed as GRPO's) are GRPO's learners: a pool for the two stages
                pool = pool if pool is not None else stages.enter_context(engine_pool())
                cfg, baseline = sft_baseline(cfg, pool)
            summary = train(cfg, stop, pool)
    except StopConditionMet as exc:
        exc.summary = {**exc.condition.to_dict(), "checkpointed": True}
        print_summary(exc.summary)
        raise
    except SystemExit as exc:
        if exc.code == EXIT_REQUEUE:
            exc.summary = {"stopped": "signal", "checkpointed": True}
            print_summary(exc.summary)
        raise
    finally:
        if own_ray:
            import ray

            ray.shutdown()
    if baseline is not None:  # the baseline's test eval is GRPO's step 0: the same weights (train/sft.py)
        summary = {"baseline": "sft", "sft_steps": baseline["steps"],
                   "baseline_test_correctness": summary["initial_test_correctness"], **summary}
    return summary


def print_summary(summary: dict, out: Path | None = None, *, echo: bool = True) -> None:
    """The run's final JSON line; with `out` (--summary-out) the same dict as a JSON file, for whoever
    launched the run (the experiment runner, experiment/runner.py; a drill, drill/harness.py), so that no one
    reads it from a log.  `echo=False`: the file only (the line was printed already)."""
    end_progress()
    if echo:
        print(json.dumps(summary))
    if out is not None:
        from megatron_rl.durable_files import write_json_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out, summary)


def _cmd_run(args: argparse.Namespace) -> int:
    """`train` and `sft`."""
    from megatron_rl.train.config import load_train_config

    if args.summary_out is not None:
        args.summary_out.unlink(missing_ok=True)  # a file there after the run is this run's
    extra = ["run.allow_config_change=true"] if args.allow_config_change else []
    cfg = load_train_config(args.config, [*args.overrides, *extra])
    plan_or_attach(cfg, args.dry_run)
    if args.dry_run:
        return 0
    try:
        summary = run_one(args.command, cfg)
    except SystemExit as exc:  # a stop condition or a signal: its JSON line goes to --summary-out too
        if args.summary_out is not None and getattr(exc, "summary", None) is not None:
            print_summary(exc.summary, args.summary_out, echo=False)
        raise
    print_summary(summary, args.summary_out)
    return 0


def _cmd_reconcile(args: argparse.Namespace) -> int:
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.dry_run import check_and_plan
    from megatron_rl.train.reconcile import reconcile, render_table

    cfg = load_train_config(args.config, args.overrides)
    check_and_plan(cfg)
    attach_run_dir(cfg.run.dir)
    report = reconcile(cfg)
    if not args.json:
        print(render_table(report))
    print(json.dumps(report["summary"]))
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="GRPO training: rollout -> score -> enqueue -> take -> learn -> publish")
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    p.add_argument("--summary-out", type=Path, metavar="PATH", help="also write the final summary (JSON) to PATH")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume even if learning keys (lr, loss, reward, data, sampling) changed (run.allow_config_change)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. run.steps=10")
    p.set_defaults(func=_cmd_run)
    f = sub.add_parser("sft", help="supervised fine-tuning on the train split: the baseline GRPO starts from")
    f.add_argument("--config", required=True, help="training config YAML (its sft section sets steps and lr)")
    f.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    f.add_argument("--summary-out", type=Path, metavar="PATH", help="also write the final summary (JSON) to PATH")
    f.add_argument("--allow-config-change", action="store_true",
                   help="resume even if learning keys (lr, loss, reward, data, sampling) changed (run.allow_config_change)")
    f.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. sft.steps=20")
    f.set_defaults(func=_cmd_run)
    r = sub.add_parser("reconcile", help="one-step reconciliation report: logprobs, reward, advantage, loss, grad sign")
    r.add_argument("--config", required=True, help="training config YAML")
    r.add_argument("--json", action="store_true", help="print only the JSON summary line")
    r.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    r.set_defaults(func=_cmd_reconcile)

