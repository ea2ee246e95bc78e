"""`megatron-rl eval`: score a policy on a held-out split with fixed decoding, outside training.

    megatron-rl eval --run RUN_DIR [--split test] [--samples N --k K --temperature T] [--json]
    megatron-rl eval --model HF_DIR --config F [k=v ...] [--split test] [--json]

`--run` evaluates the run's newest COMMITTED checkpoint (or `--checkpoint STEP_DIR`), exported
once to `RUN_DIR/export/step_N` (a Hugging Face directory), with the data, reward and rollout
settings of `RUN_DIR/config.json`.  `--model` evaluates a Hugging Face directory with the
settings of `--config`.  One vLLM engine generates (no publication, no coordinator: the
training queue is never read or written), the run's verifier grades, and the per-example
outcomes are written as JSONL to `--out` (default `RUN_DIR/eval/<split>_step_N.jsonl`, or
`eval_<model>_<split>.jsonl` here) so two evals can be compared example by example.  The last
line printed is the JSON summary (decoding settings included).  Engine and Ray start-up output
goes to `OUT_DIR/logs/eval.log` (`--verbose` shows it on the console too).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path

from megatron_rl.config import ConfigError
from megatron_rl.console import attach_run_dir, end_progress

logger = logging.getLogger(__name__)


def _run_config(run_dir: Path, overrides: list[str]):
    from megatron_rl.config import apply_overrides, from_dict
    from megatron_rl.run_files import read_json
    from megatron_rl.train.config import TrainConfig

    path = run_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--run {run_dir}: no config.json (not a training run directory)")
    return from_dict(TrainConfig, apply_overrides(read_json(path), list(overrides)))


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _open_manifest(out: Path, cfg, model_dir: Path, ds, prompts: dict) -> str:
    """OUT.manifest.json next to the outcomes: code, versions, hardware and the eval's inputs."""
    from megatron_rl.config import config_hash
    from megatron_rl.models.tokenizer import tokenizer_hash
    from megatron_rl.run_manifest import model_identity, open_run

    out.parent.mkdir(parents=True, exist_ok=True)
    name = f"{out.stem}.manifest.json"
    open_run(out.parent, kind="eval", config_hash=config_hash(cfg), resuming=False, name=name,
             identity={"model": model_identity(model_dir), "tokenizer_hash": tokenizer_hash(model_dir),
                       "dataset_version": ds.dataset_version, "grader_version": cfg.reward.grader_version()},
             prompts=prompts)
    return name


def _cmd_eval(args: argparse.Namespace) -> int:
    summary = run_eval(args)
    if not args.json:
        for key in ("correctness", "format", "reward", *(k for k in summary if k.startswith("pass@"))):
            value = summary[key]  # None: the reward function gives no correctness (reward/function.py)
            print(f"{key:>12}: {'n/a' if value is None else format(value, '.4f')}")
        print(f"{'errors':>12}: {summary['verifier_errors']} of {summary['responses']} responses")
    print(json.dumps(summary))
    return 0


def run_eval(args: argparse.Namespace, reward_function=None) -> dict:
    """The eval `megatron-rl eval` prints, as a dict (megatron_rl.api.evaluate calls it too); with
    `reward_function` (a Python callable) it replaces the config's reward (reward/function.py)."""
    import ray

    from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint
    from megatron_rl.evaluation import Decoding, evaluate_model, start_eval_ray
    from megatron_rl.run_manifest import close_run
    from megatron_rl.train.config import load_train_config
    from megatron_rl.data.tasks import fit_prompts, load_task

    if (args.run is None) == (args.model is None):
        raise ConfigError("give exactly one of --run RUN_DIR or --model HF_DIR")
    temperature = args.temperature if args.temperature is not None else (0.0 if args.samples == 1 else 1.0)
    decoding = Decoding(samples=args.samples, temperature=temperature, seed=args.seed)
    ks = sorted({1, args.k})
    if args.k > args.samples:
        raise ConfigError(f"--k {args.k} needs --samples >= {args.k}")
    if args.run is not None:
        run_dir = Path(args.run).resolve()
        cfg = _run_config(run_dir, args.overrides)
        model_dir = export_run_checkpoint(run_dir, args.checkpoint)
        out = Path(args.out) if args.out else run_dir / "eval" / f"{args.split}_{model_dir.name}.jsonl"
    else:
        if args.config is None:
            raise ConfigError("--model needs --config (for the data, reward and rollout settings)")
        cfg = load_train_config(args.config, args.overrides)
        model_dir = Path(args.model).resolve()
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(f"--model: no config.json in {model_dir}")
        out = Path(args.out) if args.out else Path(f"eval_{model_dir.name}_{args.split}.jsonl")
    if reward_function is not None:
        from megatron_rl.reward.function import with_callable

        cfg = dataclasses.replace(cfg, reward=with_callable(cfg.reward, reward_function))
    # vLLM and Ray start-up output goes to OUT_DIR/logs/eval.log (the console keeps the result).
    attach_run_dir(out.parent, log_name="eval.log")
    splits, template = load_task(cfg.data)
    # The prompts the engine can take, as in training (data/prompt_length.py).
    fitted = fit_prompts({args.split: splits[args.split]}, template, _tokenizer(model_dir), cfg.prompt_token_limit)
    ds = fitted.splits[args.split]
    examples = [ds[i] for i in range(min(args.limit or cfg.data.eval_size, len(ds)))]
    manifest = _open_manifest(out, cfg, model_dir, ds, fitted.record())
    start_eval_ray(cfg.run.ray_num_cpus)  # a cluster's at RAY_ADDRESS, else its own on loopback
    try:
        result = evaluate_model(model_dir, cfg.rollout, cfg.reward, examples, template, decoding, split=args.split)
    finally:
        ray.shutdown()
        close_run(out.parent, name=manifest)
    summary = result.summary(ks)
    summary.update(model=str(model_dir), dataset_version=ds.dataset_version, max_tokens=cfg.rollout.max_tokens,
                   prompts_dropped=fitted.dropped[args.split],
                   grader_version=cfg.reward.grader_version(), outcomes=str(out),
                   manifest=str(out.parent / manifest), responses=len(examples) * decoding.samples)
    result.write(out)
    end_progress()
    return summary


def register(sub) -> None:
    p = sub.add_parser("eval", help="score a policy on a held-out split (fixed decoding, pass@1 / pass@k)")
    p.add_argument("--run", help="training run directory: evaluates its newest COMMITTED checkpoint")
    p.add_argument("--checkpoint", help="with --run: this step directory instead of the newest")
    p.add_argument("--model", help="Hugging Face model directory (with --config)")
    p.add_argument("--config", help="with --model: config YAML for data, reward and rollout settings")
    p.add_argument("--split", choices=("dev", "test"), default="test", help="held-out split (default test)")
    p.add_argument("--samples", type=int, default=1, help="samples per example (default 1: greedy)")
    p.add_argument("--k", type=int, default=1, help="also report pass@k (needs --samples >= k)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default 0 for one sample, 1.0 for several)")
    p.add_argument("--seed", type=int, default=0, help="request seed (default 0)")
    p.add_argument("--limit", type=int, default=None, help="examples to score (default data.eval_size)")
    p.add_argument("--out", help="per-example outcomes JSONL")
    p.add_argument("--json", action="store_true", help="print only the JSON summary line")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the config")
    p.set_defaults(func=_cmd_eval)
