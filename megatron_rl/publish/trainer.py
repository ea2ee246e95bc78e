"""Trainer side of weight publication: push (hf_name, full_tensor) groups to rollout groups.

    import ray
    from megatron_rl.publish import WeightPublisher
    pub = WeightPublisher(bucket_bytes=64 << 20)
    pub.connect(rollout_workers)                     # RolloutWorker actor handles
    report = pub.publish(version=1, tensors=model_groups)   # iterator of [(hf_name, tensor), ...]
    assert report.committed

`tensors` is any iterable of (hf_name, full_tensor) pairs or of lists of them (one list
per layer is what a Megatron source gathering TP shards per layer naturally yields); it
is consumed lazily, on the calling thread.  The trainer process is rank 0 of a group whose
other ranks are every vLLM worker process of every rollout group:

  transport="gloo" (CPU; default)  our wire protocol (wire.py), manifest on the wire.
  transport="nccl" (GPU)           vLLM's NCCL communicator and packed broadcast carry the
                                   tensors (on the trainer's GPU); a ManifestRecorder hashes
                                   them on the way, and the manifest follows by RPC
                                   (commit_weights).  `tensors` must then say up front what it
                                   yields: a list, or a source with metadata() (MegatronWeightSource).
  transport="ipc" (GPU, colocated) CUDA IPC handles to the tensors on the trainer's GPU, hashed
                                   first, and to byte-for-byte copies held by a learner rank on
                                   each other engine GPU (ipc_route.py); the engines read their
                                   GPU's copy in place, then the manifest follows by RPC
                                   (commit_weights) as for nccl (vllm_ipc.py).
Either way a rollout group commits a version only when all of it verified (vllm_engine.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.platform.spawn import free_port
from megatron_rl.publish.checksum import DEFAULT_CHECKSUM
from megatron_rl.publish.manifest import (
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    ManifestRecorder,
    PublicationManifest,
    dtype_name,
    flatten_groups,
    to_dtype,
)
from megatron_rl.publish.wire import host_store, open_group, send_publication

TRANSPORTS = ("gloo", "nccl", "ipc")
NCCL_BUFFERS = 2  # vLLM's packed broadcast: buffers in flight on each side

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
    """Rank 0 of the publication group; drives RolloutWorker actors through Ray."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum_algo: str = DEFAULT_CHECKSUM, timeout_s: float = 600.0, transport: str = "gloo"):
        if transport not in TRANSPORTS:
            raise ValueError(f"publication transport {transport!r} is not one of {list(TRANSPORTS)}")
        self.host, self.port, self.transport = host, port, transport
        self.bucket_bytes, self.checksum_algo, self.timeout_s = bucket_bytes, checksum_algo, timeout_s
        self.workers: list = []
        self.group = None
        self.replicas = None  # ipc: the learner ranks holding copies on other GPUs (ipc_route.py)

    def connect(self, workers: list, replicas=None) -> None:
        """Form the group with every worker process of every actor in `workers`.  ipc: `replicas`
        (ipc_route.IPCReplicas, planned over the learner group) say which learner ranks hold copies
        on the other engine GPUs; without it every engine must sit on this process's GPU."""
        import ray

        if not workers:
            raise ValueError("connect() needs at least one rollout worker")
        sizes = ray.get([w.engine_world_size.remote() for w in workers], timeout=self.timeout_s)
        world = 1 + sum(sizes)
        store = None
        if self.transport == "gloo":  # listening before the workers are told the port: nothing can take it
            store = host_store(self.host, world, self.timeout_s, port=self.port or 0)
            port = store.port
        else:
            port = self.port or free_port(self.host)
        offsets = [1 + sum(sizes[:i]) for i in range(len(workers))]
        info = dict(master_address=self.host, master_port=port, world_size=world)
        if self.transport == "ipc":  # no rendezvous: the handles name the memory
            from megatron_rl.publish.ipc_route import IPCReplicas, engine_gpu_uuids, gpu_uuid

            # The route (which learner rank holds a copy on each engine GPU) comes from the learner
            # group (RankWeights.connect_rollout); a publisher on its own serves its GPU only.
            self.replicas = replicas or IPCReplicas.local(engine_gpu_uuids(workers), gpu_uuid())
            refs = [w.init_weight_transfer.remote({"packed": False, "rank_offset": off})
                    for w, off in zip(workers, offsets)]
            ray.get(refs)
            self.workers, self.group = list(workers), "ipc"
            log.info("publication over CUDA IPC to %d rollout groups on %d GPU(s)", len(workers),
                     len(set(self.replicas.route.source_of)))
            return
        if self.transport == "nccl":  # vLLM's fields; the worker decodes chunks as we encode them
            info.update(packed=True, packed_buffer_size_bytes=self.bucket_bytes, packed_num_buffers=NCCL_BUFFERS)
        else:
            info.update(timeout_s=self.timeout_s)
        refs = [w.init_weight_transfer.remote(dict(info, rank_offset=off)) for w, off in zip(workers, offsets)]
        if self.transport == "nccl":
            from vllm.distributed.weight_transfer.nccl_common import trainer_init

            self.group = trainer_init(info)  # rank 0, on this process's current CUDA device
        else:
            self.group = open_group(self.host, port, 0, world, self.timeout_s, store=store)
        ray.get(refs, timeout=self.timeout_s)
        self.workers = list(workers)
        log.info("publication group up: %d rollout groups, world size %d, port %d", len(workers), world, port)

    def publish(self, version: int, tensors: Iterable, *,
                fault_hook: Callable[[BucketSpec, torch.Tensor], None] | None = None) -> PublicationReport:
        """Send one version to every connected group; returns once all have answered."""
        if self.group is None:
            raise RuntimeError("publish() before connect()")
        started = time.perf_counter()
        if self.transport == "nccl":
            manifest, results = self._publish_nccl(version, tensors, fault_hook)
        elif self.transport == "ipc":
            manifest, results = self._publish_ipc(version, tensors, fault_hook)
        else:
            manifest, results = self._publish_gloo(version, tensors, fault_hook)
        report = PublicationReport(manifest, results, time.perf_counter() - started)
        if not report.committed and report.results:
            log.warning("version %d refused by %d of %d rollout groups: %s", version,
                        sum(not r["committed"] for r in results), len(results),
                        next(r["error"] for r in results if not r["committed"]))
        return report

    def _publish_gloo(self, version: int, tensors, fault_hook) -> tuple[PublicationManifest | None, list[dict]]:
        """Our wire protocol; a group that stops answering (a stopped process, a severed link) costs at most
        timeout_s on the send and timeout_s waiting for its answer, and is reported `unresponsive`."""
        refs = [w.receive_weights.remote(version) for w in self.workers]
        manifest = failure = None
        try:
            manifest = send_publication(self.group, version, tensors, bucket_bytes=self.bucket_bytes,
                                        checksum_algo=self.checksum_algo, fault_hook=fault_hook)
        except RuntimeError as err:  # gloo timed out or lost a peer; a source error also lands here
            failure = err
            self.group = None  # a failed collective leaves the group unusable: connect() again
            log.warning("publication of version %d broke off: %s", version, str(err).strip().splitlines()[-1])
        results = group_answers(refs, version, self.timeout_s)
        if failure is not None and not any(r.get("unresponsive") or r.get("broken_off") for r in results):
            raise failure  # no link broke: the trainer's side failed (e.g. its source raised)
        return manifest, results

    def _publish_nccl(self, version: int, tensors, fault_hook) -> tuple[PublicationManifest, list[dict]]:
        """Tensors through vLLM's packed NCCL broadcast, hashed on the way; then the manifest
        by RPC, and each group commits all of it or nothing."""
        import ray
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        meta = announced_metadata(tensors)
        refs = [w.receive_weights.remote(version, meta) for w in self.workers]
        # A worker that failed before entering the broadcast would leave us blocked in NCCL
        # forever (checked without waiting, best effort); a source that raises mid-stream
        # leaves the workers blocked instead (the group must be rebuilt then).
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        if done:
            ray.get(done)  # raises the worker's error
            raise RuntimeError(f"{len(done)} rollout group(s) left the NCCL publication before it started")
        recorder = ManifestRecorder(tensors, version, checksum_algo=self.checksum_algo,
                                    bucket_bytes=self.bucket_bytes, fault_hook=fault_hook)
        torch.cuda.current_stream().synchronize()  # tensors made just before on this stream are complete
        packed_nccl_broadcast_producer(iterator=as_announced(recorder, meta), group=self.group, src=0,
                                       post_iter_func=lambda item: item[1], buffer_size_bytes=self.bucket_bytes,
                                       num_buffers=NCCL_BUFFERS)
        torch.cuda.current_stream().synchronize()
        ray.get(refs)
        manifest = recorder.manifest()
        return manifest, ray.get([w.commit_weights.remote(manifest.to_dict()) for w in self.workers])


    def _publish_ipc(self, version: int, tensors, fault_hook,
                     exporter=None) -> tuple[PublicationManifest, list[dict]]:
        """Hash, export a CUDA IPC handle per tensor (and have the learner ranks on the other engine
        GPUs hold copies: publish/ipc_route.py), let every group open and verify them, and hold the
        tensors until every group has answered (a handle does not keep its memory)."""
        import ray

        from megatron_rl.publish.ipc_route import export_cuda_handle, ipc_round

        def deliver(meta, pickled, manifest):
            ray.get([w.receive_weights.remote(version, meta, pickled) for w in self.workers])
            return ray.get([w.commit_weights.remote(manifest.to_dict()) for w in self.workers])

        recorder = ManifestRecorder(tensors, version, checksum_algo=self.checksum_algo,
                                    bucket_bytes=self.bucket_bytes, fault_hook=fault_hook)
        return ipc_round(recorder, deliver, exporter or export_cuda_handle, self.replicas)


def group_answers(refs: list, version: int, timeout_s: float) -> list[dict[str, Any]]:
    """Each rollout group's answer to one publication (RolloutWorker.receive_weights), waiting at most
    `timeout_s` for all of them; a group that did not answer is {"committed": False, "unresponsive": True}
    with an error naming it and rollout.publish_timeout_s, one whose call raised has the error."""
    import ray

    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    out = []
    for g, ref in enumerate(refs):
        if ref not in done:
            out.append({"committed": False, "unresponsive": True, "version": None,
                        "error": f"rollout group {g} did not answer the publication of version {version} within "
                                 f"rollout.publish_timeout_s={timeout_s:g} s (stopped or cut off?)"})
            continue
        try:
            out.append(ray.get(ref))
        except ray.exceptions.RayError as err:
            out.append({"committed": False, "version": None,
                        "error": f"rollout group {g}: {str(err).strip().splitlines()[-1]}"})
    return out


def announced_metadata(tensors) -> list[tuple[str, str, list[int]]]:
    """(name, dtype name, shape) of every tensor `tensors` will yield, in order, known before
    any is produced: from its metadata() (MegatronWeightSource), or read off a list."""
    if hasattr(tensors, "metadata"):
        meta = [(name, dtype_name(dtype), list(shape)) for name, dtype, shape in tensors.metadata()]
    elif isinstance(tensors, (list, tuple)):
        meta = [(name, dtype_name(t.dtype), list(t.shape)) for name, t in flatten_groups(tensors)]
    else:
        raise TypeError("the NCCL transport announces every tensor before sending: pass a list of "
                        f"(name, tensor) pairs or groups, or a source with metadata(), not {type(tensors).__name__}")
    seen: set[str] = set()
    for name, _, _ in meta:
        if name in seen:  # found now, not half way through a broadcast the receivers cannot leave
            raise ValueError(f"tensor {name!r} appears twice in one publication")
        seen.add(name)
    return meta


def as_announced(pairs, meta: list[tuple[str, str, list[int]]]):
    """`pairs` unchanged, checked against what the receivers were told: a disagreement would
    leave them cutting the byte stream differently (a hang or garbage), so it raises, naming it."""
    count = 0
    for name, tensor in pairs:
        if count >= len(meta) or (name, dtype_name(tensor.dtype), list(tensor.shape)) != tuple(meta[count]):
            told = meta[count] if count < len(meta) else "nothing more"
            raise ValueError(f"tensor {count} is {name} {dtype_name(tensor.dtype)} {list(tensor.shape)}, "
                             f"the receivers were told {told}")
        count += 1
        yield name, tensor
    if count != len(meta):
        raise ValueError(f"{count} tensors sent, the receivers were told {len(meta)}")
