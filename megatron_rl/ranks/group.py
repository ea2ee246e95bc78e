"""The learner ranks as Ray actors, driven in lock step: one `LearnerWorker` (ranks/rank.py)
per torch.distributed rank.

    group = LearnerGroup(RankSpec(learner=..., loss=..., hf_dir=..., seed=s), placement=place.learner)
    metrics = group.train_step(batch)            # every rank gets the same global batch
    logprobs_bt = group.forward_logprobs(tokens_bt)
    group.connect_rollout(workers, PublishSettings(...)); group.publish(version)
    group.save(ckpt_dir); group.load(ckpt_dir)

learner.tensor_parallel_size x pipeline_parallel_size x data_parallel_size ranks
(LearnerConfig.world_size).  The driver never touches tensors of a single rank.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from megatron_rl.ranks.rank import LearnerOutOfMemory, LearnerWorker, RankSpec  # noqa: F401
from megatron_rl.ranks.weights import PublishSettings

logger = logging.getLogger(__name__)


class LearnerDied(RuntimeError):
    """A learner rank died (its actor is gone) or did not answer within run.learner_timeout_s."""


class LearnerGroup:
    """All learner ranks, driven in lock step; methods return rank 0's answer."""

    def __init__(self, spec: RankSpec, *, placement=None, call_timeout_s: float = 1800.0,
                 handed_over: list | None = None):
        """`handed_over`: the learner actors of an earlier run of the experiment (train/engine_pool.py),
        rebuilt for this one in their processes instead of new actors being started."""
        import ray

        from megatron_rl.platform.priority import with_normal_priority

        self.world_size = spec.learner.world_size
        self.call_timeout_s = call_timeout_s
        # Calls may come from two threads (the driver, and the rollout fleet refitting a restarted
        # engine): one call at a time on every rank, or ranks would enter collectives in other orders.
        self.lock = threading.RLock()
        self.updates = 0  # how often the weights changed (steps, loads): a refit must not publish newer ones
        if handed_over is not None:
            if len(handed_over) != self.world_size:
                raise ValueError(f"{len(handed_over)} learner actors handed over for {self.world_size} ranks")
            self.workers = list(handed_over)
            self._all(LearnerWorker.rebuild, spec)
            return
        cls = ray.remote(LearnerWorker)
        self.workers = [
            cls.options(**with_normal_priority(placement(rank) if placement else {"num_cpus": 0})).remote(
                rank=rank, world_size=self.world_size)
            for rank in range(self.world_size)
        ]
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        self._all(LearnerWorker.setup, addr, port, spec)

    def _all(self, method: Callable, *args) -> list:
        """Call `method` (a LearnerWorker method: `LearnerWorker.train_step`, checked where it is named) on
        every rank; fail fast when one rank dies (the others may be blocked in a collective with it and would
        never answer) or none answers within `call_timeout_s`."""
        with self.lock:
            return self._all_locked(method.__name__, *args)

    def _all_locked(self, method: str, *args) -> list:
        import ray

        refs = [getattr(w, method).remote(*args) for w in self.workers]
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + self.call_timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(rank_of[r] for r in pending)
                raise LearnerDied(f"learner rank(s) {ranks} did not finish {method} within "
                                  f"run.learner_timeout_s={self.call_timeout_s:g} s")
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, 5.0))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    raise LearnerDied(f"learner rank {rank_of[ref]} died during {method} "
                                      f"({type(err).__name__})") from None
        return ray.get(refs)

    def train_step(self, batch: dict, lr_scale: float = 1.0, kl_coef: float | None = None) -> dict[str, float]:
        with self.lock:
            self.updates += 1
            out = self._all(LearnerWorker.train_step, batch, lr_scale, kl_coef)[0]
        if out.get("oom_retries"):
            logger.warning("learner update %d: out of memory at micro_batch_size %d (the error: the learner ranks' "
                           "log, RUN_DIR/logs/ray_LearnerWorker.log); retried at %d, the same global batch by "
                           "gradient accumulation", self.updates, out["oom_micro_batch_size"],
                           out["retry_micro_batch_size"])
        return out

    def sft_step(self, batch: dict) -> dict[str, float]:
        with self.lock:
            self.updates += 1
            return self._all(LearnerWorker.sft_step, batch)[0]

    def forward_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None,
                         raw: bool = False) -> torch.Tensor:
        """[B, T-1]; with `lengths_b` (and a token budget) positions past a row's end hold 0; `raw`:
        under the model's own distribution, not the sampling transform (learner/learner.py)."""
        return self._all(LearnerWorker.forward_logprobs, tokens_bt, lengths_b, raw)[0]

    def reference_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        return self._all(LearnerWorker.reference_logprobs, tokens_bt, lengths_b)[0]

    def keep_version(self, version: int) -> None:
        """Every rank keeps its live weights as `version` in its audit ring (audit/ring.py), if it has one."""
        self._all(LearnerWorker.keep_version, version)

    def audit_logprobs(self, version: int, tokens_bt: torch.Tensor,
                       lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T-1] logprobs under `version`'s weights from the ranks' rings (the sampling transform)."""
        return self._all(LearnerWorker.audit_logprobs, version, tokens_bt, lengths_b)[0]

    def ring_versions(self) -> list[int]:
        return self._all(LearnerWorker.ring_versions)[0]

    def hf_state(self) -> dict[str, torch.Tensor]:
        return self._all(LearnerWorker.hf_state)[0]

    def connect_rollout(self, rollout_workers: list, settings: PublishSettings) -> None:
        """Form the publication group with `rollout_workers` (anew: a regroup drops the last one)."""
        self._all(LearnerWorker.connect_rollout, rollout_workers, settings)

    def publish(self, version: int) -> dict:
        return self._all(LearnerWorker.publish, version)[0]

    def save(self, weights_dir: str) -> None:
        self._all(LearnerWorker.save, weights_dir)

    def load(self, weights_dir: str) -> int:
        with self.lock:
            self.updates += 1
            return self._all(LearnerWorker.load, weights_dir)[0]

    def rng_states(self) -> dict[int, dict]:
        return dict(enumerate(self._all(LearnerWorker.rng_state)))

    def set_rng_states(self, states: dict[int, dict]) -> None:
        import ray

        ray.get([w.set_rng_state.remote(states[r]) for r, w in enumerate(self.workers)])

    def hand_over(self) -> list:
        """The rank actors, for the next run (train/engine_pool.py); this group holds none afterwards."""
        with self.lock:
            workers, self.workers = self.workers, []
        return workers

    def shutdown(self, wait_s: float = 15.0) -> None:
        """Kill the rank actors and wait (up to wait_s) until they are gone.  A driver that exits first leaves
        them to its job's end, where Ray stops them with SIGTERM, and a SIGTERM that lands while the rank
        collects a garbage actor handle prints a traceback on the run's console ("Exception ignored in
        ActorHandle.__del__"); a killed actor exits at once, running no Python."""
        import ray

        for w in self.workers:
            ray.kill(w)
        deadline = time.monotonic() + wait_s
        for w in self.workers:
            try:
                ray.get(w.__ray_ready__.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            except (ray.exceptions.RayError, TimeoutError):
                continue  # gone (or not yet, past the bound: the job's end takes it)
