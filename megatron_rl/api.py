"""The Python API: what `megatron-rl train`, `sft` and `eval` do, called from a script or a notebook.

    from megatron_rl import train, evaluate

    def my_reward(*, prompt, response, answer, **fields):
        return {"correct": float(response.strip() == answer)}

    summary = train("configs/my_task.example.yaml", overrides=["run.steps=20"], reward_function=my_reward)
    result = evaluate(run=summary["run_dir"], reward_function=my_reward)

A script that calls these needs the `if __name__ == "__main__":` guard around the calls: the verifier pool and
vLLM start processes with the "spawn" method, and those import the script again.

Each returns the summary dict the command prints as its final JSON line.  A `reward_function` may be any
Python callable, a closure or a lambda included: it is pickled by value (cloudpickle, as Ray ships
functions) to the verifier pool's processes, and its grader version is the digest of that pickle
(reward/function.py).  It replaces the config's reward.function or reward.grader for this call; the run's
config.json names it "callable:NAME@DIGEST", so resuming the run from the command line asks for a file or
module form.  The config is checked as by `--dry-run` before anything starts; a bad one raises
megatron_rl.config.ConfigError (or FileNotFoundError) naming the key.  A stop condition or a signal ends the
call with the SystemExit the command would exit with (its summary in the exception's `summary`).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence


def _config(config: str | Path | None, overrides: Sequence[str], reward_function: Callable | None):
    from megatron_rl.train.config import load_train_config

    cfg = load_train_config(config, list(overrides))
    if reward_function is not None:
        from megatron_rl.reward.function import with_callable

        cfg = dataclasses.replace(cfg, reward=with_callable(cfg.reward, reward_function))
    return cfg


def train(config: str | Path | None, overrides: Sequence[str] = (), *, reward_function: Callable | None = None,
          dry_run: bool = False) -> dict[str, Any]:
    """`megatron-rl train --config CONFIG [overrides]`: GRPO (after SFT with sft.first); returns its summary,
    or with dry_run the plan it would run."""
    return _run("train", config, overrides, reward_function, dry_run)


def sft(config: str | Path | None, overrides: Sequence[str] = (), *, reward_function: Callable | None = None,
        dry_run: bool = False) -> dict[str, Any]:
    """`megatron-rl sft`: supervised fine-tuning on the train split (its evals scored by the reward)."""
    return _run("sft", config, overrides, reward_function, dry_run)


def _run(command: str, config, overrides, reward_function, dry_run: bool) -> dict[str, Any]:
    from megatron_rl.train.cli import run_one
    from megatron_rl.train.dry_run import check_and_plan
    from megatron_rl.console import attach_run_dir, end_progress

    cfg = _config(config, overrides, reward_function)
    plan = check_and_plan(cfg)
    if dry_run:
        return plan
    attach_run_dir(cfg.run.dir)
    try:
        return run_one(command, cfg)
    finally:
        end_progress()


def evaluate(config: str | Path | None = None, overrides: Sequence[str] = (), *, run: str | Path | None = None,
             model: str | Path | None = None, split: str = "test", samples: int = 1, k: int = 1,
             temperature: float | None = None, seed: int = 0, limit: int | None = None,
             reward_function: Callable | None = None) -> dict[str, Any]:
    """`megatron-rl eval`: a run's newest committed checkpoint (`run`) or a Hugging Face directory (`model`
    with `config`) on a held-out split; returns the summary (correctness None when the reward gives none)."""
    from megatron_rl.eval_cli import run_eval

    args = argparse.Namespace(run=None if run is None else str(run), model=None if model is None else str(model),
                              config=None if config is None else str(config), overrides=list(overrides),
                              split=split, samples=samples, k=k, temperature=temperature, seed=seed, limit=limit,
                              checkpoint=None, out=None, json=True)
    return run_eval(args, reward_function=reward_function)
