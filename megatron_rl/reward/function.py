"""A user's own reward function, named by import path: `reward.function: "my_pkg.rewards:fn"` or
`"path/to/rewards.py:fn"`.

    def fn(*, prompt, response, answer, **fields) -> float | dict[str, float]:
        ...   # a float, or named components (summed into the reward; "correct", 0 or 1, is correctness)

    components = call_function(cfg.function, response, reference, context)   # in a verifier-pool worker

The function is called once per response, with keyword arguments: `prompt` (the prompt as the policy saw
it, decoded), `response` (decoded, special tokens dropped), `answer` (the example's reference answer) and
`fields`: the example's `question` and `id`, and its metadata's keys (reasoning-gym entries;
envs/example.py Example.reward_fields).  It runs in the verifier pool's worker processes (reward/pool.py) under
`reward.timeout_s`, with that pool's contract: a timeout is not a zero, an exception is an error code
(`grader_error`), both are excluded from the loss and counted.  A value that is not a finite number, or a
`correct` component other than 0 or 1, is an error of the function, named in the trajectory's error.

Correctness is only ever the `correct` component: a function without one trains and evaluates on its
reward, and eval reports no correctness for it (never its reward under that name).

Its grader version is `function:<name>@<sha256 of its source file, 12 hex>`, so every trajectory names
the code that scored it, and a resume with a changed file is refused (run_manifest.json).  A path form is
resolved against the working directory when the config is loaded (the run's config.json keeps it
absolute); a module form is imported as Python would, with the working directory on sys.path.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
from typing import Any, Callable

from megatron_rl.plugins import absolute_ref as _absolute_ref
from megatron_rl.plugins import load_object, source_file
from megatron_rl.plugins import split_ref as _split_ref

CORRECT = "correct"
"""The component eval reports as correctness (0 or 1)."""
CALLABLE = "callable:"
"""reward.function of a Python callable handed to megatron_rl.train(reward_function=fn): "callable:NAME@DIGEST"."""
_CALLABLES: dict[str, bytes] = {}  # reward.function "callable:..." -> the callable, cloudpickled


def _cloudpickle():
    try:
        import cloudpickle
    except ImportError:  # Ray carries its own copy
        from ray import cloudpickle
    return cloudpickle


def register_callable(fn: Callable[..., Any]) -> str:
    """Make a local callable (a closure, a lambda, a function of __main__) a reward.function: it is pickled by
    value (cloudpickle, as Ray ships functions), so the verifier pool's fresh worker processes can run it.
    Returns the reference; its digest is that of the pickled code."""
    if not callable(fn):
        raise ValueError(f"reward_function must be callable, got {type(fn).__name__}")
    payload = _cloudpickle().dumps(fn)
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in getattr(fn, "__name__", "fn")) or "fn"
    ref = f"{CALLABLE}{name}@{hashlib.sha256(payload).hexdigest()[:12]}"
    _CALLABLES[ref] = payload
    return ref


def with_callable(reward, fn: Callable[..., Any]):
    """The `reward:` section scoring with the Python callable `fn` (it replaces a configured function or grader)."""
    import dataclasses

    return dataclasses.replace(reward, function=register_callable(fn), grader="math")


def callable_payloads() -> dict[str, bytes]:
    """The registered callables, for a worker process to install (reward/pool.py)."""
    return dict(_CALLABLES)


def install_callables(payloads: dict[str, bytes]) -> None:
    _CALLABLES.update(payloads)


KEY = "reward.function"


def split_ref(ref: str) -> tuple[str, str]:
    """("path/to/file.py" or "pkg.module", "fn") of "TARGET:NAME"; ValueError naming reward.function."""
    return _split_ref(ref, KEY)


def absolute_ref(ref: str) -> str:
    """The same reference with a file path made absolute (against the working directory)."""
    return ref if ref.startswith(CALLABLE) else _absolute_ref(ref, KEY)


def load_function(ref: str) -> Callable[..., Any]:
    """Import the function `ref` names; ValueError with the reason (missing file, import error, no such name,
    not callable, no keyword arguments it needs)."""
    if ref.startswith(CALLABLE):
        if ref not in _CALLABLES:
            raise ValueError(f"reward.function {ref!r} is a Python callable given to megatron_rl.train("
                             f"reward_function=...) in another process; from the command line name a file "
                             f"('path/to/file.py:fn') or a module ('pkg.module:fn')")
        return _loaded_callable(ref)
    fn = load_object(ref, KEY)
    name = split_ref(ref)[1]
    if not callable(fn):
        raise ValueError(f"reward.function {ref!r}: {name} is not callable")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    missing = [k for k in ("prompt", "response", "answer") if k not in named and not takes_any]
    if missing:
        raise ValueError(f"reward.function {ref!r}: it must take the keyword arguments prompt, response, answer "
                         f"(and **fields); it lacks {', '.join(missing)}")
    return fn


@functools.lru_cache(maxsize=8)
def _loaded_callable(ref: str) -> Callable[..., Any]:
    return _cloudpickle().loads(_CALLABLES[ref])


def source_digest(ref: str) -> str:
    """sha256 (12 hex) of the file that defines the function: what its grader version names."""
    load_function(ref)
    return hashlib.sha256(source_file(ref, KEY).read_bytes()).hexdigest()[:12]


def grader_version(ref: str) -> str:
    if ref.startswith(CALLABLE):  # its name and the digest of its pickled code
        return f"function:{ref[len(CALLABLE):]}"
    return f"function:{split_ref(ref)[1]}@{source_digest(ref)}"


def components_of(value: Any, name: str) -> dict[str, float]:
    """The named components of what the function returned (a float is one component named after the
    function); ValueError naming what is wrong."""
    items = value.items() if isinstance(value, dict) else [(name, value)]
    out: dict[str, float] = {}
    for key, v in items:
        if not isinstance(key, str) or not key:
            raise ValueError(f"reward function {name}: component names must be non-empty strings, got {key!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"reward function {name}: {key!r} must be a finite number, got {v!r}")
        out[key] = float(v)
    if not out:
        raise ValueError(f"reward function {name}: returned no components")
    if CORRECT in out and out[CORRECT] not in (0.0, 1.0):
        raise ValueError(f"reward function {name}: {CORRECT!r} must be 0 or 1, got {out[CORRECT]!r}")
    return out


def call_function(ref: str, response: str, reference: str, context: dict | None = None) -> dict[str, float]:
    """The components the function `ref` gives one response (called in a verifier-pool worker; the Score is
    made by reward/math_verifier.grade)."""
    context = dict(context or {})
    prompt = context.pop("prompt", "")
    answer = context.pop("answer", reference)
    name = ref[len(CALLABLE):].split("@")[0] if ref.startswith(CALLABLE) else split_ref(ref)[1]
    return components_of(load_function(ref)(prompt=prompt, response=response, answer=answer, **context), name)
