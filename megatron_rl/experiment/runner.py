"""The experiment runner: every run not finished yet, one after another, each recorded in its result.json.

    ran = run_all(cfg)     # cfg: experiment/config.py; the runs: experiment/runs.py

`cfg.runner` chooses the launch: `process` (launch_process: `megatron-rl` in a process of its own, its
summary written to a file it is told of) or `in_process` / `pooled` (experiment/inprocess.py: `run_one` in
this process, the summary returned; `pooled` hands the engine pool, train/engine_pool.py, to every run).
In and out of this process a launch returns an Outcome (exit code and summary); nothing is read from a log.
A failed run ends the experiment (and what the pool keeps); rerunning it resumes at the first run without
a result.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from megatron_rl.config import ConfigError
from megatron_rl.experiment.config import ExperimentConfig, Runner
from megatron_rl.experiment.runs import Outcome, Run, log_path, plan_runs, run_dir
from megatron_rl.run_files import read_json

logger = logging.getLogger(__name__)

Launch = Callable[[Run, Path], Outcome]
"""Launches one run, its console output to the log path given; returns its Outcome."""
RESULT_KEYS = ("steps", "generated_tokens", "stopped", "stopped_at_step")
"""What of a run's summary its result.json keeps."""


def preregister(cfg: ExperimentConfig) -> dict:
    """Write DIR/preregistration.json before any run; refuse to go on if it exists and differs."""
    pre = dataclasses.asdict(cfg.preregistration)
    if pre["test"] == "superiority":  # the default: registrations written before the field existed lack it
        del pre["test"]
    record = {"preregistration": pre, "base": cfg.base,
              "arms": {k: _arm_record(v) for k, v in cfg.arms.items()}, "seeds": cfg.seeds,
              "overrides": cfg.overrides}
    if cfg.budget_generated_tokens is not None:  # the equal budget is part of the design
        record["budget_generated_tokens"] = cfg.budget_generated_tokens
    path = Path(cfg.dir) / "preregistration.json"
    if path.is_file():
        old = read_json(path)
        registered = dict(old)
        old.pop("registered_at", None)
        if old != record:
            raise ConfigError(f"{path} differs from this experiment file: a pre-registration cannot change after "
                             f"runs started (use a new experiment dir)")
        return registered
    path.parent.mkdir(parents=True, exist_ok=True)
    record["registered_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(record, indent=2, sort_keys=True))
    return record



def _arm_record(arm) -> dict:
    """An arm as its pre-registration records it; its faults only when it injects some (so the registrations of
    experiments from before arms could inject faults still match)."""
    record = dataclasses.asdict(arm)
    if not record["faults"]:
        del record["faults"]
    return record


@contextlib.contextmanager
def shared_ray_cluster(cfg: ExperimentConfig) -> Iterator[str | None]:
    """One local Ray cluster for all of an experiment's runs, owned by this process; yields its address
    (exported as RAY_ADDRESS for the runs) or None when cfg.shared_ray is off.  Ray stops it on exit.  It
    listens on loopback only and authenticates with a private token, which the runs started from here
    find in their environment (platform/local_ray.py)."""
    if not cfg.shared_ray:
        yield None
        return
    import ray

    from megatron_rl.platform.local_ray import local_ray_options
    from megatron_rl.train.config import load_train_config

    cpus = load_train_config(cfg.base, cfg.overrides).run.ray_num_cpus
    t0 = time.time()
    ray.init(num_cpus=cpus, logging_level=logging.WARNING, **local_ray_options())
    address = ray.get_runtime_context().gcs_address
    logger.info("shared Ray cluster for the runs at %s (up in %.1f s)", address, time.time() - t0)
    before = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        if before is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = before
        ray.shutdown()


def summary_path(log: Path) -> Path:
    """Where a run in its own process writes its summary (--summary-out): beside its log."""
    return log.with_name(log.stem + ".summary.json")


def read_summary(path: Path) -> dict:
    """The summary a finished run's process wrote; {} (logged) when it wrote none."""
    if not path.is_file():
        logger.warning("the run wrote no summary to %s", path)
        return {}
    return read_json(path)


def launch_process(run: Run, log: Path) -> Outcome:
    """Run one `megatron-rl` command in its own process (its own Ray unless shared), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    summary = summary_path(log)
    summary.unlink(missing_ok=True)  # an earlier attempt's
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", *run.argv(summary)], stdout=f,
                            stderr=subprocess.STDOUT, check=False, env=run.environment()).returncode
    return Outcome(rc, read_summary(summary) if rc == 0 else {})


def runner_of(cfg: ExperimentConfig) -> Runner:
    """cfg.runner, or `process` when the runs cannot be in this process (shared_ray off: each needs its own Ray)."""
    if cfg.runner != "process" and not cfg.shared_ray:
        logger.info("runner: %s needs shared_ray: each run starts as its own process", cfg.runner)
        return "process"
    return cfg.runner


def choose_launch(runner: Runner, pool=None) -> Launch:
    """The launch for `runner`; `pool` (an EnginePool, train/engine_pool.py) goes to every run in this process."""
    if runner == "process":
        return launch_process
    from megatron_rl.experiment.inprocess import launch_in_process

    return functools.partial(launch_in_process, pool=pool)


def run_all(cfg: ExperimentConfig, launch: Launch | None = None) -> list[tuple[str, int]]:
    """Run every (arm, seed) not finished yet; returns the ones run now.  Stops on a failed run.
    `launch`: instead of the one cfg.runner chooses (no pool then)."""
    from megatron_rl.console import progress

    start = time.time()
    runs = plan_runs(cfg)
    preregister(cfg)
    todo = [r for r in runs if not (run_dir(cfg, r.arm, r.seed) / "result.json").is_file()]
    if len(todo) < len(runs):
        logger.info("%d of %d runs finished earlier: skipped", len(runs) - len(todo), len(runs))
    runner = runner_of(cfg)
    pooled = launch is None and runner == "pooled" and bool(todo)
    ran: list[tuple[str, int]] = []
    with shared_ray_cluster(cfg) if todo else contextlib.nullcontext(), _pool(pooled) as pool:
        chosen = launch is None
        launch = launch or choose_launch(runner, pool)
        for i, run in enumerate(todo):
            t0 = time.time()
            if pool is not None:
                pool.prepare_for(run.command)  # what it keeps for another kind of run ends
            own = run.faults and chosen and launch is not launch_process  # a faulted run: its own process
            if own:
                logger.info("run %s seed %d injects faults: it runs as its own process", run.arm, run.seed)
            rc = execute_run(cfg, run, launch_process if own else launch)
            if rc != 0:
                if pool is not None:
                    pool.drop()  # nothing of a failed run reaches a later one
                raise RuntimeError(f"run {run.arm} seed {run.seed} failed (exit {rc}); see "
                                   f"{log_path(cfg, run.arm, run.seed)} -- rerun the experiment to resume")
            ran.append((run.arm, run.seed))
            progress(run_progress_line(len(runs) - len(todo) + i + 1, len(runs), run.arm, run.seed, time.time() - t0,
                                       eta_s=(len(todo) - i - 1) * (time.time() - start) / (i + 1)))
    return ran


def _pool(pooled: bool) -> contextlib.AbstractContextManager:
    """The engine pool (train/engine_pool.py) the runs of a `pooled` runner share, owned here; else none."""
    if not pooled:
        return contextlib.nullcontext()
    from megatron_rl.train.engine_pool import engine_pool

    return engine_pool()


def execute_run(cfg: ExperimentConfig, run: Run, launch: Launch) -> int:
    """Launch one run; when it succeeds, write its result.json: launch time, wall time and what its summary
    says (steps, generated tokens, the budget that stopped it).  Returns its exit code."""
    t0 = time.time()
    outcome = launch(run, log_path(cfg, run.arm, run.seed))
    if outcome.code == 0:
        (run_dir(cfg, run.arm, run.seed) / "result.json").write_text(json.dumps({
            "arm": run.arm, "seed": run.seed, "launched_at": t0, "wall_s": time.time() - t0,
            **{k: outcome.summary[k] for k in RESULT_KEYS if k in outcome.summary}}))
    return outcome.code


def run_progress_line(done: int, total: int, arm: str, seed: int, wall_s: float, eta_s: float) -> str:
    """The experiment's console line after each run: runs done/total, which run, its time, ETA."""
    def dur(s: float) -> str:
        return f"{int(s) // 60}m{int(s) % 60:02d}s"

    return f"experiment run {done}/{total} | {arm} seed {seed} done in {dur(wall_s)} | eta {dur(eta_s)}"

