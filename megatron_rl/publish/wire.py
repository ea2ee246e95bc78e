"""The gloo wire protocol for weight publication (CPU path; GPU uses vLLM's NCCL backend).

    pg = open_group("127.0.0.1", port, rank=0, world_size=1 + n_rollout_workers)
    manifest = send_publication(pg, version=3, tensors=groups_of_name_tensor_pairs)   # rank 0
    received = receive_publication(pg)                                                 # ranks 1..n

Rank 0 is the trainer; every rollout worker process (each TP rank of each rollout group)
is another rank and receives every byte.  A publication is a sequence of broadcasts:

    per bucket:  control int64[3] = [BUCKET, header_len, nbytes], header JSON, data uint8[nbytes]
    at the end:  control [END, header_len, 0], the full PublicationManifest as JSON
    on failure:  control [ABORT, header_len, 0], the error text (the trainer's source raised)

The trainer packs and checksums bucket k+1 on a helper thread while bucket k is on the
wire; receivers verify bucket k on a helper thread while bucket k+1 arrives.  Tensors are
pulled from the trainer's iterator on the calling thread only, so a source that gathers
with collectives (Megatron TP/PP) keeps its collectives on one thread.
"""

from __future__ import annotations

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
    BucketSpec,
    PublicationManifest,
    bucket_from_dict,
    bucket_to_dict,
    flatten_groups,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    verify_bucket,
)

log = logging.getLogger(__name__)

BUCKET, END, ABORT = 1, 2, 3
STORE_PREFIX = "megatron_rl_publish"


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
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def _send_message(pg, kind: int, header: dict | str, data: torch.Tensor | None = None) -> None:
    blob = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    _bcast(pg, torch.tensor([kind, blob.numel(), 0 if data is None else data.numel()], dtype=torch.int64))
    _bcast(pg, blob)
    if data is not None and data.numel():
        _bcast(pg, data)


def send_publication(
    pg: dist.ProcessGroupGloo,
    version: int,
    tensors: Iterable,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    checksum_algo: str = "crc32",
    fault_hook: Callable[[BucketSpec, torch.Tensor], None] | None = None,
) -> PublicationManifest:
    """Broadcast every tensor from rank 0 in checksummed buckets; returns the manifest.

    `tensors`: (hf_name, full_tensor) pairs, or groups (lists) of them, e.g. one per layer.
    `fault_hook(spec, buf)` runs after checksumming and before sending: tests use it to
    corrupt a bucket on the wire.  If `tensors` raises, receivers get ABORT and the
    error propagates here.
    """
    specs: list[BucketSpec] = []
    planner = plan_buckets(flatten_groups(tensors), bucket_bytes)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-pack") as pool:
        pending: Future | None = None
        try:
            for items in planner:
                nxt = pool.submit(pack_bucket, len(specs) + (pending is not None), items, checksum_algo)
                if pending is not None:
                    _send_bucket(pg, *pending.result(), checksum_algo, specs, fault_hook)
                pending = nxt
            if pending is not None:
                _send_bucket(pg, *pending.result(), checksum_algo, specs, fault_hook)
        except Exception as err:
            _send_message(pg, ABORT, f"trainer failed while publishing version {version}: {err!r}")
            raise
    manifest = PublicationManifest(version=version, checksum_algo=checksum_algo, buckets=tuple(specs))
    _send_message(pg, END, manifest.to_dict())
    log.info("published version %d: %d buckets, %.1f MB", version, len(specs), manifest.nbytes / 1e6)
    return manifest


def _send_bucket(pg, spec: BucketSpec, buf: torch.Tensor, algo: str, specs: list, fault_hook) -> None:
    if fault_hook is not None:
        fault_hook(spec, buf)
    _send_message(pg, BUCKET, {"algo": algo, **bucket_to_dict(spec)}, buf)
    specs.append(spec)


@dataclass
class ReceivedPublication:
    """What a receiver got: the manifest, the tensors (views into bucket buffers), and the
    first error (None when every bucket verified and matched the manifest)."""

    manifest: PublicationManifest | None
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    error: str | None = None
    bad_bucket: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def receive_publication(pg: dist.ProcessGroupGloo) -> ReceivedPublication:
    """Receive one publication on a non-zero rank; never raises for bad data, reports it.

    Buckets are verified as they arrive; the result is `ok` only if every bucket's
    checksum matched and the final manifest lists exactly the buckets received.
    """
    specs: list[BucketSpec] = []
    buffers: list[torch.Tensor] = []
    checks: list[Future] = []
    first_error: tuple[str, int | None] | None = None  # keep draining the stream after one
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish-verify") as pool:
        while True:
            control = torch.empty(3, dtype=torch.int64)
            _bcast(pg, control)
            kind, header_len, nbytes = (int(x) for x in control)
            blob = torch.empty(header_len, dtype=torch.uint8)
            _bcast(pg, blob)
            try:
                header = json.loads(bytes(blob.numpy()).decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                header = None
                first_error = first_error or (f"unreadable header of message {len(specs)}: {err}", len(specs))
            if kind == BUCKET:
                data = torch.empty(nbytes, dtype=torch.uint8)
                if nbytes:
                    _bcast(pg, data)
                if header is None:
                    continue
                spec = bucket_from_dict(header)
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
