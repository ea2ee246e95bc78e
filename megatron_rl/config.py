"""Typed configuration: keyword-only dataclasses, YAML files and dotted overrides.

    cfg = load_config(RootConfig, "configs/tiny_cpu.yaml", ["rollout.temperature=0.7"])

Each component owns a dataclass for its section (fields documented, checks in __post_init__
raising ValueError that names the field).  This module only knows how to build those
dataclasses from plain data, strictly: unknown keys, missing required keys and wrong types are
errors naming the dotted path, before any work starts, all of them in one pass (ConfigProblems).
A dataclass whose checks span several fields may define `config_problems(values) -> list[str]`
(a staticmethod over the fields given): its __post_init__ raises what it returns, and when other
keys of the same mapping are wrong it is called with the readable ones, so those checks are
reported in the same pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
"""A decimal number written as text: what a float field takes from a string (YAML 1.1 reads 1e-6 as one)."""


class ConfigError(ValueError):
    """Input a user can fix (config, data, checkpoint, command-line values): the message names the
    key, file or value.  The CLI ends with that one line and exit 2; any other exception is a bug
    (traceback, exit 1).  Subclasses: DataError, checkpoint.CheckpointError."""


class ConfigProblems(ConfigError):
    """Several problems of one config, reported together; each names its dotted key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(self.problems[0] if len(self.problems) == 1 else
                         f"{len(self.problems)} problems:\n  " + "\n  ".join(self.problems))


def _problems(err: ConfigError) -> list[str]:
    return list(getattr(err, "problems", [str(err)]))


def _coerce_each(items: list[tuple[Any, Any, str]]) -> list:
    """_coerce every (value, hint, where); all their problems raised together."""
    out, problems = [], []
    for value, hint, where in items:
        try:
            out.append(_coerce(value, hint, where))
        except ConfigError as err:
            problems += _problems(err)
    if problems:
        raise ConfigProblems(problems)
    return out


class DataError(ConfigError):
    """A data file or task the run cannot use as configured (names the file/line or the field)."""


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} matches none of {hint}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        return origin(_coerce_each([(v, item, f"{where}[{i}]") for i, v in enumerate(value)]))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
        vt = args[1] if len(args) == 2 else Any
        return dict(zip(value, _coerce_each([(v, vt, f"{where}.{k}") for k, v in value.items()])))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and FLOAT_TEXT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads 1e-6 (no dot) as text: the number it spells
    if hint is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # YAML reads a bare 0 as a number: a text field (a core list, a name) gets its digits
    if hint in (int, float, str, bool):
        if isinstance(value, bool) and hint is not bool:
            raise ConfigError(f"{where}: expected {hint.__name__}, got bool {value!r}")
        if not isinstance(value, hint):
            raise ConfigError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    return value


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys, missing required keys and wrong types raise
    ConfigProblems naming every one of them (and `cls.config_problems` of the readable fields)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}

    def key(name) -> str:
        return ".".join(filter(None, [where, str(name)]))

    problems = [f"unknown config key {key(k)!r}; allowed at this level: {sorted(fields)}"
                for k in sorted(set(data) - set(fields), key=str)]
    problems += [f"missing config key {key(name)!r} (required: it has no default)" for name, f in fields.items()
                 if name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    kwargs = {}  # the readable fields (all of them when there is no problem)
    for k in (k for k in data if k in fields):
        try:
            kwargs[k] = _coerce(data[k], hints[k], key(k))
        except ConfigError as err:
            problems += _problems(err)
    if problems:
        cross = getattr(cls, "config_problems", None)
        problems += [f"{where}: {p}" if where else p for p in (cross(kwargs) if cross else [])]
        raise ConfigProblems(problems)
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{where or 'config'}: {err}") from None
    except ConfigError:
        raise
    except ValueError as err:  # a section's own check (__post_init__): the user's input, named
        raise ConfigError(f"{where}: {err}" if where else str(err)) from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested mapping, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
        import yaml  # here, not at module level: the learner, checkpoint and publish modules import
        # this one, and a GPU node's stage-1 check (tests/gpu/stage1.py) runs them without PyYAML

        try:
            value = yaml.safe_load(raw)
            if value is None and raw.strip().startswith("#"):  # YAML reads `k=####` as a comment: keep the text
                value = raw.strip()
            node[parts[-1]] = value
        except (yaml.YAMLError, RecursionError) as err:
            raise ConfigError(f"override {key!r}: value {raw[:80]!r} is not valid YAML ({err!r})"[:400]) from None
    return data


def read_config_data(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """Plain data of YAML `path` (optional) with dotted `overrides` applied."""
    import yaml  # see apply_overrides

    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text ({err})") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(err)})") from None
        except RecursionError:
            raise ConfigError(f"{path}: YAML nested too deeply to read") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    return apply_overrides(data, list(overrides))





def read_config_chain(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The YAML at `path` on top of its `base:` file (resolved against path's folder), recursively.  Mappings
    merge key by key (the file's values win, lists are replaced whole); a key set to null takes the
    default back (e.g. `model: {tiny: null, path: ...}` over a recipe with a tiny model)."""
    data = read_config_data(path)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{path}: base must be the file name of another config, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in _seen or base_path == path.resolve():
        raise ConfigError(f"{path}: base {base} leads back to itself")
    return _merged(read_config_chain(base_path, (*_seen, path.resolve())), data)


def _merged(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _yaml_problem(err: Exception) -> str:
    """A YAML error on one line: where (line, column) and what, without the excerpt PyYAML draws under it."""
    mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
    if mark is None or not problem:
        return " ".join(str(err).split())[:300]
    context = getattr(err, "context", None)
    return f"line {mark.line + 1} column {mark.column + 1}: {problem}" + (f", {context}" if context else "")


def load_config(cls: type[T], path: str | Path | None, overrides: list[str] = ()) -> T:
    """Read YAML `path` (optional), apply dotted `overrides`, build and validate `cls`."""
    return from_dict(cls, read_config_data(path, overrides))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def config_hash(cfg: Any) -> str:
    """sha256 of the resolved config (canonical JSON), for manifests and checkpoints."""
    blob = json.dumps(to_dict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
