"""The `data.env` section: which environment a run's episodes play, its options, limits and chat format.

    data:
      task: env                     # examples made by the environment (guess_number); or a task of its own
      env:
        name: guess_number            # an environment of envs/registry.py; unset: single-turn (no episodes)
        options: {low: 1, high: 16} # its own config section (GuessNumberConfig here), checked by name
        max_turns: 6
        max_total_tokens: 256       # prompt + every turn and observation; <= rollout.max_model_len
        step_timeout_s: 10
        chat_template: plain        # the tokenizer's own template when unset; "plain" for tokenizers without one

With `env.name` set, a run's rollouts are episodes (envs/runner.py) on either engine (the round engine
plays a round's episodes in lockstep: rollout/turn_batcher.py), rewarded by the environment instead of the verifier, and `data.task: env`
takes its examples from the environment when it makes its own (guess_number).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_rl.config import ConfigError
from megatron_rl.envs.chat_format import TEMPLATES
from megatron_rl.envs.protocol import EpisodeLimits


@dataclasses.dataclass(kw_only=True)
class EnvConfig:
    """Multi-turn episodes with an environment (issue 28); off while `name` is unset."""

    name: Optional[str] = None
    """Environment name (envs/registry.py: calculator, guess_number, python), or your own class by import path
    ("my_envs.py:MyEnv", "my_pkg.envs:MyEnv"); None: single-turn rollouts."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The environment's own config section (e.g. GuessNumberConfig's keys); unknown keys are refused."""
    max_turns: int = 8
    """Assistant turns per episode at most (terminal reason max_turns)."""
    max_total_tokens: int = 512
    """Prompt + response tokens per episode at most (terminal reason max_tokens); <= rollout.max_model_len."""
    step_timeout_s: float = 30.0
    """Wall-clock seconds one environment step may take (terminal reason timeout: excluded, counted)."""
    chat_template: Optional[str] = None
    """Turn separators: None uses the tokenizer's chat template; "plain" (TEMPLATES) or a Jinja template."""
    system_prompt: Optional[str] = None
    """The prompt's system message: None keeps the environment's own, "" drops it (short contexts)."""

    def __post_init__(self) -> None:
        if self.name is None:
            return
        from megatron_rl.envs.registry import ENVIRONMENTS, environment_config
        from megatron_rl.plugins import absolute_ref, is_ref

        if not is_ref(self.name) and self.name not in ENVIRONMENTS:
            raise ConfigError(f"data.env.name {self.name!r} is not a known environment; known: {sorted(ENVIRONMENTS)},"
                              f" or your own class as 'path/to/file.py:Class' or 'package.module:Class'")
        if is_ref(self.name):  # your own class by import path (megatron_rl/plugins.py)
            try:
                self.name = absolute_ref(self.name, "data.env.name")
            except ValueError as err:
                raise ConfigError(str(err)) from None
        environment_config(self.name, self.options)  # known or importable; its own keys and values, named
        self.limits()  # max_turns / max_total_tokens / step_timeout_s, named
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("data.env.chat_template is empty: unset it (the tokenizer's own) or name one of "
                              f"{sorted(TEMPLATES)} or give a Jinja template")

    def preflight(self) -> dict:
        """What the environment checks on the node that runs it before a run starts (its config's `preflight`,
        e.g. the python environment's sandbox isolation), as a record for the run manifest; {} for most.
        A node that cannot give what the config asks for is a ConfigError naming what it lacks."""
        from megatron_rl.envs.registry import environment_config

        if not self.enabled:
            return {}
        check = getattr(environment_config(self.name, self.options), "preflight", None)
        try:
            return dict(check()) if check is not None else {}
        except RuntimeError as err:  # SandboxError and its kind: the node, not the code
            raise ConfigError(f"data.env ({self.name}): {err}") from None

    def package_dirs(self) -> list[str]:
        """The local package of an environment named by module path: what the run's Ray job ships to the
        rollout workers that play it (megatron_rl/plugins.py)."""
        from megatron_rl.plugins import is_ref, local_package_dirs

        return local_package_dirs([self.name]) if self.name and is_ref(self.name) else []

    @property
    def enabled(self) -> bool:
        return self.name is not None

    def limits(self) -> EpisodeLimits:
        try:
            return EpisodeLimits(max_turns=self.max_turns, max_total_tokens=self.max_total_tokens,
                                 step_timeout_s=self.step_timeout_s)
        except ValueError as err:
            raise ConfigError(f"data.env.{err}") from None

    @property
    def template(self) -> str | None:
        """The Jinja chat template to use, or None for the tokenizer's own."""
        return TEMPLATES.get(self.chat_template, self.chat_template) if self.chat_template else None
