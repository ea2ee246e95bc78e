"""The refit check's statistic measured on a bf16 vLLM engine against a bf16 Megatron learner (issue 31, item 3).

    flock /tmp/mrl-heavy.lock .venv/bin/python benchmarks/refit_probe_bf16.py            # medium qwen2, LM head x4 and x8
    .venv/bin/python benchmarks/refit_probe_bf16.py --size tiny --scales 4                # a quick look

For each LM-head scale (a random model's logits are nearly flat; scaling its LM head gives the logit range of
a trained model, as tests/unit/test_refit_check.py does):
1. a random qwen2 of --size (the `medium` preset: hidden 1024, 24 layers) with a --vocab-size embedding is
   written in bfloat16 with its LM head scaled;
2. vLLM's CPU engine serves it in bfloat16, samples --rows responses of --response tokens (temperature 1,
   seeded) after random prompts, and scores teacher-forced (prompt logprobs, as rollout/worker.py `score`)
   both those sequences and as many sequences of uniformly random tokens;
3. a one-rank Megatron learner (bf16, local layers on CPU, loaded from the same files as a run's learner is:
   learner/initial_policy.py InitialPolicy) scores the same rows raw, as train/policy.py `_expect_probe` does;
   then again with one MLP matrix of layer 0 rolled by one row: a load that verified byte for byte but was
   laid out wrongly, which the check exists to refuse.
Per kind of token it prints |Δ logprob| over all rows (median, mean, p95, max) and the statistic the check
computes: the median over a 4-row probe (rollout/refit_check.py `probe_verdict`), for each disjoint 4-row
probe; one JSON line per scale and kind.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from pathlib import Path

ENGINE_DTYPE = {"bf16": "bfloat16", "fp32": "float32"}  # learner.dtype -> rollout.dtype
PROBE_ROWS = 4  # rows the engine scores in a refit check (train/policy.py _expect_probe)


def write_model(out: Path, size: str, vocab_size: int, scale: float, seed: int) -> Path:
    """A random qwen2 in bfloat16 with its LM head scaled by `scale`."""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_rl.models.tiny import make_tiny_model

    path = make_tiny_model(out, arch="qwen2", size=size, seed=seed, vocab_size=vocab_size)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * scale
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(weights),
              metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def engine_side(model: Path, args) -> dict:
    """Sampled and uniformly random rows, and the bf16 engine's teacher-forced logprobs of both."""
    import os
    import random

    from vllm import LLM, SamplingParams

    from megatron_rl.rollout.config import RolloutConfig
    from megatron_rl.rollout.engine_setup import engine_env, llm_kwargs

    cfg = RolloutConfig(model=str(model), dtype=ENGINE_DTYPE[args.dtype], max_model_len=args.prompt + args.response + 8,
                        weight_transfer="none", engine_in_process=True)
    os.environ.update(engine_env(cfg, on_gpu=False))
    llm = LLM(**llm_kwargs(cfg, on_gpu=False))
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab_size) for _ in range(args.prompt)] for _ in range(args.rows)]
    sample = SamplingParams(max_tokens=args.response, temperature=1.0, seed=args.seed, ignore_eos=True,
                            detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sample, use_tqdm=False)
    rows = {"sampled": [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)],
            "random": [[rng.randrange(0, args.vocab_size) for _ in range(args.prompt + args.response)]
                       for _ in range(args.rows)]}
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
    engine = {}
    for kind, seqs in rows.items():
        scored = llm.generate([{"prompt_token_ids": s} for s in seqs], score, use_tqdm=False)
        engine[kind] = [[None] + [float(lp[t].logprob) for lp, t in zip(o.prompt_logprobs[1:], s[1:])]
                        for o, s in zip(scored, seqs)]
    del llm
    gc.collect()
    return {"rows": rows, "engine": engine}


def learner_side(model: Path, rows: dict, seed: int, dtype: str) -> dict:
    """The learner's raw logprobs of every row, with the right weights and with a wrong layout."""
    from megatron_rl.conversion.model_io import run_on_ranks

    return run_on_ranks(_score_on_rank, 1, str(model), rows, seed, dtype)[0]


def _score_on_rank(rank: int, world: int, model: str, rows: dict, seed: int, dtype: str) -> dict:
    import torch

    from megatron_rl.learner import LearnerConfig
    from megatron_rl.learner.initial_policy import InitialPolicy
    from megatron_rl.platform import detect_platform

    n = len(next(iter(rows.values())))
    cfg = LearnerConfig(dtype=dtype, global_batch_size=n, micro_batch_size=n, seed=seed)
    policy = InitialPolicy.load(cfg, model, detect_platform("cpu", dtype=dtype))
    learner = policy.learner
    out = {}
    try:
        for label in ("right", "wrong"):
            if label == "wrong":
                fc1 = dict(learner.model[0].module.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
                with torch.no_grad():
                    fc1.copy_(torch.roll(fc1, 1, dims=0))
            out[label] = {kind: learner.forward_logprobs(torch.tensor(seqs), None, raw=True).float().tolist()
                          for kind, seqs in rows.items()}
    finally:
        learner.close()
    return out


def stats(engine_rows: list, learner_rows: list) -> dict:
    """|Δ| over all rows, and the check's statistic (median over a 4-row probe) per disjoint probe."""
    from megatron_rl.rollout.refit_check import probe_deltas

    deltas = sorted(probe_deltas(engine_rows, learner_rows))
    probes = [statistics.median(probe_deltas(engine_rows[i:i + PROBE_ROWS], learner_rows[i:i + PROBE_ROWS]))
              for i in range(0, len(engine_rows) - PROBE_ROWS + 1, PROBE_ROWS)]
    return {"tokens": len(deltas), "median": statistics.median(deltas), "mean": statistics.fmean(deltas),
            "p95": deltas[int(0.95 * (len(deltas) - 1))], "max": deltas[-1],
            "probe_medians": probes, "probe_median_max": max(probes)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="medium", help="make-tiny-model size preset")
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--scales", type=float, nargs="+", default=[4.0, 8.0], help="LM-head scales, one model each")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--dtype", default="bf16", choices=sorted(ENGINE_DTYPE),
                    help="both sides' dtype (the weights are bf16 either way; fp32 shows the kernels' floor)")
    args = ap.parse_args(argv)
    for scale in args.scales:
        with tempfile.TemporaryDirectory() as tmp:
            model = write_model(Path(tmp) / "model", args.size, args.vocab_size, scale, args.seed)
            side = engine_side(model, args)
            learned = learner_side(model, side["rows"], args.seed, args.dtype)
        for load in ("right", "wrong"):
            for kind in ("sampled", "random"):
                row = {"dtype": args.dtype, "size": args.size, "vocab": args.vocab_size, "lm_head_scale": scale, "load": load,
                       "kind": kind, **stats(side["engine"][kind], learned[load][kind])}
                print(json.dumps({k: [round(x, 4) for x in v] if isinstance(v, list) else
                                  round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
