"""The coordinator under load with random SIGKILLs: nothing lost, nothing consumed twice.

    python benchmarks/coordinator_load.py [--duration 120] [--producers 8] [--consumers 2]
                                                      [--kill-every 8 20] [--seed 0] [--json]

The coordinator is the real Ray actor (`start_coordinator`: SQLite WAL, max_restarts=-1,
max_task_retries=-1) in its own process.  `--producers` threads each put batches of
trajectories (unique ids) and record the ids whose put_many was acknowledged (accepted, or
reported as a duplicate of what an interrupted call already stored); `--consumers` threads
take batches with their own request ids ("c<k>-step-<n>") and record every id they received.
A killer thread SIGKILLs the actor's process by PID at random intervals (uniform in
`--kill-every LO HI` seconds); Ray restarts it, the new instance replays the log and the
interrupted calls are retried.  After `--duration` seconds the producers stop, the consumers
drain the queue, and the ids are counted:

    lost        acknowledged ids never received and not queued (must be 0)
    duplicated  ids received more than once, across all consumers and actor lives (must be 0)
    throughput  trajectories consumed per second of load (acknowledged ones per second too)
    kills       SIGKILLs delivered (each answered by a restarted actor with a new PID)

Prints one line per figure, or one JSON object with --json; exits 1 if anything was lost or
duplicated.  tests/e2e/test_coordinator_load.py runs it for a short duration.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rl.coordinator import CoordinatorConfig, start_coordinator
from megatron_rl.trajectory import make_trajectory

logger = logging.getLogger("coordinator_load")
TOK = "b" * 64
CALL_TIMEOUT_S = 180.0  # one call may wait out a restart (Ray restarts the actor, then retries)


@dataclass
class Tally:
    """What the threads saw; every field is guarded by `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    acked: set = field(default_factory=set)
    received: list = field(default_factory=list)
    pids: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    puts: int = 0
    takes: int = 0


def _traj(tid: str, response_len: int):
    now = time.time()
    return make_trajectory(id=tid, prompt_id=tid.rsplit("-", 1)[0], dataset_version="d", policy_versions=0,
                           tokenizer_hash=TOK, prompt_tokens=list(range(16)),
                           response_tokens=list(range(response_len)), behavior_logprobs=[-0.3] * response_len,
                           reward_components={"r": 1.0}, grader_version="g", terminal_reason="eos",
                           rollout_started_at=now, scored_at=now)


def _produce(ray, coord, worker: int, batch: int, stop: threading.Event, tally: Tally, response_len: int) -> None:
    b = 0
    try:
        while not stop.is_set():
            trajs = [_traj(f"w{worker}-{b}-{i}", response_len) for i in range(batch)]
            res = ray.get(coord.put_many.remote(trajs), timeout=CALL_TIMEOUT_S)
            if res.rejected or res.conflicts or res.dropped:
                raise AssertionError(f"producer {worker}: rejected {res.rejected}, conflicts {res.conflicts}, "
                                     f"dropped {res.dropped}")
            with tally.lock:
                tally.acked.update(res.accepted + res.duplicates)
                tally.puts += 1
            b += 1
    except Exception as err:  # noqa: BLE001 - reported by main()
        tally.errors.append(f"producer {worker}: {err!r}")


def _consume(ray, coord, consumer: int, batch: int, producing: threading.Event, tally: Tally,
             drain_deadline: list) -> None:
    step = 0
    try:
        while True:
            got = ray.get(coord.take.remote(batch, request_id=f"c{consumer}-step-{step}"), timeout=CALL_TIMEOUT_S)
            with tally.lock:
                tally.received.extend(t.id for t in got)
                tally.takes += 1
            if got:
                step += 1
                continue
            if not producing.is_set():  # producers stopped and the queue gave nothing: drained
                if not ray.get(coord.queued_ids.remote(), timeout=CALL_TIMEOUT_S) or time.time() > drain_deadline[0]:
                    return
            time.sleep(0.01)
    except Exception as err:  # noqa: BLE001 - reported by main()
        tally.errors.append(f"consumer {consumer}: {err!r}")


def _kill_loop(ray, coord, stop: threading.Event, tally: Tally, lo: float, hi: float, rng: random.Random) -> None:
    try:
        while not stop.wait(rng.uniform(lo, hi)):
            os.kill(tally.pids[-1], signal.SIGKILL)
            pid = ray.get(coord.pid.remote(), timeout=CALL_TIMEOUT_S)  # served by the restarted actor
            with tally.lock:
                tally.pids.append(pid)
            logger.info("killed the coordinator; restarted as pid %d", pid)
    except Exception as err:  # noqa: BLE001 - reported by main()
        tally.errors.append(f"killer: {err!r}")


def run_load(*, duration_s: float, producers: int = 8, consumers: int = 2, batch: int = 8,
             kill_every: tuple[float, float] = (8.0, 20.0), seed: int = 0, workdir: str | Path,
             response_len: int = 48) -> dict:
    """Run the load with kills (Ray must be initialised); returns the counts described above."""
    import ray

    cfg = CoordinatorConfig(batch_size=batch, max_staleness=10_000, max_age_s=0, compact_every=64,
                            wal_path=str(Path(workdir) / "queue.db"))
    coord = start_coordinator(cfg, tokenizer_hash=TOK)
    tally = Tally(pids=[ray.get(coord.pid.remote(), timeout=CALL_TIMEOUT_S)])
    producing, stop_killing = threading.Event(), threading.Event()
    producing.set()
    drain_deadline = [float("inf")]
    stop_producing = threading.Event()
    threads = [threading.Thread(target=_produce, args=(ray, coord, w, batch, stop_producing, tally, response_len))
               for w in range(producers)]
    threads += [threading.Thread(target=_consume, args=(ray, coord, c, batch, producing, tally, drain_deadline))
                for c in range(consumers)]
    killer = threading.Thread(target=_kill_loop, args=(ray, coord, stop_killing, tally, *kill_every,
                                                       random.Random(seed)))
    start = time.time()
    for t in threads + [killer]:
        t.start()
    time.sleep(duration_s)
    stop_killing.set()
    killer.join(timeout=CALL_TIMEOUT_S)
    stop_producing.set()
    for t in threads[:producers]:
        t.join(timeout=CALL_TIMEOUT_S)
    load_s = time.time() - start
    drain_deadline[0] = time.time() + CALL_TIMEOUT_S
    producing.clear()
    for t in threads[producers:]:
        t.join(timeout=2 * CALL_TIMEOUT_S)
    queued = ray.get(coord.queued_ids.remote(), timeout=CALL_TIMEOUT_S)
    metrics = ray.get(coord.metrics.remote(), timeout=CALL_TIMEOUT_S)
    hung = [t.name for t in threads + [killer] if t.is_alive()]
    received = set(tally.received)
    return {
        "duration_s": round(load_s, 1), "producers": producers, "consumers": consumers,
        "kills": len(tally.pids) - 1, "restarts_seen": len(set(tally.pids)) - 1,
        "acknowledged": len(tally.acked), "consumed": len(tally.received),
        "lost": len(tally.acked - received - set(queued)),
        "duplicated": len(tally.received) - len(received),
        "unacknowledged_received": len(received - tally.acked),
        "still_queued": len(queued),
        "throughput_consumed_per_s": round(len(tally.received) / load_s, 1),
        "throughput_acknowledged_per_s": round(len(tally.acked) / load_s, 1),
        "log_position": int(metrics["queue/log_position"]),
        "errors": tally.errors, "hung_threads": hung,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--consumers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="trajectories per put_many and per take")
    parser.add_argument("--kill-every", type=float, nargs=2, default=(8.0, 20.0), metavar=("LO", "HI"),
                        help="seconds between SIGKILLs, drawn uniformly from [LO, HI]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.producers < 1 or args.consumers < 1 or not 0 < args.kill_every[0] <= args.kill_every[1]:
        parser.error("--duration, --producers, --consumers must be positive and 0 < LO <= HI for --kill-every")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory(prefix="coordinator_load.") as workdir:
            out = run_load(duration_s=args.duration, producers=args.producers, consumers=args.consumers,
                           batch=args.batch, kill_every=tuple(args.kill_every), seed=args.seed, workdir=workdir)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:32s} {value}")
    ok = out["lost"] == 0 and out["duplicated"] == 0 and not out["errors"] and not out["hung_threads"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
