"""Durable files: sha256 of many files on a thread pool, fsync, and atomic JSON writes.

    from megatron_rl.durable_files import files_sha256, write_json_atomic
    digests = files_sha256(paths, fsync=True)      # in `paths` order, each file flushed once hashed
    write_json_atomic(step_dir / "COMMITTED", manifest)

The checkpoint protocol (megatron_rl/checkpoint.py) is built on these: every file of a step
directory is hashed and flushed before the manifest that lists the digests is written, atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def file_sha256(path: Path) -> str:
    """sha256 (hex) of one file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file (or a directory entry list) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` so a reader sees the old file or the whole new one, on disk."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def hash_workers(n_files: int) -> int:
    """Threads for hashing `n_files`: up to 8, at most one per core and one per file."""
    return max(1, min(8, os.cpu_count() or 1, n_files))


def files_sha256(paths: list[Path], *, fsync: bool = False, workers: int | None = None) -> list[str]:
    """sha256 of each file, in `paths` order, hashed by a thread pool (hashlib releases the GIL
    on large blocks, so a 100 GB checkpoint of many shard files hashes at several cores' speed
    instead of one); with `fsync`, each file is also flushed to disk once hashed."""
    def one(path: Path) -> str:
        digest = file_sha256(path)
        if fsync:
            fsync_path(path)
        return digest

    workers = workers or hash_workers(len(paths))
    if workers == 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-sha256") as pool:
        return list(pool.map(one, paths))
