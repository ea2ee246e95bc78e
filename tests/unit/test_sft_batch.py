"""SFT batches: the loss covers the answer and EOS, never the prompt; normalised over the batch."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data.dataset import PromptTemplate
from megatron_rl.envs.example import Example
from megatron_rl.learner.sft_loss import sft_micro_batch_loss
from megatron_rl.train.sft_data import sft_batch

pytestmark = pytest.mark.unit


class CharTokenizer:
    eos_token_id, pad_token_id = 2, 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_mask_covers_answer_and_eos_and_micro_batches_sum_to_the_batch_mean():
    examples = [Example(id="a", question="max(1,9)", answer="9"), Example(id="b", question="m(3)", answer="33")]
    batch = sft_batch(examples, PromptTemplate("{question}="), CharTokenizer(), micro_batch_size=1)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    assert tokens[0].tolist() == [ord(c) for c in "max(1,9)=9"] + [2]
    assert tokens[1].tolist() == [ord(c) for c in "m(3)=33"] + [2, 0, 0, 0]
    # Position k predicts token k+1: the targets under the mask are exactly answer + EOS.
    assert tokens[0, 1:][mask[0] > 0].tolist() == [ord("9"), 2]
    assert tokens[1, 1:][mask[1] > 0].tolist() == [ord("3"), ord("3"), 2]
    assert batch["token_denominator"] == pytest.approx(5 / 2)  # 5 target tokens, 2 micro-batches
    logprobs = -torch.rand(2, tokens.shape[1] - 1, dtype=torch.float64)
    per_micro = [sft_micro_batch_loss(logprobs[i:i + 1], {**batch, "loss_mask": mask[i:i + 1]})[0] for i in range(2)]
    # The learner averages micro-batches: that average must be the batch's mean NLL per target token.
    assert sum(per_micro) / 2 == pytest.approx(float(-(logprobs * mask).sum() / mask.sum()))
