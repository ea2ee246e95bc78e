"""`megatron-rl submit`: render the sbatch script for a training config and submit it.

    megatron-rl submit --config configs/tiny_cpu.yaml --run-dir runs/a --nodes 1 --dry-run
    megatron-rl submit --config configs/qwen2_7b_8gpu_disaggregated.yaml --run-dir runs/b \
        --nodes 2 --gpus-per-task 8 --time 24:00:00

The template is megatron_rl/slurm/train.sbatch.in, shipped inside the package (package_data,
read through importlib.resources), so `submit` works from an installed package as from a
checkout.  The rendered script is written to RUN_DIR/train.sbatch (and printed with --dry-run,
which submits nothing).  The config is validated first, so a bad config fails here rather than
in the queue.  The script calls `megatron-rl wait-ray` and `megatron-rl train` from the same
environment (`sys.prefix`).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.platform.local_ray import FORWARD_ALL

TEMPLATE = ("megatron_rl", "slurm/train.sbatch.in")  # package, resource path inside it
_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


def template_text() -> str:
    """The sbatch template as installed with the package."""
    from importlib.resources import files

    package, name = TEMPLATE
    resource = files(package).joinpath(name)
    if not resource.is_file():
        raise FileNotFoundError(f"sbatch template {name} is missing from the installed package {package} "
                                "(reinstall megatron-rl)")
    return resource.read_text(encoding="utf-8")


def render(
    *, config: Path, run_dir: Path, nodes: int, tasks_per_node: int, cpus_per_task: int,
    gpus_per_task: int, time_limit: str, signal_seconds: int, job_name: str,
    venv: Path, overrides: list[str], extra: list[str], driver: list[str] | None = None,
) -> str:
    """Fill the template; every value is checked and shell-quoted."""
    for name, val in (("nodes", nodes), ("tasks_per_node", tasks_per_node), ("cpus_per_task", cpus_per_task)):
        if val < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {val}")
    if gpus_per_task < 0:
        raise ConfigError(f"--gpus-per-task must be >= 0, got {gpus_per_task}")
    if not _TIME_RE.match(time_limit):
        raise ConfigError(f"--time {time_limit!r} is not a Slurm time (D-HH:MM:SS, HH:MM:SS or MM)")
    values = {
        "JOB_NAME": job_name,
        "NODES": str(nodes),
        "TASKS_PER_NODE": str(tasks_per_node),
        "CPUS_PER_TASK": str(cpus_per_task),
        "GPU_DIRECTIVE": f"#SBATCH --gpus-per-task={gpus_per_task}" if gpus_per_task else "",
        "TIME_LIMIT": time_limit,
        "SIGNAL_SECONDS": str(signal_seconds),
        "RUN_DIR": shlex.quote(str(run_dir)),
        "CONFIG": shlex.quote(str(config)),
        "VENV": shlex.quote(str(venv)),
        "OVERRIDES": " ".join(shlex.quote(o) for o in overrides),
        "EXTRA_DIRECTIVES": "\n".join(f"#SBATCH {e}" for e in extra),
        # The Ray settings every node of a run needs, from the one table local runs use as well (a user's value wins).
        "RAY_FORWARD_EXPORTS": "\n".join(f'export {k}="${{{k}:-{v}}}"' for k, v in sorted(FORWARD_ALL.items())),
        # The driver's command line after `megatron-rl` (an experiment's array task runs one of its runs).
        "DRIVER": " ".join(shlex.quote(a) for a in driver) if driver is not None else
        'train --config "$CONFIG" "run.dir=$RUN_DIR" "run.use_existing_ray=true"',
    }
    text = template_text()
    for key, val in values.items():
        text = text.replace("{{" + key + "}}", val)
    leftover = re.findall(r"\{\{[A-Z_]+\}\}", text)
    assert not leftover, f"template placeholders left unfilled: {leftover}"
    return text


def _cmd_submit(args: argparse.Namespace) -> int:
    from megatron_rl.train.config import load_train_config

    config = Path(args.config).resolve()
    load_train_config(config, args.overrides)  # validate before anything reaches the queue
    run_dir = Path(args.run_dir).resolve()
    script = render(
        config=config, run_dir=run_dir, nodes=args.nodes, tasks_per_node=args.tasks_per_node,
        cpus_per_task=args.cpus_per_task, gpus_per_task=args.gpus_per_task, time_limit=args.time,
        signal_seconds=args.signal_seconds, job_name=args.job_name,
        venv=Path(sys.prefix), overrides=args.overrides, extra=args.sbatch_arg,
    )
    if args.dry_run:
        print(script)
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "train.sbatch"
    path.write_text(script)
    out = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"sbatch failed: {out.stderr.strip()}", file=sys.stderr)
        return out.returncode
    print(out.stdout.strip().split(";")[0])
    return 0


def register(sub) -> None:
    p = sub.add_parser("submit", help="render the sbatch script for a config and submit it")
    p.add_argument("--config", required=True, help="training config YAML")
    p.add_argument("--run-dir", required=True, help="run directory (checkpoints, logs, events)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks-per-node", type=int, default=1, help="Ray nodes per Slurm node")
    p.add_argument("--cpus-per-task", type=int, default=2)
    p.add_argument("--gpus-per-task", type=int, default=0)
    p.add_argument("--time", default="04:00:00", help="Slurm time limit")
    p.add_argument("--signal-seconds", type=int, default=300, help="USR1 this long before the limit")
    p.add_argument("--job-name", default="megatron-rl")
    p.add_argument("--sbatch-arg", action="append", default=[], help="extra #SBATCH line, e.g. --partition=gpu")
    p.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    p.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    p.set_defaults(func=_cmd_submit)
