"""Supervised fine-tuning: the baseline a GRPO run starts from and is measured against.

    megatron-rl sft --config configs/tiny_cpu.yaml run.dir=runs/sft [sft.steps=100 ...]
    megatron-rl train --config configs/tiny_cpu.yaml run.dir=runs/grpo model.init_from=runs/sft model.tiny=null

Each step takes `sft.global_batch_size` (default: the GRPO batch) training examples from the data cursor and
minimises the mean negative log-likelihood of the reference answer (then EOS) given the prompt,
over response tokens only (the prompt is context, never a target):

    L = -(1/N) sum_b sum_t m_bt log pi_theta(y_bt | y_b<t),   N = sum of m over the global batch

With `data.env` (multi-turn episodes) each example is instead played by its environment's expert
(`Environment.expert`, envs/demonstrations.py), token-in/token-out as a rollout would lay it out, and m is
the episode's action mask: the assistant turns are learned, the observations are context only.

on the same Megatron learner, parallel layouts and checkpoint protocol (COMMITTED written last)
as GRPO; metrics go to the `sft/` panel.  At the end the newest checkpoint is exported to a
Hugging Face directory (`RUN_DIR/export/step_N`), which a fresh vLLM engine evaluates on the
hidden test split (greedy): the baseline number.  `model.init_from: RUN_DIR` starts a GRPO run
from that export.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from megatron_rl.train.sft_data import sft_batches

logger = logging.getLogger(__name__)


def sft(cfg, pool=None, *, before=None) -> dict:
    """Run (or resume) supervised fine-tuning; returns a summary with the test-split baseline.  `pool`: the
    experiment runner's engine pool (train/engine_pool.py), whose parked sft learner actors it rebuilds, or None.
    `before`: the config of the GRPO run that follows (sft.first).  That run evaluates the same weights at its
    step 0, on its own engines, so no test eval here (no engine is started; the summary has no test figures),
    and with a pool the learner actors are built in its placement and left to it.

    The same parts as GRPO's driver: the learner group, the Checkpointer (resume point chosen once,
    train/resume.py; one cadence) and the Reporter (metrics, console line, the final test eval logged once)."""
    import ray

    from megatron_rl.train.checkpointing import Checkpointer
    from megatron_rl.train.engine_pool import release_sft_learners, sft_learner_group
    from megatron_rl.reporting.reporter import Reporter, metrics_logger
    from megatron_rl.train.resume import choose_resume
    from megatron_rl.train.run_setup import close_run_dir, open_run_dir, start_ray, train_cursor

    resume_from = choose_resume(cfg)  # once: handed to the run dir and the Checkpointer
    inputs = open_run_dir(cfg, kind="sft", resuming=resume_from is not None)
    run_dir = inputs.run_dir
    cursor = train_cursor(cfg, inputs.splits["train"])
    checkpointer = Checkpointer(run_dir, cfg, tokenizer_hash=inputs.tokenizer_hash, resume_from=resume_from)
    lc = _sft_learner_config(cfg)
    own_ray = start_ray(cfg)
    learner = report = None
    try:  # with a pool: the last sft run's learner actors, rebuilt (train/engine_pool.py)
        make_batch = sft_batches(cfg, inputs, lc.micro_batch_size)  # before any actor: no expert stops here
        learner = sft_learner_group(pool, before=before, learner=lc, loss=cfg.loss.without_kl(),
                                    hf_dir=str(inputs.model_dir), seed=lc.seed, deterministic=cfg.run.deterministic,
                                    threads=cfg.run.torch_threads)
        manifest = checkpointer.restore(learner, cursor)
        start = int(manifest["step"]) if manifest is not None else 0
        if manifest is not None:
            logger.info("resumed SFT from %s at step %d", resume_from, start)
        resolved = json.loads((run_dir / "config.json").read_text())
        report = Reporter(run_dir, metrics_logger(run_dir, cfg.tracking, resolved), None,
                          ExportEvaluator(cfg, inputs), steps=cfg.sft.steps)
        report.rewind(start)  # steps after the checkpoint are redone: log them once
        _train(cfg, lc, inputs, learner, cursor, checkpointer, report, start, make_batch)
        release_sft_learners(learner, pool, placed=before is not None)  # with a pool: kept for the next run
        learner = None
        if before is not None:
            return {"steps": cfg.sft.steps, "run_dir": str(run_dir)}
        result = report.final_eval(cfg.sft.steps)  # an attempt that ended here logged it: taken from there
        return {"steps": cfg.sft.steps, "test_correctness": result["correctness"], "test_reward": result["reward"],
                "test_format": result["format"], "run_dir": str(run_dir)}
    finally:
        if learner is not None:
            learner.shutdown()
        if report is not None:
            report.close()
        if own_ray:
            ray.shutdown()
        close_run_dir(run_dir)


def _sft_learner_config(cfg):
    """The learner's config with sft.lr and sft.global_batch_size where they are set.  SFT trains every
    parameter, also before a LoRA run: its result is the base the run's adapters sit on."""
    return dataclasses.replace(cfg.learner, lr=cfg.sft.lr if cfg.sft.lr is not None else cfg.learner.lr,
                               global_batch_size=cfg.sft.global_batch_size or cfg.learner.global_batch_size,
                               lora=dataclasses.replace(cfg.learner.lora, enabled=False))


def _train(cfg, lc, inputs, learner, cursor, checkpointer, report, start: int, make_batch) -> None:
    """Steps start+1 .. sft.steps: a batch from the cursor, one learner step, its report, checkpoints on the
    cadence (Checkpointer.due: the same rule as GRPO's)."""
    train = inputs.splits["train"]
    for step in range(start, cfg.sft.steps):
        t0 = time.perf_counter()
        out = learner.sft_step(make_batch([train[i] for i in cursor.next_indices(lc.global_batch_size)]))
        report.log_sft_step(step + 1, out, time.perf_counter() - t0)
        if checkpointer.due(step + 1, cfg.sft.steps):
            checkpointer.commit(step + 1, step + 1, learner, cursor, extra={"kind": "sft"})


class ExportEvaluator:
    """SFT's evaluator for the Reporter (`run(step, split)`): the newest checkpoint exported to a Hugging Face
    directory (RUN_DIR/export/step_N), greedy pass@1 on the hidden test split on a fresh vLLM engine."""

    def __init__(self, cfg, inputs):
        self.cfg, self.inputs = cfg, inputs

    def run(self, step: int, split: str) -> dict:
        from megatron_rl.conversion.mcore_to_hf import export_run_checkpoint
        from megatron_rl.evaluation import Decoding, evaluate_model

        if split != "test":
            raise ValueError(f"an SFT run evaluates the test split only, not {split!r}")
        cfg, inputs = self.cfg, self.inputs
        model_dir = export_run_checkpoint(inputs.run_dir)
        ds = inputs.splits["test"]
        examples = [ds[i] for i in range(min(cfg.data.eval_size, len(ds)))]
        env = dataclasses.asdict(cfg.data.env) if cfg.data.env.enabled else None  # episodes of its environment
        result = evaluate_model(model_dir, cfg.rollout, cfg.reward, examples, inputs.template, Decoding(),
                                split="test", env=env)
        result.write(inputs.run_dir / "eval" / f"test_step_{step:06d}.jsonl")
        return result.summary()


SFT_SUMMARY = "sft_summary.json"


def sft_baseline(cfg, pool=None) -> tuple[object, dict]:
    """`sft.first`: run (or reuse) SFT in RUN_DIR/sft, then the GRPO config that starts from it.

    Returns (grpo_cfg, sft_summary).  A finished SFT stage (its summary written once it ended, for the
    same config) is reused as it is, so a resumed GRPO run does not redo it.  The SFT stage runs no test
    eval of its own: the baseline's test figures are the GRPO run's step-0 eval (the same weights, on the
    GRPO run's engines), which its checkpoints keep for a resumed run.
    """
    import json

    from megatron_rl.config import config_hash

    sft_dir = Path(cfg.run.dir).resolve() / "sft"
    sft_cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=str(sft_dir)))
    done = sft_dir / SFT_SUMMARY
    summary = json.loads(done.read_text()) if done.is_file() else None
    model = dataclasses.replace(cfg.model, init_from=str(sft_dir), tiny=None, path=None)
    grpo_cfg = dataclasses.replace(cfg, model=model, sft=dataclasses.replace(cfg.sft, first=False))
    if summary is None or summary.get("config_hash") != config_hash(sft_cfg):
        summary = {**sft(sft_cfg, pool, before=grpo_cfg), "config_hash": config_hash(sft_cfg)}
        done.write_text(json.dumps(summary))
    else:
        logger.info("SFT baseline %s already finished: reusing it", sft_dir)
    return grpo_cfg, summary
