"""Everything checked before work starts, and the plan `train --dry-run` prints.

    plan = check_and_plan(cfg)     # raises ValueError/FileNotFoundError naming the problem

Checks: run.dir (a directory, or creatable), the model (config.json readable, architecture
supported, every safetensors file as long as its header says), the learner and rollout
layouts against the model's heads, KV heads and layers, the data (JSONL files and fields; prompts
longer than the engine takes are dropped and counted per split, a split left empty is an error),
and the checkpoint to resume from (the newest whose files match their sha256, its tokenizer
this run's).  No Ray, vLLM or
Megatron is started.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.train.config import TrainConfig
from megatron_rl.train.start_model import init_from_model_dir, resolve_model_path
from megatron_rl.config import ConfigError


def model_config(cfg: TrainConfig):
    """The HFModelConfig the run will use (a tiny spec is built in memory, not written)."""
    from megatron_rl.models.hf_config import load_hf_config

    if cfg.model.path is not None:
        return load_hf_config(cfg.model.path)
    if cfg.model.init_from is not None:
        return load_hf_config(init_from_model_dir(cfg.model.init_from))
    from megatron_rl.models.tiny import build_config

    spec = cfg.model.tiny
    return load_hf_config(build_config(spec.arch, spec.size, tie_embeddings=spec.tie_embeddings).to_dict())


def run_tokenizer(cfg: TrainConfig):
    """The tokenizer the run encodes prompts with, without making a model: the model's, or for a
    tiny spec the character tokenizer it is made with (or the one an earlier attempt wrote)."""
    from transformers import AutoTokenizer

    if cfg.model.tiny is not None:
        made = Path(cfg.run.dir) / "model"
        if not (made / "tokenizer.json").is_file():
            from megatron_rl.models.tokenizer import build_tokenizer

            return build_tokenizer()
        return AutoTokenizer.from_pretrained(str(made))
    model_dir = cfg.model.path if cfg.model.path is not None else init_from_model_dir(cfg.model.init_from)
    return AutoTokenizer.from_pretrained(str(model_dir))


def check_resume_tokenizer(cfg: TrainConfig) -> str | None:
    """The checkpoint the start will resume from (the same rule: train/resume.py `choose_resume`, which
    refuses another learner layout), refused when written with another tokenizer; its path or None."""
    from megatron_rl.train.resume import check_lora, check_tokenizer, choose_resume

    run_dir = Path(cfg.run.dir)
    ckpt = choose_resume(cfg)
    if ckpt is None:
        return None
    if cfg.model.init_from is not None:
        model_dir = init_from_model_dir(cfg.model.init_from)
    else:
        model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / "model"
    check_tokenizer(ckpt, model_dir)
    if (model_dir / "config.json").is_file():  # model.tiny not made yet: nothing to compare
        check_lora(ckpt, cfg, model_dir)  # a LoRA checkpoint: the same base and adapter settings
    return str(ckpt)


def check_run_dir(cfg: TrainConfig) -> None:
    """run.dir must be a directory or creatable as one (its nearest existing parent a directory)."""
    path = Path(cfg.run.dir).absolute()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"run.dir {cfg.run.dir}: exists and is not a directory")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"run.dir {cfg.run.dir}: cannot be created, {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"run.dir {cfg.run.dir}: cannot be created, {parent} is not writable")


def check_safetensors(path: str | Path) -> None:
    """Read a .safetensors header and check that the tensor data it describes fits the file.

    Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}, then the data (offsets relative to it).
    A file cut short (interrupted copy or download) fails here with its path, instead of deep
    inside a worker at load time.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ConfigError(f"weight file {path}: {size} bytes, too short for a safetensors header (truncated?)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise ConfigError(f"weight file {path}: header of {n} bytes does not fit the {size}-byte file (truncated?)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"weight file {path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"weight file {path}: safetensors header is not a JSON object")
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"weight file {path}: tensor {name!r} has no valid data_offsets") from None
        if not 0 <= begin <= stop:
            raise ConfigError(f"weight file {path}: tensor {name!r} has data_offsets [{begin}, {stop}]")
        end = max(end, stop)
    if 8 + n + end > size:
        raise ConfigError(f"weight file {path}: the header describes {8 + n + end} bytes, the file has {size} "
                         f"(truncated? copy or download it again)")


def check_weight_files(model_dir: str | Path) -> int:
    """check_safetensors on every *.safetensors in a model directory; returns how many."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        check_safetensors(f)
    return len(files)


def check_model_dir(model_dir: str | Path) -> None:
    """A model directory the run can start from: intact weights (safetensors) and a tokenizer, named if not."""
    if check_weight_files(model_dir) == 0:
        raise ConfigError(f"model.path {model_dir}: no *.safetensors weights there (convert a .bin checkpoint "
                          f"with transformers' save_pretrained, or point at the directory that has them)")
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"model.path {model_dir}: no tokenizer there (none of {', '.join(TOKENIZER_FILES)})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_device(cfg: TrainConfig) -> None:
    """A GPU recipe (bf16 / fp16 learner or engines, a GPU-only weight transfer) on a machine without a CUDA
    GPU is refused here, naming the keys, instead of failing once Ray and the engines are up."""
    import torch

    if torch.cuda.is_available():
        return
    gpu_keys = [f"learner.dtype {cfg.learner.dtype}" for _ in [0] if cfg.learner.dtype in ("bf16", "fp16")]
    gpu_keys += [f"rollout.dtype {cfg.rollout.dtype}" for _ in [0] if cfg.rollout.dtype in ("bfloat16", "float16")]
    gpu_keys += [f"rollout.weight_transfer {cfg.rollout.weight_transfer}" for _ in [0]
                 if cfg.rollout.weight_transfer in ("nccl", "ipc")]
    if gpu_keys:
        raise ConfigError(f"this recipe needs CUDA GPUs ({', '.join(gpu_keys)}) and this machine has none: run it "
                          f"on a GPU node, or try it here with learner.dtype=fp32 rollout.dtype=float32 "
                          f"rollout.weight_transfer=auto")


def check_answers(cfg: TrainConfig, splits: dict) -> None:
    """What would mislead late: a built-in grader that can never find a reference answer of this data (numbers
    only, answers that are not numbers).  (An eval larger than its split scores the whole split: the plan
    shows how many examples each eval takes, `data.eval_examples`.)"""
    r = cfg.reward
    if cfg.data.env.enabled:
        return
    answers = [ex.answer for ex in list(splits["test"])[:50]]
    if answers and not r.can_match_any(answers):
        raise ConfigError(f"reward.extractors {r.extractors} only find numbers, but none of the test split's first "
                          f"{len(answers)} answers is a number (e.g. {answers[0]!r}): add 'boxed' or 'answer_is', "
                          f"set data.answer_delimiter, or use reward.function")


def check_and_plan(cfg: TrainConfig) -> dict:
    from megatron_rl.coordinator.config import plan_entry
    from megatron_rl.models.hf_config import check_parallel_layout
    from megatron_rl.data.tasks import fit_prompts, load_task

    check_run_dir(cfg)
    check_device(cfg)
    if cfg.model.path is not None:  # a hub id: its snapshot in the local cache, or the way to fetch it
        cfg.model.path = str(resolve_model_path(cfg.model.path))
    hf = model_config(cfg)
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path)
    elif cfg.model.init_from is None and (Path(cfg.run.dir) / "model").is_dir():
        check_weight_files(Path(cfg.run.dir) / "model")  # the tiny model made by an earlier attempt
    lc = cfg.learner
    check_parallel_layout(hf, lc.tensor_parallel_size, lc.pipeline_parallel_size, lc.data_parallel_size)
    if hf.num_heads % cfg.rollout.tensor_parallel_size or hf.num_kv_heads % cfg.rollout.tensor_parallel_size:
        raise ConfigError(f"rollout.tensor_parallel_size {cfg.rollout.tensor_parallel_size} does not divide "
                         f"num_heads {hf.num_heads} and num_kv_heads {hf.num_kv_heads}")
    splits, template = load_task(cfg.data)
    tokenizer = run_tokenizer(cfg)
    fitted = fit_prompts(splits, template, tokenizer, cfg.prompt_token_limit)
    splits = fitted.splits
    check_answers(cfg, splits)
    resume_from = check_resume_tokenizer(cfg)  # and a resume with changed learning keys (choose_resume)
    ranks = lc.world_size
    return {
        "mode": cfg.run.mode,
        "placement": cfg.run.placement,
        "model": cfg.model.path or (cfg.model.init_from and f"init_from {cfg.model.init_from}") or f"tiny {cfg.model.tiny.arch}/{cfg.model.tiny.size} (made in {cfg.run.dir}/model)",
        "model_params": _param_count(hf),
        "learner": {"ranks": ranks, "tp": lc.tensor_parallel_size, "pp": lc.pipeline_parallel_size,
                    "dp": lc.data_parallel_size, "global_batch": lc.global_batch_size,
                    "micro_batch": lc.micro_batch_size, "micro_batches": lc.micro_batching(),
                    "distributed_optimizer": lc.use_distributed_optimizer},
        "training": lc.lora.label,
        "sft_first": cfg.sft.first,
        "rollout": {"groups": cfg.rollout.data_parallel_size, "tp": cfg.rollout.tensor_parallel_size,
                    "samples_per_step": cfg.samples_per_step, "group_size": cfg.run.group_size,
                    "max_tokens": cfg.rollout.max_tokens, "streaming": cfg.rollout.streaming},
        "environment": cfg.data.env.name if cfg.data.env.enabled else None,
        **({"environment_checks": cfg.data.env.preflight()} if cfg.data.env.enabled else {}),
        "reward": _reward_entry(cfg.reward),
        "tracking": _tracking_entry(cfg.tracking),
        "data": {"task": cfg.data.task, "train": len(splits["train"]), "dev": len(splits["dev"]),
                 "test": len(splits["test"]), "version": splits["train"].dataset_version[:16],
                 "template": template.template, **fitted.record(),
                 "prompt": _first_prompt(splits["train"], template, tokenizer),
                 "eval_examples": {k: min(cfg.data.eval_size, len(splits[k])) for k in ("dev", "test")}},
        "steps": cfg.run.steps,
        "coordinator": plan_entry(cfg.coordinator),
        "run_dir": cfg.run.dir,
        "resume_from": resume_from,
    }


def _first_prompt(train, template, tokenizer) -> dict | None:
    """The first training prompt as the policy will see it: its chat template, its text and its token count."""
    if not len(train):
        return None
    ids = template.encode(train[0], tokenizer)
    return {"chat_template": template.describe(tokenizer), "text": tokenizer.decode(ids), "tokens": len(ids)}


def _tracking_entry(tracking) -> dict:
    """Where the metrics go beside TensorBoard and metrics.jsonl; W&B without wandb installed is refused now."""
    import importlib.util

    w = tracking.wandb
    if not w.project or w.mode == "disabled":
        return {"wandb": None}
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("tracking.wandb.project is set but wandb is not installed: pip install wandb "
                          "(or unset tracking.wandb.project)")
    return {"wandb": {"project": w.project, "entity": w.entity, "mode": w.mode}}


def _reward_entry(reward) -> dict:
    """Who scores the responses: the user's function (its file digest in the grader version) or a grader."""
    who = {"function": reward.function} if reward.function else {"grader": reward.grader}
    return {**who, "grader_version": reward.grader_version(), "timeout_s": reward.timeout_s}


def _param_count(hf) -> int:
    from megatron_rl.planner.ledger import dims_from_hf

    return dims_from_hf(hf).num_params
