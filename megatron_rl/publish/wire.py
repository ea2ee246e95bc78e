"""The gloo wire protocol for weight publication (CPU path; GPU uses vLLM's NCCL backend).

    pg = open_group("127.0.0.1", port, rank=0, world_size=1 + n_rollout_workers)
    manifest = send_publication(pg, version=3, tensors=groups_of_name_tensor_pairs)   # rank 0
    staging = StagingBuffers()                                                         # kept across versions
    received = receive_publication(pg, staging)                                        # ranks 1..n

Rank 0 is the trainer; every rollout worker process (each TP rank of each rollout group)
is another rank and receives every byte.  A publication is a sequence of broadcasts:

    first:       control int64[4] = [BEGIN, header_len, 0, 0], JSON {"version", "algo"}
    per bucket:  control [BUCKET, 0, nbytes, n_parts], part sizes int64[n_parts], each part
    at the end:  control [END, header_len, 0, 0], the PublicationManifest as JSON (every
                 bucket's tensors -- names, shapes, dtypes, offsets -- and checksum)
    on failure:  control [ABORT, header_len, 0, 0], the error text (the trainer's source raised)

Zero copy on both sides and no stall between buckets: the trainer broadcasts each tensor
from where it lies (one part per tensor) while a helper thread hashes the same bytes, and
moves on to the next bucket without waiting for the digest, which travels in the final
manifest; receivers take each part straight into its slice of a staging buffer (reused
from one publication to the next) and a helper thread hashes each part as soon as it has
landed, while the following parts arrive.  At END a receiver accepts the publication only
if every bucket's size, part sizes and digest match the manifest.  Tensors are pulled from
the trainer's iterator on the calling thread only, so a source that gathers with
collectives (Megatron TP/PP) keeps its collectives on one thread.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rl.platform.listen import joining_store, listening_store, pin_gloo
from megatron_rl.publish.checksum import CHECKSUMS, DEFAULT_CHECKSUM, byte_view, checksum_parts, new_hasher
from megatron_rl.publish.manifest import (
    DEFAULT_BUCKET_BYTES,
    BucketSpec,
    PublicationManifest,
    flatten_groups,
    pack_bucket,
    plan_buckets,
    tensor_specs,
    unpack_bucket,
)

log = logging.getLogger(__name__)

BEGIN, BUCKET, END, ABORT = 0, 1, 2, 3
STORE_PREFIX = "megatron_rl_publish"
MAX_BUCKETS_IN_FLIGHT = 2  # queued on the trainer beyond the one being filled (memory bound)
HASH_THREAD_NICE = 10  # added to the hashing threads' nice value (Linux; see _yield_to_transfer)


def _yield_to_transfer() -> None:
    """Initializer of the hashing threads: lower their CPU priority (Linux nice is per thread).

    Moving the bytes is the critical path; hashing can fill whatever CPU time the transfer
    leaves idle and catch up at the end.  Where cores are scarce, hashing at equal priority
    preempts gloo's send and receive threads and stretches the whole publication: on 2 cores,
    nice 10 took the median publish/raw ratio from 1.60 to about 1.45 (bench_publish.py).
    Nice 10 still leaves the threads a share of a busy core, so a publication is never
    starved behind unrelated work.
    """
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + HASH_THREAD_NICE))
    except OSError as err:  # raising nice is always allowed; a sandbox may still refuse it
        log.debug("hash thread keeps its priority: %s", err)


def host_store(host: str, world_size: int, timeout_s: float = 600.0, port: int = 0) -> dist.TCPStore:
    """Rank 0's TCPStore, listening on `host` alone (never every interface: platform/listen.py) before
    anyone is told its port (`store.port`).  Port 0 lets the OS pick a free one while binding it, so no
    other process can take it in between (a port probed free and bound later can be)."""
    return listening_store(host, world_size, timeout_s, port=port)


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0, store: dist.TCPStore | None = None
) -> dist.ProcessGroupGloo:
    """Join the publication group: rank 0 hosts the TCPStore (`store`, from host_store, or one
    made here), everyone builds a gloo group."""
    if not 0 <= rank < world_size:
        raise ValueError(f"publication rank {rank} is outside world_size {world_size}")
    pin_gloo(host)  # gloo's sockets on the interface of the trainer's address when it is on this node
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None and rank == 0:
        store = listening_store(host, world_size, timeout_s, port=port)
    elif store is None:
        store = joining_store(host, port, world_size, timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)


def _ibcast(pg: dist.ProcessGroupGloo, tensors: list[torch.Tensor]) -> list:
    """Queue a broadcast from rank 0 of each non-empty tensor; returns the works (gloo runs
    them in order, with no Python round trip between them).  Keep the tensors alive until
    every work is waited for."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return [pg.broadcast([t], opts) for t in tensors if t.numel()]


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _bcast(pg: dist.ProcessGroupGloo, tensor: torch.Tensor) -> None:
    _wait(_ibcast(pg, [tensor]))


def _send_control(pg, kind: int, header: dict | str | None, nbytes: int = 0, n_parts: int = 0) -> None:
    raw = b"" if header is None else json.dumps(header).encode()
    _bcast(pg, torch.tensor([kind, len(raw), nbytes, n_parts], dtype=torch.int64))
    _bcast(pg, torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8))


def send_publication(
    pg: dist.ProcessGroupGloo,
    version: int,
    tensors: Iterable,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    checksum_algo: str = DEFAULT_CHECKSUM,
    fault_hook: Callable[[BucketSpec, torch.Tensor], None] | None = None,
) -> PublicationManifest:
    """Broadcast every tensor from rank 0 in checksummed buckets; returns the manifest.

    `tensors`: (hf_name, full_tensor) pairs, or groups (lists) of them, e.g. one per layer.
    `fault_hook(spec, buf)` gets a packed copy of each bucket after checksumming and before
    sending (then the copy is sent): tests use it to corrupt a bucket on the wire.  If
    `tensors` raises, receivers get ABORT and the error propagates here.
    """
    new_hasher(checksum_algo)  # an unknown algorithm fails before anything is sent
    layouts: list[tuple[tuple, int]] = []
    digests: list[Future] = []
    in_flight: collections.deque = collections.deque()  # (works, tensors they read) per bucket
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-hash",
                            initializer=_yield_to_transfer) as pool:
        try:
            _send_control(pg, BEGIN, {"version": version, "algo": checksum_algo})
            for items in plan_buckets(flatten_groups(tensors), bucket_bytes):
                tensor_list, nbytes = tensor_specs(items)
                parts = [byte_view(t) for _, t in items]  # [nbytes_i] uint8 views of the tensors themselves
                digests.append(pool.submit(checksum_parts, parts, checksum_algo))  # overlaps the sends
                if fault_hook is not None:
                    spec, buf = pack_bucket(len(layouts), items, checksum_algo)
                    fault_hook(spec, buf)
                    parts = [buf[t.offset : t.offset + t.nbytes] for t in tensor_list]
                control = torch.tensor([BUCKET, 0, nbytes, len(parts)], dtype=torch.int64)
                sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64)
                # Queued, not waited for: the next bucket's messages follow without draining the link.
                in_flight.append((_ibcast(pg, [control, sizes, *parts]), [control, sizes, *parts]))
                layouts.append((tensor_list, nbytes))
                while len(in_flight) > MAX_BUCKETS_IN_FLIGHT:
                    _wait(in_flight.popleft()[0])
            while in_flight:
                _wait(in_flight.popleft()[0])
            buckets = tuple(BucketSpec(i, tensor_list, nbytes, digest.result())
                            for i, ((tensor_list, nbytes), digest) in enumerate(zip(layouts, digests)))
        except Exception as err:
            _send_control(pg, ABORT, f"trainer failed while publishing version {version}: {err!r}")
            raise
    manifest = PublicationManifest(version=version, checksum_algo=checksum_algo, buckets=buckets)
    _send_control(pg, END, manifest.to_dict())
    log.info("published version %d: %d buckets, %.1f MB", version, len(buckets), manifest.nbytes / 1e6)
    return manifest


class StagingBuffers:
    """Receive buffers kept from one publication to the next (one per bucket index).

    Reusing them spares the page faults of fresh memory on every publication.  The tensors
    of a ReceivedPublication are views into these buffers: load (copy) them before the
    next receive_publication with the same StagingBuffers.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8))
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffers[index][:nbytes]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers)


@dataclass
class ReceivedPublication:
    """What a receiver got: the manifest, the tensors (views into staging buffers), and the
    first error (None when every bucket verified and matched the manifest)."""

    manifest: PublicationManifest | None
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    error: str | None = None
    bad_bucket: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def receive_publication(pg: dist.ProcessGroupGloo, staging: StagingBuffers | None = None) -> ReceivedPublication:
    """Receive one publication on a non-zero rank; never raises for bad data, reports it.

    Each bucket is hashed as soon as it has arrived; the result is `ok` only if the final
    manifest lists exactly the buckets received (sizes and part sizes) and every digest
    matches it.
    """
    staging = staging if staging is not None else StagingBuffers()
    received: list[tuple[torch.Tensor | None, list[int]]] = []  # (bucket bytes or None, part sizes)
    digests: list[Future | None] = []
    begin: dict | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-verify",
                            initializer=_yield_to_transfer) as pool:
        while True:
            control = torch.empty(4, dtype=torch.int64)
            _bcast(pg, control)
            kind, header_len, nbytes, n_parts = (int(x) for x in control)
            header = _receive_header(pg, header_len)
            if kind == BUCKET:
                sizes = torch.empty(n_parts, dtype=torch.int64)
                _bcast(pg, sizes)
                sizes = sizes.tolist()
                buf, works = _receive_parts(pg, staging.get(len(received), nbytes), sizes)
                received.append((buf, sizes))
                algo = begin.get("algo") if isinstance(begin, dict) else None
                ok = buf is not None and algo in CHECKSUMS
                # The helper thread hashes each part as it lands, while the rest keep arriving.
                digests.append(pool.submit(_hash_on_arrival, works, torch.split(buf, sizes), algo) if ok else None)
                if not ok:
                    _wait(works)
            elif kind == BEGIN:
                begin = header
            elif kind == ABORT:
                return ReceivedPublication(None, error=str(header))
            elif kind == END:
                break
            else:
                # Unknown kind: the stream is unreadable, sizes included; give up on it.
                return ReceivedPublication(None, error=f"unknown publication message kind {kind}")
        got = [None if d is None else d.result() for d in digests]
    if not isinstance(begin, dict) or not isinstance(header, dict):
        return ReceivedPublication(None, error="unreadable publication header or final manifest")
    try:
        manifest = PublicationManifest.from_dict(header)
    except ValueError as err:
        return ReceivedPublication(None, error=str(err))
    if manifest.version != begin.get("version") or manifest.checksum_algo != begin.get("algo"):
        return ReceivedPublication(manifest, error=f"manifest (version {manifest.version}, {manifest.checksum_algo}) "
                                                   f"disagrees with the announced {begin}")
    return _check(manifest, received, got)


def _receive_header(pg, header_len: int):
    """The JSON that follows a control message (None when empty or unreadable)."""
    blob = torch.empty(header_len, dtype=torch.uint8)
    _bcast(pg, blob)
    if not header_len:
        return None
    try:
        return json.loads(bytes(blob.numpy()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def _receive_parts(pg, buf: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor | None, list]:
    """Queue the receives of a bucket's parts back to back into `buf`: (buf, works), or
    (None, works) into scratch memory when the sizes disagree (the stream stays in step)."""
    if min(sizes, default=0) >= 0 and sum(sizes) == buf.numel():
        return buf, _ibcast(pg, list(torch.split(buf, sizes)))
    return None, _ibcast(pg, [torch.empty(max(size, 0), dtype=torch.uint8) for size in sizes])


def _hash_on_arrival(works: list, parts: tuple[torch.Tensor, ...], algo: str) -> str:
    """Checksum of a bucket's `parts`, each hashed as soon as its broadcast has landed, while
    its bytes are still in cache (`works`: one per non-empty part, in order, as _ibcast
    returns them)."""
    hasher = new_hasher(algo)
    pending = iter(works)
    for part in parts:
        if part.numel():
            next(pending).wait()
        hasher.update(part)
    return hasher.hexdigest()


def _check(manifest: PublicationManifest, received: list, digests: list) -> ReceivedPublication:
    """Accept only if the received buckets are exactly the manifest's, byte for byte."""
    if len(received) != len(manifest.buckets):
        n = min(len(received), len(manifest.buckets))
        return ReceivedPublication(manifest, bad_bucket=n, error=f"bucket {n}: {len(received)} buckets received, "
                                                                 f"the manifest lists {len(manifest.buckets)}")
    for spec, (buf, sizes), digest in zip(manifest.buckets, received, digests):
        problem = None
        if buf is None or buf.numel() != spec.nbytes or sizes != [t.nbytes for t in spec.tensors]:
            problem = f"{spec.describe()}: received sizes disagree with the manifest"
        elif digest != spec.checksum:
            problem = f"{spec.describe()}: {manifest.checksum_algo} mismatch (expected {spec.checksum}, got {digest})"
        if problem is not None:
            log.warning("publication version %d refused: %s", manifest.version, problem)
            return ReceivedPublication(manifest, error=problem, bad_bucket=spec.index)
    tensors = [pair for spec, (buf, _) in zip(manifest.buckets, received) for pair in unpack_bucket(spec, buf)]
    return ReceivedPublication(manifest, tensors=tensors)
