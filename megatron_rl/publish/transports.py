"""The three publication paths, one object each; which one a run uses is chosen once, at start-up
(publish/transport.py `transport_class`), and nothing else branches on it.

    transport = GlooTransport(host=ip, bucket_bytes=64 << 20, checksum_algo="blocksum", timeout_s=600)
    transport.join(workers)                   # every learner rank (ipc: which rank holds copies where)
    transport.connect(workers, offsets, world)  # the publishing rank: form the group with every engine
    manifest, results = transport.send(version, tensors, fault_hook)   # one publication, every answer
    transport.follow()                        # every other learner rank, after its share of the gathers

  GlooTransport   CPU; our wire protocol (wire.py), the manifest on the wire, each group commits in
                  its answer to receive_weights.
  NcclTransport   GPU, disaggregated; vLLM's packed NCCL broadcast carries the tensors (on the
                  trainer's GPU), a ManifestRecorder hashes them on the way, the manifest follows by
                  RPC (commit_weights).  `tensors` must say up front what it yields (a list, or a
                  source with metadata(): MegatronWeightSource).
  IpcTransport    GPU, colocated; CUDA IPC handles to a copy of the tensors in one staging buffer on
                  the trainer's GPU, kept across steps (ipc_staging.py), hashed first, and to byte-for-byte copies held by a learner rank on each other engine GPU
                  (ipc_route.py); the manifest follows by RPC, as for NCCL.

The class attributes say what the other layers need to know of a path without naming it: where the
learner materialises published tensors (`device`), whether the engines commit by a separate RPC
(`commits_by_rpc`), which vLLM weight-transfer backend receives it, the engine's environment, and
whether each GPU holds a whole copy of the model during a publication (the planner's ledger).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from megatron_rl.publish.manifest import ManifestRecorder, PublicationManifest, dtype_name, flatten_groups

log = logging.getLogger(__name__)

NCCL_BUFFERS = 2  # vLLM's packed broadcast: buffers in flight on each side
Results = list[dict[str, Any]]


class Transport(abc.ABC):
    """One publication path, on the publishing learner rank (and its share on the others)."""

    name: ClassVar[str]
    vllm_backend: ClassVar[str]
    """The weight-transfer backend that receives it inside vLLM (publish/vllm_engine.py registers it)."""
    device: ClassVar[str] = "cpu"
    """Where the learner materialises the tensors it publishes."""
    commits_by_rpc: ClassVar[bool] = False
    """The engines only keep what arrives; commit_weights(manifest) decides (else receive_weights does)."""
    engine_env: ClassVar[dict[str, str]] = {}
    """Environment variables the receiving vLLM engine needs."""
    whole_model_per_gpu: ClassVar[bool] = False
    """A whole copy of the model stays on each GPU a publication reaches (planner/ledger.py)."""

    def __init__(self, *, host: str = "127.0.0.1", port: int | None = None, bucket_bytes: int,
                 checksum_algo: str, timeout_s: float):
        self.host, self.port = host, port
        self.bucket_bytes, self.checksum_algo, self.timeout_s = bucket_bytes, checksum_algo, timeout_s
        self.workers: list = []

    def join(self, workers: list) -> None:
        """Every learner rank, before connect (collective where a path needs it)."""

    @abc.abstractmethod
    def connect(self, workers: list, offsets: list[int], world: int) -> None:
        """Form the publication group: the publisher is rank 0, group i's engine ranks start at offsets[i]."""

    def send(self, version: int, tensors, fault_hook=None) -> tuple[PublicationManifest | None, Results]:
        """Send one version to every connected group; (the manifest, or None when the send broke off;
        each group's answer)."""
        if not self.connected:
            raise RuntimeError("a publication before connect() (or after a send broke off: connect() again)")
        return self._send(version, tensors, fault_hook)

    @abc.abstractmethod
    def _send(self, version: int, tensors, fault_hook) -> tuple[PublicationManifest | None, Results]:
        """The path's send (Transport.send checked the group is formed)."""

    def follow(self) -> None:
        """Every learner rank but the publisher, after driving its share of the source's gathers."""

    def close(self) -> None:
        """Free the group's communicator (before a regroup forms a new one, or a rank is rebuilt)."""
        self.workers = []

    @property
    def connected(self) -> bool:
        return bool(self.workers)

    def _init_workers(self, workers: list, infos: list[dict]) -> list:
        return [w.init_weight_transfer.remote(info) for w, info in zip(workers, infos)]


class GlooTransport(Transport):
    name = "gloo"
    vllm_backend = "megatron_rl_gloo"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.group = None

    def connect(self, workers: list, offsets: list[int], world: int) -> None:
        import ray

        from megatron_rl.publish.wire import host_store, open_group

        self.close()  # a second connect replaces the group: the last one goes first
        # Listening before the workers are told the port: nothing can take it in between.
        store = host_store(self.host, world, self.timeout_s, port=self.port or 0)
        info = dict(master_address=self.host, master_port=store.port, world_size=world, timeout_s=self.timeout_s)
        refs = self._init_workers(workers, [dict(info, rank_offset=off) for off in offsets])
        self.group = open_group(self.host, store.port, 0, world, self.timeout_s, store=store)
        ray.get(refs, timeout=self.timeout_s)
        self.workers = list(workers)
        log.info("publication group up: %d rollout groups, world size %d, port %d", len(workers), world, store.port)

    @property
    def connected(self) -> bool:
        return self.group is not None

    def _send(self, version: int, tensors, fault_hook) -> tuple[PublicationManifest | None, Results]:
        """A group that stops answering (a stopped process, a severed link) costs at most timeout_s on
        the send and timeout_s waiting for its answer, and is reported `unresponsive`."""
        from megatron_rl.publish.wire import send_publication

        refs = [w.receive_weights.remote(version) for w in self.workers]
        manifest = failure = None
        try:
            manifest = send_publication(self.group, version, tensors, bucket_bytes=self.bucket_bytes,
                                        checksum_algo=self.checksum_algo, fault_hook=fault_hook)
        except RuntimeError as err:  # gloo timed out or lost a peer; a source error also lands here
            failure = err
            self._drop_group()  # a failed collective leaves the group unusable: connect() again
            log.warning("publication of version %d broke off: %s", version, str(err).strip().splitlines()[-1])
        results = group_answers(refs, version, self.timeout_s)
        if failure is not None and not any(r.get("unresponsive") or r.get("broken_off") for r in results):
            raise failure  # no link broke: the trainer's side failed (e.g. its source raised)
        return manifest, results

    def close(self) -> None:
        """The group's threads, its sockets and the store's listening port go with it (release_gloo_group)."""
        self._drop_group()
        super().close()

    def _drop_group(self) -> None:
        group, self.group = self.group, None
        release_gloo_group(group)


class NcclTransport(Transport):
    name = "nccl"
    vllm_backend = "megatron_rl_nccl"
    device = "cuda"
    commits_by_rpc = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.group = None

    def connect(self, workers: list, offsets: list[int], world: int) -> None:
        import ray
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        from megatron_rl.platform.spawn import free_port

        self.close()  # a second connect replaces the communicator: the last one goes first
        # vLLM's fields; the worker decodes chunks as we encode them.
        info = dict(master_address=self.host, master_port=self.port or free_port(self.host), world_size=world,
                    packed=True, packed_buffer_size_bytes=self.bucket_bytes, packed_num_buffers=NCCL_BUFFERS)
        refs = self._init_workers(workers, [dict(info, rank_offset=off) for off in offsets])
        self.group = trainer_init(info)  # rank 0, on this process's current CUDA device
        ray.get(refs, timeout=self.timeout_s)
        self.workers = list(workers)
        log.info("NCCL publication group up: %d rollout groups, world size %d", len(workers), world)

    def close(self) -> None:
        """An NCCL communicator holds device memory and a socket per peer until destroyed."""
        group, self.group = self.group, None
        destroy_communicator(group)
        super().close()

    def _send(self, version: int, tensors, fault_hook) -> tuple[PublicationManifest, Results]:
        """Tensors through vLLM's packed NCCL broadcast, hashed on the way; then the manifest by RPC,
        and each group commits all of it or nothing."""
        import ray
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        meta = announced_metadata(tensors)
        refs = [w.receive_weights.remote(version, meta) for w in self.workers]
        # A worker that failed before entering the broadcast would leave us blocked in NCCL forever
        # (checked without waiting, best effort); a source that raises mid-stream leaves the workers
        # blocked instead (the group must be rebuilt then).
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


class IpcTransport(Transport):
    name = "ipc"
    vllm_backend = "megatron_rl_ipc"
    device = "cuda"
    commits_by_rpc = True
    engine_env = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the handles travel pickled
    whole_model_per_gpu = True

    def __init__(self, *, exporter: Callable | None = None, **kw):
        from megatron_rl.publish.ipc_staging import IpcStaging

        super().__init__(**kw)
        self.replicas = None  # which learner rank holds a copy on each engine GPU (ipc_route.py)
        # Every publication is copied into this one buffer and exported from it, never from the
        # learner's parameters (ipc_staging.py); `exporter` replaces the CUDA step in tests without a GPU.
        self.staging = IpcStaging(exporter)

    def join(self, workers: list) -> None:
        from megatron_rl.publish.ipc_route import IPCReplicas, engine_gpu_uuids, gpu_uuid

        self.replicas = IPCReplicas.connect(lambda: engine_gpu_uuids(workers), gpu_uuid())

    def connect(self, workers: list, offsets: list[int], world: int) -> None:
        """No rendezvous: the handles name the memory.  Without join() (a publisher on its own) every
        engine must sit on this process's GPU."""
        import ray

        from megatron_rl.publish.ipc_route import IPCReplicas, engine_gpu_uuids, gpu_uuid

        if self.replicas is None:
            self.replicas = IPCReplicas.local(engine_gpu_uuids(workers), gpu_uuid())
        ray.get(self._init_workers(workers, [{"packed": False, "rank_offset": off} for off in offsets]))
        self.workers = list(workers)
        log.info("publication over CUDA IPC to %d rollout groups on %d GPU(s)", len(workers),
                 len(set(self.replicas.route.source_of)))

    def _send(self, version: int, tensors, fault_hook) -> tuple[PublicationManifest, Results]:
        """Hash, export a CUDA IPC handle per tensor (the holders on the other engine GPUs copy theirs),
        let every group open and verify them, and hold the tensors until every group has answered (a
        handle does not keep its memory)."""
        import ray

        from megatron_rl.publish.ipc_route import ipc_round

        def deliver(meta, pickled, manifest):
            ray.get([w.receive_weights.remote(version, meta, pickled) for w in self.workers])
            return ray.get([w.commit_weights.remote(manifest.to_dict()) for w in self.workers])

        recorder = ManifestRecorder(tensors, version, checksum_algo=self.checksum_algo,
                                    bucket_bytes=self.bucket_bytes, fault_hook=fault_hook)
        return ipc_round(recorder, deliver, self.staging, self.replicas)

    def follow(self) -> None:
        if self.replicas is not None:
            self.replicas.hold()

    def close(self) -> None:
        """The staging buffers go with the group (every engine has answered, so none holds a view)."""
        self.staging.release()
        if self.replicas is not None:
            self.replicas.staging.release()
        super().close()


def release_gloo_group(group) -> None:
    """Free a publication gloo group (wire.open_group; the trainer's and each engine worker's side).

    Nothing in torch.distributed destroys such a group explicitly: it is not registered there
    (destroy_process_group refuses it), and in torch 2.13 a gloo backend's shutdown() does nothing.
    Its destructor joins its threads and closes its sockets and its store (on rank 0, the listening
    port) when the last reference to it goes.  So this calls shutdown() (the backend API for a clean
    end, should a torch implement it for gloo), and the caller must drop its reference -- its last
    one: wire.py keeps none, and a group held elsewhere stays alive.  None is accepted (no group)."""
    if group is None:
        return
    try:
        group.shutdown()
    except Exception as err:  # noqa: BLE001 -- a group a failed collective broke: its destructor still frees it
        log.debug("gloo group shutdown: %s", err)


def destroy_communicator(comm) -> None:
    """Free an NCCL communicator from vLLM (a PyNcclCommunicator; the trainer's and each engine
    worker's side).  None is accepted (no communicator).

    destroy() aborts it (ncclCommAbort: its device memory and its connection to every peer; vLLM
    waits at most 5 s for the abort).  The communicator still holds its StatelessProcessGroup
    after that, whose TCPStore (listening on the trainer's side) has no close(): the reference is
    dropped here, and the store's sockets close with its last reference.  A communicator without
    destroy() (not vLLM 0.32's) cannot be freed from Python: its resources stay until the process
    exits, and a warning says so."""
    if comm is None:
        return
    destroy = getattr(comm, "destroy", None)
    if callable(destroy):
        destroy()
    else:
        log.warning("%s has no destroy(): its NCCL resources stay allocated until this process exits",
                    type(comm).__name__)
    if getattr(comm, "group", None) is not None:
        comm.group = None


def group_answers(refs: list, version: int, timeout_s: float) -> Results:
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
