"""An episode driven turn by turn: environment steps between generate calls, limits, terminal reasons.

    runner = EpisodeRunner(env, chat_format, EpisodeLimits(max_turns=4))
    ep = runner.start(example)                      # env.reset -> prompt tokens (or env_error)
    while not ep.finished:
        toks, lps, vers = engine.generate(ep.tokens, max_new_tokens=ep.remaining_tokens)
        runner.assistant_turn(ep, toks, lps, vers)  # env.step -> reward / done / observation tokens
    fields = trajectory_fields(ep)

    ep = run_episode(runner, example, generate)     # the same loop, for tests and offline use

A failed reset (raised, timed out, or a prompt with no room under max_total_tokens) gives an
episode with no tokens and terminal reason env_error.  After each assistant turn, in this order: the environment steps (raising -> `env_error`; slower
than `step_timeout_s` -> `timeout`); `done` ends the episode (`done`); the last allowed turn ends it
(`max_turns`); an observation that would leave no room for one more token ends it (`max_tokens`);
otherwise the observation's tokens are appended and the next turn is generated.  The step runs on
a helper thread so a stuck tool cannot stall the caller past the timeout; the environment is
closed when its step timed out (its state is unknown), and must be reset before reuse.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from megatron_rl.envs.chat_format import ChatFormat
from megatron_rl.envs.episode import Episode
from megatron_rl.envs.protocol import Environment, EpisodeLimits, StepResult

# generate(tokens, max_new_tokens) -> (new tokens, their logprobs, their policy versions)
Generate = Callable[[list[int], int], "tuple[Sequence[int], Sequence[float], Sequence[int] | int]"]


class StepTimeout(Exception):
    """An environment step ran past the per-step timeout."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> Any:
    """fn() on a daemon thread; its result, its exception re-raised, or StepTimeout after timeout_s."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except Exception as err:  # handed to the caller, which decides
            box["error"] = err
        except BaseException as err:  # sys.exit / KeyboardInterrupt inside a step: still the env's failure
            box["error"] = RuntimeError(f"step ended with {type(err).__name__}: {err}")

    thread = threading.Thread(target=target, name="env-step", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise StepTimeout(f"environment step still running after {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:400]


class EpisodeRunner:
    """Runs one environment's episodes with one chat format and one set of limits."""

    def __init__(self, env: Environment, chat_format: ChatFormat, limits: EpisodeLimits):
        self.env = env
        self.chat_format = chat_format
        self.limits = limits

    def start(self, example: Any) -> Episode:
        """Reset the environment; the episode holds the prompt (a failed reset: env_error, no tokens)."""
        try:
            first = call_with_timeout(lambda: self.env.reset(example), self.limits.step_timeout_s)
            if not isinstance(first, str):
                raise TypeError(f"reset returned {type(first).__name__}, not the first observation (str)")
        except StepTimeout as err:
            self.env.close()
            return Episode.failed_at_reset(f"reset timed out: {err}")
        except Exception as err:  # any failure of the environment is its error, counted, never a crash
            return Episode.failed_at_reset(f"reset raised {_describe(err)}")
        prompt = self.chat_format.prompt_tokens(first)
        if len(prompt) >= self.limits.max_total_tokens:  # the example's fault, counted, not a crash of the run
            return Episode.failed_at_reset(f"the prompt has {len(prompt)} tokens: no room under "
                                           f"max_total_tokens={self.limits.max_total_tokens}")
        return Episode(prompt, max_total_tokens=self.limits.max_total_tokens)

    def assistant_turn(self, episode: Episode, tokens: Sequence[int], logprobs: Sequence[float],
                       versions: Sequence[int] | int, text: str | None = None) -> None:
        """Append one sampled assistant turn and take the environment's step after it."""
        episode.add_assistant(tokens, logprobs, versions)
        if text is None:
            text = self.chat_format.tokenizer.decode(list(tokens), skip_special_tokens=True)
        started = time.monotonic()
        try:
            result = call_with_timeout(lambda: self.env.step(text), self.limits.step_timeout_s)
            if not isinstance(result, StepResult):
                raise TypeError(f"step returned {type(result).__name__}, not a StepResult")
            calls, errors = int(result.info.get("tool_calls", 0)), int(result.info.get("tool_errors", 0))
        except StepTimeout as err:
            self.env.close()
            episode.finish("timeout", error=str(err))
            return
        except Exception as err:  # the environment failed: env_error, never a silent zero
            episode.finish("env_error", error=f"step raised {_describe(err)}")
            return
        finally:
            episode.step_seconds.append(time.monotonic() - started)
        episode.tool_calls += calls
        episode.tool_errors += errors
        episode.add_reward(result.reward)
        if result.done:
            episode.finish("done")
        elif episode.turns >= self.limits.max_turns:
            episode.finish("max_turns")
        else:
            ended = int(tokens[-1]) == self.chat_format.end_of_turn_id
            obs = self.chat_format.observation_tokens(result.observation, assistant_ended=ended)
            if len(obs) >= episode.remaining_tokens:
                episode.finish("max_tokens")
            else:
                episode.add_observation(obs)

    def out_of_room(self, episode: Episode) -> None:
        """The engine could not generate (no tokens left): end with max_tokens."""
        episode.finish("max_tokens")


def run_episode(runner: EpisodeRunner, example: Any, generate: Generate) -> Episode:
    """Drive one episode to its end with `generate` (tokens so far, max new tokens) -> a sampled turn."""
    episode = runner.start(example)
    while not episode.finished:
        if episode.remaining_tokens < 1:
            runner.out_of_room(episode)
            break
        tokens, logprobs, versions = generate(episode.tokens, episode.remaining_tokens)
        runner.assistant_turn(episode, tokens, logprobs, versions)
    return episode
