"""Checkpoints of a training run: what a resume restores and what a checkpoint saves.

    ckpt = Checkpointer(run_dir, cfg, tokenizer_hash=h, resume_from=restore_queue_snapshot(run_dir, cfg, h))
    state, initial_eval = ckpt.resume(policy, source, coordinator)   # newest COMMITTED checkpoint, or step 0
    path = ckpt.save(state, policy, source, coordinator, initial_eval=...)

A checkpoint holds the learner (weights, optimizer, scheduler, per-rank RNG), a probe batch and
its logprobs (the shadow forward on resume, train/restart.py), the coordinator's queue (its SQLite
log: admission leases, sampler RNG), the data cursor, and the rollout rounds generated ahead of
the learner; COMMITTED (sha256 of every file) is written last.  The queue snapshot is put back
before the coordinator starts (`restore_queue_snapshot`); a checkpoint of another learner layout
is refused before anything starts (`check_resume_world`).
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
from pathlib import Path

from megatron_rl import __version__
from megatron_rl.config import config_hash
from megatron_rl.coordinator.client import Coordinator
from megatron_rl.models.lora_checkpoint import BASE_DIGEST, base_digest, check_adapter_record, check_base_digest
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.policy import Policy
from megatron_rl.train.producer import Round, TrainState
from megatron_rl.train.rollout_source import RolloutSource

logger = logging.getLogger(__name__)

QUEUE_DB = "queue.db"
QUEUE_SNAPSHOT = "queue_snapshot.db"
PENDING_ROUNDS = "rollout_rounds.json"  # rounds generated before a checkpoint, not yet learned from


class Checkpointer:
    """Saves and restores every part of a run's state; the checkpoint to resume was chosen (and
    verified) by restore_queue_snapshot before the coordinator started."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, *, tokenizer_hash: str, resume_from: Path | None,
                 base_digest: str | None = None):
        self.run_dir = run_dir
        self.base_digest = base_digest  # learner.lora: the frozen base's (lora_base_digest), recorded per checkpoint
        self.config_hash = config_hash(cfg)
        self.tokenizer_hash = tokenizer_hash
        self.resume_from = resume_from
        self.keep = cfg.run.keep_checkpoints
        self.shadow_tolerance = cfg.run.shadow_tolerance
        self.learner_world = learner_world(cfg)

    def resume(self, policy: Policy, source: RolloutSource, coordinator: Coordinator) -> tuple[TrainState, dict | None]:
        """(state, the step-0 test eval the checkpoint recorded) after loading the learner, its RNG,
        the data cursor and the pending rounds, and publishing the loaded version; step 0 without one."""
        from megatron_rl.checkpoint import load_checkpoint, load_rng_state, quarantine_newer
        from megatron_rl.train.restart import shadow_forward

        ckpt = self.resume_from  # verified (sha256) before anything was restored from it
        if ckpt is None:
            coordinator.set_version(0)
            return TrainState(step=0, version=0), None
        manifest = load_checkpoint(ckpt, tokenizer_hash=self.tokenizer_hash, verify=False)
        if manifest["config_hash"] != self.config_hash:
            logger.warning("resuming %s written with a different config (hash %s, now %s)",
                           ckpt, manifest["config_hash"][:12], self.config_hash[:12])
        learner = policy.learner
        learner.load(str(ckpt / "weights"))
        learner.set_rng_states({r: load_rng_state(ckpt, r) for r in manifest["rng"]["ranks"]})
        shadow_forward(learner, ckpt, self.shadow_tolerance)  # refuses altered weights
        source.cursor.load_state_dict(manifest["data_cursor"])
        rounds = [Round.from_dict(d) for d in json.loads((ckpt / PENDING_ROUNDS).read_text())] \
            if (ckpt / PENDING_ROUNDS).is_file() else []
        state = TrainState(step=int(manifest["step"]), version=int(manifest["policy_version"]), rounds=rounds)
        logger.info("resumed from %s: step %d, policy version %d", ckpt, state.step, state.version)
        policy.publish(state.version)
        coordinator.set_version(state.version)
        quarantine_newer(ckpt.parent, state.step)  # newer step dirs failed verification
        return state, manifest.get("extra", {}).get("initial_test_eval")

    def save(self, state: TrainState, policy: Policy, source: RolloutSource, coordinator: Coordinator, *,
             initial_eval: dict | None) -> Path:
        """Save weights, optimizer, RNG, queue (with admission leases and sampler RNG), data cursor and
        the rollout rounds generated ahead of the learner; COMMITTED is written last."""
        from megatron_rl.checkpoint import rotate, save_checkpoint
        from megatron_rl.train.restart import save_probe

        rounds = source.pause()  # nothing in flight: cursor, queue and rounds agree
        try:
            position = coordinator.position()
            ckpts = self.run_dir / "checkpoints"
            learner = policy.learner

            def save_fn(tmp: Path) -> None:
                learner.save(str(tmp / "weights"))
                save_probe(learner, rows=policy.settings.probe_rows, vocab_size=policy.settings.vocab_size,
                           ckpt_dir=tmp)
                snapshot_queue(self.run_dir / QUEUE_DB, tmp / QUEUE_SNAPSHOT)
                (tmp / PENDING_ROUNDS).write_text(json.dumps([r.to_dict() for r in rounds]))

            path = save_checkpoint(
                ckpts, state.step, policy_version=state.version, config_hash=self.config_hash,
                save_fn=save_fn, tokenizer_hash=self.tokenizer_hash, data_cursor=source.cursor.state_dict(),
                coordinator_log_position=position, rng_states=learner.rng_states(),
                extra={"initial_test_eval": initial_eval, "package_version": __version__,
                       "pending_rounds": [r.index for r in rounds], "learner_world": self.learner_world,
                       **({BASE_DIGEST: self.base_digest} if self.base_digest else {})},
            )
        finally:
            source.unpause()
        rotate(ckpts, self.keep)
        logger.debug("checkpoint %s committed", path)  # checkpoint.py says it on the console
        return path


def learner_world(cfg: TrainConfig) -> dict:
    """The learner layout a checkpoint records: (tensor, pipeline, data) parallel sizes."""
    lc = cfg.learner
    return {"tensor": lc.tensor_parallel_size, "pipeline": lc.pipeline_parallel_size, "data": lc.data_parallel_size}


def snapshot_queue(src: Path, dst: Path) -> None:
    """Consistent copy of the coordinator's SQLite log (SQLite's online backup)."""
    if not src.exists():
        return
    with sqlite3.connect(str(src)) as a, sqlite3.connect(str(dst)) as b:
        a.backup(b)

def check_resume_world(cfg: TrainConfig) -> None:
    """Refuse, before anything starts, to resume a checkpoint saved by another learner layout.

    The Megatron distributed checkpoint of model + optimizer could be resharded, but the
    per-rank RNG states and the scheduler files are keyed by rank, so a resume at another
    data-parallel (or tensor/pipeline) size would not be the run it claims to continue.
    """
    from megatron_rl.checkpoint import CheckpointError, read_manifest, resume_checkpoint

    ckpt = resume_checkpoint(Path(cfg.run.dir).resolve() / "checkpoints") if cfg.run.resume else None
    if ckpt is None:
        return
    manifest = read_manifest(ckpt)
    now = learner_world(cfg)
    saved = manifest.get("extra", {}).get("learner_world")
    if saved is None:  # written before the layout was recorded: the RNG files still count the ranks
        ranks = len(manifest.get("rng", {}).get("ranks", []))
        if ranks and ranks != now["tensor"] * now["pipeline"] * now["data"]:
            raise CheckpointError(f"cannot resume {ckpt}: it was saved by {ranks} learner ranks, this run has "
                                  f"{now['tensor'] * now['pipeline'] * now['data']}")
        return
    if saved != now:
        raise CheckpointError(
            f"cannot resume {ckpt}: it was saved by a learner with (tensor, pipeline, data) parallel sizes "
            f"({saved['tensor']}, {saved['pipeline']}, {saved['data']}), this run has ({now['tensor']}, "
            f"{now['pipeline']}, {now['data']}); per-rank RNG and scheduler state cannot be carried over. "
            "Use the same layout, or start a new run directory (run.resume=false ignores the checkpoint)")

def lora_base_digest(cfg: TrainConfig, model_dir: Path) -> str | None:
    """With learner.lora: the digest of the frozen base (the run's model directory) its checkpoints
    record and a resume must match; None for a full-parameter run."""
    return base_digest(model_dir) if cfg.learner.lora.enabled else None


def restore_queue_snapshot(run_dir: Path, cfg: TrainConfig, tokenizer_hash: str | None = None,
                           base_digest: str | None = None, model_dir: Path | None = None) -> Path | None:
    """Put the queue back as it was at the checkpoint we resume from (if any); returns that checkpoint.

    The checkpoint is the newest one whose every file matches its COMMITTED manifest (sha256):
    a corrupt or uncommitted newer one is skipped (the warning names the file) before the live
    queue.db is touched, so nothing of it ever reaches the run directory; so is a checkpoint of
    another tokenizer refused (CheckpointError) with the live queue left as it is, and one whose LoRA
    adapters belong to another base than `base_digest` (that of `model_dir`, lora_base_digest) or whose
    weights are not what this run's learner loads (adapters of other learner.lora settings, or none).
    """
    from megatron_rl.checkpoint import load_checkpoint, resume_checkpoint

    ckpt = resume_checkpoint(run_dir / "checkpoints") if cfg.run.resume else None
    if ckpt is not None:
        manifest = load_checkpoint(ckpt, tokenizer_hash=tokenizer_hash, verify=False)  # files verified just above
        check_base_digest(ckpt, manifest, base_digest, model_dir)
        check_adapter_record(ckpt / "weights", cfg.learner.lora)  # adapters, or not, as this run's learner
    live = run_dir / QUEUE_DB
    for suffix in ("", "-wal", "-shm"):
        Path(str(live) + suffix).unlink(missing_ok=True)
    if ckpt is not None and (ckpt / QUEUE_SNAPSHOT).exists():
        shutil.copyfile(ckpt / QUEUE_SNAPSHOT, live)
        logger.info("restored %s from %s", QUEUE_DB, ckpt / QUEUE_SNAPSHOT)
    return ckpt
