"""Tokens/s through the RolloutWorker Ray actor vs bare vLLM on the same prompts.

    python benchmarks/bench_rollout.py --model /tmp/tiny --prompts 64 --max-tokens 64

Both run the same engine settings, the same token-id prompts and the same seeds.  Both
engines stay up and their generate calls alternate (A B, B A, ...) for --rounds rounds,
each after --gap seconds of quiet (vLLM's processes busy-poll for ~1 s after a call), so
both sides see the same machine; a single call per side, minutes apart, swings +-30% on a
shared 2-core machine.  Prints tokens/s per round and the median of each side and of the
per-round ratio actor/bare (goal >= 0.9).  --busy N keeps N normal-priority busy-loop
processes running during the timed calls (the engine must not lose the CPU to them).
"""

import argparse
import os
import statistics
import subprocess
import sys
import time


def prompts(n):
    return [[1] + [23 + (i * 7 + j) % 60 for j in range(8 + i % 8)] for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gap", type=float, default=2.0, help="seconds of quiet before each timed call")
    ap.add_argument("--busy", type=int, default=0, help="normal-priority busy-loop processes during timing")
    args = ap.parse_args()

    import ray
    from vllm import LLM, SamplingParams

    from megatron_rl.rollout import RolloutConfig, create_rollout_worker
    from megatron_rl.rollout.worker import engine_env, llm_kwargs

    cfg = RolloutConfig(model=args.model, max_model_len=256, ignore_eos=True, max_tokens=args.max_tokens,
                        weight_transfer="none")
    ps = prompts(args.prompts)
    sampling = {"seed": 0, "max_tokens": args.max_tokens, "ignore_eos": True}
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i, logprobs=0, detokenize=False)
              for i in range(len(ps))]
    requests = [{"prompt_token_ids": p} for p in ps]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    worker = create_rollout_worker(cfg)
    os.environ.update(engine_env(cfg, on_gpu=False))
    llm = LLM(**llm_kwargs(cfg, on_gpu=False))

    def run_actor():
        return sum(len(s.response_tokens) for s in ray.get(worker.generate.remote(ps, sampling)))

    def run_bare():
        return sum(len(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False))

    run_actor(), run_bare()  # warm-up
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    rates = {"actor": [], "bare": []}
    try:
        for r in range(args.rounds):
            for side in ("actor", "bare") if r % 2 == 0 else ("bare", "actor"):
                time.sleep(args.gap)
                t0 = time.perf_counter()
                n = run_actor() if side == "actor" else run_bare()
                rates[side].append(n / (time.perf_counter() - t0))
            a, b = rates["actor"][-1], rates["bare"][-1]
            print(f"round {r}: actor={a:.0f} tok/s bare={b:.0f} tok/s ratio={a / b:.2f}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        ray.get(worker.shutdown.remote())
        ray.shutdown()
        llm.llm_engine.engine_core.shutdown()
    actor, bare = statistics.median(rates["actor"]), statistics.median(rates["bare"])
    ratio = statistics.median(a / b for a, b in zip(rates["actor"], rates["bare"]))
    print(f"actor={actor:.0f} tok/s bare={bare:.0f} tok/s ratio={ratio:.2f} "
          f"(median of {args.rounds} rounds; goal >= 0.9)")


if __name__ == "__main__":
    main()
