"""The GRPO loss through the real Megatron learner: batch-wide normalisers and lag guard at DP1 and DP2.

    python -m pytest tests/dist/test_loss_normalisers.py -q

One launch of 2 gloo processes runs two layouts of the same tiny Llama (TP1 x DP2 and TP2 x DP1),
both with B=4 sequences in micro-batches of 2 built by train.batch.build_batch:
  * gradients (DDP's reduced main_grad) of "sequence" and "token" aggregation, with a verifier
    error masking one row and uneven response lengths, equal autograd of the documented
    batch-wide formulas on a plain TP1 model with the same weights, within 1e-6;
  * the lag guard sees the batch-wide D_lag: micro-batches at D_lag 0.1 and 0.9 (0.5 over the
    batch) are stepped in full under a threshold of 0.6, quarantined in full above 0.4 (weights,
    Adam moments and LR schedule unchanged), and down-weighted by 0.25/0.5 in "downweight" mode.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_rl.grpo.loss import GRPOLossConfig
from megatron_rl.platform.spawn import run_distributed
from tests.dist.grpo_reference import documented_loss, one_group_batch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
SEED = 11
LAG_OFFSETS = (0.1, 0.1, 0.9, 0.9)  # |log π_θ - log μ| of each row: micro-batch 0 at 0.1, micro-batch 1 at 0.9


def _batch(responses: list[list[int]], texts: list[str | None]) -> dict:
    return one_group_batch(responses, texts, micro_batch_size=2)


def _with_behavior(batch, logprobs_bt, offsets_b, alternate=True):
    """The batch with μ = log π_θ ± offset per row (signs alternate along the sequence)."""
    t = logprobs_bt.shape[1]
    sign = torch.tensor([(-1.0) ** j for j in range(t)]) if alternate else torch.ones(t)
    return dict(batch, behavior_logprobs=(logprobs_bt - torch.tensor(offsets_b)[:, None] * sign).float())


def _grads(module):
    return {n: p.main_grad.detach().clone() for n, p in module.named_parameters()}


def _adam_state(learner):
    out = []
    for opt in getattr(learner.optimizer, "chained_optimizers", [learner.optimizer]):
        for state in opt.optimizer.state.values():
            out.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()})
    return out


def _work(rank, world, seq_batch, lag_batch):
    from megatron.core import parallel_state as ps

    from megatron_rl.grpo.step_metrics import grpo_step_weight
    from megatron_rl.learner import Learner, LearnerConfig, token_logprobs
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope
    from megatron_rl.models.reshard import load_shard, shard_state_dict
    from megatron_rl.grpo.micro_loss import grpo_micro_batch_loss

    cfg, platform = load_hf_config(TINY), detect_platform("cpu")
    tokens = seq_batch["tokens"]
    ref_grads = {}
    with parallel_scope(tp=1, pp=1, seed=SEED):
        model = build_gpt_model(cfg, platform=platform, tp=1, pp=1)
        full = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        for agg in ("sequence", "token"):
            model.zero_grad()
            logprobs = token_logprobs(model(tokens, pos, attention_mask=None), tokens, cfg.vocab_size)
            if agg == "sequence":  # μ near π_θ (±0.05): both clip sides leave most tokens a gradient
                seq_batch = _with_behavior(seq_batch, logprobs.detach(), (0.05, 0.03, -0.04, 0.02))
            documented_loss(logprobs, seq_batch, agg).backward()
            ref_grads[agg] = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                              for n, p in model.named_parameters()}
    out = {}
    for tp in (1, 2):
        learner = Learner(LearnerConfig(tensor_parallel_size=tp, micro_batch_size=2, global_batch_size=4,
                                        seed=SEED, use_distributed_optimizer=False, lr=1e-2, weight_decay=0.0,
                                        clip_grad=0.0), cfg, platform)
        module = learner.model[0].module
        where = dict(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=1, pp_rank=0, num_layers=cfg.num_layers,
                     tie_word_embeddings=cfg.tie_word_embeddings, vocab_size=cfg.vocab_size)
        load_shard(module, full, **where)
        learner.optimizer.reload_model_params()
        res = {"dp": learner.dp, "grad_diff": {}, "grad_max": {}}
        for agg in ("sequence", "token"):
            loss_fn = partial(grpo_micro_batch_loss, cfg=GRPOLossConfig(aggregation=agg))
            learner.forward_backward(seq_batch, loss_fn)
            got, want = _grads(module), shard_state_dict(ref_grads[agg], **where)
            res["grad_diff"][agg] = max((got[n] - want[n]).abs().max().item() for n in want)
            res["grad_max"][agg] = max(want[n].abs().max().item() for n in want)

        def lag_step(batch, **guard):
            cfg_loss = GRPOLossConfig(**guard)
            return learner.train_step(batch, partial(grpo_micro_batch_loss, cfg=cfg_loss),
                                      partial(grpo_step_weight, cfg=cfg_loss))

        plain_fn = partial(grpo_micro_batch_loss, cfg=GRPOLossConfig())
        # 1. Below the threshold (batch 0.5 < 0.6, although micro-batch 1 is at 0.9): the full step.
        b1 = _with_behavior(lag_batch, learner.forward_logprobs(lag_batch["tokens"]), LAG_OFFSETS)
        learner.forward_backward(b1, plain_fn)
        g_plain = _grads(module)
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        res["below"] = lag_step(b1, lag_threshold=0.6)
        res["below_grad_diff"] = max((p.main_grad - g_plain[n]).abs().max().item()
                                     for n, p in module.named_parameters())
        res["below_moved"] = max((p.detach() - before[n]).abs().max().item() for n, p in module.named_parameters())
        # 2. Above (0.5 > 0.4, although micro-batch 0 is at 0.1): quarantined, nothing moves.
        b2 = _with_behavior(lag_batch, learner.forward_logprobs(lag_batch["tokens"]), LAG_OFFSETS)
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        adam_before, sched_before = _adam_state(learner), learner.scheduler.state_dict()
        res["above"] = lag_step(b2, lag_threshold=0.4)
        res["above_moved"] = max((p.detach() - before[n]).abs().max().item() for n, p in module.named_parameters())
        adam_after = _adam_state(learner)
        res["adam_entries"] = len(adam_before)
        res["adam_unchanged"] = len(adam_before) == len(adam_after) and all(
            a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
            for a, b in zip(adam_before, adam_after))
        res["sched_unchanged"] = learner.scheduler.state_dict() == sched_before
        # 3. Downweight: the reduced gradient is scaled by 0.25 / 0.5 before the step.
        learner.forward_backward(b2, plain_fn)
        g2 = _grads(module)
        res["down"] = lag_step(b2, lag_threshold=0.25, lag_action="downweight")
        res["down_grad_diff"] = max((p.main_grad - 0.5 * g2[n]).abs().max().item()
                                    for n, p in module.named_parameters())
        res["g2_max"] = max(g.abs().max().item() for g in g2.values())
        res["learner_step"] = learner.step
        learner.close()
        out[tp] = res
    return out


@pytest.fixture(scope="module")
def runs():
    seq_batch = _batch([[7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20]], ["5", None, "1", "x"])
    lag_batch = _batch([[7, 8, 9], [10, 11, 12], [13, 14, 15], [16, 17, 18]], ["5", "1", "5", "x"])
    return run_distributed(_work, 2, seq_batch, lag_batch, timeout=900)


def test_batch_layout_has_a_masked_row_in_a_micro_batch_of_two():
    batch = _batch([[7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18, 19, 20]], ["5", None, "1", "x"])
    assert batch["loss_mask"].sum(dim=1).tolist() == [2, 0, 5, 4]
    assert batch["token_denominator"] == pytest.approx(11 / 2)
    assert batch["sequence_denominator"] == pytest.approx(3 / 2)


@pytest.mark.parametrize("aggregation", ["sequence", "token"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1dp2", "tp2dp1"])
def test_gradient_equals_documented_batch_formula(runs, aggregation, tp):
    for rank, out in enumerate(runs):
        res = out[tp]
        assert res["dp"] == 2 // tp
        assert res["grad_max"][aggregation] > 1e-3, "the reference gradient must not be trivial"
        assert res["grad_diff"][aggregation] < 1e-6, (rank, res["grad_diff"])


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1dp2", "tp2dp1"])
def test_lag_guard_acts_on_the_batch(runs, tp):
    for rank, out in enumerate(runs):
        res = out[tp]
        below, above, down = res["below"], res["above"], res["down"]
        for m in (below, above, down):
            assert m["d_lag"] == pytest.approx(0.5, abs=1e-6)
            assert m["d_lag/p50"] == pytest.approx(0.5, abs=1e-6)  # sequences at 0.1, 0.1, 0.9, 0.9
            assert m["d_lag/p99"] == pytest.approx(0.9, abs=1e-6)
        # Under the threshold: the whole batch's gradient is applied.
        assert below["lag_weight"] == 1.0 and below["lag_quarantined"] == 0.0 and below["update_successful"] == 1.0
        assert res["below_grad_diff"] < 1e-7 and res["below_moved"] > 1e-4
        # Over it: no update at all, no optimizer or schedule state change.
        assert above["lag_quarantined"] == 1.0 and above["update_successful"] == 0.0 and above["grad_norm"] == 0.0
        assert res["above_moved"] == 0.0
        assert res["adam_entries"] > 0 and res["adam_unchanged"] and res["sched_unchanged"]
        # Down-weighted: the gradient handed to Adam is scaled by threshold / D_lag.
        assert down["lag_weight"] == pytest.approx(0.5, abs=1e-6) and down["update_successful"] == 1.0
        assert res["g2_max"] > 1e-3 and res["down_grad_diff"] < 1e-7
        assert res["learner_step"] == 3  # train_step calls, quarantined included
