"""Prompts longer than the engine can take, dropped before any work (data.max_prompt_tokens).

    fitted = fit_prompts(splits, template, tokenizer, max_prompt_tokens=62)
    fitted.splits            # {"train", "dev", "test"} without the prompts over 62 tokens
    fitted.dropped           # {"train": 3, "dev": 0, "test": 1}
    fitted.record()          # what run_manifest.json and `train --dry-run` report

A prompt is measured as the rollout encodes it (PromptTemplate.encode: the template applied,
special tokens included).  The limit is the room the engine leaves a prompt next to a whole
response, rollout.max_model_len - rollout.max_tokens, unless data.max_prompt_tokens sets a
smaller one (train/config.py `TrainConfig.prompt_token_limit`); a longer prompt would be refused
by vLLM in the middle of the run.  A split left with no prompt is a DataError naming it.
"""

from __future__ import annotations

import dataclasses
import logging

from megatron_rl.config import DataError
from megatron_rl.data.dataset import Dataset, PromptTemplate

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FittedPrompts:
    """The splits whose prompts fit, and how many prompts of each split were dropped."""

    splits: dict[str, Dataset]
    dropped: dict[str, int]
    max_prompt_tokens: int
    longest: dict[str, int]
    """The longest prompt of each split before the filter, in tokens (0 for an empty split)."""

    def record(self) -> dict:
        """{"max_prompt_tokens", "prompts_dropped": {split: n}, "longest_prompt": {split: tokens}}."""
        return {"max_prompt_tokens": self.max_prompt_tokens, "prompts_dropped": dict(self.dropped),
                "longest_prompt": dict(self.longest)}


def fit_prompts(splits: dict[str, Dataset], template: PromptTemplate, tokenizer,
                max_prompt_tokens: int) -> FittedPrompts:
    """Drop every example whose encoded prompt is longer than `max_prompt_tokens`, split by split;
    log the counts.  Raises DataError when a non-empty split has no prompt left, naming the split,
    its shortest prompt and the limit."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    kept_splits, dropped, longest = {}, {}, {}
    for name, ds in splits.items():
        lengths = [len(template.encode(ex, tokenizer)) for ex in ds]
        kept = [ex for ex, n in zip(ds, lengths) if n <= max_prompt_tokens]
        dropped[name] = len(ds) - len(kept)
        longest[name] = max(lengths, default=0)
        if lengths and not kept:
            raise DataError(f"data split {name!r}: all {len(ds)} prompts are longer than the {max_prompt_tokens}-token "
                            f"limit (data.max_prompt_tokens, by default rollout.max_model_len - rollout.max_tokens); "
                            f"the shortest has {min(lengths)} tokens: raise rollout.max_model_len, lower "
                            f"rollout.max_tokens or use shorter prompts")
        kept_splits[name] = ds if not dropped[name] else Dataset(name=ds.name, split=ds.split, examples=kept)
        if dropped[name]:
            logger.warning("data split %r: dropped %d of %d prompts longer than %d tokens (longest %d)",
                           name, dropped[name], len(ds), max_prompt_tokens, longest[name])
    logger.info("prompts over %d tokens dropped per split: %s", max_prompt_tokens,
                ", ".join(f"{name} {n}" for name, n in dropped.items()))
    return FittedPrompts(kept_splits, dropped, max_prompt_tokens, longest)
