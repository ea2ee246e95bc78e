"""GPU check stage 1 in its CPU dry mode (issue 31: "a GPU check that fits a locked-down node").

    python -m pytest tests/unit/test_gpu_stage1.py -q

tests/gpu/stage1.py runs in a subprocess with `--device cpu`: the same four parts as on a GPU
(learner step, checkpoint round trip, two-process export and digest check, metric devices) on gloo.
The passing run is made with PyYAML, vLLM, Ray, Transformer Engine, transformers and safetensors
unimportable (a sitecustomize on the child's path refuses them, in the opening process too), as on a
node that has only torch, megatron-core and this project.  Its last line, a JSON summary, must say
every part ran and passed.  With a byte of the exported copy flipped after hashing (--break ipc) the
run must exit 1 and name the IPC part, the other parts still passing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # a fresh process that imports Megatron

REPO = Path(__file__).resolve().parents[2]
PARTS = ["learner_step", "checkpoint", "ipc_digest", "metrics"]
ABSENT = ("yaml", "vllm", "ray", "transformer_engine", "transformers", "safetensors")
BLOCKER = f'''import importlib.abc, sys
ABSENT = {ABSENT!r}
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on this node)", name=name)
sys.meta_path.insert(0, _Absent())
'''


def _stage1(tmp_path: Path, *args: str, locked_down: bool = False) -> tuple[subprocess.CompletedProcess, dict]:
    path = [str(REPO)]
    if locked_down:
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(BLOCKER)
        path.insert(0, str(site))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(REPO / "tests/gpu/stage1.py"), "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-3000:]
    return out, json.loads(lines[-1])


def test_dry_mode_runs_every_part_without_the_packages_a_locked_down_node_lacks(tmp_path):
    out, summary = _stage1(tmp_path, locked_down=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert summary["passed"] is True and summary["failed"] == [] and summary["device"] == "cpu"
    assert list(summary["parts"]) == PARTS
    assert all(part["ok"] for part in summary["parts"].values()), summary
    for n, name in enumerate(PARTS, 1):  # each part says what it ran and its result
        assert f"== stage 1 part {n}/4 {name}: " in out.stdout and f"{name}: " in out.stdout
    assert "== stage 1 passed" in out.stdout
    detail = summary["parts"]
    assert "over shared memory to process" in detail["ipc_digest"]["detail"]
    assert "verified (sha256)" in detail["checkpoint"]["detail"]
    assert "torch.bfloat16 params" in detail["learner_step"]["detail"]


def test_a_corrupted_export_fails_the_run_naming_the_part(tmp_path):
    out, summary = _stage1(tmp_path, "--break", "ipc")
    assert out.returncode == 1, out.stdout[-4000:]
    assert summary["passed"] is False and summary["failed"] == ["ipc_digest"], summary
    assert "blocksum mismatch" in summary["parts"]["ipc_digest"]["detail"]
    assert all(summary["parts"][name]["ok"] for name in PARTS if name != "ipc_digest")
    assert "== stage 1 FAILED: ipc_digest" in out.stdout
