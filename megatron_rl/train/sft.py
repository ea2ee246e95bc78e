"""Supervised fine-tuning: the baseline a GRPO run starts from and is measured against.

    megatron-rl sft --config configs/tiny_cpu.yaml run.dir=runs/sft [sft.steps=100 ...]
    megatron-rl train --config configs/tiny_cpu.yaml run.dir=runs/grpo model.init_from=runs/sft model.tiny=null

Each step takes `sft.global_batch_size` (default: the GRPO batch) training examples from the data cursor and
minimises the mean negative log-likelihood of the reference answer (then EOS) given the prompt,
over response tokens only (the prompt is context, never a target):

    L = -(1/N) sum_b sum_t m_bt log pi_theta(y_bt | y_b<t),   N = sum of m over the global batch

on the same Megatron learner, parallel layouts and checkpoint protocol (COMMITTED written last)
as GRPO; metrics go to the `sft/` panel.  At the end the newest checkpoint is exported to a
Hugging Face directory (`RUN_DIR/export/step_N`), which a fresh vLLM engine evaluates on the
hidden test split (greedy): the baseline number.  `model.init_from: RUN_DIR` starts a GRPO run
from that export.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def sft_batch(examples: Sequence, template, tokenizer, *, micro_batch_size: int) -> dict:
    """tokens [B, T] (prompt + answer + EOS, right-padded), loss_mask [B, T-1] on the answer and
    EOS predictions, lengths [B], and the batch's token count in the loss (the normaliser)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    if eos is None:
        raise ValueError("SFT needs a tokenizer with an EOS token (the answer must learn to end)")
    rows = []
    for ex in examples:
        prompt = template.encode(ex, tokenizer)
        answer = [int(i) for i in tokenizer(ex.answer, add_special_tokens=False)["input_ids"]] + [int(eos)]
        rows.append((prompt, answer))
    b, t = len(rows), max(len(p) + len(a) for p, a in rows)
    tokens = torch.full((b, t), pad, dtype=torch.long)  # [B, T]
    mask = torch.zeros(b, t - 1)  # [B, T-1]: position k predicts token k+1
    for i, (p, a) in enumerate(rows):
        tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1:len(p) - 1 + len(a)] = 1.0
    micro_batches = b // micro_batch_size
    n = max(float(mask.sum()), 1.0)
    lengths = torch.tensor([len(p) + len(a) for p, a in rows], dtype=torch.long)  # [B] real tokens per row
    # N travels as it is (the learner gives each micro-batch its step's K); N/K for fixed
    # micro-batches of micro_batch_size is kept for callers outside the learner.
    return {"tokens": tokens, "loss_mask": mask, "lengths": lengths, "tokens_in_loss": n,
            "token_denominator": n / micro_batches}


def sft(cfg, pool=None) -> dict:
    """Run (or resume) supervised fine-tuning; returns a summary with the test-split baseline.  `pool`: the
    experiment runner's engine pool (train/engine_pool.py), whose parked sft learner actors it rebuilds, or None."""
    import ray

    from megatron_rl.checkpoint import resume_checkpoint
    from megatron_rl.metrics import MetricsLogger, logged_test_evals
    from megatron_rl.run_manifest import close_run
    from megatron_rl.train.engine_pool import release_sft_learners, sft_learner_group
    from megatron_rl.train.run_setup import open_run_dir, start_ray, train_cursor

    inputs = open_run_dir(cfg, kind="sft")
    run_dir = inputs.run_dir
    resume_from = resume_checkpoint(run_dir / "checkpoints") if cfg.run.resume else None
    cursor = train_cursor(cfg, inputs.splits["train"])
    lc = _sft_learner_config(cfg)
    own_ray = start_ray(cfg.run)
    learner = metrics = None
    try:  # with a pool: the last sft run's learner actors, rebuilt (train/engine_pool.py)
        learner = sft_learner_group(pool, learner=lc, loss=dataclasses.replace(cfg.loss, kl_coef=0.0),
                                    hf_dir=str(inputs.model_dir), seed=lc.seed, deterministic=cfg.run.deterministic,
                                    threads=cfg.run.torch_threads)
        start = 0 if resume_from is None else _resume(resume_from, inputs, learner, cursor)
        metrics = MetricsLogger(run_dir / "metrics")
        metrics.rewind(start if start else -1)  # steps after the checkpoint are redone: log them once
        logged = logged_test_evals(run_dir / "metrics" / "metrics.jsonl").get(cfg.sft.steps)
        _train(cfg, lc, inputs, learner, cursor, metrics, start)
        release_sft_learners(learner, pool)  # with a pool: kept for the next sft run
        learner = None
        if logged is not None and start == cfg.sft.steps:  # an earlier attempt ended here and evaluated
            result = logged
            logger.info("SFT had ended at step %d; its final test eval was logged then: correctness %.3f",
                        start, result["correctness"])
        else:
            result = _export_and_evaluate(cfg, inputs, metrics)
        return {"steps": cfg.sft.steps, "test_correctness": result["correctness"], "test_reward": result["reward"],
                "test_format": result["format"], "run_dir": str(run_dir)}
    finally:
        if learner is not None:
            learner.shutdown()
        if metrics is not None:
            metrics.close()
        if own_ray:
            ray.shutdown()
        close_run(run_dir)


def _sft_learner_config(cfg):
    """The learner's config with sft.lr and sft.global_batch_size where they are set.  SFT trains every
    parameter, also before a LoRA run: its result is the base the run's adapters sit on."""
    return dataclasses.replace(cfg.learner, lr=cfg.sft.lr if cfg.sft.lr is not None else cfg.learner.lr,
                               global_batch_size=cfg.sft.global_batch_size or cfg.learner.global_batch_size,
                               lora=dataclasses.replace(cfg.learner.lora, enabled=False))


def _resume(resume_from: Path, inputs, learner, cursor) -> int:
    """Load checkpoint `resume_from` into the learner and the data cursor; the step to start at."""
    from megatron_rl.checkpoint import load_checkpoint, load_rng_state

    manifest = load_checkpoint(resume_from, tokenizer_hash=inputs.tokenizer_hash)
    learner.load(str(resume_from / "weights"))
    learner.set_rng_states({r: load_rng_state(resume_from, r) for r in manifest["rng"]["ranks"]})
    cursor.load_state_dict(manifest["data_cursor"])
    logger.info("resumed SFT from %s at step %d", resume_from, int(manifest["step"]))
    return int(manifest["step"])


def _train(cfg, lc, inputs, learner, cursor, metrics, start: int) -> None:
    """Steps start+1 .. sft.steps: a batch from the cursor, one learner step, metrics, checkpoints."""
    from megatron_rl.console import progress
    from megatron_rl.train.telemetry import sft_progress_line

    train, seconds = inputs.splits["train"], []
    for step in range(start, cfg.sft.steps):
        t0 = time.perf_counter()
        examples = [train[i] for i in cursor.next_indices(lc.global_batch_size)]
        batch = sft_batch(examples, inputs.template, inputs.tokenizer, micro_batch_size=lc.micro_batch_size)
        out = learner.sft_step(batch)
        step_s = time.perf_counter() - t0
        metrics.log(step + 1, {"sft/loss": out["loss"], "sft/nll_per_token": out["nll_sum"] / max(out["tokens"], 1),
                               "sft/tokens": out["tokens"], "sft/grad_norm": out["grad_norm"], "sft/lr": out["lr"],
                               "latency/sft_step_s": step_s})
        seconds.append(step_s)
        progress(sft_progress_line(step + 1, cfg.sft.steps, out, sum(seconds) / len(seconds),
                                   float(out["tokens"]) / max(step_s, 1e-9)), step=step + 1, total=cfg.sft.steps)
        due = cfg.run.checkpoint_every and (step + 1) % cfg.run.checkpoint_every == 0
        if due or step + 1 == cfg.sft.steps:
            _save(cfg, inputs, learner, cursor, step + 1)


def _save(cfg, inputs, learner, cursor, step: int) -> None:
    """Checkpoint `step` (weights, data cursor, RNG states; COMMITTED last) and rotate old ones."""
    from megatron_rl.checkpoint import rotate, save_checkpoint
    from megatron_rl.config import config_hash

    ckpts = inputs.run_dir / "checkpoints"
    save_checkpoint(ckpts, step, policy_version=step, config_hash=config_hash(cfg),
                    save_fn=lambda tmp: learner.save(str(tmp / "weights")), tokenizer_hash=inputs.tokenizer_hash,
                    data_cursor=cursor.state_dict(), rng_states=learner.rng_states(), extra={"kind": "sft"})
    rotate(ckpts, cfg.run.keep_checkpoints)


def _export_and_evaluate(cfg, inputs, metrics) -> dict:
    """Export the newest checkpoint to Hugging Face format, evaluate it on the test split, log the result."""
    from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint

    result = _final_eval(cfg, export_run_checkpoint(inputs.run_dir), inputs.splits, inputs.template)
    metrics.log(cfg.sft.steps, {f"eval/test_{k}": result[k] for k in ("reward", "correctness", "format")})
    return result


SFT_SUMMARY = "sft_summary.json"


def sft_baseline(cfg, pool=None) -> tuple[object, dict]:
    """`sft.first`: run (or reuse) SFT in RUN_DIR/sft, then the GRPO config that starts from it.

    Returns (grpo_cfg, sft_summary).  A finished SFT stage (its summary written after its final
    eval, for the same config) is reused as it is, so a resumed GRPO run does not redo it.
    """
    import json

    from megatron_rl.config import config_hash

    sft_dir = Path(cfg.run.dir).resolve() / "sft"
    sft_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(sft_dir)))
    done = sft_dir / SFT_SUMMARY
    summary = json.loads(done.read_text()) if done.is_file() else None
    if summary is None or summary.get("config_hash") != config_hash(sft_cfg):
        summary = {**sft(sft_cfg, pool), "config_hash": config_hash(sft_cfg)}
        done.write_text(json.dumps(summary))
    else:
        logger.info("SFT baseline %s already finished: reusing it", sft_dir)
    model = dataclasses.replace(cfg.model, init_from=str(sft_dir), tiny=None, path=None)
    grpo_cfg = dataclasses.replace(cfg, model=model, sft=dataclasses.replace(cfg.sft, first=False))
    return grpo_cfg, summary


def _final_eval(cfg, model_dir: Path, splits, template) -> dict:
    """Greedy pass@1 of the exported policy on the hidden test split, on a fresh vLLM engine."""
    from megatron_rl.evaluation import Decoding, evaluate_model

    ds = splits["test"]
    examples = [ds[i] for i in range(min(cfg.data.eval_size, len(ds)))]
    result = evaluate_model(model_dir, cfg.rollout, cfg.reward, examples, template, Decoding(), split="test")
    result.write(Path(cfg.run.dir).resolve() / "eval" / f"test_step_{cfg.sft.steps:06d}.jsonl")
    return result.summary()
