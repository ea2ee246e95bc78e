"""Train / dev / test splits that are disjoint by construction, and checked.

    splits = holdout_splits(train_ds, dev=None, test=test_ds, seed=0, fraction=0.1)
    splits["train"], splits["dev"], splits["test"]        # Datasets

A held-out split given as its own file is used as it is; a missing one is carved from the
training file: its examples are shuffled with `seed`, the test split is cut first, then dev,
each `fraction` of the file (at least one example), and the rest trains.  The same file and
seed always give the same splits.  Whatever their origin, the splits are then checked: an
example whose question (whitespace-normalised) appears in two splits is an error naming the
splits and the shared examples, so a "held-out" number can never be measured on training
data.
"""

from __future__ import annotations

import random
from collections import defaultdict

from megatron_rl.data.dataset import Dataset
from megatron_rl.config import DataError

HELD_OUT = ("test", "dev")  # carving order: the hidden test split first


def _key(question: str) -> str:
    return " ".join(question.split())


def holdout_splits(train: Dataset, *, dev: Dataset | None, test: Dataset | None, seed: int,
                   fraction: float) -> dict[str, Dataset]:
    """{"train", "dev", "test"}: given splits kept, missing ones carved from `train`, all disjoint."""
    if not 0 < fraction < 0.5:
        raise DataError(f"data.holdout_fraction must be in (0, 0.5), got {fraction}")
    given = {"dev": dev, "test": test}
    missing = [name for name in HELD_OUT if given[name] is None]
    pool = list(train.examples)
    if missing:
        random.Random(f"holdout:{seed}:{train.dataset_version}").shuffle(pool)
        size = max(1, int(len(train) * fraction))
        if len(pool) <= size * len(missing):
            raise DataError(f"dataset {train.name!r} has {len(train)} examples: too few to carve "
                             f"{'/'.join(missing)} split(s) of {size} and keep training examples; "
                             f"give data.dev_file / data.test_file")
        for name in missing:
            given[name] = Dataset(name=train.name, split=name, examples=pool[:size])
            pool = pool[size:]
        train = Dataset(name=train.name, split="train", examples=pool)
    splits = {"train": train, "dev": given["dev"], "test": given["test"]}
    check_disjoint(splits)
    return splits


def check_disjoint(splits: dict[str, Dataset], show: int = 5) -> None:
    """Raise ValueError naming the splits and examples that share a question."""
    where: dict[str, dict[str, str]] = defaultdict(dict)  # question -> split -> example id
    for name, ds in splits.items():
        for ex in ds:
            where[_key(ex.question)].setdefault(name, ex.id)
    shared = [(q, seen) for q, seen in where.items() if len(seen) > 1]
    if shared:
        listed = "; ".join(
            f"{q[:60]!r} in " + ", ".join(f"{s} (id {i})" for s, i in seen.items()) for q, seen in shared[:show])
        more = f" and {len(shared) - show} more" if len(shared) > show else ""
        raise DataError(f"{len(shared)} question(s) appear in more than one split, so held-out results would "
                         f"be measured on training data: {listed}{more}")
