"""Data cursor: which example comes next, epoch by epoch, resumable exactly.

    cursor = DataCursor(len(ds), seed=1234, dataset_version=ds.dataset_version)
    idx = cursor.next_indices(16)                # positions into ds, crossing epochs as needed
    state = cursor.state_dict()                  # into the checkpoint manifest (JSON-safe)
    cursor2 = DataCursor(len(ds), seed=1234); cursor2.load_state_dict(state)   # same sequence

Each epoch visits every example once, in a permutation drawn from (seed, epoch) alone, so
resuming needs only (epoch, index): no generator state to save.
"""

from __future__ import annotations

import random
from typing import Any


class DataCursor:
    def __init__(self, num_examples: int, *, seed: int = 0, shuffle: bool = True,
                 dataset_version: str | None = None) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples must be >= 1, got {num_examples}")
        self.num_examples = num_examples
        self.seed = seed
        self.shuffle = shuffle
        self.dataset_version = dataset_version
        self.epoch = 0
        self.index = 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(f"cursor:{self.seed}:{epoch}").shuffle(order)
        return order

    def next_indices(self, n: int) -> list[int]:
        """The next n example positions; moves into the next epoch (new permutation) when one ends."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            take = min(n - len(out), self.num_examples - self.index)
            out.extend(self._order[self.index : self.index + take])
            self.index += take
            if self.index == self.num_examples:
                self.epoch += 1
                self.index = 0
                self._order = self._permutation(self.epoch)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "shuffle": self.shuffle,
                "num_examples": self.num_examples, "dataset_version": self.dataset_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved position; the dataset size, version, seed and shuffle must match."""
        missing = [k for k in ("epoch", "index", "seed", "shuffle", "num_examples") if k not in state]
        if missing:
            raise ValueError(f"data cursor state is missing {missing}")
        for key in ("num_examples", "seed", "shuffle", "dataset_version"):
            if key == "dataset_version" and (state.get(key) is None or self.dataset_version is None):
                continue
            if state[key] != getattr(self, key):
                raise ValueError(f"data cursor state has {key}={state[key]!r} but this cursor has {getattr(self, key)!r}")
        if not 0 <= state["index"] < self.num_examples or state["epoch"] < 0:
            raise ValueError(f"data cursor state out of range: epoch={state['epoch']} index={state['index']}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation(self.epoch)
