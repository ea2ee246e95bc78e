"""The runs of an experiment as data: what each (arm, seed) runs, and what it gives back.

    run = plan_run(cfg, "grpo", seed=0)    # Run: command, base config, overrides (built here, once)
    run.config()                           # its TrainConfig, loaded from those overrides
    run.argv()                             # its `megatron-rl` command line: only for a run in its own process
    Outcome(code=0, summary={...})         # what a launch returns: exit code and the run's summary

A run's overrides are built once, here, from the experiment file: the arm's and the experiment's
overrides, then the run dir and seeds, the arm it starts from, the token budget and what the runner
shares (its Ray cluster, the engine inside its actor).  A run inside the runner's process gets its
config from them directly (experiment/inprocess.py); a run in its own process and a Slurm task get the
command line derived from them (experiment/runner.py, experiment/slurm.py).  Its summary comes back
as data (`train.cli.run_one`, or the `--summary-out` file of its process), never read from its log.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.experiment.config import Command, ExperimentConfig


@dataclasses.dataclass(frozen=True)
class Run:
    """One (arm, seed) of an experiment."""

    arm: str
    seed: int
    command: Command
    """`sft` or `train`."""
    base: str
    """The base training config (a path)."""
    overrides: tuple[str, ...]
    """Its dotted overrides of the base config, in order."""
    faults: str = ""
    """The faults its arm injects (Arm.faults), as the JSON `megatron-rl drill` arms them with; "" for none.
    Such a run is launched as its own process, with its own Ray (experiment/runner.py `launch_process`)."""

    def config(self):
        """The run's TrainConfig (train/config.py): the base config with the run's overrides."""
        from megatron_rl.train.config import load_train_config

        return load_train_config(self.base, list(self.overrides))

    def environment(self) -> dict[str, str]:
        """The environment of the run's process: this one's, with its faults armed (fault_hooks.py) and, for a
        faulted run, no shared Ray cluster to join (it starts its own)."""
        from megatron_rl.fault_hooks import ENV

        env = dict(os.environ)
        env.pop(ENV, None)
        if self.faults:
            env[ENV] = self.faults
            env.pop("RAY_ADDRESS", None)
        return env

    def argv(self, summary_out: Path | None = None) -> list[str]:
        """Its `megatron-rl` command line; with `summary_out`, the run writes its summary there too."""
        out = ["--summary-out", str(summary_out)] if summary_out is not None else []
        return [self.command, "--config", self.base, *out, *self.overrides]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a launched run gives back."""

    code: int
    """Its exit code: the one its process had or would have had (train/cli.py lists them)."""
    summary: dict = dataclasses.field(default_factory=dict)
    """Its summary, the dict `megatron-rl train|sft` prints as its final JSON line; {} unless code is 0."""


def run_dir(cfg: ExperimentConfig, arm: str, seed: int) -> Path:
    return Path(cfg.dir) / "runs" / arm / f"seed_{seed}"


def log_path(cfg: ExperimentConfig, arm: str, seed: int) -> Path:
    return Path(cfg.dir) / "logs" / f"{arm}_seed_{seed}.log"


def plan_run(cfg: ExperimentConfig, arm: str, seed: int, *, existing_ray: bool | None = None) -> Run:
    """The run of `arm` with `seed`.  `existing_ray`: it connects to a running Ray cluster (RAY_ADDRESS:
    the runner's shared one, or a Slurm job's); default cfg.shared_ray."""
    a = cfg.arms[arm]
    faults = json.dumps(a.faults) if a.faults and a.command == "train" else ""
    existing_ray = False if faults else existing_ray  # the fault must reach the run's own actors only
    overrides = [*cfg.overrides, *a.overrides, f"run.dir={run_dir(cfg, arm, seed)}", f"run.seed={seed}",
                 f"learner.seed={1000 + seed}"]
    if a.init_from is not None:
        overrides += [f"model.init_from={run_dir(cfg, a.init_from, seed)}", "model.tiny=null", "model.path=null",
                      "sft.first=false"]  # the arm it starts from is its baseline
    if cfg.budget_generated_tokens is not None and a.command == "train":
        overrides.append(f"stop.max_generated_tokens={cfg.budget_generated_tokens}")
    if cfg.shared_ray if existing_ray is None else existing_ray:
        overrides.append("run.use_existing_ray=true")
    if cfg.engine_in_process and _rollout_tp(cfg.base, overrides) == 1:
        overrides.append("rollout.engine_in_process=true")
    return Run(arm=arm, seed=seed, command=a.command, base=cfg.base, overrides=tuple(overrides), faults=faults)


def _rollout_tp(base: str, overrides: list[str]) -> int | None:
    """The rollout TP the overrides give (None when the config does not load: validate_runs says why)."""
    from megatron_rl.train.config import load_train_config

    try:
        return load_train_config(base, overrides).rollout.tensor_parallel_size
    except ValueError:
        return None


def plan_runs(cfg: ExperimentConfig) -> list[Run]:
    """Every run, arms in dependency order; each one's training config must load (keys, types, rules across
    sections) before any run starts."""
    runs = [plan_run(cfg, arm, seed) for arm in cfg.order() for seed in cfg.seeds]
    for run in runs:
        try:
            run.config()
        except ValueError as err:
            raise ConfigError(f"arms.{run.arm} (seed {run.seed}): {err}") from None
    return runs
