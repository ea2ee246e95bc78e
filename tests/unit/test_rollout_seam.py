"""The rollout side's shape (issue 45): engines and producers are siblings built from shared parts, not
variants of one another, and remote methods are called by name in code, never through a string.

    python -m pytest tests/unit/test_rollout_seam.py -q
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[2] / "megatron_rl"
SIDES = ("rollout", "sampling", "train")
RECEIVING = {"policy_version", "serving_dtype", "refit_tolerance", "init_weight_transfer", "receive_weights",
             "commit_weights", "expect_probe", "fail_next_load", "weight_checksums"}
ENGINE = {"generate", "run_episodes", "score", "reset", "shutdown", "engine_alive", "engine_world_size"}


def _classes(root: Path) -> dict[str, list[str]]:
    """Every class under `root` by name, with the names of its bases."""
    out: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out[f"{path.relative_to(PKG)}:{node.name}"] = [ast.unparse(b).split(".")[-1] for b in node.bases]
    return out


def variants(classes: dict[str, list[str]]) -> list[str]:
    """Classes that subclass a rollout worker or producer (a class named ...Worker or ...Producer)."""
    return [name for name, bases in classes.items() if any(re.search(r"(Worker|Producer)$", b) for b in bases)]


def test_no_rollout_worker_or_producer_is_a_variant_of_another():
    found = [v for side in SIDES for v in variants(_classes(PKG / side))]
    assert found == [], f"subclasses of a rollout worker or producer: {found}"


def test_the_check_sees_a_variant():
    assert variants({"a.py:Stream": ["RolloutWorker"], "b.py:Round": ["PublicationReceiving"],
                     "c.py:S": ["Producer"]}) == ["a.py:Stream", "c.py:S"]


def test_both_engines_answer_the_same_receiving_and_engine_calls():
    from megatron_rl.rollout.receiver import PublicationReceiving
    from megatron_rl.rollout.stream_actor import StreamRolloutWorker
    from megatron_rl.rollout.worker import RolloutWorker

    for engine in (RolloutWorker, StreamRolloutWorker):
        assert issubclass(engine, PublicationReceiving), engine
        missing = (RECEIVING | ENGINE) - set(dir(engine))
        assert not missing, f"{engine.__name__} lacks {sorted(missing)}"
        assert "_commit" in vars(engine), f"{engine.__name__} must supply its own swap (_commit)"


def test_the_fleet_and_the_producers_reach_no_remote_method_through_a_string_name():
    """Nor does the sleep cycle (rollout/sleep.py picks the method with engine_sleep / engine_wake_up).  (The
    learner group's call-on-every-rank and the coordinator's verbs dispatch by a name checked where it is made.)"""
    files = [PKG / "rollout" / "fleet.py", PKG / "rollout" / "sleep.py", PKG / "sampling" / "rollout_source.py",
             *sorted((PKG / "sampling").glob("*producer*.py"))]
    calls = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        calls += [f"{path.relative_to(PKG)}: {m.group(0)}" for m in re.finditer(r"getattr\([^()]*\)\.remote", text)]
    assert len(files) >= 5 and calls == [], calls


LORA_OWN = {"models/lora.py", "models/lora_config.py", "models/lora_checkpoint.py", "conversion/lora_io.py",
            "conversion/lora_export.py", "publish/vllm_adapters.py", "publish/adapter_source.py", "planner/training.py"}
"""LoRA's own modules: the full-weights or adapter choice is theirs to make."""
LORA_BRANCHES = {
    "rollout/config.py": "RolloutConfig.refit_mode: the one place a LoRA run's refit mode is decided",
    "ranks/build.py": "the reference model: a LoRA policy's is its base with the adapters off, no second copy",
    "conversion/mcore_to_hf.py": "`megatron-rl convert` of a checkpoint that holds adapters merges them instead",
}
"""The LoRA branches outside LoRA's own modules (issue 45: at most 4), by file, with why each stays."""
_LORA = re.compile(r"lora|adapter", re.I)


def _mentions_lora(node: ast.AST) -> bool:
    """Whether a test expression asks about LoRA itself: a name, attribute or text naming LoRA or adapters,
    outside the arguments of a call (a call's answer is the asked object's decision, not a branch here)."""
    if isinstance(node, ast.Call):
        return _mentions_lora(node.func)
    word = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else \
        node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
    if _LORA.search(word):
        return True
    return any(_mentions_lora(child) for child in ast.iter_child_nodes(node))


def lora_branches(source: str) -> list[int]:
    """The lines of `source` where an if, a conditional expression, a while, a comprehension's filter or an
    and/or tests LoRA (each line once)."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        tests = [node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While)) else \
            node.ifs if isinstance(node, ast.comprehension) else [node] if isinstance(node, ast.BoolOp) else []
        lines.update(t.lineno for t in tests if _mentions_lora(t))
    return sorted(lines)


def test_lora_decides_its_weights_in_its_own_modules():
    """Weights of one kind, chosen once (issue 45 item 4): outside LoRA's own modules, only the branches
    LORA_BRANCHES names (one file each) test for LoRA; the rest ask the chosen object."""
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        lines = [] if rel in LORA_OWN else lora_branches(path.read_text(encoding="utf-8"))
        if lines:
            found[rel] = lines
    assert len(LORA_BRANCHES) <= 4
    unexpected = {f: lines for f, lines in found.items() if f not in LORA_BRANCHES or len(lines) > 1}
    assert not unexpected, f"LoRA branches outside LoRA's own modules (file: lines): {unexpected}"
    assert set(found) == set(LORA_BRANCHES), f"LORA_BRANCHES names files without one: {set(LORA_BRANCHES) - set(found)}"


def test_the_check_sees_lora_branches():
    source = '''
if cfg.learner.lora.enabled:          # 2: an attribute
    pass
x = a if adapter is not None else b   # 4: a name
ok = keep and not lora                # 5: and/or
names = [n for n in names if ".adapter.lora_" in n]   # 6: a text
y = pick(adapter) or other            # 7: a call's answer: not a branch
if sleep_blocked(cfg.adapter):        # 8: the same
    pass
'''
    assert lora_branches(source) == [2, 4, 5, 6]
