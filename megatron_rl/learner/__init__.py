"""The Megatron-Core learner: `Learner`, its `LearnerConfig`, and per-token logprobs.

    from megatron_rl.learner import Learner, LearnerConfig

The names load on first use (PEP 562), so that importing the config (`megatron_rl.learner.config`, pure
Python) does not import torch: the console script's parser stays fast.
"""

from __future__ import annotations

from megatron_rl.lazy_names import lazy_names

_WHERE = {"Learner": "learner", "LossFn": "learner", "LearnerConfig": "config", "SamplingConfig": "config",
          "token_logprobs": "logprobs"}

__all__ = sorted(_WHERE)

__getattr__ = lazy_names(__name__, _WHERE)
