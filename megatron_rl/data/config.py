"""The `data:` section: which task a run trains on and how its prompts are made.

    data:
      task: reasoning_gym            # digit_max, running_sum (built in), jsonl, reasoning_gym, or env (its own)
      generator: basic_arithmetic
      env: {name: calculator}        # multi-turn episodes with a tool (envs/config.py); unset: single-turn

Read by data/tasks.py `load_task`; the root config (train/config.py) checks it against the others.
"""

from __future__ import annotations

from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from megatron_rl.config import ConfigError
from megatron_rl.envs.config import EnvConfig

RUNNING_SUM_OPTIONS = {"min_digits", "max_digits", "carry_slip", "slip_from"}
"""data.generator_config keys of task running_sum: make_running_sum's options (data/running_sum.py)."""


@dataclass(kw_only=True)
class DataConfig:
    task: Literal["digit_max", "running_sum", "jsonl", "reasoning_gym", "env"] = "digit_max"
    """A built-in verifiable task (digit_max: one-token answers; running_sum: worked steps before the answer,
    data/running_sum.py), a JSONL file of math problems, a reasoning-gym generator, or examples the
    environment makes itself (env.name's make_examples, e.g. guess_number's hidden numbers)."""
    generator: Optional[str] = None
    """reasoning-gym dataset name, e.g. chain_sum, basic_arithmetic, countdown (task=reasoning_gym)."""
    generator_config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the reasoning-gym generator (task=reasoning_gym), or running_sum's min_digits,
    max_digits, carry_slip and slip_from (task=running_sum; data/running_sum.py)."""
    train_size: int = 2000
    """Training examples drawn from the generator (task=reasoning_gym, running_sum or env)."""
    holdout_size: int = 200
    """Examples drawn for each of dev and test (task=reasoning_gym, running_sum or env)."""
    seed: int = 0
    """Seed that freezes the task's train/dev/test split (the order training visits examples
    follows run.seed, so runs of different seeds share the held-out sets)."""
    train_file: Optional[str] = None
    """Training data (task=jsonl): a JSONL file, a Parquet file or a Hugging Face datasets save_to_disk
    directory (data.format)."""
    format: str = "auto"
    """How the data files are read: auto (by suffix; a directory is a datasets directory), jsonl, parquet, hf."""
    dev_file: Optional[str] = None
    """JSONL dev split, evaluated during training (task=jsonl); None carves it from train_file."""
    test_file: Optional[str] = None
    """JSONL hidden test split, evaluated at the start and end only (task=jsonl); None carves it from train_file."""
    holdout_fraction: float = 0.1
    """Share of train_file carved (with data.seed) into each held-out split that has no file."""
    question_field: str = "question"
    """JSONL field holding the problem text."""
    answer_field: str = "answer"
    """JSONL field holding the reference answer."""
    answer_delimiter: Optional[str] = None
    """Keep only the answer text after the last occurrence of this (GSM8K: "####"); None keeps it whole."""
    template: Optional[str] = None
    """Prompt template with {question}; None takes the task's own."""
    chat_template: str = "auto"
    """The chat template single-turn prompts are wrapped in (data/chat.py): auto (the tokenizer's own when it
    has one, else raw text), none (raw text), plain, or a .jinja file."""
    eval_size: int = 100
    """Held-out examples scored at each evaluation (<= the split's size)."""
    max_prompt_tokens: Optional[int] = None
    """Longest prompt kept, in tokens as the rollout encodes it (template applied); longer ones are
    dropped from every split before the run, counted per split in the log, the run manifest and
    `--dry-run`.  None: rollout.max_model_len - rollout.max_tokens (the room a prompt has next to a
    whole response); a larger value is refused."""

    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes with an environment (envs/config.py): off while data.env.name is unset."""

    def __post_init__(self) -> None:
        from megatron_rl.data.chat import CHOICES
        from megatron_rl.data.jsonl import FORMATS

        if self.format not in FORMATS:
            raise ConfigError(f"data.format must be one of {list(FORMATS)}, got {self.format!r}")

        if self.chat_template not in CHOICES:
            path = Path(self.chat_template).expanduser()
            if path.suffix != ".jinja" or not path.is_file():
                raise ConfigError(f"data.chat_template must be one of {list(CHOICES)} or an existing .jinja file, "
                                  f"got {self.chat_template!r}")
            self.chat_template = str(path.resolve())
        if self.task == "env" and not self.env.enabled:
            raise ConfigError("data.task 'env' takes its examples from the environment, but data.env.name is unset")
        if self.task == "jsonl" and not self.train_file:
            raise ConfigError("data.train_file is required when data.task is 'jsonl'")
        if self.task == "running_sum" and not set(self.generator_config) <= RUNNING_SUM_OPTIONS:
            raise ConfigError(f"data.generator_config of task running_sum takes "
                              f"{', '.join(sorted(RUNNING_SUM_OPTIONS))}, got {sorted(self.generator_config)}")
        if self.task == "reasoning_gym" and not self.generator:
            raise ConfigError("data.generator (a reasoning-gym dataset name) is required when data.task is "
                              "'reasoning_gym'")
        if self.eval_size < 1:
            raise ConfigError(f"data.eval_size must be >= 1, got {self.eval_size}")
        if not 0 < self.holdout_fraction < 0.5:
            raise ConfigError(f"data.holdout_fraction must be in (0, 0.5), got {self.holdout_fraction}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"data.max_prompt_tokens must be >= 1 (or unset), got {self.max_prompt_tokens}")
