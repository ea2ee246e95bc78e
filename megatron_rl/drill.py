"""Fault drills (issue #12): a real training run, one injected fault, one JSON record of what happened.

    megatron-rl drill oom --config configs/tiny_cpu_scratch.yaml [--at-step 1] [run.steps=4 ...]
    python -m benchmarks.drills                                     # every drill, one table

Each drill runs `megatron-rl train` in subprocesses (shortened: DEFAULT_OVERRIDES), injects its
fault through the documented hook (megatron_rl/drill_hooks.py, the MEGATRON_RL_DRILL variable) or
by damaging files between two attempts, reruns the same command where the protocol says so, and
reports (Record): what was detected, by what, the action taken, whether the run recovered, the
steps redone, the trajectories lost and duplicated, policy-version continuity and the time from
injection to the first step learned after it.

Accounting (`account`): every learner step appends the ids it learned from to RUN_DIR/consumed.jsonl
(Reporter.record_consumed), the last line of a step being the attempt that counts.  An id is
*acknowledged* once a queue (any attempt's WAL, copied before a rerun replaces it) accepted it or a
learner took it; it is *accounted* if a final step learned from it, the final WAL still holds it, or
the final WAL dropped it with a reason.  lost = acknowledged - accounted; duplicated = ids learned
by two final steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_OVERRIDES = ["data.eval_size=8", "run.eval_every=0", "run.checkpoint_every=2", "run.keep_checkpoints=3"]
EVENTS = "drill_events.jsonl"
DRILLS = ("bad_checkpoint", "oom", "oom_twice", "verifier_timeout", "worker_crash", "engine_crash",
          "engine_crash_publish", "bad_refit", "partition", "coordinator_stop")


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


class Drill:
    """One drill's runs and evidence."""

    def __init__(self, cfg: DrillConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.attempts: list[Attempt] = []
        self.acknowledged: set[str] = set()

    def train(self, steps: int | None = None, fault: dict | None = None, extra: tuple = ()) -> Attempt:
        """One `megatron-rl train` attempt; with `fault`, the drill hook is armed for it."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        env.pop("MEGATRON_RL_DRILL", None)
        if fault is not None:
            env["MEGATRON_RL_DRILL"] = json.dumps({**fault, "events": str(self.run_dir / EVENTS)})
        args = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", self.cfg.config,
                f"run.dir={self.run_dir}", f"run.steps={steps or self.cfg.steps}", *DEFAULT_OVERRIDES,
                *extra, *self.cfg.overrides]
        t0 = time.time()
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=self.cfg.timeout_s)
        attempt = Attempt(proc.returncode, proc.stdout, proc.stderr, t0, time.time())
        self.attempts.append(attempt)
        (self.run_dir / f"drill_attempt{len(self.attempts)}.log").write_text(proc.stderr)
        self.keep_wal_ids()
        return attempt

    def keep_wal_ids(self) -> None:
        """Remember every id this attempt's queue acknowledged (a resume replaces queue.db)."""
        self.acknowledged |= wal_ids(self.run_dir / "queue.db")["all"]

    def injections(self) -> list[dict]:
        path = self.run_dir / EVENTS
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def note_injection(self, fault: str, **extra) -> None:
        with open(self.run_dir / EVENTS, "a") as fh:
            fh.write(json.dumps({"fault": fault, "at_step": self.cfg.at_step, "time": time.time(), **extra}) + "\n")

    def log(self) -> str:
        return "\n".join(a.stderr for a in self.attempts)


# ---- accounting -----------------------------------------------------------------------------------


def wal_ids(db: Path) -> dict[str, set]:
    """The ids a queue WAL holds: all (accepted or finished), queued, consumed, dropped (with a reason)."""
    out = {"all": set(), "queued": set(), "consumed": set(), "dropped": set()}
    if not db.is_file():
        return out
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        traj = dict(con.execute("SELECT seq, id FROM traj"))
        done = con.execute("SELECT id, seq, outcome FROM done").fetchall()
    finished_seqs = {seq for _, seq, _ in done if seq is not None}
    out["queued"] = {tid for seq, tid in traj.items() if seq not in finished_seqs}
    out["consumed"] = {tid for tid, _, outcome in done if outcome == "consumed"}
    out["dropped"] = {tid for tid, _, outcome in done if outcome != "consumed"}
    out["all"] = set(traj.values()) | {tid for tid, _, _ in done}
    return out


def consumed_steps(run_dir: Path) -> tuple[dict[int, list[str]], dict[int, int], list[dict]]:
    """(final ids per step, attempts per step, all rows) from RUN_DIR/consumed.jsonl."""
    path = run_dir / "consumed.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    final, tries = {}, {}
    for r in rows:
        final[r["step"]] = r["ids"]
        tries[r["step"]] = tries.get(r["step"], 0) + 1
    return final, tries, rows


def account(drill: Drill) -> dict:
    """lost, duplicated, steps redone and version continuity of the drill's run directory."""
    run_dir = drill.run_dir
    final, tries, rows = consumed_steps(run_dir)
    learned = [tid for s in sorted(final) for tid in final[s]]
    wal = wal_ids(run_dir / "queue.db")
    acknowledged = drill.acknowledged | wal["all"] | {tid for r in rows for tid in r["ids"]}
    accounted = set(learned) | wal["queued"] | wal["dropped"]
    metrics = run_dir / "metrics" / "metrics.jsonl"
    learn_steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
                   if line.strip() and "learn/loss" in line] if metrics.is_file() else []
    versions = checkpoint_versions(run_dir)
    return {
        "steps_learned": len(final),
        "steps_redone": sum(n - 1 for n in tries.values()),
        "trajectories_learned": len(learned),
        "trajectories_lost": len(acknowledged - accounted),
        "trajectories_duplicated": len(learned) - len(set(learned)),
        "versions_continuous": (learn_steps == list(range(1, len(learn_steps) + 1))
                                and sorted(final) == learn_steps
                                and all(v - s == 0 for s, v in versions.items())),
        "checkpoint_versions": versions,
    }


def checkpoint_versions(run_dir: Path) -> dict[int, int]:
    """step -> policy_version of every COMMITTED checkpoint (sync mode: equal)."""
    out = {}
    for d in sorted((run_dir / "checkpoints").glob("step_*")):
        manifest = d / "COMMITTED"
        if manifest.is_file():
            try:
                m = json.loads(manifest.read_text())
                out[int(m["step"])] = int(m["policy_version"])
            except (ValueError, KeyError):
                continue
    return out


def recovery_time(drill: Drill) -> float | None:
    """Seconds from the first injection to the first learner step completed after it (its line in
    consumed.jsonl), restarts included."""
    events = drill.injections()
    if not events:
        return None
    t_inj = min(e["time"] for e in events)
    _, _, rows = consumed_steps(drill.run_dir)
    done = [r["time"] for r in rows if r["time"] >= t_inj]
    return round(min(done) - t_inj, 2) if done else None


def last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def clear_run_dir(path: Path) -> None:
    """Remove a previous drill's run directory (only one holding a drill's own files)."""
    if path.exists():
        if not (path / EVENTS).exists() and not (path / "drill_attempt1.log").exists():
            raise ValueError(f"drill: {path} exists and is not a drill's run directory; choose another --run-dir")
        shutil.rmtree(path)
