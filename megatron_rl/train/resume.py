"""Which checkpoint a start resumes from: chosen once, at the top of the start, then handed on.

    ckpt = choose_resume(cfg)          # Path of the checkpoint, or None: start at step 0
    digest = check_lora(ckpt, cfg, model_dir)       # learner.lora: the base's digest; other adapters refused
    Roles.build(cfg, pool, resume_from=ckpt)        # train: run dir, queue snapshot, Checkpointer
    Checkpointer(run_dir, cfg, tokenizer_hash=h, resume_from=ckpt)   # sft

The rule: with `run.resume`, the newest COMMITTED checkpoint under RUN_DIR/checkpoints whose files
all match their sha256 (checkpoint.py `resume_checkpoint`: newer bad ones are skipped with a
warning; step directories with none intact are an error); a checkpoint saved by another learner
layout is refused before anything starts (`check_resume_world`), and so is, once the model directory is
known, a LoRA checkpoint of another base or other adapter settings (`check_lora`).  `train --dry-run` prints the
choice this rule makes (train/dry_run.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from megatron_rl.checkpoint import CheckpointError, read_manifest, resume_checkpoint
from megatron_rl.config import ConfigError
from megatron_rl.learner.config import world_size
from megatron_rl.train.config import resolved_dict

logger = logging.getLogger(__name__)


def choose_resume(cfg) -> Path | None:
    """The checkpoint this start of `cfg`'s run resumes from (verified), or None to start at step 0.
    Raises CheckpointError when none is intact, or when it was saved by another learner layout; ConfigError
    when learning keys changed since the run's config.json (check_config_change)."""
    ckpt = resume_checkpoint(Path(cfg.run.dir).resolve() / "checkpoints") if cfg.run.resume else None
    if ckpt is not None:
        check_resume_world(ckpt, cfg)
        # learning keys changed since the run's config.json: refused (ConfigError) unless allowed
        check_config_change(resolved_dict(cfg), Path(cfg.run.dir).resolve(), cfg.run.allow_config_change)
    return ckpt


def finished_summary(cfg, ckpt: Path | None) -> dict | None:
    """The summary of a run that already reached run.steps, with its final test eval logged: a rerun has
    nothing to do (it says so and exits 0, starting nothing); None otherwise."""
    from megatron_rl.metrics import logged_test_evals

    if ckpt is None:
        return None
    manifest = read_manifest(ckpt)
    step = int(manifest["step"])
    final = logged_test_evals(Path(cfg.run.dir).resolve() / "metrics" / "metrics.jsonl").get(step)
    if step < cfg.run.steps or final is None:
        return None
    first = manifest.get("extra", {}).get("initial_test_eval") or {}
    return {"steps": step, "version": int(manifest["policy_version"]),
            "initial_test_correctness": first.get("correctness"), "final_test_correctness": final["correctness"],
            "initial_test_reward": first.get("reward"), "final_test_reward": final["reward"],
            "final_test_format": final["format"], "run_dir": str(Path(cfg.run.dir).resolve()),
            "training": cfg.learner.lora.label, "already_done": True}


def learner_world(cfg) -> dict:
    """The learner layout a checkpoint records: (tensor, pipeline, data) parallel sizes."""
    lc = cfg.learner
    return {"tensor": lc.tensor_parallel_size, "pipeline": lc.pipeline_parallel_size, "data": lc.data_parallel_size}


def check_resume_world(ckpt: Path, cfg) -> None:
    """Refuse to resume `ckpt` when another learner layout saved it.

    The Megatron distributed checkpoint of model + optimizer could be resharded, but the
    per-rank RNG states and the scheduler files are keyed by rank, so a resume at another
    data-parallel (or tensor/pipeline) size would not be the run it claims to continue.
    """
    manifest = read_manifest(ckpt)
    now = learner_world(cfg)
    ranks_now = world_size(now["tensor"], now["pipeline"], now["data"])
    saved = manifest.get("extra", {}).get("learner_world")
    if saved is None:  # written before the layout was recorded: the RNG files still count the ranks
        ranks = len(manifest.get("rng", {}).get("ranks", []))
        if ranks and ranks != ranks_now:
            raise CheckpointError(f"cannot resume {ckpt}: it was saved by {ranks} learner ranks, this run has "
                                  f"{ranks_now}")
        return
    if saved != now:
        raise CheckpointError(
            f"cannot resume {ckpt}: it was saved by a learner with (tensor, pipeline, data) parallel sizes "
            f"({saved['tensor']}, {saved['pipeline']}, {saved['data']}), this run has ({now['tensor']}, "
            f"{now['pipeline']}, {now['data']}); per-rank RNG and scheduler state cannot be carried over. "
            "Use the same layout, or start a new run directory (run.resume=false ignores the checkpoint)")


def check_tokenizer(ckpt: Path, model_dir: Path) -> None:
    """Refuse (ConfigError) to resume `ckpt` when it was written with another tokenizer than `model_dir`'s."""
    from megatron_rl.config import ConfigError
    from megatron_rl.models.tokenizer import tokenizer_hash

    if not ((model_dir / "tokenizer.json").exists() or (model_dir / "tokenizer_config.json").exists()):
        return
    ours, theirs = tokenizer_hash(model_dir), read_manifest(ckpt).get("tokenizer_hash")
    if theirs and theirs != ours:
        raise ConfigError(f"checkpoint {ckpt} was written with tokenizer {theirs[:12]}..., but "
                          f"{model_dir} has tokenizer {ours[:12]}...: refusing to resume across tokenizers")


def check_lora(ckpt: Path | None, cfg, model_dir: Path) -> str | None:
    """With learner.lora: the digest of the frozen base (`model_dir`'s weights) that the run's checkpoints
    record; refuses (CheckpointError / ConfigError) to resume `ckpt` when its adapters belong to another
    base, have other learner.lora settings, or it holds none; a full-parameter run refuses a checkpoint of
    adapters.  None for a full-parameter run (models/lora_checkpoint.py)."""
    from megatron_rl.conversion.lora_io import run_base_digest
    from megatron_rl.models.lora_checkpoint import check_adapter_record, check_base_digest

    digest = run_base_digest(cfg.learner.lora, model_dir)
    if ckpt is not None:
        check_base_digest(ckpt, read_manifest(ckpt), digest, model_dir)
        check_adapter_record(ckpt / "weights", cfg.learner.lora)
    return digest


def lora_record(digest: str | None) -> dict:
    """What a checkpoint's manifest records for check_lora: the base's digest (a LoRA run), else nothing."""
    from megatron_rl.models.lora_checkpoint import BASE_DIGEST

    return {BASE_DIGEST: digest} if digest else {}


RESUME_LOCKED = (
    "loss.", "reward.", "data.", "dynamic_sampling.", "sft.",
    "learner.lr", "learner.min_lr", "learner.weight_decay", "learner.adam_", "learner.clip_grad", "learner.seed",
    "learner.lora.", "learner.global_batch_size", "learner.dtype",
    "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_tokens", "rollout.seed",
    "rollout.stop_token_ids", "rollout.ignore_eos", "rollout.dtype",
    "run.mode", "run.seed", "run.prompts_per_step", "run.group_size", "run.deterministic",
    "coordinator.max_staleness", "coordinator.max_version_lag", "coordinator.sampling", "coordinator.priority_alpha",
)
"""Keys (dotted prefixes) that shape what a run learns: a resume with one of them changed is refused."""
RESUME_FREE = ("data.eval_size", "data.train_file", "data.dev_file", "data.test_file", "model.",
               "reward.function", "reward.timeout_s", "reward.num_workers", "sft.first")
"""Exceptions: how much is evaluated; where the same inputs live and which model the run starts from
(run_manifest.json refuses other content: model, tokenizer, data, grader); how the reward is run; and what
`sft.first` rewrites in the GRPO stage's config (model.init_from, sft.first: train/sft.py sft_baseline)."""


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_on_resume(before: dict, now: dict) -> list[str]:
    """The RESUME_LOCKED keys whose value differs between a run's saved config and this attempt's, as
    "key: old -> new".  A key the saved config lacks (added by a later version, at its default) is not one."""
    old, new = _flat(before), _flat(now)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
            if k.startswith(RESUME_LOCKED) and not k.startswith(RESUME_FREE) and k in old and old[k] != new.get(k)]


def check_config_change(resolved: dict, run_dir: Path, allow: bool) -> list[str]:
    """The RESUME_LOCKED keys changed between the run's config.json (an earlier attempt's) and `resolved`
    (this attempt's, train/config.py resolved_dict): refused, naming them, unless `allow`
    (run.allow_config_change); then returned, for run_manifest.json."""
    try:
        before = json.loads((Path(run_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # no readable config of an earlier attempt: nothing to compare (its checkpoints are checked)
    changed = changed_on_resume(before, resolved) if isinstance(before, dict) else []
    if changed and not allow:
        raise ConfigError(f"refusing to resume {run_dir} with a changed config: " + "; ".join(changed)
                          + " (start a new run directory, or pass --allow-config-change)")
    if changed:
        logger.warning("resuming %s with a changed config (allowed): %s", run_dir, "; ".join(changed))
    return changed
