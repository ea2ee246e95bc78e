"""The micro-batch plan of a global batch: fixed (today's layout) and token budget."""

import random

import pytest

from megatron_rl.learner.micro_batches import plan_micro_batches


def test_fixed_mode_is_contiguous_rows_as_wide_as_the_batch():
    plan = plan_micro_batches([3, 9, 4, 5, 2, 8, 7, 6], dp=2, micro_batch_size=2, width=10)
    assert plan.ranks == [[([0, 1], 10), ([2, 3], 10)], [([4, 5], 10), ([6, 7], 10)]]
    assert plan.num_micro_batches == 4
    assert plan.padding_fraction == pytest.approx(1 - 44 / 80)


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_budget_plan_covers_every_row_once_with_the_same_count_per_rank(dp, seed):
    rng = random.Random(seed)
    lengths = [rng.choice([rng.randint(5, 30)] * 9 + [rng.randint(200, 256)]) for _ in range(32)]
    budget = 300
    plan = plan_micro_batches(lengths, dp=dp, micro_batch_size=1, max_tokens=budget)
    assert plan == plan_micro_batches(lengths, dp=dp, micro_batch_size=1, max_tokens=budget)  # deterministic
    assert len({len(rank) for rank in plan.ranks}) == 1
    rows = [i for rank in plan.ranks for r, _ in rank for i in r]
    assert sorted(rows) == list(range(32))
    for rank in plan.ranks:
        assert sum(len(r) for r, _ in rank) == 32 // dp
        for r, width in rank:
            assert width == max(lengths[i] for i in r)
            assert len(r) == 1 or len(r) * width <= budget
    loads = [sum(lengths[i] for r, _ in rank for i in r) for rank in plan.ranks]
    assert max(loads) - min(loads) <= max(lengths)  # greedy balance: within one row
    fixed = plan_micro_batches(lengths, dp=dp, micro_batch_size=1)
    assert plan.padding_fraction < 0.5 * fixed.padding_fraction


def test_ranks_with_fewer_micro_batches_split_their_costliest():
    # rank 0: [50] [10 10] [10] by the budget; rank 1 packs [10 10] [10 10] and must split one.
    plan = plan_micro_batches([50, 10, 10, 10, 10, 10, 10, 10], dp=2, micro_batch_size=1, max_tokens=20)
    assert [len(r) for r, _ in plan.ranks[0]] == [1, 2, 1]
    assert sorted(len(r) for r, _ in plan.ranks[1]) == [1, 1, 2]
    assert plan.num_micro_batches == 6


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError):
        plan_micro_batches([3, 0], dp=1, micro_batch_size=1, max_tokens=8)
    with pytest.raises(ValueError):
        plan_micro_batches([3, 4, 5], dp=2, micro_batch_size=1, max_tokens=8)
