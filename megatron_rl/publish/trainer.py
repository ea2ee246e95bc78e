"""Trainer side of weight publication: push (hf_name, full_tensor) groups to rollout groups.

    import ray
    from megatron_rl.publish import WeightPublisher
    pub = WeightPublisher(bucket_bytes=64 << 20)
    pub.connect(rollout_workers)                     # RolloutWorker actor handles
    report = pub.publish(version=1, tensors=model_groups)   # iterator of [(hf_name, tensor), ...]
    assert report.committed

`tensors` is any iterable of (hf_name, full_tensor) pairs or of lists of them (one list
per layer is what a Megatron source gathering TP shards per layer naturally yields); it
is consumed lazily, on the calling thread.  The trainer process is rank 0 of a gloo group
whose other ranks are every vLLM worker process of every rollout group (CPU path).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.platform.spawn import free_port
from megatron_rl.publish.manifest import DEFAULT_BUCKET_BYTES, DEFAULT_CHECKSUM, BucketSpec, PublicationManifest
from megatron_rl.publish.wire import open_group, send_publication

log = logging.getLogger(__name__)


@dataclass
class PublicationReport:
    """Outcome of one publish(): the manifest sent and each rollout group's answer."""

    manifest: PublicationManifest
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def committed(self) -> bool:
        return all(r["committed"] for r in self.results)


class WeightPublisher:
    """Rank 0 of the publication group; drives RolloutWorker actors through Ray."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum_algo: str = DEFAULT_CHECKSUM, timeout_s: float = 600.0):
        self.host, self.port = host, port
        self.bucket_bytes, self.checksum_algo, self.timeout_s = bucket_bytes, checksum_algo, timeout_s
        self.workers: list = []
        self.group = None

    def connect(self, workers: list) -> None:
        """Form the group with every worker process of every actor in `workers`."""
        import ray

        if not workers:
            raise ValueError("connect() needs at least one rollout worker")
        sizes = ray.get([w.engine_world_size.remote() for w in workers])
        world = 1 + sum(sizes)
        port = self.port or free_port(self.host)
        offsets = [1 + sum(sizes[:i]) for i in range(len(workers))]
        refs = [
            w.init_weight_transfer.remote(dict(master_address=self.host, master_port=port, rank_offset=off,
                                               world_size=world, timeout_s=self.timeout_s))
            for w, off in zip(workers, offsets)
        ]
        self.group = open_group(self.host, port, 0, world, self.timeout_s)
        ray.get(refs)
        self.workers = list(workers)
        log.info("publication group up: %d rollout groups, world size %d, port %d", len(workers), world, port)

    def publish(self, version: int, tensors: Iterable, *,
                fault_hook: Callable[[BucketSpec, torch.Tensor], None] | None = None) -> PublicationReport:
        """Send one version to every connected group; returns once all have answered."""
        import ray

        if self.group is None:
            raise RuntimeError("publish() before connect()")
        started = time.perf_counter()
        refs = [w.receive_weights.remote(version) for w in self.workers]
        manifest = send_publication(self.group, version, tensors, bucket_bytes=self.bucket_bytes,
                                    checksum_algo=self.checksum_algo, fault_hook=fault_hook)
        results = ray.get(refs)
        report = PublicationReport(manifest, results, time.perf_counter() - started)
        if not report.committed:
            log.warning("version %d refused by %d of %d rollout groups: %s", version,
                        sum(not r["committed"] for r in results), len(results),
                        next(r["error"] for r in results if not r["committed"]))
        return report

