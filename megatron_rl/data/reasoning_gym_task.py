"""Tasks from the reasoning-gym package: procedural generators that come with their own scorers.

    splits = make_reasoning_gym("chain_sum", {"max_terms": 2}, seed=0, train_size=2000, holdout_size=200)
    # {"train", "dev", "test"}: Datasets whose examples carry the generator's metadata

Every split is drawn from its own seed (derived from `data.seed` and the split's name), so the
three come from independent streams of the generator.  Small generator spaces repeat, so a
held-out question already present in an earlier split (test first, then dev, then train) is
dropped from the later one: the splits are disjoint by construction, and then checked
(megatron_rl.data.splits).  Grade them with `reward.grader: reasoning_gym`, which calls the
generator's own `score_answer` (megatron_rl.reward.external).
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.data.splits import check_disjoint
from megatron_rl.config import DataError
from megatron_rl.envs.example import Example

logger = logging.getLogger(__name__)

# Ask for the bare answer: the built-in extractors read a leading or last number.
REASONING_GYM_TEMPLATE = PromptTemplate("{question}\nAnswer: ")


def _split_seed(seed: int, name: str, split: str) -> int:
    return int.from_bytes(hashlib.sha256(f"reasoning_gym:{name}:{seed}:{split}".encode()).digest()[:4], "little")


def make_reasoning_gym(name: str, config: dict[str, Any], *, seed: int, train_size: int,
                       holdout_size: int) -> dict[str, Dataset]:
    import reasoning_gym

    if train_size < 1 or holdout_size < 1:
        raise DataError(f"data.train_size and data.holdout_size must be >= 1, got {train_size}, {holdout_size}")
    seen: set[str] = set()
    splits = {}
    for split, size in (("test", holdout_size), ("dev", holdout_size), ("train", train_size)):
        try:
            generator = reasoning_gym.create_dataset(name, size=size, seed=_split_seed(seed, name, split), **config)
        except (KeyError, TypeError, ValueError, AssertionError) as err:
            raise DataError(f"data.generator {name!r} with data.generator_config {config}: {err}") from None
        examples, dropped = [], 0
        for i, entry in enumerate(generator):
            key = " ".join(entry["question"].split())
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            examples.append(Example(id=f"{name}-{split}-{i}", question=entry["question"], answer=str(entry["answer"]),
                                    metadata=json.dumps(entry.get("metadata", {}), default=list, sort_keys=True)))
        if not examples:
            raise DataError(f"reasoning-gym {name!r}: every {split} question repeats an earlier split's")
        if dropped:
            logger.info("reasoning-gym %s: dropped %d %s questions already in a held-out split", name, dropped, split)
        splits[split] = Dataset(name=f"rg-{name}", split=split, examples=examples)
    check_disjoint(splits)
    return {s: splits[s] for s in ("train", "dev", "test")}
