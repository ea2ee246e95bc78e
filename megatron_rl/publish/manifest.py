"""The publication manifest: what one weight publication contains, and how it is checked.

    from megatron_rl.publish.manifest import plan_buckets, pack_bucket, PublicationManifest

A publication is a policy `version` plus a list of buckets.  A bucket is a contiguous
byte buffer holding several whole tensors (HF names, full shapes) back to back, with a
checksum over its bytes.  The trainer fills buckets in the order its tensors arrive
(`plan_buckets`), the rollout side receives each bucket into one flat buffer, recomputes
the checksum and only commits the version when every bucket matched.  Both sides build
the same immutable `PublicationManifest`; it serialises to plain dicts for RPC/JSON.

Checksums: "crc32" (zlib, default; ~2x faster than sha256 here and enough for detecting
transport corruption) or "sha256" (when a cryptographic digest is wanted).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

CHECKSUMS = ("crc32", "sha256")
DEFAULT_BUCKET_BYTES = 64 * 2**20


class PublicationError(RuntimeError):
    """A publication was refused; the message names the bucket (index and tensors)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor inside a bucket: HF name, full shape, dtype name, byte offset/size."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketSpec:
    """One contiguous buffer of tensors and its checksum (hex string)."""

    index: int
    tensors: tuple[TensorSpec, ...]
    nbytes: int
    checksum: str

    def describe(self) -> str:
        names = [t.name for t in self.tensors]
        span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
        return f"bucket {self.index} ({len(names)} tensors: {span})"


@dataclass(frozen=True)
class PublicationManifest:
    """Immutable record of one publication: version, checksum algorithm, buckets."""

    version: int
    checksum_algo: str
    buckets: tuple[BucketSpec, ...]

    def __post_init__(self):
        if self.checksum_algo not in CHECKSUMS:
            raise ValueError(f"checksum_algo {self.checksum_algo!r} is not one of {list(CHECKSUMS)}")
        if self.version < 0:
            raise ValueError(f"version must be >= 0, got {self.version}")
        if [b.index for b in self.buckets] != list(range(len(self.buckets))):
            raise ValueError("bucket indices must be 0..n-1 in order")

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for b in self.buckets for t in b.tensors]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "checksum_algo": self.checksum_algo,
            "buckets": [bucket_to_dict(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, data: dict) -> PublicationManifest:
        try:
            buckets = tuple(bucket_from_dict(b) for b in data["buckets"])
            return cls(version=int(data["version"]), checksum_algo=data["checksum_algo"], buckets=buckets)
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed publication manifest: {err!r}") from None


def bucket_to_dict(b: BucketSpec) -> dict:
    return {
        "index": b.index,
        "nbytes": b.nbytes,
        "checksum": b.checksum,
        "tensors": [[t.name, list(t.shape), t.dtype, t.offset, t.nbytes] for t in b.tensors],
    }


def bucket_from_dict(d: dict) -> BucketSpec:
    tensors = tuple(TensorSpec(n, tuple(s), dt, int(o), int(nb)) for n, s, dt, o, nb in d["tensors"])
    return BucketSpec(index=int(d["index"]), tensors=tensors, nbytes=int(d["nbytes"]), checksum=str(d["checksum"]))


def checksum(buf: torch.Tensor, algo: str) -> str:
    """Checksum of a contiguous CPU uint8 tensor's bytes (hex)."""
    view = memoryview(buf.numpy())
    if algo == "crc32":
        return f"{zlib.crc32(view):08x}"
    if algo == "sha256":
        return hashlib.sha256(view).hexdigest()
    raise ValueError(f"checksum algorithm {algo!r} is not one of {list(CHECKSUMS)}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in publication manifest")
    return dtype


def flatten_groups(groups: Iterable) -> Iterator[tuple[str, torch.Tensor]]:
    """Accept an iterable of (name, tensor) pairs or of groups (lists) of such pairs."""
    for item in groups:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        else:
            yield from item


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors, in arrival order, into lists of at most `bucket_bytes` bytes.

    A tensor bigger than `bucket_bytes` gets a bucket of its own.  Lazy: it pulls the
    next tensor only when the current bucket is full, so a trainer can gather per layer.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one publication")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        yield current


def pack_bucket(index: int, items: list[tuple[str, torch.Tensor]], algo: str) -> tuple[BucketSpec, torch.Tensor]:
    """Copy `items` into one flat uint8 CPU buffer; returns (spec with checksum, buffer [nbytes])."""
    specs, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, tuple(t.shape), dtype_name(t.dtype), offset, nbytes))
        offset += nbytes
    buf = torch.empty(offset, dtype=torch.uint8)
    for spec, (_, t) in zip(specs, items):
        src = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        buf[spec.offset : spec.offset + spec.nbytes].copy_(src)
    return BucketSpec(index, tuple(specs), offset, checksum(buf, algo)), buf


def unpack_bucket(spec: BucketSpec, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` [nbytes] as the named tensors of `spec` (no copy)."""
    if buf.numel() != spec.nbytes:
        raise PublicationError(f"{spec.describe()}: got {buf.numel()} bytes, manifest says {spec.nbytes}")
    out = []
    for t in spec.tensors:
        dtype = to_dtype(t.dtype)
        out.append((t.name, buf[t.offset : t.offset + t.nbytes].view(dtype).view(t.shape)))
    return out


def verify_bucket(spec: BucketSpec, buf: torch.Tensor, algo: str) -> str | None:
    """None if `buf` matches the spec's checksum, else a message naming the bucket."""
    got = checksum(buf, algo)
    if got != spec.checksum:
        return f"{spec.describe()}: {algo} mismatch (expected {spec.checksum}, got {got})"
    return None
