"""Experiments: arms x seeds of real runs, registered before they run, judged by a paired bootstrap.

    megatron-rl experiment --config experiments/grpo_vs_sft.yaml [--dry-run]    # experiment/cli.py

An experiment file names a base training config, the arms (each a command -- `sft` or
`train` -- with dotted overrides, optionally starting from another arm's run of the same seed),
the seeds, and the pre-registration: hypothesis, primary metric (hidden-test correctness),
baseline arm, minimal effect and alpha.  Before the first run the pre-registration is written
to `DIR/preregistration.json`; a later invocation whose pre-registration differs is refused,
so the claim cannot move after the data are in.  Then every (arm, seed) runs (`DIR/runs/<arm>/seed_<s>`),
in dependency order, one after another, inside the runner's process (`in_process`, default on;
experiment/inprocess.py) or each as its own process; a run whose
`result.json` exists is skipped, so an interrupted experiment resumes where it stopped.

What the runs share, to cut each run's start-up (benchmarks/bench_experiment_overhead.py):
`shared_ray` (default on) starts one Ray cluster in the runner and the runs connect to it
(run.use_existing_ray, RAY_ADDRESS) instead of each starting its own; every run is still its
own Ray job with its own actors (engine, learner, coordinator and its WAL queue in its run dir),
which end with it -- unless `pool_engines` (default on, with in_process) hands a finished run's rollout
engines, learner actors and placement group to the next run of the same shapes (train/engine_pool.py:
engines refitted with the run's initial weights through a checked publication, learners rebuilt in
their processes; dropped after a failed run).  `engine_in_process` (default on) runs each vLLM engine inside its rollout
actor (rollout.engine_in_process).  `budget_generated_tokens` gives every `train` run the same
generated-token budget (stop.max_generated_tokens): arms are compared at equal generated tokens,
and each run's result.json records the tokens it generated and the budget that stopped it.
Under Slurm, `--slurm` submits the runs as an array job instead (experiment/slurm.py).

The analysis pairs runs on (seed, test example): every arm's per-example correctness on the
hidden test split (written by each run's final eval) against the baseline arm's on the same
seed and example.  The 95% CI of the mean difference comes from SciPy's paired bootstrap
(`scipy.stats.bootstrap(..., paired=True)`, resampling (seed, example) pairs).  The verdict:
"supported" when the CI's lower bound is above 0 and the mean difference reaches the minimal
effect, "contradicted" when the CI's upper bound is below 0, else "inconclusive"; fewer than
3 seeds is "exploratory" (no verdict).  `report.json`, `report.md` and PNG plots (test
correctness per arm with its CI, dev correctness curves with seed bands) land in DIR.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional, get_args

from megatron_rl.config import ConfigError, ConfigProblems


logger = logging.getLogger(__name__)

MIN_SEEDS = 3
Command = Literal["sft", "train"]
COMMANDS = get_args(Command)


@dataclasses.dataclass(kw_only=True)
class Preregistration:
    hypothesis: str
    """What the experiment is expected to show, in words."""
    baseline_arm: str
    """The arm every other arm is compared with."""
    primary_metric: str = "test_correctness"
    """Greedy pass@1 correctness on the hidden test split (the only primary metric supported)."""
    minimal_effect: float = 0.05
    """Smallest mean difference (arm - baseline) that counts as an effect."""
    alpha: float = 0.05
    """1 - confidence of the bootstrap interval."""

    def __post_init__(self) -> None:
        if self.primary_metric != "test_correctness":
            raise ConfigError(f"preregistration.primary_metric must be 'test_correctness', got {self.primary_metric!r}")
        if not 0 < self.alpha < 0.5:
            raise ConfigError(f"preregistration.alpha must be in (0, 0.5), got {self.alpha}")


@dataclasses.dataclass(kw_only=True)
class Arm:
    command: Command = "train"
    """`sft` or `train`."""
    overrides: list[str] = dataclasses.field(default_factory=list)
    """Dotted overrides of the base config for this arm."""
    init_from: str | None = None
    """Start from this arm's run of the same seed (model.init_from)."""


@dataclasses.dataclass(kw_only=True)
class ExperimentConfig:
    base: str
    """Base training config (relative paths are relative to the experiment file)."""
    dir: str
    """Experiment directory: pre-registration, runs, report."""
    preregistration: Preregistration
    arms: dict[str, Arm]
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2])
    """Each seed sets run.seed and learner.seed (data splits stay fixed: the test set is shared)."""
    overrides: list[str] = dataclasses.field(default_factory=list)
    """Dotted overrides for every run of every arm."""
    budget_generated_tokens: Optional[int] = None
    """Equal budget per `train` run: stop.max_generated_tokens (train/stop.py).  Each run ends once it has
    generated this many tokens (checkpoint, final test eval); run.steps must be large enough to reach it."""
    shared_ray: bool = True
    """Start one Ray cluster in the runner for all runs (they connect with run.use_existing_ray) instead of
    one per run.  Runs still own their actors, queues and run dirs: a run's actors end with it."""
    engine_in_process: bool = True
    """rollout.engine_in_process for every run whose rollout TP is 1 (vLLM without its two extra processes)."""
    in_process: bool = True
    """Run the runs inside the runner's process, one after another (experiment/inprocess.py), instead of one
    process each: the driver's imports and Ray connect are paid once.  Needs shared_ray (otherwise each run
    is its own process, logged)."""
    pool_engines: bool = True
    """With in_process: a finished `train` run's rollout engines, learner actors and placement group serve the
    next `train` run of the same engine and placement shapes (the engines refitted with its initial weights,
    the learners rebuilt in their processes), and an `sft` run's learner actors the next `sft` run
    (train/engine_pool.py)."""

    def __post_init__(self) -> None:
        problems = self.config_problems(vars(self))
        if problems:
            raise ConfigProblems(problems)

    @staticmethod
    def config_problems(values: dict) -> list[str]:
        """Every problem among the fields given that no single field shows (config.py: all of them on a
        complete file, the readable ones when other keys of the file are wrong)."""
        problems = []
        arms, prereg = values.get("arms"), values.get("preregistration")
        if arms is not None and prereg is not None and prereg.baseline_arm not in arms:
            problems.append(f"preregistration.baseline_arm {prereg.baseline_arm!r} is not an arm ({sorted(arms)})")
        for name, arm in (arms or {}).items():
            if arm.command not in COMMANDS:  # from a file, a field problem already; built in code, here
                problems.append(f"arms.{name}.command must be one of {list(COMMANDS)}, got {arm.command!r}")
            if arm.init_from is not None and arm.init_from not in arms:
                problems.append(f"arms.{name}.init_from {arm.init_from!r} is not an arm ({sorted(arms)})")
        known = {n: a if a.init_from in (arms or {}) else dataclasses.replace(a, init_from=None)
                 for n, a in (arms or {}).items()}  # an unknown init_from is named above
        stuck = dependency_order(known)[1]
        if stuck:
            problems.append(f"arms.*.init_from forms a cycle among {stuck}")
        seeds = values.get("seeds", [0])
        if not seeds or len(set(seeds)) != len(seeds):
            problems.append(f"seeds must be distinct and non-empty, got {seeds}")
        budget = values.get("budget_generated_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            problems.append(f"budget_generated_tokens must be an int >= 1 (or null = off), got {budget!r}")
        for name in ("shared_ray", "engine_in_process", "in_process", "pool_engines"):
            if not isinstance(values.get(name, True), bool):
                problems.append(f"{name} must be true or false, got {values[name]!r}")
        return problems

    def order(self) -> list[str]:
        """Arms in dependency order (an arm after the arm it starts from)."""
        done, stuck = dependency_order(self.arms)
        if stuck:
            raise ConfigError(f"arms.*.init_from forms a cycle among {stuck}")
        return done


def dependency_order(arms: dict[str, Arm]) -> tuple[list[str], list[str]]:
    """(arms in dependency order, the sorted arms that cannot be ordered: a cycle or an unknown init_from)."""
    done: list[str] = []
    while len(done) < len(arms):
        ready = [a for a in arms if a not in done and (arms[a].init_from in done + [None])]
        if not ready:
            break
        done += ready
    return done, sorted(set(arms) - set(done))


def load_experiment(path: str | Path) -> ExperimentConfig:
    import yaml

    from megatron_rl.config import from_dict

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    cfg = from_dict(ExperimentConfig, data)
    base = Path(cfg.base)
    cfg.base = str(base if base.is_absolute() else (path.parent / base).resolve())
    if not Path(cfg.base).is_file():
        raise FileNotFoundError(f"experiment base config not found: {cfg.base}")
    return cfg


def run_dir(cfg: ExperimentConfig, arm: str, seed: int) -> Path:
    return Path(cfg.dir) / "runs" / arm / f"seed_{seed}"


def command_for(cfg: ExperimentConfig, arm: str, seed: int) -> list[str]:
    """The megatron-rl command line of one run."""
    a = cfg.arms[arm]
    args = [a.command, "--config", cfg.base, *cfg.overrides, *a.overrides,
            f"run.dir={run_dir(cfg, arm, seed)}", f"run.seed={seed}", f"learner.seed={1000 + seed}"]
    if a.init_from is not None:
        args += [f"model.init_from={run_dir(cfg, a.init_from, seed)}", "model.tiny=null", "model.path=null",
                 "sft.first=false"]  # the arm it starts from is its baseline
    if cfg.budget_generated_tokens is not None and a.command == "train":
        args.append(f"stop.max_generated_tokens={cfg.budget_generated_tokens}")
    if cfg.shared_ray:
        args.append("run.use_existing_ray=true")  # RAY_ADDRESS: the runner's cluster (shared_ray_cluster)
    if cfg.engine_in_process and _rollout_tp(cfg.base, args) == 1:
        args.append("rollout.engine_in_process=true")
    return args


def _rollout_tp(base: str, args: list[str]) -> int | None:
    """The rollout TP a run's overrides give (None when its config does not load: validate_runs says why)."""
    from megatron_rl.train.config import load_train_config

    try:
        return load_train_config(base, [x for x in args[3:] if "=" in x]).rollout.tensor_parallel_size
    except ValueError:
        return None


@contextlib.contextmanager
def shared_ray_cluster(cfg: ExperimentConfig) -> Iterator[str | None]:
    """One local Ray cluster for all of an experiment's runs, owned by this process; yields its address
    (exported as RAY_ADDRESS for the runs) or None when cfg.shared_ray is off.  Ray stops it on exit."""
    if not cfg.shared_ray:
        yield None
        return
    import ray

    from megatron_rl.train.config import load_train_config

    cpus = load_train_config(cfg.base, cfg.overrides).run.ray_num_cpus
    t0 = time.time()
    ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
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


def launch_cli(args: list[str], log: Path) -> int:
    """Run one `megatron-rl` command in its own process (its own Ray), output to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        return subprocess.run([sys.executable, "-m", "megatron_rl.cli", *args], stdout=f, stderr=subprocess.STDOUT,
                              check=False).returncode


def preregister(cfg: ExperimentConfig) -> dict:
    """Write DIR/preregistration.json before any run; refuse to go on if it exists and differs."""
    record = {"preregistration": dataclasses.asdict(cfg.preregistration), "base": cfg.base,
              "arms": {k: dataclasses.asdict(v) for k, v in cfg.arms.items()}, "seeds": cfg.seeds,
              "overrides": cfg.overrides}
    if cfg.budget_generated_tokens is not None:  # the equal budget is part of the design
        record["budget_generated_tokens"] = cfg.budget_generated_tokens
    path = Path(cfg.dir) / "preregistration.json"
    if path.is_file():
        old = json.loads(path.read_text())
        old.pop("registered_at", None)
        if old != record:
            raise ConfigError(f"{path} differs from this experiment file: a pre-registration cannot change after "
                             f"runs started (use a new experiment dir)")
        return json.loads(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    record["registered_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path.write_text(json.dumps(record, indent=2, sort_keys=True))
    return record


def validate_runs(cfg: ExperimentConfig) -> None:
    """Every run's training config must load (keys, types, cross-section rules) before any run starts."""
    from megatron_rl.train.config import load_train_config

    for arm in cfg.order():
        for seed in cfg.seeds:
            args = command_for(cfg, arm, seed)
            try:
                load_train_config(cfg.base, [a for a in args[3:] if "=" in a])
            except ValueError as err:
                raise ConfigError(f"arms.{arm} (seed {seed}): {err}") from None


def choose_launch(cfg: ExperimentConfig) -> Callable[[list[str], Path], int]:
    """In the runner's process (cfg.in_process, with the shared cluster) or one process per run."""
    if not cfg.in_process:
        return launch_cli
    if not cfg.shared_ray:
        logger.info("in_process needs shared_ray: each run starts as its own process")
        return launch_cli
    from megatron_rl.experiment.inprocess import launch_in_process

    return launch_in_process


def run_all(cfg: ExperimentConfig, launch: Callable[[list[str], Path], int] | None = None) -> list[tuple[str, int]]:
    """Run every (arm, seed) not finished yet; returns the ones run now.  Stops on a failed run."""
    from megatron_rl.console import progress

    launch = launch or choose_launch(cfg)

    start = time.time()
    validate_runs(cfg)
    preregister(cfg)
    ran: list[tuple[str, int]] = []
    runs = [(arm, seed) for arm in cfg.order() for seed in cfg.seeds]
    todo = [r for r in runs if not (run_dir(cfg, *r) / "result.json").is_file()]
    if len(todo) < len(runs):
        logger.info("%d of %d runs finished earlier: skipped", len(runs) - len(todo), len(runs))
    with shared_ray_cluster(cfg) if todo else contextlib.nullcontext(), run_pool(cfg, launch) as pool:
        for i, (arm, seed) in enumerate(todo):
            t0 = time.time()
            if pool is not None:
                pool.prepare_for(cfg.arms[arm].command)  # what it keeps for another kind of run ends
            rc = execute_run(cfg, arm, seed, launch)
            if rc != 0:
                if pool is not None:
                    pool.drop()  # nothing of a failed run reaches a later one
                raise RuntimeError(f"run {arm} seed {seed} failed (exit {rc}); see {log_path(cfg, arm, seed)} -- "
                                   f"rerun the experiment to resume")
            wall = time.time() - t0
            ran.append((arm, seed))
            progress(run_progress_line(len(runs) - len(todo) + i + 1, len(runs), arm, seed, wall,
                                       eta_s=(len(todo) - i - 1) * (time.time() - start) / (i + 1)))
    return ran


def run_pool(cfg: ExperimentConfig, launch: Callable) -> contextlib.AbstractContextManager:
    """The engine pool (train/engine_pool.py) for runs inside this process with cfg.pool_engines; else none."""
    from megatron_rl.experiment.inprocess import launch_in_process

    if not cfg.pool_engines or launch is not launch_in_process:
        return contextlib.nullcontext()
    from megatron_rl.train.engine_pool import engine_pool

    return engine_pool()


def log_path(cfg: ExperimentConfig, arm: str, seed: int) -> Path:
    return Path(cfg.dir) / "logs" / f"{arm}_seed_{seed}.log"


def execute_run(cfg: ExperimentConfig, arm: str, seed: int, launch: Callable[[list[str], Path], int],
                args: list[str] | None = None) -> int:
    """Launch one run; when it succeeds, write its result.json: launch time, wall time and what its
    final JSON line says (steps, generated tokens, the budget that stopped it).  Returns its exit code."""
    log = log_path(cfg, arm, seed)
    t0 = time.time()
    rc = launch(args if args is not None else command_for(cfg, arm, seed), log)
    if rc == 0:
        final = final_line(log)
        (run_dir(cfg, arm, seed) / "result.json").write_text(json.dumps({
            "arm": arm, "seed": seed, "launched_at": t0, "wall_s": time.time() - t0,
            **{k: final[k] for k in ("steps", "generated_tokens", "stopped", "stopped_at_step") if k in final}}))
    return rc


def final_line(log: Path) -> dict:
    """A run's final JSON line (its summary) from its log; {} when there is none."""
    if not log.is_file():
        return {}
    for line in reversed(log.read_text(errors="replace").splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return {}


def run_progress_line(done: int, total: int, arm: str, seed: int, wall_s: float, eta_s: float) -> str:
    """The experiment's console line after each run: runs done/total, which run, its time, ETA."""
    def dur(s: float) -> str:
        return f"{int(s) // 60}m{int(s) % 60:02d}s"

    return f"experiment run {done}/{total} | {arm} seed {seed} done in {dur(wall_s)} | eta {dur(eta_s)}"

