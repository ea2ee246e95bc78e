"""The data of a run, by task: train/dev/test splits and the prompt template.

    splits, template = load_task(cfg.data)   # cfg.data: the `data:` section (train/config.py DataConfig)
    check_encodable(splits, template, tokenizer)   # every prompt and answer survives encode -> decode
    fitted = fit_prompts(splits, template, tokenizer, cfg.prompt_token_limit)   # prompts the engine takes

Tasks: the built-in `digit_max` (builtin.py) and `running_sum` (running_sum.py), a `reasoning_gym` generator (reasoning_gym_task.py), or
`jsonl` files (jsonl.py), a held-out split without a file carved from the training file (splits.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.data.builtin import DIGIT_MAX_TEMPLATE, make_digit_max
from megatron_rl.data.chat import CHOICES
from megatron_rl.config import DataError
from megatron_rl.data.dataset import Dataset, PromptTemplate
from megatron_rl.data.jsonl import load_jsonl
from megatron_rl.data.prompt_length import FittedPrompts, fit_prompts  # noqa: F401 - a run's data steps, in one place
from megatron_rl.data.splits import holdout_splits


def load_task(d) -> tuple[dict, PromptTemplate]:
    """The task's train/dev/test splits and its prompt template, from the `data:` section (DataConfig)."""
    if d.task == "env":
        splits = environment_splits(d, d.env)
        template = PromptTemplate("{question}")  # episodes render their prompt with the chat format
    elif d.task == "digit_max":
        splits = make_digit_max(seed=d.seed)
        template = DIGIT_MAX_TEMPLATE
    elif d.task == "running_sum":
        from megatron_rl.data.running_sum import RUNNING_SUM_TEMPLATE, make_running_sum

        try:
            splits = make_running_sum(seed=d.seed, train_size=d.train_size, dev_size=d.holdout_size,
                                      test_size=d.holdout_size, **d.generator_config)
        except ValueError as err:
            raise DataError(f"task running_sum: {err} (data.generator_config, data.train_size, holdout_size)") from None
        template = RUNNING_SUM_TEMPLATE
    elif d.task == "reasoning_gym":
        from megatron_rl.data.reasoning_gym_task import REASONING_GYM_TEMPLATE, make_reasoning_gym

        splits = make_reasoning_gym(d.generator, d.generator_config, seed=d.seed, train_size=d.train_size,
                                    holdout_size=d.holdout_size)
        template = REASONING_GYM_TEMPLATE
    else:
        kw = dict(question_field=d.question_field, answer_field=d.answer_field, answer_delimiter=d.answer_delimiter,
                  fmt=d.format)
        splits = holdout_splits(load_jsonl(d.train_file, split="train", **kw),
                                dev=load_jsonl(d.dev_file, split="dev", **kw) if d.dev_file else None,
                                test=load_jsonl(d.test_file, split="test", **kw) if d.test_file else None,
                                seed=d.seed, fraction=d.holdout_fraction)
        template = PromptTemplate("{question}")
    if d.template is not None:
        template = PromptTemplate(d.template)
    if d.task != "env":  # episodes render their turns with data.env's chat format
        chat = d.chat_template
        template = dataclasses.replace(template, chat=chat if chat in CHOICES else Path(chat).read_text())
    return splits, template


def environment_splits(d, env) -> dict[str, Dataset]:
    """train / dev / test examples made by the environment itself (data.seed, seed + 1, seed + 2)."""
    from megatron_rl.envs.registry import get_environment

    if env is None or not env.enabled:
        raise DataError("data.task 'env' takes its examples from the environment, but data.env.name is unset")
    maker = get_environment(env.name, env.options)
    if not hasattr(maker, "make_examples"):
        raise DataError(f"environment {env.name!r} makes no examples of its own: give it a task "
                        f"(data.task reasoning_gym or jsonl)")
    sizes = {"train": d.train_size, "dev": d.holdout_size, "test": d.holdout_size}
    return {split: Dataset(name=f"env:{env.name}", split=split,
                           examples=maker.make_examples(size, seed=d.seed + k, prefix=split))
            for k, (split, size) in enumerate(sizes.items())}


def check_encodable(splits: dict[str, Dataset], template: PromptTemplate, tokenizer) -> None:
    """Refuse, before any work, a task whose prompts or answers the tokenizer cannot encode
    (characters that come back different after encode -> decode), naming the characters."""
    bad: dict[str, str] = {}
    for ds in splits.values():
        for ex in ds:
            for text in (ex.question if ex.messages else template.render(ex), ex.answer):
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                if tokenizer.decode(ids) != text:
                    for ch in sorted(set(text)):
                        if tokenizer.decode(tokenizer(ch, add_special_tokens=False)["input_ids"]) != ch:
                            bad.setdefault(ch, ex.id)
    if bad:
        shown = ", ".join(f"{ch!r} (e.g. {ex_id})" for ch, ex_id in list(bad.items())[:10])
        raise DataError(f"the tokenizer cannot encode {len(bad)} character(s) of this task: {shown}")
