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
