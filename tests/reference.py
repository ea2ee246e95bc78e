"""Teacher-forced logprobs from transformers: the reference vLLM's scores are compared with.

    from tests.reference import SEQUENCES, hf_logprobs
    want = hf_logprobs(model_dir, state)          # one [T-1] float64 tensor per sequence
"""

import torch

from megatron_rl.models.tokenizer import BOS_ID

SEQUENCES = [[BOS_ID, 23, 24, 17, 29, 35, 23, 31], [BOS_ID, 78, 75, 82, 82, 85, 6, 61, 85]]


def hf_logprobs(model_dir, state: dict, sequences=SEQUENCES) -> list[torch.Tensor]:
    """Logprob of every token after the first given its prefix, with `state` loaded over the
    checkpoint in `model_dir` (names it lacks keep the checkpoint's values)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    model.load_state_dict(state, strict=False)
    out = []
    for seq in sequences:
        ids = torch.tensor([seq])  # [1, T]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # [T, V]
        out.append(logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1))  # [T-1]
    return out


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, where: str, atol: float = 1e-5) -> None:
    """Logits of two layouts agree: same shape (a mismatch FAILS, it is never skipped), then values."""
    assert tuple(got.shape) == tuple(want.shape), f"{where}: logits shape {tuple(got.shape)} != {tuple(want.shape)}"
    torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m: f"{where}: {m}")


@torch.no_grad()
def fresh_logprobs(model, seq: list[int]) -> torch.Tensor:
    """Logprob of seq[t] for every t >= 1 given seq[:t], every position computed by `model` [T-1]."""
    ids = torch.tensor([seq])  # [1, T]
    logp = torch.log_softmax(model(ids).logits[0].double(), -1)  # [T, V]
    return logp[:-1].gather(1, ids[0, 1:, None]).squeeze(1)


@torch.no_grad()
def stale_logprobs(old, new, seq: list[int], k: int) -> torch.Tensor:
    """Logprob of seq[t] for every t > k when the KV of positions [0, k) was computed by `old` and the
    rest by `new` (what a request kept across a refit without recompute attends to) [T-k-1]."""
    ids = torch.tensor([seq])  # [1, T]
    cache = old(ids[:, :k], use_cache=True).past_key_values
    logp = torch.log_softmax(new(ids[:, k:], past_key_values=cache, use_cache=True).logits[0].double(), -1)  # [T-k, V]
    return logp[:-1].gather(1, ids[0, k + 1:, None]).squeeze(1)
