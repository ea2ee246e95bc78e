"""Per-token log-probabilities from (vocab-parallel) logits, under the distribution vLLM sampled.

    logprobs_bt = token_logprobs(logits_btv, tokens_bt, vocab_size, sampling)   # [B, T-1]
    keep_nv = truncation_keep_mask(tempered_nv, sampling)                      # [N, V_real] bool

Legend: B sequences, T tokens, V vocabulary columns held by this TP rank (V_padded / tp), N rows,
V_real the real vocabulary.  logprobs_bt[b, t] = log p(tokens[b, t+1] | tokens[b, :t+1]),
normalised over the REAL vocabulary: Megatron pads the embedding table to a multiple of 128*tp,
and those padded columns are masked to -inf so the distribution equals the HF checkpoint's.
Differentiable; under TP the softmax normaliser is all-reduced across the TP group.

p is the distribution vLLM 0.32 draws from and reports with logprobs_mode=processed_logprobs
(vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py, the CPU / PyTorch path):
  1. the logits in float32, divided by `sampling.temperature`;
  2. top-k (k > 0 and k < V_real): a token survives when its logit is >= the k-th largest one,
     so every token tied with the k-th survives;
  3. top-p (p < 1): the surviving logits are sorted ascending (torch.sort, as vLLM), softmaxed and
     summed cumulatively in that order; a token is dropped when its cumulative sum is <= 1 - p
     (1 - p computed in float32), and the last (most likely) one is always kept;
  4. log-softmax over the survivors.
Steps 2-3 decide on whole vocabulary rows: under TP the detached logits are all-gathered across
the TP group, every rank computes the same keep-mask and applies its own columns of it; the
log-softmax itself stays vocab-parallel.  The mask carries no gradient (it is a selection).
Where tokens tie exactly at the nucleus boundary, which of them is kept depends on the sort's
order, as in vLLM; with logits that differ from the engine's by float noise this is measure-zero.

A token outside the truncated support (off-policy: the policy moved since sampling; or the
reference model) has probability 0 and log-probability -inf.  It scores OUT_OF_SUPPORT_LOGPROB
instead, with no gradient, so ratios and KL estimates downstream stay finite.

Not reproduced: vLLM on CUDA with Triton masks with a pivot-based kernel (topk_topp_triton.py)
and FlashInfer never reports processed logprobs; this file follows the CPU/PyTorch semantics.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_rl.learner.config import SamplingConfig

OUT_OF_SUPPORT_LOGPROB = math.log(torch.finfo(torch.float32).tiny)  # about -87.3
ROWS_PER_CHUNK = 1024  # token positions whose whole-vocabulary rows are masked at once


def token_logprobs(logits_btv: torch.Tensor, tokens_bt: torch.Tensor, vocab_size: int,
                   sampling: SamplingConfig | None = None) -> torch.Tensor:
    """log p(next token) for every position but the last: [B, T, V/tp] x [B, T] -> [B, T-1]."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    sampling = sampling or SamplingConfig()
    local_v = logits_btv.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local_v
    # A fresh float32 tensor: the cross-entropy below edits its input in place.
    logits = logits_btv[:, :-1].float().clone()  # [B, T-1, V/tp]
    if sampling.temperature != 1.0:
        # Divide by a one-element float32 tensor, as vLLM divides by its per-request temperatures.
        logits = logits / torch.tensor([sampling.temperature], dtype=torch.float32, device=logits.device)
    column_ids = torch.arange(start, start + local_v, device=logits.device)
    if start + local_v > vocab_size:
        logits = logits.masked_fill(column_ids >= vocab_size, float("-inf"))
    if sampling.truncates:
        keep = _local_keep_mask(logits.detach(), vocab_size, sampling, start)  # [B, T-1, V/tp]
        logits = logits.masked_fill(~keep, float("-inf"))
    targets = tokens_bt[:, 1:].contiguous()  # [B, T-1]
    logprobs_bt = -vocab_parallel_cross_entropy(logits, targets)  # [B, T-1]
    if sampling.truncates:
        logprobs_bt = torch.where(torch.isfinite(logprobs_bt), logprobs_bt,
                                  torch.full_like(logprobs_bt, OUT_OF_SUPPORT_LOGPROB))
    return logprobs_bt


def _local_keep_mask(local_btv: torch.Tensor, vocab_size: int, sampling: SamplingConfig,
                     start: int) -> torch.Tensor:
    """This rank's columns of the keep-mask decided on whole rows: [B, T-1, V/tp] -> same, bool.

    Rows go ROWS_PER_CHUNK at a time, so the gathered rows and the sort's buffers stay bounded
    (every TP rank holds the same rows, so each issues the same all-gathers).
    """
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    local_v = local_btv.shape[-1]
    rows_nv = local_btv.reshape(-1, local_v)  # [N, V/tp]
    keep_nv = torch.zeros_like(rows_nv, dtype=torch.bool)  # padded columns stay False
    for lo in range(0, rows_nv.shape[0], ROWS_PER_CHUNK):
        chunk = rows_nv[lo:lo + ROWS_PER_CHUNK].contiguous()  # [n, V/tp]
        if tp > 1:
            parts = [torch.empty_like(chunk) for _ in range(tp)]
            dist.all_gather(parts, chunk, group=ps.get_tensor_model_parallel_group())
            chunk = torch.cat(parts, dim=-1)  # [n, V_padded]
        full_keep = truncation_keep_mask(chunk[:, :vocab_size], sampling)  # [n, V_real]
        real_cols = max(0, min(local_v, vocab_size - start))
        keep_nv[lo:lo + ROWS_PER_CHUNK, :real_cols] = full_keep[:, start:start + real_cols]
    return keep_nv.view_as(local_btv)


def truncation_keep_mask(tempered_nv: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Which tokens survive top-k then top-p, given tempered float32 logits over the real vocabulary.

    [N, V_real] -> [N, V_real] bool.  vLLM's rules (see the module docstring): ties at the k-th
    value survive; top-p drops a token whose ascending cumulative probability is <= 1 - p and
    never the most likely token.
    """
    n, v = tempered_nv.shape
    k = sampling.top_k if 0 < sampling.top_k < v else 0
    if sampling.top_p >= 1:
        if not k:
            return torch.ones_like(tempered_nv, dtype=torch.bool)
        kth_largest = tempered_nv.topk(k, dim=-1).values[:, -1:]  # [N, 1]
        return tempered_nv >= kth_largest
    ascending, order = tempered_nv.sort(dim=-1, descending=False)  # [N, V_real] each
    if k:
        ascending = ascending.masked_fill(ascending < ascending[:, v - k:v - k + 1], float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)  # [N, V_real]
    threshold = 1 - torch.tensor(sampling.top_p, dtype=torch.float32, device=tempered_nv.device)
    dropped = cumulative <= threshold
    dropped[:, -1] = False  # the most likely token always survives
    keep_sorted = ~dropped & (ascending > float("-inf"))
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
