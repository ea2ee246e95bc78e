"""A package's public names loaded on first use (PEP 562), so that importing one of its light modules does not
import its heavy ones (torch) through the package's __init__.

    _WHERE = {"Learner": "learner", "LearnerConfig": "config"}     # name -> the package's module holding it
    __all__ = sorted(_WHERE)
    __getattr__ = lazy_names(__name__, _WHERE)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The module-level `__getattr__` of `package`: `name` from `package.<where[name]>`, imported then."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)

    return __getattr__
