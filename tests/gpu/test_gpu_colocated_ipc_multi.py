"""On two GPUs: colocated training whose refit reaches both GPUs over CUDA IPC (publish/ipc_route.py).

    bash tests/gpu/run_gpu_checks.sh        # or: python -m pytest tests/gpu/test_gpu_colocated_ipc_multi.py -m gpu -q

The real CLI on configs/tiny_cpu_scratch.yaml, colocated in bf16 on two GPUs: learner DP2 (rank i
on GPU i) and two rollout groups (group i on GPU i).  The transport is chosen at start-up (ipc);
rank 1 holds a copy of each publication on GPU 1 and group 1 opens that copy.  Every step
publishes and both groups must commit it, each after its refit check (the run ends at version 3
only then).  With one learner rank and two groups, group 1's GPU has no learner rank: the run is
refused at start-up with a ConfigError naming group 1 (exit 2).
Skipped with fewer than two GPUs (never run on this project's CPU machines).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu.engine_options import EAGER_OVERRIDES

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices (a learner rank and a rollout group on each)")]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs/tiny_cpu_scratch.yaml"
STEPS = 3


def _train(tmp_path, *extra, timeout=420):
    overrides = [f"run.dir={tmp_path / 'run'}", f"run.steps={STEPS}", "run.eval_every=0", "run.checkpoint_every=0",
                 "run.placement=colocated", "run.mode=sync", "learner.dtype=bf16", "rollout.dtype=bfloat16",
                 "rollout.gpu_memory_utilization=0.3", "data.eval_size=16", "rollout.data_parallel_size=2",
                 *EAGER_OVERRIDES, *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, "-m", "megatron_rl.cli", "train", "--config", str(RECIPE), *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_refit_reaches_both_gpus_and_every_group_commits(tmp_path):
    from megatron_rl.train.config import load_train_config
    from megatron_rl.train.placement import gpu_path_choices

    extra = ("learner.data_parallel_size=2", "learner.micro_batch_size=32")
    cfg = load_train_config(RECIPE, [f"run.dir={tmp_path / 'run'}", "run.placement=colocated", "run.mode=sync",
                                     "rollout.data_parallel_size=2", *extra])
    assert gpu_path_choices(cfg, "cuda")[0] == "ipc"
    proc = _train(tmp_path, *extra)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
    assert summary["steps"] == STEPS and summary["version"] == STEPS, summary
    route = [line for line in proc.stderr.splitlines() if "copies on learner ranks" in line]
    print(f"route lines in the run's log: {route[:1]}")


def test_an_engine_gpu_without_a_learner_rank_is_refused_at_start_up(tmp_path):
    proc = _train(tmp_path, "learner.data_parallel_size=1", timeout=300)
    assert proc.returncode == 2, proc.stderr[-6000:]
    assert "rollout.weight_transfer 'ipc'" in proc.stderr and "group 1 on" in proc.stderr, proc.stderr[-3000:]
