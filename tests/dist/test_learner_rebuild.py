"""A learner rank rebuilt in its own process for the next run holds that run's policy, as a new rank would.

    python -m pytest tests/dist/test_learner_rebuild.py -q      # through /work/heavy

The experiment runner's pool (train/engine_pool.py) hands a finished run's learner actors to the
next run, which calls `LearnerWorker.rebuild` instead of starting new ones.  Two gloo ranks (TP=2)
set up from checkpoint A, their weights are changed in place (as training would), then rebuilt from
checkpoint B and again from A: each time the published state is the checkpoint's bit for bit, the
optimizer starts over, and the probe logprobs equal those of the first set-up from A (the TP groups
rebuilt by the rebuild carry the collectives).  Each rebuild also destroys the last run's process
groups (platform/parallel.py destroy_parallel): torch holds as many live groups after the rebuilds as
after the first set-up, not one more set of Megatron's groups per rebuild.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _rebuilds(rank: int, world_size: int, dir_a: str, dir_b: str):
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.learner import LearnerConfig
    from megatron_rl.platform.parallel import live_group_count
    from megatron_rl.ranks.rank import LearnerWorker, RankSpec

    cfg = LearnerConfig(tensor_parallel_size=2, global_batch_size=2)
    tokens_bt = torch.randint(1, 60, (2, 12), generator=torch.Generator().manual_seed(5))

    def args(hf_dir: str, seed: int) -> RankSpec:
        return RankSpec(learner=cfg, loss=GRPOLossConfig(kl_coef=0.001), hf_dir=hf_dir, seed=seed, deterministic=True,
                        threads=1)

    worker = LearnerWorker(rank=rank, world_size=world_size)
    spec = RankSpec(learner=cfg, loss=GRPOLossConfig(kl_coef=0.001), hf_dir=dir_a, seed=0, deterministic=True, threads=1)
    worker.setup("127.0.0.1", 0, spec)
    first = worker.forward_logprobs(tokens_bt)
    groups = [live_group_count()]
    with torch.no_grad():  # what training would do to the weights
        for p in worker.learner.model[0].module.parameters():
            p.add_(0.5)
    worker.learner.step = 7
    worker.rebuild(args(dir_b, 1))
    state_b, step_b = worker.hf_state(), worker.learner.step
    groups.append(live_group_count())
    worker.rebuild(args(dir_a, 0))
    again = worker.forward_logprobs(tokens_bt)
    reference = worker.reference_logprobs(tokens_bt)
    groups.append(live_group_count())
    return state_b, step_b, worker.hf_state(), first, again, reference, groups


def test_a_rebuilt_learner_holds_the_next_runs_policy(tmp_path):
    from megatron_rl.models.tiny import make_tiny_model

    dir_a = make_tiny_model(tmp_path / "a", arch="llama", size="tiny", seed=1)
    dir_b = make_tiny_model(tmp_path / "b", arch="llama", size="tiny", seed=2)
    results = run_distributed(_rebuilds, 2, str(dir_a), str(dir_b), timeout=600)
    state_b, step_b, state_a, first, again, reference, groups = results[0]
    assert groups == [groups[0]] * 3 and results[1][6] == groups, (groups, results[1][6])  # no group leaked
    for state, hf_dir in ((state_b, dir_b), (state_a, dir_a)):
        original = load_file(str(hf_dir / "model.safetensors"))
        assert sorted(state) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(state[name], tensor), f"{hf_dir.name}: {name}"
    assert step_b == 0
    assert torch.equal(again, first)
    assert torch.allclose(reference, first, atol=1e-5)  # the reference is A's too (B's differs by ~1)
    assert torch.equal(results[1][4], results[1][3])  # rank 1 took part in the same forwards
