"""No module of the package imports more than MAX_PROJECT_IMPORTS project modules (issue #13).

    python -m pytest tests/unit/test_module_imports.py -q

A module that needs many of the others is a service locator in the making (the old
`train/roles.py` imported 29): its parts belong in the components that own them.  Every
`import megatron_rl.x` and `from megatron_rl.x import y` counts, at any depth of the file
(function-level imports too); `from megatron_rl.pkg import mod` counts the submodule `mod`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
MAX_PROJECT_IMPORTS = 10


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (PACKAGE.parent / rel).with_suffix(".py").is_file() or (PACKAGE.parent / rel / "__init__.py").is_file()


def project_imports(source: str, name: str, is_package: bool = False) -> set[str]:
    """The project modules `source` (module `name`) imports, anywhere in the file."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "megatron_rl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "megatron_rl":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(target)
    found.discard(name)
    return found


def counts() -> dict[str, int]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        out[name] = len(project_imports(path.read_text(), name, is_package=path.name == "__init__.py"))
    return out


def test_the_counter_sees_every_kind_of_import():
    source = ("import megatron_rl.metrics\nfrom megatron_rl.train import roles, config\n"
              "from megatron_rl.train.stop import StopRules\nimport json\n"
              "def f():\n    from megatron_rl.checkpoint import rotate\n    from . import telemetry\n")
    assert project_imports(source, "megatron_rl.train.driver") == {
        "megatron_rl.metrics", "megatron_rl.train.roles", "megatron_rl.train.config", "megatron_rl.train.stop",
        "megatron_rl.checkpoint", "megatron_rl.train.telemetry"}


def test_no_module_imports_more_than_ten_project_modules():
    found = counts()
    assert len(found) > 50 and found["megatron_rl.train.driver"] >= 5  # the walk saw the package
    over = {name: n for name, n in found.items() if n > MAX_PROJECT_IMPORTS}
    assert not over, f"modules importing more than {MAX_PROJECT_IMPORTS} project modules: {over}"
