"""A Transformer Engine that is installed but does not load reads as absent (issue 31, item 4).

    import megatron_rl          # installs the finder below (megatron_rl/__init__.py), before any Megatron import
    import megatron.core        # with a broken TE: local modules, as on a machine without TE

Megatron-Core guards its TE imports with `except ImportError` (some with `except ModuleNotFoundError`)
and, once `import transformer_engine` succeeded, imports TE's PyTorch part unguarded.  A TE whose
libraries do not load (a CUDA or driver mismatch, a build for another torch) raises OSError or
RuntimeError from `transformer_engine.pytorch`, and that ends `import megatron.core` itself, on
CPU-forced tools (`convert verify`, the gloo tests) too.

So TE is one thing here: usable when the package *and* its PyTorch part load.  The finder wraps the
loader of the top-level `transformer_engine` package only; after the package ran, its loader imports
`transformer_engine.pytorch` as well.  If either raises ImportError, OSError or RuntimeError, the
failure is logged once, TE's modules are dropped from sys.modules, and from then on every import of a
`transformer_engine*` module raises TEUnavailable (a ModuleNotFoundError that names the first
cause), which all of Megatron's guards catch: it builds local modules and `platform.detect_platform`
reports `use_te=False`.  TE's own modules load with their own loaders (their internal fallbacks are
untouched), a working TE loads unchanged, and a machine without TE never reaches the wrapper.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

logger = logging.getLogger(__name__)

PACKAGE = "transformer_engine"
TORCH_PART = "transformer_engine.pytorch"
LOAD_ERRORS = (ImportError, OSError, RuntimeError)


class TEUnavailable(ModuleNotFoundError):
    """Transformer Engine is installed but does not load; a ModuleNotFoundError because one of Megatron's
    guards (tensor_parallel/random.py) catches only that, and it is an ImportError for the others."""


class _Refusal(importlib.abc.Loader):
    """The loader of every `transformer_engine*` module once TE failed to load: raises TEUnavailable."""

    def __init__(self, message: str):
        self.message = message

    def create_module(self, spec):
        raise TEUnavailable(self.message, name=spec.name)

    def exec_module(self, module):  # never reached: create_module raised
        raise TEUnavailable(self.message, name=module.__name__)


class _CheckedLoader(importlib.abc.Loader):
    """The `transformer_engine` package's own loader, then its PyTorch part; a failure refuses TE."""

    def __init__(self, inner, finder: "BrokenTEFinder"):
        self._inner = inner
        self._finder = finder

    def __getattr__(self, attr):  # resource readers, get_code, is_package: the wrapped loader's
        return getattr(self._inner, attr)

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        try:
            self._inner.exec_module(module)
            importlib.import_module(TORCH_PART)  # the part Megatron uses: it loads, or TE counts as absent
        except TEUnavailable:
            raise
        except LOAD_ERRORS as err:
            raise self._finder.refuse(err) from err


class BrokenTEFinder(importlib.abc.MetaPathFinder):
    """Wraps the `transformer_engine` package's loader; refuses every TE module after a failed load."""

    def __init__(self):
        self.message: str | None = None

    def find_spec(self, name, path, target=None):
        if not name.startswith(PACKAGE):
            return None
        if self.message is not None:
            return importlib.util.spec_from_loader(name, _Refusal(self.message))
        if name != PACKAGE:
            return None  # TE's own modules: found and loaded as usual
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, BrokenTEFinder) or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _CheckedLoader(spec.loader, self)
                return spec
        return None

    def refuse(self, err: BaseException) -> TEUnavailable:
        """Record why TE does not load, forget its half-loaded modules, and return the error to raise."""
        self.message = (f"Transformer Engine is installed but does not load ({type(err).__name__}: {err}); "
                        f"Megatron-Core uses its local modules")
        logger.warning("%s", self.message)
        for loaded in [m for m in sys.modules if m.startswith(PACKAGE)]:
            del sys.modules[loaded]
        return TEUnavailable(self.message, name=PACKAGE)


def install() -> BrokenTEFinder:
    """Put the finder first on sys.meta_path (once per process); returns the one installed."""
    for finder in sys.meta_path:
        if isinstance(finder, BrokenTEFinder):
            return finder
    finder = BrokenTEFinder()
    sys.meta_path.insert(0, finder)
    return finder
