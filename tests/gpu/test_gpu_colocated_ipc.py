"""On one GPU: colocated publication through CUDA IPC, checked before commit, around vLLM sleep/wake.

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu/test_gpu_colocated_ipc.py -m gpu -q

The test process is the trainer; a RolloutWorker actor runs vLLM (TP=1, bf16, enable_sleep_mode)
on the same GPU (half of it each), as the colocated placement puts them.  In the order the driver
uses (rollout/sleep.py): the engine sleeps (its GPU memory is freed: measured), wakes, and a
publication of modified bf16 weights goes over "megatron_rl_ipc"; the engine's logprobs must then
match transformers with the same weights.  A publication whose bytes are flipped after hashing
must be refused with the bucket named while the engine keeps serving the committed version.
"""

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]


def _engine_free_gib(worker):
    import ray

    def free(_self):
        return torch.cuda.mem_get_info()[0] / 2**30

    return ray.get(worker.__ray_call__.remote(free))


def test_ipc_publication_commits_whole_or_not_at_all_around_sleep(tmp_path):
    import ray
    from safetensors.torch import load_file

    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.publish import WeightPublisher
    from megatron_rl.rollout import RolloutConfig, create_rollout_worker
    from megatron_rl.rollout.sleep import SleepCycle, choose_sleep
    from tests.gpu.engine_options import EAGER
    from tests.reference import SEQUENCES, hf_logprobs

    model_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2", seed=2)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    worker = None
    try:
        sleeps, why = choose_sleep(placement="colocated", device="cuda", mode="sync")
        assert sleeps, why
        cfg = RolloutConfig(model=str(model_dir), max_model_len=128, dtype="bfloat16", max_tokens=8,
                            weight_transfer="ipc", sleep_mode=True, gpu_memory_utilization=0.3, engine_options=EAGER)
        worker = create_rollout_worker(cfg, num_gpus=0.5)  # the trainer (this process) has the other half
        publisher = WeightPublisher(bucket_bytes=256 * 1024, transport="ipc")
        publisher.connect([worker])  # checks the engine sits on this process's GPU

        cycle = SleepCycle(lambda: [worker], enabled=True, reason=why)
        awake_free = _engine_free_gib(worker)
        cycle.before_learn()
        asleep_free = _engine_free_gib(worker)
        assert asleep_free > awake_free + 0.5, (awake_free, asleep_free)  # the KV cache budget came back
        cycle.before_refit()

        base = load_file(model_dir / "model.safetensors")
        g = torch.Generator().manual_seed(0)
        new = {k: (v + 0.05 * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in base.items()}
        report = publisher.publish(1, [(k, v.cuda()) for k, v in new.items()])
        assert report.committed, report.results
        assert len(report.manifest.buckets) > 2 and set(report.manifest.dtypes) == {"bfloat16"}
        want = hf_logprobs(model_dir, {k: v.float() for k, v in new.items()})
        got = [torch.tensor(s[1:], dtype=torch.float64) for s in ray.get(worker.score.remote(SEQUENCES))]
        for g_row, w_row in zip(got, want):
            assert torch.allclose(g_row, w_row, atol=0.1), (g_row - w_row).abs().max()  # bf16 engine vs fp32

        def corrupt(spec, buf):
            if spec.index == 1:
                buf[buf.numel() // 2] ^= 0x10

        cycle.before_learn()
        cycle.before_refit()
        bad = publisher.publish(2, [(k, v.to(torch.bfloat16).cuda()) for k, v in base.items()], fault_hook=corrupt)
        assert not bad.committed
        (result,) = bad.results
        assert result["version"] == 1 and result["bad_bucket"] == 1 and "bucket 1" in result["error"]
        still = [torch.tensor(s[1:], dtype=torch.float64) for s in ray.get(worker.score.remote(SEQUENCES))]
        for g_row, k_row in zip(still, got):
            assert torch.allclose(g_row, k_row, atol=1e-3)  # still serving version 1
        assert ray.get(worker.policy_version.remote()) == 1 and cycle.sleeps == 2
    finally:
        if worker is not None:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            except ray.exceptions.RayError:
                pass
        ray.shutdown()
