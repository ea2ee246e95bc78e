"""`megatron-rl audit RUN_DIR`: re-score a sample of a streaming run's sequences that span policy versions under
the weights of each segment's recorded version, and report max |Δ logprob| per segment and per refit mode.

    megatron-rl audit RUN_DIR [--sequences 16] [--seed 0] [--tolerance T] [--json]

Uses the run's resolved config (RUN_DIR/config.json, `run_config`) and what the run directory keeps
(audit/run_dir.py): version 0 and each intact checkpoint's version as weights, the coordinator's log (and the
checkpoints' copies) as trajectories. Of the trajectories whose response spans versions and has at least one
segment of a kept version, `--sequences` are drawn (seeded); the others' segments are counted as unaudited
with the reason. Prints one line per segment, the maximum per label (initial = before any refit, the control;
the run's refit mode: rollout.inflight_refit, or adapter in a LoRA run; keep_kv), then a JSON summary line.

Exit codes: 0 every judged segment within the tolerance (default the run's audit.tolerance), or nothing
to audit (the message says why); 89 a judged segment over it (the lines name sequence and segment, see
RUNBOOK.md "Audit failed"); 2 RUN_DIR is not a training run directory, or a file it keeps is damaged (one
line names the file: run_files.py), or a bad option.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.audit.compare import spans_versions
from megatron_rl.config import ConfigError, from_dict
from megatron_rl.run_files import read_json
from megatron_rl.reporting.stop import EXIT_CODES

if TYPE_CHECKING:
    from megatron_rl.train.config import TrainConfig

EXIT_AUDIT = EXIT_CODES["audit"]


def _cmd_audit(args: argparse.Namespace) -> int:
    from megatron_rl.audit.offline import audit_offline
    from megatron_rl.audit.run_dir import kept_trajectories, kept_weights
    from megatron_rl.cli import CommandError

    if args.sequences < 1:
        raise ConfigError(f"--sequences must be at least 1, got {args.sequences}")
    if args.tolerance is not None and not args.tolerance >= 0:
        raise ConfigError(f"--tolerance must be a number >= 0, got {args.tolerance}")
    run_dir = Path(args.run_dir).resolve()
    cfg = run_config(run_dir)
    tolerance = cfg.audit.tolerance if args.tolerance is None else args.tolerance
    spanning = [t for t in kept_trajectories(run_dir) if spans_versions(t)]
    weights, notes = kept_weights(run_dir) if spanning else ({}, [])
    auditable = [t for t in spanning if any(seg[2] in weights for seg in t.segments)]
    chosen = sorted(random.Random(args.seed).sample(auditable, min(args.sequences, len(auditable))),
                    key=lambda t: t.id)
    summary = {"run_dir": str(run_dir), "spanning_sequences": len(spanning), "auditable_sequences": len(auditable),
               "weights_versions": sorted(weights), "notes": notes, "mode": cfg.refit_mode}
    if not chosen:
        why = _nothing_to_audit(spanning, weights)
        print(f"nothing to audit in {run_dir}: {why}")
        print(json.dumps({**summary, "audited_sequences": 0, "reason": why}))
        return 0
    report = audit_offline(cfg, chosen, weights, mode=cfg.refit_mode, tolerance=tolerance)
    out = {**summary, "audited_sequences": len(chosen), **report.to_dict()}
    if not args.json:
        for row in report.rows:
            verdict = "" if not row.judged else "  OVER" if row in report.failures else "  ok"
            print(row.describe() + verdict)
        for mode, m in sorted(report.by_mode().items()):
            print(f"{mode:>10}: max |Δ| {m['max_abs_delta']:.3g} over {m['segments']} segment(s)"
                  f"{'' if m['judged'] else ' (not judged: KV of older weights, by design)'}")
        print(f"versions with weights: {sorted(weights)}; {len(report.unaudited)} segment(s) of other versions "
              f"unaudited" + "".join(f"\n  note: {n}" for n in notes))
    print(json.dumps(out))
    if report.failures:
        raise CommandError(f"audit failed: {report.failures[0].describe()} > tolerance {tolerance:g} "
                           f"({len(report.failures)} segment(s) over it)", exit_code=EXIT_AUDIT)
    return 0


def run_config(run_dir: Path) -> TrainConfig:
    """The run's resolved TrainConfig; ConfigError naming what is missing when `run_dir` is not a run."""
    from megatron_rl.train.config import TrainConfig

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory (expected a training run directory, run.dir)")
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a training run directory: it has no config.json (the resolved config "
                          "every `megatron-rl train` writes into run.dir)")
    data = read_json(path)  # ConfigError naming the file when it is not a JSON object
    try:
        return from_dict(TrainConfig, data)
    except ConfigError as err:  # written by another version, or edited: one line naming the file
        problems = getattr(err, "problems", [str(err)])
        raise ConfigError(f"{path}: not the resolved config of a training run ({'; '.join(problems)})") from None


def _nothing_to_audit(spanning: list, weights: dict) -> str:
    if not spanning:
        return ("no kept trajectory spans more than one policy version (a round-based run, rollout.inflight_refit "
                "'wait', or the coordinator's log no longer holds them)")
    versions = sorted({seg[2] for t in spanning for seg in t.segments})
    return (f"the {len(spanning)} sequence(s) spanning versions were sampled by versions {versions}, and the run "
            f"keeps weights only of {sorted(weights)} (version 0 and its checkpoints): checkpoint more often "
            "(run.checkpoint_every, run.keep_checkpoints) or audit while training (audit.every)")


def register(sub) -> None:
    p = sub.add_parser("audit", help="re-score sequences spanning policy versions under their recorded versions")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (run.dir)")
    p.add_argument("--sequences", type=int, default=16, help="sequences to re-score (default 16)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sample (default 0)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="largest max |Δ logprob| of a judged segment (default the run's audit.tolerance)")
    p.add_argument("--json", action="store_true", help="print only the JSON summary line")
    p.set_defaults(func=_cmd_audit)
