"""Hugging Face checkpoint files: validated lazy reading, sharded streaming writing, atomic dirs.

    ckpt = HFCheckpoint(model_dir, cfg)          # checks every tensor's presence and shape
    tensors = ckpt.read_group("layer.3")         # {hf_name: tensor}, read on demand
    with atomic_output_dir(out, force=False) as tmp:
        writer = HFWriter(tmp); writer.add(name, t) ...; writer.close()
    # `out` appears only when the block completes; an interrupted run leaves no `out`

Single-file (`model.safetensors`) and sharded (`model.safetensors.index.json`) checkpoints are
both read; the writer produces either, depending on `max_shard_bytes`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from megatron_rl.conversion import mapping

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
            raise ValueError(f"{index}: not a valid safetensors index ({err!r})") from None
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
                raise ValueError(f"corrupt safetensors file {path}: {err}") from None
            self._handles[path] = handle
        expected = mapping.hf_shapes(cfg)
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ValueError(f"{self.root}: tensor {missing[0]!r} is missing ({len(missing)} missing in all)")
        for name, shape in expected.items():
            if shapes[name] != shape:
                raise ValueError(f"{self.root}: tensor {name!r} has shape {shapes[name]}, config.json implies {shape}")
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
            raise ValueError(f"corrupt safetensors file {self._file_of[name]} (tensor {name!r}): {err}") from None

    def read_group(self, group: str) -> dict[str, torch.Tensor]:
        """The HF tensors of one streaming group (see mapping.groups)."""
        return {h: self.read(h) for e in mapping.name_table(self.cfg) if e.group == group for h in e.hf}

    def content_hash(self) -> str:
        """sha256 over the safetensors files' bytes, in file-name order."""
        digest = hashlib.sha256()
        for path in self.files:
            with open(path, "rb") as f:
                while chunk := f.read(16 << 20):
                    digest.update(chunk)
        return digest.hexdigest()


class HFWriter:
    """Write tensors one at a time into safetensors shards of at most `max_shard_bytes`.

    Holds at most one shard in memory.  close() writes the index when there is more than one
    shard and renames a lone shard to `model.safetensors`.
    """

    def __init__(self, root: str | Path, max_shard_bytes: int = 4 << 30) -> None:
        self.root = Path(root)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        fname = f"shard-{len(self._shards):05d}.safetensors"
        save_file(self._pending, str(self.root / fname), metadata={"format": "pt"})
        self._shards.append((fname, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.replace(self.root / self._shards[0][0], self.root / SINGLE_NAME)
            return [self.root / SINGLE_NAME]
        weight_map, files = {}, []
        for i, (fname, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.root / fname, self.root / final)
            files.append(self.root / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.root / INDEX_NAME).write_text(json.dumps(index, indent=2))
        return files


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


@contextlib.contextmanager
def atomic_output_dir(out: str | Path, force: bool = False):
    """Yield a temporary sibling of `out`; rename it to `out` only if the block completes.

    An existing `out` is refused (FileExistsError) unless `force`; with `force` it is replaced
    only after the new directory is complete.  On any exception the temporary dir is removed.
    """
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"output directory {out} already exists (use --force to replace it)")
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
