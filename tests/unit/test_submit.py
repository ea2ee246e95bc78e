"""`megatron-rl submit --dry-run` renders the exact sbatch script; bad values are refused."""

from __future__ import annotations

import os
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


def test_the_script_waits_for_ray_and_trains_through_the_one_cli(capsys, tmp_path):
    from megatron_rl.cli import build_parser

    assert main(["submit", "--config", TINY, "--run-dir", str(tmp_path), "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert '"$VENV/bin/megatron-rl" wait-ray --address' in script
    assert '"$VENV/bin/megatron-rl" train --config' in script
    assert "megatron_rl.launch_cli" not in script and "python\" -m" not in script
    args = build_parser().parse_args(["wait-ray", "--address", "h:1", "--nodes", "2"])
    assert args.command == "wait-ray" and args.nodes == 2 and args.timeout == 300


def test_submit_works_from_a_non_editable_install(tmp_path):
    """Build a wheel of the package (setup.py + megatron_rl/ copied out of the checkout), install
    it with pip into a target directory and run `submit --dry-run` from there, away from the
    checkout: the template must come from inside the installed package."""
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    src = tmp_path / "src"
    shutil.copytree(repo / "megatron_rl", src / "megatron_rl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo / "setup.py", src / "setup.py")
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(src)],
                   check=True, capture_output=True, timeout=300)
    wheel, = (tmp_path / "wheel").glob("megatron_rl-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    where = subprocess.run([sys.executable, "-c", "import megatron_rl; print(megatron_rl.__file__)"], cwd=tmp_path,
                           env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(str(tmp_path / "site")), where  # the installed copy, not the checkout
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "submit", "--config", TINY,
                           "--run-dir", str(tmp_path / "run"), "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("#!/usr/bin/env bash") and "wait-ray" in proc.stdout
