"""One learner rank: a Ray actor (`LearnerWorker`) per torch.distributed rank, driven SPMD by the
LearnerGroup (ranks/group.py), and assembled from parts (ranks/build.py,
ranks/weights.py):

    worker = LearnerWorker(rank=r, world_size=w)
    addr, port = worker.rendezvous_address()          # rank 0
    worker.setup(addr, port, RankSpec(learner=..., loss=..., hf_dir=..., seed=s))
    worker.train_step(batch); worker.publish(version); worker.save(d)
    worker.rebuild(next_spec)                          # the next run of an experiment, same process

    rank parts          what it owns
    policy.learner      the Megatron learner (model, optimizer, scheduler; megatron_rl.learner)
    reference           the frozen initial policy and its logprobs (None without a KL term)
    weights             the publication source, checkpoints, the audit's ring of recent versions (WeightIO)
    transport           its place in the publication group (rank 0 sends, the others follow: `publish`)

`setup` and `rebuild` build the parts from a RankSpec in the same order; a rebuild drops the old
parts and Megatron's parallel state and builds new ones (torch.distributed stays up).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
from functools import partial
from typing import TYPE_CHECKING

import torch

from megatron_rl.ranks.build import Reference, Rendezvous, confine_learner, initial_parts, seed_everything
from megatron_rl.ranks.weights import PublishSettings, WeightIO

if TYPE_CHECKING:
    from megatron_rl.grpo.loss_config import GRPOLossConfig
    from megatron_rl.learner.initial_policy import InitialPolicy
    from megatron_rl.learner.config import LearnerConfig, SamplingConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything a rank is built from: the learner and loss sections, the initial policy, its seed."""

    learner: LearnerConfig
    loss: GRPOLossConfig
    hf_dir: str
    """The HF checkpoint of the initial policy (the reference's too)."""
    seed: int
    deterministic: bool | None = None
    threads: int = 1
    sampling: SamplingConfig | None = None
    """The distribution the engines sample from; None: plain."""
    audit_ring: int = 0
    """Versions of the weights kept in host memory for the audit (audit/ring.py; 0: none)."""


class LearnerOutOfMemory(RuntimeError):
    """A learner step ran out of memory at the configured micro-batch size and at half of it."""


class LearnerWorker:
    """One learner rank (wrapped by ray.remote in LearnerGroup); its parts are built by setup()."""

    def __init__(self, *, rank: int, world_size: int):
        from megatron_rl.console import configure_worker_logging

        configure_worker_logging()
        self.rank, self.world_size = rank, world_size
        self.rendezvous = Rendezvous(rank, world_size)
        self.spec: RankSpec | None = None
        self.policy: InitialPolicy | None = None
        self.reference: Reference | None = None
        self.weights: WeightIO | None = None
        self.transport = None
        """This rank's place in the publication group (publish/transports.py), once connected."""
        self.publisher = None
        """Rank 0's WeightPublisher (the group's layout, the answers), once connected."""
        self.publish_dtype = torch.float32
        """The engines' dtype, once connected: every rank casts to it (the gathers run in it)."""
        self.ooms = 0  # drill bookkeeping: injected out-of-memory errors so far
        self.started_on = os.sched_getaffinity(0)
        """The cores this process started with: those of a run with no learner.cpu_cores (platform/cores.py)."""

    # ---- building ------------------------------------------------------------------------------

    def rendezvous_address(self) -> tuple[str, int]:
        return self.rendezvous.address()

    def setup(self, master_addr: str, master_port: int, spec: RankSpec) -> int:
        """Join torch.distributed, then build the parts of `spec`."""
        from megatron_rl.platform import detect_platform

        seed_everything(spec.seed, spec.deterministic, spec.threads)
        platform = detect_platform(dtype=spec.learner.dtype)
        self.rendezvous.join(master_addr, master_port, platform)
        self._build(spec, platform)
        return self.rank

    def rebuild(self, spec: RankSpec) -> int:
        """Serve the next run of an experiment in this process (train/engine_pool.py): the last run's
        parts (learner, reference, publication group) and Megatron parallel state are dropped, and
        new ones built from `spec` in setup's order; torch.distributed (same world size) stays up."""
        from megatron_rl.platform import detect_platform

        self._drop_parts()
        self.rendezvous.drop_parallel_state()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the last run's model and optimizer states back to the device
        seed_everything(spec.seed, spec.deterministic, spec.threads)
        self._build(spec, detect_platform(dtype=spec.learner.dtype))
        logger.info("learner rank %d rebuilt in its process for the next run (%s, seed %d)", self.rank,
                    spec.hf_dir, spec.seed)
        return self.rank

    def _drop_parts(self) -> None:
        """The last run's parts go: its publication group's communicator and its learner's state."""
        self._leave_publication()
        if self.policy is not None:
            self.policy.learner.close()
        self.spec = self.policy = self.reference = self.weights = None

    def _build(self, spec: RankSpec, platform) -> None:
        confine_learner(spec.learner.cpu_cores, self.started_on)
        self.spec = spec
        self.policy, self.reference = initial_parts(spec, platform)
        self.weights = WeightIO(self.rank, self.policy.learner, self.policy.hf_cfg, ring=spec.audit_ring)

    @property
    def learner(self):
        return self.policy.learner

    # ---- training ------------------------------------------------------------------------------

    def train_step(self, batch: dict, lr_scale: float = 1.0, kl_coef: float | None = None) -> dict[str, float]:
        """One GRPO step (at `lr_scale` times the scheduled learning rate: the restart canary; with `kl_coef`,
        that KL coefficient instead of loss.kl_coef: the adaptive controller's, grpo/kl_control.py).  An
        out-of-memory error inside it abandons the step (grad buffers cleared, no optimizer step, the
        step counter unchanged) and retries it once at half the micro-batch size: the same global
        batch by gradient accumulation.  A second failure raises LearnerOutOfMemory, with nothing of
        the step applied."""
        from megatron_rl.fault_hooks import drill_spec, record_injection

        kill = drill_spec("learner_kill")  # `megatron-rl drill worker_crash`: this rank dies mid-run
        if kill and self.rank == int(kill.get("rank", 0)) and self.learner.step == int(kill["at_step"]):
            record_injection(kill, rank=self.rank)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.reference is not None:
            batch = dict(batch, ref_logprobs=self.reference.logprobs(batch["tokens"], batch.get("lengths")))
        mbs = self.learner.cfg.micro_batch_size
        try:
            return self._step(batch, lr_scale, kl_coef)
        except torch.OutOfMemoryError as err:
            self._abandon_step()
            half = mbs // 2
            # The run's console says it from the step's result (LearnerGroup.train_step): a worker's lines reach
            # the driver only as Ray's log monitor forwards them.  The error's text is kept in this rank's log.
            logger.info("learner step %d: out of memory at micro_batch_size %d (%s); step abandoned, "
                        "retrying at %d", self.learner.step, mbs, str(err).splitlines()[0], half)
        if not self.learner.fits_micro_batch(half):
            raise LearnerOutOfMemory(f"learner step {self.learner.step} ran out of memory at micro_batch_size "
                                     f"{mbs}, which cannot be halved; nothing of the step was applied")
        cfg = self.learner.cfg
        self.learner.cfg = dataclasses.replace(cfg, micro_batch_size=half, max_tokens_per_micro_batch=(
            cfg.max_tokens_per_micro_batch // 2 if cfg.max_tokens_per_micro_batch else None))
        try:
            out = self._step(batch, lr_scale, kl_coef)
        except torch.OutOfMemoryError as err:
            self._abandon_step()
            raise LearnerOutOfMemory(f"learner step {self.learner.step} ran out of memory at micro_batch_size "
                                     f"{mbs} and again at {half} ({str(err).splitlines()[0]}); nothing of the "
                                     "step was applied") from None
        finally:
            self.learner.cfg = cfg
        out.update(oom_retries=1.0, oom_micro_batch_size=float(mbs), retry_micro_batch_size=float(half))
        return out

    def _step(self, batch: dict, lr_scale: float = 1.0, kl_coef: float | None = None) -> dict[str, float]:
        from megatron_rl.fault_hooks import drill_spec, record_injection
        from megatron_rl.grpo.micro_loss import grpo_micro_batch_loss
        from megatron_rl.grpo.step_metrics import grpo_step_weight

        step_cfg = self.spec.loss.at_step(self.learner.step)  # this step's loss settings, for every micro-batch
        if kl_coef is not None:
            step_cfg = dataclasses.replace(step_cfg, kl_coef=kl_coef)
        loss_fn = partial(grpo_micro_batch_loss, cfg=step_cfg)
        oom = drill_spec("oom")  # `megatron-rl drill oom`: the forward/backward of step at_step fails
        if oom and self.learner.step == int(oom["at_step"]) and self.ooms < int(oom.get("times", 1)):
            self.ooms += 1

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
        for chunk in self.learner.model:
            chunk.zero_grad_buffer()
        self.learner.optimizer.zero_grad()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def sft_step(self, batch: dict) -> dict[str, float]:
        """One supervised step (negative log-likelihood of the masked tokens, learner/sft_loss.py)."""
        from megatron_rl.learner.sft_loss import sft_micro_batch_loss

        return self.learner.train_step(batch, sft_micro_batch_loss)

    def forward_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None,
                         raw: bool = False) -> torch.Tensor:
        return self.learner.forward_logprobs(tokens_bt, lengths_b, raw=raw)

    def reference_logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        if self.reference is None:  # a run without a KL term asks for it (evaluation, tests)
            self.reference = Reference(self.policy)
        return self.reference.logprobs(tokens_bt, lengths_b)

    # ---- weights in and out (WeightIO) ---------------------------------------------------------

    def weight_source(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        return self.weights.source(device, dtype)

    def hf_state(self) -> dict[str, torch.Tensor] | None:
        return self.weights.hf_state()

    def connect_rollout(self, rollout_workers: list, settings: PublishSettings) -> None:
        """Rank 0 becomes rank 0 of the publication group formed with every rollout engine (again, after
        a regroup: the last group is dropped); every rank learns the engines' dtype and does its share
        of the transport's joining."""
        from megatron_rl.publish.trainer import join_publication

        self._leave_publication()  # a regroup: the last group's communicator goes first
        self.transport, self.publisher, self.publish_dtype = join_publication(
            rollout_workers, rank=self.rank, transport=settings.transport, bucket_bytes=settings.bucket_bytes,
            checksum=settings.checksum, timeout_s=settings.timeout_s)

    def _leave_publication(self) -> None:
        """Drop the publication group (its communicator freed: publish/transports.py Transport.close)."""
        if self.transport is not None:
            self.transport.close()
        self.transport = self.publisher = None

    @torch.no_grad()
    def publish(self, version: int) -> dict | None:
        """Publish the policy from rank 0 as `version`, streamed: each group is gathered (every rank takes
        part, in lockstep) only when the transport pulls it into a bucket; rank 0's report as plain data."""
        source = self.weights.source(self.transport.device, self.publish_dtype)
        if self.rank != 0:
            for _ in source:  # drive this rank's share of the gathers
                pass
            self.transport.follow()
            return None
        return self.publisher.publish(version, source).summary()  # transport.send, then the report

    def save(self, weights_dir: str) -> None:
        self.weights.save(weights_dir)

    def keep_version(self, version: int) -> None:
        self.weights.keep_version(version)

    def audit_logprobs(self, version: int, tokens_bt: torch.Tensor,
                       lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        return self.weights.audit_logprobs(version, tokens_bt, lengths_b)

    def ring_versions(self) -> list[int]:
        return self.weights.ring.versions if self.weights.ring is not None else []

    def load(self, weights_dir: str) -> int:
        return self.weights.load(weights_dir)

    def rng_state(self) -> dict:
        from megatron_rl.rng_state import capture_rng_state

        return capture_rng_state()

    def set_rng_state(self, state: dict) -> None:
        from megatron_rl.rng_state import restore_rng_state

        restore_rng_state(state)
