"""Streaming rollouts vs round-based generation on a long-tailed workload, engine level (issue 27).

    flock /tmp/mrl-heavy.lock python benchmarks/stream_throughput.py            # a tiny random llama
    python benchmarks/stream_throughput.py --model DIR --requests 192 --capacity 16

Both arms serve the same requests: the same prompts (groups of --group samples of one prompt, each
sample its own seed), the same target length per sample (--long-share of them --long tokens, the
rest --short; enforced with max_tokens and ignore_eos), so both generate exactly the same number of
tokens, on the same engine settings (one engine-core process with its worker inside, max_num_seqs =
--capacity):
- batch (the baseline of the headline ratio): what the training loop's round worker does, one vllm
  LLM.generate over a whole step's batch (--batch requests, default 64: configs/tiny_cpu_scratch.yaml's 8
  prompts x 8), step after step.  vLLM fills a slot that frees with the next request of the call, so
  only the step's last requests wait for its longest sample.
- round: one LLM.generate over a round of --capacity requests (the engine's capacity), round after round;
  each round waits for its longest sample.  Not what training does: the ratio against it (ratio_vs_round)
  overstates what streaming wins, and is printed beside the headline only to say by how much.
- stream: a StreamEngine (vLLM's AsyncLLM) with at most --capacity + --backlog requests submitted, a
  new one as soon as one finishes.  The backlog (default: one prompt group) waits in vLLM's own queue,
  so a slot that frees is filled by the scheduler at its next step, not after a round trip through
  this process; vLLM still runs at most --capacity (max_num_seqs) at once.  --backlog 0: the engine
  holds only what runs.
Each arm runs in a process of its own (a fresh engine, warmed up before the clock starts; the process
ends with os._exit, so no zmq context of vLLM is finalized).  Occupancy is the time-weighted mean of
the engine's running requests over --capacity, sampled at every engine step (vLLM's scheduler stats;
benchmarks/engine_occupancy.py).
Prints one JSON line: each arm's wall time, generated tokens, tok/s, occupancy; ratio = stream/batch (the
real rounds), ratio_vs_round = stream/round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import traceback
import tempfile
import time
from pathlib import Path

from engine_occupancy import Occupancy  # benchmarks/engine_occupancy.py (run this file as a script)

REPO = Path(__file__).resolve().parents[1]
ARMS = ("batch", "round", "stream")


def workload(args) -> list[dict]:
    """Every request in submission order: prompt, seed, target length, group index."""
    rng = random.Random(args.seed)
    out = []
    for g in range(args.requests // args.group):
        prompt = [1] + [rng.randrange(5, 95) for _ in range(rng.randrange(12, 24))]
        for s in range(args.group):
            length = args.long if rng.random() < args.long_share else args.short
            out.append({"prompt": prompt, "seed": args.seed * 100_000 + g * args.group + s, "max_tokens": length,
                        "group": g})
    return out


def sampling(req: dict) -> dict:
    return {"temperature": 1.0, "seed": req["seed"], "max_tokens": req["max_tokens"], "ignore_eos": True}


def rollout_config(args):
    from megatron_rl.rollout.config import RolloutConfig

    # The engine core in its own process (vLLM's default) with its one worker inside it, in every arm; with
    # --in-process all of it in the arm's process (rollout.engine_in_process: the stream arm's engine is then
    # rollout/stepped_engine.py's, as in a tiny recipe's training run).
    options = {"max_num_seqs": args.capacity, "disable_log_stats": False}
    if not args.in_process:
        options["distributed_executor_backend"] = "uni"
    return RolloutConfig(model=args.model, dtype="float32", max_model_len=args.max_model_len, weight_transfer="none",
                         engine_in_process=bool(args.in_process), engine_options=options)


def run_round(args, reqs: list[dict], size: int) -> dict:
    """LLM.generate over `size` requests at a time (the batch arm: a step's batch; the round arm: capacity)."""
    from vllm import LLM, SamplingParams

    from megatron_rl.rollout.engine_setup import engine_env, llm_kwargs

    cfg = rollout_config(args)
    os.environ.update(engine_env(cfg, on_gpu=False))
    llm = LLM(**llm_kwargs(cfg, on_gpu=False))
    occupancy = Occupancy(llm.llm_engine)

    def generate(batch):
        params = [SamplingParams(logprobs=0, detokenize=False, **sampling(r)) for r in batch]
        outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in batch], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    generate(warmup(args, reqs))
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(reqs), size):
        tokens += generate(reqs[i:i + size])
    end = time.perf_counter()
    return {"wall_s": end - start, "tokens": tokens, "occupancy": occupancy.mean(start, end, args.capacity)}


async def run_stream(args, reqs: list[dict]) -> dict:
    from megatron_rl.rollout.stream_engine import StreamEngine

    stream = StreamEngine.start(rollout_config(args))
    occupancy = Occupancy(getattr(stream.engine, "engine", stream.engine))  # a stepped engine's LLMEngine
    await asyncio.gather(*(stream.generate(f"warm-{i}", r["prompt"], sampling(r))
                           for i, r in enumerate(warmup(args, reqs))))
    slots = asyncio.Semaphore(args.capacity + args.backlog)

    async def one(i: int, req: dict) -> int:
        try:
            result = await stream.generate(f"r{i}", req["prompt"], sampling(req))
        finally:
            slots.release()
        return len(result.response_tokens)

    start = time.perf_counter()
    tasks = []
    for i, req in enumerate(reqs):  # submission order; a slot frees when any request finishes
        await slots.acquire()
        tasks.append(asyncio.create_task(one(i, req)))
    tokens = sum(await asyncio.gather(*tasks))
    end = time.perf_counter()
    stream.shutdown()
    return {"wall_s": end - start, "tokens": tokens, "occupancy": occupancy.mean(start, end, args.capacity)}


def warmup(args, reqs: list[dict]) -> list[dict]:
    """One full batch of short requests (not timed): the engine's first steps allocate and compile."""
    return [{**r, "max_tokens": args.short} for r in reqs[:args.capacity]]


def arm_main(args) -> None:
    """One arm in this process; prints its JSON line and leaves with os._exit."""
    code = 1
    try:
        reqs = workload(args)
        if args.arm == "stream":
            result = asyncio.run(run_stream(args, reqs))
        else:
            result = run_round(args, reqs, args.batch if args.arm == "batch" else args.capacity)
        result["tok_s"] = result["tokens"] / result["wall_s"]
        print(json.dumps(result), flush=True)
        code = 0
    except BaseException:  # os._exit below would leave without the traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_arm(args, arm: str) -> dict:
    options = {k: v for k, v in vars(args).items() if k != "arm"}
    argv = [x for k, v in options.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--arm", arm]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    # Output to files, not pipes: vLLM's engine-core process outlives the arm's os._exit and would hold a
    # pipe open for ever.  The arm's whole session (that process included) is killed once the arm ends.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            code = f"killed after {args.timeout} s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if code != 0 or not lines:
        raise SystemExit(f"arm {arm} exited {code}:\n{stderr[-4000:]}")
    return json.loads(lines[-1])


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF checkpoint directory (default: a tiny random llama, seed 0)")
    ap.add_argument("--requests", type=int, default=192, help="samples in all (a multiple of --group)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt (G)")
    ap.add_argument("--capacity", type=int, default=16, help="requests in flight: round size and max_num_seqs")
    ap.add_argument("--batch", type=int, default=64, help="the batch arm: requests in one call (a training step's)")
    ap.add_argument("--backlog", type=int, default=None,
                    help="stream arm: requests waiting in vLLM's queue beyond --capacity (default --group)")
    ap.add_argument("--short", type=int, default=8)
    ap.add_argument("--long", type=int, default=256)
    ap.add_argument("--long-share", type=float, default=0.15)
    ap.add_argument("--max-model-len", type=int, default=320)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per arm")
    ap.add_argument("--in-process", type=int, default=0, choices=(0, 1),
                    help="1: every arm's engine in the arm's process (rollout.engine_in_process)")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.requests % args.group or args.capacity % args.group or args.batch % args.group:
        ap.error("--requests, --capacity and --batch must be multiples of --group (whole prompt groups)")
    args.backlog = args.group if args.backlog is None else args.backlog
    if args.backlog < 0:
        ap.error(f"--backlog must be >= 0, got {args.backlog}")
    return args


def main() -> None:
    args = parse()
    if args.arm:
        return arm_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            from megatron_rl.models.tiny import make_tiny_model

            args.model = str(make_tiny_model(Path(tmp) / "tiny", arch="llama", seed=0))
        arms = {arm: run_arm(args, arm) for arm in ARMS}
    assert len({res["tokens"] for res in arms.values()}) == 1, arms  # the same tokens in every arm
    lengths = [r["max_tokens"] for r in workload(args)]
    print(json.dumps({"requests": args.requests, "group": args.group, "capacity": args.capacity, "batch": args.batch,
                      "backlog": args.backlog,
                      "long_share_actual": sum(n == args.long for n in lengths) / len(lengths),
                      **{f"{arm}_{k}": round(v, 4) for arm, res in arms.items() for k, v in res.items()},
                      "ratio": round(arms["stream"]["tok_s"] / arms["batch"]["tok_s"], 3),
                      "ratio_vs_round": round(arms["stream"]["tok_s"] / arms["round"]["tok_s"], 3)}))


if __name__ == "__main__":
    main()
