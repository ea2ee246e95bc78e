"""Rollout engines, learner actors and their placement group, kept from one run of an experiment for the next.

    with engine_pool() as pool:     # the experiment runner, `runner: pooled` (experiment/runner.py)
        pool.prepare_for("train")   # before each run: what only another kind of run uses ends
        run_one("train", cfg, pool) # Roles.build(cfg, pool) takes what the pool holds, Roles.close parks it
        pool.drop()                 # after a failed run

A training run's start-up is mostly its rollout actor: a process that imports torch and vLLM and
loads an engine (~10 s of GRPO's ~14 s start-up on 2 cores, notes in benchmarks/).  Inside the
experiment runner (experiment/inprocess.py) the runs are one after another in one process and one
Ray cluster, so a finished run's engines can serve the next run instead of ending with it:

  engines    a run that ends with every rollout group serving parks its `RolloutWorker` actors here
             (Roles.close).  The next run takes them when their engine identity equals its own
             (rollout/engine_setup.py: vLLM arguments, environment, the model's shapes) and they
             sit in the same placement; otherwise they are ended and it starts its own.  A taken
             engine is reset to the run's rollout config and serves nothing (version None) until the
             run's first publication -- version 0, the run's initial weights -- committed on it
             through the normal path: checksummed buckets, then the refit probe (engine logprobs vs
             the learner's).  Its prefix cache is emptied and its version counter starts again at 0.
  learners   the run's `LearnerWorker` actors (one per rank) are parked too; the next run of the same
             placement rebuilds its learner in them (LearnerWorker.rebuild, ranks/build.py:
             the last run's model, reference, optimizer, publication group and Megatron parallel
             state dropped, then everything built from that run's sections, initial policy and seed
             as a new actor would; torch.distributed stays up), which saves their process start and
             torch/Megatron imports.  An `sft` run's learner actors (outside any placement group) are
             parked apart and rebuilt by the next `sft` run (train/sft.py).  The SFT stage of a `train`
             run (sft.first) builds its learners in that run's placement instead, and its GRPO stage
             takes them; `train` opens a pool of its own for its two stages when given none (train/cli.py).
  placement  the run's Ray placement group is kept under its key (placement kind, learner ranks,
             rollout groups and TP), so parked actors keep their bundles; a run with another key
             drops the pool and reserves its own.

Everything else stays per run: run dir, coordinator and its WAL queue, seeds, learner, metrics,
checkpoints.  Not parked: a fleet with a stale or unreachable group, or with vLLM sleep mode on.
The pool is an argument, never found: `Roles.build(cfg, pool)`, `sft(cfg, pool)`; a run given none
(`pool=None`: every run outside a pooled experiment) starts and ends its engines and learners itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator

logger = logging.getLogger(__name__)

@contextlib.contextmanager
def engine_pool() -> Iterator["EnginePool"]:
    """A pool for the runs it is handed to (in this process); its engines and placement end with the block."""
    pool = EnginePool()
    try:
        yield pool
    finally:
        pool.drop()


def sft_learner_group(pool: "EnginePool | None", *, before: object = None, **spec_fields):
    """An `sft` run's LearnerGroup (ranks/group.py) built from a RankSpec of `spec_fields`.  With a
    `pool`: the last `sft` run's actors, rebuilt, when it holds them for this layout; with `before` (the config
    of the GRPO run that follows, sft.first) the actors sit in that run's placement, reserved in the pool, and
    are the parked placed learners rebuilt when there are any.  Else new actors."""
    from megatron_rl.ranks.group import LearnerGroup, RankSpec

    spec = RankSpec(**spec_fields)
    ranks = spec.learner.world_size
    if pool is None:
        return LearnerGroup(spec)
    if before is not None:
        return LearnerGroup(spec, placement=pool.placement(before, ranks).learner,
                            handed_over=pool.take_learners(ranks))
    return LearnerGroup(spec, handed_over=pool.take_free_learners(ranks))


def release_sft_learners(group, pool: "EnginePool | None", *, placed: bool = False) -> None:
    """An `sft` run is done with its learner.  With a pool: parked for the next `sft` run, or (`placed`: built
    in the placement of the GRPO run that follows) for that run; else ended."""
    if pool is not None and placed:
        pool.park_learners(group)
    elif pool is not None:
        pool.park_free_learners(group)
    group.shutdown()  # ends nothing once parked


def placement_key(cfg, learner_ranks: int) -> tuple:
    """What a placement group is made of (train/placement.py: Placement.create)."""
    return (cfg.run.placement, learner_ranks, cfg.rollout.data_parallel_size, cfg.rollout.tensor_parallel_size)


@dataclasses.dataclass
class EnginePool:
    """What one finished run left for the next: at most one placement group, one fleet's engines, one
    learner group placed in it, and one sft run's learner group.  Owned by the experiment runner."""

    place: object = None
    """The kept Placement (train/placement.py), or None."""
    place_key: tuple | None = None
    workers: list | None = None
    """Parked RolloutWorker actors (one per rollout group), or None."""
    identity: dict | None = None
    """Their engine identity (rollout/engine_setup.py: engine_identity)."""
    handed: int = 0
    """How often parked engines were taken by a later run."""
    learners: list | None = None
    """Parked LearnerWorker actors (one per rank, in the kept placement), or None."""
    free_learners: list | None = None
    """Parked learner actors of an `sft` run (placed outside any placement group), or None."""

    def placement(self, cfg, learner_ranks: int):
        """The kept placement when its key is this run's; else the pool is dropped and a new one reserved."""
        from megatron_rl.train.placement import Placement

        key = placement_key(cfg, learner_ranks)
        if self.place is not None and key == self.place_key:
            logger.info("placement group of the previous run reused %s", key)
            return self.place
        self.drop()
        self.place, self.place_key = Placement.create(cfg, learner_ranks), key
        return self.place

    def take_engines(self, rollout) -> list | None:
        """The parked workers when their identity is that of `rollout` (a RolloutConfig with the run's
        model set); None when nothing fits (parked ones that do not fit are ended)."""
        from megatron_rl.rollout.engine_setup import engine_identity

        workers, self.workers = self.workers, None
        if workers is None:
            return None
        if engine_identity(rollout, bool(self.place.gpu)) != self.identity:
            logger.info("parked rollout engines do not fit this run (engine arguments or model shapes differ): "
                        "ended, this run starts its own")
            end_workers(workers)
            return None
        self.handed += 1
        logger.info("%d rollout engine(s) of the previous run handed to this one (refitted with its initial "
                    "weights before they serve)", len(workers))
        return workers

    def take_learners(self, ranks: int) -> list | None:
        """The parked learner actors when there are `ranks` of them (they sit in this run's placement: its
        key holds the layout); None otherwise."""
        learners, self.learners = self.learners, None
        return _hand_over(learners, ranks)

    def take_free_learners(self, ranks: int) -> list | None:
        """An `sft` run's learner actors parked by the last `sft` run, when there are `ranks` of them."""
        learners, self.free_learners = self.free_learners, None
        return _hand_over(learners, ranks)

    def park_free_learners(self, group) -> None:
        """Keep a finished `sft` run's learner actors for the next `sft` run."""
        if self.free_learners is not None:
            end_actors(self.free_learners)
        self.free_learners = group.hand_over()

    def prepare_for(self, command: str) -> None:
        """Before a run: end what the pool keeps that this command does not use (`sft` runs use parked free
        learners, `train` runs the placement, engines and placed learners), so it holds no resources for it."""
        if command == "train":
            if self.free_learners:
                end_actors(self.free_learners)
            self.free_learners = None
        else:
            free, self.free_learners = self.free_learners, None
            self.drop()
            self.free_learners = free

    def park_learners(self, group) -> bool:
        """Keep a finished run's learner actors (LearnerGroup) for the next run."""
        if self.place is None or self.learners is not None:
            return False
        self.learners = group.hand_over()
        return True

    def park(self, fleet) -> bool:
        """Keep the fleet's workers for the next run (True) when all of them serve and sleep mode is off."""
        from megatron_rl.rollout.engine_setup import engine_identity

        if self.place is None or self.workers is not None:
            return False
        if fleet.cfg.sleep_mode:
            logger.info("rollout engines not kept for the next run: vLLM sleep mode is on")
            return False
        workers = fleet.hand_over()
        if workers is None:
            logger.info("rollout engines not kept for the next run: a group is stale or unreachable")
            return False
        self.workers, self.identity = workers, engine_identity(fleet.cfg, bool(self.place.gpu))
        return True

    def reserved(self) -> dict[str, float]:
        """Resources the kept placement group holds (the experiment runner allows them between runs)."""
        if self.place is None:
            return {}
        from ray.util.placement_group import placement_group_table

        out: dict[str, float] = {}
        for bundle in placement_group_table(self.place.group).get("bundles", {}).values():
            for name, amount in bundle.items():
                out[name] = out.get(name, 0.0) + float(amount)
        return out

    def drop(self) -> None:
        """End the parked workers and remove the placement group (after a failed run, at the end)."""
        workers, place = self.workers, self.place
        learners = (self.learners or []) + (self.free_learners or [])
        self.workers = self.identity = self.place = self.place_key = self.learners = self.free_learners = None
        if workers:
            end_workers(workers)
        if learners:
            end_actors(learners)
        if place is not None:
            try:
                place.remove()
            except Exception as err:  # noqa: BLE001 -- Ray going down: nothing left to free
                logger.warning("removing the kept placement group: %s", err)


def end_workers(workers: list) -> None:
    """Shut down and kill rollout actors (as RolloutFleet.shutdown does)."""
    import ray

    for w in workers:
        try:
            ray.get(w.shutdown.remote(), timeout=60)
        except Exception as err:  # noqa: BLE001 -- dead already, or Ray going down
            logger.warning("rollout worker shutdown: %s", err)
    end_actors(workers)


def end_actors(actors: list) -> None:
    import ray

    for a in actors:
        try:
            ray.kill(a)
        except Exception as err:  # noqa: BLE001 -- dead already
            logger.debug("kill of an actor: %s", err)


def _hand_over(learners: list | None, ranks: int) -> list | None:
    """Parked learner actors for a run of `ranks` learner ranks: all of them if there are that many, else
    none (the parked ones are ended)."""
    if learners is not None and len(learners) != ranks:
        end_actors(learners)
        return None
    if learners is not None:
        logger.info("%d learner actor(s) of the previous run handed to this one (rebuilt for it)", ranks)
    return learners
