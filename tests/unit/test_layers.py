"""Which part of megatron_rl/ may import which: the layers of ARCHITECTURE.md ("Layers"), checked (issue #45).

    python -m pytest tests/unit/test_layers.py -q

A part is a folder of the package (`train/`), or a named group of the modules at its top (GROUPS).  LAYERS
lists the layers bottom first; a part may import the parts of the layers below its own, never a part of its
own layer or of one above.  Inside a part imports are free (tests/unit/test_import_cycles.py forbids circles
there).  Every import counts, at any depth of a file, except one under `if TYPE_CHECKING:` (it names a type
and runs nowhere).  A violation is reported with its file and line; EXCEPTIONS lists the few that are meant.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_module_imports import PACKAGE, module_name, project_import_lines

pytestmark = pytest.mark.unit

GROUPS = {
    "base": ("config", "console", "durable_files", "lazy_names", "panels", "plugins", "te_import", "tracking",
             "trajectory", "version", "checkpoint", "run_files", "cli", "metrics", "run_manifest", "rng_state",
             "fault_hooks"),
    "run_model.py": ("run_model",),
    "evaluation.py": ("evaluation",),
    "commands": ("", "api", "audit_cli", "checkpoint_cli", "doctor", "doctor_cli", "eval_cli", "launch_cli",
                 "plan_cli", "replay", "replay_cli", "report", "report_cli", "sandbox_cli", "slurm_scripts", "submit_cli"),
}
"""The modules at the package's top, by part ("" is the package's __init__.py)."""

PARTS: dict[str, str] = {}
"""Modules that are a part of their own, not their folder's."""

LAYERS = (
    ("foundation", ("base",)),
    ("machine", ("platform/",)),
    ("model", ("models/",)),
    ("model files", ("run_model.py",)),
    ("conversion", ("conversion/",)),
    ("learner", ("learner/",)),
    ("losses, rewards, audit", ("grpo/", "reward/", "audit/")),
    ("environments", ("envs/",)),
    ("data", ("data/",)),
    ("services", ("coordinator/", "publish/")),
    ("learner ranks", ("ranks/",)),
    ("rollout", ("rollout/",)),
    ("evaluation, planning", ("evaluation.py", "planner/")),
    ("sample production", ("sampling/",)),
    ("reporting", ("reporting/",)),
    ("training", ("train/",)),
    ("commands", ("commands",)),
    ("tools", ("experiment/", "drill/")),
)
"""Bottom first.  ARCHITECTURE.md's layer picture is this table."""

EXCEPTIONS = {
    ("megatron_rl.train", "megatron_rl.api"): "the package is the Python API's callable `train` (train/__init__.py)",
}
"""(importer, imported) pairs allowed against the layers, each with why."""


def part_of(module: str, root: Path = PACKAGE, groups=GROUPS, parts=PARTS) -> str:
    """The part `module` (a dotted name in the package at `root`) belongs to; KeyError for a top module
    of no group."""
    rel = module.split(".")[1:]
    inner = ".".join(rel)
    if inner in parts:
        return parts[inner]
    if len(rel) > 1 or (rel and (root / rel[0]).is_dir()):
        return rel[0] + "/"
    return next(part for part, members in groups.items() if inner in members)


def layer_violations(root: Path = PACKAGE, layers=LAYERS, groups=GROUPS, parts=PARTS,
                     exceptions=EXCEPTIONS) -> list[str]:
    """'file:line: a (layer) imports b (layer)' for every import of a part of the same or a higher layer."""
    rank = {part: (i, name) for i, (name, members) in enumerate(layers) for part in members}
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        src = part_of(module, root, groups, parts)
        imports = project_import_lines(path.read_text(), module, path.name == "__init__.py", root)
        for target, line in sorted(imports, key=lambda found: found[1]):
            dst = part_of(target, root, groups, parts)
            if dst == src or (module, target) in exceptions or rank[dst][0] < rank[src][0]:
                continue
            out.append(f"{path.relative_to(root)}:{line}: {src} ({rank[src][1]}) imports {target}, "
                       f"{dst} ({rank[dst][1]})")
    return out


def test_the_checker_reports_an_upward_import_with_file_and_line(tmp_path):
    root = tmp_path / "pkg"
    files = {"__init__.py": "", "base.py": "", "low/__init__.py": "", "high/__init__.py": "",
             "low/a.py": "import os\n\ndef f():\n    from pkg.high import b\n",   # upward, function-level
             "low/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high.b import B\n"
                          "from pkg import base\n"),                           # type-only: not counted
             "high/b.py": "from pkg.low import a\nimport pkg.side.d\n",          # down; sideways
             "side/__init__.py": "", "side/d.py": ""}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    layers = (("bottom", ("top",)), ("lower", ("low/",)), ("upper", ("high/", "side/")))
    groups = {"top": ("", "base")}
    assert part_of("pkg.low.a", root, groups, {}) == "low/" and part_of("pkg", root, groups, {}) == "top"
    assert layer_violations(root, layers, groups, {}, {}) == [
        "high/b.py:2: high/ (upper) imports pkg.side.d, side/ (upper)",
        "low/a.py:4: low/ (lower) imports pkg.high.b, high/ (upper)"]
    assert layer_violations(root, layers, groups, {}, {("pkg.low.a", "pkg.high.b"): "meant",
                                                       ("pkg.high.b", "pkg.side.d"): "meant"}) == []


def test_every_part_of_the_package_has_one_layer():
    listed = [part for _, members in LAYERS for part in members]
    assert len(listed) == len(set(listed))
    folders = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders | set(GROUPS) | set(PARTS.values()) == set(listed)
    top = {module_name(p).partition(".")[2] for p in PACKAGE.glob("*.py")}
    assert top == {m for members in GROUPS.values() for m in members}, "a module at the top with no group"


def test_no_part_imports_its_own_layer_or_above():
    assert layer_violations() == []


def test_architecture_shows_these_layers():
    text = (PACKAGE.parent / "ARCHITECTURE.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and " | " in line]
    for name, members in LAYERS:
        assert any(row.startswith(f"| {name} | ") and all(f"`{m}`" in row for m in members) for row in rows), name
