"""The drills of `megatron-rl drill`: how each fault is injected and what counts as detected/recovered.

    megatron-rl drill worker_crash --config configs/tiny_cpu_scratch.yaml

Each runner takes a `Drill` (drill/harness.py: its run directory and attempts), runs the training
attempts the recovery protocol needs (RUNBOOK.md, "Fault drills") and returns the drill-specific
part of the record: detected_by, action, recovered, and its evidence.  The accounting common to
every drill (lost, duplicated, versions, time to recover) is drill/accounting.py `account`.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from megatron_rl.drill import streaming
from megatron_rl.drill.accounting import account, recovery_time
from megatron_rl.drill.harness import ENGINE_PROCESS, Drill

EXIT_REQUEUE, EXIT_OOM = 75, 87


def _finished(drill: Drill, attempt) -> bool:
    summary = attempt.summary
    return attempt.returncode == 0 and summary.get("steps") == drill.cfg.steps


def _first_line(text: str, pattern: str) -> str | None:
    m = re.search(pattern, text)
    if not m:
        return None
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = text[start:end if end >= 0 else None]
    return line.split(" WARNING ", 1)[-1].split(" ERROR ", 1)[-1].split(" INFO ", 1)[-1].strip()


def bad_checkpoint(drill: Drill) -> dict:
    """Train to at_step (checkpoints every 2 steps), damage the newest checkpoint (variant: flip
    bytes of a weights file, truncate the queue snapshot, or drop its COMMITTED manifest), rerun to
    `steps`: the rerun must name the damage and resume from the previous checkpoint."""
    cfg = drill.cfg
    if cfg.from_run:
        copy_run(Path(cfg.from_run), drill.run_dir)
        drill.keep_wal_ids()
    else:
        first = drill.train(steps=cfg.at_step)
        if first.returncode != 0:
            return {"detected_by": None, "action": f"the run before the damage failed (exit {first.returncode})",
                    "recovered": False}
    ckpt = drill.run_dir / "checkpoints" / f"step_{cfg.at_step:06d}"
    variant = cfg.variant or "flip"
    damaged = damage_checkpoint(ckpt, variant)
    drill.note_injection("bad_checkpoint", variant=variant, file=damaged)
    second = drill.train()
    fallback = drill.run_dir / "checkpoints" / f"step_{cfg.at_step - 2:06d}"
    named = _first_line(second.stderr, re.escape(damaged)) if variant != "uncommit" else \
        _first_line(second.stderr, r"resumed from")
    resumed = f"resumed from {fallback}" in second.stderr
    loaded_bad = f"resumed from {ckpt}" in second.stderr
    return {"injected_at": {"checkpoint": ckpt.name, "variant": variant, "file": damaged},
            "detected_by": "checkpoint verification on resume (sha256 against COMMITTED)" if named else None,
            "evidence": named,
            "action": f"fell back to {fallback.name}" if resumed else "no fallback",
            "recovered": _finished(drill, second) and resumed and not loaded_bad}


def copy_run(src: Path, dst: Path) -> None:
    """Copy a finished run's directory (its checkpoints, queue, metrics and consumed ids)."""
    for item in src.iterdir():
        if item.name.startswith("drill_"):
            continue
        target = dst / item.name
        if item.is_dir():
            shutil.copytree(item, target, symlinks=True)
        else:
            shutil.copy2(item, target)


def damage_checkpoint(ckpt: Path, variant: str) -> str:
    """Damage one file of `ckpt`; returns its path relative to the checkpoint."""
    if variant == "flip":
        target = max((ckpt / "weights").rglob("*.distcp"), key=lambda p: p.stat().st_size)
        data = bytearray(target.read_bytes())
        for i in range(len(data) // 2, len(data) // 2 + 16):
            data[i] ^= 0xFF
        target.write_bytes(bytes(data))
    elif variant == "truncate":
        target = ckpt / "queue_snapshot.db"
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
    elif variant == "uncommit":
        target = ckpt / "COMMITTED"
        target.unlink()
    else:
        raise ValueError(f"drill bad_checkpoint: variant must be flip, truncate or uncommit, got {variant!r}")
    return target.relative_to(ckpt).as_posix()


def oom(drill: Drill, times: int = 1) -> dict:
    """An out-of-memory error inside learner step at_step (`times` attempts fail): one failure is
    retried at half the micro-batch size and the run finishes; two end the run with exit 87."""
    cfg = drill.cfg
    run = drill.train(fault={"fault": "oom", "at_step": cfg.at_step, "times": times})
    log = drill.log()
    detected = _first_line(log, r"out of memory at micro_batch_size \d+")  # the driver's line
    if times == 1:
        rows = {r["step"]: r for r in drill.metric_rows()}
        retried = rows.get(cfg.at_step + 1, {}).get("numerics/oom_retries")
        return {"detected_by": "LearnerWorker.train_step (torch.OutOfMemoryError)" if detected else None,
                "evidence": detected,
                "action": "step abandoned (no optimizer step), retried at half the micro-batch size "
                          "(same global batch by gradient accumulation)" if retried == 1.0 else "none",
                "recovered": _finished(drill, run) and retried == 1.0}
    # The documented remedy: rerun with a smaller micro-batch; it resumes from the newest checkpoint.
    stopped = _first_line(run.stderr, r"megatron-rl train: error: stopped: ")
    clean = run.returncode == EXIT_OOM and stopped is not None
    smaller = "learner.micro_batch_size=16"
    rerun = drill.train(extra=(smaller,)) if clean else None
    resumed = rerun is not None and _first_line(rerun.stderr, r"resumed from \S+")
    return {"detected_by": "LearnerWorker.train_step (torch.OutOfMemoryError, twice)" if detected else None,
            "evidence": stopped, "first_exit": run.returncode, "clean_stop": clean,
            "action": f"clean stop with exit {run.returncode}; rerun with {smaller}: {resumed or 'no resume'}",
            "recovered": bool(rerun is not None and resumed and _finished(drill, rerun))}


def _arm_verifier_timeout(cfg) -> tuple[dict, tuple]:
    return {"fault": "verifier_timeout", "fraction": float(cfg.variant or 0.05)}, ("reward.timeout_s=0.5",)


def _judge_verifier_timeout(drill: Drill, run, cfg) -> dict:
    """A share (variant, default 0.05) of grading calls hang; each must be cut at reward.timeout_s,
    error-coded, excluded from the loss and counted, while the run goes on."""
    share = float(cfg.variant or 0.05)
    hung = len(drill.injections("verifier_timeout"))
    rows = drill.metric_rows()
    counted = max((r.get("latency/verifier_timeout", 0.0) for r in rows), default=0.0)

    def mean(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return round(sum(vals) / len(vals), 3) if vals else None

    return {"injected_at": {"share_of_grading_calls": share, "hung_calls": hung},
            "detected_by": "VerifierPool per-call timeout (reward.timeout_s)" if counted else None,
            "action": "hung graders killed and replaced; samples error-coded 'timeout', excluded, counted",
            "timeouts_counted": int(counted),
            "verifier_error_rate": mean("latency/verifier_error_rate"),
            "raw_tps": mean("system/generated_tokens_per_s"), "esr": mean("system/esr"),
            "effective_tps": mean("system/effective_tokens_per_s"),
            "recovered": _finished(drill, run) and hung > 0 and int(counted) >= 1}


def worker_crash(drill: Drill) -> dict:
    """SIGKILL of learner rank 0 at learner step at_step: the driver must exit 75 within
    run.learner_timeout_s, and rerunning the same command resumes from the newest COMMITTED
    checkpoint with continuous steps.  (The vLLM-engine variant is not automated here.)"""
    cfg = drill.cfg
    first = drill.train(fault={"fault": "learner_kill", "at_step": cfg.at_step, "rank": 0})
    events = drill.injections()
    fail_fast_s = round(first.ended - min(e["time"] for e in events), 1) if events else None
    detected = _first_line(first.stderr, r"learner rank \d+ died")
    second = drill.train()
    resumed = _first_line(second.stderr, r"resumed from \S+")
    return {"injected_at": {"step": cfg.at_step, "learner_rank": 0, "signal": "SIGKILL"},
            "detected_by": "LearnerGroup call (Ray actor died)" if detected else None,
            "evidence": detected, "first_exit": first.returncode, "fail_fast_s": fail_fast_s,
            "action": f"exit {first.returncode}, rerun: {resumed}",
            "recovered": first.returncode == EXIT_REQUEUE and resumed is not None and _finished(drill, second)}


def _arm_bad_refit(cfg) -> tuple[dict, tuple]:
    return {"fault": "permute_load", "at_version": cfg.at_step + 1}, ()


def _judge_bad_refit(drill: Drill, run, cfg) -> dict:
    """Publication at_step+1 verifies byte for byte but is loaded with one matrix's rows reversed: the
    refit check (engine vs learner logprobs on the probe) must refuse it, the group roll back to the
    version before, the version be published again, and the run go on with continuous versions."""
    version = cfg.at_step + 1
    log = drill.log()
    detected = _first_line(log, rf"refit check: version {version} loaded")
    again = _first_line(log, rf"publishing version {version} again")
    return {"injected_at": {"version": version, "load": "first matrix's rows reversed"},
            "detected_by": "refit check after publication (engine vs learner logprobs on the probe)"
            if detected else None,
            "evidence": detected, "action": f"group rolled back to version {version - 1}; version {version} "
                                            "published again" if again else "none",
            "recovered": _finished(drill, run) and again is not None}


def _engine_deaths(drill: Drill) -> float:
    """Engine-core kills armed in the drill's run (drills run together may arm two): one restart each."""
    return float(sum(f in ("engine_kill", "engine_kill_publish") for f in drill.armed) or 1)


def _first_line_after(text: str, anchor: str, pattern: str) -> str | None:
    """The first line matching `pattern` after the first line matching `anchor`."""
    m = re.search(anchor, text)
    return _first_line(text[m.end():], pattern) if m else None


def _arm_engine_crash(cfg) -> tuple[dict, tuple]:
    return {"fault": "engine_kill", "at_step": cfg.at_step}, ENGINE_PROCESS


def _judge_engine_crash(drill: Drill, run, cfg) -> dict:
    """SIGKILL of the vLLM engine-core process of the rollout group generating round at_step, with its
    requests in flight: the fleet must restart the group, keep it stale until a publication of the
    current version committed on it (checksums and refit check), retry the in-flight requests, and
    the run go on in the same attempt; no sample stamped with another version than its round's."""
    events = drill.injections("engine_kill")
    log = drill.log()
    detected = _first_line(log, r"vLLM engine died during generation")
    refitted = _first_line_after(log, r"vLLM engine died during generation", r"refitted: serving policy version \d+")
    last = (drill.metric_rows() or [{}])[-1]
    restarts, retried = last.get("system/engine_restarts"), last.get("system/requests_retried")
    off_version = samples_off_version(drill.run_dir / "queue.db")
    in_flight = events[0].get("in_flight_requests") if events else None
    return {"injected_at": {"round": cfg.at_step, "signal": "SIGKILL", "process": "vLLM EngineCore",
                            "requests_in_flight": in_flight},
            "detected_by": "RolloutFleet.collect (the generate call failed with EngineDeadError)" if detected else None,
            "evidence": detected, "refit": refitted, "engine_restarts": restarts, "requests_retried": retried,
            "samples_off_version": off_version,
            "action": "group restarted stale, refitted with the current version before serving, in-flight "
                      "requests retried" if refitted else "none",
            "recovered": (_finished(drill, run) and bool(in_flight) and restarts == _engine_deaths(drill) and bool(retried)
                          and refitted is not None and off_version == 0)}


PARTITION_TIMEOUT_S = 6.0  # rollout.publish_timeout_s of the partition drill; the stop lasts longer


def _arm_engine_crash_publish(cfg) -> tuple[dict, tuple]:
    return {"fault": "engine_kill_publish", "at_version": cfg.at_step + 1}, ENGINE_PROCESS


def _judge_engine_crash_publish(drill: Drill, run, cfg) -> dict:
    """SIGKILL of a group's vLLM engine-core process as publication at_step+1 begins (issue 30 defect 6):
    the same path as a death during generation -- the group restarted stale, the version published
    again (its refit), the run going on in the same attempt, no sample off its version."""
    log = drill.log()
    detected = _first_line(log, r"vLLM engine died during publication")
    refitted = _first_line_after(log, r"vLLM engine died during publication", r"refitted: serving policy version \d+")
    last = (drill.metric_rows() or [{}])[-1]
    restarts = last.get("system/engine_restarts")
    off_version = samples_off_version(drill.run_dir / "queue.db")
    return {"injected_at": {"version": cfg.at_step + 1, "signal": "SIGKILL", "process": "vLLM EngineCore"},
            "detected_by": "Policy.publish (RolloutFleet.restart_dead: engine_alive False)" if detected else None,
            "evidence": detected, "refit": refitted, "engine_restarts": restarts, "samples_off_version": off_version,
            "action": "group restarted stale, the version published again (its refit)" if refitted else "none",
            "recovered": (_finished(drill, run) and restarts == _engine_deaths(drill) and refitted is not None
                          and off_version == 0)}


def partition(drill: Drill) -> dict:
    """Two rollout groups; the first to receive publication at_step+1 stops answering (SIGSTOP of its
    actor and vLLM processes) for `variant` seconds (default 15), longer than rollout.publish_timeout_s:
    the publication must give up on it after the timeout, leave it out (stale, unreachable), the other
    group go on training, and the stopped group -- once it answers again -- be refitted before it
    serves; no sample of another version than its round's, in the same attempt."""
    cfg = drill.cfg
    version, seconds = cfg.at_step + 1, float(cfg.variant or 15.0)
    if seconds <= PARTITION_TIMEOUT_S:
        raise ValueError(f"drill partition: the stop ({seconds:g} s) must outlast rollout.publish_timeout_s "
                         f"({PARTITION_TIMEOUT_S:g} s)")
    run = drill.train(fault={"fault": "engine_stop", "at_version": version, "seconds": seconds},
                      extra=("rollout.data_parallel_size=2", f"rollout.publish_timeout_s={PARTITION_TIMEOUT_S:g}"))
    log = drill.log()
    detected = _first_line(log, r"rollout group \d+ did not answer")
    back = _first_line(log, r"rollout group \d+ answers again")
    refitted = _first_line(log, r"refitted: serving policy version \d+")
    rows = drill.metric_rows()
    last = rows[-1] if rows else {}
    while_out = sum(1 for r in rows if r.get("system/unreachable_rollout_groups") == 1.0)
    off_version = samples_off_version(drill.run_dir / "queue.db")
    return {"injected_at": {"version": version, "signal": "SIGSTOP, SIGCONT after %g s" % seconds,
                            "process": "rollout actor + vLLM engine processes",
                            "publish_timeout_s": PARTITION_TIMEOUT_S},
            "detected_by": "publication timeout (rollout.publish_timeout_s)" if detected else None,
            "evidence": detected, "returned": back, "refit": refitted,
            "steps_while_unreachable": while_out, "partitions": last.get("system/rollout_partitions"),
            "samples_off_version": off_version,
            "action": "group left out of publication and generation (stale), refitted once it answered"
                      if refitted else "none",
            "recovered": (_finished(drill, run) and detected is not None and back is not None
                          and refitted is not None and while_out >= 1 and off_version == 0
                          and last.get("system/rollout_partitions") == 1.0
                          and last.get("system/unreachable_rollout_groups") == 0.0
                          and last.get("system/stale_rollout_groups") == 0.0)}


def _arm_coordinator_stop(cfg) -> tuple[dict, tuple]:
    return {"fault": "coordinator_stop", "at_step": cfg.at_step, "seconds": float(cfg.variant or 10.0)}, ()


def _judge_coordinator_stop(drill: Drill, run, cfg) -> dict:
    """SIGSTOP of the coordinator actor's process for `variant` seconds (default 10) at the first put of
    round at_step, before it is applied: the producer's put and the learner's take wait on it (Ray calls,
    no timeout below coordinator take_timeout_s); once it continues, the put lands exactly once (put_many
    is idempotent by id, the WAL holds it) and the run finishes in the same attempt."""
    seconds = float(cfg.variant or 10.0)
    events = drill.injections("coordinator_stop")
    waited = recovery_time(drill, "coordinator_stop")
    return {"injected_at": {"round": cfg.at_step, "signal": f"SIGSTOP, SIGCONT after {seconds:g} s",
                            "process": "coordinator actor", "trajectories_in_the_put":
                                events[0].get("trajectories") if events else None},
            "detected_by": "nothing needed: the producer's put and the learner's take wait on the actor",
            "waited_s": waited,
            "action": "waited; the put applied once when the coordinator continued",
            "recovered": _finished(drill, run) and bool(events) and waited is not None and waited >= seconds * 0.9}


def samples_off_version(db: Path) -> int | None:
    """Trajectories (queued or finished) whose oldest policy version is not their round's (sync mode:
    round r is sampled with version r; an engine serving an unknown version would break it)."""
    import sqlite3

    if not db.is_file():
        return None
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT id, min_version FROM traj UNION SELECT id, min_version FROM done").fetchall()
    return sum(1 for tid, version in rows if int(tid.split("/", 1)[0].removeprefix("r")) != int(version))


# Drills of one training run with a hook-armed fault: how each arms it (fault spec, extra overrides) and
# judges the run.  They may also run together in one run (drill/together.py).
SINGLE_RUN = {
    "verifier_timeout": (_arm_verifier_timeout, _judge_verifier_timeout),
    "bad_refit": (_arm_bad_refit, _judge_bad_refit),
    "engine_crash": (_arm_engine_crash, _judge_engine_crash),
    "engine_crash_publish": (_arm_engine_crash_publish, _judge_engine_crash_publish),
    "coordinator_stop": (_arm_coordinator_stop, _judge_coordinator_stop),
}


# Streaming drills (drill/streaming.py): one run each, not combinable (one arms no fault, one ends the run).
STREAMING = {
    "refit_mid_generation": (streaming.arm_refit_mid_generation, streaming.judge_refit_mid_generation),
    "refit_stale_kv": (streaming.arm_refit_stale_kv, streaming.judge_refit_stale_kv),
    "refit_engine_death": (streaming.arm_refit_engine_death, streaming.judge_refit_engine_death),
}


def _single(name: str, table: dict = SINGLE_RUN):
    def runner(drill: Drill) -> dict:
        arm, judge = table[name]
        fault, extra = arm(drill.cfg)
        return judge(drill, drill.train(fault=fault, extra=extra), drill.cfg)
    return runner


RUNNERS = {
    **{name: _single(name) for name in SINGLE_RUN},
    **{name: _single(name, STREAMING) for name in STREAMING},
    "partition": partition,
    "bad_checkpoint": bad_checkpoint,
    "oom": oom,
    "oom_twice": lambda d: oom(d, times=2),
    "worker_crash": worker_crash,
}


def run_drill(cfg: DrillConfig) -> dict:
    """Run one drill and return its record."""
    drill = Drill(cfg)
    t0 = time.time()
    record = {"fault": cfg.name, "injected_at": {"step": cfg.at_step}}
    record.update(RUNNERS[cfg.name](drill))
    record.update(account(drill))
    record["time_to_recover_s"] = recovery_time(drill) if record.get("recovered") else None
    record["attempts"] = [{"exit": a.returncode, "seconds": round(a.ended - a.started, 1)} for a in drill.attempts]
    record["wall_s"] = round(time.time() - t0, 1)
    record["run_dir"] = str(drill.run_dir)
    return record
