"""A learner rank's weights in and out: the source a publication streams, and checkpoints.

    io = WeightIO(rank, learner, hf_cfg)          # a part of LearnerWorker (ranks/rank.py)
    for group in io.source("cpu", torch.bfloat16): ...   # what LearnerWorker.publish sends
    io.save(weights_dir); io.load(weights_dir)
    io = WeightIO(rank, learner, hf_cfg, ring=3)   # audit.every: the newest 3 versions kept in host memory
    io.keep_version(version); io.audit_logprobs(version, tokens_bt, lengths_b)

Publication streams HF-named tensors group by group (publish/source.py): every rank takes part in
the gathers, rank 0 sends the checksummed buckets through the run's transport (publish/transports.py),
the others follow (LearnerWorker.publish, which holds the rank's place in the publication group).  Checkpoints are Megatron distributed checkpoints of model + optimizer, plus
per-rank scheduler state.  With a ring (audit/ring.py), the weights published as each version are
kept in host memory, version 0 (the weights a rank is built with) first, for the in-training audit.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch


@dataclasses.dataclass(frozen=True)
class PublishSettings:
    """How this run publishes (chosen once at start-up: train/placement.py, run and rollout sections)."""

    transport: str = "gloo"
    """The path (publish/transport.py choose_transport's answer)."""
    bucket_bytes: int = 64 << 20
    timeout_s: float = 600.0
    """rollout.publish_timeout_s: how long a publication waits for a group."""
    checksum: str = "blocksum"
    """run.publish_checksum (publish/checksum.py)."""


def _results_in_process() -> None:
    """Megatron's checkpoint writer collects its write results through a queue served by a spawned
    multiprocessing Manager: a second Python started at a rank's first save (2.3-2.7 s here, and a process
    that lives as long as the rank).  Our saves are synchronous (`dist_checkpointing.save` without
    `async_sharded_save`): the results are put and read in this process, so a plain queue does.  A
    Megatron without that module-level queue is left alone."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


class WeightIO:
    """The weights of one rank's learner, out to the engines and to and from checkpoints."""

    def __init__(self, rank: int, learner, hf_cfg, ring: int = 0):
        from megatron_rl.audit.ring import WeightRing
        from megatron_rl.publish.adapter_source import rank_weights

        self.rank, self.learner, self.hf_cfg = rank, learner, hf_cfg
        self.kind = rank_weights(learner.model[0].module, hf_cfg, learner.cfg.lora)  # publish/adapter_source.py
        """What this rank publishes and checkpoints: the whole model, or a LoRA learner's adapters (chosen once)."""
        self.ring = WeightRing(ring) if ring else None
        """The audit's ring of recent versions (RankSpec.audit_ring of them), or None."""
        self.keep_version(0)  # a rank is built with the weights the run starts from: version 0

    def keep_version(self, version: int) -> None:
        """The live weights are `version`'s (they are being published as it): keep them, with a ring."""
        if self.ring is not None:
            self.ring.keep(version, self.learner.model[0].module)

    def audit_logprobs(self, version: int, tokens_bt: torch.Tensor,
                       lengths_b: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T-1] logprobs (under the sampling transform) with `version`'s weights from the ring."""
        with self.ring.weights_of(version, self.learner.model[0].module):
            return self.learner.forward_logprobs(tokens_bt, lengths_b)

    def source(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """This rank's view of the policy as HF tensors in `dtype`, streamed group by group (publish.source);
        of a LoRA learner, its adapters only, PEFT-named (publish/adapter_source.py)."""
        return self.kind.source(device, dtype)

    @torch.no_grad()
    def hf_state(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named tensors of the current policy on global rank 0 (None elsewhere).  Every rank
        takes part: TP shards are gathered per group on the stage that owns it and pipeline stages send
        their groups to the first stage (MegatronWeightSource)."""
        state = dict(self.source())
        return state if self.rank == 0 else None

    def save(self, weights_dir: str) -> None:
        """Megatron distributed checkpoint of model + optimizer + scheduler (collective); with learner.lora
        the adapters and their optimizer state, and weights/lora.json saying so."""
        from megatron.core import dist_checkpointing

        Path(weights_dir).mkdir(parents=True, exist_ok=True)
        sd = self.learner.sharded_state_dict(model_sd=self.kind.model_state())
        extra = {"scheduler": sd.pop("scheduler"), "step": sd.pop("step")}
        _results_in_process()
        dist_checkpointing.save(sd, weights_dir)
        if self.rank == 0:
            self.kind.record(weights_dir)
        torch.save(extra, Path(weights_dir) / f"extra_rank{self.rank:05d}.pt")

    def load(self, weights_dir: str) -> int:
        from megatron.core import dist_checkpointing

        from megatron_rl.models.lora_checkpoint import check_adapter_record

        check_adapter_record(weights_dir, self.learner.cfg.lora)  # every rank, before any collective
        sd = self.learner.sharded_state_dict(is_loading=True, model_sd=self.kind.model_state())
        sd.pop("scheduler"), sd.pop("step")
        state = dist_checkpointing.load(sd, weights_dir, strict="raise_all")
        self.learner.load_sharded_state_dict(state)
        extra = torch.load(Path(weights_dir) / f"extra_rank{self.rank:05d}.pt", weights_only=False)
        self.learner.scheduler.load_state_dict(extra["scheduler"])
        self.learner.step = int(extra["step"])
        return self.learner.step
