"""What a run directory keeps that an audit can use: its config, its trajectories, the weights of some versions.

    cfg = run_config(run_dir)                         # RUN_DIR/config.json; ConfigError: not a run directory
    trajs = kept_trajectories(run_dir)                # the coordinator's log and the checkpoints' copies of it
    weights, notes = kept_weights(run_dir)            # {version: HF directory}: version 0 and each checkpoint

What can be audited, honestly: a segment whose version has weights on disk.  A run keeps version 0 (the
model it started from, RUN_DIR/run_manifest.json's model_dir, or model.path / model.tiny) and one version
per COMMITTED intact checkpoint (its manifest's policy_version; run.keep_checkpoints rotates the older
ones out), exported once to RUN_DIR/export/step_N.  Other versions were in the learner's host ring only
while the run trained (audit.every audits them then).  Trajectories: the coordinator's write-ahead log
(RUN_DIR/queue.db) keeps the payloads of queued trajectories and of the last takes (compaction drops
older ones), and each checkpoint keeps a copy of the log as it was (queue_snapshot.db); the run's own
log is read first, so a trajectory found in both is taken from it.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.trajectory import Trajectory, TrajectoryError

logger = logging.getLogger(__name__)


def run_config(run_dir: Path):
    """The run's resolved TrainConfig; ConfigError naming what is missing when `run_dir` is not a run."""
    from megatron_rl.train.config import TrainConfig

    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory (expected a training run directory, run.dir)")
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{run_dir} is not a training run directory: it has no config.json (the resolved config "
                          "every `megatron-rl train` writes into run.dir)")
    try:
        return from_dict(TrainConfig, json.loads(path.read_text()))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


def kept_trajectories(run_dir: Path) -> list[Trajectory]:
    """Every trajectory whose bytes the run still keeps, each once (by id), in id order."""
    logs = [run_dir / "queue.db", *sorted(run_dir.glob("checkpoints/step_*/queue_snapshot.db"))]
    found: dict[str, Trajectory] = {}
    for db in (p for p in logs if p.is_file()):
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            for (payload,) in conn.execute("SELECT payload FROM traj"):
                try:
                    traj = Trajectory.from_bytes(payload)
                except TrajectoryError as err:
                    logger.warning("%s: a trajectory that does not decode is skipped (%s)", db, err)
                    continue
                found.setdefault(traj.id, traj)
    return [found[k] for k in sorted(found)]


def kept_weights(run_dir: Path) -> tuple[dict[int, Path], list[str]]:
    """({policy version: HF directory of its weights}, notes on what is not there)."""
    from megatron_rl.checkpoint import checkpoint_status, read_manifest
    from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint

    weights, notes = {}, []
    start = _start_model(run_dir)
    if start is not None:
        weights[0] = start
    else:
        notes.append("version 0: the run started from another run's checkpoint that is not recorded here")
    for row in reversed(checkpoint_status(run_dir / "checkpoints")):  # oldest first: a newer one wins
        if row["status"] != "intact":
            notes.append(f"{row['path']}: {row['status']} ({row['problem']}), not used")
            continue
        version = int(read_manifest(row["path"])["policy_version"])
        weights[version] = export_run_checkpoint(run_dir, row["path"])
    return weights, notes


def _start_model(run_dir: Path) -> Path | None:
    """The HF directory the run's version 0 was loaded from, or None when that cannot be told."""
    from megatron_rl.run_manifest import NAME

    manifest = run_dir / NAME
    recorded = json.loads(manifest.read_text()).get("model_dir") if manifest.is_file() else None
    if recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    model = json.loads((run_dir / "config.json").read_text()).get("model") or {}
    candidate = Path(model["path"]) if model.get("path") else run_dir / "model" if model.get("tiny") else None
    return candidate if candidate is not None and (candidate / "config.json").is_file() else None
