"""A GPT model's Megatron-Core `torch_dist` checkpoint, written and read tensor by tensor.

    writer = DistCheckpointWriter(weights_dir, num_layers=L)      # MoE: num_experts=E as well
    writer.add("decoder.layers.3.mlp.linear_fc1.weight", fc1)   # canonical name, full tensor
    writer.close()                                              # completeness check, metadata
    reader = DistCheckpointReader(weights_dir)
    fc1 = reader.tensor("decoder.layers.3.mlp.linear_fc1.weight")   # [2F, H], whatever layout wrote it

This is the on-disk format `megatron.core.dist_checkpointing` writes for a GPTModel's
`sharded_state_dict()` with the torch_dist backend (tests/dist/test_conversion.py compares
the two item by item), so Megatron loads it at any TP/PP.  Writing it directly means a
conversion never builds a model, never imports Megatron-Core and holds one layer group at a
time.  The layout, as Megatron-Core 0.16 writes it:

  metadata.json   {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch", "common_backend_version": 1}
  common.pt       torch.save({}) -- a GPT model has no unsharded state
  .metadata       pickled torch.distributed.checkpoint Metadata: every key's global shape,
                  dtype and chunks, and where each chunk's bytes are
  __0_0.distcp    each chunk torch.save'd back to back

Transformer layers are stacked on a leading layer axis: canonical
`decoder.layers.{i}.X` of shape S is the chunk at offset (i, 0, ...) of key
`decoder.layers.X`, global shape (L, *S).  Each layer's linear modules also carry an
`_extra_state` object (`decoder.layers.{module}._extra_state/shard_{i}_{L}`, the bytes of
torch.save([None])) that strict loading expects.  Chunks Megatron wrote at TP > 1 (one per TP
shard) are reassembled by the reader.

MoE experts (SequentialMLP) are stacked on a second, expert axis: canonical
`decoder.layers.{i}.mlp.experts.local_experts.{e}.X` (e global) is the chunk at offset (i, e, 0, ...)
of key `decoder.layers.mlp.experts.experts.X`, global shape (L, E, *S), and the extra state of
expert linears is `..._extra_state/shard_{i}.{e}_{L}.{E}` -- as Megatron writes them at any EP.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_rl.conversion import dcp_metadata as md
from megatron_rl.conversion.hf_io import BackgroundFlush

BACKEND_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                    "common_backend": "torch", "common_backend_version": 1}
DATA_FILE = "__0_0.distcp"
DCP_METADATA = ".metadata"
# The per-layer modules whose (empty) extra state Megatron's local and TE linear layers save.
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
EXPERT_EXTRA_STATE_MODULES = ("linear_fc1", "linear_fc2")
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)")


def stacked_key(name: str) -> tuple[str, tuple[int, ...]]:
    """Canonical name -> (checkpoint key, its index on the stacked axes: (layer,), (layer, expert) or ())."""
    m = _EXPERT.fullmatch(name)
    if m:
        return f"decoder.layers.mlp.experts.experts.{m.group(3)}", (int(m.group(1)), int(m.group(2)))
    m = _LAYER.fullmatch(name)
    if m:
        return f"decoder.layers.{m.group(2)}", (int(m.group(1)),)
    return name, ()


def _owning(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it owns exactly its storage, else a compact copy (torch.save writes whole storages)."""
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _save_without_crc(obj, f) -> None:
    """torch.save without the zip records' crc32 (a third of the time; safetensors has none either,
    and torch.load does not need it); the global torch setting is restored afterwards."""
    from torch.serialization import get_crc32_options, set_crc32_options

    previous = get_crc32_options()
    set_crc32_options(False)
    try:
        torch.save(obj, f)
    finally:
        set_crc32_options(previous)


@dataclass
class _Entry:
    """One checkpoint key as written so far: a tensor (dtype, global size, chunks) or an object."""

    dtype: torch.dtype | None = None  # None: a bytes object
    size: tuple[int, ...] = ()
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # (offsets, sizes)


class DistCheckpointWriter:
    """Writes canonical GPT tensors one at a time into a torch_dist checkpoint directory."""

    def __init__(self, root: str | Path, num_layers: int, num_experts: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.num_layers = num_layers
        self.num_experts = num_experts
        # Unbuffered: torch.save writes large records itself; a BufferedWriter halves its speed.
        self._file = open(self.root / DATA_FILE, "wb", buffering=0)
        self._entries: dict[str, _Entry] = {}
        self._storage: dict[tuple[str, tuple[int, ...] | None], tuple[int, int]] = {}  # -> (offset, length)
        self._flush = BackgroundFlush()
        self.total_bytes = 0

    def _append(self, key: str, offsets: tuple[int, ...] | None, write) -> None:
        offset = self._file.tell()
        write(self._file)
        self._storage[(key, offsets)] = (offset, self._file.tell() - offset)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write the full tensor `name` (canonical name; layers by global index)."""
        key, index = stacked_key(name)
        shape = tuple(tensor.shape)
        stack = (self.num_layers, self.num_experts)[:len(index)]
        if len(index) == 2 and self.num_experts is None:
            raise ValueError(f"{name}: an expert tensor, but the writer was opened without num_experts")
        for what, i, n in zip(("layer", "expert"), index, stack):
            if not 0 <= i < n:
                raise ValueError(f"{name}: {what} {i} outside the model's {n} {what}s")
        chunk = tensor.reshape((1,) * len(index) + shape)
        offsets, global_shape = tuple(index) + (0,) * len(shape), tuple(stack) + shape
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(tensor.dtype, global_shape)
        elif entry.size != global_shape or entry.dtype != tensor.dtype:
            raise ValueError(f"{name}: {tuple(shape)} {tensor.dtype} does not match the other layers' "
                             f"{entry.size[len(index):]} {entry.dtype}")
        if (key, offsets) in self._storage:
            raise ValueError(f"{name} was written twice")
        data = _owning(chunk.detach().cpu())
        self._append(key, offsets, lambda f: _save_without_crc(data, f))
        entry.chunks.append((offsets, tuple(chunk.shape)))
        self._flush.kick(self._file.fileno())
        self.total_bytes += data.numel() * data.element_size()
        module, _, param = key.rpartition(".")
        if len(index) == 1 and param == "weight" and module.removeprefix("decoder.layers.") in EXTRA_STATE_MODULES:
            self._add_extra_state(module, f"{index[0]}_{self.num_layers}")
        elif len(index) == 2 and param == "weight" and module.rpartition(".")[2] in EXPERT_EXTRA_STATE_MODULES:
            self._add_extra_state(module, f"{index[0]}.{index[1]}_{self.num_layers}.{self.num_experts}")

    def _add_extra_state(self, module_key: str, shard: str) -> None:
        key = f"{module_key}._extra_state/shard_{shard}"
        buf = io.BytesIO()
        torch.save([None], buf)
        self._entries[key] = _Entry()
        self._append(key, None, lambda f: f.write(buf.getbuffer()))

    def close(self) -> None:
        """Check every key is fully covered, then write the metadata files (data first, fsynced)."""
        self._flush.close()
        os.fsync(self._file.fileno())
        self._file.close()
        for key, entry in self._entries.items():
            covered = sum(math.prod(sizes) for _, sizes in entry.chunks)
            if entry.dtype is not None and covered != math.prod(entry.size):
                raise ValueError(f"{key}: chunks cover {covered} of {math.prod(entry.size)} elements "
                                 f"({len(entry.chunks)} of {self.num_layers} layers written?)")
        entries = {
            key: md.BytesStorageMetadata() if e.dtype is None else md.TensorStorageMetadata(
                md.TensorProperties(e.dtype), torch.Size(e.size),
                [md.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in e.chunks])
            for key, e in self._entries.items()
        }
        storage = {md.MetadataIndex(key, offsets): md.StorageInfo(DATA_FILE, *where)
                   for (key, offsets), where in self._storage.items()}
        metadata = md.Metadata(entries, storage, md.StorageMeta(checkpoint_id=str(self.root), save_id=uuid.uuid4().hex))
        with open(self.root / DCP_METADATA, "wb") as f:
            md.dump(metadata, f)
        torch.save({}, self.root / "common.pt")
        (self.root / "metadata.json").write_text(json.dumps(BACKEND_METADATA))


class _FileSlice(io.RawIOBase):
    """A read-only view of bytes [offset, offset + length) of an open file (for torch.load)."""

    def __init__(self, f, offset: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buf)[:n])
        self._pos += got
        return got


# torch.save's pickled storage classes -> dtype (the legacy names its pickles still carry).
_STORAGE_DTYPES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                   "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32}


class _TensorLayout(pickle.Unpickler):
    """Unpickles a torch.save'd tensor's data.pkl without its data: returns
    ((dtype, storage key, storage numel), storage offset, size, stride); anything else raises."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")

    def persistent_load(self, pid):
        return pid[1], str(pid[2]), int(pid[4])  # ('storage', dtype, key, location, numel)


def _data_offset(chunk, dtype: torch.dtype, shape: tuple[int, ...]) -> int | None:
    """Where a torch.save'd chunk keeps its data, if it is exactly one contiguous `dtype` tensor
    of `shape` over all of its storage (as Megatron's and our writer save parameters); else None."""
    reader = torch._C.PyTorchFileReader(chunk)
    try:
        storage, offset, size, stride = _TensorLayout(io.BytesIO(reader.get_record("data.pkl"))).load()
    except (pickle.UnpicklingError, TypeError, ValueError, IndexError):
        return None
    contiguous = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if storage[0] != dtype or storage[2] != math.prod(shape) or offset != 0 or size != shape:
        return None
    if any(n > 1 and st != c for n, st, c in zip(shape, stride, contiguous)):
        return None
    return reader.get_record_offset(f"data/{storage[1]}")


class DistCheckpointReader:
    """Reads canonical GPT tensors from a torch_dist checkpoint, whatever TP/PP wrote it."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        marker = self.root / "metadata.json"
        if not marker.is_file():
            raise FileNotFoundError(f"{self.root} is not a Megatron-Core distributed checkpoint (no metadata.json)")
        backend = json.loads(marker.read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise ValueError(f"{marker}: sharded_backend {backend!r}, only 'torch_dist' is supported")
        self.metadata = md.load(self.root / DCP_METADATA)
        self._files: dict[str, object] = {}

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _load_chunk(self, key: str, offsets, out: torch.Tensor | None = None) -> torch.Tensor:
        """One stored chunk: read straight into `out` (the chunk's dtype and shape) when its layout
        allows (no fresh allocation), else torch.load'ed into new memory."""
        info = self.metadata.storage_data[md.MetadataIndex(key, torch.Size(offsets))]
        f = self._files.get(info.relative_path)
        if f is None:
            f = self._files[info.relative_path] = open(self.root / info.relative_path, "rb", buffering=0)
        chunk = io.BufferedReader(_FileSlice(f, info.offset, info.length), 1 << 20)
        if out is not None:
            where = _data_offset(chunk, out.dtype, tuple(out.shape))
            data = out.reshape(-1).view(torch.uint8).numpy()
            if where is not None and where + data.nbytes <= info.length:
                f.seek(info.offset + where)
                view, done = memoryview(data), 0
                while done < data.nbytes:
                    got = f.readinto(view[done:])
                    if not got:
                        raise ValueError(f"{self.root / info.relative_path}: {key} {tuple(offsets)} is truncated")
                    done += got
                return out
            chunk.seek(0)
        return torch.load(chunk, map_location="cpu", weights_only=True)

    def tensor(self, name: str, alloc=None) -> torch.Tensor:
        """The full tensor `name` (canonical name), assembled from its chunks.

        alloc(name, shape, dtype) -> tensor: where to put it (e.g. mapping.LayerBuffers.get) instead of
        new memory; a tensor stored as one chunk is then read straight into it.
        """
        key, index = stacked_key(name)
        entry = self.metadata.state_dict_metadata.get(key)
        if not isinstance(entry, md.TensorStorageMetadata):
            raise KeyError(f"{name!r} (checkpoint key {key!r}) is not in {self.root}")
        size, k = tuple(entry.size), len(index)
        for axis, i in enumerate(index):
            if not 0 <= i < size[axis]:
                raise KeyError(f"{name!r}: index {i} outside the checkpoint's {size[axis]} on stacked axis {axis}")
        chunks = [c for c in entry.chunks
                  if all(c.offsets[a] <= i < c.offsets[a] + c.sizes[a] for a, i in enumerate(index))]
        size = size[k:]

        def own_part(c, data):  # this tensor's slice of a chunk spanning the stacked axes
            return data[tuple(i - c.offsets[a] for a, i in enumerate(index))] if k else data

        dtype = entry.properties.dtype
        if len(chunks) == 1 and tuple(chunks[0].sizes)[k:] == size and tuple(chunks[0].offsets[k:]) == (0,) * len(size):
            c = chunks[0]
            into = alloc(name, size, dtype).view(tuple(c.sizes)) if alloc and set(c.sizes[:k]) <= {1} else None
            return own_part(c, self._load_chunk(key, c.offsets, into))
        out = torch.empty(size, dtype=dtype) if alloc is None else alloc(name, size, dtype)
        filled = 0
        for c in chunks:
            data, offsets = own_part(c, self._load_chunk(key, c.offsets)), tuple(c.offsets[k:])
            region = out[tuple(slice(o, o + n) for o, n in zip(offsets, data.shape))]
            region.copy_(data)
            filled += data.numel()
        if filled != out.numel():
            raise ValueError(f"{name!r}: the checkpoint's chunks cover {filled} of {out.numel()} elements")
        return out
