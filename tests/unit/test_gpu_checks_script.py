"""tests/gpu/run_gpu_checks.sh cannot report success having tested nothing (issue 31, item 2).

    python -m pytest tests/unit/test_gpu_checks_script.py -q

The script is copied into a scratch repository and run with a fake `nvidia-smi` on PATH and one of
three venv pythons: this one (its torch sees no GPU on this machine), one without torch, and a fake
that reports one GPU, answers the package probes from the environment and stands in for pytest
(writing the JUnit report a passing, or an all-skipped, run would write) and for stage 1
(tests/gpu/stage1.py: a passing or failing JSON summary, or none).  Without a GPU it must
exit non-zero whatever the flags; with one, a part left out for a missing package fails the run
unless --allow-skip, a part whose pytest skipped its tests fails, stage 1 runs first and its failure
(or a run that printed no passing summary) fails the whole, and the end lists every part.
"""

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"

THIS_PYTHON = '#!/usr/bin/env bash\nexec REAL_PYTHON "$@"\n'
FAKE_SMI = '#!/usr/bin/env bash\necho "GPU 0: Fake H200 (UUID: GPU-0)"\n'
NO_TORCH = ("#!/usr/bin/env bash\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
ONE_GPU = """#!/usr/bin/env bash
# one GPU; packages import when named in FAKE_IMPORTS; "-m pytest" writes a JUnit report (FAKE_PYTEST=pass|skip)
case "$1 ${2:-}" in
  "-c import torch;"*) echo "1 2.13.0 13.0"; exit 0 ;;
  "-m pytest")
    for arg in "$@"; do case "$arg" in --junitxml=*) xml="${arg#--junitxml=}" ;; esac; done
    skipped=0; [ "${FAKE_PYTEST:-pass}" = skip ] && skipped=2
    echo "<testsuites><testsuite name=\\"pytest\\" tests=\\"2\\" skipped=\\"$skipped\\" failures=\\"0\\" errors=\\"0\\"/></testsuites>" > "$xml"
    exit 0 ;;
  "tests/gpu/stage1.py --device")  # stage 1's last line is its JSON summary (FAKE_STAGE1=pass|fail|silent)
    case "${FAKE_STAGE1:-pass}" in
      pass) echo "== stage 1 part 1/4 learner_step: passed"; echo '{"stage": 1, "passed": true, "failed": []}'; exit 0 ;;
      fail) echo '{"stage": 1, "passed": false, "failed": ["ipc_digest"]}'; exit 1 ;;
      silent) exit 0 ;;
    esac ;;
  "-c import "*) mod="${2#import }"; case " ${FAKE_IMPORTS:-} " in *" $mod "*) exit 0 ;; *) exit 1 ;; esac ;;
  *) exec REAL_PYTHON "$@" ;;
esac
"""


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _run(tmp_path: Path, python: str, *args: str, smi: bool = True, **env) -> subprocess.CompletedProcess:
    repo = tmp_path / "repo"
    (repo / "tests/gpu").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "tests/gpu/run_gpu_checks.sh", repo / "tests/gpu/run_gpu_checks.sh")
    venv_python = repo / ".venv/bin/python"
    venv_python.unlink(missing_ok=True)
    _executable(venv_python, python.replace("REAL_PYTHON", sys.executable))
    bin_dir = tmp_path / "bin"
    shutil.rmtree(bin_dir, ignore_errors=True)
    if smi:
        _executable(bin_dir / "nvidia-smi", FAKE_SMI)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), **env}
    return subprocess.run([BASH, "tests/gpu/run_gpu_checks.sh", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_torch_that_sees_no_gpu_fails_the_checks(tmp_path):
    out = _run(tmp_path, THIS_PYTHON)  # nvidia-smi lists a GPU; this machine's torch sees none
    assert out.returncode == 1, out.stdout + out.stderr
    assert "nvidia-smi lists 1 GPU(s) but torch sees 0" in out.stderr, out.stderr
    for args in ((), ("--allow-skip",)):  # and without nvidia-smi either: nothing can run, whatever the flag
        out = _run(tmp_path, THIS_PYTHON, *args, smi=False)
        assert out.returncode == 1 and "no GPU visible to torch" in out.stderr, (args, out.stdout + out.stderr)


def test_a_python_without_torch_fails_the_checks(tmp_path):
    out = _run(tmp_path, NO_TORCH)
    assert out.returncode == 1
    assert "does not import torch" in out.stderr and "No module named 'torch'" in out.stderr, out.stderr


def test_parts_left_out_for_a_missing_package_fail_unless_allowed_and_are_listed(tmp_path):
    out = _run(tmp_path, ONE_GPU, FAKE_IMPORTS="ray")  # no TE, no vLLM
    assert out.returncode == 1, out.stdout
    assert "FAILED:  TE vs local parity (transformer_engine.pytorch does not import)" in out.stdout
    assert "FAILED:  tiny recipe colocated bf16 with IPC refit and sleep/wake (vllm does not import)" in out.stdout
    assert "passed:  NCCL learner step with metrics" in out.stdout

    out = _run(tmp_path, ONE_GPU, "--allow-skip", FAKE_IMPORTS="ray")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed, 0 failed, 5 skipped, 2 not run" in out.stdout, out.stdout
    assert "skipped: top-p 0.9 samples reconcile with the learner's semantics (vllm does not import)" in out.stdout
    assert "skipped: checkpoint save + resume (TE FusedAdam) (transformer_engine.pytorch does not import)" in out.stdout
    assert "not run: NCCL disaggregated publication + logprobs after refit (needs 2 GPUs)" in out.stdout

    out = _run(tmp_path, ONE_GPU, FAKE_IMPORTS="transformer_engine.pytorch vllm ray")
    assert out.returncode == 0 and "6 passed, 0 failed, 0 skipped, 2 not run" in out.stdout, out.stdout


def test_a_part_whose_tests_all_skipped_failed(tmp_path):
    out = _run(tmp_path, ONE_GPU, FAKE_IMPORTS="transformer_engine.pytorch vllm ray", FAKE_PYTEST="skip")
    assert out.returncode == 1
    assert "FAILED:  NCCL learner step with metrics (pytest skipped 2 of 2)" in out.stdout, out.stdout
    out = _run(tmp_path, ONE_GPU, "--allow-skip", FAKE_PYTEST="skip")  # the flag is about packages, not this
    assert out.returncode == 1 and "no part ran" in out.stderr, out.stdout + out.stderr


def test_unknown_argument_is_refused(tmp_path):
    out = _run(tmp_path, ONE_GPU, "--allow-skips")
    assert out.returncode == 2 and "unknown argument '--allow-skips'" in out.stderr


def test_stage_one_runs_first_and_its_failure_fails_the_checks(tmp_path):
    everything = "transformer_engine.pytorch vllm ray"
    out = _run(tmp_path, ONE_GPU, FAKE_IMPORTS=everything)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.index("== stage 1 (torch + megatron-core only)") < out.stdout.index("== TE vs local parity")
    assert "== stage 1 part 1/4 learner_step: passed" in out.stdout and "   stage 1: passed" in out.stdout
    assert "stage 1 passed; stage 2: 6 passed, 0 failed" in out.stdout, out.stdout

    out = _run(tmp_path, ONE_GPU, FAKE_IMPORTS=everything, FAKE_STAGE1="fail")
    assert out.returncode == 1, out.stdout
    assert '   stage 1: FAILED (exit 1, failed parts ["ipc_digest"])' in out.stdout, out.stdout
    assert "6 passed, 0 failed" in out.stdout  # stage 2 still ran, and says so

    out = _run(tmp_path, ONE_GPU, FAKE_IMPORTS=everything, FAKE_STAGE1="silent")  # exit 0, but no summary
    assert out.returncode == 1 and "stage 1: FAILED (exit 0, failed parts unknown: no summary line)" in out.stdout
