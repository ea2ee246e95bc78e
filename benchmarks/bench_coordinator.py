"""Coordinator throughput: put_many + take with the SQLite WAL vs the same queue in memory.

    python benchmarks/bench_coordinator.py [--n 20000] [--batch 64] [--tokens 1024]

Trajectories are realistic in size: `--tokens` tokens each (1/4 prompt, 3/4 response), so
~11 KB on the wire.  Each round puts one batch (put_many: validate + one WAL transaction)
and takes one batch (take: one WAL transaction), as producers and the learner would.  The
same pre-built trajectories go through three queues side by side in one run: in memory,
WAL with synchronous=NORMAL, WAL with synchronous=FULL.  Prints trajectories/s (one
trajectory = one put + one take) and the ratio to the in-memory queue, per wall second
and per CPU second.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from megatron_rl.coordinator import CoordinatorConfig, TrajectoryQueue
from megatron_rl.trajectory import make_trajectory

TOKENIZER = "b" * 64


def build(n: int, tokens: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    p = tokens // 4
    r = tokens - p
    now = time.time()
    return [make_trajectory(id=f"traj-{i}", prompt_id=f"prompt-{i // 8}", dataset_version="bench@1",
                            policy_versions=0, tokenizer_hash=TOKENIZER,
                            prompt_tokens=rng.integers(0, 32000, p), response_tokens=rng.integers(0, 32000, r),
                            behavior_logprobs=-rng.random(r), sampling_config={"temperature": 1.0, "top_p": 1.0},
                            reward_components={"correct": float(i % 2), "format": 0.1}, grader_version="bench@1",
                            terminal_reason="eos", rollout_started_at=now, scored_at=now)
            for i in range(n)]


def run(trajs: list, batch: int, wal_path: str, synchronous: str = "FULL") -> tuple[float, float]:
    """Returns (trajectories per wall second, trajectories per CPU second of this process)."""
    cfg = CoordinatorConfig(batch_size=batch, max_staleness=len(trajs), wal_path=wal_path,
                            wal_synchronous=synchronous)
    queue = TrajectoryQueue(cfg, tokenizer_hash=TOKENIZER)
    taken = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for step, i in enumerate(range(0, len(trajs), batch)):
        res = queue.put_many(trajs[i : i + batch])
        assert len(res.accepted) == len(trajs[i : i + batch]), res
        taken += len(queue.take(batch, request_id=f"step-{step}"))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    queue.close()
    assert taken == len(trajs), (taken, len(trajs))
    return len(trajs) / elapsed, len(trajs) / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000, help="trajectories per queue")
    parser.add_argument("--batch", type=int, default=64, help="trajectories per put_many / take")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per trajectory")
    args = parser.parse_args()
    trajs = build(args.n, args.tokens)
    print(f"{args.n} trajectories x {args.tokens} tokens ({len(trajs[0].to_bytes())} bytes each), "
          f"batch {args.batch}")
    with tempfile.TemporaryDirectory() as tmp:
        memory = run(trajs, args.batch, "")
        normal = run(trajs, args.batch, str(Path(tmp) / "normal.db"), "NORMAL")
        full = run(trajs, args.batch, str(Path(tmp) / "full.db"), "FULL")
    print("(wall = trajectories per second of elapsed time; cpu = per second of this process's CPU time,")
    print(" which discounts other load on a shared machine but also hides fsync waits)")
    for name, (wall, cpu) in (("in-memory queue", memory), ("WAL synchronous=NORMAL", normal),
                              ("WAL synchronous=FULL", full)):
        print(f"{name:24s}: wall {wall:8.0f} /s  cpu {cpu:8.0f} /s   "
              f"ratio to in-memory: wall {wall / memory[0]:.3f}  cpu {cpu / memory[1]:.3f}")

if __name__ == "__main__":
    main()
