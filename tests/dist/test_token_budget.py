"""Token-budget micro-batches through the real Megatron learner equal the padded single batch.

    python -m pytest tests/dist/test_token_budget.py -q

One launch of 2 gloo processes runs the same tiny Llama at TP1 x DP2, TP2 x DP1 and PP2 x DP1
with `max_tokens_per_micro_batch` set so that the B=8 rows of long-tailed length (one verifier
error masking a row) fall into micro-batches of unequal row counts and widths.  Against one
plain-torch TP1 forward/backward of the whole [B, T] padded batch:
  * GRPO gradients (DDP's reduced main_grad) and the reported loss, "token" and "sequence"
    aggregation, within 1e-6;
  * the SFT loss (mean NLL over the batch's target tokens): gradients and loss within 1e-6;
  * forward_logprobs with lengths: the same logprobs at every real position, in the rows'
    original order (0 past a row's end); per-sequence statistics come back at their rows; and with fixed
    micro-batches of 4 rows, a forward of 2 rows (fewer than 4 x DP: an audit of a few sequences).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed
from tests.dist.grpo_reference import documented_loss, one_group_batch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 101, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
SEED = 5
LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (tp, pp) on 2 ranks: dp = 2, 1, 1
BUDGET = 24  # tokens per micro-batch: lengths 4..23 give micro-batches of 1 to 4 rows
RESPONSES = [[7, 8], [9, 10, 11], [12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24],
             [25, 26], [27, 28, 29, 30], [31, 32, 33], list(range(34, 54))]
TEXTS = ["5", None, "1", "x", "5", "5", "2", "x"]  # None: the verifier timed out (row masked)
OFFSETS = (0.05, 0.03, -0.04, 0.02, -0.03, 0.04, 0.01, -0.02)  # μ = π_θ ± offset (alternating)


def _batch() -> dict:
    return one_group_batch(RESPONSES, TEXTS, micro_batch_size=1)


def _sft_loss(logprobs_bt, batch):
    m = batch["loss_mask"]
    return -(logprobs_bt * m).sum() / m.sum()


def _work(rank, world, batch):
    from megatron.core import parallel_state as ps

    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.learner import Learner, LearnerConfig, token_logprobs
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope
    from megatron_rl.models.reshard import load_shard, shard_state_dict
    from megatron_rl.grpo.micro_loss import grpo_micro_batch_loss
    from megatron_rl.learner.sft_loss import sft_micro_batch_loss

    cfg, platform = load_hf_config(TINY), detect_platform("cpu")
    tokens = batch["tokens"]
    ref = {"grads": {}, "loss": {}}
    with parallel_scope(tp=1, pp=1, seed=SEED):
        model = build_gpt_model(cfg, platform=platform, tp=1, pp=1)
        full = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        for what in ("sequence", "token", "sft"):
            model.zero_grad()
            logprobs = token_logprobs(model(tokens, pos, attention_mask=None), tokens, cfg.vocab_size)
            if what == "sequence":
                t = logprobs.shape[1]
                sign = torch.tensor([(-1.0) ** j for j in range(t)])
                batch = dict(batch, behavior_logprobs=(logprobs.detach() - torch.tensor(OFFSETS)[:, None] * sign))
                ref["logprobs"] = logprobs.detach().clone()
            loss = _sft_loss(logprobs, batch) if what == "sft" else documented_loss(logprobs, batch, what)
            loss.backward()
            ref["loss"][what] = loss.item()
            ref["grads"][what] = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                                  for n, p in model.named_parameters()}
    out = {"ref_logprobs": ref["logprobs"], "ref_loss": ref["loss"], "layouts": {}}
    for tp, pp in LAYOUTS:
        learner = Learner(LearnerConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        micro_batch_size=1, global_batch_size=8, max_tokens_per_micro_batch=BUDGET,
                                        seed=SEED, use_distributed_optimizer=False, lr=1e-2, clip_grad=0.0), cfg,
                          platform)
        module = learner.model[0].module
        where = dict(tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), pp=pp,
                     pp_rank=ps.get_pipeline_model_parallel_rank(), num_layers=cfg.num_layers,
                     tie_word_embeddings=cfg.tie_word_embeddings, vocab_size=cfg.vocab_size)
        load_shard(module, full, **where)
        learner.optimizer.reload_model_params()
        plan = learner._plan(batch)
        res = {"dp": learner.dp, "plan": [[(list(r), w) for r, w in rk] for rk in plan.ranks],
               "grad_diff": {}, "grad_max": {}, "loss": {}}
        res["logprobs"] = learner.forward_logprobs(tokens, batch["lengths"])
        budget, learner.cfg = learner.cfg, dataclasses.replace(learner.cfg, max_tokens_per_micro_batch=None,
                                                               micro_batch_size=4)
        res["few"] = learner.forward_logprobs(tokens[:2], batch["lengths"][:2])  # fewer rows than 4 x DP
        learner.cfg = budget
        for what in ("sequence", "token", "sft"):
            loss_fn = sft_micro_batch_loss if what == "sft" else partial(
                grpo_micro_batch_loss, cfg=GRPOLossConfig(aggregation=what))
            stats = learner.forward_backward(batch, loss_fn)
            res["loss"][what] = stats["loss"]
            if what == "token":
                res["seq_tokens"] = stats["seq_tokens"]
                res["padding_fraction"] = stats["padding_fraction"]
            got = {n: p.main_grad.detach().clone() for n, p in module.named_parameters()}
            want = shard_state_dict(ref["grads"][what], **where)
            res["grad_diff"][what] = max((got[n] - want[n]).abs().max().item() for n in got)
            res["grad_max"][what] = max(want[n].abs().max().item() for n in got)
        learner.close()
        out["layouts"][(tp, pp)] = res
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_work, 2, _batch(), timeout=900)


def _ids(layout):
    return f"tp{layout[0]}pp{layout[1]}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_split_is_uneven_and_the_same_count_on_every_rank(runs, layout):
    batch = _batch()
    lengths = batch["lengths"].tolist()
    plans = [out["layouts"][layout]["plan"] for out in runs]
    assert all(p == plans[0] for p in plans), "every rank must compute the same plan"
    plan = plans[0]
    assert len({len(rank) for rank in plan}) == 1  # the same K_local on every data-parallel rank
    micro = [mb for rank in plan for mb in rank]
    assert sorted(i for rows, _ in micro for i in rows) == list(range(8))
    assert len({len(rows) for rows, _ in micro}) > 1 and len({w for _, w in micro}) > 1  # uneven
    for rows, width in micro:
        assert width == max(lengths[i] for i in rows)
        assert len(rows) == 1 or len(rows) * width <= BUDGET
    grid = sum(len(rows) * w for rows, w in micro)
    for out in runs:
        assert out["layouts"][layout]["padding_fraction"] == pytest.approx(1 - sum(lengths) / grid)
        assert out["layouts"][layout]["padding_fraction"] < 1 - sum(lengths) / (8 * max(lengths))


@pytest.mark.parametrize("what", ["sequence", "token", "sft"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_gradient_and_loss_equal_the_padded_batch(runs, layout, what):
    for rank, out in enumerate(runs):
        res = out["layouts"][layout]
        assert res["grad_max"][what] > 1e-3, "the reference gradient must not be trivial"
        assert res["grad_diff"][what] < 1e-6, (rank, layout, what, res["grad_diff"])
        assert res["loss"][what] == pytest.approx(out["ref_loss"][what], abs=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_logprobs_and_per_sequence_stats_come_back_in_row_order(runs, layout):
    batch = _batch()
    lengths, mask = batch["lengths"], batch["loss_mask"]
    for out in runs:
        res, want = out["layouts"][layout], out["ref_logprobs"]
        got = res["logprobs"]
        assert got.shape == want.shape
        real = torch.arange(want.shape[1])[None, :] < (lengths[:, None] - 1)
        assert (got - want).abs()[real].max().item() < 1e-6
        assert torch.all(got[~real] == 0)
        assert res["seq_tokens"] == mask.sum(dim=1).tolist()
        few = res["few"]  # fixed micro-batches, 2 rows: one micro-batch of 2 // DP rows per rank, not 4 x DP rows
        assert few.shape == (2, want.shape[1]) and (few - want[:2]).abs()[real[:2]].max().item() < 1e-6
