"""Re-score a run's sequences offline: a one-rank learner of the run's model, each kept version loaded in turn.

    report = audit_offline(cfg, trajs, weights, mode="recompute", tolerance=1e-3)   # weights: audit/run_dir.py

The re-score runs the learner's own forward (Learner.forward_logprobs under the run's sampling
transform) in this process, on a private one-rank group (conversion/model_io.py run_on_ranks), at the
run's learner dtype and TP = PP = DP = 1; each version's weights are loaded into the same model in turn.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.audit.compare import AuditReport, segment_deltas, spans_versions
from megatron_rl.audit.rescore import audit_trajectories


def audit_offline(cfg, trajs: list, weights: dict[int, Path], *, mode: str, tolerance: float) -> AuditReport:
    """Re-score the multi-segment `trajs` under every version of `weights` their segments name."""
    from megatron_rl.conversion.model_io import run_on_ranks

    spanning = [t for t in trajs if spans_versions(t)]
    needed = {seg[2] for t in spanning for seg in t.segments} & set(weights)
    if not needed:
        return AuditReport([row for t in spanning for row in segment_deltas(t, {}, mode)], tolerance)
    rows = cfg.learner.micro_batch_size
    return run_on_ranks(_audit_on_rank, 1, cfg, spanning, {v: weights[v] for v in needed}, mode, tolerance,
                        rows)[0]


def _audit_on_rank(rank: int, world: int, cfg, trajs: list, weights: dict[int, Path], mode: str,
                   tolerance: float, rows: int) -> AuditReport:
    """On the one-rank group: a learner of the run's model at TP = PP = DP = 1, each version loaded in turn."""
    from megatron_rl.conversion.hf_io import HFCheckpoint
    from megatron_rl.conversion.model_io import fill_from_hf
    from megatron_rl.learner.initial_policy import InitialPolicy
    from megatron_rl.platform import detect_platform

    learner_cfg = dataclasses.replace(cfg.learner, tensor_parallel_size=1, pipeline_parallel_size=1,
                                      data_parallel_size=1, global_batch_size=rows, max_tokens_per_micro_batch=None)
    first = min(weights)
    policy = InitialPolicy.load(learner_cfg, str(weights[first]), detect_platform("cpu", dtype=learner_cfg.dtype),
                                sampling=cfg.sampling)
    loaded = [first]

    def score(version, tokens_bt, lengths_b):
        if loaded[0] != version:
            fill_from_hf(policy.learner.model[0].module, policy.hf_cfg, HFCheckpoint(str(weights[version]),
                         policy.hf_cfg), 0, 1, policy.padded_vocab)
            loaded[0] = version
        return policy.learner.forward_logprobs(tokens_bt, lengths_b)

    try:
        return audit_trajectories(trajs, score, weights, rows=rows, multiple=1, mode=mode, tolerance=tolerance)
    finally:
        policy.learner.close()
