"""One metrics logger that fans out to TensorBoard and a JSONL file.

    with MetricsLogger("runs/exp1/metrics") as log:
        log.log(step, {"learn/loss": 0.3, "queue/depth": 12, **percentiles(lat_s, "latency/rollout_s")})

Keys are grouped by panel prefix: learn/, numerics/, system/, latency/, queue/, env/ (multi-turn
episodes) (plus eval/
for held-out evaluation).  A key without a known prefix is a ValueError naming it, raised
before anything is written.  Values must be real numbers (bools, ints, floats, 0-d
tensors/arrays).

Sinks fail independently: a sink that raises (disk full, closed file) is logged as a warning
and the others still receive the step, so a failing monitor never stops training.

Files: `<log_dir>/metrics.jsonl` (one {"step", "time", ...metrics} object per line) and
TensorBoard event files in `<log_dir>/tb/`, which also carry the custom-scalars layout of
megatron_rl/panels.py (grouped charts per panel, P50/P95/P99 on one chart).

Resume: `log.rewind(S)` after resuming from the checkpoint of step S drops the JSONL records of
steps > S (an abandoned attempt's, about to be redone) and lines that are not records (torn or damaged:
counted in a warning, never an error), and starts a new TensorBoard event file
with purge_step S+1, so readers discard the older files' events of those steps.
`logged_test_evals(path)` reads back the test evals a metrics.jsonl holds.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence

from megatron_rl.run_files import read_jsonl, skipped_lines

logger = logging.getLogger(__name__)

PANELS = ("learn", "numerics", "system", "latency", "queue", "eval", "sft", "env")


class Sink(Protocol):
    name: str

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    name = "jsonl"

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        self._fh.write(json.dumps({"step": step, "time": wall_time, **scalars}) + "\n")

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()

    def rewind(self, keep_through: int) -> int:
        """Drop the records of steps > keep_through; returns how many.  Lines that are not records (a line
        torn by a crash, damaged bytes) are dropped too, counted in a warning of their own."""
        self._fh.close()
        try:
            rows = read_jsonl(self.path, key="step", warn=False)
            kept = [line for row, line in zip(rows, rows.lines) if row["step"] <= keep_through]
            if len(kept) < len(rows) or rows.skipped:
                tmp = self.path.with_name(self.path.name + ".tmp")
                tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
                os.replace(tmp, self.path)
        finally:
            self._fh = self.path.open("a", encoding="utf-8")
        if rows.skipped:
            logger.warning("%s: %s, dropped by the resume's rewind", self.path, skipped_lines(rows.skipped))
        return len(rows) - len(kept)


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # heavy import, only when used

        self._log_dir = str(log_dir)
        self._writer = SummaryWriter(log_dir=self._log_dir)
        self._write_layout()

    def _write_layout(self) -> None:
        """The custom-scalars layout (megatron_rl/panels.py): TensorBoard's "Custom Scalars" tab shows
        each panel as a group of charts, percentiles of one quantity on one chart."""
        from megatron_rl.panels import tensorboard_layout

        self._writer.add_custom_scalars(tensorboard_layout())

    def write(self, step: int, wall_time: float, scalars: Mapping[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def rewind(self, keep_through: int) -> int:
        """Continue in a new event file whose purge marker makes readers (TensorBoard, EventAccumulator)
        discard the earlier files' events of steps > keep_through."""
        from torch.utils.tensorboard import SummaryWriter

        self._writer.close()
        self._writer = SummaryWriter(log_dir=self._log_dir, purge_step=keep_through + 1)
        self._write_layout()
        return 0


def check_key(key: str) -> None:
    panel, sep, rest = key.partition("/")
    if not sep or panel not in PANELS or not rest:
        raise ValueError(f"metric key {key!r} needs a panel prefix, one of {[p + '/' for p in PANELS]}, and a name")


def _to_float(key: str, value: Any) -> float:
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):  # 1-element tensor / array
        size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
        if size == 1:
            value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    raise ValueError(f"metric {key!r}: value must be a real number, got {type(value).__name__} {str(value)[:80]}")


class MetricsLogger:
    """`log(step, {panel/key: number})` to every sink; sink failures are warned about, not raised."""

    def __init__(self, log_dir: str | Path | None = None, *, tensorboard: bool = True, jsonl: bool = True,
                 sinks: Iterable[Sink] = (), flush_every: int = 1) -> None:
        self.sinks: list[Sink] = list(sinks)
        if log_dir is not None:
            log_dir = Path(log_dir)
            if jsonl:
                self.sinks.append(JsonlSink(log_dir / "metrics.jsonl"))
            if tensorboard:
                self.sinks.append(TensorBoardSink(log_dir / "tb"))
        self.flush_every = max(1, flush_every)
        self.failures: dict[str, int] = {}
        self._writes = 0

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Validate every key/value first (ValueError names the bad one), then write to all sinks."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        scalars: dict[str, float] = {}
        for key, value in metrics.items():
            check_key(key)
            scalars[key] = _to_float(key, value)
        now = time.time()
        self._writes += 1
        flush = self._writes % self.flush_every == 0
        for sink in self.sinks:
            self._guard(sink, "write", sink.write, int(step), now, scalars)
            if flush:
                self._guard(sink, "flush", sink.flush)

    def _guard(self, sink: Sink, what: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:  # a broken monitor must never stop training
            count = self.failures.get(sink.name, 0) + 1
            self.failures[sink.name] = count
            if count == 1 or count % 100 == 0:
                logger.warning("metrics sink %s failed to %s (%d failures so far): %s", sink.name, what, count, err)

    def rewind(self, keep_through: int) -> None:
        """A resumed run redoes the steps after its checkpoint: forget what an abandoned attempt
        logged for steps > keep_through (-1: everything), so that no step is counted twice."""
        for sink in self.sinks:
            if hasattr(sink, "rewind"):
                self._guard(sink, "rewind", self._rewind_one, sink, keep_through)

    @staticmethod
    def _rewind_one(sink, keep_through: int) -> None:
        dropped = sink.rewind(keep_through)
        if dropped:
            logger.warning("metrics %s: dropped %d records of steps > %d from an earlier attempt",
                           sink.name, dropped, keep_through)

    def flush(self) -> None:
        for sink in self.sinks:
            self._guard(sink, "flush", sink.flush)

    def close(self) -> None:
        for sink in self.sinks:
            self._guard(sink, "close", sink.close)

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def logged_test_evals(metrics_jsonl: str | Path) -> dict[int, dict]:
    """{step: {"reward", "correctness", "format"}} of the hidden test evals already in a
    metrics.jsonl (a run resumed where it had ended takes its final eval from here)."""
    path, out = Path(metrics_jsonl), {}
    if not path.is_file():
        return out
    for row in read_jsonl(path, key="step"):  # a torn or damaged line is skipped, with one warning
        try:
            if "eval/test_reward" not in row:
                continue
            # correctness and format are absent for a reward function without them: None, as eval gave
            out[int(row["step"])] = {k: None if row.get(f"eval/test_{k}") is None else float(row[f"eval/test_{k}"])
                                     for k in ("reward", "correctness", "format")}
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # another kind of row, or a torn line
    return out


def percentiles(values: Sequence[float], prefix: str, qs: Sequence[float] = (50, 95, 99)) -> dict[str, float]:
    """{f"{prefix}/p50": ..} (percentile below); {} for no values."""
    data = sorted(float(v) for v in values)
    out = {f"{prefix}/p{q:g}": _sorted_percentile(data, q) for q in qs}
    return out if data else {}


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear interpolation between order statistics (numpy's
    default method); 0.0 for no values.  The one percentile of the project (metrics, backpressure)."""
    return _sorted_percentile(sorted(float(v) for v in values), q)


def _sorted_percentile(data: list[float], q: float) -> float:
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside [0, 100]")
    if not data:
        return 0.0
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)
