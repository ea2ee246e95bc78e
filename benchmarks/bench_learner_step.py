"""Overhead of Learner.train_step over a bare Megatron forward_backward + optimizer step.

    python benchmarks/bench_learner_step.py [--steps 6]   # after `pip install -e .` (or PYTHONPATH=.)
    [--hidden 256] [--layers 4] [--seq 128]

Both paths run in the same process on the same model, optimizer and batch, interleaved step by
step so machine noise hits both alike; the script prints the median step time of each and the
ratio learner / bare (goal: <= 1.15).  Runs on CPU (gloo, one rank) or a GPU if present.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _bench(rank, world, args):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.hf_config import load_hf_config

    torch.set_num_threads(args.threads)
    cfg = load_hf_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": args.hidden,
                          "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024})
    learner = Learner(LearnerConfig(micro_batch_size=2, global_batch_size=args.batch, lr=1e-5), cfg)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens}

    def loss_fn(logprobs_bt, mb):
        return -logprobs_bt.mean(), {}

    def bare_forward_step(it, model):
        t = next(it)
        out = model(t, torch.arange(t.shape[1]).expand_as(t), attention_mask=None)  # [b, T, V]
        return out, lambda o: (vocab_parallel_cross_entropy(o[:, :-1].float().contiguous(), t[:, 1:]).mean(), {})

    def bare_step():
        for chunk in learner.model:
            chunk.zero_grad_buffer()
        learner.optimizer.zero_grad()
        micro = list(tokens.split(2))
        get_forward_backward_func()(forward_step_func=bare_forward_step, data_iterator=iter(micro),
                                    model=learner.model, num_microbatches=len(micro), seq_length=args.seq,
                                    micro_batch_size=2)
        learner.optimizer.step()

    times = {"learner": [], "bare": []}
    for i in range(args.steps + 1):
        for name, fn in (("learner", lambda: learner.train_step(batch, loss_fn)), ("bare", bare_step)):
            start = time.perf_counter()
            fn()
            if i:  # first round is warm-up
                times[name].append(time.perf_counter() - start)
    learner.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from megatron_rl.platform.spawn import run_distributed

    (result,) = run_distributed(_bench, 1, args, timeout=1200)
    ratio = result["learner"] / result["bare"]
    print(f"learner step {result['learner'] * 1e3:.1f} ms | bare megatron step {result['bare'] * 1e3:.1f} ms | "
          f"ratio {ratio:.3f} (goal <= 1.15)")


if __name__ == "__main__":
    main()
