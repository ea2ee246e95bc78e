"""Trainer side of weight publication: push (hf_name, full_tensor) groups to rollout groups.

    import ray
    from megatron_rl.publish import WeightPublisher
    pub = WeightPublisher(bucket_bytes=64 << 20)      # transport="gloo" | "nccl" | "ipc", or a Transport
    pub.connect(rollout_workers)                     # RolloutWorker actor handles
    report = pub.publish(version=1, tensors=model_groups)   # iterator of [(hf_name, tensor), ...]
    assert report.committed

`tensors` is any iterable of (hf_name, full_tensor) pairs or of lists of them (one list
per layer is what a Megatron source gathering TP shards per layer naturally yields); it
is consumed lazily, on the calling thread.  The trainer process is rank 0 of a group whose
other ranks are every vLLM worker process of every rollout group.

The publisher owns what every path shares: the group's layout (each rollout group's rank
offset), the timing and the report of each group's answer.  How the bytes travel is the
transport's (publish/transports.py: gloo, nccl, ipc; chosen once, publish/transport.py).
Whichever path, a rollout group commits a version only when all of it verified (vllm_engine.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.publish.checksum import DEFAULT_CHECKSUM
from megatron_rl.publish.manifest import DEFAULT_BUCKET_BYTES, BucketSpec, PublicationManifest, to_dtype
from megatron_rl.publish.transport import make_transport
from megatron_rl.publish.transports import Transport

log = logging.getLogger(__name__)


@dataclass
class PublicationReport:
    """Outcome of one publish(): the manifest sent and each rollout group's answer."""

    manifest: PublicationManifest | None  # None when the send broke off (a group stopped answering)
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def committed(self) -> bool:
        return all(r["committed"] for r in self.results)


def engine_dtype(workers: list) -> torch.dtype:
    """The one dtype every rollout group serves (RolloutWorker.serving_dtype): what the trainer
    casts its tensors to, once, before hashing and sending them (engines refuse any other)."""
    import ray

    names = sorted(set(ray.get([w.serving_dtype.remote() for w in workers])))
    if len(names) != 1:
        raise ValueError(f"rollout groups serve different dtypes {names}: set rollout.dtype to one of them")
    return to_dtype(names[0])


class WeightPublisher:
    """Rank 0 of the publication group; drives RolloutWorker actors through Ray over one transport."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum_algo: str = DEFAULT_CHECKSUM, timeout_s: float = 600.0,
                 transport: str | Transport = "gloo"):
        if isinstance(transport, str):
            transport = make_transport(transport, host=host, port=port, bucket_bytes=bucket_bytes,
                                       checksum_algo=checksum_algo, timeout_s=timeout_s)
        self.transport = transport
        self.timeout_s = transport.timeout_s

    def connect(self, workers: list) -> None:
        """Form the group with every worker process of every actor in `workers`."""
        import ray

        if not workers:
            raise ValueError("connect() needs at least one rollout worker")
        sizes = ray.get([w.engine_world_size.remote() for w in workers], timeout=self.timeout_s)
        offsets = [1 + sum(sizes[:i]) for i in range(len(workers))]
        self.transport.connect(list(workers), offsets, 1 + sum(sizes))

    def publish(self, version: int, tensors: Iterable, *,
                fault_hook: Callable[[BucketSpec, torch.Tensor], None] | None = None) -> PublicationReport:
        """Send one version to every connected group; returns once all have answered."""
        if not self.transport.connected:
            raise RuntimeError("publish() before connect() (or after a send broke off: connect() again)")
        started = time.perf_counter()
        manifest, results = self.transport.send(version, tensors, fault_hook)
        report = PublicationReport(manifest, results, time.perf_counter() - started)
        if not report.committed and report.results:
            log.warning("version %d refused by %d of %d rollout groups: %s", version,
                        sum(not r["committed"] for r in results), len(results),
                        next(r["error"] for r in results if not r["committed"]))
        return report
