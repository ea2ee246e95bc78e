"""The parts a learner rank is built from: its rendezvous and the frozen reference model (the Megatron
learner filled with the initial policy is learner/initial_policy.py's `InitialPolicy`).  Assembled by
`LearnerWorker` (ranks/rank.py).

    rdv = Rendezvous(rank, world_size); addr, port = rdv.address()   # rank 0 only
    rdv.join(addr, port, platform)                                     # every rank
    policy, reference = initial_parts(spec, platform)   # InitialPolicy (learner/), Reference or None
    reference.logprobs(tokens_bt, lengths_b)

`seed_everything` sets seeds, threads and deterministic mode of a process (the driver's too).
"""

from __future__ import annotations

import logging
import os
import random
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from megatron_rl.learner.initial_policy import InitialPolicy

logger = logging.getLogger(__name__)


def seed_everything(seed: int, deterministic: bool | None, threads: int) -> None:
    """Seeds, threads and deterministic mode (None: on for CPU, off on GPU; platform.apply_determinism)."""
    from megatron_rl.platform import apply_determinism

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    apply_determinism(deterministic, cuda=torch.cuda.is_available())


def confine_learner(cores: str | None, started_on: set[int]) -> None:
    """This rank's process on learner.cpu_cores, or back on `started_on` (the cores it started with) when
    they are unset (platform/cores.py); nothing to do when unset and never moved."""
    from megatron_rl.platform.cores import confine_process, parse_cores

    if cores is None and os.sched_getaffinity(0) == started_on:
        return  # every thread is where it started: confine_process moves all of them together
    wanted = parse_cores(cores, "learner.cpu_cores") if cores is not None else started_on
    confine_process(wanted, started_on, "learner.cpu_cores")


class Rendezvous:
    """How the learner ranks find each other: rank 0's store, bound before any rank hears its port."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.store = None

    def address(self) -> tuple[str, int]:
        """(the address rank 0's rendezvous store listens on, its port): loopback when the run is on one
        node, this node's cluster address otherwise, never every interface (platform/listen.py).  The store
        binds port 0 (the OS picks a free one and binds it at once) before any rank is told the port, so no
        other process can take it in between, as a port probed free and bound later by
        init_process_group could be (EADDRINUSE; the publication group had the same fix, wire.host_store)."""
        from megatron_rl.platform.listen import bind_address, listening_store

        host = bind_address()
        self.store = listening_store(host, self.world_size)
        return host, self.store.port

    def join(self, master_addr: str, master_port: int, platform) -> None:
        """Join torch.distributed through rank 0's store (address()): rank 0 passes the store it
        already listens on, the other ranks connect to it as clients.  A process that is already a
        rank (tests/dist: run_distributed set torch.distributed up) joins nothing."""
        import torch.distributed as dist

        from megatron_rl.platform.listen import joining_store, pin_gloo
        from megatron_rl.platform.parallel import init_distributed

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        pin_gloo(master_addr)  # gloo's sockets on the interface of rank 0's address when it is on this node
        if dist.is_initialized():  # a process that is already a rank (tests/dist): nothing to join
            init_distributed(platform, rank=self.rank, world_size=self.world_size)
            return
        store = self.store if self.rank == 0 else None
        if store is None:
            if self.rank == 0:
                raise RuntimeError("learner rank 0 joins before Rendezvous.address() made its store")
            store = joining_store(master_addr, master_port, self.world_size, 600)
        init_distributed(platform, rank=self.rank, world_size=self.world_size, store=store)

    @staticmethod
    def drop_parallel_state() -> None:
        """Megatron's parallel state goes (a rank rebuilt for the next run); torch.distributed stays up."""
        from megatron.core import parallel_state as ps

        from megatron_rl.platform.parallel import destroy_parallel

        if ps.model_parallel_is_initialized():
            destroy_parallel()


def initial_parts(spec, platform) -> tuple[InitialPolicy, Reference | None]:
    """The learner of `spec` (a RankSpec) filled with its initial policy (learner/initial_policy.py), and the
    frozen reference when its loss has a KL term (None otherwise); after the rank joined."""
    from megatron_rl.learner.initial_policy import InitialPolicy

    policy = InitialPolicy.load(spec.learner, spec.hf_dir, platform, sampling=spec.sampling)
    return policy, Reference(policy) if spec.loss.has_reference else None


class Reference:
    """A frozen copy of the initial policy in the learner's layout: forward only, and its own logprobs
    (run through the learner's schedule, so TP/PP/DP and the token budget apply as for the policy).

    Its logprobs are taken at the sampling temperature but untruncated (`SamplingConfig.untruncated`:
    no top-k/top-p), whatever the rollout samples with: the KL penalty compares the policy with the
    reference's whole distribution, where every token has a probability.  A truncated reference
    would score each sampled token outside its own top-k/top-p set as -87.3, and one such token
    dominates a step's KL (grpo/loss.py)."""

    def __init__(self, policy: InitialPolicy):
        from megatron_rl.conversion.model_io import fill_from_hf
        from megatron_rl.models.builder import build_gpt_model

        self.learner = policy.learner
        lc = self.learner.cfg
        self.sampling = self.learner.sampling.untruncated
        if lc.lora.enabled:
            # The policy is the frozen initial policy plus adapters: without them it is the reference
            # (models/lora.py adapters_off), and no second copy of the weights is built.
            self.model = None
            return
        self.model = build_gpt_model(policy.hf_cfg, platform=self.learner.platform, tp=lc.tensor_parallel_size,
                                     pp=lc.pipeline_parallel_size, config=self.learner.config)
        fill_from_hf(self.model, policy.hf_cfg, policy.checkpoint, policy.tp_rank, lc.tensor_parallel_size,
                     policy.padded_vocab)
        self.model.requires_grad_(False)

    def logprobs(self, tokens_bt: torch.Tensor, lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T-1] log-probabilities of the tokens under the initial policy, at the sampling
        temperature and untruncated (as Learner.forward_logprobs, under `self.sampling`)."""
        if self.model is None:
            from megatron_rl.models.lora import adapters_off

            with adapters_off(*self.learner.model):
                return self.learner.forward_logprobs(tokens_bt, lengths_b, sampling=self.sampling)
        return self.learner.forward_logprobs(tokens_bt, lengths_b, model=[self.model], sampling=self.sampling)
