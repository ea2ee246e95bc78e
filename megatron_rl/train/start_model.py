"""The policy a run starts from, as a Hugging Face directory (the `model:` section).

    model_dir = prepare_model(cfg.model, run_dir)     # at the start of a run
    model_dir = run_model_dir(run_dir)                # later: the model a run's checkpoints belong to

`model.path` is used as it is; `model.tiny` is made in RUN_DIR/model on first use (no network);
`model.init_from` exports another run's newest COMMITTED checkpoint on first use.

The run records the directory it started from in RUN_DIR/run_manifest.json (`model_dir`), and
`run_model_dir` reads it back: that directory holds the config.json and tokenizer every one of
the run's checkpoints uses (eval --run and convert mcore-to-hf export with them).  A run written
before the record existed, or whose recorded directory is gone, is followed through its
config.json instead: model.path, RUN_DIR/model for model.tiny, and for model.init_from the run it
started from, recursively (a run keeps the architecture and tokenizer of the run it starts from).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.run_manifest import NAME as MANIFEST
from megatron_rl.train.config import ModelConfig


def prepare_model(model: ModelConfig, run_dir: Path) -> Path:
    """The HF model directory to start from (a tiny random model is made on first use; another
    run's newest checkpoint is exported on first use)."""
    if model.init_from is not None:
        from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint

        return export_run_checkpoint(Path(model.init_from).resolve())
    if model.path is not None:
        path = Path(model.path).resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: no config.json in {path}")
        return path
    from megatron_rl.models.tiny import make_tiny_model

    path = run_dir / "model"
    if not (path / "config.json").is_file():
        spec = model.tiny
        make_tiny_model(path, arch=spec.arch, size=spec.size, seed=spec.seed)
    return path


def run_model_dir(run_dir: str | Path) -> Path:
    """The HF directory (config.json, tokenizer) of the model run `run_dir` started from, whichever
    way it started (model.tiny, model.path, model.init_from of any run); errors name the key."""
    return _run_model_dir(Path(run_dir).resolve(), seen=())


def _run_model_dir(run_dir: Path, seen: tuple[Path, ...]) -> Path:
    if run_dir in seen:
        raise FileNotFoundError(f"model.init_from of the runs {[str(p) for p in seen]} leads back to {run_dir}")
    recorded = _recorded_model_dir(run_dir)
    if recorded is not None and (recorded / "config.json").is_file():
        return recorded
    config_path = run_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir}: no config.json (the run's resolved config, which names its model)"
                                + _recorded_note(recorded))
    model = json.loads(config_path.read_text()).get("model") or {}
    if model.get("init_from"):
        source = Path(model["init_from"])
        if not (source / "config.json").is_file():
            raise FileNotFoundError(f"model.init_from of the run in {run_dir}: {source} is not a run directory "
                                    f"(no config.json){_recorded_note(recorded)}")
        return _run_model_dir(source.resolve(), seen + (run_dir,))
    key, model_dir = ("model.path", Path(model["path"])) if model.get("path") else ("model.tiny", run_dir / "model")
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{key} of the run in {run_dir}: no config.json in {model_dir}"
                                + _recorded_note(recorded))
    return model_dir


def _recorded_model_dir(run_dir: Path) -> Path | None:
    """The model directory RUN_DIR/run_manifest.json records (None for runs written before it did)."""
    path = run_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text()).get("model_dir")
    except ValueError:
        return None
    return Path(recorded) if recorded else None


def _recorded_note(recorded: Path | None) -> str:
    return f" (and {recorded}, recorded in its {MANIFEST}, has no config.json)" if recorded is not None else ""
