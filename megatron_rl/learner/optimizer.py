"""The learner's optimizer and learning-rate schedule, built from its LearnerConfig.

    optimizer = build_optimizer(learner_cfg, model_chunks, dtype=torch.float32)
    scheduler = build_scheduler(learner_cfg, optimizer)
    scheduler.step(increment=learner_cfg.global_batch_size)     # after each applied step

Megatron-Core's optimizer (Adam; the distributed optimizer with learner.use_distributed_optimizer;
torch Adam without Apex/TE) over the DDP-wrapped model chunks, patched so a checkpoint loads
into torch Adam (optimizer_state.py), and Megatron's OptimizerParamScheduler, which counts
SAMPLES: warm-up and decay lengths are learner steps times global_batch_size.
"""

from __future__ import annotations

import torch

from megatron_rl.learner.config import LearnerConfig
from megatron_rl.learner.optimizer_state import patch_torch_adam_state_loading


def build_optimizer(cfg: LearnerConfig, model: list, *, dtype: torch.dtype):
    """Megatron's optimizer over `model` (DDP chunks) with params of `dtype` (bf16/fp16 flags follow it)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    patch_torch_adam_state_loading(optimizer)
    return optimizer


def build_scheduler(cfg: LearnerConfig, optimizer):
    """Warm-up over lr_warmup_steps, then lr_decay_style decay over lr_decay_steps (constant: lr throughout).

    A checkpoint's scheduler state gives the position in the schedule (samples seen); the schedule itself (lr,
    min_lr, warm-up, decay) is this config's: a run resumed, or replayed (`replay --set learner.lr=...`), with
    another learning rate trains with it.  (Megatron's default keeps the checkpoint's values and silently
    ignores the config's.)"""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    gbs = cfg.global_batch_size  # Megatron's scheduler counts samples (increment=global_batch_size per step)
    warmup = cfg.lr_warmup_steps * gbs
    decay = (cfg.lr_decay_steps or 1) * gbs + warmup
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else cfg.lr, max_lr=cfg.lr,
        min_lr=cfg.lr if cfg.lr_decay_style == "constant" else cfg.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay, end_wd=cfg.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True,
    )


SCHEDULE_KEYS = ("max_lr", "min_lr")
"""What Megatron keeps per parameter group for the scheduler (OptimizerParamScheduler.get_lr reads them first):
the config's, set when the optimizer is built."""


def load_optimizer_state(optimizer, state) -> None:
    """`optimizer.load_state_dict(state)`, keeping this config's schedule.  A checkpoint's optimizer state holds
    its parameter groups' max_lr / min_lr, which Megatron's scheduler reads before its own values: restored as
    they are, a run resumed (or replayed) with another learner.lr went on at the old one (build_scheduler)."""
    kept = [{k: group[k] for k in SCHEDULE_KEYS if k in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keys in zip(optimizer.param_groups, kept):
        group.update(keys)
