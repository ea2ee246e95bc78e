"""What a run directory keeps that an audit can use: its trajectories, the weights of some versions.

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

import logging
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.run_files import query_sqlite, read_json
from megatron_rl.trajectory import Trajectory, TrajectoryError, validate

logger = logging.getLogger(__name__)


def kept_trajectories(run_dir: Path) -> list[Trajectory]:
    """Every trajectory whose bytes the run still keeps, each once (by id), in id order.  A log that is not a
    readable SQLite database, or a trajectory that decodes but breaks the trajectory contract (segments that
    do not tile its response, a checksum that does not match), is a ConfigError naming the file: an audit
    of what is left would silently depend on what the damage took."""
    logs = [run_dir / "queue.db", *sorted(run_dir.glob("checkpoints/step_*/queue_snapshot.db"))]
    found: dict[str, Trajectory] = {}
    for db in (p for p in logs if p.is_file()):
        for (payload,) in query_sqlite(db, "SELECT payload FROM traj"):
            try:
                traj = Trajectory.from_bytes(payload)
            except TrajectoryError as err:
                logger.warning("%s: a trajectory that does not decode is skipped (%s)", db, err)
                continue
            try:
                validate(traj)
            except TrajectoryError as err:
                raise ConfigError(f"{db}: {err}; the log is damaged") from None
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
    recorded = read_json(manifest).get("model_dir") if manifest.is_file() else None
    if isinstance(recorded, str) and recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    model = read_json(run_dir / "config.json").get("model")
    model = model if isinstance(model, dict) else {}
    candidate = Path(model["path"]) if model.get("path") else run_dir / "model" if model.get("tiny") else None
    return candidate if candidate is not None and (candidate / "config.json").is_file() else None
