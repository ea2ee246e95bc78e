"""The charts a run is watched with: one list for TensorBoard's custom-scalars layout and for
`megatron-rl report`.

    from megatron_rl.panels import CHARTS, tensorboard_layout
    tensorboard_layout()   # {"learn": {"D_lag P50/P95/P99": ["Multiline", [...]]}, ...}

Each chart belongs to a panel (the metric key prefix: learn/, numerics/, system/, latency/,
queue/, eval/, env/) and lists the series it draws as regular expressions over metric keys (full
match); percentile charts put P50, P95 and P99 of one quantity on one chart.  A series that no
logged key matches is "missing": the report names it instead of skipping it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chart:
    panel: str
    """TensorBoard category (the metric prefix)."""
    title: str
    """Chart title; also the PNG's name in the report (slugged)."""
    series: tuple[str, ...]
    """Regular expressions over metric keys (full match), one per line drawn (or family of lines)."""
    in_report: bool = True
    """Drawn by `megatron-rl report` (every chart is in the TensorBoard layout)."""
    feature: str = ""
    """A metric prefix (e.g. "env/"): the report draws the chart only for runs that logged such a key."""

    def wanted(self, keys: Iterable[str]) -> bool:
        """Whether the report draws this chart for a run that logged `keys`."""
        return self.in_report and (not self.feature or any(k.startswith(self.feature) for k in keys))

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.title.replace("Δ", "d").lower()).strip("_")

    def matches(self, keys: Iterable[str]) -> tuple[dict[str, list[str]], list[str]]:
        """({pattern: matching keys (sorted)}, [patterns matching no key])."""
        keys = sorted(keys)
        found = {p: [k for k in keys if re.fullmatch(p, k)] for p in self.series}
        return {p: ks for p, ks in found.items() if ks}, [p for p, ks in found.items() if not ks]


def _pcts(key: str) -> tuple[str, ...]:
    return tuple(re.escape(f"{key}/p{q}") for q in (50, 95, 99))


CHARTS: tuple[Chart, ...] = (
    Chart(panel="learn", title="Reward and correctness",
          series=("learn/reward_mean", "learn/reward_correctness", "eval/test_correctness", "eval/dev_correctness")),
    Chart(panel="learn", title="KL to reference", series=(r"learn/kl_ref_.*",)),
    Chart(panel="learn", title="KL coefficient β", series=("learn/kl_coef",),  # loss.kl_coef > 0; moves when adaptive
          feature="learn/kl_coef"),
    Chart(panel="learn", title="Entropy", series=("learn/entropy_estimate",)),
    Chart(panel="learn", title="Response length", series=("learn/response_length",)),
    Chart(panel="learn", title="Clip fraction", series=("learn/clip_fraction",)),
    Chart(panel="learn", title="Off-policy masked tokens", series=("learn/off_policy_masked_fraction",),
          feature="learn/off_policy_masked_fraction"),  # loss.off_policy_mask set
    Chart(panel="learn", title="Grad norm", series=("learn/grad_norm",)),
    Chart(panel="learn", title="D_lag P50/P95/P99", series=_pcts("learn/d_lag")),
    Chart(panel="learn", title="LoRA adapter norm and update ratio", feature="learn/adapter_",  # learner.lora
          series=("learn/adapter_norm", "learn/adapter_update_ratio")),
    Chart(panel="numerics", title="Non-finite values", in_report=False,
          series=("numerics/nonfinite_loss", "numerics/nonfinite_grad_norm", "numerics/nonfinite_behavior_logprobs")),
    Chart(panel="numerics", title="Min behavior logprob", series=("numerics/min_behavior_logprob",), in_report=False),
    Chart(panel="numerics", title="Audit: worst |Δ logprob|", in_report=False,  # megatron_rl/audit/ (audit.every)
          series=("numerics/audit_worst_abs_delta", r"numerics/audit_max_abs_delta/.*")),
    Chart(panel="system", title="TPS vs effective TPS",
          series=("system/generated_tokens_per_s", "system/effective_tokens_per_s")),
    Chart(panel="system", title="Step time by phase",
          series=tuple(f"system/time_{p}_s" for p in ("rollout", "score", "learn", "publish", "step"))),
    Chart(panel="system", title="ESR", series=("system/esr",), in_report=False),
    Chart(panel="latency", title="Rollout round P50/P95/P99", series=_pcts("latency/rollout_round_s"), in_report=False),
    Chart(panel="latency", title="Verifier batch P50/P95/P99", series=_pcts("latency/verifier_batch_s"),
          in_report=False),
    Chart(panel="queue", title="Δv P50/P95/P99", series=_pcts("queue/taken_dv")),
    Chart(panel="queue", title="Per-token Δv P50/P95/P99", series=_pcts("queue/taken_token_dv"), in_report=False),
    Chart(panel="system", title="Streaming: versions per sample and groups in flight", in_report=False,
          series=("system/stream_segments_per_sample", "system/stream_multi_version_fraction",
                  "system/stream_groups_in_flight")),
    Chart(panel="system", title="Streaming: the learner's wait for its batch (too few groups; the version window)",
          in_report=False, series=("system/stream_wait_groups_s", "system/stream_wait_window_s")),
    Chart(panel="system", title="Streaming: refits in flight and the requests they kept", in_report=False,
          feature="system/engine_refits", series=("system/engine_refits", "system/engine_refit_requests_kept")),
    Chart(panel="system", title="Engine occupancy and idle fraction; learner idle fraction",
          feature="system/engine_occupancy",
          series=("system/engine_occupancy", "system/engine_idle_fraction", "system/learner_idle_fraction")),
    Chart(panel="queue", title="Queue depth and drops", series=("queue/depth", r"queue/dropped.*")),
    Chart(panel="env", title="Episodes: turns and tool calls", feature="env/",
          series=("env/turns_mean", "env/tool_calls_per_episode", "env/tool_success_rate")),
    Chart(panel="env", title="Environment step time P50/P95/P99", series=_pcts("env/step_seconds"), feature="env/"),
    Chart(panel="env", title="Terminal reasons, env errors and sandbox violations", feature="env/",
          series=(r"env/terminal/.*", "env/env_errors", "env/dropped_groups", "env/sandbox_violations")),
    Chart(panel="eval", title="Held-out correctness", series=(r"eval/.*_correctness",), in_report=False),
    Chart(panel="eval", title="Held-out reward", series=(r"eval/.*_reward",), in_report=False),
)


def tensorboard_layout(charts: Iterable[Chart] = CHARTS) -> dict[str, dict[str, list]]:
    """{panel: {title: ["Multiline", [tag regex, ...]]}}: torch's SummaryWriter.add_custom_scalars form."""
    layout: dict[str, dict[str, list]] = {}
    for chart in charts:
        layout.setdefault(chart.panel, {})[chart.title] = ["Multiline", list(chart.series)]
    return layout
