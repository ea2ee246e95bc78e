"""A drill's config, its training attempts (`megatron-rl train` subprocesses) and their evidence.

    drill = Drill(DrillConfig(name="oom", config="configs/tiny_cpu_scratch.yaml", run_dir="runs/drill"))
    attempt = drill.train(fault={"fault": "oom", "at_step": 2})    # one attempt, the drill hook armed

The overview of the drills is the package's docstring (megatron_rl/drill/__init__.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from megatron_rl.drill.accounting import wal_ids

DEFAULT_OVERRIDES = ["data.eval_size=8", "run.eval_every=0", "run.checkpoint_every=2", "run.keep_checkpoints=3"]
EVENTS = "drill_events.jsonl"
# The engine drills kill vLLM's engine-core process: it must be a process of its own (with the engine in the
# rollout actor's process, as the tiny recipes run it, there is none to kill).
ENGINE_PROCESS = ("rollout.engine_in_process=false",)
DRILLS = ("bad_checkpoint", "oom", "oom_twice", "verifier_timeout", "worker_crash", "engine_crash",
          "engine_crash_publish", "bad_refit", "partition", "coordinator_stop", "refit_mid_generation",
          "refit_stale_kv", "refit_engine_death")


@dataclasses.dataclass(kw_only=True)
class DrillConfig:
    name: str
    """The drill: one of DRILLS."""
    config: str
    """Training config YAML (configs/tiny_cpu_scratch.yaml)."""
    run_dir: str
    """A fresh run directory for the drill (must not hold checkpoints)."""
    at_step: int = 2
    """Learner step (0-based) the fault hits; bad_checkpoint damages the checkpoint of this step."""
    steps: int = 4
    """Steps of the drill run (run.steps)."""
    variant: str | None = None
    """Drill-specific choice: bad_checkpoint flip|truncate|uncommit; verifier_timeout the share of calls;
    partition / coordinator_stop the seconds the stopped process stays stopped."""
    overrides: list = dataclasses.field(default_factory=list)
    """Extra dotted.key=value overrides, after DEFAULT_OVERRIDES."""
    from_run: str | None = None
    """bad_checkpoint only: damage a copy of this finished run (checkpoints at at_step and at_step-2)
    instead of training one first."""
    timeout_s: float = 900.0
    """Wall-clock limit of one training attempt."""

    def __post_init__(self) -> None:
        if self.name not in DRILLS:
            raise ValueError(f"drill: unknown drill {self.name!r}; choose one of {', '.join(DRILLS)}")
        if not 0 <= self.at_step < self.steps:
            raise ValueError(f"drill: --at-step must be in [0, {self.steps}), got {self.at_step}")
        if self.name == "bad_checkpoint" and (self.at_step < 4 or self.at_step % 2):
            raise ValueError("drill bad_checkpoint: --at-step names the checkpoint to damage: an even step >= 4 "
                             "(checkpoints every 2 steps; an older one must exist to fall back to)")
        if self.from_run is not None and self.name != "bad_checkpoint":
            raise ValueError("drill: --from-run applies to bad_checkpoint only")
        if self.from_run is not None and not (Path(self.from_run) / "checkpoints").is_dir():
            raise FileNotFoundError(f"drill: --from-run {self.from_run} has no checkpoints/ directory")
        if (Path(self.run_dir) / "checkpoints").exists():
            raise ValueError(f"drill: run dir {self.run_dir} already holds checkpoints; drills start from nothing")


@dataclasses.dataclass
class Attempt:
    returncode: int
    stdout: str
    stderr: str
    started: float
    ended: float
    summary: dict = dataclasses.field(default_factory=dict)
    """The run's final JSON line as it wrote it (--summary-out): its summary, or the stop that ended it; {} if none."""


class Drill:
    """One drill's runs and evidence."""

    def __init__(self, cfg: DrillConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.attempts: list[Attempt] = []
        self.acknowledged: set[str] = set()
        self.armed: list[str] = []
        """The faults armed in the last attempt (several when drills run together)."""

    def train(self, steps: int | None = None, fault: dict | list[dict] | None = None, extra: tuple = ()) -> Attempt:
        """One `megatron-rl train` attempt; with `fault` (one spec, or a list to arm several faults in
        the one run), the drill hook is armed for it."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        env.pop("MEGATRON_RL_DRILL", None)
        specs = [] if fault is None else fault if isinstance(fault, list) else [fault]
        self.armed = [f["fault"] for f in specs]
        if specs:
            armed = [{**f, "events": str(self.run_dir / EVENTS)} for f in specs]
            env["MEGATRON_RL_DRILL"] = json.dumps(armed if isinstance(fault, list) else armed[0])
        out = self.run_dir / f"drill_attempt{len(self.attempts) + 1}.summary.json"
        args = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", self.cfg.config, "--summary-out", str(out),
                f"run.dir={self.run_dir}", f"run.steps={steps or self.cfg.steps}", *DEFAULT_OVERRIDES,
                *extra, *self.cfg.overrides]
        out.unlink(missing_ok=True)
        t0 = time.time()
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=self.cfg.timeout_s)
        summary = json.loads(out.read_text()) if out.is_file() else {}
        attempt = Attempt(proc.returncode, proc.stdout, proc.stderr, t0, time.time(), summary)
        self.attempts.append(attempt)
        (self.run_dir / f"drill_attempt{len(self.attempts)}.log").write_text(proc.stderr)
        self.keep_wal_ids()
        return attempt

    def keep_wal_ids(self) -> None:
        """Remember every id this attempt's queue acknowledged (a resume replaces queue.db)."""
        self.acknowledged |= wal_ids(self.run_dir / "queue.db")["all"]

    def injections(self, fault: str | None = None) -> list[dict]:
        """The injection events of this drill's run directory (of `fault` only, if given)."""
        path = self.run_dir / EVENTS
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        return [r for r in rows if fault is None or r.get("fault") == fault]

    def note_injection(self, fault: str, **extra) -> None:
        with open(self.run_dir / EVENTS, "a") as fh:
            fh.write(json.dumps({"fault": fault, "at_step": self.cfg.at_step, "time": time.time(), **extra}) + "\n")

    def log(self) -> str:
        return "\n".join(a.stderr for a in self.attempts)

    def metric_rows(self) -> list[dict]:
        """The learner steps' metrics rows of the run directory (those holding learn/loss)."""
        path = self.run_dir / "metrics" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip() and "learn/loss" in line]


def clear_run_dir(path: Path) -> None:
    """Remove a previous drill's run directory (only one holding a drill's own files)."""
    if path.exists():
        if not (path / EVENTS).exists() and not (path / "drill_attempt1.log").exists():
            raise ValueError(f"drill: {path} exists and is not a drill's run directory; choose another --run-dir")
        shutil.rmtree(path)
