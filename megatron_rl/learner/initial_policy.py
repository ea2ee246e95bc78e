"""The Megatron learner of one rank, filled with the initial policy from a Hugging Face checkpoint.

    policy = InitialPolicy.load(learner_cfg, hf_dir, platform, sampling=sampling)   # after the rank joined
    policy.learner, policy.hf_cfg, policy.checkpoint, policy.tp_rank, policy.padded_vocab

Built by every learner rank (ranks/rank.py `LearnerWorker`, whose frozen reference,
ranks/build.py `Reference`, is filled from the same checkpoint) and by the offline audit's
one-rank learner (audit/offline.py).  The weights go through the shared HF <-> Megatron mapping
(conversion/model_io.py `fill_from_hf`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_rl.conversion.hf_io import HFCheckpoint
    from megatron_rl.learner.config import LearnerConfig, SamplingConfig
    from megatron_rl.learner.learner import Learner
    from megatron_rl.models.hf_config import HFModelConfig


@dataclasses.dataclass
class InitialPolicy:
    """The Megatron learner of one rank, filled from the HF checkpoint it starts from."""

    learner: Learner
    hf_cfg: HFModelConfig
    checkpoint: HFCheckpoint
    """The HF checkpoint the learner was filled from (the reference is filled from it too)."""
    tp_rank: int
    padded_vocab: int

    @classmethod
    def load(cls, learner_cfg: LearnerConfig, hf_dir: str, platform, *,
             sampling: SamplingConfig | None = None) -> InitialPolicy:
        """Build the learner of `learner_cfg` (after the rank joined torch.distributed) and load the initial
        policy of `hf_dir` into it; `sampling`: the distribution the engines sample from (None: plain)."""
        from megatron.core import parallel_state as ps

        from megatron_rl.conversion.hf_io import HFCheckpoint
        from megatron_rl.conversion.model_io import fill_from_hf
        from megatron_rl.learner.learner import Learner
        from megatron_rl.models.hf_config import load_hf_config, padded_vocab_size

        hf_cfg = load_hf_config(hf_dir)
        learner = Learner(learner_cfg, hf_cfg, platform, sampling=sampling)
        tp = learner_cfg.tensor_parallel_size
        policy = cls(learner, hf_cfg, HFCheckpoint(hf_dir, hf_cfg), ps.get_tensor_model_parallel_rank(),
                     padded_vocab_size(hf_cfg.vocab_size, tp))
        fill_from_hf(learner.model[0].module, hf_cfg, policy.checkpoint, policy.tp_rank, tp, policy.padded_vocab)
        # Megatron's optimizer keeps fp32 main params for bf16 models: copy the loaded weights in.
        if hasattr(learner.optimizer, "reload_model_params"):
            learner.optimizer.reload_model_params()
        return policy
