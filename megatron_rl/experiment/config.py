"""An experiment file: the base config, the arms, the seeds, the pre-registration and how the runs run.

    cfg = load_experiment("experiments/grpo_vs_sft.yaml")     # every problem of the file named at once

Each field has its docstring; the checks across fields are `ExperimentConfig.config_problems`.  Keys of
earlier versions are refused, naming what to write instead (REPLACED: the booleans `in_process` and
`pool_engines` became the one field `runner`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional, get_args

from megatron_rl.config import ConfigError, ConfigProblems

MIN_SEEDS = 3
Command = Literal["sft", "train"]
COMMANDS = get_args(Command)
Runner = Literal["process", "in_process", "pooled"]
RUNNERS = get_args(Runner)
Test = Literal["superiority", "non_inferiority"]
REPLACED = ("in_process", "pool_engines")
"""Experiment keys of earlier versions (both are `runner` now)."""


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
    test: Test = "superiority"
    """"superiority": an arm beats the baseline (CI above 0, mean difference >= minimal_effect); "non_inferiority":
    an arm loses no more than minimal_effect (CI lower bound above -minimal_effect; report.py verdict)."""

    def __post_init__(self) -> None:
        if self.test not in get_args(Test):
            raise ConfigError(f"preregistration.test must be 'superiority' or 'non_inferiority', got {self.test!r}")
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
    faults: list[dict] = dataclasses.field(default_factory=list)
    """Failures injected into this arm's `train` runs, as `megatron-rl drill` injects them (fault_hooks.py: a
    test double of a failure, never a feature), e.g. `{fault: verifier_timeout, fraction: 0.1}`: for an arm
    that measures what a failure does to the metrics.  Such a run is its own process with its own Ray,
    whatever the runner, so the fault reaches that run's processes and no other run's."""


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
    """Equal budget per `train` run: stop.max_generated_tokens (reporting/stop.py).  Each run ends once it has
    generated this many tokens (checkpoint, final test eval); run.steps must be large enough to reach it."""
    not_run: list[str] = dataclasses.field(default_factory=list)
    """What the question needs that these runs do not cover (an arm, a workload, a scale), each named in the
    report's "Estimated or not run" section."""
    runner: Runner = "pooled"
    """How the runs are launched, one after another: `process`, each its own `megatron-rl` process;
    `in_process`, inside the runner's process (experiment/inprocess.py: the driver's imports and Ray connect
    are paid once); `pooled`, in_process and a finished `train` run's rollout engines, learner actors and
    placement group serve the next `train` run of the same engine and placement shapes (the engines refitted
    with its initial weights, the learners rebuilt in their processes), an `sft` run's learner actors the next
    `sft` run (train/engine_pool.py).  in_process and pooled need shared_ray (without it each run is its own
    process, logged)."""
    shared_ray: bool = True
    """Start one Ray cluster in the runner for all runs (they connect with run.use_existing_ray) instead of
    one per run, whatever the runner (`process` runs connect to it too).  Runs still own their actors, queues
    and run dirs: a run's actors end with it (unless the runner pools them)."""
    engine_in_process: bool = True
    """rollout.engine_in_process for every run whose rollout TP is 1 (vLLM without its two extra processes):
    a rollout option of each run, whatever the runner."""

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
            problems += fault_problems(name, arm)
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
        if values.get("runner", "pooled") not in RUNNERS:  # from a file, a field problem already
            problems.append(f"runner must be one of {list(RUNNERS)}, got {values['runner']!r}")
        for name in ("shared_ray", "engine_in_process"):
            if not isinstance(values.get(name, True), bool):
                problems.append(f"{name} must be true or false, got {values[name]!r}")
        return problems

    def order(self) -> list[str]:
        """Arms in dependency order (an arm after the arm it starts from)."""
        done, stuck = dependency_order(self.arms)
        if stuck:
            raise ConfigError(f"arms.*.init_from forms a cycle among {stuck}")
        return done


def fault_problems(name: str, arm: Arm) -> list[str]:
    """What is wrong with arm `name`'s faults: each a mapping naming a known fault, on a `train` arm."""
    from megatron_rl.fault_hooks import FAULTS, VERIFIER_DRAWS

    if not arm.faults:
        return []
    if arm.command != "train":
        return [f"arms.{name}.faults: only a train run is injected with faults, this arm runs {arm.command!r}"]
    problems = []
    for i, spec in enumerate(arm.faults):
        if not isinstance(spec, dict) or spec.get("fault") not in FAULTS:
            problems.append(f"arms.{name}.faults[{i}] must be a mapping with 'fault' one of {list(FAULTS)}, got {spec!r}")
        elif spec["fault"] == "verifier_timeout" and spec.get("per", "input") not in VERIFIER_DRAWS:
            problems.append(f"arms.{name}.faults[{i}].per must be one of {list(VERIFIER_DRAWS)}, got {spec['per']!r}")
    return problems


def dependency_order(arms: dict[str, Arm]) -> tuple[list[str], list[str]]:
    """(arms in dependency order, the sorted arms that cannot be ordered: a cycle or an unknown init_from)."""
    done: list[str] = []
    while len(done) < len(arms):
        ready = [a for a in arms if a not in done and (arms[a].init_from in done + [None])]
        if not ready:
            break
        done += ready
    return done, sorted(set(arms) - set(done))


def replaced_keys(data: dict) -> list[str]:
    """The keys of earlier versions in an experiment file's `data` (taken out of it), each named with the
    `runner` that says what it said."""
    old = {k: data.pop(k) for k in REPLACED if k in data}
    if not old:
        return []
    if old.get("in_process", True) is False:
        runner = "process"
    else:
        runner = "in_process" if old.get("pool_engines", True) is False else "pooled"
    return [f"experiment key {k} was replaced by runner: {runner} (one of {' | '.join(RUNNERS)})" for k in old]


def load_experiment(path: str | Path) -> ExperimentConfig:
    from megatron_rl.config import from_dict, read_config_data

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment file not found: {path}")
    data = read_config_data(path)  # ConfigError, one line, when it is not UTF-8 YAML of a mapping
    replaced = replaced_keys(data) if isinstance(data, dict) else []
    try:
        cfg = from_dict(ExperimentConfig, data)
    except ConfigError as err:
        raise ConfigProblems(replaced + getattr(err, "problems", [str(err)])) from None
    if replaced:
        raise ConfigProblems(replaced)
    base = Path(cfg.base)
    cfg.base = str(base if base.is_absolute() else (path.parent / base).resolve())
    if not Path(cfg.base).is_file():
        raise FileNotFoundError(f"experiment base config not found: {cfg.base}")
    return cfg
