"""The example sbatch scripts in the repository's slurm/ folder, rendered from the packaged template.

    python -m megatron_rl.slurm_scripts slurm        # (re)write slurm/*.sbatch
    python -m megatron_rl.slurm_scripts slurm --check  # exit 1 if a file differs from its rendering

An HPC user reads, copies and edits these; `megatron-rl submit` and `megatron-rl experiment --slurm`
render the same template (megatron_rl/slurm/train.sbatch.in) with the user's values.  Each example
is that rendering with relative paths (submit from the repository root; Slurm starts a job in the
directory it was submitted from), so the files cannot drift from the template:
tests/unit/test_slurm_scripts.py checks them against this module and with `bash -n`.

- train.sbatch: the main job on one node (configs/tiny_cpu.yaml);
- experiment_array.sbatch: one arm of an experiment as an array job, a task per seed;
- convert.sbatch: an HF -> Megatron-Core conversion (one process that starts its own ranks; no Ray).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from megatron_rl.submit_cli import render

VENV = Path(".venv")
HEADER = """\
# EXAMPLE, rendered from the packaged template by `python -m megatron_rl.slurm_scripts slurm`.
# {what}
# Submit from the repository root:  {how}
# {adapt}
"""
ADAPT = ("To adapt it, edit the #SBATCH lines and the variables RUN_DIR, CONFIG, VENV, OVERRIDES below,\n"
         "# or let `megatron-rl {renderer}` render the same script with your values.")


def _with_header(script: str, what: str, how: str, renderer: str) -> str:
    shebang, rest = script.split("\n", 1)
    return f"{shebang}\n{HEADER.format(what=what, how=how, adapt=ADAPT.format(renderer=renderer))}{rest}"


def train_script() -> str:
    text = render(config=Path("configs/tiny_cpu.yaml"), run_dir=Path("runs/slurm_tiny_cpu"), nodes=1,
                  tasks_per_node=1, cpus_per_task=2, gpus_per_task=0, time_limit="04:00:00",
                  signal_seconds=300, job_name="megatron-rl", venv=VENV, overrides=[], extra=[])
    return _with_header(text, "The main job (SFT baseline, then GRPO) on one node, requeued from its checkpoint "
                              "on preemption.", "sbatch slurm/train.sbatch",
                        "submit --config C --run-dir D --dry-run")


def experiment_array_script() -> str:
    exp = "experiments/grpo_vs_sft.yaml"
    text = render(config=Path(exp), run_dir=Path("runs/exp_grpo_vs_sft"), nodes=1, tasks_per_node=1,
                  cpus_per_task=2, gpus_per_task=0, time_limit="04:00:00", signal_seconds=300,
                  job_name="exp-grpo_vs_sft-grpo", venv=VENV, overrides=[], extra=["--array=0,1,2"],
                  driver=["experiment", "--config", exp, "--task", "grpo"])
    return _with_header(text, "One arm (grpo) of an experiment: array task i runs seed seeds[i] on its own Ray "
                              "cluster and writes its result.json (grpo starts from the sft arm: submit it after that arm's array).",
                        "sbatch --dependency=afterok:SFT_JOB slurm/experiment_array.sbatch",
                        "experiment --config E --slurm --dry-run")


def convert_script() -> str:
    hf, out = "models/Qwen2-0.5B", "runs/convert/qwen2_0.5b_tp1"
    args = ["convert", "hf-to-mcore", "--hf", hf, "--out", out, "--tp", "1", "--pp", "1", "--dtype", "bf16"]
    lines = [
        "#!/usr/bin/env bash",
        HEADER.format(what="An HF -> Megatron-Core conversion: one process, which starts the TP x PP ranks itself.",
                      how="sbatch slurm/convert.sbatch",
                      adapt="To adapt it, edit the #SBATCH lines and the arguments (megatron-rl convert "
                            "hf-to-mcore --help).").rstrip("\n"),
        "#SBATCH --job-name=megatron-rl-convert",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --time=01:00:00",
        "#SBATCH --output=slurm-convert-%j.out",
        "set -euo pipefail",
        "",
        f"VENV={shlex.quote(str(VENV))}",
        "# The output directory appears whole or not at all (written aside, then renamed); check it with",
        "#   megatron-rl convert verify --hf HF --mcore OUT",
        f'exec "$VENV/bin/megatron-rl" {" ".join(shlex.quote(a) for a in args)}',
    ]
    return "\n".join(lines) + "\n"


def convert_args(script: str) -> list[str]:
    """The megatron-rl argument list of convert.sbatch's command (tests parse it with the CLI)."""
    line = next(ln for ln in script.splitlines() if ln.startswith('exec "$VENV/bin/megatron-rl"'))
    return shlex.split(line)[2:]


SCRIPTS = {"train.sbatch": train_script, "experiment_array.sbatch": experiment_array_script,
           "convert.sbatch": convert_script}


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python -m megatron_rl.slurm_scripts DIR [--check]", file=sys.stderr)
        return 2
    out, check = Path(argv[0]), "--check" in argv[1:]
    stale = []
    for name, make in SCRIPTS.items():
        path, text = out / name, make()
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o755)
    if stale:
        print(f"differ from their rendering (rerun without --check): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
