"""Checkpoints of a training run: what a resume restores and what a checkpoint saves.

    resume_from = choose_resume(cfg)                  # train/resume.py: once per start
    restore_queue_snapshot(run_dir, resume_from, h)   # before the coordinator starts
    ckpt = Checkpointer(run_dir, cfg, tokenizer_hash=h, resume_from=resume_from)
    state, initial_eval = ckpt.resume(policy, source, coordinator)   # GRPO: the resume point, or step 0
    if ckpt.due(step, last): path = ckpt.save(state, policy, source, coordinator, initial_eval=...)
    manifest = ckpt.restore(learner, cursor); ckpt.commit(step, step, learner, cursor, extra={"kind": "sft"})

A checkpoint holds the learner (weights, optimizer, scheduler, per-rank RNG; with learner.lora the adapters
and their optimizer state, and the digest of the base they belong to), the KL penalty's β (its manifest's
`kl_control`: the adaptive controller's state, grpo/kl_control.py), the refit check's probe rows (its
`refit_probe_rows`: tokens the engines sampled, train/policy.py), a probe batch and
its logprobs (the shadow forward on resume, train/restart.py), the coordinator's queue (its SQLite
log: admission leases, sampler RNG), the data cursor, and the rollout rounds generated ahead of
the learner; COMMITTED (sha256 of every file) is written last.  The queue snapshot is put back
before the coordinator starts (`restore_queue_snapshot`).  SFT checkpoints hold the learner and the
data cursor only (`restore`, `commit`): both kinds go through this one class, with one cadence (`due`).
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
from pathlib import Path

from megatron_rl.version import __version__
from megatron_rl.config import config_hash
from megatron_rl.coordinator.client import Coordinator
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.policy import Policy
from megatron_rl.sampling.producer import Round, TrainState
from megatron_rl.train.resume import learner_world, lora_record
from megatron_rl.sampling.rollout_source import RolloutSource

logger = logging.getLogger(__name__)

QUEUE_DB = "queue.db"
QUEUE_SNAPSHOT = "queue_snapshot.db"
PENDING_ROUNDS = "rollout_rounds.json"  # rounds generated before a checkpoint, not yet learned from
IN_FLIGHT = "rollout_in_flight.json"  # streaming: prompt groups generating at the checkpoint (generated again)


class Checkpointer:
    """Saves and restores every part of a run's state (GRPO: `resume`, `save`; SFT: `restore`, `commit`);
    the checkpoint to resume was chosen once at the start (train/resume.py `choose_resume`)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig, *, tokenizer_hash: str, resume_from: Path | None,
                 base_digest: str | None = None):
        self.run_dir = run_dir
        self.base_digest = base_digest  # learner.lora: the frozen base's (train/resume.py check_lora), recorded
        self.config_hash = config_hash(cfg)
        self.tokenizer_hash = tokenizer_hash
        self.resume_from = resume_from
        self.keep = cfg.run.keep_checkpoints
        self.every = cfg.run.checkpoint_every
        self.shadow_tolerance = cfg.run.shadow_tolerance
        self.learner_world = learner_world(cfg)

    def due(self, step: int, last: int) -> bool:
        """The checkpoint cadence: after every `run.checkpoint_every`-th step (0: none) and after the last."""
        return bool(self.every and step % self.every == 0) or step == last

    def restore(self, learner, cursor, *, shadow: bool = False) -> dict | None:
        """Load the resume point into the learner (weights, optimizer, RNG) and the data cursor; its manifest,
        or None when the run starts at step 0.  `shadow`: check the loaded weights against the checkpoint's
        probe (train/restart.py) before anything else is restored."""
        from megatron_rl.checkpoint import load_checkpoint, load_rng_state, quarantine_newer
        from megatron_rl.train.restart import shadow_forward

        ckpt = self.resume_from  # verified (sha256) when it was chosen
        if ckpt is None:
            return None
        manifest = load_checkpoint(ckpt, tokenizer_hash=self.tokenizer_hash, verify=False)
        if manifest["config_hash"] != self.config_hash:
            logger.warning("resuming %s written with a different config (hash %s, now %s)",
                           ckpt, manifest["config_hash"][:12], self.config_hash[:12])
        learner.load(str(ckpt / "weights"))
        learner.set_rng_states({r: load_rng_state(ckpt, r) for r in manifest["rng"]["ranks"]})
        if shadow:
            shadow_forward(learner, ckpt, self.shadow_tolerance)  # refuses altered weights
        cursor.load_state_dict(manifest["data_cursor"])
        quarantine_newer(ckpt.parent, int(manifest["step"]))  # newer step dirs failed verification
        return manifest

    def resume(self, policy: Policy, source: RolloutSource, coordinator: Coordinator) -> tuple[TrainState, dict | None]:
        """(state, the step-0 test eval the checkpoint recorded) after loading the learner, its RNG,
        the data cursor and the pending rounds, and publishing the loaded version; step 0 without one."""
        manifest = self.restore(policy.learner, source.cursor, shadow=True)
        if manifest is None:
            coordinator.set_version(0)
            return TrainState(step=0, version=0), None
        ckpt = self.resume_from
        rounds = [Round.from_dict(d) for d in json.loads((ckpt / PENDING_ROUNDS).read_text())] \
            if (ckpt / PENDING_ROUNDS).is_file() else []
        in_flight = json.loads((ckpt / IN_FLIGHT).read_text()) if (ckpt / IN_FLIGHT).is_file() else []
        state = TrainState(step=int(manifest["step"]), version=int(manifest["policy_version"]), rounds=rounds,
                           in_flight=in_flight, serials=manifest.get("extra", {}).get("stream_serials") or {})
        policy.kl.load_state_dict(manifest.get("extra", {}).get("kl_control"))  # the adaptive KL's β
        policy.probe_rows = manifest.get("extra", {}).get("refit_probe_rows")  # sampled: the bf16 bound holds
        logger.info("resumed from %s: step %d, policy version %d", ckpt, state.step, state.version)
        policy.publish(state.version)
        coordinator.set_version(state.version)
        return state, manifest.get("extra", {}).get("initial_test_eval")

    def commit(self, step: int, version: int, learner, cursor, *, write=None, coordinator_log_position=None,
               extra: dict) -> Path:
        """Save checkpoint `step`: the learner's weights, optimizer and RNG, the data cursor, what `write(tmp)`
        adds, the manifest with `extra` and the learner layout (COMMITTED last); then rotate old ones."""
        from megatron_rl.checkpoint import rotate, save_checkpoint

        def save_fn(tmp: Path) -> None:
            learner.save(str(tmp / "weights"))
            if write is not None:
                write(tmp)

        ckpts = self.run_dir / "checkpoints"
        path = save_checkpoint(
            ckpts, step, policy_version=version, config_hash=self.config_hash, save_fn=save_fn,
            tokenizer_hash=self.tokenizer_hash, data_cursor=cursor.state_dict(),
            coordinator_log_position=coordinator_log_position, rng_states=learner.rng_states(),
            extra={**extra, "learner_world": self.learner_world, **lora_record(self.base_digest)})
        rotate(ckpts, self.keep)
        logger.debug("checkpoint %s committed", path)  # checkpoint.py says it on the console
        return path

    def save(self, state: TrainState, policy: Policy, source: RolloutSource, coordinator: Coordinator, *,
             initial_eval: dict | None) -> Path:
        """Save weights, optimizer, RNG, queue (with admission leases and sampler RNG), data cursor and
        the rollout rounds generated ahead of the learner; COMMITTED is written last."""
        from megatron_rl.train.restart import save_probe

        rounds = source.pause()  # admission stopped: cursor, queue, rounds and the groups in flight agree
        in_flight = source.in_flight()  # streaming: generating on through the save; generated again at resume
        serials = source.serials()  # streaming: a resumed run's groups go on from the next serial
        try:
            learner = policy.learner

            def write(tmp: Path) -> None:
                save_probe(learner, rows=policy.settings.probe_rows, vocab_size=policy.settings.vocab_size,
                           ckpt_dir=tmp)
                snapshot_queue(self.run_dir / QUEUE_DB, tmp / QUEUE_SNAPSHOT)
                (tmp / PENDING_ROUNDS).write_text(json.dumps([r.to_dict() for r in rounds]))
                if in_flight:
                    (tmp / IN_FLIGHT).write_text(json.dumps(in_flight))

            return self.commit(state.step, state.version, learner, source.cursor, write=write,
                               coordinator_log_position=coordinator.position(),
                               extra={"initial_test_eval": initial_eval, "package_version": __version__,
                                      "pending_rounds": [r.index for r in rounds],
                                      "in_flight_groups": [g["serial"] for g in in_flight],
                                      "stream_serials": serials,
                                      "kl_control": policy.kl.state_dict(), "refit_probe_rows": policy.probe_rows})
        finally:
            source.unpause()


def snapshot_queue(src: Path, dst: Path) -> None:
    """Consistent copy of the coordinator's SQLite log (SQLite's online backup)."""
    if not src.exists():
        return
    with sqlite3.connect(str(src)) as a, sqlite3.connect(str(dst)) as b:
        a.backup(b)

def restore_queue_snapshot(run_dir: Path, resume_from: Path | None, tokenizer_hash: str | None = None) -> None:
    """Put the queue back as it was at checkpoint `resume_from` (train/resume.py `choose_resume`), or
    start it empty (None).

    The choice verified every file of the checkpoint (sha256) before the live queue.db is touched, so
    nothing of a corrupt one ever reaches the run directory; a checkpoint of another tokenizer is
    refused (CheckpointError) with the live queue left as it is.
    """
    from megatron_rl.checkpoint import load_checkpoint

    if resume_from is not None:
        load_checkpoint(resume_from, tokenizer_hash=tokenizer_hash, verify=False)  # files verified when chosen
    live = run_dir / QUEUE_DB
    for suffix in ("", "-wal", "-shm"):
        Path(str(live) + suffix).unlink(missing_ok=True)
    if resume_from is not None and (resume_from / QUEUE_SNAPSHOT).exists():
        shutil.copyfile(resume_from / QUEUE_SNAPSHOT, live)
        logger.info("restored %s from %s", QUEUE_DB, resume_from / QUEUE_SNAPSHOT)
