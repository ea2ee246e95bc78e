"""The trajectory contract: one scored rollout, as rollout workers hand it to the coordinator.

    from megatron_rl.trajectory import make_trajectory, validate, Trajectory
    traj = make_trajectory(id="run1/p7/s0", prompt_id="p7", dataset_version="gsm8k@3",
                           policy_versions=[4] * R, tokenizer_hash=tok_hash,
                           prompt_tokens=prompt, response_tokens=resp, action_mask=[1] * R,
                           behavior_logprobs=lps, sampling_config={"temperature": 1.0},
                           reward_components={"correct": 1.0}, grader_version="math@2",
                           terminal_reason="eos", rollout_started_at=t0, scored_at=t1)
    validate(traj, tokenizer_hash=tok_hash, current_version=5)   # raises TrajectoryError
    blob = traj.to_bytes(); same = Trajectory.from_bytes(blob)

Shapes (P = prompt tokens, R = response tokens):
    prompt_tokens      int32   [P]
    response_tokens    int32   [R]
    policy_versions    int32   [R]  policy version that sampled each response token
    action_mask        uint8   [R]  1 = token produced by the policy (in the loss)
    behavior_logprobs  float32 [R]  log pi_behavior(token) as reported by the sampler

The checksum (SHA-256, first 128 bits in hex) covers every field except `checksum` itself and
`sampling_probability`, which the coordinator sets when it samples by priority.

A verifier that timed out or failed is NOT a zero reward: such a record carries
`status="verifier_timeout"` (or `"verifier_error"`), an `error_code`, no reward
(`reward is None`) and `in_loss=False`; the coordinator counts it and the learner excludes it.

Wire format (`to_bytes`): a 20-byte header (magic, checked-meta length, extra-meta length,
P, R), compact JSON of the checksummed scalar fields, JSON of `checksum` and
`sampling_probability`, then the five arrays back to back.  The checksum is SHA-256/128 over
(P, R, checked JSON, arrays), so it can be verified straight from the bytes
(`checksum_of_wire`) without encoding twice.  Decoding is zero-copy (`np.frombuffer`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

STATUSES = ("ok", "verifier_timeout", "verifier_error", "quarantined")  # quarantined: train/policy.py
# Reasons a record is rejected at enqueue; metric keys are queue/rejected/<reason>.
REJECT_REASONS = (
    "schema",  # a field of the wrong type / dtype / shape
    "length",  # per-token arrays disagree in length, or an empty prompt/response
    "nonfinite_logprobs",  # NaN or inf in behavior_logprobs
    "positive_logprobs",  # a log-probability above 0
    "checksum",  # content does not match the checksum
    "tokenizer",  # tokenizer hash is not the run's
    "version",  # a negative policy version, or one newer than the learner's
    "status",  # unknown status, or an ok record with no / non-finite reward
)

_MAGIC = b"MRT1"
_HEADER = struct.Struct("<4sIIII")  # magic, checked-meta bytes, extra-meta bytes, P, R
_SIZES = struct.Struct("<II")  # P, R: the first thing the checksum covers
_ARRAYS = (  # (field, dtype, length key) in wire order
    ("prompt_tokens", np.int32, "P"),
    ("response_tokens", np.int32, "R"),
    ("policy_versions", np.int32, "R"),
    ("behavior_logprobs", np.float32, "R"),
    ("action_mask", np.uint8, "R"),
)
_ARRAY_FIELDS = frozenset(name for name, _, _ in _ARRAYS)
_UNCHECKED = frozenset({"checksum", "sampling_probability"})


class TrajectoryError(ValueError):
    """A trajectory that breaks the contract; `reason` is one of REJECT_REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, eq=False, kw_only=True)
class Trajectory:
    """One scored rollout.  Immutable; use `dataclasses.replace` to derive a copy."""

    id: str  # globally unique; the coordinator's idempotency key
    prompt_id: str  # the dataset prompt this answers (GRPO groups share it)
    dataset_version: str  # which dataset snapshot the prompt came from
    policy_versions: np.ndarray  # int32 [R]
    tokenizer_hash: str  # must equal the run's tokenizer hash
    prompt_tokens: np.ndarray  # int32 [P]
    response_tokens: np.ndarray  # int32 [R]
    action_mask: np.ndarray  # uint8 [R]
    behavior_logprobs: np.ndarray  # float32 [R]
    sampling_config: dict  # temperature, top_p, ... as the sampler used them
    reward_components: dict  # name -> float; summed into `reward`
    grader_version: str  # version of the verifier / reward model
    terminal_reason: str  # "eos", "length", "stop", "abort", ...
    rollout_started_at: float  # unix seconds, rollout worker clock
    scored_at: float  # unix seconds, when the reward was computed
    checksum: str  # SHA-256/128 hex of the content (see module doc)
    status: str = "ok"  # one of STATUSES
    error_code: str = ""  # why the verifier gave no score, when status != "ok"
    source: str = ""  # data source / environment, for per-source quotas
    priority: float = 1.0  # weight for priority sampling (> 0)
    sampling_probability: float | None = None  # set by the coordinator (priority sampling)
    weights: dict = dataclasses.field(default_factory=dict)
    """Provenance: each policy version (str) in policy_versions -> the digest of the publication the
    engine sampled it with (rollout/provenance.py); empty for trajectories made before it existed."""
    segments: list = dataclasses.field(default_factory=list)
    """Streaming provenance: the response as [start, end, version, kv_version] spans, kv_version the oldest
    weights behind the KV those tokens attended to (older than `version` after a keep_kv refit:
    rollout/stream_engine.py); empty for rounds, where every token's KV came from its own version."""

    @property
    def reward(self) -> float | None:
        """Total reward, or None when the verifier produced no score."""
        if self.status != "ok":
            return None
        return float(sum(self.reward_components.values()))

    @property
    def in_loss(self) -> bool:
        return self.status == "ok"

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that produced any token: what staleness is measured from."""
        return int(self.policy_versions.min())

    @property
    def kv_versions(self) -> np.ndarray:
        """int32 [R]: per response token, the oldest weights that computed KV it attended to."""
        out = self.policy_versions.copy()
        for start, end, _, kv in self.segments:
            out[start:end] = kv
        return out

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_tokens) + len(self.response_tokens)

    def compute_checksum(self) -> str:
        h = hashlib.sha256(_SIZES.pack(len(self.prompt_tokens), len(self.response_tokens)))
        h.update(_checked_json(self))
        for name, dtype, _ in _ARRAYS:
            h.update(np.ascontiguousarray(getattr(self, name), dtype=dtype))
        return h.hexdigest()[:32]

    def to_bytes(self) -> bytes:
        checked = _checked_json(self)
        extra = json.dumps([self.checksum, self.sampling_probability]).encode()
        p, r = len(self.prompt_tokens), len(self.response_tokens)
        parts = [_HEADER.pack(_MAGIC, len(checked), len(extra), p, r), checked, extra]
        parts.extend(np.ascontiguousarray(getattr(self, n), dtype=d).tobytes() for n, d, _ in _ARRAYS)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, blob: bytes | memoryview) -> Trajectory:
        view = _byte_view(blob)
        checked_len, extra_len, p, r = _unpack_header(view)
        offset = _HEADER.size
        try:
            meta = json.loads(bytes(view[offset : offset + checked_len]))
            offset += checked_len
            meta["checksum"], meta["sampling_probability"] = json.loads(bytes(view[offset : offset + extra_len]))
        except (UnicodeDecodeError, ValueError, TypeError, RecursionError) as err:
            raise TrajectoryError("schema", f"metadata is not valid JSON: {err!r}"[:300]) from None
        offset += extra_len
        sizes = {"P": p, "R": r}
        for name, dtype, key in _ARRAYS:
            nbytes = sizes[key] * np.dtype(dtype).itemsize
            if offset + nbytes > len(view):
                raise TrajectoryError("schema", f"blob truncated inside {name}")
            meta[name] = np.frombuffer(view[offset : offset + nbytes], dtype=dtype)
            offset += nbytes
        if offset != len(view):
            raise TrajectoryError("schema", f"{len(view) - offset} trailing bytes after the arrays")
        try:
            return cls(**meta)
        except TypeError as err:
            raise TrajectoryError("schema", str(err)) from None

    def __reduce__(self):
        # Pickle (Ray, multiprocessing) through the compact wire format.  A module-level function,
        # not the bound classmethod: cloudpickle would pickle the latter by value, globals and all.
        return (_trajectory_from_bytes, (self.to_bytes(),))


def _trajectory_from_bytes(blob: bytes) -> Trajectory:
    return Trajectory.from_bytes(blob)


def _byte_view(blob) -> memoryview:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TrajectoryError("schema", f"expected the bytes of a trajectory, got {type(blob).__name__}")
    return memoryview(blob).cast("B")


def _unpack_header(view: memoryview) -> tuple[int, int, int, int]:
    if len(view) < _HEADER.size:
        raise TrajectoryError("schema", f"blob of {len(view)} bytes is shorter than the header")
    magic, checked_len, extra_len, p, r = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise TrajectoryError("schema", f"bad magic {magic!r}, expected {_MAGIC!r}")
    return checked_len, extra_len, p, r


def checksum_of_wire(blob: bytes | memoryview) -> str:
    """The checksum of the content encoded in `blob` (what `compute_checksum` gives after decoding)."""
    view = _byte_view(blob)
    checked_len, extra_len, p, r = _unpack_header(view)
    start = _HEADER.size
    h = hashlib.sha256(_SIZES.pack(p, r))
    h.update(view[start : start + checked_len])
    h.update(view[start + checked_len + extra_len :])
    return h.hexdigest()[:32]


_CHECKED_FIELDS = tuple(f.name for f in dataclasses.fields(Trajectory)
                        if f.name not in _ARRAY_FIELDS and f.name not in _UNCHECKED)


def _checked_json(traj: Trajectory) -> bytes:
    meta = {name: getattr(traj, name) for name in _CHECKED_FIELDS}
    for name in ("weights", "segments"):  # absent when empty: older trajectories keep their checksums
        if not meta[name]:
            del meta[name]
    try:
        return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as err:
        raise TrajectoryError("schema", f"trajectory {traj.id!r}: metadata is not JSON-serialisable: {err!r}") from None


def _finite(value: Any) -> bool:
    """A real number (not bool) that is finite as a float; ints too large for a float are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def make_trajectory(
    *,
    policy_versions: Sequence[int] | np.ndarray | int,
    prompt_tokens: Sequence[int] | np.ndarray,
    response_tokens: Sequence[int] | np.ndarray,
    action_mask: Sequence[int] | np.ndarray | None = None,
    behavior_logprobs: Sequence[float] | np.ndarray,
    sampling_config: Mapping[str, Any] | None = None,
    reward_components: Mapping[str, float] | None = None,
    **scalars: Any,
) -> Trajectory:
    """Build a Trajectory with canonical dtypes and its checksum.

    `policy_versions` may be one int (every token from the same policy); `action_mask`
    defaults to all ones.  Other fields (id, prompt_id, ...) pass by keyword.
    """
    response = np.asarray(response_tokens, dtype=np.int32)
    if np.ndim(policy_versions) == 0:
        versions = np.full(len(response), int(policy_versions), dtype=np.int32)
    else:
        versions = np.asarray(policy_versions, dtype=np.int32)
    mask = np.ones(len(response), np.uint8) if action_mask is None else np.asarray(action_mask, np.uint8)
    traj = Trajectory(
        policy_versions=versions,
        prompt_tokens=np.asarray(prompt_tokens, dtype=np.int32),
        response_tokens=response,
        action_mask=mask,
        behavior_logprobs=np.asarray(behavior_logprobs, dtype=np.float32),
        sampling_config=dict(sampling_config or {}),
        reward_components={k: float(v) for k, v in (reward_components or {}).items()},
        checksum="",
        **scalars,
    )
    return dataclasses.replace(traj, checksum=traj.compute_checksum())


def _validate_schema(traj: Any) -> None:
    """Types, dtypes and value ranges of every field (reason 'schema')."""
    if not isinstance(traj, Trajectory):
        raise TrajectoryError("schema", f"expected a Trajectory, got {type(traj).__name__}")
    tid = traj.id
    for name in ("id", "prompt_id", "dataset_version", "tokenizer_hash", "grader_version", "terminal_reason",
                 "checksum", "status", "error_code", "source"):
        if not isinstance(getattr(traj, name), str):
            raise TrajectoryError("schema", f"trajectory {tid!r}: {name} must be a str")
    if not traj.id:
        raise TrajectoryError("schema", "trajectory id is empty")
    for name in ("rollout_started_at", "scored_at"):
        value = getattr(traj, name)
        if not _finite(value):
            raise TrajectoryError("schema", f"trajectory {tid!r}: {name} must be finite unix seconds, got {value!r}")
    for name, dtype, _ in _ARRAYS:
        arr = getattr(traj, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.ndim != 1:
            got = f"{arr.dtype}{list(arr.shape)}" if isinstance(arr, np.ndarray) else type(arr).__name__
            raise TrajectoryError("schema", f"trajectory {tid!r}: {name} must be 1-D {np.dtype(dtype)}, got {got}")
    for name in ("prompt_tokens", "response_tokens"):
        if getattr(traj, name).size and getattr(traj, name).min() < 0:
            raise TrajectoryError("schema", f"trajectory {tid!r}: {name} holds a negative token id")
    if traj.action_mask.size and traj.action_mask.max() > 1:
        raise TrajectoryError("schema", f"trajectory {tid!r}: action_mask must hold only 0 and 1")
    if not isinstance(traj.weights, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                      for k, v in traj.weights.items()):
        raise TrajectoryError("schema", f"trajectory {tid!r}: weights must map version strings to digest strings")
    p = traj.sampling_probability
    if p is not None and not (_finite(p) and 0 <= p <= 1):
        raise TrajectoryError("schema", f"trajectory {tid!r}: sampling_probability must be None or in [0, 1], "
                                        f"got {p!r}")


def _validate_lengths_and_logprobs(traj: Trajectory) -> None:
    """Per-token arrays as long as the response; behavior logprobs finite and <= 0."""
    tid = traj.id
    r = len(traj.response_tokens)
    if len(traj.prompt_tokens) == 0 or r == 0:
        raise TrajectoryError("length", f"trajectory {tid!r}: prompt has {len(traj.prompt_tokens)} tokens, "
                                        f"response {r}; both must be non-empty")
    for name in ("policy_versions", "action_mask", "behavior_logprobs"):
        if len(getattr(traj, name)) != r:
            raise TrajectoryError("length", f"trajectory {tid!r}: {name} has {len(getattr(traj, name))} entries, "
                                            f"response_tokens has {r}")
    lps = traj.behavior_logprobs
    if not np.isfinite(lps.sum()) and not np.isfinite(lps).all():
        bad = int(np.flatnonzero(~np.isfinite(lps))[0])
        raise TrajectoryError("nonfinite_logprobs", f"trajectory {tid!r}: behavior_logprobs[{bad}] = {lps[bad]}")
    if lps.max() > 1e-4:
        bad = int(np.argmax(lps))
        raise TrajectoryError("positive_logprobs", f"trajectory {tid!r}: behavior_logprobs[{bad}] = {lps[bad]} > 0")


def validate(traj: Any, *, tokenizer_hash: str | None = None, current_version: int | None = None,
             check_checksum: bool = True) -> tuple[int, int]:
    """Check the contract; raise TrajectoryError(reason, message) on the first violation.

    Returns (oldest, newest) policy version of the response tokens.

    Checks, in order: schema, length, logprobs, status/reward, version, tokenizer, checksum.
    With check_checksum=False the caller verifies it afterwards with `verify_checksum`.
    """
    _validate_schema(traj)
    _validate_lengths_and_logprobs(traj)
    _validate_segments(traj)
    tid = traj.id
    _validate_status(traj)
    oldest, newest = int(traj.policy_versions.min()), int(traj.policy_versions.max())
    if oldest < 0:
        raise TrajectoryError("version", f"trajectory {tid!r}: negative policy version {oldest}")
    if current_version is not None and newest > current_version:
        raise TrajectoryError("version", f"trajectory {tid!r}: policy version {newest} is newer than the "
                                         f"learner's {current_version}")
    if tokenizer_hash is not None and traj.tokenizer_hash != tokenizer_hash:
        raise TrajectoryError("tokenizer", f"trajectory {tid!r}: tokenizer hash {traj.tokenizer_hash[:12]!r} "
                                           f"is not the run's {tokenizer_hash[:12]!r}")
    if check_checksum:
        verify_checksum(traj)
    return oldest, newest


def verify_checksum(traj: Trajectory, wire: bytes | None = None) -> None:
    """Raise TrajectoryError('checksum') unless the checksum matches; `wire` = traj.to_bytes() saves an encode."""
    expected = traj.compute_checksum() if wire is None else checksum_of_wire(wire)
    if traj.checksum != expected:
        raise TrajectoryError("checksum", f"trajectory {traj.id!r}: checksum {traj.checksum!r} != content "
                                          f"{expected!r}")


def _validate_segments(traj: Trajectory) -> None:
    """Segments, when present, tile the response in order and agree with its per-token versions."""
    segs, ok = traj.segments, isinstance(traj.segments, list)
    if ok and segs:
        ok = all(isinstance(g, list) and len(g) == 4 and all(type(x) is int for x in g) for g in segs)
        ok = ok and segs[0][0] == 0 and segs[-1][1] == len(traj.response_tokens) and all(
            a[1] == b[0] for a, b in zip(segs, segs[1:])) and all(
            g[0] < g[1] and 0 <= g[3] <= g[2] and bool((traj.policy_versions[g[0]:g[1]] == g[2]).all()) for g in segs)
    if not ok:
        raise TrajectoryError("schema", f"trajectory {traj.id!r}: segments must tile the response as [start, end, "
                                        "version, kv_version] spans with the tokens' versions and kv_version <= version")


def _validate_status(traj: Trajectory) -> None:
    tid = traj.id
    if traj.status not in STATUSES:
        raise TrajectoryError("status", f"trajectory {tid!r}: status {traj.status!r} not in {list(STATUSES)}")
    if not isinstance(traj.reward_components, dict) or not isinstance(traj.sampling_config, dict):
        raise TrajectoryError("schema", f"trajectory {tid!r}: reward_components and sampling_config must be dicts")
    if traj.status == "ok":
        if not traj.reward_components:
            raise TrajectoryError("status", f"trajectory {tid!r}: status 'ok' but no reward_components")
        for name, value in traj.reward_components.items():
            if not _finite(value):
                raise TrajectoryError("status", f"trajectory {tid!r}: reward component {name!r} = {value!r}")
    elif not traj.error_code:
        raise TrajectoryError("status", f"trajectory {tid!r}: status {traj.status!r} needs an error_code")
    if not _finite(traj.priority) or not traj.priority > 0:
        raise TrajectoryError("schema", f"trajectory {tid!r}: priority must be a finite number > 0, "
                                        f"got {traj.priority!r}")
