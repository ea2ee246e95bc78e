"""slurm/*.sbatch: the example scripts an HPC user copies are the packaged template's rendering
(megatron_rl/slurm_scripts.py), parse with bash -n, and name only commands the CLI accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_rl import slurm_scripts
from megatron_rl.cli import build_parser

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(slurm_scripts.SCRIPTS))
def test_committed_script_is_the_templates_rendering(name):
    path = REPO / "slurm" / name
    assert path.is_file(), f"slurm/{name} is missing: python -m megatron_rl.slurm_scripts slurm"
    assert path.read_text() == slurm_scripts.SCRIPTS[name](), \
        f"slurm/{name} differs from the template's rendering: python -m megatron_rl.slurm_scripts slurm"


@pytest.mark.parametrize("name", sorted(slurm_scripts.SCRIPTS))
def test_script_is_bash_clean_and_sbatch_reads_its_directives(name):
    text = (REPO / "slurm" / name).read_text()
    proc = subprocess.run([shutil.which("bash") or "bash", "-n", str(REPO / "slurm" / name)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # sbatch reads #SBATCH lines only before the first command: every directive must come first.
    lines = text.splitlines()
    first_command = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert not [ln for ln in lines[first_command:] if ln.startswith("#SBATCH")]
    assert any(ln.startswith("#SBATCH --time=") for ln in lines[:first_command])


def test_check_mode_reports_a_drifted_copy(tmp_path, capsys):
    assert slurm_scripts.main([str(tmp_path)]) == 0
    assert slurm_scripts.main([str(tmp_path), "--check"]) == 0
    edited = tmp_path / "train.sbatch"
    edited.write_text(edited.read_text().replace("--time=04:00:00", "--time=08:00:00"))
    assert slurm_scripts.main([str(tmp_path), "--check"]) == 1
    assert "train.sbatch" in capsys.readouterr().err


def test_commands_in_the_scripts_are_accepted_by_the_cli():
    parser = build_parser()
    args = parser.parse_args(slurm_scripts.convert_args(slurm_scripts.convert_script()))
    assert args.hf == "models/Qwen2-0.5B" and args.tp == 1 and args.dtype == "bf16"
    array = slurm_scripts.experiment_array_script()
    assert '"$VENV/bin/megatron-rl" experiment --config experiments/grpo_vs_sft.yaml --task grpo' in array
    assert (REPO / "experiments" / "grpo_vs_sft.yaml").is_file()
    assert (REPO / "configs" / "tiny_cpu.yaml").is_file()
    parser.parse_args(["experiment", "--config", "experiments/grpo_vs_sft.yaml", "--task", "grpo"])
