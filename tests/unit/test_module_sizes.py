"""Files stay readable in one sitting and functions do one thing (shared/STYLE.md "Sizes").

    python -m pytest tests/unit/test_module_sizes.py -q

No module of the package is longer than MAX_FILE_LINES lines and no function (or method) longer
than MAX_FUNCTION_LINES lines (from its `def` to its last line).  The few functions still past
the limit are listed in ALLOWED with the size they have today: they may shrink, never grow, and
a new long function is not added to the list but split (into helpers named for what they do).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rl"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
ALLOWED: dict[str, int] = {}  # "path relative to megatron_rl/:function" -> its size today (lines); empty since session 9


def file_lines(source: str) -> int:
    return source.count("\n") + (0 if source.endswith("\n") or not source else 1)


def long_functions(source: str, limit: int) -> dict[str, int]:
    """{name: lines} of the functions and methods of `source` longer than `limit` lines."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                out[node.name] = max(lines, out.get(node.name, 0))
    return out


def test_the_measures_see_what_they_measure():
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    source = f"def long():\n{body}\nclass C:\n    def short(self):\n        return 1\n"
    assert long_functions(source, 60) == {"long": 62}
    assert file_lines(source) == 66 and file_lines("a\nb") == 2


def test_no_file_past_the_limit():
    sizes = {str(p.relative_to(PACKAGE)): file_lines(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(sizes) > 50  # the walk saw the package
    over = {name: n for name, n in sizes.items() if n > MAX_FILE_LINES}
    assert not over, f"files longer than {MAX_FILE_LINES} lines (split them along a seam): {over}"


def test_no_function_past_the_limit_or_its_allowance():
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, lines in long_functions(path.read_text(), MAX_FUNCTION_LINES).items():
            key = f"{path.relative_to(PACKAGE)}:{name}"
            if lines > ALLOWED.get(key, MAX_FUNCTION_LINES):
                over[key] = lines
    assert not over, (f"functions longer than {MAX_FUNCTION_LINES} lines or than their allowance in ALLOWED "
                      f"(split them into helpers): {over}")
