"""Environments by name: `data.env: <name>` with its section `data.env_config: {...}` (when wired).

    env = get_environment("guess_number", {"low": 1, "high": 50})
    ENVIRONMENTS                # name -> (environment class, its config dataclass)

An unknown name is a ConfigError listing the known ones; unknown or mistyped config keys are
ConfigErrors naming the key (config.from_dict).  To add one: an Environment subclass
(protocol.py) with a keyword-only config dataclass, and a line in ENVIRONMENTS.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.envs.calculator import CalculatorConfig, CalculatorEnvironment
from megatron_rl.envs.guess_number import GuessNumberConfig, GuessNumberEnvironment
from megatron_rl.envs.protocol import Environment
from megatron_rl.envs.python_tool import PythonConfig, PythonEnvironment

ENVIRONMENTS: dict[str, tuple[type[Environment], type]] = {
    "calculator": (CalculatorEnvironment, CalculatorConfig),
    "guess_number": (GuessNumberEnvironment, GuessNumberConfig),
    "python": (PythonEnvironment, PythonConfig),
}


def get_environment(name: str, config: Mapping[str, Any] | Any | None = None) -> Environment:
    """A new environment `name` built from `config` (a mapping, its config dataclass, or None for defaults)."""
    if name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r} (data.env); known: {sorted(ENVIRONMENTS)}")
    env_class, config_class = ENVIRONMENTS[name]
    if config is None or isinstance(config, Mapping):
        config = from_dict(config_class, dict(config or {}), where="data.env_config")
    elif not isinstance(config, config_class):
        raise ConfigError(f"environment {name!r} takes a {config_class.__name__} or a mapping, "
                          f"got {type(config).__name__}")
    return env_class(config)
