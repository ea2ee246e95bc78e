"""The Megatron-Core learner: `Learner`, its `LearnerConfig`, and per-token logprobs.

    from megatron_rl.learner import Learner, LearnerConfig

The names load on first use (PEP 562), so that importing the config (`megatron_rl.learner.config`, pure
Python) does not import torch: the console script's parser stays fast.
"""

from __future__ import annotations

import importlib

_WHERE = {"Learner": "learner", "LossFn": "learner", "LearnerConfig": "config", "SamplingConfig": "config",
          "token_logprobs": "logprobs"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
