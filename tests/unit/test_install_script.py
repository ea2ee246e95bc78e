"""launch/install.sh on a GPU machine, run against fakes: nothing is installed (issue 31, item 1).

    python -m pytest tests/unit/test_install_script.py -q

The script and its helper (launch/cuda_toolkit.sh) are copied into a scratch repository whose
`.venv/bin/pip` only records its arguments (and the CUDA_HOME it was given) and whose `.venv/bin/python`
answers the script's probes (torch sees a GPU or not, Transformer Engine imports or not, where
site-packages is) and hands everything else to this Python.  A fake `nvidia-smi` on PATH makes the
script choose the GPU build.  The helper's nvcc lookup is also run on its own, where the system CUDA
folder can be pointed at an empty one (this machine may have a real /usr/local/cuda).
"""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"

FAKE_PYTHON = """#!/usr/bin/env bash
# the venv's python, as the install script probes it; anything else goes to the real one
venv="$(cd "$(dirname "$0")/.." && pwd)"
case "$*" in
  *torch.cuda.is_available*) echo "${FAKE_TORCH_SEES_GPU:-False}" ;;
  *torch.version.cuda*) echo "2.13.0 built for CUDA 13.0" ;;
  *purelib*) echo "$venv/site" ;;
  *"import transformer_engine.pytorch"*) [ -f "$venv/te-installed" ] || [ "${FAKE_TE:-no}" = yes ] ;;
  *"import vllm"*) true ;;
  *) exec REAL_PYTHON "$@" ;;
esac
"""
FAKE_PIP = """#!/usr/bin/env bash
venv="$(cd "$(dirname "$0")/.." && pwd)"
echo "$* | CUDA_HOME=${CUDA_HOME:-} | CUDNN_PATH=${CUDNN_PATH:-}" >> "$venv/pip.log"
case "$*" in *transformer-engine*) touch "$venv/te-installed" ;; esac
"""
FAKE_SMI = """#!/usr/bin/env bash
case "$*" in *driver_version*) echo "535.00" ;; *) echo "GPU 0: Fake H200 (UUID: GPU-0)" ;; esac
"""


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _scratch(root: Path) -> Path:
    repo = root / "repo"
    (repo / "launch").mkdir(parents=True)
    for name in ("launch/install.sh", "launch/cuda_toolkit.sh", "setup.py"):
        shutil.copy(REPO / name, repo / name)
    _executable(repo / ".venv/bin/python", FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
    _executable(repo / ".venv/bin/pip", FAKE_PIP)
    (repo / ".venv/site").mkdir()
    _executable(root / "bin/nvidia-smi", FAKE_SMI)
    return repo


def _install(repo: Path, **env) -> subprocess.CompletedProcess:
    base = {"PATH": f"{repo.parent / 'bin'}:/usr/bin:/bin", "HOME": str(repo.parent)}  # no nvcc on this PATH
    return subprocess.run([BASH, "launch/install.sh"], cwd=repo, env={**base, **env}, capture_output=True,
                          text=True, timeout=120)


def _pip_log(repo: Path) -> list[str]:
    log = repo / ".venv/pip.log"
    return log.read_text().splitlines() if log.exists() else []


def _toolkit(root: Path) -> Path:
    _executable(root / "bin/nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    return root


def test_gpu_install_stops_when_torch_sees_no_gpu(tmp_path):
    repo = _scratch(tmp_path / "a")
    toolkit = str(_toolkit(tmp_path / "cuda"))
    out = _install(repo, CUDA_HOME=toolkit)  # the GPU build, chosen by nvidia-smi
    assert out.returncode == 1, out.stderr
    assert "torch.cuda.is_available() is False" in out.stderr and "535.00" in out.stderr, out.stderr
    assert "2.13.0 built for CUDA 13.0" in out.stderr
    assert _pip_log(repo) == [f"install -q -e .[gpu,test] | CUDA_HOME={toolkit} | CUDNN_PATH="]  # no TE build
    assert not (repo / ".venv/.megatron-rl-installed").exists()

    # Where torch sees the GPU, TE is built with the toolkit given; the flag lets a node without one install.
    runs = {"sees_gpu": {"FAKE_TORCH_SEES_GPU": "True"},
            "skip_check": {"MEGATRON_RL_DEVICE": "gpu", "MEGATRON_RL_SKIP_CUDA_CHECK": "1"}}
    for name, env in runs.items():
        repo = _scratch(tmp_path / name)
        out = _install(repo, CUDA_HOME=toolkit, **env)
        assert out.returncode == 0, (name, out.stderr)
        te = [line for line in _pip_log(repo) if "transformer-engine" in line]
        assert len(te) == 1 and f"CUDA_HOME={toolkit} " in te[0], _pip_log(repo)
        assert (repo / ".venv/.megatron-rl-installed").read_text().startswith("gpu ")

    # The CPU install has no such check and is as it was.
    repo = _scratch(tmp_path / "cpu")
    (tmp_path / "cpu/bin/nvidia-smi").unlink()
    out = _install(repo)
    assert out.returncode == 0, out.stderr
    assert _pip_log(repo) == ["install -q -e .[cpu,test] | CUDA_HOME= | CUDNN_PATH=",
                              "uninstall -y -q torchvision torchaudio torchcodec | CUDA_HOME= | CUDNN_PATH="]
    assert (repo / ".venv/.megatron-rl-installed").read_text().startswith("cpu ")


def test_gpu_install_stops_before_compiling_te_without_nvcc(tmp_path):
    repo = _scratch(tmp_path)
    out = _install(repo, CUDA_HOME=str(tmp_path), FAKE_TORCH_SEES_GPU="True")
    assert out.returncode == 1
    assert f"CUDA_HOME={tmp_path} has no bin/nvcc" in out.stderr, out.stderr
    assert not [line for line in _pip_log(repo) if "transformer-engine" in line]  # no compile attempted
    # A TE that already imports (a prebuilt wheel) needs no nvcc: the same install goes through.
    out = _install(repo, CUDA_HOME=str(tmp_path), FAKE_TORCH_SEES_GPU="True", FAKE_TE="yes")
    assert out.returncode == 0, out.stderr


def _lookup(tmp_path, site: Path, path_dirs=(), **env) -> subprocess.CompletedProcess:
    system = tmp_path / "no-system-cuda"
    script = f'source "{REPO}/launch/cuda_toolkit.sh"; cuda_home_for_te "{site}" "{system}"'
    return subprocess.run([BASH, "-c", script], env={"PATH": ":".join(map(str, path_dirs)) or str(tmp_path), **env},
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("wheel", ["nvidia/cu13", "nvidia/cuda_nvcc"])
def test_lookup_finds_the_pip_toolkit_nvcc(tmp_path, wheel):
    site = tmp_path / "site"
    _toolkit(site / wheel)
    out = _lookup(tmp_path, site)
    assert out.returncode == 0 and out.stdout.strip() == str(site / wheel), out.stderr


def test_lookup_without_any_nvcc_names_where_it_looked(tmp_path):
    out = _lookup(tmp_path, tmp_path / "site")
    assert out.returncode == 1 and out.stdout == ""
    assert "no nvcc found" in out.stderr and f"{tmp_path}/site/nvidia/cu13/bin" in out.stderr, out.stderr


def test_lookup_prefers_cuda_home_then_path_over_the_wheels(tmp_path):
    site = tmp_path / "site"
    _toolkit(site / "nvidia/cu13")
    home = _toolkit(tmp_path / "home")
    assert _lookup(tmp_path, site, CUDA_HOME=str(home)).stdout.strip() == str(home)
    on_path = _toolkit(tmp_path / "onpath")
    out = _lookup(tmp_path, site, path_dirs=[on_path / "bin"])
    assert out.returncode == 0 and out.stdout.strip() == ""  # TE's build finds that one itself


def test_scripts_parse():
    for name in ("launch/install.sh", "launch/cuda_toolkit.sh"):
        assert subprocess.run([BASH, "-n", str(REPO / name)]).returncode == 0, name
    assert os.access(REPO / "launch/install.sh", os.R_OK)
