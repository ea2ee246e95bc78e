"""Prompt groups out of a StreamEngine in the order they complete (issue 27, toward streaming rollouts).

    async for index, samples in groups_as_completed(stream, prompts, sampling, group_size=4, capacity=16):
        ...  # samples: the group's RolloutSamples in sample order, handed on as soon as its last one ends

GRPO needs a prompt's whole group (its G samples) before it can score advantages, and nothing more:
a group whose samples all finished can go to the learner while longer groups still generate.  Here
samples are submitted prompt-major with at most `capacity` in flight (a slot refills the moment any
sample finishes, so one long sample never holds the engine idle), and each group is yielded when its
last sample finishes, whatever its submission order.  Every token keeps its provenance: the weights
version that sampled it (policy_versions) and, in its `segments`, the oldest weights whose KV it
attended to (differs only across keep_kv refits; rollout/stream_engine.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from megatron_rl.rollout.requests import to_sample
from megatron_rl.rollout.sample import RolloutSample

Sampling = Callable[[int, int], dict[str, Any]]  # (group index, sample index) -> sampling parameters


async def groups_as_completed(stream, prompts: list[list[int]], sampling: Sampling, group_size: int,
                              capacity: int, prefix: str = "g") -> AsyncIterator[tuple[int, list[RolloutSample]]]:
    """(group index, its `group_size` samples in sample order) for every prompt, in completion order.

    `stream`: a StreamEngine (anything with its `generate(request_id, prompt, sampling)`); request ids
    are f"{prefix}{group}-{sample}".  At most `capacity` requests are in flight.  A failed request
    ends the iteration with its error after the requests in flight are cancelled."""
    if group_size < 1 or capacity < 1:
        raise ValueError(f"group_size and capacity must be >= 1, got {group_size} and {capacity}")
    slots = asyncio.Semaphore(capacity)
    done: asyncio.Queue = asyncio.Queue()
    pending = {g: [None] * group_size for g in range(len(prompts))}

    async def one(g: int, s: int, params: dict[str, Any]) -> None:
        started = time.time()
        try:
            result = await stream.generate(f"{prefix}{g}-{s}", prompts[g], params)
            await done.put((g, s, to_sample(result, params, started, time.time())))
        except BaseException as err:
            await done.put((g, s, err))
            raise
        finally:
            slots.release()

    async def submit(tasks: list) -> None:
        for g in range(len(prompts)):
            for s in range(group_size):
                await slots.acquire()
                tasks.append(asyncio.create_task(one(g, s, sampling(g, s))))

    tasks: list[asyncio.Task] = []
    feeder = asyncio.create_task(submit(tasks))
    try:
        while pending:
            g, s, got = await done.get()
            if isinstance(got, BaseException):
                raise got
            pending[g][s] = got
            if all(x is not None for x in pending[g]):
                yield g, pending.pop(g)
    finally:
        for t in [feeder, *tasks]:
            t.cancel()
        await asyncio.gather(feeder, *tasks, return_exceptions=True)
