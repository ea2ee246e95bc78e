"""The learner scores the distribution vLLM samples from: temperature, top-k, top-p, at TP=1 and TP=2.

    python -m pytest tests/dist/test_sampling_logprobs.py -q

The reference is vLLM's own sampler code applied to the same logits (Sampler.apply_temperature,
apply_top_k_top_p as the CPU engine calls it, Sampler.compute_logprobs): what the engine reports
as processed_logprobs.  The learner's `token_logprobs` runs in 2 gloo processes on vocab shards
(padded columns hold junk that must be masked; rows masked in one chunk or several) and must agree within 1e-6 wherever vLLM's
log-probability is finite; where vLLM gives -inf (token cut by top-k/top-p) it must give
OUT_OF_SUPPORT_LOGPROB.  Gradients must match autograd of the log-softmax over vLLM's kept tokens.
"""

import pytest
import torch

from megatron_rl.learner.config import SamplingConfig
from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

VOCAB, PADDED = 101, 128  # real vocabulary; Megatron-style padded width (a multiple of tp)
B, T = 3, 9
SETTINGS = [  # (temperature, top_p, top_k)
    (0.7, 1.0, 0),
    (1.0, 0.9, 0),
    (1.0, 1.0, 5),   # top-k only: vLLM's sort-free path
    (0.7, 0.9, 20),
    (1.3, 0.5, 7),
    (0.7, 0.95, 3),  # rows with ties at the 3rd value (see _logits)
]
LAYOUTS = [(1, 1024), (2, 1024), (2, 5)]  # (TP size, rows masked per chunk: 5 splits the 24 rows unevenly)


def _logits():
    """[B, T, PADDED] float32: varied scales, junk in the padded columns, exact ties at the top."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, T, PADDED, generator=g) * torch.linspace(1.0, 4.0, T).view(1, T, 1)
    logits[..., VOCAB:] = 50.0  # would dominate every softmax if it were not masked
    row = logits[1, 2, :VOCAB]
    top = row.topk(4).indices
    row[top[3]] = row[top[2]]  # 3rd and 4th largest tie: top_k=3 must keep both (vLLM keeps ties)
    return logits


def _tokens():
    # Mostly likely tokens (argmax per position), some random ones that truncation cuts.
    logits = _logits()[..., :VOCAB]
    tokens = logits.argmax(-1)
    rnd = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    pick = torch.rand(B, T, generator=torch.Generator().manual_seed(6)) < 0.5
    tokens = torch.where(pick, rnd, tokens)
    # token t+1 is scored at position t: shift so that position t's target is its own pick
    return torch.cat([tokens[:, :1], tokens[:, :-1]], dim=1)


def _vllm_reference(logits_btv, tokens_bt, temperature, top_p, top_k):
    """vLLM's processed logprobs of tokens[:, 1:] and their gradient wrt the logits (autograd)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.sample.sampler import Sampler

    leaf = logits_btv[:, :-1, :VOCAB].reshape(-1, VOCAB).clone().requires_grad_(True)  # [N, V]
    n = leaf.shape[0]
    tempered = Sampler.apply_temperature(leaf.to(torch.float32).clone(),
                                         torch.full((n,), temperature, dtype=torch.float32), all_random=True)
    # vLLM's input batch: k is None unless 0 < top_k < vocab, p is None unless top_p < 1.
    k = torch.full((n,), top_k, dtype=torch.int32) if 0 < top_k < VOCAB else None
    p = torch.full((n,), top_p, dtype=torch.float32) if top_p < 1 else None
    processed = apply_top_k_top_p(tempered.detach().clone(), k, p)  # vLLM's ops are in place, not autograd
    logprobs = Sampler.compute_logprobs(processed)  # [N, V]
    picked = logprobs.gather(1, tokens_bt[:, 1:].reshape(-1, 1)).view(B, T - 1)
    finite = torch.isfinite(picked)
    # Gradient: the same masked log-softmax, differentiated through the temperature (the mask is a selection).
    kept = tempered.masked_fill(~torch.isfinite(processed), float("-inf")).log_softmax(dim=-1)
    kept.gather(1, tokens_bt[:, 1:].reshape(-1, 1)).view(B, T - 1).masked_fill(~finite, 0.0).sum().backward()
    grad = torch.zeros(B, T, PADDED)
    grad[:, :-1, :VOCAB] = leaf.grad.view(B, T - 1, VOCAB)
    return picked.detach(), grad


def _learner_side(rank, world):
    from megatron.core import parallel_state as ps

    from megatron_rl.learner import logprobs
    from megatron_rl.learner.logprobs import token_logprobs
    from megatron_rl.platform.parallel import parallel_scope

    logits, tokens = _logits(), _tokens()
    out = {}
    for tp, rows_per_chunk in LAYOUTS:
        logprobs.ROWS_PER_CHUNK = rows_per_chunk
        with parallel_scope(tp=tp, pp=1):
            width = PADDED // tp
            start = ps.get_tensor_model_parallel_rank() * width
            for setting in SETTINGS:
                temperature, top_p, top_k = setting
                local = logits[..., start:start + width].clone().requires_grad_(True)
                lp = token_logprobs(local, tokens, VOCAB, SamplingConfig(temperature=temperature, top_p=top_p,
                                                                         top_k=top_k))
                in_support = lp > -80
                lp.masked_fill(~in_support, 0.0).sum().backward()
                out[(tp, rows_per_chunk, setting)] = {"logprobs": lp.detach(), "grad": local.grad, "start": start}
    return out


@pytest.fixture(scope="module")
def learner_runs():
    return run_distributed(_learner_side, 2, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}-chunk{l[1]}")
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"T{s[0]}-p{s[1]}-k{s[2]}")
def test_learner_logprobs_equal_vllm_processed_logprobs(learner_runs, layout, setting):
    from megatron_rl.learner.logprobs import OUT_OF_SUPPORT_LOGPROB

    ref, ref_grad = _vllm_reference(_logits(), _tokens(), *setting)
    finite = torch.isfinite(ref)
    if setting[1] < 1 or setting[2] > 0:
        assert (~finite).any() and finite.any(), "the test must score tokens both kept and cut by truncation"
    for rank, out in enumerate(learner_runs):
        got = out[(*layout, setting)]
        torch.testing.assert_close(got["logprobs"][finite], ref[finite], atol=1e-6, rtol=0)
        assert (got["logprobs"][~finite] == OUT_OF_SUPPORT_LOGPROB).all(), f"rank {rank}"
        start = got["start"]
        expected = ref_grad[..., start:start + got["grad"].shape[-1]]
        torch.testing.assert_close(got["grad"], expected, atol=1e-6, rtol=0)


def test_ties_at_the_kth_value_are_kept():
    """top_k=3 on a row whose 3rd and 4th logits tie keeps 4 tokens, as vLLM does."""
    from megatron_rl.learner.logprobs import truncation_keep_mask

    row = _logits()[1, 2, :VOCAB].unsqueeze(0) / 0.7
    keep = truncation_keep_mask(row, SamplingConfig(temperature=0.7, top_k=3))
    assert int(keep.sum()) == 4
    keep_p = truncation_keep_mask(row, SamplingConfig(temperature=0.7, top_k=3, top_p=0.999999))
    assert int(keep_p.sum()) == 4
