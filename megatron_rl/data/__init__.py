"""Prompt data: the built-in digit_max task, a JSONL loader, prompt templates, a resumable cursor.

    from megatron_rl.data import make_digit_max, load_jsonl, PromptTemplate, DataCursor
"""

from megatron_rl.data.builtin import DIGIT_MAX_TEMPLATE, digit_max_reward_config, make_digit_max
from megatron_rl.data.cursor import DataCursor
from megatron_rl.data.dataset import Dataset, PromptTemplate, content_hash
from megatron_rl.data.jsonl import load_jsonl

__all__ = [
    "DIGIT_MAX_TEMPLATE", "DataCursor", "Dataset", "PromptTemplate", "content_hash",
    "digit_max_reward_config", "load_jsonl", "make_digit_max",
]
