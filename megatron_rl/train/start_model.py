"""The policy a run starts from, as a Hugging Face directory (the `model:` section).

    model_dir = prepare_model(cfg.model, run_dir)     # at the start of a run
    model_dir = run_model_dir(run_dir)                # later (megatron_rl/run_model.py)

`model.path` is a local directory, or a Hugging Face hub id found in the local cache (`resolve_model_path`);
`model.tiny` is made in RUN_DIR/model on first use (no network);
`model.init_from` exports another run's newest COMMITTED checkpoint on first use.

The run records the directory it started from in RUN_DIR/run_manifest.json (`model_dir`), and
`run_model_dir` (megatron_rl/run_model.py) reads it back: that directory holds the config.json and tokenizer every one of
the run's checkpoints uses (eval --run and convert mcore-to-hf export with them).  A run written
before the record existed, or whose recorded directory is gone, is followed through its
config.json instead: model.path, RUN_DIR/model for model.tiny, and for model.init_from the run it
started from, recursively (a run keeps the architecture and tokenizer of the run it starts from).
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.train.config import ModelConfig


def prepare_model(model: ModelConfig, run_dir: Path) -> Path:
    """The HF model directory to start from (a tiny random model is made on first use; another
    run's newest checkpoint is exported on first use)."""
    if model.init_from is not None:
        from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint

        return export_run_checkpoint(Path(model.init_from).resolve())
    if model.path is not None:
        path = resolve_model_path(model.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: no config.json in {path}")
        return path
    from megatron_rl.models.tiny import make_tiny_model

    path = run_dir / "model"
    if not (path / "config.json").is_file():
        spec = model.tiny
        make_tiny_model(path, arch=spec.arch, size=spec.size, seed=spec.seed, tie_embeddings=spec.tie_embeddings)
    return path


def resolve_model_path(path: str | Path) -> Path:
    """A local directory as it is; a Hugging Face hub id ("org/name", no such local directory) as its snapshot
    in the local Hugging Face cache (HF_HOME, HF_HUB_CACHE).  Nothing is downloaded here: an id that is not
    cached is a FileNotFoundError that says how to fetch it first."""
    local = Path(path).expanduser()
    if local.exists() or not _looks_like_hub_id(str(path)):
        return local.resolve()
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id=str(path), local_files_only=True)).resolve()
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        raise FileNotFoundError(
            f"model.path {path!r} is not a local directory and not in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it first, on a machine with network: "
            f"`hf download {path}` (or `huggingface-cli download {path}`), with the same HF_HOME") from None


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return (len(parts) == 2 and all(parts) and not text.startswith((".", "~"))
            and all(c.isalnum() or c in "-_." for c in "".join(parts)))


def init_from_model_dir(run_dir: str | Path) -> Path:
    """The model (config, tokenizer) of the run `model.init_from` names; it must have a
    COMMITTED checkpoint to start from."""
    from megatron_rl.checkpoint import latest_committed
    from megatron_rl.conversion.mcore_to_hf import training_checkpoint_model_dir

    ckpt = latest_committed(Path(run_dir) / "checkpoints", verify=True)
    if ckpt is None:
        raise FileNotFoundError(f"model.init_from {run_dir}: no intact COMMITTED checkpoint to start from")
    return training_checkpoint_model_dir(ckpt)
