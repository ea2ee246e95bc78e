"""Which Hugging Face directory (config.json, tokenizer) a run started from, read back from the run
directory, whichever way it started (model.tiny, model.path, model.init_from of any run).

    model_dir = run_model_dir("runs/tiny_cpu")     # eval --run, convert mcore-to-hf, init_from
    model_dir = training_checkpoint_model_dir(ckpt)  # the same for RUN_DIR/checkpoints/step_N, its files verified

A run records it in RUN_DIR/run_manifest.json (`model_dir`); runs written before that are
followed through their resolved config.json.
"""

from __future__ import annotations

from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.run_files import read_json
from megatron_rl.run_manifest import NAME as MANIFEST


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
    model = read_json(config_path).get("model") or {}
    if not isinstance(model, dict):
        raise ConfigError(f"{config_path}: model is not a section ({type(model).__name__}); the file is damaged")
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
        recorded = read_json(path).get("model_dir")
    except ValueError:  # damaged (ConfigError): the run's config.json names the model too
        return None
    return Path(recorded) if isinstance(recorded, str) and recorded else None


def _recorded_note(recorded: Path | None) -> str:
    return f" (and {recorded}, recorded in its {MANIFEST}, has no config.json)" if recorded is not None else ""


def training_checkpoint_model_dir(ckpt_dir: Path) -> Path:
    """The HF directory whose config and tokenizer a training checkpoint's weights belong to.

    Verifies the checkpoint's files against its manifest and the tokenizer against the hash the
    checkpoint recorded; errors name the file or field.
    """
    from megatron_rl.checkpoint import load_checkpoint
    from megatron_rl.models.tokenizer import tokenizer_hash

    run_dir = ckpt_dir.resolve().parent.parent
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt_dir} looks like a training checkpoint but {run_dir / 'config.json'} (the "
                                f"run's resolved config, which names its model) is missing")
    model_dir = run_model_dir(run_dir)  # model.tiny, model.path or model.init_from: the run's own start
    load_checkpoint(ckpt_dir, tokenizer_hash=tokenizer_hash(model_dir))  # sha256 of every file, tokenizer match
    return model_dir
