"""Every vLLM worker of every rollout group has its own rank in the publication group (issue #45).

    python -m pytest tests/unit/test_engine_rank.py -q

The publisher gives each group its offset (publish/trainer.py `group_offsets`), each worker adds its place
in its engine (publish/vllm_engine.py `engine_rank`, the one formula of the gloo, nccl and ipc backends).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rl.publish.trainer import group_offsets
from megatron_rl.publish.vllm_engine import engine_rank

pytestmark = pytest.mark.unit


def test_the_workers_of_every_group_fill_ranks_one_to_world_minus_one():
    sizes = [2, 4, 1]  # each rollout group's vLLM worker processes (RolloutWorker.engine_world_size)
    offsets, world = group_offsets(sizes)
    assert offsets == [1, 3, 7] and world == 8
    ranks = [engine_rank(offset, SimpleNamespace(data_parallel_index=0, world_size=size, rank=r))
             for offset, size in zip(offsets, sizes) for r in range(size)]
    assert ranks == list(range(1, world))  # distinct, in order, rank 0 left to the publisher
    assert engine_rank(3, SimpleNamespace(data_parallel_index=1, world_size=2, rank=1)) == 3 + 2 + 1
