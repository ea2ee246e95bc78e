"""A role's own CPU cores: learner.cpu_cores and rollout.cpu_cores (platform/cores.py).

    python -m pytest tests/unit/test_cores.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.config import ConfigError, apply_overrides, from_dict
from megatron_rl.learner.config import LearnerConfig
from megatron_rl.platform.cores import confine_process, format_cores, parse_cores
from megatron_rl.rollout.config import RolloutConfig
from megatron_rl.rollout.engine_setup import engine_env

pytestmark = pytest.mark.unit


def test_core_lists_are_read_and_written_in_one_form():
    assert parse_cores("0", "f") == {0}
    assert parse_cores("0-2,5", "f") == {0, 1, 2, 5}
    assert parse_cores(" 3 , 1-1 ", "f") == {1, 3}
    assert format_cores({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert parse_cores(format_cores({4, 0, 1, 9}), "f") == {0, 1, 4, 9}


@pytest.mark.parametrize("text", ["", "a", "1-", "2-1", "-1", "0;1"])
def test_a_bad_core_list_is_refused_naming_the_field(text):
    with pytest.raises(ValueError, match="learner.cpu_cores"):
        LearnerConfig(cpu_cores=text)
    with pytest.raises(ValueError, match="rollout.cpu_cores"):
        RolloutConfig(cpu_cores=text)


def test_rollout_cores_bind_the_engines_threads_unless_a_binding_is_given():
    assert engine_env(RolloutConfig(cpu_cores="1"), on_gpu=False)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert engine_env(RolloutConfig(cpu_cores="0,1"), on_gpu=False)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    given = RolloutConfig(cpu_cores="0-1", cpu_threads_bind="1")
    assert engine_env(given, on_gpu=False)["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env(RolloutConfig(), on_gpu=False)
    with pytest.raises(ValueError, match="rollout.cpu_threads_bind"):  # TP 2: which cores each rank gets
        RolloutConfig(cpu_cores="0-1", tensor_parallel_size=2)


def test_confining_moves_every_thread_and_what_starts_later():
    # In a child process (affinity is per thread and inherited): a thread running before, one started after.
    core = min(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, threading
        from megatron_rl.platform.cores import confine_process
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        confine_process({{{core}}}, os.sched_getaffinity(0), "learner.cpu_cores")
        got = []
        after = threading.Thread(target=lambda: got.append(os.sched_getaffinity(0))); after.start(); after.join()
        print(os.sched_getaffinity(before.native_id), os.sched_getaffinity(0), got[0])
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [f"{{{core}}}"] * 3


def test_cores_outside_the_process_are_refused_naming_the_field():
    allowed = os.sched_getaffinity(0)
    with pytest.raises(ValueError, match=r"rollout.cpu_cores: core\(s\) 9999 are not among"):
        confine_process({9999}, allowed, "rollout.cpu_cores")
    assert os.sched_getaffinity(0) == allowed  # nothing moved


def test_a_bare_core_number_from_yaml_or_an_override_is_a_core_list():
    """`cpu_cores: 0` in YAML, or `learner.cpu_cores=0` on the command line, is read as the number 0."""
    cfg = from_dict(LearnerConfig, apply_overrides({}, ["cpu_cores=0"]))
    assert cfg.cpu_cores == "0" and parse_cores(cfg.cpu_cores, "f") == {0}
    assert from_dict(RolloutConfig, {"cpu_cores": 1}).cpu_cores == "1"
    with pytest.raises(ConfigError, match="cpu_cores"):  # true is no core list
        from_dict(RolloutConfig, {"cpu_cores": True})


def test_a_learner_without_cores_is_moved_only_back_to_where_it_started(monkeypatch):
    """confine_learner: no affinity call at a build when learner.cpu_cores is unset and the process never moved;
    the named cores, or the ones it started on after a move, for every thread (recorded, not applied)."""
    from megatron_rl.ranks.build import confine_learner

    moves: list[set[int]] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cores: moves.append(set(cores)))
    started = os.sched_getaffinity(0)
    confine_learner(None, started)
    assert moves == []
    confine_learner("0", started)
    assert moves and all(m == {0} for m in moves)
    moves.clear()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # as if a run before had moved it to core 0
    confine_learner(None, started)
    assert moves and all(m == started for m in moves)
