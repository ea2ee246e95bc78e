"""On GPUs: the NCCL path of init_distributed / parallel_scope and a learner step.

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu -m gpu -q

Two tests, each honest about what one GPU can show:
  * with >= 2 GPUs: 2 ranks, an NCCL all-reduce over the TP group (a collective between ranks)
    and a TP=2 bf16 Learner step.  Skipped, with the reason, on a machine with fewer GPUs:
    NCCL refuses two ranks on one device, and a 1-rank group proves nothing about collectives.
  * with >= 1 GPU: 1 rank, the NCCL process group initialises and a bf16 Learner step on a tiny
    Llama has a finite loss and raises the logprobs it was trained on (no collective claimed).
Either way the loss returns float, 0-dim and per-sequence statistics, reduced with the loss.
"""

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY = {"model_type": "llama", "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 256}


def _nccl_step(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform

    assert dist.get_backend() == "nccl"
    platform = detect_platform("cuda", "bf16")
    learner = Learner(LearnerConfig(tensor_parallel_size=world, global_batch_size=4, micro_batch_size=2,
                                    lr=1e-3), load_hf_config(TINY), platform)
    x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
    tokens = torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(1))
    before = learner.forward_logprobs(tokens)
    metrics = learner.train_step({"tokens": tokens}, _loss_with_metrics)
    after = learner.forward_logprobs(tokens)
    learner.close()
    return {"sum": x[0].item(), "loss": metrics["loss"], "gain": (after - before).mean().item(),
            "rows": metrics["rows"], "seq_mean": metrics["seq_mean"]}


def _loss_with_metrics(lp, mb):
    """-mean logprob with the three kinds of statistic a loss may return (as grpo_loss does):
    a Python float, a 0-dim CUDA tensor and a per-sequence [b] CUDA tensor."""
    return -lp.mean(), {"rows": float(lp.shape[0]), "tokens": torch.tensor(float(lp.numel()), device=lp.device),
                        "seq_mean": lp.detach().mean(dim=1)}


def _check(results, world):
    assert len(results) == world
    for out in results:
        assert out["sum"] == world * (world + 1) / 2
        assert torch.isfinite(torch.tensor(out["loss"]))
        assert out["gain"] > 0, "one step on -logprob must raise the batch's logprobs"
        assert out["rows"] == 4.0 and len(out["seq_mean"]) == 4  # summed over micro-batches, placed per row


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                    reason=f"an NCCL collective between ranks needs 2 GPUs; this machine has "
                           f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
def test_nccl_all_reduce_between_two_ranks_and_tp2_learner_step():
    _check(run_distributed(_nccl_step, 2, device="cuda", timeout=600), world=2)


def test_nccl_init_and_bf16_learner_step_on_one_gpu():
    _check(run_distributed(_nccl_step, 1, device="cuda", timeout=600), world=1)
