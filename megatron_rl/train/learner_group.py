"""The learner ranks as Ray actors: one `LearnerWorker` per torch.distributed rank, driven SPMD.

    group = LearnerGroup(learner_cfg=..., loss_cfg=..., hf_dir=..., seed=s, placement=place.learner)
    metrics = group.train_step(batch)            # every rank gets the same global batch
    logprobs_bt = group.forward_logprobs(tokens_bt)
    group.save(ckpt_dir); group.load(ckpt_dir)
    for hf_name, tensor in group.hf_state(): ... # full HF-named tensors, for publication

learner.tensor_parallel_size x pipeline_parallel_size x data_parallel_size ranks.  Each worker
initialises torch.distributed (gloo on CPU, NCCL on GPU) with its rank, builds the Megatron
learner (`megatron_rl.learner.Learner`) and fills it from the Hugging Face checkpoint (through the
shared conversion mapping; learner_build.py), plugs the GRPO loss into the learner's
per-micro-batch loss interface (here), and publishes and checkpoints its weights
(learner_weights.py).  The driver never touches tensors of a single rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from functools import partial

import torch

from megatron_rl.train.learner_build import RankBuild
from megatron_rl.train.learner_weights import RankWeights

logger = logging.getLogger(__name__)


def micro_batch_denominators(mb: dict) -> tuple[float, float]:
    """(N/K, S/K) of a micro-batch: the global batch's tokens N and sequences S in the loss
    (`tokens_in_loss`, `sequences_in_loss`) over the K micro-batches of its step
    (`num_micro_batches`, set by the learner; it varies with a token budget).  Outside the learner
    (no `num_micro_batches`) the batch's precomputed *_denominator entries are used."""
    k = mb.get("num_micro_batches")
    if k is None:
        return float(mb["token_denominator"]), float(mb["sequence_denominator"])
    if "tokens_in_loss" not in mb or "sequences_in_loss" not in mb:
        raise KeyError("a learner micro-batch needs the global 'tokens_in_loss' and 'sequences_in_loss' "
                       "(train.batch.build_batch provides them)")
    return float(mb["tokens_in_loss"]) / k, float(mb["sequences_in_loss"]) / k


def grpo_micro_batch_loss(logprobs_bt: torch.Tensor, mb: dict, cfg):
    """The learner's loss_fn: GRPO on one micro-batch of a batch from train.batch.build_batch,
    normalised by the global batch's token / sequence counts over the step's K micro-batches."""
    from megatron_rl.grpo.loss import grpo_loss

    token_den, seq_den = micro_batch_denominators(mb)
    return grpo_loss(
        logprobs_bt, mb["behavior_logprobs"], mb.get("ref_logprobs"), mb["advantages"], mb["loss_mask"], cfg,
        old_logprobs_bt=logprobs_bt.detach() if cfg.tis_cap is not None else None,
        token_denominator=token_den,
        sequence_denominator=seq_den,
    )


class LearnerOutOfMemory(RuntimeError):
    """A learner step ran out of memory at the configured micro-batch size and at half of it."""


class LearnerDied(RuntimeError):
    """A learner rank died (its actor is gone) or did not answer within run.learner_timeout_s."""


class LearnerWorker(RankBuild, RankWeights):
    """One learner rank (wrapped by ray.remote in LearnerGroup): built by RankBuild (learner_build.py:
    torch.distributed, the Megatron learner, the initial policy, the reference), weights in and out
    by RankWeights (learner_weights.py: publication, checkpoints, RNG), training here."""

    _ooms = 0  # drill bookkeeping: injected out-of-memory errors so far

    def __init__(self, *, rank: int, world_size: int, learner_cfg, loss_cfg, hf_dir: str, seed: int,
                 deterministic: bool | None, threads: int):
        from megatron_rl.console import configure_worker_logging

        configure_worker_logging()
        self.rank, self.world_size = rank, world_size
        self._args = (learner_cfg, loss_cfg, hf_dir, seed, deterministic, threads)

    # ---- training ------------------------------------------------------------------------------

    def train_step(self, batch: dict, lr_scale: float = 1.0) -> dict[str, float]:
        """One GRPO step (at `lr_scale` times the scheduled learning rate: the restart canary).  An out-of-memory error inside it abandons the step (grad buffers cleared,
        no optimizer step, the step counter unchanged) and retries it once at half the micro-batch
        size: the same global batch by gradient accumulation.  A second failure raises
        LearnerOutOfMemory, with nothing of the step applied."""
        from megatron_rl.drill_hooks import drill_spec, record_injection

        kill = drill_spec("learner_kill")  # `megatron-rl drill worker_crash`: this rank dies mid-run
        if kill and self.rank == int(kill.get("rank", 0)) and self.learner.step == int(kill["at_step"]):
            record_injection(kill, rank=self.rank)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.reference is not None:
            batch = dict(batch, ref_logprobs=self._reference_logprobs(batch["tokens"], batch.get("lengths")))
        mbs = self.learner.cfg.micro_batch_size
        try:
            return self._step(batch, lr_scale)
        except torch.OutOfMemoryError as err:
            self._abandon_step()
            half = mbs // 2
            logger.warning("learner step %d: out of memory at micro_batch_size %d (%s); step abandoned, "
                           "retrying at %d", self.learner.step, mbs, str(err).splitlines()[0], half)
        if half < 1 or self.learner.cfg.global_batch_size % (half * self.learner.dp):
            raise LearnerOutOfMemory(f"learner step {self.learner.step} ran out of memory at micro_batch_size "
                                     f"{mbs}, which cannot be halved; nothing of the step was applied")
        cfg = self.learner.cfg
        self.learner.cfg = dataclasses.replace(cfg, micro_batch_size=half, max_tokens_per_micro_batch=(
            cfg.max_tokens_per_micro_batch // 2 if cfg.max_tokens_per_micro_batch else None))
        try:
            out = self._step(batch, lr_scale)
        except torch.OutOfMemoryError as err:
            self._abandon_step()
            raise LearnerOutOfMemory(f"learner step {self.learner.step} ran out of memory at micro_batch_size "
                                     f"{mbs} and again at {half} ({str(err).splitlines()[0]}); nothing of the "
                                     "step was applied") from None
        finally:
            self.learner.cfg = cfg
        out.update(oom_retries=1.0, retry_micro_batch_size=float(half))
        return out

    def _step(self, batch: dict, lr_scale: float = 1.0) -> dict[str, float]:
        from megatron_rl.drill_hooks import drill_spec, record_injection
        from megatron_rl.grpo.step_metrics import grpo_step_weight

        step_cfg = self.loss_cfg.at_step(self.learner.step)  # this step's loss settings, for every micro-batch
        loss_fn = partial(grpo_micro_batch_loss, cfg=step_cfg)
        oom = drill_spec("oom")  # `megatron-rl drill oom`: the forward/backward of step at_step fails
        if oom and self.learner.step == int(oom["at_step"]) and self._ooms < int(oom.get("times", 1)):
            self._ooms += 1

            def loss_fn(logprobs_bt, mb):  # noqa: ARG001 - fails inside the schedule, mid-step
                record_injection(oom, rank=self.rank, micro_batch_size=self.learner.cfg.micro_batch_size)
                raise torch.OutOfMemoryError("drill: CUDA out of memory (injected by MEGATRON_RL_DRILL)")
        groups = self.learner.optimizer.param_groups
        scheduled = [g["lr"] for g in groups]
        for g in groups:  # the scheduler sets the next step's rate after a successful update
            g["lr"] *= lr_scale
        try:
            out = self.learner.train_step(batch, loss_fn, partial(grpo_step_weight, cfg=step_cfg))
        finally:
            if lr_scale != 1.0 and [g["lr"] for g in groups] == [lr * lr_scale for lr in scheduled]:
                for g, lr in zip(groups, scheduled):  # no update: the schedule did not move
                    g["lr"] = lr
        return out

    def _abandon_step(self) -> None:
        """Drop what a failed forward/backward left: accumulated gradients and freed activations."""
        import gc

        for chunk in self.learner.model:
            chunk.zero_grad_buffer()
        self.learner.optimizer.zero_grad()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def sft_step(self, batch: dict) -> dict[str, float]:
        """One supervised step (negative log-likelihood of the masked tokens, train/sft.py)."""
        from megatron_rl.train.sft import sft_micro_batch_loss

        return self.learner.train_step(batch, sft_micro_batch_loss)

    def forward_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        return self.learner.forward_logprobs(tokens_bt, lengths_b)

    def reference_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        if self.reference is None:
            self.reference = self._build_reference()
        return self._reference_logprobs(tokens_bt, lengths_b)

    def _reference_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        # Swap the frozen reference module in for one forward-only pass of the learner's schedule.
        ddp = self.learner.model[0]
        policy = ddp.module
        ddp.module = self.reference
        try:
            return self.learner.forward_logprobs(tokens_bt, lengths_b)
        finally:
            ddp.module = policy

class LearnerGroup:
    """All learner ranks, driven in lock step; methods return rank 0's answer."""

    def __init__(self, *, learner_cfg, loss_cfg, hf_dir: str, seed: int,
                 deterministic: bool | None, threads: int, placement=None, sampling=None,
                 call_timeout_s: float = 1800.0, handed_over: list | None = None):
        """`handed_over`: the learner actors of an earlier run of the experiment (train/engine_pool.py),
        rebuilt for this one in their processes instead of new actors being started."""
        import ray

        from megatron_rl.platform.priority import with_normal_priority

        world = learner_cfg.tensor_parallel_size * learner_cfg.pipeline_parallel_size
        self.world_size = world * learner_cfg.data_parallel_size
        self.call_timeout_s = call_timeout_s
        # Calls may come from two threads (the driver, and the rollout fleet refitting a restarted
        # engine): one call at a time on every rank, or ranks would enter collectives in other orders.
        self.lock = threading.RLock()
        self.updates = 0  # how often the weights changed (steps, loads): a refit must not publish newer ones
        if handed_over is not None:
            if len(handed_over) != self.world_size:
                raise ValueError(f"{len(handed_over)} learner actors handed over for {self.world_size} ranks")
            self.workers = list(handed_over)
            self._all("rebuild", (learner_cfg, loss_cfg, hf_dir, seed, deterministic, threads), sampling)
            return
        cls = ray.remote(LearnerWorker)
        self.workers = [
            cls.options(**with_normal_priority(placement(rank) if placement else {"num_cpus": 0})).remote(
                rank=rank, world_size=self.world_size, learner_cfg=learner_cfg, loss_cfg=loss_cfg, hf_dir=hf_dir,
                seed=seed, deterministic=deterministic, threads=threads)
            for rank in range(self.world_size)
        ]
        addr, port = ray.get(self.workers[0].rendezvous_address.remote())
        self._all("setup", addr, port, sampling)

    def _all(self, method: str, *args) -> list:
        """Call `method` on every rank; fail fast when one rank dies (the others may be blocked in a
        collective with it and would never answer) or none answers within `call_timeout_s`."""
        with self.lock:
            return self._all_locked(method, *args)

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

    def train_step(self, batch: dict, lr_scale: float = 1.0) -> dict[str, float]:
        with self.lock:
            self.updates += 1
            return self._all("train_step", batch, lr_scale)[0]

    def sft_step(self, batch: dict) -> dict[str, float]:
        with self.lock:
            self.updates += 1
            return self._all("sft_step", batch)[0]

    def forward_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T-1]; with `lengths_b` (and a token budget) positions past a row's end hold 0."""
        return self._all("forward_logprobs", tokens_bt, lengths_b)[0]

    def reference_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        return self._all("reference_logprobs", tokens_bt, lengths_b)[0]

    def hf_state(self) -> dict[str, torch.Tensor]:
        return self._all("hf_state")[0]

    def connect_rollout(self, rollout_workers: list, bucket_bytes: int, transport: str = "gloo",
                        timeout_s: float = 600.0) -> None:
        self._all("connect_rollout", rollout_workers, bucket_bytes, transport, timeout_s)

    def publish(self, version: int) -> dict:
        return self._all("publish", version)[0]

    def save(self, weights_dir: str) -> None:
        self._all("save", weights_dir)

    def load(self, weights_dir: str) -> int:
        with self.lock:
            self.updates += 1
            return self._all("load", weights_dir)[0]

    def rng_states(self) -> dict[int, dict]:
        return dict(enumerate(self._all("rng_state")))

    def set_rng_states(self, states: dict[int, dict]) -> None:
        import ray

        ray.get([w.set_rng_state.remote(states[r]) for r, w in enumerate(self.workers)])

    def hand_over(self) -> list:
        """The rank actors, for the next run (train/engine_pool.py); this group holds none afterwards."""
        with self.lock:
            workers, self.workers = self.workers, []
        return workers

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            ray.kill(w)
