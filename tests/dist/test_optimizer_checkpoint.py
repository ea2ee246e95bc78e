"""Distributed-optimizer checkpoint at DP2: memory-efficient save, exact resume (issue 18, defect 4).

    .venv/bin/python -m pytest tests/dist/test_optimizer_checkpoint.py -q

Two gloo ranks (TP1 x DP2) train a tiny Llama one step with the distributed optimizer and save
through the learner's sharded_state_dict (as train.learner_group does).  The save must use the
memory-efficient reshardable exchange: the gathered optimizer state exists on DP rank 0 only
(DP rank 1 contributes over gloo and holds none), instead of an all-gather onto every rank.
A fresh learner then loads it: weights and Adam moments equal, and the next step matches.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def _loss(lp, mb):
    return -lp.mean() / mb["num_micro_batches"], {}


def _moments(learner):
    inner = learner.optimizer.optimizer
    return [state[k].clone() for state in inner.state.values() for k in ("exp_avg", "exp_avg_sq")]


def _save_and_resume(rank, world, ckpt_dir):
    import multiprocessing

    from megatron.core import dist_checkpointing

    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.models.hf_config import load_hf_config

    cfg = LearnerConfig(global_batch_size=4, micro_batch_size=2, lr=1e-2, seed=5)
    hf_cfg = load_hf_config(TINY)
    tokens = torch.randint(0, 101, (4, 16), generator=torch.Generator().manual_seed(2))
    learner = Learner(cfg, hf_cfg)
    learner.train_step({"tokens": tokens}, _loss)
    sd = learner.sharded_state_dict()
    held = sd["optimizer"]["param_state"] is not None
    sd.pop("scheduler"), sd.pop("step")
    proc = multiprocessing.current_process()
    daemon, proc.daemon = proc.daemon, False  # save starts a Manager; spawned ranks are daemonic
    try:
        dist_checkpointing.save(sd, ckpt_dir)
    finally:
        proc.daemon = daemon
    saved_params = [p.detach().clone() for p in learner.model[0].module.parameters()]
    saved_moments = _moments(learner)
    after = learner.train_step({"tokens": tokens}, _loss)["loss"]
    learner.close()

    fresh = Learner(cfg, hf_cfg)
    sd = fresh.sharded_state_dict(is_loading=True)
    sd.pop("scheduler"), sd.pop("step")
    fresh.load_sharded_state_dict(dist_checkpointing.load(sd, ckpt_dir, strict="raise_all"))
    same_params = all(torch.equal(a, b.detach()) for a, b in zip(saved_params, fresh.model[0].module.parameters()))
    same_moments = all(torch.equal(a, b) for a, b in zip(saved_moments, _moments(fresh)))
    resumed = fresh.train_step({"tokens": tokens}, _loss)["loss"]
    fresh.close()
    return {"held": held, "params": same_params, "moments": same_moments, "after": after, "resumed": resumed,
            "optimizer": type(fresh.optimizer.optimizer).__name__}


def test_memory_efficient_save_and_exact_resume(tmp_path):
    (tmp_path / "ckpt").mkdir()
    out = run_distributed(_save_and_resume, 2, str(tmp_path / "ckpt"), timeout=600)
    assert [r["held"] for r in out] == [True, False], "gathered optimizer state on DP rank 0 only"
    for r in out:
        assert r["params"] and r["moments"]
        assert r["resumed"] == pytest.approx(r["after"], rel=1e-6)
