"""`megatron-rl plan`: the capacity planner's memory ledger (planner/) for a training config.

    megatron-rl plan --config configs/qwen2_7b_8gpu_colocated.yaml [--json] [--step-seconds S]

Prints, per role and per GPU, every item of the ledger (see planner/ledger.py for the formulas), then
compares colocated and disaggregated placements with a fits / does-not-fit verdict and its reason (every
check that fails, naming the config keys and the numbers: GPUs needed against cluster.gpus, a peak against
cluster.gpu_memory_gib, the engine against its budget, or cannot-start, naming the fields, for a layout
Placement.create refuses on GPUs) and the largest item, host memory per node (with the audit's weight ring
when audit.every is set: planner/host_memory.py), and the run's length: the steps its token budget allows
(stop.max_generated_tokens, planner/budget.py), and the wall time they take at S seconds per step when
--step-seconds is given.
"""

from __future__ import annotations

import argparse
import json

from megatron_rl.learner.config import uses_sequence_parallel
from megatron_rl.planner.budget import budget_plan, render_budget
from megatron_rl.planner.host_memory import host_memory_problem, resume_host_memory
from megatron_rl.planner.ledger import (
    GIB, LearnerLayout, RolloutLayout, as_dict, compare_placements, dims_from_hf, learner_ledger,
    rollout_ledger,
)
from megatron_rl.planner.training import describe_lines, training_of
from megatron_rl.publish.transport import whole_model_per_gpu
from megatron_rl.rollout.sleep import choose_sleep


def plan_for_config(cfg, step_seconds: float | None = None) -> dict:
    from megatron_rl.train.dry_run import model_config

    hf = model_config(cfg)
    model = dims_from_hf(hf)
    lc, rc = cfg.learner, cfg.rollout
    dtype = lc.dtype or "bf16"
    lay = LearnerLayout(
        tp=lc.tensor_parallel_size, pp=lc.pipeline_parallel_size, dp=lc.data_parallel_size,
        ep=lc.expert_parallel_size,
        dtype=dtype, use_distributed_optimizer=lc.use_distributed_optimizer, micro_batch_size=lc.micro_batch_size,
        seq_length=rc.max_model_len, activation_checkpointing=lc.recompute_activations,
        sequence_parallel=uses_sequence_parallel(hf.moe is not None, lc.tensor_parallel_size),
        reference_model=cfg.loss.has_reference, publish_dtype="fp32" if rc.dtype == "float32" else "bf16",
        publish_whole_model=whole_model_per_gpu(cfg.run.placement, rc.weight_transfer),
        training=training_of(lc.lora))
    max_seqs = int(rc.engine_options.get("max_num_seqs", cfg.samples_per_step // cfg.rollout.data_parallel_size or 1))
    roll = RolloutLayout(tp=rc.tensor_parallel_size, groups=cfg.rollout.data_parallel_size,
                         dtype="fp32" if rc.dtype == "float32" else "bf16",
                         max_num_seqs=max_seqs, max_model_len=rc.max_model_len,
                         gpu_memory_utilization=float(rc.engine_options.get("gpu_memory_utilization",
                                                                            rc.gpu_memory_utilization)))
    reserve = cfg.cluster.reserve_fraction
    led = learner_ledger(model, lay, reserve)
    rled = rollout_ledger(model, roll, reserve, cfg.cluster.gpu_memory_gib)
    # The engines sleep while the learner learns exactly when the driver will sleep them: colocated
    # on GPUs in sync mode, unless rollout.sleep_mode is false (rollout/sleep.py, the same rule).
    sleeps, sleep_why = choose_sleep(placement="colocated", device="cuda", mode=cfg.run.mode,
                                     requested=rc.sleep_mode, adapter=cfg.rollout_served.adapter)
    verdicts = compare_placements(led, rled, lay, roll, cfg.cluster.gpu_memory_gib, cfg.cluster.gpus,
                                  sleep_mode=sleeps)
    host = resume_host_memory(model, lay, roll, gpus_per_node=cfg.cluster.gpus_per_node,
                              sleep_mode=sleeps and cfg.run.placement == "colocated",
                              rollback_copy=lay.training.rollback_copy(rc.keep_rollback_copy),
                              audit_ring_versions=cfg.audit.ring_versions(cfg.coordinator.max_version_lag))
    return {
        "model_params": model.num_params,
        "lora": lay.training.describe(model, lay),
        "model_active_params": model.active_params,
        "gpu_memory_gib": cfg.cluster.gpu_memory_gib,
        "learner_gib_per_gpu": {k: v / GIB for k, v in led.items.items()} | {"total": led.total / GIB},
        "rollout_gib_per_gpu": {k: v / GIB for k, v in rled.items.items()} | {"total": rled.total / GIB},
        "rollout_need_gib": rled.need / GIB,
        "rollout_budget_gib": None if rled.budget is None else rled.budget / GIB,
        "placements": [as_dict(v) | {"peak_gib_per_gpu": v.peak_bytes_per_gpu / GIB,
                                     "margin": 1 - v.peak_bytes_per_gpu / (cfg.cluster.gpu_memory_gib * GIB)}
                       for v in verdicts],
        "configured_placement": cfg.run.placement,
        "colocated_sleep_mode": sleeps,
        "sleep_mode_reason": sleep_why,
        "length": budget_plan(cfg, step_seconds),
        "resume_host_gib_per_node": {k: v / GIB for k, v in host.items.items()} | {"total": host.per_node_bytes / GIB},
        "host_memory_gib": cfg.cluster.host_memory_gib,
        "host_memory_problem": host_memory_problem(host, cfg.cluster.host_memory_gib, reserve),
    }


def render(plan: dict) -> str:
    active = plan.get("model_active_params", plan["model_params"])
    moe = f" ({active / 1e9:.2f} B active per token)" if active != plan["model_params"] else ""
    lines = [f"model: {plan['model_params'] / 1e9:.3f} B parameters{moe}; GPU memory {plan['gpu_memory_gib']:.0f} GiB"]
    lines += describe_lines(plan.get("lora"))
    for role in ("learner", "rollout"):
        items = plan[f"{role}_gib_per_gpu"]
        extra = (f" (engine budget {plan['rollout_budget_gib']:.2f} GiB = gpu_memory_utilization x GPU memory; "
                 f"needs {plan['rollout_need_gib']:.2f})" if role == "rollout" and plan["rollout_budget_gib"] is not None else "")
        lines.append(f"{role} per GPU:{extra}")
        lines += [f"  {k:<24} {v:10.2f} GiB" for k, v in items.items()]
    lines.append(f"colocated: vLLM sleep mode {'on' if plan['colocated_sleep_mode'] else 'off'} "
                 f"({plan['sleep_mode_reason']})")
    lines.append("placements:")
    for v in plan["placements"]:
        mark = ("fits" if v["fits"] else "DOES NOT FIT") if v["startable"] else "CANNOT START"
        chosen = " (configured)" if v["placement"] == plan["configured_placement"] else ""
        lines.append(f"  {v['placement']:<14}{chosen} {v['gpus_needed']} GPUs, peak {v['peak_gib_per_gpu']:.2f} GiB/GPU "
                     f"({v['margin']:.0%} margin): {mark} ({v['reason']}); largest item {v['largest_item']} "
                     f"({v['note']})")
    host = plan["resume_host_gib_per_node"]
    lines.append(f"host memory per node at resume: {host['total']:.1f} GiB ("
                 + ", ".join(f"{k} {v:.1f}" for k, v in host.items() if k != "total") + ")"
                 + (f": DOES NOT FIT ({plan['host_memory_problem']})" if plan["host_memory_problem"] else
                    "" if plan["host_memory_gib"] is None else f" of {plan['host_memory_gib']:g} GiB: fits"))
    lines.append(render_budget(plan["length"]))
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    from megatron_rl.train.config import load_train_config

    plan = plan_for_config(load_train_config(args.config, args.overrides), step_seconds=args.step_seconds)
    print(json.dumps(plan) if args.json else render(plan))
    chosen = next(v for v in plan["placements"] if v["placement"] == plan["configured_placement"])
    return 0 if chosen["fits"] and not plan["host_memory_problem"] else 1


def register(sub) -> None:
    p = sub.add_parser("plan", help="memory ledger per role and GPU; colocated vs disaggregated verdicts")
    p.add_argument("--config", required=True)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--step-seconds", type=float, default=None,
                   help="seconds per training step measured on this hardware (a run's mean system/time_step_s): "
                        "the plan then gives the wall time of the steps the token budget allows")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.set_defaults(func=_cmd)
