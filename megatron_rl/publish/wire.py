"""The gloo wire protocol for weight publication (CPU path; GPU uses vLLM's NCCL backend).

    pg = open_group("127.0.0.1", port, rank=0, world_size=1 + n_rollout_workers)
    manifest = send_publication(pg, version=3, tensors=groups_of_name_tensor_pairs)   # rank 0
    staging = StagingBuffers()                                                         # kept across versions
    received = receive_publication(pg, staging)                                        # ranks 1..n

Rank 0 is the trainer; every rollout worker process (each TP rank of each rollout group)
is another rank and receives every byte.  A publication is a sequence of broadcasts:

    per bucket:  control int64[4] = [BUCKET, header_len, nbytes, n_parts], header JSON,
                 part sizes int64[n_parts], each part's bytes, checksum trailer uint8[64]
    at the end:  control [END, header_len, 0, 0], the full PublicationManifest as JSON
    on failure:  control [ABORT, header_len, 0, 0], the error text (the trainer's source raised)

Zero copy on both sides: the trainer broadcasts each tensor from where it lies (one part
per tensor) while a helper thread hashes the same bytes, and sends the digest as the
bucket's trailer; receivers take each part straight into its slice of a staging buffer,
reused from one publication to the next, and verify bucket k on a helper thread while
bucket k+1 arrives.  The part sizes travel as their own int64 message, so a receiver can
drain a bucket whose JSON header arrived unreadable.  Tensors are pulled from the
trainer's iterator on the calling thread only, so a source that gathers with collectives
(Megatron TP/PP) keeps its collectives on one thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_rl.publish.manifest import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHECKSUM,
    BucketSpec,
    PublicationManifest,
    bucket_from_dict,
    bucket_to_dict,
    byte_view,
    checksum_parts,
    flatten_groups,
    new_hasher,
    pack_bucket,
    plan_buckets,
    tensor_specs,
    unpack_bucket,
    verify_bucket,
)

log = logging.getLogger(__name__)

BUCKET, END, ABORT = 1, 2, 3
STORE_PREFIX = "megatron_rl_publish"
TRAILER_BYTES = 64  # the hex digest, ASCII, zero-padded


def open_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float = 600.0
) -> dist.ProcessGroupGloo:
    """Join the publication group: rank 0 hosts the TCPStore, everyone builds a gloo group."""
    if not 0 <= rank < world_size:
        raise ValueError(f"publication rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), wait_for_workers=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(STORE_PREFIX, store), rank, world_size, timeout)


def _bcast(pg: dist.ProcessGroupGloo, tensor: torch.Tensor) -> None:
    _bcast_many(pg, [tensor])


def _bcast_many(pg: dist.ProcessGroupGloo, tensors: list[torch.Tensor]) -> None:
    """Broadcast each tensor from rank 0, all queued at once (gloo runs them in order, with no
    Python round trip between them), then wait for all."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    works = [pg.broadcast([t], opts) for t in tensors if t.numel()]
    for work in works:
        work.wait()


def _send_control(pg, kind: int, header: dict | str, nbytes: int = 0, n_parts: int = 0) -> None:
    blob = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    _bcast(pg, torch.tensor([kind, blob.numel(), nbytes, n_parts], dtype=torch.int64))
    _bcast(pg, blob)


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
    specs: list[BucketSpec] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-hash") as pool:
        try:
            for items in plan_buckets(flatten_groups(tensors), bucket_bytes):
                specs.append(_send_bucket(pg, len(specs), items, checksum_algo, pool, fault_hook))
        except Exception as err:
            _send_control(pg, ABORT, f"trainer failed while publishing version {version}: {err!r}")
            raise
    manifest = PublicationManifest(version=version, checksum_algo=checksum_algo, buckets=tuple(specs))
    _send_control(pg, END, manifest.to_dict())
    log.info("published version %d: %d buckets, %.1f MB", version, len(specs), manifest.nbytes / 1e6)
    return manifest


def _send_bucket(pg, index: int, items: list, algo: str, pool: ThreadPoolExecutor, fault_hook) -> BucketSpec:
    tensor_list, nbytes = tensor_specs(items)
    parts = [byte_view(t) for _, t in items]  # [nbytes_i] uint8 views of the tensors themselves
    digest = pool.submit(checksum_parts, parts, algo)  # hashing overlaps the sends below
    if fault_hook is not None:
        spec, buf = pack_bucket(index, items, algo)
        fault_hook(spec, buf)
        parts = [buf[t.offset : t.offset + t.nbytes] for t in tensor_list]
    header = {"algo": algo, **bucket_to_dict(BucketSpec(index, tensor_list, nbytes, ""))}
    _send_control(pg, BUCKET, header, nbytes, len(parts))
    _bcast(pg, torch.tensor([p.numel() for p in parts], dtype=torch.int64))
    _bcast_many(pg, parts)
    spec = BucketSpec(index, tensor_list, nbytes, digest.result())
    _bcast(pg, _trailer(spec.checksum))
    return spec


def _trailer(digest: str) -> torch.Tensor:
    out = torch.zeros(TRAILER_BYTES, dtype=torch.uint8)
    raw = digest.encode()[:TRAILER_BYTES]
    out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


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

    Buckets are verified as they arrive; the result is `ok` only if every bucket's
    checksum matched and the final manifest lists exactly the buckets received.
    """
    staging = staging if staging is not None else StagingBuffers()
    specs: list[BucketSpec] = []
    buffers: list[torch.Tensor] = []
    checks: list[Future] = []
    first_error: tuple[str, int | None] | None = None  # keep draining the stream after one
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-verify") as pool:
        while True:
            control = torch.empty(4, dtype=torch.int64)
            _bcast(pg, control)
            kind, header_len, nbytes, n_parts = (int(x) for x in control)
            blob = torch.empty(header_len, dtype=torch.uint8)
            _bcast(pg, blob)
            try:
                header = json.loads(bytes(blob.numpy()).decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                header = None
                first_error = first_error or (f"unreadable header of message {len(specs)}: {err}", len(specs))
            if kind == BUCKET:
                data = _receive_parts(pg, staging.get(len(specs), nbytes), n_parts)
                trailer = torch.empty(TRAILER_BYTES, dtype=torch.uint8)
                _bcast(pg, trailer)
                if header is None or data is None:
                    first_error = first_error or (f"bucket {len(specs)}: part sizes disagree with its size", len(specs))
                    continue
                digest = bytes(trailer.numpy()).rstrip(b"\0").decode(errors="replace")
                spec = dataclasses.replace(bucket_from_dict(header), checksum=digest)
                specs.append(spec)
                buffers.append(data)
                checks.append(pool.submit(verify_bucket, spec, data, header["algo"]))
            elif kind == ABORT:
                return ReceivedPublication(None, error=str(header))
            elif kind == END:
                break
            else:
                # Unknown kind: the stream is unreadable, sizes included; give up on it.
                return ReceivedPublication(None, error=f"unknown publication message kind {kind}")
        results = [f.result() for f in checks]
    if first_error is not None or header is None:
        msg, idx = first_error or ("unreadable final manifest", None)
        return ReceivedPublication(None, error=msg, bad_bucket=idx)
    try:
        manifest = PublicationManifest.from_dict(header)
    except ValueError as err:
        return ReceivedPublication(None, error=str(err))
    return _check(manifest, specs, buffers, results)


def _receive_parts(pg, buf: torch.Tensor, n_parts: int) -> torch.Tensor | None:
    """Receive a bucket's parts back to back into `buf`; None (after draining) if sizes disagree."""
    sizes = torch.empty(n_parts, dtype=torch.int64)
    _bcast(pg, sizes)
    fits = int(sizes.sum()) == buf.numel()
    if fits:
        _bcast_many(pg, list(torch.split(buf, sizes.tolist())))
    else:  # drain the parts into scratch memory so the stream stays in step
        _bcast_many(pg, [torch.empty(size, dtype=torch.uint8) for size in sizes.tolist()])
    return buf if fits else None
def _check(manifest, specs, buffers, results) -> ReceivedPublication:
    for spec, problem in zip(specs, results):
        if problem is not None:
            log.warning("publication version %d refused: %s", manifest.version, problem)
            return ReceivedPublication(manifest, error=problem, bad_bucket=spec.index)
    if tuple(specs) != manifest.buckets:
        n = next((i for i, (a, b) in enumerate(zip(specs, manifest.buckets)) if a != b), min(len(specs), len(manifest.buckets)))
        problem = f"bucket {n}: received bucket list disagrees with the manifest ({len(specs)} received, {len(manifest.buckets)} listed)"
        return ReceivedPublication(manifest, error=problem, bad_bucket=n)
    tensors = [pair for spec, buf in zip(specs, buffers) for pair in unpack_bucket(spec, buf)]
    return ReceivedPublication(manifest, tensors=tensors)
