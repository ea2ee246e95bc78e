"""What a generated-token budget (`stop.max_generated_tokens`) means for a run's length, for `megatron-rl plan`.

    from megatron_rl.planner.budget import budget_plan
    budget_plan(cfg, step_seconds=12.0)
    # {"max_generated_tokens": 50000, "tokens_per_step": [256, 512], "steps": [98, 100], "wall_s": [...], ...}

The budget ends the run after the first step at which the tokens generated so far reach it
(reporting/stop.py), so the steps it allows follow from the tokens one step can generate:
  fewest  every response is `rollout.max_tokens` long: samples x max_tokens per step
          (with dynamic sampling every attempt may draw its whole oversampled share of prompts,
          and discarded groups count as generated: x max_attempts x oversample)
  most    every response is one token long: samples per step (the first attempt's draw)
Both are capped at run.steps, which ends the run first if the budget is not reached.  Wall time
is the step count times `step_seconds` (a step time measured on the same hardware: the mean of
a run's `system/time_step_s`), given only when one is passed: the planner has no model of speed.
"""

from __future__ import annotations

import math


def tokens_per_step(cfg) -> tuple[int, int]:
    """(fewest, most) tokens one step can generate under this config."""
    prompts, group = cfg.run.prompts_per_step, cfg.run.group_size
    ds = cfg.dynamic_sampling
    first = ds.prompts_to_draw(prompts) if ds.enabled else prompts
    attempts = ds.max_attempts if ds.enabled else 1
    return first * group, attempts * first * group * cfg.rollout.max_tokens


def budget_plan(cfg, step_seconds: float | None = None) -> dict:
    """Steps (fewest, most) the run takes under its token budget (or run.steps without one), and
    the wall time they mean at `step_seconds` per step (None when no step time is given)."""
    if step_seconds is not None and not step_seconds > 0:
        raise ValueError(f"--step-seconds must be > 0, got {step_seconds}")
    budget, steps = cfg.stop.max_generated_tokens, cfg.run.steps
    fewest_tokens, most_tokens = tokens_per_step(cfg)
    if budget is None:
        span, note = (steps, steps), f"no token budget: run.steps ({steps}) ends the run"
    else:
        span = (min(steps, math.ceil(budget / most_tokens)), min(steps, math.ceil(budget / fewest_tokens)))
        if span[0] == steps:
            note = f"the budget cannot end the run: {steps} steps generate at most {steps * most_tokens} tokens"
        elif span[1] < steps:
            note = f"the budget ends the run before run.steps ({steps})"
        else:
            note = f"the budget ends the run before run.steps ({steps}) unless responses are short"
    return {"max_generated_tokens": budget, "run_steps": steps, "tokens_per_step": [fewest_tokens, most_tokens],
            "steps": list(span), "note": note, "step_seconds": step_seconds,
            "wall_s": None if step_seconds is None else [n * step_seconds for n in span]}


def render_budget(b: dict) -> str:
    steps = f"{b['steps'][0]}" if b["steps"][0] == b["steps"][1] else f"{b['steps'][0]}-{b['steps'][1]}"
    head = (f"token budget {b['max_generated_tokens']}: " if b["max_generated_tokens"] is not None else "")
    line = (f"length: {head}{steps} steps ({b['tokens_per_step'][0]}-{b['tokens_per_step'][1]} generated tokens "
            f"per step; {b['note']})")
    if b["wall_s"] is not None:
        lo, hi = (w / 3600 for w in b["wall_s"])
        line += (f"; wall {lo:.2f} h" if lo == hi else f"; wall {lo:.2f}-{hi:.2f} h") + \
            f" at {b['step_seconds']:g} s/step"
    return line
