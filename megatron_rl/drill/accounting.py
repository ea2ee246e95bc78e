"""What a drill's run directory shows: trajectories lost and duplicated, steps redone, version continuity,
time to recover (the accounting rules: megatron_rl/drill/__init__.py).

    record = account(drill)     # drill: a harness.Drill after its attempts
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path


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


def account(drill) -> dict:
    """lost, duplicated, steps redone and version continuity of `drill`'s run directory (a harness.Drill)."""
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


def recovery_time(drill, fault: str | None = None) -> float | None:
    """Seconds from the first injection (of `fault`, if given) to the first learner step completed
    after it (its line in consumed.jsonl), restarts included."""
    events = drill.injections(fault)
    if not events:
        return None
    t_inj = min(e["time"] for e in events)
    _, _, rows = consumed_steps(drill.run_dir)
    done = [r["time"] for r in rows if r["time"] >= t_inj]
    return round(min(done) - t_inj, 2) if done else None
