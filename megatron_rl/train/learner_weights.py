"""A learner rank's weights in and out: publication to the rollout engines, checkpoints, RNG state.

    class LearnerWorker(..., RankWeights)   # train/learner_group.py
    worker.connect_rollout(engines, bucket_bytes, transport); worker.publish(version)
    worker.save(weights_dir); worker.load(weights_dir)

Publication streams HF-named tensors group by group (publish/source.py): every rank takes part in
the gathers, rank 0 sends the checksummed buckets (publish/trainer.py).  Checkpoints are Megatron
distributed checkpoints of model + optimizer, plus per-rank scheduler state.
"""

from __future__ import annotations

from pathlib import Path

import torch


class RankWeights:
    """Mixin of LearnerWorker: needs self.rank, self.learner and self.hf_cfg (RankBuild.setup)."""

    def weight_source(self, device: str = "cpu", dtype: torch.dtype = torch.float32):
        """This rank's view of the policy as HF tensors in `dtype`, streamed group by group (publish.source)."""
        from megatron_rl.publish.source import MegatronWeightSource

        return MegatronWeightSource(self.learner.model[0].module, self.hf_cfg, dtype=dtype, device=device)

    @torch.no_grad()
    def hf_state(self) -> dict[str, torch.Tensor] | None:
        """Full HF-named tensors of the current policy on global rank 0 (None elsewhere).

        Every rank takes part: TP shards are gathered per group on the stage that owns it and
        pipeline stages send their groups to the first stage (MegatronWeightSource).
        """
        state = dict(self.weight_source())
        return state if self.rank == 0 else None

    def connect_rollout(self, rollout_workers: list, bucket_bytes: int, transport: str = "gloo",
                        timeout_s: float = 600.0) -> None:
        """Rank 0 becomes rank 0 of the publication group formed with every rollout engine.
        `transport`: "gloo" (CPU tensors), "nccl" or "ipc" (tensors stay on this rank's GPU);
        `timeout_s`: rollout.publish_timeout_s (how long a publication waits for a group)."""
        import ray

        from megatron_rl.publish import WeightPublisher
        from megatron_rl.publish.trainer import engine_dtype

        self.publish_device = "cuda" if transport in ("nccl", "ipc") else "cpu"
        # Every rank casts (the gathers and pipeline sends run in it): once, in the engine's dtype.
        self.publish_dtype = engine_dtype(rollout_workers)
        self.ipc_replicas = None
        if transport == "ipc":  # which rank holds a copy on each engine GPU (collective; publish/ipc_route.py)
            from megatron_rl.publish.ipc_route import IPCReplicas, engine_gpu_uuids, gpu_uuid

            self.ipc_replicas = IPCReplicas.connect(lambda: engine_gpu_uuids(rollout_workers), gpu_uuid())
        if self.rank != 0:
            return

        self.publisher = WeightPublisher(host=ray.util.get_node_ip_address(), bucket_bytes=bucket_bytes,
                                         transport=transport, timeout_s=timeout_s)
        self.publisher.connect(rollout_workers, replicas=self.ipc_replicas)

    @torch.no_grad()
    def publish(self, version: int) -> dict | None:
        """Publish the policy from rank 0 as `version`, streamed: each group is gathered (every
        rank takes part, in lockstep) only when the publisher pulls it into a bucket.  ipc on
        several GPUs: a rank on another engine GPU then holds a copy until every group answered."""
        source = self.weight_source(self.publish_device, self.publish_dtype)
        if self.rank != 0:
            for _ in source:  # drive this rank's share of the gathers
                pass
            if getattr(self, "ipc_replicas", None) is not None:
                self.ipc_replicas.hold()
            return None
        report = self.publisher.publish(version, source)
        return {"committed": report.committed, "seconds": report.seconds,
                "bytes": report.manifest.nbytes if report.manifest is not None else 0,
                "broken": report.manifest is None,  # the send broke off: form the group anew, publish again
                "errors": [r["error"] for r in report.results if not r["committed"]],
                "groups": [{"committed": r["committed"], "unresponsive": bool(r.get("unresponsive")),
                            "error": r.get("error")} for r in report.results]}

    def save(self, weights_dir: str) -> None:
        """Megatron distributed checkpoint of model + optimizer + scheduler (collective)."""
        from megatron.core import dist_checkpointing

        Path(weights_dir).mkdir(parents=True, exist_ok=True)
        sd = self.learner.sharded_state_dict()
        extra = {"scheduler": sd.pop("scheduler"), "step": sd.pop("step")}
        dist_checkpointing.save(sd, weights_dir)
        torch.save(extra, Path(weights_dir) / f"extra_rank{self.rank:05d}.pt")

    def rng_state(self) -> dict:
        from megatron_rl.rng_state import capture_rng_state

        return capture_rng_state()

    def set_rng_state(self, state: dict) -> None:
        from megatron_rl.rng_state import restore_rng_state

        restore_rng_state(state)

    def load(self, weights_dir: str) -> int:
        from megatron.core import dist_checkpointing

        sd = self.learner.sharded_state_dict(is_loading=True)
        sd.pop("scheduler"), sd.pop("step")
        state = dist_checkpointing.load(sd, weights_dir, strict="raise_all")
        self.learner.load_sharded_state_dict(state)
        extra = torch.load(Path(weights_dir) / f"extra_rank{self.rank:05d}.pt", weights_only=False)
        self.learner.scheduler.load_state_dict(extra["scheduler"])
        self.learner.step = int(extra["step"])
        return self.learner.step
