"""Multi-turn episodes on a rollout engine (issue 28, scheduling): turns are requests, tools run off the loop.

    play = EpisodePlayer(env_cfg, tokenizer_dir, max_tokens_per_turn=64)   # envs/config.py EnvConfig (or its dict)
    samples = await play.group(stream, rid, examples, params, n, info, weights_of)   # on the engine's loop
    samples = TurnBatcher(generate_turns).play(play.episodes(batcher, ...))     # the round engine (turn_batcher.py)

An episode (envs/runner.py) is one token sequence.  Each assistant turn is one request to the engine with the
whole sequence so far as its prompt (token-in/token-out: nothing is re-rendered), so its prefix comes from
vLLM's prefix cache while the weights stay the same; a refit between two turns applies to the next turn,
and its segments say so.  The environment's calls (reset, step, close) run on step threads
(envs/step_threads.py), never on the engine's event loop and never queued behind another episode's call,
so a slow tool stalls only its own episode; each is one hand-off out and one back, its timeout watched
by the loop.  The episode's book-keeping (EpisodeRunner's rules, a few tokenizer calls) runs on the loop:
a hand-off costs more than it does (benchmarks/multiturn_throughput.md).  Sample j of example i is seeded like a single-turn request
(seed + i * n + j), each turn t of it with that seed + 7919 * t.

What comes back per episode is a RolloutSample: the response is everything after the prompt (assistant
turns with mask 1, their logprobs and versions; observations with mask 0), `segments` tile it
([start, end, version, kv_version]; an observation carries the version of the turn before it), and
`episode` holds its EpisodeSummary (rollout/sample.py): the reward, terminal reason and counters (graded by
sampling/scoring.py, measured by envs/metrics.py).  An episode whose environment failed at reset has no tokens to
train on: it is returned with an empty response and terminal reason env_error, and the producer drops its group.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

from megatron_rl.envs.chat_format import env_chat_format
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.episode import Episode
from megatron_rl.envs.registry import get_environment
from megatron_rl.envs.runner import EpisodeRunner
from megatron_rl.envs.step_threads import shared_step_threads
from megatron_rl.publish.vllm_adapters import FOLLOWS_REFITS
from megatron_rl.rollout.sample import EpisodeSummary, PromptInfo, RolloutSample

TURN_SEED_STRIDE = 7919

_PLAYERS: dict[str, "EpisodePlayer"] = {}  # (tokenizer, turn length, env config) -> its player, one per process
_PLAYERS_LOCK = threading.Lock()


def player_for(env: dict, tokenizer_dir: str, max_tokens_per_turn: int) -> "EpisodePlayer":
    """This process's EpisodePlayer for one environment config and turn length (made once: it loads a tokenizer)."""
    key = repr((tokenizer_dir, max_tokens_per_turn, sorted((env or {}).items())))
    with _PLAYERS_LOCK:
        if key not in _PLAYERS:
            _PLAYERS[key] = EpisodePlayer(env or {}, tokenizer_dir, max_tokens_per_turn=max_tokens_per_turn)
        return _PLAYERS[key]


class EpisodePlayer:
    """Plays one environment's episodes on a StreamEngine; one per rollout worker and env config."""

    def __init__(self, env: EnvConfig | dict, tokenizer_dir: str, *, max_tokens_per_turn: int):
        from transformers import AutoTokenizer

        from megatron_rl.config import from_dict

        self.cfg = env if isinstance(env, EnvConfig) else from_dict(EnvConfig, env, where="env")
        if not self.cfg.enabled:
            raise ValueError("EpisodePlayer needs env.name")
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.chat = env_chat_format(self.cfg, self.tokenizer)
        self.limits = self.cfg.limits()
        self.max_tokens_per_turn = max_tokens_per_turn
        self.threads = shared_step_threads()

    def new_environment(self):
        return get_environment(self.cfg.name, self.cfg.options)

    async def group(self, stream, request_id: str, examples: list, params: dict, n: int,
                    info: list[PromptInfo] | None, weights_of: Callable[[Any], dict],
                    keeps_of: Callable[[], Any] = lambda: FOLLOWS_REFITS) -> list[RolloutSample]:
        """n episodes of every example, prompt-major, played concurrently on `stream`; info[i] rides on
        example i's samples.  `keeps_of()`: what a turn starting now keeps to its end, as any request does
        (publish/vllm_adapters.py): a LoRA run's newest committed adapter, or nothing (full weights)."""
        return list(await asyncio.gather(*self.episodes(stream, request_id, examples, params, n, info, weights_of,
                                                         keeps_of)))

    def episodes(self, stream, request_id: str, examples: list, params: dict, n: int,
                 info: list[PromptInfo] | None, weights_of: Callable[[Any], dict],
                 keeps_of: Callable[[], Any] = lambda: FOLLOWS_REFITS) -> list:
        """The coroutines `group` plays, prompt-major (the round engine's TurnBatcher plays them in lockstep,
        rollout/turn_batcher.py); sample j of example i is seeded seed + i * n + j."""
        jobs = []
        for i, example in enumerate(examples):
            for j in range(n):
                seed = None if params.get("seed") is None else params["seed"] + i * n + j
                jobs.append(self.one(stream, f"{request_id}-{i}-{j}", example, {**params, "seed": seed},
                                     info[i] if info else PromptInfo(), weights_of, keeps_of))
        return jobs

    async def one(self, stream, rid: str, example, params: dict, info: PromptInfo,
                  weights_of: Callable[[Any], dict],
                  keeps_of: Callable[[], Any] = lambda: FOLLOWS_REFITS) -> RolloutSample:
        """One episode to its end: reset, then generate / step until a terminal reason."""
        threads, timeout = self.threads, self.limits.step_timeout_s
        env = self.new_environment()
        runner = EpisodeRunner(env, self.chat, self.limits, threads)
        started = time.time()
        weights: dict[str, str] = {}
        segments: list[list[int]] = []
        try:
            ep = runner.opened((await threads.run_timed(lambda: env.reset(example), timeout))[1])
            turn = 0
            while not ep.finished:
                room = ep.remaining_tokens
                if room < 1:
                    runner.out_of_room(ep)
                    break
                seed = None if params.get("seed") is None else params["seed"] + TURN_SEED_STRIDE * turn
                turn_params = {**params, "seed": seed, "max_tokens": min(self.max_tokens_per_turn, room)}
                result = await stream.generate(f"{rid}-t{turn}", ep.tokens, turn_params, keeps_of())
                if result.finish_reason == "abort":
                    raise RuntimeError("this rollout group holds no complete policy version (a failed load could "
                                       "not be rolled back; its requests in flight were aborted): sent again")
                offset = len(ep.response_tokens)
                versions = [g.version for g in result.segments for _ in range(g.end - g.start)]
                text = runner.begin_turn(ep, result.response_tokens, result.logprobs, versions)
                # weights_of may wait for a refit check's verdict (which needs this loop running): before the
                # step, on the step's thread; the step's timeout starts when the step does.
                got, outcome, seconds = await threads.run_timed(lambda: env.step(text), timeout,
                                                                before=lambda: weights_of(result))
                weights.update(got)
                runner.end_turn(ep, result.response_tokens, outcome, seconds)
                segments += [[offset + g.start, offset + g.end, g.version, g.kv_version] for g in result.segments]
                if len(ep.response_tokens) > segments[-1][1]:  # the observation appended after this turn
                    segments.append([segments[-1][1], len(ep.response_tokens), *segments[-1][2:]])
                turn += 1
        finally:
            await threads.run(env.close)
        return self._sample(ep, params, info, started, weights, segments)

    def _sample(self, ep: Episode, params: dict, info: PromptInfo, started: float, weights: dict,
                segments: list[list[int]]) -> RolloutSample:
        return RolloutSample(
            prompt_tokens=list(ep.prompt_tokens), response_tokens=list(ep.response_tokens),
            behavior_logprobs=list(ep.behavior_logprobs), policy_versions=list(ep.policy_versions),
            action_mask=list(ep.action_mask), sampling={**params, "max_tokens": self.max_tokens_per_turn},
            finish_reason="stop" if ep.terminal_reason == "done" else "length",
            started_at=started, finished_at=time.time(),
            prompt=info, weights=weights, segments=_joined(segments),
            episode=EpisodeSummary.of(self.cfg.name, ep))


def episode_score(episode: EpisodeSummary):
    """The Score of a multi-turn episode (its EpisodeSummary, rollout/sample.py): the sum of its
    environment's rewards (its correctness too when that is 0 or 1, else none); its format is 1.0 when the
    environment ended it (terminal reason done: the policy followed the protocol to its end) and 0.0 at a turn
    or token limit; an episode ended by env_error or timeout is not scored (excluded, counted)."""
    from megatron_rl.reward.math_verifier import Score

    grader = f"env:{episode.env}"
    if episode.reward is None:
        error = "timeout" if episode.terminal_reason == "timeout" else "env_error"
        return Score.failed(error, grader, detail=episode.error[:300])
    reward = float(episode.reward)
    # An episode's reward is its correctness only when it is a success or a failure (0 or 1): a partial
    # credit (0.5, 1.5) is never reported as correctness (eval then reports the reward alone).
    correct = reward if reward in (0.0, 1.0) else None
    return Score(reward=reward, correctness=correct, format=float(episode.terminal_reason == "done"), overlong=None,
                 error=None, grader_version=grader, components={"env": reward})


def _joined(segments: list[list[int]]) -> list[list[int]]:
    """Neighbouring spans with the same (version, kv_version) as one."""
    out: list[list[int]] = []
    for seg in segments:
        if out and out[-1][1] == seg[0] and out[-1][2:] == seg[2:]:
            out[-1][1] = seg[1]
        else:
            out.append(list(seg))
    return out
