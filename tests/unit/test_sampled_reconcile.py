"""Truncated sampling keeps a check on sampled tokens (train/probe.py, train/policy.py; issue 31, item 9).

    python -m pytest tests/unit/test_sampled_reconcile.py -q

On GPU vLLM samples top-k/top-p through its own kernels; the learner reproduces PyTorch semantics
(learner/logprobs.py).  Before, the refit probe was skipped exactly for such runs and nothing
compared the two.  Here: the refit probe runs at top_p 0.9 on sampled tokens scored raw, and the
reconcile compares the learner's truncated logprobs of on-policy sampled tokens with the engine's,
passing when the engine samples the learner's distribution and flagging an engine whose
truncation differs.  The "model" is a bigram table; the learner's semantics are truncation_keep_mask.
"""

from types import SimpleNamespace

import pytest
import torch

from megatron_rl.learner.config import SamplingConfig
from megatron_rl.learner.logprobs import truncation_keep_mask
from megatron_rl.train.probe import on_policy, probe_sequences, reconcile_sampled

pytestmark = pytest.mark.unit

V = 16
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 1.5  # next-token logits by previous token


def _logprobs(tokens_bt, sampling, truncate=True):
    """log p(tokens[:, t+1] | tokens[:, t]) under `sampling`: [B, T] -> [B, T-1] (the learner's rule)."""
    logits = TABLE[tokens_bt[:, :-1]] / sampling.temperature  # [B, T-1, V]
    if truncate and sampling.truncates:
        keep = truncation_keep_mask(logits.reshape(-1, V), sampling).reshape(logits.shape)
        logits = logits.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(logits, -1).gather(-1, tokens_bt[:, 1:, None])[..., 0]


def _trajectories(sampling, version, n=6, engine_truncates=True):
    """n sampled trajectories (prompt 3 tokens, response 8) at `version`; the engine's behavior
    logprobs come from its own rule (the learner's, or one that ignores the truncation)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        seq = torch.randint(0, V, (1, 3), generator=g)
        for _ in range(8):
            logits = TABLE[seq[:, -1]] / sampling.temperature
            if sampling.truncates:
                logits = logits.masked_fill(~truncation_keep_mask(logits, sampling), float("-inf"))
            seq = torch.cat([seq, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)], 1)
        behavior = _logprobs(seq, sampling, truncate=engine_truncates)[0, 2:]
        out.append(SimpleNamespace(prompt_tokens=seq[0, :3].numpy(), response_tokens=seq[0, 3:].numpy(),
                                   policy_versions=[version] * 8, action_mask=[1] * 8,
                                   behavior_logprobs=behavior.numpy()))
    return out


def _learner(sampling):
    calls = []

    def forward(tokens_bt, lengths_b=None, raw=False):
        calls.append({"rows": tokens_bt.shape[0], "lengths": lengths_b, "raw": raw})
        lps = _logprobs(tokens_bt, SamplingConfig() if raw else sampling)
        if lengths_b is not None:
            lps = lps.masked_fill(torch.arange(lps.shape[1])[None, :] >= lengths_b[:, None] - 1, 0.0)
        return lps
    return forward, calls


TOP_P = SamplingConfig(temperature=0.7, top_p=0.9)


def test_the_reconcile_passes_when_the_engine_samples_the_learners_distribution():
    forward, calls = _learner(TOP_P)
    stats = reconcile_sampled(forward, _trajectories(TOP_P, 3), 3, rows=4, tolerance=0.05)
    assert stats["numerics/reconcile_tokens"] == 32 and stats["numerics/reconcile_max_abs"] < 1e-5
    assert stats["numerics/reconcile_over_tolerance"] == 0.0 and calls[0]["rows"] == 4


def test_the_reconcile_flags_an_engine_whose_truncation_differs(caplog):
    top_p_half = SamplingConfig(top_p=0.5)
    forward, _ = _learner(top_p_half)
    stats = reconcile_sampled(forward, _trajectories(top_p_half, 3, engine_truncates=False), 3, rows=4,
                              tolerance=0.25)
    assert stats["numerics/reconcile_median_abs"] > 0.25 and stats["numerics/reconcile_over_tolerance"] == 1.0
    assert "another distribution than the learner scores" in caplog.text


def test_only_on_policy_trajectories_are_reconciled():
    trajs = _trajectories(TOP_P, 2)
    trajs[0].policy_versions = [1] * 4 + [2] * 4  # sampled across a publication: off-policy for version 2
    assert len(on_policy(trajs, 2)) == 5 and on_policy(trajs, 3) == []
    forward, calls = _learner(TOP_P)
    assert reconcile_sampled(forward, trajs, 3, rows=4, tolerance=0.05) == {} and calls == []


class _Fleet:
    cfg = SimpleNamespace(publish_timeout_s=5.0)
    workers = ()

    def __init__(self):
        self.probes = []

    def set_refitter(self, refitter):
        pass

    def expect_probe(self, version, sequences, logprobs, tolerance):
        self.probes.append((version, sequences, logprobs, tolerance))


def test_the_refit_probe_runs_at_top_p_on_sampled_tokens_scored_raw():
    """Before: skipped whenever temperature, top-p or top-k transformed the distribution."""
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.ranks.weights import PublishSettings
    from megatron_rl.train.policy import Policy, PolicySettings

    forward, calls = _learner(TOP_P)
    learner = SimpleNamespace(forward_logprobs=forward, connect_rollout=lambda *a: None)
    fleet = _Fleet()
    settings = PolicySettings(loss=GRPOLossConfig(), sampling=TOP_P, micro_batch_size=2, probe_rows=2,
                              refit_tolerance="auto", vocab_size=V, pad_id=0)
    policy = Policy(learner, fleet, settings, PublishSettings())
    policy.probe_rows = probe_sequences(_trajectories(TOP_P, 1), rows=2)
    policy._expect_probe(2)
    ((version, seqs, lps, tol),) = fleet.probes
    assert version == 2 and tol == "auto" and calls[-1]["raw"] is True
    assert seqs == policy.probe_rows and len(seqs[0]) == 11  # prompt + response of sampled trajectories
    assert torch.allclose(torch.tensor(lps), _logprobs(torch.tensor(seqs), SamplingConfig()))


@pytest.mark.parametrize("micro_batch_size,dp,forwarded", [(16, 1, 4), (8, 2, 4), (2, 3, 6), (1, 2, 2)])
def test_the_learner_forwards_only_the_probe_rows_the_engines_check(micro_batch_size, dp, forwarded):
    """The engines score the first ENGINE_PROBE_ROWS rows; the learner forwards those (rounded up to its
    data-parallel size, never more than the probe holds), not a whole micro-batch per rank of them."""
    from megatron_rl.grpo.loss import GRPOLossConfig
    from megatron_rl.ranks.weights import PublishSettings
    from megatron_rl.train.policy import ENGINE_PROBE_ROWS, Policy, PolicySettings

    forwarded_shapes = []

    def forward(tokens_bt, lengths_b=None, raw=False):  # scores row r as r: the test sees which rows came back
        forwarded_shapes.append((tuple(tokens_bt.shape), raw))
        return tokens_bt[:, :1].float().expand(-1, tokens_bt.shape[1] - 1)

    rows = micro_batch_size * dp
    settings = PolicySettings(loss=GRPOLossConfig(), sampling=SamplingConfig(), micro_batch_size=micro_batch_size,
                              probe_rows=rows, refit_tolerance=0.05, vocab_size=64, pad_id=0)
    learner, fleet = SimpleNamespace(forward_logprobs=forward, connect_rollout=lambda *a: None), _Fleet()
    policy = Policy(learner, fleet, settings, PublishSettings())
    policy.probe_rows = [[r, 7, 8, 9] for r in range(rows)]
    policy._expect_probe(3)
    assert forwarded_shapes == [((forwarded, 4), True)]
    (version, sequences, logprobs, tolerance), = fleet.probes
    sent = min(ENGINE_PROBE_ROWS, rows)
    assert (version, tolerance) == (3, 0.05)
    assert sequences == policy.probe_rows[:sent]
    assert logprobs == [[float(r)] * 3 for r in range(sent)]  # each row's own logprobs


def test_the_reconcile_reaches_the_step_metrics():
    import numpy as np

    from megatron_rl.reporting.telemetry import _numerics_metrics

    learn = {"loss": 0.0, "grad_norm": 1.0, "numerics/reconcile_median_abs": 0.01, "numerics/reconcile_tokens": 32.0}
    out = _numerics_metrics(learn, np.zeros(0))
    assert out["numerics/reconcile_median_abs"] == 0.01 and out["numerics/reconcile_tokens"] == 32.0
