"""Streaming rollouts vs round-based rollouts in whole training runs, side by side (issue 27).

    flock /tmp/mrl-heavy.lock .venv/bin/python benchmarks/stream_training.py [--steps 10] [--stop-tokens 13]
    flock /tmp/mrl-heavy.lock .venv/bin/python benchmarks/stream_training.py --longtail [--budget 12000]

Both arms train the tiny recipe (configs/tiny_cpu_scratch.yaml) in async mode for the same steps with
the same seed.  Lengths: by default every response is exactly --tokens tokens (EOS ignored), so both
arms generate the same number of tokens and no round waits for a straggler; with --stop-tokens K, K
token ids end a response (about K/128 per token for the random tiny model), so lengths are long-tailed
up to --tokens (each arm then reports its own token count).  --longtail is issue 27's workload: a JSONL
task (written here) whose rows carry their own response budget (`max_tokens`, data/jsonl.py), 85% of
prompts 8 tokens and 15% --tokens (256), EOS ignored, so every response is exactly its prompt's budget;
both arms run until the same generated-token budget (stop.max_generated_tokens = --budget) is spent.
--set KEY=VALUE adds a config override to both arms; --pin L:R confines the learner to cores L and the
rollout engine to cores R in both arms (learner.cpu_cores, rollout.cpu_cores; e.g. --pin 0:1 on 2 cores).  The arms differ only in rollout.streaming (and with
it the rollout actor: one offline generate call per round, or vLLM's async engine with prompt groups streaming into batches and publications
landing in flight, rollout.inflight_refit recompute).  Start-up is excluded: the clock runs from the
first learner step's metrics to the last one's.  Printed: one JSON line per arm (loop seconds, steps,
generated tokens, generated tokens per second of loop, CPU seconds inside the clock -- the run's whole process
tree, its rollout engine's, the rest, and the engine's CPU ms per generated token (`CpuSampler`) --, mean taken
Δv, share of samples spanning versions, per-step phase seconds) and the ratio stream / rounds of tokens per second; an arm that fails
prints its error and the steps it ran instead, and there is no ratio.  --repeats N runs N pairs of arms,
alternating their order (rounds first, then streaming first, ...), so that a slow spell of the machine falls on
both: one JSON line per arm run, then the ratio of the arms' summed tokens over summed loop seconds, with each
pair's own ratio beside it (`pairs`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
SHORT = 8  # tokens of a short response (--longtail)


def longtail_task(root: Path, args) -> list[str]:
    """A digit_max-like JSONL task whose prompts carry their own response budget: SHORT tokens for 85% of
    them, --tokens for 15% (drawn with a fixed seed); the overrides that train on it."""
    rng, rows = random.Random(args.seed), []
    for number in rng.sample(range(10_000), 400):  # distinct questions: no split shares one
        digits = [int(c) for c in f"{number:04d}"]
        rows.append({"question": f"max({','.join(map(str, digits))})", "answer": str(max(digits)),
                     "max_tokens": args.tokens if rng.random() < args.long_share else SHORT})
    path = root / "longtail.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["data.task=jsonl", f"data.train_file={path}", f"stop.max_generated_tokens={args.budget}",
            "rollout.ignore_eos=true"]


def run(streaming: bool, args, root: Path, name: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """One arm: a training run in `root`/`name` (default "stream" or "rounds"), `extra` overrides last."""
    run_dir = root / (name or ("stream" if streaming else "rounds"))
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(REPO / "configs" / "tiny_cpu_scratch.yaml"),
           f"run.dir={run_dir}", "run.mode=async", f"run.steps={args.steps * (10 if args.longtail else 1)}", "run.prompts_per_step=4",
           "run.group_size=4", "learner.micro_batch_size=16", "run.eval_every=0", "run.checkpoint_every=0",
           "data.eval_size=8", f"rollout.max_tokens={args.tokens}", f"rollout.max_model_len={args.tokens + 56}",
           f"rollout.streaming={'true' if streaming else 'false'}", f"run.seed={args.seed}"]
    cmd += list(args.set) + list(extra)
    if args.pin:
        learner, rollout = args.pin.split(":")
        cmd += [f"learner.cpu_cores={learner}", f"rollout.cpu_cores={rollout}"]
    if args.longtail:
        cmd += longtail_task(root, args)
    elif args.stop_tokens:
        cmd += ["rollout.ignore_eos=false", f"rollout.stop_token_ids=[{','.join(str(40 + i) for i in range(args.stop_tokens))}]"]
    else:
        cmd += ["rollout.ignore_eos=true"]
    with open(root / f"{run_dir.name}.log", "w") as log, open(root / f"{run_dir.name}.out", "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=log, text=True)
        cpu = CpuSampler(proc, run_dir / "logs" / "driver.log")
        try:
            cpu.run(args.timeout)
        finally:
            proc.kill()
            proc.wait()
    metrics = run_dir / "metrics" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    learn = [r for r in rows if "learn/loss" in r]
    if proc.returncode != 0:  # reported, not hidden: the error and the steps it ran
        errors = [line for line in (root / f"{run_dir.name}.log").read_text().splitlines() if "Error:" in line]
        return {"arm": run_dir.name, "failed": errors[-1] if errors else f"exit {proc.returncode}",
                "steps": len(learn), "per_step_s": phase_means(learn[1:])}
    loop_s = learn[-1]["time"] - learn[0]["time"]
    tokens = sum(r["system/generated_tokens"] for r in learn[1:])  # generated for the steps inside the clock
    run_cpu, engine_cpu = cpu.between(learn[0]["time"], learn[-1]["time"])
    return {"arm": run_dir.name, "loop_s": round(loop_s, 2), "steps": len(learn), "generated_tokens": tokens,
            "tok_s": round(tokens / loop_s, 1),
            "cpu_s": {"run": round(run_cpu, 2), "engine": round(engine_cpu, 2), "rest": round(run_cpu - engine_cpu, 2),
                      "engine_ms_per_token": round(1000 * engine_cpu / max(tokens, 1), 3)},
            "taken_dv_mean": round(sum(r["queue/taken_dv/p50"] for r in learn) / len(learn), 2),
            "multi_version_fraction": round(sum(r.get("system/stream_multi_version_fraction", 0.0) for r in learn)
                                            / len(learn), 3),
            "per_step_s": phase_means(learn[1:])}


class CpuSampler:
    """CPU seconds (user + system) of a run while it runs, sampled every `every` s: the whole process tree of its
    CLI (the driver, the Ray cluster it starts, learner ranks, the rollout engine, the coordinator, verifiers) and
    the rollout engine's process with its children (the one the driver logs: "rollout engines up: group 0 in
    process P").  Each process counts with the last CPU time seen of it, so one that exits keeps what it used."""

    ENGINE = re.compile(r"rollout engines up: group 0 in process (\d+) ")

    def __init__(self, proc: subprocess.Popen, driver_log: Path, every: float = 0.25):
        self.proc, self.driver_log, self.every = proc, driver_log, every
        self.engine_pid: int | None = None
        self.samples: list[tuple[float, float, float]] = []  # (time, run CPU s, engine CPU s)
        self.last: dict[int, float] = {}  # pid -> its CPU seconds when last seen
        self.engine_pids: set[int] = set()

    def run(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        root = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.proc.args, timeout)
            if self.engine_pid is None and self.driver_log.exists():
                found = self.ENGINE.search(self.driver_log.read_text(errors="replace"))
                self.engine_pid = int(found.group(1)) if found else None
            tree: list = []
            try:
                tree = [root, *root.children(recursive=True)]
                if self.engine_pid is not None:
                    engine = psutil.Process(self.engine_pid)
                    self.engine_pids.update([engine.pid, *(c.pid for c in engine.children(recursive=True))])
            except psutil.NoSuchProcess:
                pass
            for p in tree:
                try:
                    t = p.cpu_times()
                    self.last[p.pid] = t.user + t.system
                except psutil.Error:
                    continue
            engine_s = sum(self.last.get(p, 0.0) for p in self.engine_pids)
            self.samples.append((time.time(), sum(self.last.values()), engine_s))
            time.sleep(self.every)

    def between(self, t0: float, t1: float) -> tuple[float, float]:
        """(run, engine) CPU seconds from the last sample at or before t0 to the first at or after t1."""
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t1] or self.samples[-1:]
        return after[0][1] - before[-1][1], after[0][2] - before[-1][2]


def phase_means(rows: list[dict]) -> dict:
    """Mean seconds per step inside the clock: the driver's phases (step, score, learn, publish; the rest of
    a step is waiting for the batch) and, streaming, the producer's summed per-group admit/generate/grade, its
    verifier calls per graded group, and the learner's wait for its batch: too few groups finished (wait_groups)
    or enough, but one about to leave the version window still generating (wait_window)."""
    keys = [f"system/time_{k}_s" for k in ("step", "score", "learn", "publish", "audit", "driver_cpu")]
    keys += [f"system/stream_{k}_s" for k in ("admit", "generate", "grade", "wait_groups", "wait_window")]
    keys += ["system/stream_grade_calls_per_group"]
    return {k.removeprefix("system/").removesuffix("_s"): round(sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1), 4)
            for k in keys if any(k in r for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=None,
                    help="response length (EOS ignored); --longtail: the long responses' (default 200, longtail 256)")
    ap.add_argument("--stop-tokens", type=int, default=0, help="token ids that end a response (0: fixed lengths)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per arm")
    ap.add_argument("--longtail", action="store_true", help=f"85%% of prompts {SHORT} tokens, the rest --tokens")
    ap.add_argument("--long-share", type=float, default=0.15, help="share of long prompts (--longtail)")
    ap.add_argument("--budget", type=int, default=12000, help="generated tokens per arm (--longtail)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for both arms, e.g. coordinator.max_staleness=4 (repeatable)")
    ap.add_argument("--pin", default=None, metavar="L:R",
                    help="learner cores L, rollout cores R in both arms (e.g. 0:1); default: unpinned")
    ap.add_argument("--repeats", type=int, default=1, help="pairs of arms, in alternating order (default 1)")
    ap.add_argument("--keep", type=Path, default=None, help="keep both runs' directories here (profiling)")
    args = ap.parse_args()
    args.tokens = args.tokens or (256 if args.longtail else 200)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.pin is not None and args.pin.count(":") != 1:
        ap.error(f"--pin takes LEARNER_CORES:ROLLOUT_CORES, e.g. 0:1; got {args.pin!r}")
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for i in range(args.repeats):
            tag = "" if args.repeats == 1 else str(i)
            order = (False, True) if i % 2 == 0 else (True, False)  # ABBA: drift falls on both arms
            done = {streaming: run(streaming, args, root, name=("stream" if streaming else "rounds") + tag)
                    for streaming in order}
            pairs.append((done[False], done[True]))
            print(json.dumps(done[False]))
            print(json.dumps(done[True]))
    if any("failed" in arm for pair in pairs for arm in pair):
        raise SystemExit("no ratio: an arm failed (above)")
    print(json.dumps(ratios(pairs)))


def ratios(pairs: list[tuple[dict, dict]]) -> dict:
    """Streaming over rounds, tokens per second of loop (summed tokens over summed loop seconds of each arm) and
    loop seconds (rounds' over streaming's); with several pairs, each pair's tokens-per-second ratio too."""
    tokens = [sum(pair[k]["generated_tokens"] for pair in pairs) for k in (0, 1)]
    loop = [sum(pair[k]["loop_s"] for pair in pairs) for k in (0, 1)]
    out = {"ratio_tok_s": round((tokens[1] / loop[1]) / (tokens[0] / loop[0]), 3),
           "ratio_loop_s": round(loop[0] / loop[1], 3)}
    if len(pairs) > 1:
        out["pairs"] = [round(s["tok_s"] / r["tok_s"], 3) for r, s in pairs]
    return out


if __name__ == "__main__":
    main()
