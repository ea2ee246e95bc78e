"""`megatron-rl drill`: inject one fault into a real (shortened) training run and report the recovery.

    megatron-rl drill oom --config configs/tiny_cpu_scratch.yaml [--at-step 2] [--steps 4] [k=v ...]
    megatron-rl drill bad_checkpoint --config configs/tiny_cpu_scratch.yaml --variant truncate
    megatron-rl drill verifier_timeout --config configs/tiny_cpu_scratch.yaml --variant 0.1 reward.timeout_s=0.5

Prints one JSON record (megatron_rl/drill/): fault, injected_at, detected_by, action, recovered,
steps_redone, trajectories_lost, trajectories_duplicated, versions_continuous, time_to_recover_s.
Exit 0 when the drill ended as its protocol says (recovered, or the documented clean stop), else 1.
Drills: every name of drill/harness.py DRILLS, e.g. oom, engine_crash, refit_engine_death (RUNBOOK.md, "Fault drills").
`megatron-rl drill together --drills a,b,...` runs one-run drills in one training run (drill/together.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_drill(args: argparse.Namespace) -> int:
    from megatron_rl.drill.harness import DrillConfig, clear_run_dir
    from megatron_rl.drill.faults import run_drill

    at_step = args.at_step if args.at_step is not None else (4 if args.name == "bad_checkpoint" else 2)
    steps = args.steps if args.steps is not None else max(4, at_step + 1)
    run_dir = Path(args.run_dir or f"runs/drills/{args.name}")
    if not Path(args.config).is_file():
        raise FileNotFoundError(f"--config: no such file {args.config}")
    clear_run_dir(run_dir)
    cfg = DrillConfig(name=args.name, config=args.config, run_dir=str(run_dir), at_step=at_step, steps=steps,
                      variant=args.variant, from_run=args.from_run, overrides=list(args.overrides), timeout_s=args.timeout)
    record = run_drill(cfg)
    print(json.dumps(record))
    return 0 if record.get("recovered") and record["trajectories_lost"] == 0 and record["trajectories_duplicated"] == 0 else 1


def _cmd_together(args: argparse.Namespace) -> int:
    from megatron_rl.drill.harness import DrillConfig, clear_run_dir
    from megatron_rl.drill.together import all_recovered, check_names, run_together

    names = [n.strip() for n in args.drills.split(",") if n.strip()]
    check_names(names)
    at_step = args.at_step if args.at_step is not None else 2
    steps = args.steps if args.steps is not None else max(4, at_step + 1)
    run_dir = Path(args.run_dir or "runs/drills/together")
    if not Path(args.config).is_file():
        raise FileNotFoundError(f"--config: no such file {args.config}")
    clear_run_dir(run_dir)
    cfg = DrillConfig(name=names[0], config=args.config, run_dir=str(run_dir), at_step=at_step, steps=steps,
                      overrides=list(args.overrides), timeout_s=args.timeout)
    result = run_together(names, cfg)
    print(json.dumps(result))
    return 0 if all_recovered(result) else 1


def _cmd_reward_hacking(args: argparse.Namespace) -> int:
    from megatron_rl.config import ConfigError, read_config_data
    from megatron_rl.drill.reward_hacking import reward_hacking, run_targets

    targets = [Path(t) for t in args.target] + (run_targets(Path(args.from_run)) if args.from_run else [])
    if not targets:
        raise ConfigError("drill reward_hacking: give --from-run RUN_DIR or --target FILE")
    for t in targets:
        if not t.is_file():
            raise FileNotFoundError(f"drill reward_hacking: target {t} is not a file")
    sandbox = read_config_data(None, [f"s.{o}" for o in args.set]).get("s", {})
    record = reward_hacking(targets, sandbox)
    print(json.dumps(record))
    return 0 if record["recovered"] else 1


def _common_options(d) -> None:
    d.add_argument("--config", required=True, help="training config YAML (e.g. configs/tiny_cpu_scratch.yaml)")
    d.add_argument("--at-step", type=int, default=None,
                   help="learner step (0-based) the fault hits; bad_checkpoint: the checkpoint step to "
                        "damage (default 2; bad_checkpoint 4)")
    d.add_argument("--steps", type=int, default=None, help="training steps of the drill run (default max(4, S+1))")
    d.add_argument("--timeout", type=float, default=900.0, help="wall-clock limit of one training attempt (s)")


def register(sub) -> None:
    from megatron_rl.drill.harness import DRILLS

    p = sub.add_parser("drill", help="inject a fault into a short real training run; print the recovery record")
    names = p.add_subparsers(dest="name", metavar="NAME", required=True)
    for name in DRILLS:  # one parser per drill, so options and k=v overrides may come in any order after NAME
        d = names.add_parser(name, help=f"the {name} drill")
        _common_options(d)
        d.add_argument("--variant", default=None,
                       help="bad_checkpoint: flip|truncate|uncommit; verifier_timeout: share of calls that hang")
        d.add_argument("--from-run", default=None,
                       help="bad_checkpoint: damage a copy of this finished run instead of training one first")
        d.add_argument("--run-dir", default=None, help="run directory (default runs/drills/NAME; replaced)")
        d.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the training config")
        d.set_defaults(func=_cmd_drill)
    t = names.add_parser("together", help="several one-run drills in one training run (one record each)")
    _common_options(t)
    t.add_argument("--drills", required=True, help="comma-separated one-run drills (drill/together.py TOGETHER)")
    t.add_argument("--run-dir", default=None, help="run directory (default runs/drills/together; replaced)")
    t.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the training config")
    t.set_defaults(func=_cmd_together)
    r = names.add_parser("reward_hacking", help="the policy's code attacks the grader, a checkpoint and the data "
                                                "through the python environment's sandbox; every attempt must fail")
    r.add_argument("--from-run", default=None, help="take the targets from this run directory")
    r.add_argument("--target", action="append", default=[], help="a file to attack (repeatable)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a sandbox setting of the python environment, e.g. wall_seconds=5 (repeatable)")
    r.set_defaults(func=_cmd_reward_hacking)
