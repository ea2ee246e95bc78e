"""No import circle in megatron_rl/ (the middle-layer redesign, issue 26): the guard of structure.

    python -m pytest tests/unit/test_import_cycles.py -q

Every project import counts, at any depth of a file (a function-level import too: deferring an
import hides a circle from Python, not from the design), except one under `if TYPE_CHECKING:` (it
names a type and runs nowhere).  The graph's strongly connected components must all be single
modules, and so must those of the folder graph: package A imports package B and B imports A (through
any of their modules) is a folder loop, a layer cut in the wrong place (tests/unit/test_layers.py
states the layers).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_module_imports import PACKAGE, module_name, project_imports

pytestmark = pytest.mark.unit


KNOWN_FOLDER_LOOPS: dict[tuple[str, ...], str] = {}
"""Folder loops not broken yet (each a set of folders that reach each other), with what they consist of: the
guard fails on any other, and when one listed here is gone (then delete its line)."""


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    graph = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        graph[name] = project_imports(path.read_text(), name, path.name == "__init__.py", root)
    return graph


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """{folder: folders it imports} of the package's subpackages (the top-level folders under the package),
    from the module graph; modules at the package's top are no folder and are left out."""
    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 2 or (len(parts) == 2 and module in packages) else None

    packages = {m for m in graph if any(other.startswith(m + ".") for other in graph)}
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        src = folder(module)
        if src is None:
            continue
        out.setdefault(src, set()).update(f for t in targets if (f := folder(t)) not in (None, src))
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert len(graph) > 50 and graph["megatron_rl.train.driver"]  # the walk saw the package
    assert circles(graph) == [], "import circles (each a set of modules that import each other)"


def test_the_folder_finder_sees_a_loop_through_any_module(tmp_path):
    root = tmp_path / "pkg"
    files = {"__init__.py": "", "top.py": "import pkg.low.a\n", "low/__init__.py": "", "low/a.py": "x = 1\n",
             "low/b.py": "def f():\n    from pkg.high import c\n",   # function-level: it counts
             "high/__init__.py": "", "high/c.py": "from pkg.low import a\n",
             "side/__init__.py": "", "side/d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                   "    from pkg.high import c\n"),
             "high/e.py": "import pkg.side.d\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    folders = folder_graph(import_graph(root))
    assert folders == {"low": {"high"}, "high": {"low", "side"}, "side": set()}  # type-only: no side -> high
    assert circles(folders) == [["high", "low"]]


def test_no_folder_loop_in_the_package():
    folders = folder_graph(import_graph())
    assert {"train", "rollout", "learner"} <= set(folders) and "train" not in folders["learner"]
    loops = [tuple(c) for c in circles(folders)]
    assert not [c for c in loops if c not in KNOWN_FOLDER_LOOPS], "folder loops (packages that import each other)"
    assert not [c for c in KNOWN_FOLDER_LOOPS if c not in loops], "a known folder loop is gone: delete its line"
