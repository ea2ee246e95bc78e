"""destroy_parallel destroys the process groups that initialize_parallel (and later users) made.

    python -m pytest tests/unit/test_parallel_groups.py -q

One gloo rank (world size 1; Megatron still makes every group) set up and torn down three times:
torch's registry of live groups is back to its size before the first set-up each time, a group
made before initialize_parallel survives, and publish/ipc_route.py's cached subgroup is destroyed
and made anew rather than handed out again.  The 2-rank rebuild check is in
tests/dist/test_learner_rebuild.py.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_rl.platform import parallel
from megatron_rl.platform.spawn import run_distributed


def _cycles(rank: int, world_size: int) -> dict:
    from megatron_rl.publish import ipc_route

    kept = dist.new_group([0])  # a group from before the parallel state: not the learner's to destroy
    start = parallel.live_group_count()
    during, after, subgroups = [], [], []
    for _ in range(3):
        parallel.initialize_parallel(tp=1, pp=1)
        subgroup = ipc_route._subgroup((0,))
        assert ipc_route._subgroup((0,)) is subgroup  # cached within one parallel state
        during.append(parallel.live_group_count())
        parallel.destroy_parallel()
        after.append(parallel.live_group_count())
        subgroups.append((parallel.group_is_live(subgroup), len(ipc_route._SUBGROUPS)))
    return {"start": start, "during": during, "after": after, "kept": parallel.group_is_live(kept),
            "subgroups": subgroups}


def test_destroy_parallel_destroys_the_groups_it_made():
    (out,) = run_distributed(_cycles, 1, timeout=300)
    assert out["during"][0] > out["start"] + 5, out  # Megatron's TP/PP/DP/... groups and the subgroup
    assert out["during"] == [out["during"][0]] * 3, out
    assert out["after"] == [out["start"]] * 3, out
    assert out["kept"]
    for live, cached in out["subgroups"]:
        assert not live and cached == 0


def test_a_missing_torch_registry_is_named(monkeypatch):
    monkeypatch.delattr(dist.distributed_c10d, "_world")
    with pytest.raises(RuntimeError, match=r"torch .* has no torch\.distributed\.distributed_c10d\._world\.pg_map"):
        parallel.live_group_count()
