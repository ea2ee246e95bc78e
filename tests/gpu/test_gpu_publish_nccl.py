"""On two GPUs: publication through vLLM's NCCL transport, checked before commit ("megatron_rl_nccl").

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu -m gpu -q

The test process is the trainer on one GPU; a RolloutWorker actor runs vLLM (TP=1, fp32) on
another (NCCL refuses two ranks on one device, hence two GPUs).  A modified copy of the tiny
model's tensors, sent from the GPU, must commit and score like transformers with the same
weights; a bucket corrupted after hashing must be refused with the bucket named while the
engine keeps serving the committed version; a publication missing a tensor is refused too.
"""

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices (trainer and rollout engine each on its own)")]

REPO = Path(__file__).resolve().parents[2]


def test_nccl_publication_commits_whole_or_not_at_all(tmp_path):
    import ray
    from safetensors.torch import load_file

    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.publish import WeightPublisher
    from megatron_rl.rollout import RolloutConfig, create_rollout_worker
    from tests.gpu.engine_options import EAGER
    from tests.reference import SEQUENCES, hf_logprobs

    model_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2", seed=2)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)  # the actor's GPU
    worker = None
    try:
        cfg = RolloutConfig(model=str(model_dir), max_model_len=128, dtype="float32", max_tokens=8,
                            weight_transfer="nccl", gpu_memory_utilization=0.3, engine_options=EAGER)
        worker = create_rollout_worker(cfg, num_gpus=1)
        # The trainer takes a GPU other than the engine's (told apart by UUID, whatever the numbering).
        engine_uuid = ray.get(worker.__ray_call__.remote(lambda self: str(torch.cuda.get_device_properties(0).uuid)))
        torch.cuda.set_device(next(d for d in range(torch.cuda.device_count())
                                   if str(torch.cuda.get_device_properties(d).uuid) != engine_uuid))
        publisher = WeightPublisher(bucket_bytes=256 * 1024, transport="nccl")
        publisher.connect([worker])

        base = load_file(model_dir / "model.safetensors")
        g = torch.Generator().manual_seed(0)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
        report = publisher.publish(1, [(k, v.cuda()) for k, v in new.items()])
        assert report.committed, report.results
        assert len(report.manifest.buckets) > 2
        want = hf_logprobs(model_dir, new)
        got = [torch.tensor(s[1:], dtype=torch.float64) for s in ray.get(worker.score.remote(SEQUENCES))]
        for g_row, w_row in zip(got, want):
            assert torch.allclose(g_row, w_row, atol=1e-4), (g_row - w_row).abs().max()

        def corrupt(spec, buf):
            if spec.index == 1:
                buf[buf.numel() // 2] ^= 0x10

        bad = publisher.publish(2, [(k, v.cuda()) for k, v in base.items()], fault_hook=corrupt)
        assert not bad.committed
        (result,) = bad.results
        assert result["version"] == 1 and result["bad_bucket"] == 1 and "bucket 1" in result["error"]
        still = [torch.tensor(s[1:], dtype=torch.float64) for s in ray.get(worker.score.remote(SEQUENCES))]
        for g_row, w_row in zip(still, want):
            assert torch.allclose(g_row, w_row, atol=1e-4)

        partial = [(k, v.cuda()) for k, v in base.items() if k != "model.layers.1.mlp.down_proj.weight"]
        incomplete = publisher.publish(3, partial)
        assert not incomplete.committed and "missing 1" in incomplete.results[0]["error"]
        assert ray.get(worker.policy_version.remote()) == 1
    finally:
        if worker is not None:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            except ray.exceptions.RayError:
                pass
        ray.shutdown()
