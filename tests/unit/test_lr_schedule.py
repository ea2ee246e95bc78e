"""The learning-rate schedule across a checkpoint: the position comes from the checkpoint, the schedule from
the config (learner/optimizer.py build_scheduler).

    python -m pytest tests/unit/test_lr_schedule.py -q

Megatron's scheduler, by default, takes lr, min_lr, warm-up and decay from the checkpoint and ignores the
config's: a run resumed with a lower learning rate, or `replay --from-step K --set learner.lr=...`, went on
at the old one without a word (found by the replay's e2e test: the counterfactual was identical).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.learner.config import LearnerConfig
from megatron_rl.learner.optimizer import build_scheduler, load_optimizer_state

pytestmark = pytest.mark.unit


def _scheduler(**cfg):
    # param groups as Megatron's optimizer builds them: each carries the config's max_lr / min_lr
    group = {"params": [torch.nn.Parameter(torch.zeros(2))], "max_lr": cfg["lr"], "min_lr": cfg["lr"]}
    optimizer = torch.optim.SGD([group], lr=0.0)
    return optimizer, build_scheduler(LearnerConfig(global_batch_size=4, micro_batch_size=4, **cfg), optimizer)


def test_a_resumed_schedule_keeps_its_position_and_takes_the_configs_learning_rate():
    old_opt, old = _scheduler(lr=1e-3)
    old.step(increment=3 * 4)                      # three steps of 4 samples
    state = old.state_dict()
    new_opt, new = _scheduler(lr=5e-2)
    load_optimizer_state(new_opt, old_opt.state_dict())   # as Learner.load_state_dict: optimizer, then scheduler
    new.load_state_dict(state)
    assert new.num_steps == 12
    assert old_opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert new_opt.param_groups[0]["lr"] == pytest.approx(5e-2)   # the config's, not the checkpoint's 1e-3


def test_a_warm_up_resumed_midway_goes_on_from_where_it_was():
    _, old = _scheduler(lr=1e-3, lr_warmup_steps=10)
    old.step(increment=5 * 4)                      # half-way through the warm-up
    opt, new = _scheduler(lr=1e-3, lr_warmup_steps=10)
    load_optimizer_state(opt, old.optimizer.state_dict())
    new.load_state_dict(old.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3, rel=0.2)   # mid-warm-up, not at 0 or at lr
    same_opt, same = _scheduler(lr=1e-3, lr_warmup_steps=10)
    same.step(increment=5 * 4)
    assert opt.param_groups[0]["lr"] == same_opt.param_groups[0]["lr"]  # as if never interrupted
