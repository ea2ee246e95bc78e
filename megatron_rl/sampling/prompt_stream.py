"""The prompts a training run samples: the training split in the data cursor's order, each prompt with
the PromptInfo (rollout/sample.py) its samples carry to the grader and into their trajectories.

    prompts = PromptStream(train, template, tokenizer, cursor)
    tokens, info = prompts.next(round_, 8)                   # 8 encoded prompts and their PromptInfos
    examples, info = prompts.next(serial, 1, examples=True)  # a multi-turn run: the data Examples themselves
    tokens, info = prompts.at([17], serial)                  # example 17 again (the cursor stays)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.data.cursor import DataCursor
from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.rollout.sample import PromptInfo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptStream:
    """The training split, visited in the data cursor's order, encoded with the prompt template."""

    def __init__(self, dataset: Dataset, template: PromptTemplate, tokenizer: PreTrainedTokenizerBase,
                 cursor: DataCursor):
        self.dataset, self.template, self.tokenizer, self.cursor = dataset, template, tokenizer, cursor

    def next(self, round_: int, n: int, *, examples: bool = False) -> tuple[list, list[PromptInfo]]:
        """The next n prompts (token ids; with `examples`, the data Examples an episode starts from) and
        their PromptInfos (id, round, answer, what a reward function is given beside the texts, the
        example's own response budget when it has one); advances the cursor."""
        return self.at(self.cursor.next_indices(n), round_, examples=examples)

    def at(self, indices: list[int], round_: int, *, examples: bool = False) -> tuple[list, list[PromptInfo]]:
        """The prompts of the training split's examples `indices` (drawn before: a prompt group in flight at
        a checkpoint, generated again at resume), as `next` gives them; the cursor does not move."""
        prompts, info = [], []
        for idx in indices:
            ex = self.dataset[idx]
            prompts.append(ex if examples else self.template.encode(ex, self.tokenizer))
            info.append(PromptInfo(id=ex.id, round=round_, answer=ex.reference, fields=ex.reward_fields(),
                                   max_tokens=ex.max_tokens))
        return prompts, info
