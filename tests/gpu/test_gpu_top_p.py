"""On one GPU: top-p sampled by vLLM's own kernels reconciles with the learner's PyTorch semantics.

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu/test_gpu_top_p.py -m gpu -q

Issue 31, item 9.  A bf16 vLLM engine (eager) samples at temperature 0.7, top_p 0.9 from the tiny
qwen2 model; on GPU that goes through vLLM's top-k/top-p kernels, not the PyTorch rules the learner
reproduces (learner/logprobs.py truncation_keep_mask).  The learner side here is transformers on the
same GPU in bf16 with that rule applied.  train/probe.py reconcile_sampled compares them on every
sampled token: its median |Δ| must be within the bf16 tolerance (rollout/refit_check.py), and almost
every sampled token must lie inside the learner's truncated support (a token vLLM sampled that the
learner's rule cuts off gets log p -87: the kernels disagree on the distribution itself).
"""

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
TOP_P = {"temperature": 0.7, "top_p": 0.9, "top_k": 0}


def _learner_forward(model_dir, sampling):
    """forward(tokens_bt, lengths_b) -> [B, T-1]: transformers in bf16 on the GPU, the learner's rule."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.learner.logprobs import OUT_OF_SUPPORT_LOGPROB, truncation_keep_mask

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()

    def forward(tokens_bt, lengths_b=None):
        with torch.no_grad():
            logits = model(tokens_bt.cuda()).logits[:, :-1].float() / sampling.temperature  # [B, T-1, V]
        keep = truncation_keep_mask(logits.reshape(-1, logits.shape[-1]), sampling).reshape(logits.shape)
        lps = torch.log_softmax(logits.masked_fill(~keep, float("-inf")), -1)
        out = lps.gather(-1, tokens_bt.cuda()[:, 1:, None])[..., 0]
        return torch.where(torch.isfinite(out), out, torch.full_like(out, OUT_OF_SUPPORT_LOGPROB)).cpu()
    return forward


def test_top_p_samples_reconcile_with_the_learners_semantics(tmp_path):
    import ray

    from megatron_rl.learner.config import SamplingConfig
    from megatron_rl.models.tiny import make_tiny_model
    from megatron_rl.rollout import RolloutConfig, create_rollout_worker
    from megatron_rl.train.probe import reconcile_sampled
    from tests.gpu.engine_options import EAGER

    model_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2", seed=2)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=4, num_gpus=1, include_dashboard=False, log_to_driver=False)
    worker = None
    try:
        cfg = RolloutConfig(model=str(model_dir), max_model_len=128, dtype="bfloat16", max_tokens=24,
                            gpu_memory_utilization=0.3, engine_options=EAGER, **TOP_P)
        worker = create_rollout_worker(cfg, num_gpus=0.5)
        prompts = [[1, 23 + i, 24, 17, 29] for i in range(8)]
        samples = ray.get(worker.generate.remote(prompts, dict(TOP_P, ignore_eos=True), 4))
        assert samples and all(s.sampling.get("top_p") == 0.9 for s in samples)
        taken = [SimpleNamespace(prompt_tokens=s.prompt_tokens, response_tokens=s.response_tokens,
                                 policy_versions=[0] * len(s.response_tokens), action_mask=[1] * len(s.response_tokens),
                                 behavior_logprobs=s.behavior_logprobs) for s in samples]
        sampling = SamplingConfig(**TOP_P)
        tol = ray.get(worker.refit_tolerance.remote("auto"))  # the bound a run's reconcile uses (dtype, depth)
        stats = reconcile_sampled(_learner_forward(model_dir, sampling), taken, 0, rows=len(taken), tolerance=tol)
        print("top_p 0.9 reconcile:", stats)
        assert stats["numerics/reconcile_tokens"] >= 100, stats
        assert stats["numerics/reconcile_over_tolerance"] == 0.0, stats
        # A token outside the learner's support shows as |Δ| near 87; allow bf16 flips at the p boundary.
        assert stats["numerics/reconcile_mean_abs"] < tol, stats
    finally:
        if worker is not None:
            try:
                ray.get(worker.shutdown.remote(), timeout=60)
            except ray.exceptions.RayError:
                pass
        ray.shutdown()
