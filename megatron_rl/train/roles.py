"""The roles of a training run, each built from its own config section and the handles it uses.

    roles = Roles.build(cfg, resume_from=choose_resume(cfg))   # Ray, run inputs, coordinator, source, ...
    roles = Roles.build(cfg, pool, resume_from=...)   # the experiment runner's engine pool (train/engine_pool.py)
    ... the loop in driver.py ...
    roles.close()

Who owns what:
  coordinator   Coordinator (coordinator/client.py)          queue, admission, TTL, the take window
  source        RolloutSource (sampling/rollout_source.py)  producer, fleet, data cursor, prompts
  scorer        Scorer (sampling/scoring.py)                verifier pool, samples -> trajectories
  policy        Policy (policy.py)                           learner group, publication to the fleet
  checkpointer  Checkpointer (checkpointing.py)              resume and checkpoints
  reporter      Reporter (reporting/reporter.py)             metrics, evals, progress, stop rules
  auditor       Auditor (audit/auditor.py)                   re-scores sequences spanning versions (audit.every)
"""

from __future__ import annotations

import json

import dataclasses
import logging
from pathlib import Path

from megatron_rl.audit.auditor import Auditor
from megatron_rl.coordinator.client import Coordinator
from megatron_rl.train.checkpointing import QUEUE_DB, Checkpointer, restore_queue_snapshot
from megatron_rl.train.engine_pool import EnginePool
from megatron_rl.train.placement import Placement, gpu_path_choices
from megatron_rl.train.policy import Policy
from megatron_rl.reporting.reporter import Reporter
from megatron_rl.sampling.rollout_source import PromptStream, RolloutSource, RoundSpec, start_fleet
from megatron_rl.train.run_setup import RunInputs, close_run_dir, open_run_dir, start_ray, train_cursor
from megatron_rl.sampling.scoring import Scorer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Roles:
    inputs: RunInputs
    coordinator: Coordinator
    source: RolloutSource
    scorer: Scorer
    policy: Policy
    checkpointer: Checkpointer
    reporter: Reporter
    auditor: Auditor
    placement: Placement
    own_ray: bool
    pool: EnginePool | None = None
    """The experiment runner's pool (train/engine_pool.py): placement, engines and learner actors come
    from it and go back to it when the run closes; None for a run on its own."""

    @property
    def run_dir(self):
        return self.inputs.run_dir

    @classmethod
    def build(cls, cfg, pool: EnginePool | None = None, *, resume_from: Path | None) -> "Roles":
        """Each role from its own config section (cfg: the run's TrainConfig, train/config.py) and the
        handles it uses.  `pool`: the experiment runner's (placement, engines and learner actors come from
        it, and go back to it at close); None, the run starts and ends its own.  `resume_from`: the
        checkpoint this start resumes from, or None (chosen once by the caller: train/resume.py `choose_resume`)."""
        inputs = open_run_dir(cfg, kind="train", resuming=resume_from is not None, resume_from=resume_from)
        own_ray = start_ray(cfg)
        restore_queue_snapshot(inputs.run_dir, resume_from, inputs.tokenizer_hash)
        coordinator = Coordinator.start(cfg.coordinator, wal_path=inputs.run_dir / QUEUE_DB,
                                        tokenizer_hash=inputs.tokenizer_hash, take_timeout_s=cfg.run.take_timeout_s)
        lc = cfg.learner
        ranks = lc.world_size
        place = pool.placement(cfg, ranks) if pool is not None else Placement.create(cfg, ranks)
        train = inputs.splits["train"]
        scorer = Scorer.create(cfg.reward, inputs.tokenizer, tokenizer_hash=inputs.tokenizer_hash,
                               dataset_version=train.dataset_version)
        transport, sleep_on, sleep_why = gpu_path_choices(cfg, place.device)  # once, from (placement, device)
        rollout = dataclasses.replace(cfg.rollout_served, weight_transfer=transport, sleep_mode=sleep_on)
        handed = pool.take_engines(dataclasses.replace(rollout, model=str(inputs.model_dir))) if pool else None
        fleet = start_fleet(rollout, inputs.model_dir, place.rollout, wait=place.gpu,  # CPU: starts with the learner
                            handed_over=handed)
        source = RolloutSource(fleet, PromptStream(train, inputs.template, inputs.tokenizer, train_cursor(cfg, train)),
                               coordinator, scorer, spec=RoundSpec.from_sections(cfg.run, cfg.dynamic_sampling,
                                                                             cfg.data.env))
        learners = pool.take_learners(ranks) if pool is not None else None
        policy = Policy.create(cfg.learner, cfg.loss, cfg.run, cfg.sampling,
                               weight_transfer=transport, model_dir=inputs.model_dir,
                               fleet=fleet, placement=place.learner,
                               vocab_size=inputs.vocab_size, pad_id=inputs.pad_id,
                               sleep=(sleep_on, sleep_why), handed_over=learners,
                               audit_ring=cfg.audit.ring_versions(cfg.coordinator.max_version_lag))
        if fleet.handed_over:  # an earlier run's engines: they serve once this run's weights are on them
            policy.publish(0)
        checkpointer = Checkpointer(inputs.run_dir, cfg, tokenizer_hash=inputs.tokenizer_hash, resume_from=resume_from,
                                    base_digest=inputs.base_digest)  # LoRA: recorded in each checkpoint
        reporter = Reporter.create(cfg.stop, steps=cfg.run.steps, eval_size=cfg.data.eval_size, run_dir=inputs.run_dir,
                                   fleet=fleet, verifier=scorer.verifier, splits=inputs.splits,
                                   template=inputs.template, tokenizer=inputs.tokenizer, env=source.spec.env,
                                   tracking=cfg.tracking, config=json.loads((inputs.run_dir / "config.json").read_text()))
        auditor = Auditor(cfg.audit, policy.learner, mode=rollout.refit_mode,  # the engines' own mode
                          rows=policy.settings.probe_rows, pad_id=inputs.pad_id,
                          multiple=policy.settings.probe_rows // policy.settings.micro_batch_size)  # DP size
        return cls(inputs, coordinator, source, scorer, policy, checkpointer, reporter, auditor, place, own_ray, pool)

    def close(self) -> None:
        import ray

        for closer in (self.source.stop, self.reporter.close, self.scorer.close, self._park, self.source.close,
                       self.policy.close, self._remove_placement):
            try:
                closer()
            except Exception as err:  # shutting down: report, keep closing the rest
                logger.warning("while closing: %s", err)
        if self.own_ray:
            ray.shutdown()
        close_run_dir(self.inputs.run_dir)

    def _park(self) -> None:
        """Inside the experiment runner: engines and learner actors kept for the next run (before they close)."""
        if self.pool is not None:
            self.pool.park(self.source.fleet)
            self.pool.park_learners(self.policy.learner)

    def _remove_placement(self) -> None:
        if self.pool is None:  # else the pool keeps it
            self.placement.remove()

