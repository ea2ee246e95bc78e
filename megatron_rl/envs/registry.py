"""Environments by name: `data.env.name: <name>` with its section `data.env.options: {...}` (envs/config.py).

    env = get_environment("guess_number", {"low": 1, "high": 50})
    ENVIRONMENTS                # name -> (environment class, its config dataclass)

An unknown name is a ConfigError listing the known ones; unknown or mistyped config keys are
ConfigErrors naming the key (config.from_dict).  To add one: an Environment subclass
(protocol.py) with a keyword-only config dataclass, and a line in ENVIRONMENTS.

Your own, with no registration: `data.env.name: "my_envs.py:TwoStep"` or `"my_pkg.envs:TwoStep"` (megatron_rl/
plugins.py): an Environment subclass whose class attribute `config_class` is its keyword-only config dataclass
(`data.env.options` is checked against it; without one the options must be empty).  Rollout workers import
it by the same path (a module's package is shipped to them with the run's Ray job, train/run_setup.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from megatron_rl.config import ConfigError, from_dict
from megatron_rl.envs.calculator import CalculatorConfig, CalculatorEnvironment
from megatron_rl.envs.guess_number import GuessNumberConfig, GuessNumberEnvironment
from megatron_rl.envs.protocol import Environment
from megatron_rl.envs.python_tool import PythonConfig, PythonEnvironment
from megatron_rl.plugins import is_ref, load_object

ENVIRONMENTS: dict[str, tuple[type[Environment], type]] = {
    "calculator": (CalculatorEnvironment, CalculatorConfig),
    "guess_number": (GuessNumberEnvironment, GuessNumberConfig),
    "python": (PythonEnvironment, PythonConfig),
}


def register_environment(env_class: type[Environment], config_class: type) -> None:
    """Add an environment of your own under `env_class.name` (before the run's config is loaded; a rollout
    worker that plays it must import the module that registers it, e.g. from a `sitecustomize` or the
    package's `__init__`).  A name already taken is refused."""
    if not env_class.name or env_class.name in ENVIRONMENTS:
        raise ConfigError(f"cannot register environment {env_class.name!r}: the name is empty or taken "
                          f"({sorted(ENVIRONMENTS)})")
    ENVIRONMENTS[env_class.name] = (env_class, config_class)


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    """The config of an environment by import path that declares no config_class: no keys."""


def environment_entry(name: str) -> tuple[type[Environment], type]:
    """(environment class, its config dataclass) of a registered name or an import path; ConfigError naming
    data.env.name when it is neither."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    if not is_ref(name):
        raise ConfigError(f"unknown environment {name!r} (data.env.name); known: {sorted(ENVIRONMENTS)}, or "
                          f"'path/to/file.py:Class' / 'package.module:Class'")
    try:
        env_class = load_object(name, "data.env.name")
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if not (isinstance(env_class, type) and issubclass(env_class, Environment)):
        raise ConfigError(f"data.env.name {name!r} is not a subclass of megatron_rl.envs.protocol.Environment")
    config_class = getattr(env_class, "config_class", None) or NoOptions
    if not dataclasses.is_dataclass(config_class):
        raise ConfigError(f"data.env.name {name!r}: its config_class must be a dataclass, got {config_class!r}")
    return env_class, config_class


def environment_config(name: str, config: Mapping[str, Any] | Any | None = None) -> Any:
    """The config dataclass of environment `name` from a mapping (keys checked by name), itself, or None."""
    config_class = environment_entry(name)[1]
    if config is None or isinstance(config, Mapping):
        try:
            return from_dict(config_class, dict(config or {}), where="data.env.options")
        except ConfigError:
            raise
        except ValueError as err:  # a value its __post_init__ refuses
            raise ConfigError(f"data.env.options: {err}") from None
    if not isinstance(config, config_class):
        raise ConfigError(f"environment {name!r} takes a {config_class.__name__} or a mapping, "
                          f"got {type(config).__name__}")
    return config


def has_expert(name: str) -> bool:
    """Whether environment `name` says an expert's turns (overrides Environment.expert): SFT can learn from it."""
    return environment_entry(name)[0].expert is not Environment.expert  # an unknown name is refused by name


def get_environment(name: str, config: Mapping[str, Any] | Any | None = None) -> Environment:
    """A new environment `name` built from `config` (a mapping, its config dataclass, or None for defaults)."""
    config = environment_config(name, config)
    return environment_entry(name)[0](config)
