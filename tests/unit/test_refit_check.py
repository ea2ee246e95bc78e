"""The refit check's rule by serving dtype, on sampled tokens (rollout/refit_check.py; issue 31, item 3).

    python -m pytest tests/unit/test_refit_check.py -q

Two implementations of one model in bf16 disagree in the last bits; here the engine side is the
`small` random qwen2 run in bf16 and the learner side the same weights in fp32 (a larger gap than
two bf16 kernels, so a bound that passes it is not tight).  The LM head is scaled x4 so the logits
span a trained model's range (sampled tokens near log p -1, random ones near -20), which is where
the old rule (mean |Δ| <= 0.05 over uniformly random tokens) refuses a correct bf16 load.  A load
with one permuted matrix must still be refused at the bf16 bound.
"""

import copy

import pytest
import torch

from megatron_rl.rollout.refit_check import FLOOR, probe_verdict, refit_tolerance, sampled_probe

SMALL_LAYERS = 8  # the `small` preset's depth

pytestmark = pytest.mark.unit


def test_the_tolerance_follows_the_serving_dtype_and_the_depth():
    assert refit_tolerance("float32", "auto") == refit_tolerance("float32", "auto", 80) == FLOOR == 0.05
    # bf16: 0.08 nat per layer, twice the worst correct load measured (benchmarks/refit_probe_bf16.md)
    assert refit_tolerance("bfloat16", "auto", 24) == pytest.approx(1.92)
    assert refit_tolerance("torch.bfloat16", "auto", 28) == pytest.approx(2.24)  # Qwen2.5-1.5B's depth
    assert refit_tolerance("bfloat16", "auto", 2) == pytest.approx(0.16)
    assert refit_tolerance("bfloat16", "auto") == pytest.approx(0.08)
    assert refit_tolerance("float16", "auto", 24) == pytest.approx(0.24)
    assert refit_tolerance("float16", "auto", 2) == FLOOR
    assert refit_tolerance("bfloat16", 0.1, 24) == 0.1 and refit_tolerance("float32", None) is None
    with pytest.raises(ValueError, match="run.refit_tolerance"):
        refit_tolerance("float8", "auto")
    with pytest.raises(ValueError, match="0 layers"):
        refit_tolerance("bfloat16", "auto", 0)


def test_the_median_ignores_a_few_tail_tokens_and_not_a_wrong_load():
    learner = [[-1.0] * 15 for _ in range(4)]
    noisy = [[None] + [-1.02] * 15 for _ in range(4)]
    noisy[0][3] = noisy[2][9] = -4.0  # two tail tokens far off: the mean is 0.12, the median 0.02
    stats, problem = probe_verdict(noisy, learner, 0.05)
    assert problem is None and stats["median"] == pytest.approx(0.02) and stats["mean"] > 0.05
    wrong = [[None] + [-3.0] * 15 for _ in range(4)]
    stats, problem = probe_verdict(wrong, learner, 0.25)
    assert "median |Δ| 2 > tolerance 0.25 over 60 tokens" in problem
    assert probe_verdict([[None]], [[]], 0.25)[1] == "refit check: the probe compared no token"
    _, nan = probe_verdict([[None, float("nan")]], [[-1.0]], 0.25)
    assert nan is not None


def test_probe_rows_come_from_sampled_sequences_cut_to_one_length():
    rows = sampled_probe([[5, 6, 7, 8], [9], [1, 2, 3]], rows=4, max_len=64)
    assert rows == [[6, 7, 8], [1, 2, 3], [6, 7, 8], [1, 2, 3]]  # the ends: the sampled responses
    assert sampled_probe([[1]], rows=2) is None
    assert sampled_probe([list(range(100))], rows=1, max_len=64)[0] == list(range(36, 100))


def _logprobs(model, tokens):
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T-1]


@pytest.fixture(scope="module")
def models():
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.tiny import build_config

    torch.manual_seed(0)
    cfg = build_config("qwen2", "small")
    fp32 = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        fp32.lm_head.weight.mul_(4.0)  # a trained model's logit range
    bf16 = copy.deepcopy(fp32)
    permuted = copy.deepcopy(fp32)
    with torch.no_grad():
        down = permuted.model.layers[0].mlp.down_proj.weight
        down.copy_(down.flip(0))
    g = torch.Generator().manual_seed(1)
    random_bt = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    sampled_bt = random_bt[:, :4].clone()
    with torch.no_grad():
        for _ in range(12):
            probs = torch.softmax(fp32(sampled_bt).logits[:, -1].float(), -1)
            sampled_bt = torch.cat([sampled_bt, torch.multinomial(probs, 1, generator=g)], 1)
    return fp32, bf16.to(torch.bfloat16), permuted.to(torch.bfloat16), random_bt, sampled_bt


def _engine_rows(lps_bt):
    """The engine's answer as RolloutWorker.score gives it: per row [None, lp_1, ...]."""
    return [[None, *row] for row in lps_bt.tolist()]


def test_a_correct_bf16_load_passes_on_sampled_tokens_where_the_old_rule_refused_it(models):
    fp32, bf16, _, random_bt, sampled_bt = models
    learner_random, engine_random = _logprobs(fp32, random_bt), _logprobs(bf16, random_bt)
    old_rule = (learner_random - engine_random).abs().mean().item()  # main: mean over random tokens <= 0.05
    assert old_rule > 0.05
    stats, problem = probe_verdict(_engine_rows(_logprobs(bf16, sampled_bt)), _logprobs(fp32, sampled_bt).tolist(),
                                   refit_tolerance("bfloat16", "auto", SMALL_LAYERS))
    assert problem is None, stats
    assert stats["median"] < refit_tolerance("bfloat16", "auto", SMALL_LAYERS) / 2, stats  # a margin of 2 at least


def test_a_permuted_load_is_refused_at_the_bf16_bound(models):
    fp32, _, permuted, _, sampled_bt = models
    stats, problem = probe_verdict(_engine_rows(_logprobs(permuted, sampled_bt)),
                                   _logprobs(fp32, sampled_bt).tolist(),
                                   refit_tolerance("bfloat16", "auto", SMALL_LAYERS))
    assert problem is not None and stats["median"] > 1.0, stats


def test_float32_keeps_its_bound_and_refuses_a_permuted_load(models):
    fp32, _, permuted, _, sampled_bt = models
    learner = _logprobs(fp32, sampled_bt).tolist()
    assert probe_verdict(_engine_rows(_logprobs(fp32, sampled_bt)), learner, refit_tolerance("float32", "auto"))[1] \
        is None
    wrong = _logprobs(permuted.float(), sampled_bt)
    assert probe_verdict(_engine_rows(wrong), learner, refit_tolerance("float32", "auto"))[1] is not None
