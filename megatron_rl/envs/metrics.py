"""Metrics of finished episodes (issue 28 item 5), keys grouped under the `env/` panel.

    metrics = episode_metrics(episodes)   # {"env/episodes": 64, "env/turns_mean": 2.5, ...}
    metrics = summary_metrics([s.episode for s in samples])   # the same, from rollout samples

env/episodes, env/turns_mean, env/tool_calls_per_episode, env/tool_success_rate (tool calls that
did not fail; absent without tool calls), env/step_seconds/p50|p95|p99 (environment time per step),
env/env_errors (episodes ended by env_error or timeout: excluded from the loss),
env/sandbox_violations (what the policy's code tried that the sandbox refused or flagged: writes outside
scratch, processes, sockets, signals, reads outside what it may read; envs/sandbox_child.py), and
env/terminal/<reason> (the share of episodes per terminal reason, every reason present).
"""

from __future__ import annotations

import types
from typing import Sequence

from megatron_rl.envs.episode import Episode
from megatron_rl.envs.protocol import TERMINAL_REASONS
from megatron_rl.metrics import percentiles


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    unfinished = [i for i, ep in enumerate(episodes) if not ep.finished]
    if unfinished:
        raise ValueError(f"episode_metrics of unfinished episodes (positions {unfinished[:5]})")
    n = len(episodes)
    if n == 0:
        return {"env/episodes": 0.0}
    calls = sum(ep.tool_calls for ep in episodes)
    out = {
        "env/episodes": float(n),
        "env/turns_mean": sum(ep.turns for ep in episodes) / n,
        "env/tool_calls_per_episode": calls / n,
        "env/env_errors": float(sum(ep.terminal_reason in ("env_error", "timeout") for ep in episodes)),
        "env/sandbox_violations": float(sum(getattr(ep, "sandbox_violations", 0) for ep in episodes)),
    }
    if calls:
        out["env/tool_success_rate"] = 1.0 - sum(ep.tool_errors for ep in episodes) / calls
    out.update(percentiles([s for ep in episodes for s in ep.step_seconds], "env/step_seconds"))
    for reason in TERMINAL_REASONS:
        out[f"env/terminal/{reason}"] = sum(ep.terminal_reason == reason for ep in episodes) / n
    return out


def summary_metrics(summaries: Sequence) -> dict[str, float]:
    """episode_metrics of finished episodes as rollout/sample.py EpisodeSummaries (or their dicts)."""
    return episode_metrics([s if hasattr(s, "finished") else types.SimpleNamespace(finished=True, **s)
                            for s in summaries])
