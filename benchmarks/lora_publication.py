"""Adapter-only publication against full weights, side by side, on the ~283M "medium" model; and the
learner's peak memory with LoRA against full-parameter training.

    python benchmarks/lora_publication.py [--rounds 5] [--rank 16]

Two real vLLM engines (CPU, float32) serve the same base: one takes full-weight publications, the other
(a LoRA run's, rollout.adapter) takes adapters (rank --rank on qkv, proj, fc1 and fc2).  Each round
publishes a full version to the first and an adapter version to the second, one right after the other,
through the same checked gloo path (WeightPublisher: checksummed buckets, verified, committed on the whole
group), and takes the ratio of the pair, so the machine's drift cancels; the first round warms up and the
reported figure is the median of the rest.  Bytes per version are the manifests'.  Then, in two fresh
processes, a Megatron learner of the same model (TP1, distributed optimizer, float32) takes two training
steps on 4 x 256 tokens, with and without adapters, and reports its peak resident memory (ru_maxrss).
Prints one JSON line; benchmarks/lora_publication.md holds three invocations.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _engines(model_dir: Path, lora):
    from megatron_rl.publish import WeightPublisher
    from megatron_rl.rollout import RolloutConfig, create_rollout_worker

    common = dict(model=str(model_dir), max_model_len=256, dtype="float32", max_tokens=4, kv_cache_gib=1)
    full = create_rollout_worker(RolloutConfig(**common))
    adapted = create_rollout_worker(RolloutConfig(**common, adapter=lora.serving(1)))
    pubs = []
    for worker in (full, adapted):
        pub = WeightPublisher(bucket_bytes=64 << 20)
        pub.connect([worker])
        pubs.append(pub)
    return (full, adapted), pubs


def _publication(model_dir: Path, lora, rounds: int) -> dict:
    import ray
    from safetensors.torch import load_file

    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.publish.adapter_source import adapter_shapes

    base = sorted(load_file(model_dir / "model.safetensors").items())
    shapes = adapter_shapes(lora, load_hf_config(model_dir))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        workers, (full_pub, lora_pub) = _engines(model_dir, lora)
        ratios, full_s, lora_s = [], [], []
        for version in range(1, rounds + 1):
            g = torch.Generator().manual_seed(version)
            adapter = [(n, 0.01 * torch.randn(s, generator=g)) for n, s in sorted(shapes.items())]
            full = full_pub.publish(version, base)
            adapted = lora_pub.publish(version, adapter)
            assert full.committed and adapted.committed, (full.results, adapted.results)
            if version > 1:  # the first round warms up
                full_s.append(full.seconds)
                lora_s.append(adapted.seconds)
                ratios.append(adapted.seconds / full.seconds)
        for w in workers:
            ray.get(w.shutdown.remote())
    finally:
        ray.shutdown()
    return {"full_bytes": full.manifest.nbytes, "adapter_bytes": adapted.manifest.nbytes,
            "bytes_ratio": adapted.manifest.nbytes / full.manifest.nbytes,
            "full_s_median": statistics.median(full_s), "adapter_s_median": statistics.median(lora_s),
            "time_ratio_median": statistics.median(ratios)}


def _learner_peak(rank, world, model_dir, lora_dict) -> int:
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.lora import LoraConfig
    from megatron_rl.platform import detect_platform

    torch.set_num_threads(2)
    hf = load_hf_config(model_dir)
    learner = Learner(LearnerConfig(global_batch_size=4, micro_batch_size=1, lr=1e-5, seed=1,
                                    lora=LoraConfig(**lora_dict)), hf, detect_platform("cpu"))
    tokens = torch.randint(0, hf.vocab_size, (4, 256), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        learner.train_step({"tokens": tokens}, lambda lp, mb: (-lp.mean(), {"tokens": float(lp.numel())}))
    learner.close()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    from megatron_rl.models.lora import LoraConfig
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.platform.spawn import run_distributed

    lora = LoraConfig(enabled=True, rank=args.rank, alpha=2.0 * args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "medium", arch="qwen2", size="medium", seed=0)
        result = _publication(model_dir, lora, args.rounds)
        peaks = {}
        for name, enabled in (("full", False), ("lora", True)):
            lora_dict = {"enabled": enabled, "rank": args.rank, "alpha": 2.0 * args.rank}
            peaks[name] = run_distributed(_learner_peak, 1, str(model_dir), lora_dict, timeout=1200)[0]
    result.update(learner_peak_full_gib=peaks["full"] / 2**30, learner_peak_lora_gib=peaks["lora"] / 2**30,
                  learner_peak_ratio=peaks["lora"] / peaks["full"], rank=args.rank, rounds=args.rounds)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
