"""No module of the package imports more than MAX_PROJECT_IMPORTS project modules (issue #13).

    python -m pytest tests/unit/test_module_imports.py -q

A module that needs many of the others is a service locator in the making (the old
`train/roles.py` imported 29): its parts belong in the components that own them.  The count is a
smell detector; which package may import which is the layering rule (tests/unit/test_layers.py).
Every `import megatron_rl.x` and `from megatron_rl.x import y` counts, at any depth of the file
(function-level imports too); `from megatron_rl.pkg import mod` counts the submodule `mod`.  An import
under `if TYPE_CHECKING:` does not count: it runs in no process, it only names a type.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
MAX_PROJECT_IMPORTS = 10


def module_name(path: Path, root: Path = PACKAGE) -> str:
    """The dotted name of the module at `path` in the package at `root`."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    rel = Path(*name.split("."))
    return (root.parent / rel).with_suffix(".py").is_file() or (root.parent / rel / "__init__.py").is_file()


def _type_checking_block(node: ast.AST) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
                                         or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` blocks (their `else` is kept)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking_block(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def project_import_lines(source: str, name: str, is_package: bool = False,
                         root: Path = PACKAGE) -> list[tuple[str, int]]:
    """(project module imported, line) for every import in `source` (module `name` of the package at
    `root`) outside `if TYPE_CHECKING:`, at any depth of the file; in source order."""
    top = root.name
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != top:
                continue
            subs = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}", root)]
            found.extend((sub, node.lineno) for sub in subs)
            if len(subs) < len(node.names):
                found.append((target, node.lineno))
    return sorted((t, line) for t, line in found if t != name)


def project_imports(source: str, name: str, is_package: bool = False, root: Path = PACKAGE) -> set[str]:
    """The project modules `source` (module `name`) imports, anywhere in the file (not type-only)."""
    return {target for target, _ in project_import_lines(source, name, is_package, root)}


def counts() -> dict[str, int]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        out[name] = len(project_imports(path.read_text(), name, is_package=path.name == "__init__.py"))
    return out


def test_the_counter_sees_every_kind_of_import():
    source = ("import megatron_rl.metrics\nfrom megatron_rl.train import roles, config\n"
              "from megatron_rl.reporting.stop import StopRules\nimport json\n"
              "def f():\n    from megatron_rl.checkpoint import rotate\n    from . import policy\n")
    assert project_imports(source, "megatron_rl.train.driver") == {
        "megatron_rl.metrics", "megatron_rl.train.roles", "megatron_rl.train.config", "megatron_rl.reporting.stop",
        "megatron_rl.checkpoint", "megatron_rl.train.policy"}


def test_type_only_imports_do_not_count():
    source = ("from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n"
              "    from megatron_rl.learner import Learner\nelse:\n    import megatron_rl.metrics\n"
              "if typing.TYPE_CHECKING:\n    import megatron_rl.checkpoint\n"
              "def f():\n    from megatron_rl.reporting import stop\n")
    assert project_imports(source, "megatron_rl.train.driver") == {"megatron_rl.metrics", "megatron_rl.reporting.stop"}
    assert project_import_lines(source, "megatron_rl.train.driver") == [("megatron_rl.metrics", 6),
                                                                          ("megatron_rl.reporting.stop", 10)]


def test_no_module_imports_more_than_ten_project_modules():
    found = counts()
    assert len(found) > 50 and found["megatron_rl.train.driver"] >= 5  # the walk saw the package
    over = {name: n for name, n in found.items() if n > MAX_PROJECT_IMPORTS}
    assert not over, f"modules importing more than {MAX_PROJECT_IMPORTS} project modules: {over}"
