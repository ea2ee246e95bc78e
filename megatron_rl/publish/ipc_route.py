"""Colocated CUDA IPC on several GPUs: a copy of each publication on every GPU that runs an engine.

    # every learner rank, joining the publication group (IpcTransport.join, publish/transports.py):
    replicas = IPCReplicas.connect(lambda: engine_gpu_uuids(workers), gpu_uuid())
    # the publishing rank (0), in its transport's send (IpcTransport._send; WeightPublisher.publish calls it):
    manifest, results = ipc_round(recorder, deliver, staging, replicas)   # staging: ipc_staging.py
    # every other learner rank, after driving its share of the source's gathers (IpcTransport.follow):
    replicas.hold()          # a holder: copy, export, wait until every group answered; others: nothing

CUDA IPC opens memory only on the GPU it lies on.  On a colocated node every GPU runs a learner
rank and a rollout engine worker, so the publishing rank's tensors reach the engines on its own
GPU only.  The route, planned once at connect from the GPU UUIDs of the learner ranks and of
every engine worker (engine TP ranks included), names for each engine GPU the learner rank that
supplies its copy: the publisher on its own GPU, else the lowest learner rank on that GPU (the
"holders").  A GPU that runs an engine worker and no learner rank is a ConfigError naming the
groups and GPUs.

Per publication, after the source's gathers: the publisher hashes its tensors (the ManifestRecorder
digests, as for one GPU), copies them into its staging buffer and exports them there (never the
learner's own memory: ipc_staging.py), broadcasts them byte for byte over a process subgroup
of the publisher and the holders, and gathers the holders' handles; one union per tensor,
{GPU UUID: handle}, goes to every engine, whose workers each open their own GPU's handle and
verify the digests over that memory before commit (vllm_ipc.py).  Same digests, same bytes on
every GPU: a copy that differs on one GPU is refused by the engines reading it.

Memory: one copy of the model in the engine's dtype on each route GPU, in a staging buffer kept
from one publication to the next (written again only after every rollout group answered: the
publisher's release); ranks not on the route hold nothing.  The
planner counts it per GPU (planner/ledger.py, `publish`).  Tested on CPU with gloo ranks and the
CUDA handle step replaced (tests/dist/test_ipc_route.py); tests/gpu/test_gpu_colocated_ipc_multi.py
needs two GPUs.
"""

from __future__ import annotations

import base64
import logging
import pickle
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError
from megatron_rl.platform.parallel import register_teardown
from megatron_rl.publish.ipc_staging import Handle, IpcStaging, export_cuda_handle, gpu_uuid  # noqa: F401

log = logging.getLogger(__name__)

FIELD = "rollout.weight_transfer 'ipc'"
_SUBGROUPS: dict[tuple[int, ...], object] = {}  # ranks -> process subgroup (made once per parallel state)
# destroy_parallel destroys these subgroups with Megatron's (they are made after initialize_parallel):
# the cache empties with them on every rank alike, and the next publication makes them anew.
register_teardown(_SUBGROUPS.clear)


def export_ipc_handles(pairs: Iterable[tuple[str, torch.Tensor]], staging: IpcStaging):
    """(metadata [(name, dtype name, shape)], handles [one per tensor], keep [the staged views]): each
    tensor copied into `staging` (ipc_staging.py: never the learner's own memory) and exported there.

    `keep` must not be written again until every engine has answered: a handle does not hold its memory."""
    return staging.export(pairs)


def pickle_handles(handles: list[Handle]) -> str:
    """The form vLLM's update info accepts over any RPC (`ipc_handles_pickled`)."""
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


def _worker_gpu_uuids(worker) -> list[str]:
    """Runs inside a RolloutWorker actor (through __ray_call__): the GPU UUID of each vLLM worker."""
    return list(worker.llm.collective_rpc("megatron_rl_gpu_uuid"))


def engine_gpu_uuids(workers: list) -> list[list[str]]:
    """Per rollout group, the GPU UUID of each of its engine workers (TP ranks)."""
    import ray

    return ray.get([w.__ray_call__.remote(_worker_gpu_uuids) for w in workers])


@dataclass(frozen=True)
class IPCRoute:
    """Which learner rank supplies the copy that the engines on each GPU open."""

    publisher: int
    source_of: dict[str, int]  # engine GPU UUID -> learner rank holding a copy on it

    @property
    def holders(self) -> tuple[int, ...]:
        """Learner ranks other than the publisher that hold a copy (sorted)."""
        return tuple(sorted(set(self.source_of.values()) - {self.publisher}))

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.publisher, *self.holders)


def plan_route(learner_gpus: list[str], engine_gpus: list[list[str]], publisher: int = 0) -> IPCRoute:
    """The route for learner ranks on `learner_gpus` (rank -> GPU UUID) and rollout groups whose
    workers run on `engine_gpus`; ConfigError naming every group and GPU no learner rank can serve."""
    if not 0 <= publisher < len(learner_gpus):
        raise ValueError(f"publisher rank {publisher} is not among {len(learner_gpus)} learner ranks")
    on_gpu: dict[str, int] = {}
    for rank, uuid in enumerate(learner_gpus):
        on_gpu.setdefault(uuid, rank)
    on_gpu[learner_gpus[publisher]] = publisher
    missing = {g: sorted(set(u for u in gpus if u not in on_gpu)) for g, gpus in enumerate(engine_gpus)}
    missing = {g: gpus for g, gpus in missing.items() if gpus}
    if missing:
        where = "; ".join(f"group {g} on {', '.join(gpus)}" for g, gpus in missing.items())
        raise ConfigError(
            f"{FIELD}: rollout group(s) {sorted(missing)} run on GPU(s) with no learner rank ({where}; learner "
            f"ranks are on {sorted(on_gpu)}); CUDA IPC opens memory only on its own GPU, so every engine GPU "
            "needs a learner rank to hold a copy (colocate them, or use 'gloo')")
    return IPCRoute(publisher, {u: on_gpu[u] for gpus in engine_gpus for u in gpus})


def _subgroup(ranks: tuple[int, ...]):
    """The process subgroup of `ranks` (every learner rank calls this, in the same order)."""
    key = tuple(sorted(ranks))
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_group(list(key))
    return _SUBGROUPS[key]


def _broadcast_bytes(tensor: torch.Tensor, src: int, group) -> None:
    """Broadcast a contiguous tensor's raw bytes (any dtype; the copy is bit for bit)."""
    if tensor.numel():
        dist.broadcast(tensor.reshape(-1).view(torch.uint8), src=src, group=group)


class IPCReplicas:
    """The route's collectives on one learner rank (the publisher's share/release, a holder's hold)."""

    def __init__(self, route: IPCRoute, rank: int, group=None, staging: IpcStaging | None = None) -> None:
        self.route, self.rank, self.group = route, rank, group
        self.staging = staging if staging is not None else IpcStaging()  # a holder's copies (ipc_staging.py)
        self.shared = False  # the holders hold copies of the current publication (publisher side)

    @classmethod
    def local(cls, engine_gpus: list[list[str]], my_gpu: str) -> "IPCReplicas":
        """A publisher alone (no learner group): the engines must all sit on its GPU."""
        return cls(plan_route([my_gpu], engine_gpus), 0, None)

    @classmethod
    def connect(cls, engine_gpus: Callable[[], list[list[str]]] | None, my_gpu: str, *,
                staging: IpcStaging | None = None, publisher: int = 0) -> "IPCReplicas":
        """Plan the route over the learner's default process group (every rank calls this; only the
        publisher passes `engine_gpus`, which asks the engines).  Raises on every rank alike."""
        rank, world = dist.get_rank(), dist.get_world_size()
        gpus: list = [None] * world
        dist.all_gather_object(gpus, my_gpu)
        verdict: list = [None]
        failure = None
        if rank == publisher:
            try:
                verdict[0] = plan_route(gpus, engine_gpus(), publisher)
            except Exception as err:  # noqa: BLE001 -- every rank must hear of it, or the others wait forever
                failure, verdict[0] = err, (isinstance(err, ConfigError), str(err))
        dist.broadcast_object_list(verdict, src=publisher)
        if failure is not None:
            raise failure
        if isinstance(verdict[0], tuple):
            is_config, message = verdict[0]
            raise (ConfigError if is_config else RuntimeError)(message)
        route = verdict[0]
        group = _subgroup(route.ranks) if route.holders else None
        if rank == publisher:
            log.info("publication over CUDA IPC to %d GPU(s): copies on learner ranks %s", len(set(route.source_of)),
                     list(route.ranks))
        return cls(route, rank, group, staging)

    def share(self, meta: list, keep: list[torch.Tensor], handles: list[Handle]) -> list[Handle]:
        """Publisher: copy `keep` onto every holder's GPU and gather their handles; returns the
        union per tensor ({GPU UUID: handle} for every route GPU)."""
        if not self.route.holders:
            return handles
        src = self.route.publisher
        dist.broadcast_object_list([meta], src=src, group=self.group)
        for tensor in keep:
            _broadcast_bytes(tensor, src, self.group)
        gathered: list = [None] * len(self.route.ranks)
        dist.gather_object(None, gathered, dst=src, group=self.group)
        self.shared = True
        union = [dict(h) for h in handles]
        for part in gathered:
            for mine, theirs in zip(union, part or ()):
                mine.update(theirs)
        return union

    def abort(self) -> None:
        """Publisher: nothing will be shared this time (its source or export failed)."""
        if self.route.holders:
            dist.broadcast_object_list([None], src=self.route.publisher, group=self.group)

    def release(self) -> None:
        """Publisher: every rollout group answered; the holders may free their copies."""
        if self.shared:
            self.shared = False
            dist.broadcast_object_list(["release"], src=self.route.publisher, group=self.group)

    def hold(self) -> int:
        """Any rank but the publisher, after the source: a holder receives this publication's copy,
        exports it, sends the handles and keeps the copy until released; returns its bytes (0 for
        a rank not on the route, or when the publisher aborted)."""
        if self.rank not in self.route.holders:
            return 0
        src = self.route.publisher
        box: list = [None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        if box[0] is None:
            return 0
        keep = self.staging.place(box[0])  # the same blocks every publication (ipc_staging.py)
        for tensor in keep:
            _broadcast_bytes(tensor, src, self.group)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # every copied byte is written before an engine reads
        dist.gather_object(self.staging.handles(keep), None, dst=src, group=self.group)
        nbytes = sum(t.numel() * t.element_size() for t in keep)
        dist.broadcast_object_list(box, src=src, group=self.group)  # the release: every group answered
        del keep
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
        return nbytes


def ipc_round(recorder, deliver: Callable[[list, str, object], list], staging: IpcStaging,
              replicas: IPCReplicas) -> tuple:
    """The publisher's side of one publication: hash and export (recorder: a ManifestRecorder),
    copy to the holders, `deliver(meta, pickled handles, manifest)` to every rollout group (their
    answers), then release every copy.  Returns (manifest, answers)."""
    try:
        meta, handles, keep = export_ipc_handles(recorder, staging)
    except BaseException:
        replicas.abort()  # the holders are waiting for this publication's copy
        raise
    manifest = recorder.manifest()
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()  # every exported byte is written
    try:
        handles = replicas.share(meta, keep, handles)
        return manifest, deliver(meta, pickle_handles(handles), manifest)
    finally:
        replicas.release()
        del keep
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # release what the engines opened and closed
