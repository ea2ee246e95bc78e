"""On one GPU: the tiny recipe trained colocated in bf16, refit over CUDA IPC, engines asleep while learning.

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu/test_gpu_train_colocated.py -m gpu -q

The real CLI on configs/tiny_cpu_scratch.yaml, 3 sync steps, learner bf16 and engine bfloat16 on
the one GPU.  Nothing names the transport or sleep mode: they are chosen at start-up from
(placement, device), and for this run that must be ipc with sleep mode on.  Every step publishes
and must commit (the run ends at version 3), and each commit passes the refit check: the engine's
logprobs of the probe batch after the refit against the learner's (rollout/worker.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def test_tiny_recipe_colocated_bf16_over_ipc_with_sleep(tmp_path):
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.placement import gpu_path_choices
    from tests.gpu.engine_options import EAGER_OVERRIDES

    overrides = [f"run.dir={tmp_path / 'run'}", f"run.steps={STEPS}", "run.eval_every=0", "run.checkpoint_every=0",
                 "run.placement=colocated", "run.mode=sync", "learner.dtype=bf16", "rollout.dtype=bfloat16",
                 "rollout.gpu_memory_utilization=0.3", "data.eval_size=16", *EAGER_OVERRIDES]
    cfg = load_train_config(REPO / "configs/tiny_cpu_scratch.yaml", overrides)
    assert gpu_path_choices(cfg, "cuda")[:2] == ("ipc", True)

    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config",
                           str(REPO / "configs/tiny_cpu_scratch.yaml"), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
    assert summary["steps"] == STEPS and summary["version"] == STEPS, summary
    freed = [line for line in proc.stderr.splitlines() if "Sleep mode freed" in line]
    print(f"vLLM sleep lines in the run's log: {len(freed)}; first: {freed[:1]}")
