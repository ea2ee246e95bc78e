"""The publication manifest: what one weight publication contains, and how it is checked.

    from megatron_rl.publish.manifest import plan_buckets, pack_bucket, PublicationManifest

A publication is a policy `version` plus a list of buckets.  A bucket is a contiguous
byte buffer holding several whole tensors (HF names, full shapes) back to back, with a
checksum over its bytes.  The trainer fills buckets in the order its tensors arrive
(`plan_buckets`), the rollout side receives each bucket into one flat buffer, recomputes
the checksum and only commits the version when every bucket matched.  Both sides build
the same immutable `PublicationManifest`; it serialises to plain dicts for RPC/JSON, and
`from_dict` checks plain data fully (ManifestError naming the field) before anything trusts it.

Checksums (megatron_rl/publish/checksum.py: "blocksum" by default, or "blake3") are computed over a bucket's tensors in order, where they lie.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megatron_rl.publish.checksum import (CHECKSUMS, DEFAULT_CHECKSUM, byte_view, checksum_parts, new_hasher,
                                          raw_bytes)

DEFAULT_BUCKET_BYTES = 64 * 2**20


class PublicationError(RuntimeError):
    """A publication was refused; the message names the bucket (index and tensors)."""


class ManifestError(ValueError):
    """A manifest (as plain data, from the wire or RPC) that is malformed; the message names the field."""


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

    def digest(self) -> str:
        """The publication's identity (16 hex): a hash over its algorithm and every bucket's layout and
        checksum.  Trainer and engines compute it from the same manifest; a trajectory's tokens carry
        the digest of the weights that sampled them (trajectory.Trajectory.weights)."""
        import hashlib

        h = hashlib.sha256(self.checksum_algo.encode())
        for b in self.buckets:
            h.update(json.dumps(bucket_to_dict(b), sort_keys=True).encode())
        return h.hexdigest()[:16]

    def coverage_problem(self, expected: dict[str, tuple[int, ...]]) -> str | None:
        """None if the publication holds exactly the `expected` tensors (HF name -> shape), else
        what is missing, extra or misshapen (a partial model must never be committed)."""
        got = {t.name: t.shape for b in self.buckets for t in b.tensors}
        missing = sorted(set(expected) - set(got))
        if missing:
            return f"version {self.version} is missing {len(missing)} of the model's tensors, e.g. {missing[0]!r}"
        extra = sorted(set(got) - set(expected))
        if extra:
            return f"version {self.version} has {len(extra)} tensors the model does not have, e.g. {extra[0]!r}"
        for name, shape in expected.items():
            if tuple(got[name]) != tuple(shape):
                return f"version {self.version}: {name} has shape {tuple(got[name])}, the model's is {tuple(shape)}"
        return None

    @property
    def dtypes(self) -> list[str]:
        """The dtype names the publication's tensors carry (each tensor's is in its TensorSpec)."""
        return sorted({t.dtype for b in self.buckets for t in b.tensors})

    def dtype_problem(self, expected: str) -> str | None:
        """None if every tensor is in the engine's dtype `expected` (a dtype name, e.g. "bfloat16"),
        else the first one that is not: loading it would cast silently, and the bytes checked
        would not be the bytes served."""
        for b in self.buckets:
            for t in b.tensors:
                if t.dtype != expected:
                    return (f"version {self.version}: {t.name} is {t.dtype}, the engine serves {expected} "
                            f"(the trainer must publish in the engine's dtype)")
        return None

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "checksum_algo": self.checksum_algo,
            "buckets": [bucket_to_dict(b) for b in self.buckets],
        }

    @classmethod
    def from_dict(cls, data: dict) -> PublicationManifest:
        """Parse and check plain data (to_dict's shape); ManifestError names the first bad field.

        Beyond types: each tensor's nbytes matches its shape and dtype, tensors lie back to back
        from offset 0, a bucket's nbytes is their sum, and no name appears twice, so unpacking a
        buffer of the announced size can never fail."""
        if not isinstance(data, dict):
            raise ManifestError(f"malformed publication manifest: expected a mapping, got {type(data).__name__}")
        version = _field(data, "version", int, "manifest")
        algo = _field(data, "checksum_algo", str, "manifest")
        if version < 0 or algo not in CHECKSUMS:
            raise ManifestError(f"malformed publication manifest: version {version} (must be >= 0) or "
                                f"checksum_algo {algo!r} (one of {list(CHECKSUMS)})")
        raw = _field(data, "buckets", list, "manifest")
        buckets = tuple(bucket_from_dict(b, where=f"buckets[{i}]") for i, b in enumerate(raw))
        names = [t.name for b in buckets for t in b.tensors]
        if len(set(names)) != len(names):
            raise ManifestError("malformed publication manifest: a tensor name appears twice")
        try:
            return cls(version=version, checksum_algo=algo, buckets=buckets)
        except ValueError as err:
            raise ManifestError(f"malformed publication manifest: {err}") from None


def bucket_to_dict(b: BucketSpec) -> dict:
    return {
        "index": b.index,
        "nbytes": b.nbytes,
        "checksum": b.checksum,
        "tensors": [[t.name, list(t.shape), t.dtype, t.offset, t.nbytes] for t in b.tensors],
    }


def _field(d: dict, key: str, kind: type, where: str):
    value = d.get(key) if isinstance(d, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ManifestError(f"malformed publication manifest: {where}.{key} must be {kind.__name__}, "
                            f"got {type(value).__name__}")
    return value


def _tensor_from_list(item, offset: int, where: str) -> TensorSpec:
    if not isinstance(item, (list, tuple)) or len(item) != 5:
        raise ManifestError(f"malformed publication manifest: {where} must be [name, shape, dtype, offset, nbytes]")
    name, shape, dtype, start, nbytes = item
    if not isinstance(name, str) or not name:
        raise ManifestError(f"malformed publication manifest: {where}: name must be a non-empty str")
    if not isinstance(shape, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                       for x in shape):
        raise ManifestError(f"malformed publication manifest: {where} ({name}): shape must be a list of ints >= 0")
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ManifestError(f"malformed publication manifest: {where} ({name}): unknown dtype {dtype!r}")
    expected = math.prod(shape) * getattr(torch, dtype).itemsize
    if start != offset or nbytes != expected or isinstance(start, bool) or isinstance(nbytes, bool):
        raise ManifestError(f"malformed publication manifest: {where} ({name}): offset {start!r} / nbytes "
                            f"{nbytes!r}, expected {offset} / {expected} for shape {list(shape)} {dtype}")
    return TensorSpec(name, tuple(shape), dtype, offset, expected)


def bucket_from_dict(d: dict, where: str = "bucket") -> BucketSpec:
    """Parse one bucket (bucket_to_dict's shape); ManifestError names the bad field."""
    index = _field(d, "index", int, where)
    nbytes = _field(d, "nbytes", int, where)
    digest = _field(d, "checksum", str, where)
    tensors, offset = [], 0
    for i, item in enumerate(_field(d, "tensors", list, where)):
        tensors.append(_tensor_from_list(item, offset, f"{where}.tensors[{i}]"))
        offset += tensors[-1].nbytes
    if nbytes != offset:
        raise ManifestError(f"malformed publication manifest: {where}.nbytes is {nbytes}, its tensors hold {offset}")
    return BucketSpec(index=index, tensors=tuple(tensors), nbytes=nbytes, checksum=digest)


def checksum(spec_tensors: Iterable[TensorSpec], buf: torch.Tensor, algo: str) -> str:
    """Checksum (hex) of a packed bucket `buf` [nbytes] whose tensors lie as `spec_tensors` say."""
    return checksum_parts([buf[t.offset : t.offset + t.nbytes] for t in spec_tensors], algo)


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


def tensor_specs(items: list[tuple[str, torch.Tensor]]) -> tuple[tuple[TensorSpec, ...], int]:
    """Where each of `items` lies in its bucket, back to back; returns (specs, bucket nbytes)."""
    specs, offset = [], 0
    for name, t in items:
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(name, tuple(t.shape), dtype_name(t.dtype), offset, nbytes))
        offset += nbytes
    return tuple(specs), offset


def pack_bucket(index: int, items: list[tuple[str, torch.Tensor]], algo: str) -> tuple[BucketSpec, torch.Tensor]:
    """Copy `items` into one flat uint8 CPU buffer; returns (spec with checksum, buffer [nbytes])."""
    specs, nbytes = tensor_specs(items)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    for spec, (_, t) in zip(specs, items):
        buf[spec.offset : spec.offset + spec.nbytes].copy_(byte_view(t))
    return BucketSpec(index, specs, nbytes, checksum(specs, buf, algo)), buf


def unpack_bucket(spec: BucketSpec, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views into `buf` [nbytes] as the named tensors of `spec` (no copy)."""
    if buf.numel() != spec.nbytes:
        raise PublicationError(f"{spec.describe()}: got {buf.numel()} bytes, manifest says {spec.nbytes}")
    out = []
    for t in spec.tensors:
        dtype = to_dtype(t.dtype)
        out.append((t.name, buf[t.offset : t.offset + t.nbytes].view(dtype).view(t.shape)))
    return out


class ManifestRecorder:
    """Pass (name, tensor) pairs through unchanged while recording the manifest of what passed.

        recorder = ManifestRecorder(pairs, version=4)
        send_somehow(iter(recorder))          # e.g. vLLM's packed NCCL producer
        manifest = recorder.manifest()        # complete once the iteration is

    For transports that carry tensors but no manifest (vLLM's NCCL backend): the manifest
    then travels separately, and receivers check what they staged with `verify_tensors`.
    Tensors are grouped as `plan_buckets` groups them and hashed on their own device, so a
    bucket's tensors are held (at most `bucket_bytes`) until the bucket is full.
    `fault_hook(spec, buf)`, as in wire.send_publication, gets a packed CPU copy of each
    bucket after hashing; the tensors passed on are then views of that copy (tests corrupt
    bytes that way).
    """

    def __init__(self, pairs: Iterable, version: int, *, checksum_algo: str = DEFAULT_CHECKSUM,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, fault_hook=None) -> None:
        new_hasher(checksum_algo)  # an unknown algorithm fails here
        self._pairs, self.version, self.checksum_algo = pairs, version, checksum_algo
        self.bucket_bytes, self.fault_hook = bucket_bytes, fault_hook
        self._buckets: list[BucketSpec] = []
        self._done = False

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for items in plan_buckets(flatten_groups(self._pairs), self.bucket_bytes):
            specs, nbytes = tensor_specs(items)
            digest = checksum_parts([raw_bytes(t) for _, t in items], self.checksum_algo)
            spec = BucketSpec(len(self._buckets), specs, nbytes, digest)
            self._buckets.append(spec)
            if self.fault_hook is not None:
                device = items[0][1].device
                _, buf = pack_bucket(spec.index, items, self.checksum_algo)
                self.fault_hook(spec, buf)
                items = [(name, t.to(device)) for name, t in unpack_bucket(spec, buf)]
                if device.type == "cuda":
                    torch.cuda.synchronize()  # the copies are complete before anyone packs them
            yield from items
        self._done = True

    def manifest(self) -> PublicationManifest:
        if not self._done:
            raise RuntimeError("the manifest is known only after every tensor has passed")
        return PublicationManifest(self.version, self.checksum_algo, tuple(self._buckets))


def verify_tensors(
    manifest: PublicationManifest, tensors: list[tuple[str, torch.Tensor]]
) -> tuple[str | None, int | None]:
    """Check received (name, tensor) pairs against a manifest that travelled separately.

    Returns (None, None) when they are exactly the manifest's tensors -- same names in the
    same order, shapes, dtypes -- and every bucket's checksum matches; else (problem, index
    of the first bad bucket).
    """
    got = iter(tensors)
    for spec in manifest.buckets:
        parts = []
        for t in spec.tensors:
            pair = next(got, None)
            if pair is None:
                return f"{spec.describe()}: {t.name} never arrived", spec.index
            name, tensor = pair
            if name != t.name or tuple(tensor.shape) != tuple(t.shape) or dtype_name(tensor.dtype) != t.dtype:
                return (f"{spec.describe()}: expected {t.name} {list(t.shape)} {t.dtype}, received {name} "
                        f"{list(tensor.shape)} {dtype_name(tensor.dtype)}"), spec.index
            parts.append(raw_bytes(tensor))
        digest = checksum_parts(parts, manifest.checksum_algo)
        if digest != spec.checksum:
            return (f"{spec.describe()}: {manifest.checksum_algo} mismatch (expected {spec.checksum}, "
                    f"got {digest})"), spec.index
    extra = next(got, None)
    if extra is not None:
        count = len(manifest.tensor_names)
        return f"received {extra[0]} and more beyond the manifest's {count} tensors", len(manifest.buckets)
    return None, None
