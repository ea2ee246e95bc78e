"""Tensor- and expert-parallel MoE learners take the step one TP1/EP1 process takes (Qwen3-MoE, fp32).

    python -m pytest tests/dist/test_moe_parallel_equivalence.py -q

One launch of 4 gloo processes builds the tiny random Qwen3-MoE (8 experts, top-2, renormalised)
at EP1 with the same seed everywhere and takes one plain-torch step on the whole batch
(clip_grad_norm_ + AdamW, Megatron's no-decay rule for 1-D weights).  Then for each layout
(TP, PP, EP) on 4 ranks (DP = 4 / (TP x PP), EP splitting it) a Learner loads the matching
parameters by canonical name (experts by their global index) and takes one step
(distributed optimizer): per-token logprobs, loss and grad norm, and every updated weight it holds,
must equal the reference within 1e-5.  At TP 2 the learner runs sequence parallel (Megatron's
condition for training MoE at TP > 1; on CPU through platform.cpu_compat item 7), and the 13-token
rows are padded to 14 to split over the two ranks.
"""

import pytest
import torch

from megatron_rl.platform.spawn import run_distributed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUTS = [(1, 1, 2), (1, 1, 4), (1, 2, 2), (2, 1, 1), (2, 1, 2), (2, 2, 1)]  # (tp, pp, ep) on 4 ranks
OPT = dict(lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-6, clip_grad=1.0)
SEED = 7


def _config():
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.tiny import build_config

    return load_hf_config(build_config("qwen3_moe", "tiny").to_dict())


def _tokens(vocab: int):
    return torch.randint(3, vocab, (4, 13), generator=torch.Generator().manual_seed(3))


def _nll(logprobs_bt, mb):
    return -logprobs_bt.mean(), {"tokens": float(logprobs_bt.numel())}


def _reference(cfg, platform, tokens):
    """TP1/EP1 in plain torch: canonical weights before and after one clipped AdamW step."""
    from megatron_rl.conversion.model_io import canonical_params
    from megatron_rl.learner import token_logprobs
    from megatron_rl.models.builder import build_gpt_model

    model = build_gpt_model(cfg, platform=platform, tp=1, pp=1)
    full = {k: v.detach().clone() for k, v in canonical_params(model).items()}
    logits = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), attention_mask=None)
    logprobs = token_logprobs(logits, tokens, cfg.vocab_size)
    loss = -logprobs.mean()
    loss.backward()
    named = list(model.named_parameters())
    grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in named], OPT["clip_grad"])
    decay = [p for n, p in named if p.dim() > 1 and not n.endswith(".bias")]
    no_decay = [p for n, p in named if not (p.dim() > 1 and not n.endswith(".bias"))]
    torch.optim.AdamW([{"params": decay, "weight_decay": OPT["weight_decay"]},
                       {"params": no_decay, "weight_decay": 0.0}],
                      lr=OPT["lr"], betas=(OPT["adam_beta1"], OPT["adam_beta2"]), eps=OPT["adam_eps"]).step()
    updated = {k: v.detach().clone() for k, v in canonical_params(model).items()}
    return full, {"logprobs": logprobs.detach(), "loss": loss.item(), "grad_norm": grad_norm.item(),
                  "updated": updated}


def _shard(name, full, vocab_rows):
    """This TP rank's slice of a canonical full tensor (vocabulary rows zero-padded as Megatron pads)."""
    from megatron.core import parallel_state as ps

    from megatron_rl.conversion import mapping

    if name in (mapping.EMBED, mapping.OUTPUT) and full.shape[0] < vocab_rows:
        full = torch.cat([full, full.new_zeros(vocab_rows - full.shape[0], *full.shape[1:])])
    return mapping.tp_shard(name, full, ps.get_tensor_model_parallel_world_size(),
                            ps.get_tensor_model_parallel_rank())


def _equivalence(rank, world):
    from megatron_rl.conversion.model_io import canonical_params
    from megatron_rl.models.hf_config import padded_vocab_size
    from megatron_rl.learner import Learner, LearnerConfig
    from megatron_rl.platform import detect_platform
    from megatron_rl.platform.parallel import parallel_scope

    cfg, platform = _config(), detect_platform("cpu")
    tokens = _tokens(cfg.vocab_size)
    with parallel_scope(tp=1, pp=1, seed=SEED):
        full, ref = _reference(cfg, platform, tokens)
    out = {"ref": {k: v for k, v in ref.items() if k != "updated"}, "layouts": {}}
    for tp, pp, ep in LAYOUTS:
        learner = Learner(LearnerConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        expert_parallel_size=ep, micro_batch_size=1,
                                        global_batch_size=4, seed=SEED, use_distributed_optimizer=True, **OPT),
                          cfg, platform)
        params = canonical_params(learner.model[0].module)
        rows = padded_vocab_size(cfg.vocab_size, tp)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(_shard(name, full[name], rows))
        learner.optimizer.reload_model_params()  # the distributed optimizer keeps its own fp32 copy
        result = {"logprobs": learner.forward_logprobs(tokens)}
        metrics = learner.train_step({"tokens": tokens}, _nll)
        result.update(loss=metrics["loss"], grad_norm=metrics["grad_norm"], n_weights=len(params),
                      n_experts=sum(n.endswith("linear_fc2.weight") and "local_experts" in n for n in params),
                      max_weight_diff=max((p - _shard(n, ref["updated"][n], rows)).abs().max().item()
                                            for n, p in params.items()))
        learner.close()
        out["layouts"][(tp, pp, ep)] = result
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_equivalence, 4, timeout=600)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"tp{l[0]}pp{l[1]}ep{l[2]}")
def test_moe_optimizer_step_matches_ep1(runs, layout):
    ref = runs[0]["ref"]
    assert ref["grad_norm"] > OPT["clip_grad"], "the reference step must actually clip"
    tp, pp, ep = layout
    for rank, out in enumerate(runs):
        got = out["layouts"][layout]
        assert got["n_experts"] == 2 // pp * 8 // ep  # this rank holds only its experts of its layers
        torch.testing.assert_close(got["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert got["max_weight_diff"] < 1e-5, f"rank {rank} layout {layout}: {got['max_weight_diff']}"
