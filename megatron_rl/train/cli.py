"""`megatron-rl train`, `megatron-rl sft` and `megatron-rl reconcile`.

    megatron-rl train --config configs/tiny_cpu.yaml [dotted.key=value ...] [--dry-run]
    megatron-rl sft --config configs/tiny_cpu.yaml run.dir=runs/sft [sft.steps=50 ...]
    megatron-rl reconcile --config configs/tiny_cpu.yaml [--json]

`train --dry-run` validates the whole config (types, cross-section rules, parallel layout
against the model, data files) and prints the plan without starting Ray, vLLM or Megatron.
The console shows one progress line per step (a bar on a terminal) and the project's own
messages; library and engine logs go to RUN_DIR/logs/ (`--verbose` shows them; megatron_rl/console.py).
Exit codes: 0 done, 1 a bug (its traceback), 2 bad input, 75 stopped by a signal after checkpointing (requeue me),
81-86 a stop condition held and the run checkpointed and stopped (megatron_rl/train/stop.py:
81 nonfinite, 82 dev_eval_falling, 83 kl_out_of_bounds, 84 entropy_out_of_bounds, 85 lag_p95,
86 verifier_errors); the final JSON line names it.  75 also ends a run whose rollout engine or
learner rank died (rerun to resume); 87 a learner step that ran out of memory at the configured and
at half the micro-batch size (nothing of it applied).  Fault drills: `megatron-rl drill`.
"""

from __future__ import annotations

import argparse
import json

from megatron_rl.console import attach_run_dir, end_progress


def _config_and_plan(args: argparse.Namespace):
    """The validated config; with --dry-run the plan is printed (and nothing else happens)."""
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.dry_run import check_and_plan

    cfg = load_train_config(args.config, args.overrides)
    plan = check_and_plan(cfg)
    if args.dry_run:
        print(json.dumps(plan, indent=2))
    else:  # library and engine logs go to RUN_DIR/logs/ from here on (megatron_rl/console.py)
        attach_run_dir(cfg.run.dir)
    return cfg


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _config_and_plan(args)
    if args.dry_run:
        return 0
    from megatron_rl.train.driver import EXIT_REQUEUE, StopFlag, train
    from megatron_rl.train.stop import StopConditionMet

    baseline = None
    if cfg.sft.first:  # SFT, then GRPO from its result: the baseline the run is measured against
        from megatron_rl.train.sft import sft_baseline

        cfg, baseline = sft_baseline(cfg)
    stop = StopFlag()
    stop.install()
    try:
        summary = train(cfg, stop)
    except StopConditionMet as exc:
        end_progress()
        print(json.dumps({**exc.condition.to_dict(), "checkpointed": True}))
        raise
    except SystemExit as exc:
        end_progress()
        if exc.code == EXIT_REQUEUE:
            print(json.dumps({"stopped": "signal", "checkpointed": True}))
        raise
    if baseline is not None:
        summary = {"baseline": "sft", "sft_steps": baseline["steps"],
                   "baseline_test_correctness": baseline["test_correctness"], **summary}
    end_progress()
    print(json.dumps(summary))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    cfg = _config_and_plan(args)
    if args.dry_run:
        return 0
    from megatron_rl.train.sft import sft

    summary = sft(cfg)
    end_progress()
    print(json.dumps(summary))
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
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. run.steps=10")
    p.set_defaults(func=_cmd_train)
    f = sub.add_parser("sft", help="supervised fine-tuning on the train split: the baseline GRPO starts from")
    f.add_argument("--config", required=True, help="training config YAML (its sft section sets steps and lr)")
    f.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    f.add_argument("overrides", nargs="*", help="dotted.key=value overrides, e.g. sft.steps=20")
    f.set_defaults(func=_cmd_sft)
    r = sub.add_parser("reconcile", help="one-step reconciliation report: logprobs, reward, advantage, loss, grad sign")
    r.add_argument("--config", required=True, help="training config YAML")
    r.add_argument("--json", action="store_true", help="print only the JSON summary line")
    r.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    r.set_defaults(func=_cmd_reconcile)

