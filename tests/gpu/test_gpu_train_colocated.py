"""On one GPU: the tiny recipe trained colocated in bf16, refit over CUDA IPC, engines asleep while learning.

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu/test_gpu_train_colocated.py -m gpu -q

The real CLI on configs/tiny_cpu_scratch.yaml, 3 sync steps, learner bf16 and engine bfloat16 on
the one GPU.  Nothing names the transport or sleep mode: they are chosen at start-up from
(placement, device), and for this run that must be ipc with sleep mode on.  Every step publishes
and must commit (the run ends at version 3), and each commit passes the refit check: the engine's
logprobs of the probe batch after the refit against the learner's (rollout/worker.py).

The driver-level checkpoint on the GPU: the first invocation stops after step 2 with a checkpoint at
each step; the second resumes from step 2 (weights, optimizer, RNG, queue through the Checkpointer),
publishes the resumed version -- whose refit check runs on the sampled rows the checkpoint kept, at the
bf16 bound -- and learns step 3.
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


def _train(overrides: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config",
                           str(REPO / "configs/tiny_cpu_scratch.yaml"), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _summary(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def test_tiny_recipe_colocated_bf16_over_ipc_with_sleep_checkpoint_and_resume(tmp_path):
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.placement import gpu_path_choices
    from tests.gpu.engine_options import EAGER_OVERRIDES

    overrides = [f"run.dir={tmp_path / 'run'}", "run.eval_every=0", "run.checkpoint_every=1",
                 "run.placement=colocated", "run.mode=sync", "learner.dtype=bf16", "rollout.dtype=bfloat16",
                 "rollout.gpu_memory_utilization=0.3", "data.eval_size=16", *EAGER_OVERRIDES]
    cfg = load_train_config(REPO / "configs/tiny_cpu_scratch.yaml", overrides)
    assert gpu_path_choices(cfg, "cuda")[:2] == ("ipc", True)

    first = _train([*overrides, f"run.steps={STEPS - 1}"])
    assert _summary(first)["version"] == STEPS - 1, _summary(first)
    freed = [line for line in first.stderr.splitlines() if "Sleep mode freed" in line]
    print(f"vLLM sleep lines in the run's log: {len(freed)}; first: {freed[:1]}")
    assert (tmp_path / "run" / "checkpoints" / f"step_{STEPS - 1:06d}" / "COMMITTED").is_file()

    resumed = _train([*overrides, f"run.steps={STEPS}"])
    assert "resumed from" in resumed.stderr and f"step_{STEPS - 1:06d}" in resumed.stderr, resumed.stderr[-3000:]
    assert "uniformly random tokens" not in resumed.stderr  # the checkpoint's sampled probe rows
    summary = _summary(resumed)
    assert summary["steps"] == STEPS and summary["version"] == STEPS, summary
