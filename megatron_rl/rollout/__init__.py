"""Rollout side: vLLM engines in Ray actors producing token-level samples.

    from megatron_rl.rollout import RolloutConfig, RolloutSample, RolloutWorker, create_rollout_worker
"""

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.sample import RolloutSample
from megatron_rl.rollout.worker import RolloutWorker, create_rollout_worker

__all__ = ["RolloutConfig", "RolloutSample", "RolloutWorker", "create_rollout_worker"]
