"""CPU-forced work on a machine where CUDA is visible (issue 18, defect 7).

    python -m pytest tests/unit/test_cpu_forced.py -q

`enable_cpu_compat()` is a no-op when CUDA is available, so a process that chose the CPU path on a
GPU machine (`convert verify`, the gloo process tests) used to build Megatron buffers on the GPU.
This machine has no GPU: a fresh process makes `torch.cuda.is_available()` answer True (the
injected condition), calls init_distributed with a CPU platform, and reports whether Megatron's
CUDA calls are redirected.  Spawned CPU children must not see the GPUs at all.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_rl.platform.spawn import run_distributed

# The fast tier (`-m unit`) is given by tests/unit/conftest.py: every test here but the slow ones.

CUDA_VISIBLE = textwrap.dedent('''
    import json, os, sys, torch
    torch.cuda.is_available = lambda: True          # as on a GPU machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.cpu_compat import is_enabled
    from megatron_rl.platform.parallel import init_distributed
    init_distributed(detect_platform("cpu"), rank=0, world_size=1)
    buf = torch.zeros(2, device=torch.cuda.current_device())   # how Megatron places its buffers
    print(json.dumps({"enabled": is_enabled(), "device": buf.device.type}))
''')


@pytest.mark.slow
def test_cpu_platform_redirects_cuda_even_when_cuda_is_visible():
    out = subprocess.run([sys.executable, "-c", CUDA_VISIBLE, "0"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"enabled": True, "device": "cpu"}


def _visible_devices(rank, world):
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.slow
def test_cpu_children_hide_the_gpus():
    assert run_distributed(_visible_devices, 1) == [""]
