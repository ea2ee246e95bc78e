"""Held-out splits: carved reproducibly from a training file, and never sharing a question."""

from __future__ import annotations

import pytest

from megatron_rl.data.dataset import Dataset
from megatron_rl.data.splits import check_disjoint, holdout_splits
from megatron_rl.envs.example import Example

pytestmark = pytest.mark.unit


def _ds(split, questions):
    return Dataset(name="t", split=split, examples=[Example(id=str(i), question=q, answer="0")
                                                    for i, q in enumerate(questions)])


def test_missing_splits_are_carved_disjoint_and_reproducible():
    train = _ds("train", [f"q{i}" for i in range(50)])
    a = holdout_splits(train, dev=None, test=None, seed=3, fraction=0.1)
    b = holdout_splits(train, dev=None, test=None, seed=3, fraction=0.1)
    c = holdout_splits(train, dev=None, test=None, seed=4, fraction=0.1)
    assert [len(a[s]) for s in ("train", "dev", "test")] == [40, 5, 5]
    questions = [{ex.question for ex in a[s]} for s in ("train", "dev", "test")]
    assert set.union(*questions) == {f"q{i}" for i in range(50)}
    assert sum(map(len, questions)) == 50  # disjoint, nothing lost
    assert all(a[s].dataset_version == b[s].dataset_version for s in a)
    assert a["test"].dataset_version != c["test"].dataset_version  # the seed picks the split


def test_given_split_is_kept_and_only_the_missing_one_is_carved():
    train, test = _ds("train", [f"q{i}" for i in range(20)]), _ds("test", ["x", "y"])
    splits = holdout_splits(train, dev=None, test=test, seed=0, fraction=0.1)
    assert splits["test"] is test and len(splits["dev"]) == 2 and len(splits["train"]) == 18


def test_overlap_is_an_error_naming_the_examples():
    with pytest.raises(ValueError, match=r"appear in more than one split.*'a b' in train \(id 0\), dev \(id 1\)"):
        check_disjoint({"train": _ds("train", ["a  b", "c"]), "dev": _ds("dev", ["d", "a b"])})


def test_too_small_a_file_is_refused():
    with pytest.raises(ValueError, match="too few to carve"):
        holdout_splits(_ds("train", ["a", "b"]), dev=None, test=None, seed=0, fraction=0.2)
