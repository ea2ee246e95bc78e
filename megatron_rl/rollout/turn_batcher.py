"""Multi-turn episodes on the round engine: every live episode's next turn goes to the engine in one call.

    batcher = TurnBatcher(generate_turns)        # generate_turns(turns) -> one TurnResult per turn, same order
    samples = batcher.play(player.episodes(batcher, rid, examples, params, n, info, weights_of))
    samples = play_in_lockstep(generate_turns, env, tokenizer_dir, examples, params, n, info)   # the same, whole

The round engine (rollout/worker.py) runs whole batches through vLLM's synchronous `LLM.generate`; the
episode loop (rollout/episodes.py `EpisodePlayer`) is written against a streaming engine, one awaited
request per turn.  This module joins them: an episode's turn request waits until every episode still
playing waits for its own turn (the others are in an environment step, or ended), and then the waiting
turns go to the engine as one batch -- the group's episodes advance in lockstep, turn by turn, as a
round's samples do.  An episode that ends leaves the count, so the rest are not held for it.

A round engine serves one version for a whole call (a publication runs between calls), so a turn's
tokens carry one version and one segment, whose KV is its own (no refit in flight); episodes whose turns
fall in different calls can span versions, recorded per turn as on the streaming engine.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from megatron_rl.rollout.stream_engine import Segment


@dataclass
class TurnResult:
    """One turn's request, answered: what EpisodePlayer reads of a streaming engine's StreamResult."""

    request_id: str
    prompt_tokens: list[int]
    response_tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    segments: list[Segment]
    weights: dict[str, str] = field(default_factory=dict)
    """{version: digest} of the weights that sampled the turn (rollout/provenance.py)."""

    @classmethod
    def of_one_version(cls, request_id: str, prompt_tokens: list[int], tokens: list[int], logprobs: list[float],
                       finish_reason: str, version: int, weights: dict[str, str]) -> "TurnResult":
        """A turn the round engine sampled: every token by `version`, on KV of its own (one segment)."""
        return cls(request_id, prompt_tokens, tokens, logprobs, finish_reason,
                   [Segment(0, len(tokens), version, version)], weights)


@dataclass
class Turn:
    """A turn request waiting for its batch: request id, the episode's tokens so far, sampling."""

    request_id: str
    tokens: list[int]
    params: dict[str, Any]


class TurnBatcher:
    """Answers episodes' turn requests in batches: a batch goes out when every live episode waits for a turn."""

    def __init__(self, generate_turns: Callable[[list[Turn]], list[TurnResult]]):
        self.generate_turns = generate_turns
        self.live = 0
        self.batches: list[int] = []  # turns per engine call, in order (a record for tests and metrics)
        self._waiting: list[tuple[Turn, asyncio.Future]] = []

    def play(self, episodes: list[Awaitable]) -> list:
        """Run the episodes (coroutines of EpisodePlayer.one on this batcher) to their ends; their results in order."""
        return asyncio.run(self._all(episodes))

    async def _all(self, episodes: list[Awaitable]) -> list:
        self.live = len(episodes)
        return list(await asyncio.gather(*(self._counted(e) for e in episodes)))

    async def _counted(self, episode: Awaitable):
        try:
            return await episode
        finally:
            self.live -= 1
            self._maybe_send()

    async def generate(self, request_id: str, tokens: list[int], params: dict[str, Any],
                       keeps: Any = None) -> TurnResult:
        """The streaming engine's `generate` call, answered with the next batch.  `keeps` is not passed on: a
        round engine serves one version for a whole call and names its adapter itself."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((Turn(request_id, list(tokens), dict(params)), future))
        self._maybe_send()
        return await future

    def _maybe_send(self) -> None:
        """Send the waiting turns when no live episode is elsewhere (an environment step, a reset, a close)."""
        if not self._waiting or len(self._waiting) < self.live:
            return
        waiting, self._waiting = self._waiting, []
        self.batches.append(len(waiting))
        try:
            results = self.generate_turns([turn for turn, _ in waiting])
            if len(results) != len(waiting):
                raise RuntimeError(f"the engine answered {len(results)} of {len(waiting)} turns")
        except BaseException as err:  # every episode of the batch fails with the engine's error
            for _, future in waiting:
                future.set_exception(err)
            return
        for (_, future), result in zip(waiting, results):
            future.set_result(result)


def play_in_lockstep(generate_turns: Callable[[list[Turn]], list[TurnResult]], env: dict, tokenizer_dir: str,
                     examples: list, params: dict[str, Any], n: int, info: list | None) -> list:
    """n episodes of each example (prompt-major, seeded as the streaming engine's) with environment `env`,
    played by this process's EpisodePlayer in lockstep."""
    from megatron_rl.rollout.episodes import player_for

    player = player_for(env, tokenizer_dir, params["max_tokens"])
    batcher = TurnBatcher(generate_turns)
    return batcher.play(player.episodes(batcher, uuid.uuid4().hex[:12], examples, params, n, info,
                                        lambda result: result.weights))
