"""The audit's rule, its re-score and the learner's weight ring (megatron_rl/audit/), without engines.

    python -m pytest tests/unit/test_audit.py -q

A small torch language model stands in for the learner: `score(version, tokens_bt, lengths_b)` is its
teacher-forced logprobs under that version's weights.  Behaviour logprobs made by the same weights pass;
a segment whose logprobs were made by the previous version's weights (what a KV cache a recompute refit
failed to drop produces) or forged by hand fails, naming the sequence and segment.
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib

import numpy as np
import pytest
import torch

from megatron_rl.audit.compare import AuditReport, segment_deltas
from megatron_rl.audit.config import AuditConfig
from megatron_rl.audit.rescore import audit_trajectories
from megatron_rl.audit.ring import WeightRing
from megatron_rl.config import ConfigError
from megatron_rl.reporting.stop import StopCondition, StopConfig, StopRules
from megatron_rl.trajectory import make_trajectory

pytestmark = pytest.mark.unit

V = 11  # vocabulary


class TinyLM(torch.nn.Module):
    """logits[t] = W[token[t]] + b: enough of a model for teacher-forced logprobs."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=g))
        self.bias = torch.nn.Parameter(torch.randn(V, generator=g))

    def logprobs(self, tokens_bt: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T-1]
        logits = self.table[tokens_bt[:, :-1]] + self.bias
        return torch.log_softmax(logits, -1).gather(-1, tokens_bt[:, 1:, None])[..., 0]


MODELS = {0: TinyLM(0), 1: TinyLM(1), 2: TinyLM(2)}


def score(version, tokens_bt, lengths_b):
    with torch.no_grad():
        return MODELS[version].logprobs(tokens_bt)


def spanning(tid: str, segments, stale_from: int | None = None, forge: float = 0.0):
    """A trajectory whose segments' behaviour logprobs come from their versions' models; `stale_from`: the
    segment at that index scored by the version before it; `forge`: added to its first token's logprob."""
    rng = np.random.default_rng(zlib.crc32(tid.encode()))  # str hash() differs per process (PYTHONHASHSEED)
    prompt, response = rng.integers(0, V, 3).tolist(), rng.integers(0, V, segments[-1][1]).tolist()
    tokens = torch.tensor([prompt + response])
    lps = np.zeros(len(response), np.float32)
    versions = np.zeros(len(response), np.int32)
    for i, (start, end, version, _) in enumerate(segments):
        used = version - 1 if i == stale_from else version
        lps[start:end] = score(used, tokens, None)[0, len(prompt) - 1:][start:end].numpy()
        versions[start:end] = version
    if stale_from is not None:
        lps[segments[stale_from][0]] += forge
    traj = make_trajectory(id=tid, prompt_id="p", dataset_version="d", tokenizer_hash="t", grader_version="g",
                           terminal_reason="length", rollout_started_at=0.0, scored_at=1.0, policy_versions=versions,
                           prompt_tokens=prompt, response_tokens=response, behavior_logprobs=lps,
                           reward_components={"correct": 1.0})
    return _with(traj, segments=[list(s) for s in segments])


def _with(traj, **changes):
    """A copy of `traj` with `changes` and its checksum recomputed (it covers segments and logprobs)."""
    traj = dataclasses.replace(traj, **changes)
    return dataclasses.replace(traj, checksum=traj.compute_checksum())


SEGMENTS = [(0, 4, 0, 0), (4, 9, 1, 1), (9, 12, 2, 1)]  # initial, recompute, keep_kv


def test_behaviour_logprobs_of_the_recorded_versions_pass():
    trajs = [spanning("a", SEGMENTS), spanning("b", SEGMENTS[:2])]
    report = audit_trajectories(trajs, score, versions={0, 1, 2}, rows=4, mode="recompute", tolerance=1e-4)
    assert not report.failures and report.worst is not None and report.worst.max_abs_delta < 1e-5
    assert sorted(report.by_mode()) == ["initial", "keep_kv", "recompute"]
    assert report.metrics()["numerics/audit_over_tolerance"] == 0.0 and report.metrics()["numerics/audit_segments"] == 5


def test_a_segment_scored_by_stale_weights_fails_and_is_named():
    trajs = [spanning("ok", SEGMENTS), spanning("stale", SEGMENTS, stale_from=1)]
    report = audit_trajectories(trajs, score, versions={0, 1, 2}, rows=4, mode="recompute", tolerance=1e-3)
    assert [(r.trajectory_id, r.index, r.mode) for r in report.failures] == [("stale", 1, "recompute")]
    assert "sequence stale segment 1 (tokens [4, 9), version 1" in report.failures[0].describe()
    assert report.metrics()["numerics/audit_over_tolerance"] == 1.0
    assert report.metrics()["numerics/audit_worst_abs_delta"] == report.failures[0].max_abs_delta > 1e-3


def test_a_forged_logprob_fails_even_when_small():
    traj = spanning("forged", SEGMENTS[:2], stale_from=None)
    lps = traj.behavior_logprobs.copy()
    lps[6] -= 0.01
    forged = _with(traj, behavior_logprobs=lps)
    report = audit_trajectories([forged], score, versions={0, 1}, rows=2, mode="recompute", tolerance=1e-3)
    assert [(r.index, round(r.max_abs_delta, 4)) for r in report.failures] == [(1, 0.01)]


def test_keep_kv_segments_are_reported_not_judged_and_missing_versions_unaudited():
    traj = spanning("kv", SEGMENTS, stale_from=2, forge=1.0)  # the keep_kv segment far off: by design
    report = audit_trajectories([traj], score, versions={0, 2}, rows=1, mode="recompute", tolerance=1e-3)
    rows = {r.index: r for r in report.rows}
    assert rows[2].mode == "keep_kv" and not rows[2].judged and rows[2].max_abs_delta > 0.5
    assert rows[1].max_abs_delta is None and report.unaudited == [rows[1]]  # version 1 not available
    assert not report.failures and report.metrics()["numerics/audit_unaudited_segments"] == 1.0


def test_a_nan_rescore_fails():
    traj = spanning("nan", SEGMENTS[:2])
    rows = segment_deltas(traj, {0: traj.behavior_logprobs, 1: np.full(9, np.nan)}, "recompute")
    report = AuditReport(rows, tolerance=1.0)
    assert [r.index for r in report.failures] == [1] and math.isnan(report.worst.max_abs_delta)
    assert math.isnan(report.by_mode()["recompute"]["max_abs_delta"])


def test_the_ring_swaps_a_version_in_and_puts_the_live_weights_back():
    model = TinyLM(0)
    ring = WeightRing(capacity=2)
    ring.keep(0, model)
    with torch.no_grad():
        model.table.add_(1.0)
    ring.keep(1, model)
    with torch.no_grad():
        model.table.add_(1.0)  # the live weights: a third state, not kept
    live = model.table.detach().clone()
    with ring.weights_of(0, model):
        assert torch.equal(model.table, TinyLM(0).table)
    assert torch.equal(model.table, live)
    with pytest.raises(RuntimeError, match="boom"), ring.weights_of(1, model):
        raise RuntimeError("boom")
    assert torch.equal(model.table, live)  # restored when the forward raises too
    ring.keep(2, model)
    assert ring.versions == [1, 2] and ring.nbytes == 2 * (V * V + V) * 4
    with pytest.raises(KeyError, match="version 0 is not in the weight ring"):
        with ring.weights_of(0, model):
            pass


def test_config_checks_and_the_ring_size():
    assert AuditConfig().ring_versions(3) == 0 and AuditConfig(every=2).ring_versions(3) == 4
    assert AuditConfig(every=2).due(4) and not AuditConfig(every=2).due(3) and not AuditConfig().due(1)
    for bad in ({"every": -1}, {"sequences": 0}, {"tolerance": 0}, {"tolerance": float("nan")}):
        with pytest.raises(ConfigError, match="audit."):
            AuditConfig(**bad)


def test_a_failed_audit_is_a_stop_condition_with_its_own_exit_code():
    rules = StopRules(StopConfig())
    condition = StopCondition("audit", 4, "numerics/audit_worst_abs_delta", 0.3, "> audit.tolerance 0.001 on sequence x")
    assert rules.hold(condition) is condition and rules.triggered.exit_code == 89
    assert json.loads(json.dumps(condition.to_dict()))["stopped"] == "audit"


def test_plan_counts_the_weight_ring_in_host_memory():
    from pathlib import Path

    from megatron_rl.plan_cli import plan_for_config
    from megatron_rl.train.config import load_train_config

    recipe = Path(__file__).resolve().parents[2] / "configs" / "qwen2_7b_8gpu_colocated.yaml"  # TP4 x DP2, bf16
    off = plan_for_config(load_train_config(recipe, []))["resume_host_gib_per_node"]
    plan = plan_for_config(load_train_config(recipe, ["audit.every=5"]))
    host = plan["resume_host_gib_per_node"]
    # 8 ranks on the node x P / TP 4 x 2 bytes x (2 versions kept: max_version_lag 1 + 1; + 1 set aside)
    assert off["audit_ring"] == 0 and host["audit_ring"] == pytest.approx(8 * plan["model_params"] / 4 * 2 * 3 / 2**30)
    assert host["total"] == pytest.approx(off["total"] + host["audit_ring"])


@pytest.mark.parametrize("recipe,mode", [("tiny_cpu_lora.yaml", "adapter"), ("tiny_cpu_scratch.yaml", "recompute")])
def test_the_offline_audit_labels_a_runs_segments_with_the_mode_its_engines_used(tmp_path, capsys, recipe, mode):
    """`megatron-rl audit` names the refit mode the engines used (rollout.refit_mode): a LoRA run's later
    segments begin at an adapter switch, not at the configured rollout.inflight_refit."""
    import json
    from pathlib import Path

    from megatron_rl.cli import main
    from megatron_rl.train.config import load_train_config, resolved_dict

    run = tmp_path / "run"
    run.mkdir()
    cfg = load_train_config(Path(__file__).resolve().parents[2] / "configs" / recipe, [f"run.dir={run}"])
    (run / "config.json").write_text(json.dumps(resolved_dict(cfg)))
    assert main(["audit", str(run)]) == 0  # a run that kept nothing spanning versions: nothing to audit
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["mode"] == mode and summary["audited_sequences"] == 0


@pytest.mark.parametrize("overrides,every", [
    (["rollout.streaming=true"], 20),  # recompute refits keep requests: tokens can span versions
    (["rollout.streaming=true", "rollout.inflight_refit=keep_kv"], 20),
    (["rollout.streaming=true", "rollout.inflight_refit=wait"], 0),  # requests finish on the old weights first
    ([], 0),  # rounds: one version per round
    (["rollout.streaming=true", "learner.lora.enabled=true"], 0),  # a request keeps its adapter to its end
    (["rollout.streaming=true", "audit.every=3"], 3), (["rollout.streaming=true", "audit.every=0"], 0),  # as set
])
def test_the_audit_is_on_by_default_where_a_sequence_can_span_versions(overrides, every):
    from pathlib import Path

    from megatron_rl.audit.config import DEFAULT_EVERY
    from megatron_rl.train.config import load_train_config

    recipe = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu_scratch.yaml"
    cfg = load_train_config(recipe, ["run.mode=async", *overrides])
    assert cfg.audit.every == every and DEFAULT_EVERY == 20
    assert cfg.audit.ring_versions(cfg.coordinator.max_version_lag) == (cfg.coordinator.max_version_lag + 1 if every
                                                                        else 0)
    with pytest.raises(ConfigError, match="audit.every must be an int >= 0"):
        AuditConfig(every=-1)


def test_a_few_sequences_are_padded_to_the_data_parallel_multiple_not_to_the_full_rows():
    # The in-training audit of 1-3 sequences used to compute a whole micro-batch x DP of rows.
    shapes = []

    def recording(version, tokens_bt, lengths_b):
        shapes.append((version, tokens_bt.shape[0]))
        return score(version, tokens_bt, lengths_b)

    trajs = [spanning(t, SEGMENTS[:2]) for t in "abc"] + [spanning("d", [(0, 5, 1, 1)])]
    padded = audit_trajectories(trajs, recording, versions={0, 1}, rows=8, multiple=2, mode="recompute",
                                tolerance=1e-4)
    assert shapes == [(0, 4), (1, 4)]  # 3 sequences name version 0, 4 name version 1: each padded to 2's multiple
    shapes.clear()
    full = audit_trajectories(trajs, recording, versions={0, 1}, rows=8, mode="recompute", tolerance=1e-4)
    assert shapes == [(0, 8), (1, 8)]  # no multiple: every call is `rows` rows, as before
    assert [r.max_abs_delta for r in padded.rows] == [r.max_abs_delta for r in full.rows] and not padded.failures
    shapes.clear()
    audit_trajectories(trajs[:1], recording, versions={0, 1}, rows=8, multiple=2, mode="recompute", tolerance=1e-4)
    assert shapes == [(0, 2), (1, 2)]
