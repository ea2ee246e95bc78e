"""What one training step reports, grouped by TensorBoard panel.

    tel = Telemetry(window=50)
    metrics_logger.log(step, tel.step_metrics(...))

Panels: learn/ (reward and its components, KL to the reference, entropy estimate, response
length, clip fraction, grad norm, the batch's D_lag and its P50/P95/P99 over sequences),
numerics/ (non-finite counts, extreme logprobs, lag quarantines; the audit's numerics/audit_* come from
megatron_rl/audit/auditor.py through the reporter), system/ (generated and
learned tokens/s, ESR and effective TPS, phase times, memory), latency/ (rollout and verifier
P50/P95/P99 over a sliding window, verifier error counters and this step's share of ungraded
samples `latency/verifier_error_rate`), queue/ (the coordinator's gauges, plus the
taken batch's version lag Δv).

ESR (effective sample ratio) = tokens that were valid (graded), fresh (taken inside the
version window) and informative (non-zero advantage) / tokens generated this round;
effective TPS = generated TPS x ESR.  With dynamic sampling (sampling/dynamic_sampling.py) the
groups it discarded count as generated, and system/dynamic_* report its share of informative
groups among those sampled, the groups it had to fill, the tokens it discarded and its attempts.  Two lags are kept apart: `learn/kl_ref_<k>_grad_<dir>` is
the KL penalty to the frozen reference model (named after the divergence its gradient follows,
see megatron_rl.grpo.loss), `learn/d_lag*` is |log pi_learner - log mu_behavior| over the
batch's tokens (d_lag, the value the lag guard acts on) and per sequence (d_lag/p50, /p95, /p99),
measured by the training forward before the update.
"""

from __future__ import annotations

import collections
import math
import resource

import numpy as np

from megatron_rl.metrics import percentiles


class Telemetry:
    def __init__(self, window: int = 50):
        self.rollout_s: collections.deque = collections.deque(maxlen=window)
        self.verify_s: collections.deque = collections.deque(maxlen=window)

    def step_metrics(self, samples: list, trajs: list, taken: list, learn: dict, phases: dict,
                     queue: dict, verifier_counters: dict, sampling: dict | None = None) -> dict[str, float]:
        """`sampling`: dynamic sampling's account of the round (sampling/dynamic_sampling.py), if on."""
        self.rollout_s.append(phases["rollout"])
        self.verify_s.append(phases["score"])
        valid = [t for t in trajs if t.in_loss]
        logps = np.concatenate([_sampled_logprobs(s) for s in samples]) if samples else np.zeros(0)
        out = _learn_metrics(samples, valid, learn, logps)
        out.update(_numerics_metrics(learn, logps))
        out.update(_system_metrics(samples, taken, learn, phases, sampling or {}))
        # latency/
        out.update(percentiles(list(self.rollout_s), "latency/rollout_round_s"))
        out.update(percentiles(list(self.verify_s), "latency/verifier_batch_s"))
        if trajs:
            out["latency/verifier_error_rate"] = (len(trajs) - len(valid)) / len(trajs)
        for code, count in verifier_counters.items():
            out[f"latency/verifier_{code}"] = float(count)
        # queue/
        out.update({k: float(v) for k, v in queue.items()})
        out.update(percentiles(learn.get("dv", []), "queue/taken_dv"))  # {} when nothing was taken
        out.update(percentiles(learn.get("token_dv", []), "queue/taken_token_dv"))  # per token (streaming: differs)
        return out


def _learn_metrics(samples: list, valid: list, learn: dict, logps: np.ndarray) -> dict[str, float]:
    """learn/: rewards of the trajectories in the loss, response length, entropy estimate, the step's stats."""
    out = {"learn/reward_mean": _mean([t.reward for t in valid])}
    for comp in sorted({k for t in valid for k in t.reward_components}):
        out[f"learn/reward_{comp}"] = _mean([t.reward_components.get(comp, 0.0) for t in valid])
    # the tokens the policy sampled: a multi-turn episode's observations are in its response, not in its length
    out["learn/response_length"] = sum(s.generated_tokens for s in samples) / max(len(samples), 1)
    out["learn/response_length_max"] = float(max((s.generated_tokens for s in samples), default=0))  # the tail
    out["learn/entropy_estimate"] = float(-logps.mean()) if logps.size else float("nan")
    for key in ("loss", "pg_loss", "clip_fraction", "ratio_mean", "ratio_max", "grad_norm", "lr",
                "d_lag", "d_lag/p50", "d_lag/p95", "d_lag/p99", "lag_weight", "entropy_coef", "kl_coef",
                "kl_out_of_support_tokens", "quarantined_trajectories", "adapter_norm", "adapter_update_ratio",
                "tis_weight_mean", "tis_truncated_fraction", "off_policy_masked_fraction"):  # loss.tis_cap, off_policy_mask
        if key in learn:
            out[f"learn/{key}"] = float(learn[key])
    for key in sorted(k for k in learn if k.startswith("kl_ref_")):  # named after its gradient's direction
        out[f"learn/{key}"] = float(learn[key])
    for key, name in (("adv/zero_variance_groups", "learn/zero_variance_groups"),
                      ("adv/invalid_samples", "learn/invalid_samples")):
        if key in learn:  # a metric the step did not measure is absent, never a made-up 0
            out[name] = float(learn[key])
    return out


def _sampled_logprobs(sample) -> np.ndarray:
    """Behaviour logprobs of the tokens the policy sampled (an episode's observation tokens carry none)."""
    lps = np.asarray(sample.behavior_logprobs, np.float64)
    return lps if sample.action_mask is None else lps[np.asarray(sample.action_mask, bool)]


def _numerics_metrics(learn: dict, logps: np.ndarray) -> dict[str, float]:
    """numerics/: non-finite loss, gradient norm and behaviour logprobs; quarantines, skipped updates, OOM retries."""
    out = {"numerics/nonfinite_loss": float(not math.isfinite(learn.get("loss", float("nan")))),
           "numerics/nonfinite_grad_norm": float(not math.isfinite(learn.get("grad_norm", float("nan")))),
           "numerics/nonfinite_behavior_logprobs": float((~np.isfinite(logps)).sum())}
    if logps.size:
        out["numerics/min_behavior_logprob"] = float(logps.min())
    for key in ("lag_quarantined", "update_successful"):
        if key in learn:
            out[f"numerics/{key}"] = float(learn[key])
    out["numerics/oom_retries"] = float(learn.get("oom_retries", 0.0))  # a count: no retry is a real 0
    out.update({k: float(v) for k, v in learn.items() if k.startswith("numerics/reconcile_")})  # train/probe.py
    return out


def _system_metrics(samples: list, taken: list, learn: dict, phases: dict, sampling: dict) -> dict[str, float]:
    """system/: throughput (generated, learned, effective tokens per second), dynamic sampling, phase times."""
    out: dict[str, float] = {}
    gen_tokens = sum(s.generated_tokens for s in samples)  # an episode's observations were not generated
    out.update({k: float(v) for k, v in sampling.items()  # sampling/stream_producer.py; the producers' env/ counts
                if k.startswith(("system/stream_", "system/engine_", "env/"))})
    if samples and samples[0].episode is not None:  # multi-turn, on either engine: turns, tools, env time, ends
        from megatron_rl.envs.metrics import summary_metrics

        out.update(summary_metrics([s.episode for s in samples]))
    if "discarded_tokens" in sampling:  # groups dynamic sampling threw away were generated too: ESR counts them
        gen_tokens += sampling["discarded_tokens"]
        out["system/dynamic_kept_fraction"] = sampling["informative_groups"] / max(sampling["sampled_groups"], 1)
        out["system/dynamic_filled_groups"] = float(sampling["filled_groups"])
        out["system/dynamic_discarded_tokens"] = float(sampling["discarded_tokens"])
        if "attempts" in sampling:  # rounds; streaming discards group by group (sampling/stream_producer.py)
            out["system/dynamic_attempts"] = float(sampling["attempts"])
    gen_tps = gen_tokens / max(phases["rollout"], 1e-9)
    learned = sum(t.num_tokens for t in taken)
    out.update({
        "system/generated_tokens_per_s": gen_tps,
        "system/generated_tokens": float(gen_tokens),  # this step's; stop.max_generated_tokens sums them
        "system/learned_tokens_per_s": learned / max(phases["learn"], 1e-9),
        "system/driver_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    })
    if gen_tokens and "adv/informative_tokens" in learn:  # ESR of nothing generated is undefined
        esr = learn["adv/informative_tokens"] / gen_tokens
        out.update({"system/esr": esr, "system/effective_tokens_per_s": gen_tps * esr})
    if "padding_fraction" in learn:  # padded / computed token positions of the learner's grid
        out["system/padding_fraction"] = float(learn["padding_fraction"])
    for name, seconds in phases.items():
        out[f"system/time_{name}_s"] = float(seconds)
    if phases.get("step"):  # the share of the step the learner was not learning (waiting on rollout, publishing)
        out["system/learner_idle_fraction"] = max(0.0, 1.0 - phases.get("learn", 0.0) / phases["step"])
    return out


def _mean(values: list) -> float:
    return float(np.mean(values)) if values else float("nan")


def progress_line(step: int, total: int, metrics: dict, seconds_per_step: float) -> str:
    """One console line per step: where the run is and whether it is learning.

    step/total, the policy version the coordinator serves after the step's publication,
    reward and correctness of the step's samples, KL to the
    reference, dv and D_lag P95, ESR, generated tokens/s and the ETA at the mean step time so
    far.  A value the step did not log shows as "-" (never as a made-up zero).
    """
    def fmt(key: str, spec: str) -> str:
        value = metrics.get(key)
        if key == "learn/kl_ref":  # the KL's unbiased value when logged, else the penalty's value
            value = metrics.get("learn/kl_ref_estimate",
                                next((v for k, v in metrics.items() if k.startswith("learn/kl_ref_")), None))
        return "-" if value is None or not math.isfinite(value) else format(value, spec)

    eta = max(total - step, 0) * seconds_per_step
    # the built-in verifier's component, or a reward function's "correct" (reward/function.py)
    correct = "learn/reward_correctness" if "learn/reward_correctness" in metrics else "learn/reward_correct"
    return (f"step {step}/{total} v{fmt('queue/version', '.0f')} | reward {fmt('learn/reward_mean', '.3f')} "
            f"correct {fmt(correct, '.3f')} | kl {fmt('learn/kl_ref', '.3g')} "
            f"dv95 {fmt('queue/taken_dv/p95', '.0f')} lag95 {fmt('learn/d_lag/p95', '.2g')} | "
            f"esr {fmt('system/esr', '.2f')} gen {fmt('system/generated_tokens_per_s', '.0f')} tok/s | "
            f"eta {_duration(eta)}")


def sft_step_metrics(out: dict, seconds: float) -> dict:
    """An SFT learner step's metrics (the `sft/` panel) from its output and wall time."""
    return {"sft/loss": out["loss"], "sft/nll_per_token": out["nll_sum"] / max(out["tokens"], 1),
            "sft/tokens": out["tokens"], "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"],
            "latency/sft_step_s": seconds}


def sft_progress_line(step: int, total: int, out: dict, seconds_per_step: float, tokens_per_s: float) -> str:
    """The SFT step's console line: step/total, loss, NLL per token, grad norm, tokens/s, ETA."""
    def fmt(value, spec: str) -> str:
        return "-" if value is None or not math.isfinite(float(value)) else format(float(value), spec)

    nll = out["nll_sum"] / out["tokens"] if out.get("tokens") else None
    return (f"sft step {step}/{total} | loss {fmt(out.get('loss'), '.4f')} nll/token {fmt(nll, '.4f')} "
            f"grad {fmt(out.get('grad_norm'), '.3g')} | {fmt(tokens_per_s, '.0f')} tok/s | "
            f"eta {_duration(max(total - step, 0) * seconds_per_step)}")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
