"""An episode driven turn by turn: environment steps between generate calls, limits, terminal reasons.

    runner = EpisodeRunner(env, chat_format, EpisodeLimits(max_turns=4))
    ep = runner.start(example)                      # env.reset -> prompt tokens (or env_error)
    while not ep.finished:
        toks, lps, vers = engine.generate(ep.tokens, max_new_tokens=ep.remaining_tokens)
        runner.assistant_turn(ep, toks, lps, vers)  # env.step -> reward / done / observation tokens
    fields = trajectory_fields(ep)

    ep = run_episode(runner, example, generate)     # the same loop, for tests and offline use

An async caller that runs the environment's calls itself (rollout/episodes.py, off its event loop) uses
the same rules in pieces: `opened(reset's outcome)`, then per turn `begin_turn` -> the step -> `end_turn`.

A failed reset (raised, timed out, or a prompt with no room under max_total_tokens) gives an
episode with no tokens and terminal reason env_error.  After each assistant turn, in this order: the environment steps (raising -> `env_error`; slower
than `step_timeout_s` -> `timeout`); `done` ends the episode (`done`); the last allowed turn ends it
(`max_turns`); an observation that would leave no room for one more token ends it (`max_tokens`);
otherwise the observation's tokens are appended and the next turn is generated.  The step runs on
a step thread (envs/step_threads.py: reused, one per call in flight) so a stuck tool cannot stall the
caller past the timeout; the environment is closed when its step timed out (its state is unknown), and
must be reset before reuse.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from megatron_rl.envs.chat_format import ChatFormat
from megatron_rl.envs.episode import Episode
from megatron_rl.envs.protocol import Environment, EpisodeLimits, StepResult
from megatron_rl.envs.step_threads import StepThreads, StepTimeout, shared_step_threads

# generate(tokens, max_new_tokens) -> (new tokens, their logprobs, their policy versions)
Generate = Callable[[list[int], int], "tuple[Sequence[int], Sequence[float], Sequence[int] | int]"]


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:400]


class EpisodeRunner:
    """Runs one environment's episodes with one chat format and one set of limits."""

    def __init__(self, env: Environment, chat_format: ChatFormat, limits: EpisodeLimits,
                 threads: StepThreads | None = None):
        self.env = env
        self.chat_format = chat_format
        self.limits = limits
        self.threads = threads or shared_step_threads()

    def start(self, example: Any) -> Episode:
        """Reset the environment; the episode holds the prompt (a failed reset: env_error, no tokens)."""
        first = self._outcome(lambda: self.env.reset(example))
        if isinstance(first, StepTimeout):
            self.env.close()
        return self.opened(first)

    def opened(self, first: Any) -> Episode:
        """The episode after a reset that returned `first` (or raised it, or timed out: a StepTimeout)."""
        if isinstance(first, StepTimeout):
            return Episode.failed_at_reset(f"reset timed out: {first}")
        if not isinstance(first, (str, Exception)):
            first = TypeError(f"reset returned {type(first).__name__}, not the first observation (str)")
        if isinstance(first, Exception):  # any failure of the environment is its error, counted, never a crash
            return Episode.failed_at_reset(f"reset raised {_describe(first)}")
        prompt = self.chat_format.prompt_tokens(first)
        if len(prompt) >= self.limits.max_total_tokens:  # the example's fault, counted, not a crash of the run
            return Episode.failed_at_reset(f"the prompt has {len(prompt)} tokens: no room under "
                                           f"max_total_tokens={self.limits.max_total_tokens}")
        return Episode(prompt, max_total_tokens=self.limits.max_total_tokens)

    def assistant_turn(self, episode: Episode, tokens: Sequence[int], logprobs: Sequence[float],
                       versions: Sequence[int] | int, text: str | None = None) -> None:
        """Append one sampled assistant turn and take the environment's step after it."""
        text = self.begin_turn(episode, tokens, logprobs, versions, text)
        started = time.monotonic()
        result = self._outcome(lambda: self.env.step(text))
        if isinstance(result, StepTimeout):
            self.env.close()
        self.end_turn(episode, tokens, result, time.monotonic() - started)

    def begin_turn(self, episode: Episode, tokens: Sequence[int], logprobs: Sequence[float],
                   versions: Sequence[int] | int, text: str | None = None) -> str:
        """Append one sampled assistant turn; the text the environment's step gets."""
        episode.add_assistant(tokens, logprobs, versions)
        if text is None:
            text = self.chat_format.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return text

    def end_turn(self, episode: Episode, tokens: Sequence[int], result: Any, seconds: float) -> None:
        """The environment's step after the turn `tokens` returned `result` (or raised it, or timed out: a
        StepTimeout) in `seconds`: a terminal reason, or the observation appended."""
        episode.step_seconds.append(seconds)
        if isinstance(result, StepTimeout):
            episode.finish("timeout", error=str(result))
            return
        if not isinstance(result, (StepResult, Exception)):
            result = TypeError(f"step returned {type(result).__name__}, not a StepResult")
        if isinstance(result, Exception):  # the environment failed: env_error, never a silent zero
            episode.finish("env_error", error=f"step raised {_describe(result)}")
            return
        try:
            calls, errors = int(result.info.get("tool_calls", 0)), int(result.info.get("tool_errors", 0))
            violations = int(result.info.get("sandbox_violations", 0))
        except Exception as err:  # a malformed info is the environment's failure too
            episode.finish("env_error", error=f"step raised {_describe(err)}")
            return
        episode.tool_calls += calls
        episode.tool_errors += errors
        episode.sandbox_violations += violations
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

    def _outcome(self, fn: Callable[[], Any]) -> Any:
        """fn()'s value on a step thread, or the exception it raised, or StepTimeout past the step timeout."""
        try:
            return self.threads.call(fn, self.limits.step_timeout_s)
        except Exception as err:
            return err

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
