"""Host memory at resume for a MoE learner (planner/host_memory.py): a rank's shard holds E / EP experts.

    python -m pytest tests/unit/test_host_memory.py -q
"""

from __future__ import annotations

import pytest

from megatron_rl.planner.host_memory import OPTIMIZER_LOAD_BYTES, resume_host_memory, stage_params
from megatron_rl.planner.ledger import LearnerLayout, ModelDims, RolloutLayout

pytestmark = pytest.mark.unit

# 2 layers, 8 experts of width 32: experts 2 x 8 x 3 x 64 x 32 = 98304 of 252224 parameters
MOE = ModelDims(vocab_size=1000, hidden_size=64, intermediate_size=0, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, num_experts=8, moe_ffn_hidden_size=32, moe_top_k=2)


def _load(ep: int) -> float:
    lay = LearnerLayout(tp=1, pp=2, dp=4, ep=ep)
    host = resume_host_memory(MOE, lay, RolloutLayout(), gpus_per_node=8, sleep_mode=False, rollback_copy=False)
    return host.items["optimizer_load"]


def test_the_optimizer_load_splits_the_experts_over_expert_parallel_ranks_by_hand():
    dense, experts = 252224 - 98304, 98304
    assert stage_params(MOE, LearnerLayout(tp=1, pp=2, dp=4, ep=4)) == dense / 2 + experts / 8
    # 8 ranks on the node; fc1 = layers x (gate + up) x hidden x (E / EP x F_e) / (TP x PP)
    assert _load(4) == 8 * (dense / 2 + experts / 8 + 2 * 2 * 64 * (2 * 32) / 2) * OPTIMIZER_LOAD_BYTES
    assert _load(1) == 8 * (dense / 2 + experts / 2 + 2 * 2 * 64 * (8 * 32) / 2) * OPTIMIZER_LOAD_BYTES
    assert _load(4) < _load(2) < _load(1)
