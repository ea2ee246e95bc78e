"""Drills of streaming rollouts with in-flight refit (issue 27): publications land while sequences are half
generated, and the stale-cache bug, injected, must be caught by the audit.

    megatron-rl drill refit_mid_generation --config configs/tiny_cpu_scratch.yaml
    megatron-rl drill refit_stale_kv --config configs/tiny_cpu_scratch.yaml [--at-step 1]

Both run the tiny recipe in async mode with rollout.streaming on and long responses (200 tokens, EOS ignored)
on an engine that runs 8 sequences at once, so the admitted groups queue in it and every publication lands
while sequences are mid-response (`STREAMING`, as tests/e2e/test_streaming.py).

refit_mid_generation   no fault: the refits keep their requests (recompute: their KV recomputed under the new
                       weights); recovered when the run finishes, some refit kept requests, sequences that span
                       versions were trained on, and the accounting holds (0 lost, 0 duplicated, versions
                       continuous)
refit_stale_kv         the `stale_kv` hook (fault_hooks.py): from publication at_step+1 on, a recompute refit
                       skips the KV invalidation and says it happened, so kept requests attend to the old
                       weights' KV while their tokens are labelled as recomputed; with audit.every=1 the audit
                       re-scores those segments under their version and must stop the run (exit 89) naming one
refit_engine_death     the `engine_kill_refit` hook: the first refit to a version >= at_step+1 that keeps requests
                       SIGKILLs the group's vLLM engine core while generation is paused, before the new weights
                       load; the publication fails, the fleet restarts the group stale, publishes the version
                       again (its refit) and sends the requests that were in flight again; recovered when the
                       run finishes in the same attempt with one restart, the kept requests retried, no token
                       quarantined (every segment's digest is a committed publication's) and the accounting holds
"""

from __future__ import annotations

import re
import sqlite3

from megatron_rl.drill.harness import ENGINE_PROCESS, Drill

STREAMING = ("run.mode=async", "run.prompts_per_step=4", "run.group_size=4", "learner.micro_batch_size=16",
             "rollout.streaming=true", "rollout.inflight_refit=recompute", "rollout.max_tokens=200",
             "rollout.max_model_len=256", "rollout.ignore_eos=true", "rollout.engine_options.max_num_seqs=8")
EXIT_AUDIT = 89
KEPT = re.compile(r"refit to version (\d+) \(recompute\): (\d+) request\(s\) kept")


def _kept_by_refit(drill: Drill) -> dict[int, int]:
    """Requests each refit kept in flight, from the streaming actor's log (the last refit to a version)."""
    log = drill.run_dir / "logs" / "ray_StreamRolloutWorker.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    return {int(v): int(n) for v, n in KEPT.findall(text)}


def _spanning(drill: Drill) -> int:
    """Queued or learned trajectories whose response spans more than one policy version."""
    from megatron_rl.trajectory import Trajectory

    with sqlite3.connect(f"file:{drill.run_dir / 'queue.db'}?mode=ro", uri=True) as con:
        blobs = [row[0] for row in con.execute("SELECT payload FROM traj")]
    return sum(len(Trajectory.from_bytes(b).segments) > 1 for b in blobs)


def arm_refit_mid_generation(cfg) -> tuple[dict | None, tuple]:
    return None, STREAMING


def judge_refit_mid_generation(drill: Drill, run, cfg) -> dict:
    kept = _kept_by_refit(drill)
    trained_spanning = max((r.get("system/stream_multi_version_fraction", 0.0) for r in drill.metric_rows()),
                           default=0.0)
    summary = run.summary
    return {"injected_at": {"what": "publications while sequences are half generated (no fault)"},
            "detected_by": None, "requests_kept_per_refit": kept, "spanning_sequences_queued": _spanning(drill),
            "max_multi_version_fraction_trained": trained_spanning,
            "action": "refits kept their requests in flight, KV recomputed under the new weights",
            "recovered": (run.returncode == 0 and summary.get("steps") == cfg.steps and any(kept.values())
                          and trained_spanning > 0)}


def arm_refit_engine_death(cfg) -> tuple[dict, tuple]:
    return {"fault": "engine_kill_refit", "at_version": cfg.at_step + 1}, STREAMING + ENGINE_PROCESS


def judge_refit_engine_death(drill: Drill, run, cfg) -> dict:
    events = drill.injections("engine_kill_refit")
    log = drill.log()
    died = re.search(r"vLLM engine died during (generation|publication)[^\n]*", log)
    refitted = re.search(r"refitted: serving policy version \d+", log[died.end():]) if died else None
    rows = drill.metric_rows()
    last = rows[-1] if rows else {}
    quarantined = sum(r.get("learn/quarantined_trajectories", 0.0) for r in rows)
    summary = run.summary
    kept = events[0].get("in_flight_requests") if events else None
    return {"injected_at": {"version": events[0].get("version") if events else None, "signal": "SIGKILL",
                            "process": "vLLM EngineCore", "while": "paused for an in-flight refit",
                            "requests_kept": kept},
            "detected_by": f"RolloutFleet (engine died during {died.group(1)})" if died else None,
            "evidence": died.group(0) if died else None, "refit": refitted.group(0) if refitted else None,
            "engine_restarts": last.get("system/engine_restarts"), "requests_retried": last.get("system/requests_retried"),
            "quarantined_trajectories": quarantined,
            "action": "group restarted stale, the version published again, the kept requests sent again"
                      if refitted else "none",
            "recovered": (run.returncode == 0 and summary.get("steps") == cfg.steps and bool(kept)
                          and last.get("system/engine_restarts") == 1.0 and bool(last.get("system/requests_retried"))
                          and refitted is not None and quarantined == 0)}


def arm_refit_stale_kv(cfg) -> tuple[dict, tuple]:
    return {"fault": "stale_kv", "at_version": cfg.at_step + 1}, STREAMING + ("audit.every=1",)


def judge_refit_stale_kv(drill: Drill, run, cfg) -> dict:
    events = drill.injections("stale_kv")
    named = re.search(r"sequence \S+ segment \d+ \(tokens \[\d+, \d+\), version \d+, kv_version \d+, recompute\): "
                      r"max \|Δ\| \S+", run.stderr)
    summary = run.summary
    kept = [n for n in (e.get("in_flight_requests") for e in events) if n]
    return {"injected_at": {"version": cfg.at_step + 1, "refits_without_invalidation": len(events),
                            "requests_kept_on_stale_kv": sum(kept)},
            "detected_by": "the audit (audit.every=1: segments re-scored under their version)" if named else None,
            "evidence": named.group(0) if named else None, "stopped": summary.get("stopped"),
            "action": f"the run stopped with exit {run.returncode}, checkpointed" if named else "none",
            "recovered": bool(kept) and run.returncode == EXIT_AUDIT and named is not None}

