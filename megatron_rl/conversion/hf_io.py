"""Hugging Face checkpoint files: validated lazy reading, sharded streaming writing, atomic dirs.

    ckpt = HFCheckpoint(model_dir, cfg)          # checks every tensor's presence and shape
    tensors = ckpt.read_group("layer.3")         # {hf_name: tensor}, read on demand
    with atomic_output_dir(out, force=False) as tmp:
        writer = HFWriter(tmp, {name: (shape, dtype), ...}); writer.add(name, t) ...; writer.close()
    # `out` appears only when the block completes; an interrupted run leaves no `out`

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints are
both read; the writer produces either, depending on `max_shard_bytes`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from megatron_rl.conversion import mapping
from megatron_rl.config import ConfigError

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _weight_files(root: Path) -> dict[str, Path]:
    """HF tensor name -> file holding it (only the file map, headers are read later)."""
    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{index}: not a valid safetensors index ({err!r})") from None
        return {name: root / fname for name, fname in weight_map.items()}
    single = root / SINGLE_NAME
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {root}")
    return {}


class HFCheckpoint:
    """The safetensors of one HF model directory, checked against `cfg` on open."""

    def __init__(self, root: str | Path, cfg) -> None:
        self.root = Path(root)
        self.cfg = cfg
        file_of = _weight_files(self.root)
        paths = sorted(set(file_of.values())) or [self.root / SINGLE_NAME]
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        shapes: dict[str, tuple] = {}
        for path in paths:
            if not path.is_file():
                raise FileNotFoundError(f"safetensors file listed in the index is missing: {path}")
            try:
                handle = safe_open(str(path), framework="pt")
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
                    self._file_of[name] = path
            except (SafetensorError, OSError, ValueError) as err:
                raise ConfigError(f"corrupt safetensors file {path}: {err}") from None
            self._handles[path] = handle
        expected = mapping.hf_shapes(cfg)
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ConfigError(f"{self.root}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
        for name, shape in expected.items():
            if shapes[name] != shape:
                raise ConfigError(f"{self.root}: tensor {name!r} has shape {shapes[name]}, config.json implies {shape}")
        extra = sorted(set(shapes) - set(expected))
        if extra:
            logger.warning("%s: ignoring %d tensors the model does not use (e.g. %s)", self.root, len(extra), extra[0])

    @property
    def files(self) -> list[Path]:
        return sorted(self._handles)

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._handles[self._file_of[name]].get_tensor(name)
        except SafetensorError as err:
            raise ConfigError(f"corrupt safetensors file {self._file_of[name]} (tensor {name!r}): {err}") from None

    def read_group(self, group: str) -> dict[str, torch.Tensor]:
        """The HF tensors of one streaming group (see mapping.groups)."""
        return {h: self.read(h) for e in mapping.name_table(self.cfg) if e.group == group for h in e.hf}

    def content_hash(self) -> str:
        """blake3 over the safetensors files' bytes, in file-name order (~4x faster than sha256)."""
        from blake3 import blake3

        digest = blake3()
        for path in self.files:
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    digest.update(chunk)
        return digest.hexdigest()


class BackgroundFlush:
    """Push written data towards the disk while more is being produced.

    `kick(fd)` starts an fsync of `fd` on a helper thread unless one is still running, so
    the disk writes back earlier data while the caller computes and writes the next; the
    caller's final fsync (durability before the directory is renamed into place) then has
    little left to wait for.
    """

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fsync")
        self._running: concurrent.futures.Future | None = None

    def kick(self, fd: int) -> None:
        if self._running is None or self._running.done():
            self._running = self._pool.submit(os.fsync, fd)

    def close(self) -> None:
        """Wait for the running fsync (its errors surface here) and stop the thread."""
        try:
            if self._running is not None:
                self._running.result()
        finally:
            self._pool.shutdown()


# safetensors dtype names (https://github.com/huggingface/safetensors, format section).
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


class HFWriter:
    """Write a known set of tensors into safetensors shards of at most `max_shard_bytes`, streaming.

    `layout` lists every tensor (name -> (shape, dtype)) in file order.  Since every size is
    known up front, each shard's header is written first and each tensor goes straight to its
    offset when add()ed, in any order: one tensor in memory, never a shard.  close() checks
    that every tensor arrived and writes the index when there is more than one shard.
    """

    def __init__(self, root: str | Path, layout: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 max_shard_bytes: int = 4 << 30) -> None:
        self.root = Path(root)
        shards: list[dict[str, tuple]] = [{}]
        size = 0
        for name, (shape, dtype) in layout.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors name")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = (tuple(shape), dtype, size, size + nbytes)
            size += nbytes
        n = len(shards)
        self.files = [self.root / (SINGLE_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
        self._slot: dict[str, tuple] = {}  # name -> (shard index, data start, shape, dtype, begin, end)
        self._handles = []
        for i, (path, shard) in enumerate(zip(self.files, shards)):
            header = {name: {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [b, e]}
                      for name, (shape, dtype, b, e) in shard.items()}
            header["__metadata__"] = {"format": "pt"}
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
            f = open(path, "wb", buffering=0)  # tensors are written whole; no buffer copy
            f.write(len(raw).to_bytes(8, "little") + raw)
            start = f.tell()
            f.truncate(start + max((e for _, _, _, e in shard.values()), default=0))
            self._handles.append(f)
            for name, (shape, dtype, b, e) in shard.items():
                self._slot[name] = (i, start, shape, dtype, b, e)
        self._written: set[str] = set()
        self._flush = BackgroundFlush()
        self.total_bytes = sum(e - b for *_, b, e in self._slot.values())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._slot:
            raise KeyError(f"{name!r} is not in this checkpoint's layout")
        if name in self._written:
            raise ValueError(f"{name!r} was written twice")
        shard, start, shape, dtype, begin, _ = self._slot[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the layout says {shape} {dtype}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()  # [nbytes]
        f = self._handles[shard]
        f.seek(start + begin)
        f.write(memoryview(data))
        self._written.add(name)
        self._flush.kick(f.fileno())

    def close(self) -> list[Path]:
        missing = [name for name in self._slot if name not in self._written]
        if missing:
            raise ValueError(f"{len(missing)} tensors were never written, e.g. {missing[0]!r}")
        self._flush.close()
        for f in self._handles:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if len(self.files) > 1:
            weight_map = {name: self.files[slot[0]].name for name, slot in self._slot.items()}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.root / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return list(self.files)


def copy_model_side_files(src: Path, dst: Path) -> list[str]:
    """Copy config, generation config and tokenizer files (everything but the weights)."""
    copied = []
    for path in sorted(Path(src).iterdir()):
        if not path.is_file() or path.suffix == ".safetensors" or path.name == INDEX_NAME or path.name.startswith("."):
            continue
        if path.suffix in (".bin", ".pt", ".pth", ".ckpt") or path.name == "manifest.json":
            continue
        shutil.copy2(path, dst / path.name)
        copied.append(path.name)
    return copied


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse (FileExistsError) an existing `out` unless `force`, and whatever is not a directory even with
    `force`: --force replaces an output directory, never deletes a file (nor a link, whose target stays)."""
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_symlink() or not out.is_dir():
        kind = "a symbolic link" if out.is_symlink() else "a file, not a directory"
        raise FileExistsError(f"output {out} exists and is {kind}: refusing to replace it"
                              + (" (--force replaces only an output directory)" if force else ""))
    if not force:
        raise FileExistsError(f"output directory {out} already exists (use --force to replace it)")


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, force: bool = False):
    """Yield a temporary sibling of `out`; rename it to `out` only if the block completes.

    An existing `out` is refused (FileExistsError) unless `force`; with `force` a directory is replaced
    only after the new one is complete, and anything else is still refused (check_output_dir).  On any
    exception the temporary dir is removed.
    """
    out = Path(out)
    check_output_dir(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
