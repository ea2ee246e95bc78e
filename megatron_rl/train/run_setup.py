"""What every run (train, sft, eval) does first, before Ray, vLLM or Megatron start: the run
directory with its resolved config, seeds, the model to start from, its tokenizer and the data
(megatron_rl/data/tasks.py).

    inputs = open_run_dir(cfg, kind="train")   # RunInputs: run_dir, model_dir, tokenizer, splits, template
    cursor = train_cursor(cfg, inputs.splits["train"])   # the order training visits its examples
    own_ray = start_ray(cfg)                              # connect to or start Ray; True if this run started it

A resume with other inputs (model, tokenizer, data, grader) is refused by run_manifest.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_rl.config import config_hash
from megatron_rl.data import DataCursor, Dataset, PromptTemplate
from megatron_rl.data.tasks import check_encodable, fit_prompts, load_task
from megatron_rl.train.config import TrainConfig, data_order_seed, resolved_dict
from megatron_rl.platform.local_ray import NODE_LOCAL, local_ray_options
from megatron_rl.train.start_model import prepare_model

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclasses.dataclass(frozen=True)
class RunInputs:
    """The inputs a run opened: where it writes, the policy it starts from, tokenizer and data."""

    run_dir: Path
    model_dir: Path
    tokenizer: PreTrainedTokenizerBase
    """The Hugging Face tokenizer of model_dir."""
    tokenizer_hash: str
    splits: dict[str, Dataset]
    """{"train", "dev", "test"}: the task's datasets."""
    template: PromptTemplate
    """The PromptTemplate that encodes an example into prompt tokens."""
    prompts_dropped: dict[str, int] = dataclasses.field(default_factory=dict)
    """Prompts over the run's prompt_token_limit dropped from each split (data/prompt_length.py)."""
    base_digest: str | None = None
    """A LoRA training run's: the digest of its frozen base (model_dir's weights) its checkpoints record."""

    @property
    def vocab_size(self) -> int:
        return int(json.loads((self.model_dir / "config.json").read_text())["vocab_size"])

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0


def open_run_dir(cfg: TrainConfig, kind: str, *, resuming: bool = False, resume_from: Path | None = None) -> RunInputs:
    """What every run (train, sft) does first, before any Ray/vLLM/Megatron start: the run
    directory with its resolved config, seeds, the model to start from, its tokenizer, the data
    splits (checked encodable; prompts longer than the engine takes dropped and counted), and
    run_manifest.json (a resume with other inputs is refused).  `resuming`: this start resumes a
    checkpoint (train/resume.py `choose_resume` chose one); a training run with learner.lora is given it
    (`resume_from`): its adapters must belong to this base and these adapter settings (resume.py check_lora).

    Returns the RunInputs.
    """
    from transformers import AutoTokenizer

    from megatron_rl.models.tokenizer import tokenizer_hash
    from megatron_rl.run_manifest import model_identity, open_run
    from megatron_rl.ranks.build import seed_everything
    from megatron_rl.train.resume import check_config_change, check_lora

    environment = cfg.data.env.preflight()  # e.g. the sandbox this node gives: refused before anything is written
    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    changed = check_config_change(resolved_dict(cfg), run_dir, cfg.run.allow_config_change) if resuming else []
    (run_dir / "config.json").write_text(json.dumps(resolved_dict(cfg), indent=2, sort_keys=True))
    seed_everything(cfg.run.seed, cfg.run.deterministic, cfg.run.torch_threads)
    model_dir = prepare_model(cfg.model, run_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    splits, template = load_task(cfg.data)
    if cfg.data.task != "env":
        logger.info("prompts: %s", template.describe(tokenizer))
    check_encodable(splits, template, tokenizer)
    fitted = fit_prompts(splits, template, tokenizer, cfg.prompt_token_limit)
    splits = fitted.splits
    tok_hash = tokenizer_hash(model_dir)
    digest = check_lora(resume_from, cfg, model_dir) if kind == "train" else None  # SFT trains every parameter
    open_run(run_dir, kind=kind, config_hash=config_hash(cfg),
             resuming=resuming, model_dir=model_dir,
             prompts=fitted.record(), training=cfg.learner.lora.label if kind == "train" else "full",
             config_changed=changed, environment=environment,
             identity={"model": model_identity(model_dir), "tokenizer_hash": tok_hash,
                       "dataset_version": splits["train"].dataset_version,
                       "grader_version": cfg.reward.grader_version()})
    return RunInputs(run_dir, model_dir, tokenizer, tok_hash, splits, template, fitted.dropped, digest)

def close_run_dir(run_dir: Path) -> None:
    """The end of this attempt, in run_manifest.json (open_run_dir began it)."""
    from megatron_rl.run_manifest import close_run

    close_run(run_dir)


def train_cursor(cfg: TrainConfig, train) -> DataCursor:
    """The data cursor over the training split: its order follows data.seed and run.seed."""
    return DataCursor(len(train), seed=data_order_seed(cfg), dataset_version=train.dataset_version)


def job_env_vars(environ=os.environ) -> dict[str, str]:
    """The variables a run's actors must see as the driver does (MEGATRON_RL_*: drills' faults, test
    settings).  A Ray this run starts hands its whole environment to its workers; workers of a cluster
    started elsewhere have that cluster's environment, so a run joining one passes these in its job's
    runtime_env.  Not the driver's node's listening address (MEGATRON_RL_BIND_ADDRESS): each node has its own."""
    return {k: v for k, v in environ.items() if k.startswith("MEGATRON_RL_") and k not in NODE_LOCAL}


def start_ray(cfg: TrainConfig) -> bool:
    """Connect to (run.use_existing_ray) or start Ray unless it is up; True when this run started it.  The job
    carries the run's MEGATRON_RL_* settings and its own code's packages (EnvConfig / RewardConfig
    package_dirs: megatron_rl/plugins.py) to every worker.  A Ray the run starts listens on loopback only
    and authenticates with a private token (platform/local_ray.py)."""
    import ray

    if ray.is_initialized():
        return False
    run, modules = cfg.run, [*cfg.data.env.package_dirs(), *cfg.reward.package_dirs()]
    env_vars = job_env_vars() if run.use_existing_ray else {}
    runtime_env = {k: v for k, v in (("env_vars", env_vars), ("py_modules", modules)) if v} or None
    if run.use_existing_ray:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING,
                 runtime_env=runtime_env)
    else:
        ray.init(num_cpus=run.ray_num_cpus, logging_level=logging.WARNING, runtime_env=runtime_env,
                 **local_ray_options())
    return True
