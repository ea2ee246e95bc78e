"""The audit's rule: per segment, max |Δ logprob| between a re-score under the segment's recorded version and
the behaviour logprobs the sampler recorded; which segments are judged; the verdict.

    rows = segment_deltas(traj, {3: lps_r, 4: lps_r}, mode="recompute")   # lps_r: float [R] per version
    report = AuditReport(rows, tolerance=1e-3)
    report.failures, report.worst, report.by_mode(), report.metrics()

A trajectory's `segments` are [start, end, version, kv_version] spans of its response
(megatron_rl/trajectory.py).  Each segment is labelled with how its tokens came to be:
  initial      the first segment: sampled before any refit touched the request (the control: what the
               learner and the engine disagree by with nothing stale anywhere);
  <mode>       a later segment, begun by an in-flight refit of the run's mode (rollout.inflight_refit;
               "adapter" in a LoRA run, rollout/config.py refit_mode)
               (recompute: the kept request's KV was recomputed under the new weights);
  keep_kv      any segment with kv_version < version: it attended to KV older weights computed.
Judged (against the tolerance) are the segments that claim KV of their own version (kv_version ==
version): a teacher-forced re-score under that version must reproduce their behaviour logprobs up to the
numerics of two implementations.  A stale cache that a `recompute` refit failed to drop breaks exactly
that claim.  keep_kv segments are reported, not judged: their Δ is the documented cost of keeping the KV.
A segment whose version has no weights to re-score with is listed as unaudited (max_abs_delta None).
Only action tokens (action_mask 1) are compared; a NaN re-score fails.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np

INITIAL, KEEP_KV = "initial", "keep_kv"


@dataclass(frozen=True)
class SegmentDelta:
    """One segment of one trajectory, and how far the re-score is from its behaviour logprobs."""

    trajectory_id: str
    index: int
    """The segment's position among its trajectory's segments (0 = first)."""
    start: int
    end: int
    version: int
    kv_version: int
    mode: str
    """initial, the refit mode that began it, or keep_kv (module doc)."""
    max_abs_delta: float | None
    """max |Δ logprob| over its action tokens; None when `version`'s weights were not available."""
    tokens: int
    """Action tokens compared."""

    @property
    def judged(self) -> bool:
        return self.max_abs_delta is not None and self.kv_version == self.version and self.tokens > 0

    def describe(self) -> str:
        delta = "unaudited" if self.max_abs_delta is None else f"max |Δ| {self.max_abs_delta:.3g}"
        return (f"sequence {self.trajectory_id} segment {self.index} (tokens [{self.start}, {self.end}), version "
                f"{self.version}, kv_version {self.kv_version}, {self.mode}): {delta}")


def spans_versions(traj) -> bool:
    """A streaming trajectory whose response was sampled by more than one policy version."""
    return len(traj.segments) > 1


def segment_deltas(traj, rescored: Mapping[int, np.ndarray], mode: str) -> list[SegmentDelta]:
    """One row per segment of `traj`; `rescored[v]` is the teacher-forced logprob of every response token
    under version v's weights (float [R]), absent for versions that could not be re-scored."""
    behavior = np.asarray(traj.behavior_logprobs, np.float64)
    action = np.asarray(traj.action_mask, bool)
    rows = []
    for i, (start, end, version, kv_version) in enumerate(traj.segments):
        label = KEEP_KV if kv_version < version else (INITIAL if i == 0 else mode)
        keep = action[start:end]
        delta = None
        if version in rescored:
            got = np.asarray(rescored[version], np.float64)[start:end][keep]
            diff = np.abs(got - behavior[start:end][keep])
            delta = float(np.nan if np.isnan(diff).any() else diff.max()) if diff.size else 0.0
        rows.append(SegmentDelta(traj.id, i, start, end, version, kv_version, label, delta, int(keep.sum())))
    return rows


class AuditReport:
    """The rows of one audit and their verdict against `tolerance`."""

    def __init__(self, rows: Sequence[SegmentDelta], tolerance: float):
        self.rows, self.tolerance = list(rows), tolerance

    @property
    def failures(self) -> list[SegmentDelta]:
        """Judged segments over the tolerance (NaN included), worst first."""
        bad = [r for r in self.rows if r.judged and not r.max_abs_delta <= self.tolerance]
        return sorted(bad, key=lambda r: -r.max_abs_delta if not math.isnan(r.max_abs_delta) else -math.inf)

    @property
    def worst(self) -> SegmentDelta | None:
        """The judged segment furthest from its behaviour logprobs (a NaN one first), or None."""
        judged = [r for r in self.rows if r.judged]
        if not judged:
            return None
        return max(judged, key=lambda r: math.inf if math.isnan(r.max_abs_delta) else r.max_abs_delta)

    def by_mode(self) -> dict[str, dict]:
        """{mode: {"max_abs_delta", "segments", "judged"}} over the audited segments of each label."""
        out: dict[str, dict] = {}
        for r in self.rows:
            if r.max_abs_delta is None:
                continue
            m = out.setdefault(r.mode, {"max_abs_delta": 0.0, "segments": 0, "judged": r.judged})
            m["max_abs_delta"] = max(m["max_abs_delta"], r.max_abs_delta) if not math.isnan(r.max_abs_delta) \
                else math.nan
            m["segments"] += 1
        return out

    @property
    def unaudited(self) -> list[SegmentDelta]:
        return [r for r in self.rows if r.max_abs_delta is None]

    def metrics(self) -> dict[str, float]:
        """audit/ metrics of one audit: the worst judged Δ, per label, the segments audited and not."""
        out = {"numerics/audit_segments": float(len(self.rows) - len(self.unaudited)),
               "numerics/audit_unaudited_segments": float(len(self.unaudited)),
               "numerics/audit_over_tolerance": float(bool(self.failures))}
        if self.worst is not None:
            out["numerics/audit_worst_abs_delta"] = self.worst.max_abs_delta
        for mode, m in self.by_mode().items():
            out[f"numerics/audit_max_abs_delta/{mode}"] = m["max_abs_delta"]
        return out

    def to_dict(self) -> dict:
        return {"tolerance": self.tolerance, "segments": [asdict(r) for r in self.rows], "by_mode": self.by_mode(),
                "failures": [r.describe() for r in self.failures], **self.metrics()}
