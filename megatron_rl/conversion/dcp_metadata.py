"""The `.metadata` file of a torch_dist checkpoint, written and read without importing
`torch.distributed.checkpoint`.

    with open(root / ".metadata", "wb") as f:
        dump(Metadata(state_dict_metadata=..., storage_data=..., storage_meta=StorageMeta(...)), f)
    metadata = load(root / ".metadata")      # the same types, whoever wrote the file

That package takes ~1 s to import (it pulls in DTensor and its op tables): a third of a whole
~300M-parameter conversion.  The file itself is a plain pickle of a few dataclasses.  The classes
here stand in for them: each pickles under torch's own module and class name, with the state
torch's class gives (`tests/unit/test_dcp_metadata.py` checks the bytes equal those of
`pickle.dumps` of torch's objects, and that torch unpickles them into its own classes).
Reading maps those names back to these classes; a name not known here (another writer's
extras) is imported from torch as usual.
"""

from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path

import torch

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"


def _as(module: str, name: str):
    """Give the class torch's module and name: the names it is pickled and unpickled under."""
    def mark(cls):
        cls.__module__, cls.__qualname__, cls._dcp_name = module, name, (module, name)
        return cls
    return mark


@_as(_MD, "_MEM_FORMAT_ENCODING")
class MemoryFormat(enum.Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@_as(_MD, "ChunkStorageMetadata")
class ChunkStorageMetadata:
    def __init__(self, offsets: torch.Size, sizes: torch.Size) -> None:
        self.offsets, self.sizes = offsets, sizes


@_as(_MD, "TensorProperties")
class TensorProperties:
    """Only contiguous, strided, unpinned tensors without grad are written (what a checkpoint holds)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __getstate__(self):
        return self.dtype, torch.strided, False, MemoryFormat.TORCH_CONTIGUOUS_FORMAT, False

    def __setstate__(self, state) -> None:
        self.dtype = state[0]


@_as(_MD, "TensorStorageMetadata")
class TensorStorageMetadata:
    def __init__(self, properties: TensorProperties, size: torch.Size, chunks: list[ChunkStorageMetadata]) -> None:
        self.properties, self.size, self.chunks = properties, size, chunks


@_as(_MD, "BytesStorageMetadata")
class BytesStorageMetadata:
    pass


@_as(_MD, "StorageMeta")
class StorageMeta:
    def __init__(self, checkpoint_id: str | None = None, save_id: str | None = None) -> None:
        self.checkpoint_id, self.save_id, self.load_id, self.modules = checkpoint_id, save_id, None, []


@_as(_MD, "Metadata")
class Metadata:
    def __init__(self, state_dict_metadata: dict, storage_data: dict, storage_meta: StorageMeta,
                 version: str = "1.0.0") -> None:
        self.state_dict_metadata, self.planner_data = state_dict_metadata, None
        self.storage_data, self.storage_meta, self.version = storage_data, storage_meta, version


@_as(_MD, "MetadataIndex")
class MetadataIndex:
    """A storage key: (checkpoint key, chunk offsets); equal and hashed on those two, as torch's is."""

    offset = None

    def __init__(self, fqn: str, offset: torch.Size | None = None) -> None:
        self.fqn, self.index = fqn, None  # torch's attribute order: fqn, index, then offset if any
        if offset is not None:
            self.offset = torch.Size(offset)

    def _key(self):
        return self.fqn, self.offset

    def __eq__(self, other) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@_as(_FS, "_StorageInfo")
class StorageInfo:
    """Where a chunk's bytes are: file, offset, length."""

    def __init__(self, relative_path: str, offset: int, length: int) -> None:
        self.relative_path, self.offset, self.length = relative_path, offset, length


_CLASSES = {cls._dcp_name: cls for cls in (MemoryFormat, ChunkStorageMetadata, TensorProperties,
                                           TensorStorageMetadata, BytesStorageMetadata, StorageMeta,
                                           Metadata, MetadataIndex, StorageInfo)}


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (the metadata is small), writing these classes under torch's names
    without the import-and-compare check the standard pickler makes of every class."""

    def save_global(self, obj, name=None):
        dcp_name = getattr(obj, "_dcp_name", None) if isinstance(obj, type) else None
        if dcp_name is None or _CLASSES.get(dcp_name) is not obj:
            return super().save_global(obj, name)
        if self.proto < 4:
            raise pickle.PicklingError("the checkpoint metadata is written with pickle protocol >= 4")
        self.save(dcp_name[0])
        self.save(dcp_name[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _CLASSES.get((module, name)) or super().find_class(module, name)


def dump(metadata: Metadata, f) -> None:
    """Pickle `metadata` into the open binary file `f`, as `pickle.dump` of torch's objects would."""
    _Pickler(f, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)


def dumps(metadata: Metadata) -> bytes:
    buf = io.BytesIO()
    dump(metadata, buf)
    return buf.getvalue()


def load(path: str | Path) -> Metadata:
    """A `.metadata` file, into these classes (or torch's, for names these do not cover)."""
    with open(path, "rb") as f:
        return _Unpickler(f).load()
