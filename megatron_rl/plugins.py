"""Your own code, named in a config by import path: "pkg.module:name" or "path/to/file.py:name".

    ref = absolute_ref("my_rewards.py:score", key="reward.function")   # a file path made absolute
    obj = load_object(ref, key="reward.function")                       # imported (cached), or ValueError
    ship = local_package_dirs([ref])                                    # what Ray's runtime_env py_modules ships

Used by `reward.function` (reward/function.py) and `data.env.name` (envs/registry.py).  A file path is
resolved against the working directory when the config is loaded (the run's config.json keeps it
absolute); a module is imported as Python would, with the working directory on sys.path.  Errors are
ValueErrors naming the config key and what went wrong (no such file, the module's own import error, no
such attribute).

Shipping: a run's Ray actors get the driver's module-form plugins through the job's runtime_env
(`py_modules`, train/run_setup.py start_ray): the top-level package directory of each one that is not
installed in site-packages.  File forms are loaded by their absolute path (one machine, or a shared file
system as on HPC clusters).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any


def split_ref(ref: str, key: str) -> tuple[str, str]:
    """("path/to/file.py" or "pkg.module", "name") of "TARGET:NAME"; ValueError naming `key`."""
    target, sep, name = str(ref).rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise ValueError(f"{key} must be 'pkg.module:name' or 'path/to/file.py:name', got {ref!r}")
    return target, name


def is_path(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or "/" in target


def is_ref(value: str) -> bool:
    """Whether a config value names code by import path (has a ':'), not a registered name."""
    return ":" in str(value)


def absolute_ref(ref: str, key: str) -> str:
    """The same reference with a file path made absolute (against the working directory)."""
    target, name = split_ref(ref, key)
    return f"{Path(target).expanduser().resolve()}:{name}" if is_path(target) else ref


@functools.lru_cache(maxsize=32)
def load_object(ref: str, key: str) -> Any:
    """Import what `ref` names; ValueError naming `key` and the reason."""
    target, name = split_ref(ref, key)
    try:
        if is_path(target):
            path = Path(target)
            if not path.is_file():
                raise ValueError(f"{key}: file {path} does not exist")
            module_name = f"megatron_rl_plugin_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except ValueError:
        raise
    except Exception as err:  # the user's module failed to import: say which and why
        raise ValueError(f"{key} {ref!r}: importing {target} failed: {type(err).__name__}: {err}") from err
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{key} {ref!r}: {target} has no attribute {name!r}")
    return obj


def source_file(ref: str, key: str) -> Path:
    """The file that defines what `ref` names."""
    import inspect

    target, _ = split_ref(ref, key)
    if is_path(target):
        return Path(target)
    module = sys.modules.get(target) or importlib.import_module(target)
    return Path(inspect.getfile(module))


def local_package_dirs(refs) -> list[str]:
    """The top-level package directories of the module-form `refs` that are not installed packages: what a
    Ray job ships to its workers (runtime_env py_modules)."""
    out: list[str] = []
    for ref in refs:
        target = str(ref).rpartition(":")[0]
        if not target or is_path(target):
            continue
        spec = importlib.util.find_spec(target.split(".")[0])
        if spec is None or not spec.submodule_search_locations:
            continue  # a top-level module file, not a package: importable where the driver's path is
        directory = str(Path(list(spec.submodule_search_locations)[0]).resolve())
        if "site-packages" in directory or "dist-packages" in directory or directory in out:
            continue
        out.append(directory)
    return out
