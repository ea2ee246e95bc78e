"""run_distributed: results come back per rank, a child's exception comes back with its traceback.

    python -m pytest tests/dist/test_spawn.py -q
"""

import pytest
import torch

from megatron_rl.platform.spawn import DistributedChildError, run_distributed

pytestmark = pytest.mark.dist


def _sum_ranks(rank, world, scale):
    import torch.distributed as dist

    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return {"rank": rank, "sum": x * scale, "backend": dist.get_backend()}


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom from the test")
    return rank


def test_results_in_rank_order_over_gloo():
    out = run_distributed(_sum_ranks, 2, 10.0, timeout=120)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["backend"] == "gloo" and o["sum"].item() == 30.0 for o in out)


def test_child_exception_is_reraised_with_traceback():
    with pytest.raises(DistributedChildError, match="rank 1 of 2") as info:
        run_distributed(_fail_on_rank_one, 2, timeout=120)
    assert "ValueError: boom from the test" in str(info.value)
    assert "_fail_on_rank_one" in str(info.value)


def _what_the_rank_has(rank, world):
    import os
    import sys

    return {"var": os.environ.get("MEGATRON_RL_SPAWN_PROBE"), "gone": os.environ.get("MEGATRON_RL_SPAWN_GONE"),
            "megatron": "megatron.core.models.gpt" in sys.modules, "pid": os.getpid()}


def test_cpu_ranks_fork_from_a_preloaded_server_with_the_callers_environment_of_the_moment(monkeypatch):
    """CPU ranks fork from a forkserver that imported Megatron once (platform/spawn.py `_PRELOAD`); a rank
    still sees the environment the caller has when it calls, not the one the server started with."""
    import multiprocessing.forkserver as forkserver

    monkeypatch.setenv("MEGATRON_RL_SPAWN_GONE", "set before the server")
    run_distributed(_sum_ranks, 1, 1.0, timeout=120)  # the server is up from here on
    server = forkserver._forkserver._forkserver_pid
    assert server is not None
    monkeypatch.setenv("MEGATRON_RL_SPAWN_PROBE", "set after the server started")
    monkeypatch.delenv("MEGATRON_RL_SPAWN_GONE")
    out = run_distributed(_what_the_rank_has, 2, timeout=120)
    assert [o["var"] for o in out] == ["set after the server started"] * 2
    assert [o["gone"] for o in out] == [None, None]
    assert all(o["megatron"] for o in out)  # imported before the fork, by the server
    assert forkserver._forkserver._forkserver_pid == server  # the same server: one import per caller
