"""`megatron-rl submit --dry-run` renders the exact sbatch script; bad values are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.cli import main

pytestmark = pytest.mark.unit

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml")


def test_dry_run_prints_the_script(capsys, tmp_path):
    run_dir = tmp_path / "run with space"
    code = main(["submit", "--config", TINY, "--run-dir", str(run_dir), "--nodes", "2", "--gpus-per-task", "4",
                 "--time", "1-00:00:00", "--sbatch-arg=--partition=gpu", "--dry-run", "run.steps=7"])
    script = capsys.readouterr().out
    assert code == 0
    assert script.startswith("#!/usr/bin/env bash")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-task=4", "#SBATCH --time=1-00:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --requeue", "set -euo pipefail"):
        assert line in script, line
    assert f"RUN_DIR='{run_dir}'" in script  # shell-quoted
    assert "OVERRIDES=(run.steps=7)" in script
    assert "{{" not in script
    assert not run_dir.exists()  # a dry run submits and writes nothing


@pytest.mark.parametrize("args, needle", [
    (["--time", "forever"], "--time"),
    (["--nodes", "0"], "--nodes"),
])
def test_bad_values_are_named(capsys, tmp_path, args, needle):
    code = main(["submit", "--config", TINY, "--run-dir", str(tmp_path), "--dry-run", *args])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_bad_config_fails_before_submitting(capsys, tmp_path):
    code = main(["submit", "--config", TINY, "--run-dir", str(tmp_path), "--dry-run", "run.nonsense=1"])
    assert code == 2
    assert "run.nonsense" in capsys.readouterr().err
