"""A trained policy exports (eval --run, convert mcore-to-hf) whichever way its run started (issue 30, defect 1).

    python -m pytest tests/unit/test_run_model_dir.py -q

Each run directory is laid out by the project's own start-up (train/run_setup.py open_run_dir:
config.json, run_manifest.json, the model it starts from, exported from another run for
model.init_from) and given one COMMITTED checkpoint whose weights are its start model's
(converted with hf-to-mcore, as a trained checkpoint would hold them; no Ray, vLLM or Megatron
start).  Exporting that checkpoint must give back the start model: its config, its tokenizer and
its tensors, bit for bit.  Ways a run starts: model.tiny, model.path, model.init_from another run
(and a run started from that one), the README's main job (`sft.first`: GRPO from RUN_DIR/sft),
and an experiment's run from another arm (relative experiment dir, runs in the runner's process
with pooled engines), exported from another working directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_rl.checkpoint import save_checkpoint
from megatron_rl.conversion.hf_to_mcore import convert_hf_to_mcore
from megatron_rl.conversion.mcore_to_hf import convert_mcore_to_hf, export_run_checkpoint
from megatron_rl.models.tokenizer import tokenizer_hash
from megatron_rl.train.config import load_train_config
from megatron_rl.run_model import run_model_dir

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SCRATCH = REPO / "configs" / "tiny_cpu_scratch.yaml"
MAIN_JOB = REPO / "configs" / "tiny_cpu.yaml"
STEP = "step_000002"


@pytest.fixture(autouse=True)
def _no_global_seeding(monkeypatch):
    # open_run_dir seeds and sets torch's threads / deterministic mode for the whole process: not in tests.
    monkeypatch.setattr("megatron_rl.ranks.build.seed_everything", lambda *a, **k: None)


def start_run(cfg, kind: str = "train"):
    """What a run leaves that export reads: its start-up, then one COMMITTED checkpoint of its start weights."""
    from megatron_rl.train.run_setup import open_run_dir

    inputs = open_run_dir(cfg, kind)
    mcore = convert_hf_to_mcore(inputs.model_dir, inputs.run_dir.parent / f"{inputs.run_dir.name}.mcore")
    save_checkpoint(inputs.run_dir / "checkpoints", 2, policy_version=2, config_hash="test",
                    save_fn=lambda tmp: shutil.copytree(mcore / "weights", tmp / "weights"),
                    tokenizer_hash=inputs.tokenizer_hash, extra={"kind": kind})
    return inputs


def tensors(model_dir: Path) -> dict:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_exports_its_start(inputs, out: Path) -> None:
    """The exported checkpoint is the run's start model: same config, tokenizer and tensors."""
    if not out.exists():
        convert_mcore_to_hf(inputs.run_dir / "checkpoints" / STEP, out)
    assert json.loads((out / "config.json").read_text()) == json.loads((inputs.model_dir / "config.json").read_text())
    assert tokenizer_hash(out) == inputs.tokenizer_hash
    ours, theirs = tensors(out), tensors(inputs.model_dir)
    assert sorted(ours) == sorted(theirs) and ours
    assert all(ours[k].equal(theirs[k]) for k in ours)


def config(base: Path, run_dir: Path, *overrides: str):
    return load_train_config(base, [f"run.dir={run_dir}", *overrides])


def test_a_tiny_run_and_a_path_run_export_from_anywhere(tmp_path, monkeypatch):
    """model.tiny (made in RUN_DIR/model) and model.path (here relative to where the run started):
    the run records the directory it started from, so export works from any working directory."""
    tiny = start_run(config(SCRATCH, tmp_path / "tiny"))
    assert tiny.model_dir == tmp_path / "tiny" / "model"
    assert json.loads((tmp_path / "tiny" / "run_manifest.json").read_text())["model_dir"] == str(tiny.model_dir)
    assert_exports_its_start(tiny, tmp_path / "tiny_out")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    path = start_run(config(SCRATCH, tmp_path / "path", "model.tiny=null", "model.path=tiny/model"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert run_model_dir(tmp_path / "path") == tiny.model_dir
    assert_exports_its_start(path, tmp_path / "path_out")


def test_runs_started_from_runs_export_and_start_runs(tmp_path):
    from megatron_rl.train.start_model import init_from_model_dir

    first = start_run(config(SCRATCH, tmp_path / "a"))
    second = start_run(config(SCRATCH, tmp_path / "b", "model.tiny=null", f"model.init_from={tmp_path / 'a'}"))
    assert second.model_dir == tmp_path / "a" / "export" / STEP  # the first run's checkpoint, exported
    assert_exports_its_start(second, tmp_path / "b_out")
    # A run from the run that started from a run: its start exports b's checkpoint (b's model found first).
    third = start_run(config(SCRATCH, tmp_path / "c", "model.tiny=null", f"model.init_from={tmp_path / 'b'}"))
    assert third.model_dir == tmp_path / "b" / "export" / STEP
    assert_exports_its_start(third, tmp_path / "c_out")
    assert (init_from_model_dir(tmp_path / "c") / "config.json").read_text() == \
        (first.model_dir / "config.json").read_text()  # what `train --dry-run model.init_from=c` reads


def test_the_main_job_sft_then_grpo_evaluates_and_exports(tmp_path, monkeypatch):
    """configs/tiny_cpu.yaml: SFT in RUN_DIR/sft (sft.first), then GRPO from it (model.init_from=RUN_DIR/sft)."""
    from megatron_rl.train import sft as sft_module

    run = tmp_path / "tiny_cpu"
    stages = {}

    def sft_stage(cfg, pool=None, *, before=None):  # the SFT stage, a checkpoint of its start weights
        # sft.first: the GRPO run that follows is named (its step-0 eval is the baseline's, train/sft.py)
        assert before is not None and before.model.init_from == str(run / "sft")
        stages["sft"] = start_run(cfg, kind="sft")
        return {"steps": 8, "run_dir": str(cfg.run.dir)}

    monkeypatch.setattr(sft_module, "sft", sft_stage)
    grpo_cfg, _ = sft_module.sft_baseline(config(MAIN_JOB, run))
    assert grpo_cfg.model.init_from == str(run / "sft")
    grpo = start_run(grpo_cfg)
    assert grpo.model_dir == run / "sft" / "export" / STEP
    # `megatron-rl eval --run RUN_DIR` exports the newest checkpoint to RUN_DIR/export/step_N.
    assert export_run_checkpoint(run) == run / "export" / STEP
    assert_exports_its_start(grpo, run / "export" / STEP)
    assert_exports_its_start(grpo, tmp_path / "out")  # `convert mcore-to-hf --mcore RUN_DIR/checkpoints/step_N`


def test_a_run_written_before_the_record_follows_its_config(tmp_path, monkeypatch):
    """A run whose run_manifest.json records no model_dir (older runs) or a removed one: its
    config.json's model.init_from is followed to the run it started from; errors name the key."""
    first = start_run(config(SCRATCH, tmp_path / "a"))
    second = start_run(config(SCRATCH, tmp_path / "b", "model.tiny=null", f"model.init_from={tmp_path / 'a'}"))
    manifest = tmp_path / "b" / "run_manifest.json"
    record = json.loads(manifest.read_text())
    assert record["model_dir"] == str(second.model_dir)
    del record["model_dir"]
    manifest.write_text(json.dumps(record))
    assert run_model_dir(tmp_path / "b") == first.model_dir
    assert_exports_its_start(second, tmp_path / "out")
    shutil.rmtree(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match=r"model.init_from of the run in .*b: .*a is not a run directory"):
        run_model_dir(tmp_path / "b")


def test_an_experiment_run_from_another_arm_exports_from_anywhere(tmp_path, monkeypatch):
    """An arm started from another arm's run (model.init_from, relative to the experiment dir, which is
    relative to where the runner ran), in the runner's process with pooled engines."""
    from megatron_rl.experiment.config import load_experiment
    from megatron_rl.experiment.runs import plan_run, run_dir

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "exp.yaml").write_text(json.dumps({
        "base": str(MAIN_JOB), "dir": "runs/exp", "seeds": [0], "runner": "pooled",
        "preregistration": {"hypothesis": "h", "baseline_arm": "sft"},
        "arms": {"sft": {"command": "sft"}, "grpo": {"command": "train", "init_from": "sft"}}}))
    exp = load_experiment(tmp_path / "exp.yaml")
    runs = {}
    for arm in exp.order():
        run = plan_run(exp, arm, 0)
        runs[arm] = start_run(run.config(), kind=run.command)
    assert json.loads((run_dir(exp, "grpo", 0) / "config.json").read_text())["model"]["init_from"] == \
        "runs/exp/runs/sft/seed_0"
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert run_model_dir(tmp_path / "runs" / "exp" / "runs" / "grpo" / "seed_0") == runs["grpo"].model_dir
    assert_exports_its_start(runs["grpo"], tmp_path / "out")
