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
