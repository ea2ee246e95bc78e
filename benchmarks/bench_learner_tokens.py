"""Learned tokens per second: token-budget micro-batches vs every row padded to the batch's longest.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_learner_tokens.py [--rounds 5] [--batch 32]
    [--max-len 256] [--long-fraction 0.1] [--budget 1024] [--mbs 4] [--hidden 128] [--layers 2]

One global batch of GRPO rows whose lengths are long-tailed ((1 - long_fraction) of them short,
16..48 tokens; the rest within 10% of --max-len), one learner (one CPU rank, gloo, fp32) and the
real GRPO loss.  Each round runs one train_step with fixed micro-batches of --mbs rows padded to
the batch's longest (learner.max_tokens_per_micro_batch = None, today's layout) and one with
the token budget --budget, in alternating order, so machine noise hits both alike.  Printed:
median learned (real) tokens per second of each, their per-round ratio's median (goal >= 1.5),
and the padding fraction of each layout's grid.  The first round is warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _lengths(args) -> list[int]:
    gen = torch.Generator().manual_seed(args.seed)
    n_long = max(1, round(args.batch * args.long_fraction))
    long = torch.randint(int(0.9 * args.max_len), args.max_len + 1, (n_long,), generator=gen).tolist()
    short = torch.randint(16, 49, (args.batch - n_long,), generator=gen).tolist()
    lengths = long + short
    order = torch.randperm(args.batch, generator=gen).tolist()  # long rows anywhere in the batch
    return [lengths[i] for i in order]


def _batch(args, vocab: int) -> dict:
    lengths = _lengths(args)
    b, t = len(lengths), max(lengths)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t - 1)
    prompt = 8
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, vocab, (n,), generator=gen)
        mask[i, prompt - 1:n - 1] = 1.0  # the response: every token after the prompt
    n_tokens, n_seqs = float(mask.sum()), float((mask.sum(dim=1) > 0).sum())
    return {"tokens": tokens, "loss_mask": mask, "lengths": torch.tensor(lengths),
            "behavior_logprobs": torch.full((b, t - 1), -6.9) * mask,
            "advantages": torch.randn(b, generator=gen), "tokens_in_loss": n_tokens, "sequences_in_loss": n_seqs,
            "token_denominator": n_tokens / (b // args.mbs), "sequence_denominator": n_seqs / (b // args.mbs)}


def _bench(rank, world, args):
    from functools import partial

    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.grpo.micro_loss import grpo_micro_batch_loss

    torch.set_num_threads(args.threads)
    cfg = load_hf_config({"model_type": "llama", "vocab_size": 1000, "hidden_size": args.hidden,
                          "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
                          "num_attention_heads": 8, "num_key_value_heads": 4,
                          "max_position_embeddings": max(1024, args.max_len)})
    learner = Learner(LearnerConfig(micro_batch_size=args.mbs, global_batch_size=args.batch, lr=1e-6), cfg)
    batch = _batch(args, cfg.vocab_size)
    real = float(batch["lengths"].sum())
    loss_fn = partial(grpo_micro_batch_loss, cfg=GRPOLossConfig())
    layouts = {"padded": None, "budget": args.budget}
    tps = {name: [] for name in layouts}
    padding = {}
    ratios = []
    for i in range(args.rounds + 1):
        names = list(layouts) if i % 2 == 0 else list(reversed(layouts))
        seconds = {}
        for name in names:
            learner.cfg.max_tokens_per_micro_batch = layouts[name]
            start = time.perf_counter()
            metrics = learner.train_step(batch, loss_fn)
            seconds[name] = time.perf_counter() - start
            padding[name] = metrics["padding_fraction"]
        if i:  # the first round is warm-up
            for name in layouts:
                tps[name].append(real / seconds[name])
            ratios.append(seconds["padded"] / seconds["budget"])
    learner.close()
    return {"tps": {k: statistics.median(v) for k, v in tps.items()}, "ratio": statistics.median(ratios),
            "ratio_range": (min(ratios), max(ratios)), "padding": padding, "real_tokens": real,
            "rows": args.batch, "longest": int(batch["tokens"].shape[1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--budget", type=int, default=1024, help="learner.max_tokens_per_micro_batch")
    parser.add_argument("--mbs", type=int, default=4, help="micro_batch_size of the padded baseline")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from megatron_rl.platform.spawn import run_distributed

    (r,) = run_distributed(_bench, 1, args, timeout=1800)
    print(f"{r['rows']} rows, {r['real_tokens']:.0f} real tokens, longest {r['longest']}; "
          f"{args.rounds} interleaved rounds")
    print(f"padded (micro_batch_size={args.mbs}): {r['tps']['padded']:.0f} learned tokens/s, "
          f"padding fraction {r['padding']['padded']:.3f}")
    print(f"token budget ({args.budget}):        {r['tps']['budget']:.0f} learned tokens/s, "
          f"padding fraction {r['padding']['budget']:.3f}")
    lo, hi = r["ratio_range"]
    print(f"median ratio budget / padded: {r['ratio']:.2f}x (rounds {lo:.2f}..{hi:.2f}; goal >= 1.5)")


if __name__ == "__main__":
    main()
