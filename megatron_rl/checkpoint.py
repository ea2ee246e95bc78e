"""Checkpoint directory protocol: immutable step directories, committed by a manifest written last.

    path = save_checkpoint(run_dir, step=123, save_fn=lambda d: megatron_save(d), policy_version=7,
                           config_hash=config_hash(cfg), tokenizer_hash=tokenizer_hash(model_dir),
                           data_cursor=cursor.state_dict(), coordinator_log_position=pos,
                           rng_states={rank: capture_rng_state() for each rank})   # megatron_rl/rng_state.py
    ckpt = latest_committed(run_dir)               # newest committed step dir, or None
    ckpt = resume_checkpoint(run_dir)              # newest that verifies (sha256), bad ones skipped
    checkpoint_status(run_dir)                     # every step dir: intact / corrupt / uncommitted
    manifest = load_checkpoint(ckpt, tokenizer_hash=tokenizer_hash(model_dir))   # verifies sha256
    restore_rng_state(load_rng_state(ckpt, rank))
    rotate(run_dir, keep_n=3)

Layout of a run directory:
    step_000123/            one immutable directory per saved step
        <whatever save_fn wrote>      the trainer (train/checkpointing.py) writes: weights/ (Megatron
                                      distributed checkpoint: weights + optimizer + scheduler),
                                      queue_snapshot.db (the coordinator's log: queue, admission
                                      leases, priority-sampler RNG), rollout_rounds.json (rounds
                                      sampled ahead of the learner, replayed on resume)
        rng/rank_00000.json           per-rank RNG states (python, numpy, torch CPU, CUDA)
        COMMITTED                     the manifest (JSON), present only once complete

Protocol.  Everything is written into a hidden temporary directory `.tmp.step_000123.*`
next to the step directories; when save_fn has returned, every file is hashed (sha256, files in
parallel on a thread pool) and fsync'ed, the directory is renamed to `step_000123`, and only then the manifest is written
to `COMMITTED.tmp` and atomically renamed to `COMMITTED`.  A crash at any point leaves
either a hidden temp dir or a step dir without COMMITTED, both of which readers skip (with
a warning).  The manifest records: step, policy_version, config hash, package version,
tokenizer hash, files with sha256 and size, coordinator log position, data cursor, the ranks
whose RNG state was saved, and the time.  Reading it checks every field readers use (types, and
file paths relative and inside the step directory): a damaged manifest is a CheckpointError.

`tokenizer_hash` is an opaque string: use megatron_rl.models.tokenizer.tokenizer_hash, the
same hash the trajectories carry.  This module does not import Megatron: the weights and optimizer are written by the
`save_fn(tmp_dir)` callback the learner passes in (and read back by the learner).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from megatron_rl.version import __version__
from megatron_rl.config import ConfigError
from megatron_rl.durable_files import files_sha256, fsync_path, write_json_atomic

logger = logging.getLogger(__name__)

MANIFEST = "COMMITTED"
FORMAT = "megatron-rl-checkpoint/1"
_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used as asked: the message names the directory and the problem."""


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


# ---------------------------------------------------------------- save


def _hash_tree(root: Path) -> dict[str, dict[str, Any]]:
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    digests = files_sha256(paths, fsync=True)
    return {path.relative_to(root).as_posix(): {"sha256": digest, "bytes": path.stat().st_size}
            for path, digest in zip(paths, digests)}


def _fresh_step_dir(run_dir: Path, step: int) -> Path:
    """Where step `step` goes: never a committed directory; an uncommitted leftover is removed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / step_dir_name(step)
    if (final / MANIFEST).exists():
        raise FileExistsError(f"checkpoint {final} is already committed; step directories are immutable")
    if final.exists():
        logger.warning("removing uncommitted leftover %s before saving step %d again", final, step)
        shutil.rmtree(final)
    return final


def _write_rng_states(root: Path, rng_states: Mapping[int, Mapping[str, Any]]) -> None:
    for rank, state in sorted(rng_states.items()):
        rng_dir = root / "rng"
        rng_dir.mkdir(exist_ok=True)
        (rng_dir / f"rank_{int(rank):05d}.json").write_text(json.dumps(state))


def _manifest(step: int, files: dict, *, policy_version: int, config_hash: str, tokenizer_hash: str | None,
              data_cursor: Mapping[str, Any] | None, rng_states: Mapping[int, Any],
              coordinator_log_position: int | None, extra: Mapping[str, Any]) -> dict[str, Any]:
    """The COMMITTED manifest's content; ValueError (before anything is renamed) if it is not JSON."""
    now = time.time()
    manifest = {
        "format": FORMAT,
        "step": step,
        "policy_version": policy_version,
        "config_hash": config_hash,
        "package_version": __version__,
        "tokenizer_hash": tokenizer_hash,
        "files": files,
        "coordinator_log_position": coordinator_log_position,
        "data_cursor": dict(data_cursor) if data_cursor is not None else None,
        "rng": {"ranks": sorted(int(r) for r in rng_states)},
        "time": now,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "extra": dict(extra),
    }
    try:
        json.dumps(manifest)
    except TypeError as err:
        raise ValueError(f"checkpoint manifest for step {step} is not JSON-serialisable: {err}") from None
    return manifest


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    policy_version: int,
    config_hash: str,
    save_fn: Callable[[Path], None] | None = None,
    tokenizer_hash: str | None = None,
    data_cursor: Mapping[str, Any] | None = None,
    coordinator_log_position: int | None = None,
    rng_states: Mapping[int, Mapping[str, Any]] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write step directory `run_dir/step_<step, 6 digits>` by the protocol above; returns its path.

    A committed directory for this step is never overwritten (FileExistsError); an
    uncommitted leftover of a crashed save is removed first.  If save_fn raises, the temp
    directory is removed and the error propagates: earlier checkpoints are untouched.
    """
    run_dir = Path(run_dir)
    final = _fresh_step_dir(run_dir, step)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp.{final.name}.", dir=run_dir))
    try:
        os.chmod(tmp, 0o755)
        if save_fn is not None:
            save_fn(tmp)
        _write_rng_states(tmp, rng_states or {})
        manifest = _manifest(step, _hash_tree(tmp), policy_version=policy_version, config_hash=config_hash,
                             tokenizer_hash=tokenizer_hash, data_cursor=data_cursor, rng_states=rng_states or {},
                             coordinator_log_position=coordinator_log_position, extra=extra or {})
        os.rename(tmp, final)
        fsync_path(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_json_atomic(final / MANIFEST, manifest)
    logger.info("committed checkpoint %s (%d files)", final, len(manifest["files"]))
    return final


# ---------------------------------------------------------------- read


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    """The manifest of a committed step directory (CheckpointError if absent or unreadable)."""
    path = Path(ckpt_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} is not committed (no {MANIFEST} manifest)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"checkpoint manifest {path} is unreadable: {err!r}"[:400]) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint manifest {path} is not of format {FORMAT}")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise CheckpointError(f"checkpoint manifest {path}: {problem}")
    return manifest


def _is_int(value: Any, *, optional: bool = False) -> bool:
    return (optional and value is None) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _manifest_problem(m: Mapping[str, Any]) -> str | None:
    """What is wrong with a parsed manifest's fields (None when every field readers use is well-formed)."""
    for key, ok in (("step", _is_int(m.get("step"))), ("policy_version", _is_int(m.get("policy_version"))),
                    ("config_hash", isinstance(m.get("config_hash", ""), str)),
                    ("tokenizer_hash", m.get("tokenizer_hash") is None or isinstance(m.get("tokenizer_hash"), str)),
                    ("coordinator_log_position", _is_int(m.get("coordinator_log_position"), optional=True)),
                    ("data_cursor", m.get("data_cursor") is None or isinstance(m.get("data_cursor"), dict)),
                    ("extra", isinstance(m.get("extra", {}), dict)),
                    ("rng", isinstance(m.get("rng"), dict) and isinstance(m["rng"].get("ranks"), list)
                     and all(_is_int(r) for r in m["rng"]["ranks"])),
                    ("files", isinstance(m.get("files"), dict))):
        if not ok:
            return f"field {key!r} is missing or malformed"
    for rel, meta in m["files"].items():
        parts = rel.split("/")
        if not rel or rel.startswith("/") or ".." in parts or "" in parts or "\\" in rel or rel == MANIFEST:
            return f"files: {rel!r} is not a relative path inside the checkpoint"
        if not (isinstance(meta, dict) and _is_int(meta.get("bytes")) and isinstance(meta.get("sha256"), str)
                and _HEX64.match(meta["sha256"])):
            return f"files[{rel!r}] must be {{'sha256': 64 hex digits, 'bytes': int >= 0}}"
    return None


def verify_files(ckpt_dir: str | Path, manifest: Mapping[str, Any]) -> None:
    """Check every file listed in the manifest: present, same size, same sha256."""
    root = Path(ckpt_dir)
    for rel, meta in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            raise CheckpointError(f"checkpoint {root}: file {rel} listed in the manifest is missing")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint {root}: file {rel} has {path.stat().st_size} bytes, manifest says {meta['bytes']}")
    rels = list(manifest["files"])
    for rel, digest in zip(rels, files_sha256([root / rel for rel in rels])):
        if digest != manifest["files"][rel]["sha256"]:
            raise CheckpointError(f"checkpoint {root}: file {rel} fails its sha256 check (corrupted or modified)")


def load_checkpoint(ckpt_dir: str | Path, *, tokenizer_hash: str | None = None, verify: bool = True) -> dict[str, Any]:
    """Validate a committed checkpoint and return its manifest; the learner then loads the weights.

    tokenizer_hash: the run's tokenizer fingerprint; a checkpoint saved with another one is
    refused (token ids would mean different strings).
    """
    manifest = read_manifest(ckpt_dir)
    saved = manifest.get("tokenizer_hash")
    if tokenizer_hash is not None:
        if saved is None:
            logger.warning("checkpoint %s records no tokenizer hash; cannot check it against the run's", ckpt_dir)
        elif saved != tokenizer_hash:
            raise CheckpointError(
                f"checkpoint {ckpt_dir} was saved with tokenizer {saved[:12]}… but this run uses "
                f"{tokenizer_hash[:12]}…; refusing to load weights under a different vocabulary"
            )
    if verify:
        verify_cached(ckpt_dir, manifest)  # resume and export pick the checkpoint by verifying it already
    return manifest


def load_rng_state(ckpt_dir: str | Path, rank: int) -> dict[str, Any]:
    path = Path(ckpt_dir) / "rng" / f"rank_{rank:05d}.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} has no RNG state for rank {rank} ({path.name})")
    try:
        state = json.loads(path.read_text())
    except (ValueError, RecursionError) as err:
        raise CheckpointError(f"checkpoint {ckpt_dir}: RNG state {path.name} is unreadable: {err!r}"[:400]) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {ckpt_dir}: RNG state {path.name} is not a mapping")
    return state


def list_step_dirs(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_* directory, committed or not, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        m = _STEP_RE.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_committed(run_dir: str | Path, *, verify: bool = False) -> Path | None:
    """Newest committed step directory (optionally checksum-verified); incomplete ones are skipped with a warning."""
    for step, path in reversed(list_step_dirs(run_dir)):
        try:
            manifest = read_manifest(path)
            if verify:
                verify_cached(path, manifest)
        except CheckpointError as err:
            logger.warning("skipping checkpoint step %d: %s", step, err)
            continue
        return path
    return None


_VERIFIED: dict[str, tuple] = {}  # step dir -> (size, mtime) signature of its files when they last verified


def _signature(root: Path, manifest: Mapping[str, Any]) -> tuple:
    sig = []
    for rel in sorted(manifest["files"]):
        try:
            st = (root / rel).stat()
        except OSError:
            return ()
        sig.append((rel, st.st_size, st.st_mtime_ns))
    st = (root / MANIFEST).stat()
    return tuple(sig) + ((MANIFEST, st.st_size, st.st_mtime_ns),)


def verify_cached(ckpt_dir: str | Path, manifest: Mapping[str, Any]) -> None:
    """verify_files, skipped when this process already verified the same unchanged files
    (dry-run checks, the layout check and resume all ask about the same checkpoint)."""
    root = Path(ckpt_dir).resolve()
    sig = _signature(root, manifest)
    if sig and _VERIFIED.get(str(root)) == sig:
        return
    verify_files(root, manifest)
    _VERIFIED[str(root)] = sig


def checkpoint_status(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every step directory, newest first: {"step", "path", "status", "problem"} with status
    "intact" (committed, every file matches its sha256), "corrupt" (problem names the file) or
    "uncommitted" (no COMMITTED manifest: a save that never finished, or a deleted manifest)."""
    out = []
    for step, path in reversed(list_step_dirs(run_dir)):
        row: dict[str, Any] = {"step": step, "path": str(path), "status": "intact", "problem": None}
        if not (path / MANIFEST).is_file():
            row.update(status="uncommitted", problem=f"no {MANIFEST} manifest")
        else:
            try:
                verify_cached(path, read_manifest(path))
            except CheckpointError as err:
                row.update(status="corrupt", problem=str(err))
        out.append(row)
    return out


def resume_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint a resume must use: the newest one that is committed and verifies.

    Newer ones that do not verify are skipped with a warning naming the bad file.  When step
    directories exist but none is intact, CheckpointError: starting over silently would redo
    (and then collide with) the committed steps.
    """
    ckpt = latest_committed(run_dir, verify=True)
    if ckpt is None and list_step_dirs(run_dir):
        raise CheckpointError(f"no intact checkpoint in {run_dir} to resume from (see the warnings above, or "
                              "`megatron-rl checkpoint verify RUN_DIR`); set run.resume=false to start over "
                              "in a new run.dir")
    return ckpt


def quarantine_newer(run_dir: str | Path, step: int) -> list[Path]:
    """Rename step directories newer than `step` (the one resumed from, which verified) to
    `bad.step_N.<time>`, so that the resumed run can commit those steps again; nothing is deleted."""
    moved = []
    for s, path in list_step_dirs(run_dir):
        if s > step:
            dest = path.with_name(f"bad.{path.name}.{int(time.time())}")
            os.rename(path, dest)
            logger.warning("set aside checkpoint %s that failed verification as %s", path, dest.name)
            moved.append(dest)
    return moved


def _remove(path: Path) -> None:
    manifest = path / MANIFEST
    if manifest.exists():
        manifest.unlink()  # uncommit first: a half-deleted directory must never look committed
    shutil.rmtree(path)


def rotate(run_dir: str | Path, keep_n: int) -> list[Path]:
    """Delete all but the newest keep_n committed step dirs, and incomplete/temp dirs older than the newest committed.

    Returns the removed paths.  Directories of steps newer than the newest committed one are
    left alone: a save may be in progress there.
    """
    if keep_n < 1:
        raise ValueError(f"keep_n must be >= 1, got {keep_n}")
    run_dir = Path(run_dir)
    steps = list_step_dirs(run_dir)
    committed = [(s, p) for s, p in steps if (p / MANIFEST).is_file()]
    if not committed:
        return []
    newest = committed[-1][0]
    doomed = [p for _, p in committed[:-keep_n]]
    doomed += [p for s, p in steps if s < newest and not (p / MANIFEST).is_file()]
    for child in run_dir.iterdir():
        m = re.match(r"^\.tmp\.step_(\d+)\.", child.name)
        if m and int(m.group(1)) < newest and child.is_dir():
            doomed.append(child)
    for path in doomed:
        _remove(path)
        logger.debug("rotated out %s", path)
    return doomed
