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
other ranks are every vLLM worker process of every rollout group.  In a run that is learner rank 0:
`join_publication` gives it its publisher and LearnerWorker.publish (ranks/rank.py) calls
`publish`, as the tests do.

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

    def summary(self) -> dict:
        """Plain data for the driver (train/policy.py judges it): committed, bytes, digest, whether the send
        broke off (then the group is formed anew and the version published again), each group's answer."""
        return {"committed": self.committed, "seconds": self.seconds,
                "bytes": self.manifest.nbytes if self.manifest is not None else 0,
                "digest": self.manifest.digest() if self.manifest is not None else None,
                "broken": self.manifest is None,
                "errors": [r["error"] for r in self.results if not r["committed"]],
                "groups": [{"committed": r["committed"], "unresponsive": bool(r.get("unresponsive")),
                            "error": r.get("error")} for r in self.results]}


def engine_dtype(workers: list) -> torch.dtype:
    """The one dtype every rollout group serves (RolloutWorker.serving_dtype): what the trainer
    casts its tensors to, once, before hashing and sending them (engines refuse any other)."""
    import ray

    names = sorted(set(ray.get([w.serving_dtype.remote() for w in workers])))
    if len(names) != 1:
        raise ValueError(f"rollout groups serve different dtypes {names}: set rollout.dtype to one of them")
    return to_dtype(names[0])


def join_publication(workers: list, *, rank: int, transport: str, bucket_bytes: int, checksum: str,
                     timeout_s: float) -> tuple[Transport, "WeightPublisher | None", torch.dtype]:
    """A learner rank's part in forming the publication group with `workers` (every rank, in step): its
    transport, joined; on rank 0 the WeightPublisher connected to every engine (None elsewhere); and the
    engines' dtype, which every rank casts to (the gathers run in it)."""
    from megatron_rl.platform.listen import bind_address

    dtype = engine_dtype(workers)
    # The group's store listens on loopback when the run is on one node, on this node's cluster address
    # when it spans several (platform/listen.py); the engines connect to it there.
    path = make_transport(transport, host=bind_address(), bucket_bytes=bucket_bytes,
                          checksum_algo=checksum, timeout_s=timeout_s)
    path.join(workers)
    publisher = None
    if rank == 0:
        publisher = WeightPublisher(transport=path)
        publisher.connect(workers)
    return path, publisher, dtype


def group_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """(each rollout group's rank offset in the publication group, the group's world size) for groups of
    `sizes` worker processes: the publisher is rank 0, the groups follow in order (a worker's own rank is
    publish/vllm_engine.py `engine_rank`)."""
    return [1 + sum(sizes[:i]) for i in range(len(sizes))], 1 + sum(sizes)


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
        self.transport.connect(list(workers), *group_offsets(sizes))

    def publish(self, version: int, tensors: Iterable, *,
                fault_hook: Callable[[BucketSpec, torch.Tensor], None] | None = None) -> PublicationReport:
        """Send one version to every connected group; returns once all have answered."""
        started = time.perf_counter()
        manifest, results = self.transport.send(version, tensors, fault_hook)
        return self.report(version, manifest, results, time.perf_counter() - started)

    @staticmethod
    def report(version: int, manifest: PublicationManifest | None, results: list[dict],
               seconds: float) -> PublicationReport:
        """One publication's report from what the transport's send returned; a refusal is logged."""
        report = PublicationReport(manifest, results, seconds)
        if not report.committed and report.results:
            log.warning("version %d refused by %d of %d rollout groups: %s", version,
                        sum(not r["committed"] for r in results), len(results),
                        next(r["error"] for r in results if not r["committed"]))
        return report
