"""What a rollout actor's call asks of its engine, and what comes back: the request helpers both actors share
(RolloutWorker, rollout/worker.py, on vLLM's LLM; StreamRolloutWorker, rollout/stream_actor.py, on the async engine).

    params = call_params(config, eos_ids, count=len(prompts), sampling={"seed": 3}, n=4, info=info)
    own = prompt_params(params, info, i)         # prompt i's: its max_tokens capped by its own budget
    sample = to_sample(stream_result, own, started, finished, info[i])   # the async engine's answer

`sampling` keys are SAMPLING_KEYS; the config's defaults fill the rest, and unless `ignore_eos` the
checkpoint's EOS ids join the stop tokens (a token-only engine does not know EOS otherwise).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.sample import PromptInfo, RolloutSample

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop_token_ids", "ignore_eos")


def sampling_defaults(config: RolloutConfig) -> dict[str, Any]:
    """The sampling parameters of the `rollout:` section, for a call that overrides none."""
    c = config
    return dict(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens,
                seed=None, stop_token_ids=list(c.stop_token_ids), ignore_eos=c.ignore_eos)


def check_prompts(prompts: list[list[int]]) -> None:
    """Every prompt a non-empty list of token ids (ValueError naming the first that is not)."""
    for i, p in enumerate(prompts):
        if not p or not all(isinstance(t, int) and t >= 0 for t in p):
            raise ValueError(f"prompt {i} must be a non-empty list of token ids, got {p!r:.80}")


def call_params(config: RolloutConfig, eos_token_ids, count: int, sampling: dict[str, Any] | None, n: int,
                info: list[PromptInfo] | None) -> dict[str, Any]:
    """The checks and sampling parameters of a call on `count` prompts (or episode examples), n each."""
    unknown = sorted(set(sampling or {}) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"unknown sampling key {unknown[0]!r}; allowed: {list(SAMPLING_KEYS)}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if info is not None and len(info) != count:
        raise ValueError(f"info has {len(info)} entries for {count} prompts")
    params = {**sampling_defaults(config), **(sampling or {})}
    if not params["ignore_eos"]:
        params["stop_token_ids"] = sorted(set(params["stop_token_ids"]) | set(eos_token_ids))
    return params


def prompt_params(params: dict[str, Any], info: list[PromptInfo] | None, i: int) -> dict[str, Any]:
    """Prompt i's sampling parameters: `params`, with its response budget capped by the prompt's own
    (info[i].max_tokens, from a dataset row's `max_tokens`, data/jsonl.py) when it carries one."""
    budget = info[i].max_tokens if info else None
    if budget is None:
        return params
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"prompt {i}: max_tokens must be an int >= 1, got {budget!r}")
    return {**params, "max_tokens": min(int(params["max_tokens"]), budget)}


def sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs [T] from a vLLM completion's `logprobs`: a FlatLogprobs (what a request
    made with flat_logprobs=True gets: one flat list, no dict and Logprob object per token for the garbage
    collector to walk; each position's first entry is the sampled token's) or a list of {token: Logprob}."""
    if logprobs is None:
        return []
    flat = getattr(logprobs, "start_indices", None)
    if flat is not None:
        return [float(logprobs.logprobs[i]) for i in flat]
    return [float(lp[t].logprob) for lp, t in zip(logprobs, token_ids)]


def finish_reason(reason: str | None) -> str:
    """A sample's finish reason from vLLM's: "stop" or "length", anything else "abort"."""
    return reason if reason in ("stop", "length") else "abort"


def to_sample(result, sampling: dict[str, Any], started: float, finished: float,
              info: PromptInfo | None = None) -> RolloutSample:
    """A finished StreamResult (rollout/stream_engine.py) as a RolloutSample: per-token versions from its segments,
    the segments themselves merged (merged_segments)."""
    versions = [seg.version for seg in result.segments for _ in range(seg.end - seg.start)]
    return RolloutSample(prompt_tokens=list(result.prompt_tokens), response_tokens=list(result.response_tokens),
                         behavior_logprobs=list(result.logprobs), policy_versions=versions, sampling=dict(sampling),
                         finish_reason=finish_reason(result.finish_reason), started_at=started, finished_at=finished,
                         prompt=info or PromptInfo(), segments=merged_segments(result.segments))


def merged_segments(segments) -> list[list[int]]:
    """A StreamResult's segments as [start, end, version, kv_version] spans, neighbours with the same versions
    joined (a provisional label and its confirmed one are two vLLM spans of one version)."""
    out: list[list[int]] = []
    for g in segments:
        if out and out[-1][1] == g.start and out[-1][2:] == [g.version, g.kv_version]:
            out[-1][1] = g.end
        else:
            out.append([g.start, g.end, g.version, g.kv_version])
    return out
