"""The Megatron-Core learner: `Learner`, its `LearnerConfig`, and per-token logprobs.

    from megatron_rl.learner import Learner, LearnerConfig
"""

from megatron_rl.learner.config import LearnerConfig, SamplingConfig
from megatron_rl.learner.learner import Learner, LossFn
from megatron_rl.learner.logprobs import token_logprobs

__all__ = ["Learner", "LearnerConfig", "LossFn", "SamplingConfig", "token_logprobs"]
