"""Tokens/s through the RolloutWorker Ray actor vs bare vLLM on the same prompts.

    python benchmarks/bench_rollout.py --model /tmp/tiny --prompts 64 --max-tokens 64

Both run the same engine settings, the same token-id prompts and the same seeds, one
after the other in one run; the second generate call of each is timed (the first warms
up).  Prints tokens/s for each and the ratio actor/bare (goal >= 0.9).
"""

import argparse
import os
import time


def prompts(n):
    return [[1] + [23 + (i * 7 + j) % 60 for j in range(8 + i % 8)] for i in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    import ray
    from vllm import LLM, SamplingParams

    from megatron_rl.rollout import RolloutConfig, create_rollout_worker
    from megatron_rl.rollout.worker import engine_env, llm_kwargs

    cfg = RolloutConfig(model=args.model, max_model_len=256, ignore_eos=True, max_tokens=args.max_tokens,
                        weight_transfer="none")
    ps = prompts(args.prompts)
    sampling = {"seed": 0, "max_tokens": args.max_tokens, "ignore_eos": True}

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    worker = create_rollout_worker(cfg)
    ray.get(worker.generate.remote(ps, sampling))
    t0 = time.perf_counter()
    n_actor = sum(len(s.response_tokens) for s in ray.get(worker.generate.remote(ps, sampling)))
    t_actor = time.perf_counter() - t0
    ray.get(worker.shutdown.remote())
    ray.shutdown()

    os.environ.update(engine_env(cfg, on_gpu=False))
    llm = LLM(**llm_kwargs(cfg, on_gpu=False))
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i, logprobs=0, detokenize=False)
              for i in range(len(ps))]
    llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    t_bare = time.perf_counter() - t0
    n_bare = sum(len(o.outputs[0].token_ids) for o in outs)
    actor, bare = n_actor / t_actor, n_bare / t_bare
    print(f"actor={actor:.0f} tok/s bare={bare:.0f} tok/s ratio={actor / bare:.2f} (goal >= 0.9)")


if __name__ == "__main__":
    main()
