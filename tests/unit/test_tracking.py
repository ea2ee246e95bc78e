"""Weights & Biases beside TensorBoard (tracking.wandb; megatron_rl/tracking.py), in offline mode: the same
metric names the JSONL gets, the resolved config, config.json and run_manifest.json attached, a resumed run in
the same W&B run; nothing without a project; a missing wandb named at start-up.

    python -m pytest tests/unit/test_tracking.py -q
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.train.config import load_train_config
from megatron_rl.reporting.reporter import metrics_logger
from megatron_rl.tracking import tracking_sinks

pytestmark = pytest.mark.unit


def _wandb_files(run_dir):
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def _written(path, wanted: list[bytes], wait_s: float = 60.0) -> bytes:
    """The run file once it holds `wanted`: W&B's service process writes it after finish() returns, which on a
    loaded machine can take seconds (a CI run saw only the file's header right after close)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        data = path.read_bytes()
        if all(w in data for w in wanted) or time.monotonic() > deadline:
            return data
        time.sleep(0.2)


def test_offline_wandb_gets_the_metrics_config_and_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_train_config(None, ["model.tiny.arch=llama", "tracking.wandb.project=megatron-rl-test",
                                   "tracking.wandb.mode=offline", "learner.lr=0.000123"])
    resolved = {"learner": {"lr": cfg.learner.lr}, "run": {"dir": str(tmp_path)}}
    (tmp_path / "config.json").write_text(json.dumps(resolved))
    (tmp_path / "run_manifest.json").write_text(json.dumps({"kind": "train", "attempts": []}))
    log = metrics_logger(tmp_path, cfg.tracking, resolved)
    assert sorted(s.name for s in log.sinks) == ["jsonl", "tensorboard", "wandb"]
    for step in range(1, 4):
        log.log(step, {"learn/loss": 1.0 / step, "eval/test_reward": 0.25 * step})
    log.close()
    [run_file] = _wandb_files(tmp_path)
    data = _written(run_file, [b"learn/loss", b"eval/test_reward", b"0.000123"])
    assert b"learn/loss" in data and b"eval/test_reward" in data and b"0.000123" in data
    files = run_file.parent / "files"
    assert json.loads((files / "config.json").read_text()) == resolved
    assert json.loads((files / "run_manifest.json").read_text())["kind"] == "train"
    jsonl = [json.loads(line) for line in (tmp_path / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [1, 2, 3]
    again = metrics_logger(tmp_path, cfg.tracking, resolved)  # a resumed run: the same W&B run id
    again.log(4, {"learn/loss": 0.2})
    again.close()
    ids = {p.name.rsplit("-", 1)[-1] for p in (tmp_path / "wandb").glob("offline-run-*")}
    assert len(ids) == 1


def test_no_project_no_wandb_and_a_missing_package_is_named(tmp_path, monkeypatch):
    cfg = load_train_config(None, ["model.tiny.arch=llama"])
    assert tracking_sinks(cfg.tracking, tmp_path, {}) == []
    off = load_train_config(None, ["model.tiny.arch=llama", "tracking.wandb.project=p", "tracking.wandb.mode=disabled"])
    assert tracking_sinks(off.tracking, tmp_path, {}) == []
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    on = load_train_config(None, ["model.tiny.arch=llama", "tracking.wandb.project=p", "tracking.wandb.mode=offline"])
    with pytest.raises(RuntimeError, match="wandb is not installed: pip install wandb"):
        tracking_sinks(on.tracking, tmp_path, {})
