"""Experiments under Slurm: one array job per arm (a task per unfinished seed), then a report job.

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml --slurm [--dry-run] \
        [--time 04:00:00 --cpus-per-task 2 --gpus-per-task 0 --sbatch-arg=--partition=gpu ...]

The pre-registration is written (or checked unchanged) at submission, before any job runs.
Each arm becomes one array job rendered from the packaged sbatch template
(megatron_rl/slurm/train.sbatch.in, the same script `megatron-rl submit` uses): array task i is
seed `seeds[i]`, so `--array` lists only the seeds whose run has no result.json yet.  The
template brings up the task's own Ray cluster through srun; its driver is
`megatron-rl experiment --config EXP --task ARM`, which runs that one (arm, seed) against the
job's cluster (run.use_existing_ray) in a process of its own and records its result.json (from the
summary the run writes, --summary-out) as the local runner does.  USR1
before the time limit reaches the run, which checkpoints and exits 75, and the task is
requeued, as for single jobs.

An arm that starts from another arm waits for that arm's whole array (`--dependency=afterok`).
The report job waits for every array and runs `megatron-rl experiment --config EXP`, which finds
every run finished and only writes report.json / report.md / the plots.  If a task fails, the
report job is cancelled (`--kill-on-invalid-dep=yes`); rerun the `--slurm` command (finished runs
are skipped) or the plain command to finish locally.  The scripts land in DIR/slurm/
(<arm>.sbatch, report.sbatch), the job ids in DIR/slurm/jobs.json; `--dry-run` prints the scripts
and the sbatch command lines and submits nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from megatron_rl.config import ConfigError
from megatron_rl.experiment.config import ExperimentConfig
from megatron_rl.experiment.runner import Launch, execute_run, preregister, read_summary, summary_path
from megatron_rl.experiment.runs import Outcome, Run, plan_run, plan_runs, run_dir

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True)
class SlurmOptions:
    nodes: int = 1
    tasks_per_node: int = 1
    cpus_per_task: int = 2
    gpus_per_task: int = 0
    time_limit: str = "04:00:00"
    signal_seconds: int = 300
    extra: list[str] = dataclasses.field(default_factory=list)
    """Extra #SBATCH lines for every job, e.g. --partition=gpu."""


def array_indices(cfg: ExperimentConfig, arm: str) -> list[int]:
    """Array task ids (positions in cfg.seeds) of the arm's runs that have no result yet."""
    return [i for i, seed in enumerate(cfg.seeds) if not (run_dir(cfg, arm, seed) / "result.json").is_file()]


def arm_script(cfg: ExperimentConfig, config_path: Path, arm: str, opts: SlurmOptions) -> str:
    """The arm's array job: the packaged template, its driver one run of the experiment."""
    from megatron_rl.submit_cli import render

    exp_dir = Path(cfg.dir).resolve()
    indices = array_indices(cfg, arm)
    return render(config=config_path, run_dir=exp_dir, nodes=opts.nodes, tasks_per_node=opts.tasks_per_node,
                  cpus_per_task=opts.cpus_per_task, gpus_per_task=opts.gpus_per_task, time_limit=opts.time_limit,
                  signal_seconds=opts.signal_seconds, job_name=f"exp-{exp_dir.name}-{arm}",
                  venv=Path(sys.prefix), overrides=[],
                  extra=[f"--array={','.join(map(str, indices))}", *opts.extra],
                  driver=["experiment", "--config", str(config_path), "--task", arm])


def report_script(cfg: ExperimentConfig, config_path: Path, opts: SlurmOptions) -> str:
    exp_dir = Path(cfg.dir).resolve()
    lines = ["#!/usr/bin/env bash", f"#SBATCH --job-name=exp-{exp_dir.name}-report", "#SBATCH --ntasks=1",
             "#SBATCH --cpus-per-task=1", f"#SBATCH --time={opts.time_limit}",
             f"#SBATCH --output={shlex.quote(str(exp_dir))}/slurm-report-%j.out",
             *(f"#SBATCH {e}" for e in opts.extra),
             "# The experiment's report, once every run of every arm finished (rendered by experiment --slurm).",
             "set -euo pipefail",
             f"exec {shlex.quote(str(Path(sys.prefix) / 'bin' / 'megatron-rl'))} experiment --config "
             f"{shlex.quote(str(config_path))}"]
    return "\n".join(lines) + "\n"


def sbatch(script: Path, dependency: list[str]) -> str:
    """Submit one script; returns its job id."""
    cmd = ["sbatch", "--parsable"]
    if dependency:
        cmd += [f"--dependency=afterok:{':'.join(dependency)}", "--kill-on-invalid-dep=yes"]
    out = subprocess.run([*cmd, str(script)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def submit(cfg: ExperimentConfig, config_path: Path, opts: SlurmOptions, *, dry_run: bool = False,
           submit_one: Callable[[Path, list[str]], str] = sbatch) -> dict:
    """Render and submit the arms' array jobs in dependency order, then the report job."""
    plan_runs(cfg)  # every run's config loads
    config_path = config_path.resolve()
    out_dir = Path(cfg.dir).resolve() / "slurm"
    scripts: dict[str, str] = {}
    for arm in cfg.order():
        if array_indices(cfg, arm):
            scripts[arm] = arm_script(cfg, config_path, arm, opts)
    scripts["report"] = report_script(cfg, config_path, opts)
    if dry_run:
        return {"scripts": scripts}
    preregister(cfg)  # before any job can run
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, str] = {}
    for name, text in scripts.items():
        path = out_dir / f"{name}.sbatch"
        path.write_text(text)
        init_from = cfg.arms[name].init_from if name in cfg.arms else None
        deps = list(jobs.values()) if name == "report" else ([jobs[init_from]] if init_from in jobs else [])
        jobs[name] = submit_one(path, deps)
        logger.info("submitted %s as job %s%s", path.name, jobs[name], f" after {deps}" if deps else "")
    (out_dir / "jobs.json").write_text(json.dumps(jobs, indent=2))
    return {"jobs": jobs, "scripts": {k: str(out_dir / f"{k}.sbatch") for k in scripts}}


def run_task(cfg: ExperimentConfig, arm: str, index: int | None = None, launch: Launch | None = None) -> int:
    """One array task: the run (arm, seeds[SLURM_ARRAY_TASK_ID]) against the job's Ray cluster."""
    if arm not in cfg.arms:
        raise ConfigError(f"--task {arm!r} is not an arm ({sorted(cfg.arms)})")
    if index is None:
        raw = os.environ.get("SLURM_ARRAY_TASK_ID")
        if raw is None or not raw.isdigit():
            raise ConfigError(f"--task needs SLURM_ARRAY_TASK_ID (a seed position), got {raw!r}")
        index = int(raw)
    if not 0 <= index < len(cfg.seeds):
        raise ConfigError(f"array task {index} has no seed: seeds are {cfg.seeds}")
    seed = cfg.seeds[index]
    preregister(cfg)  # refuses an experiment file changed since submission
    if (run_dir(cfg, arm, seed) / "result.json").is_file():
        logger.info("run %s seed %d finished earlier: nothing to do", arm, seed)
        return 0
    run = plan_run(cfg, arm, seed, existing_ray=True)  # the template's cluster (RAY_ADDRESS)
    return execute_run(cfg, run, launch or launch_forwarding_signals)


def launch_forwarding_signals(run: Run, log: Path) -> Outcome:
    """Run one `megatron-rl` command; USR1/TERM (Slurm's warning) are passed on to it.  Its summary comes
    back in the file it is told of (--summary-out)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    summary = summary_path(log)
    summary.unlink(missing_ok=True)  # an earlier attempt's (a requeued task)
    with log.open("a") as f:
        child = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", *run.argv(summary)], stdout=f,
                                 stderr=subprocess.STDOUT, env=run.environment())
        previous = {sig: signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
                    for sig in (signal.SIGUSR1, signal.SIGTERM)}
        try:
            rc = child.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return Outcome(rc, read_summary(summary) if rc == 0 else {})
