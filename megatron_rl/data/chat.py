"""Chat templates for prompts: which one a run uses (`data.chat_template`), and the plain one for tokenizers
that have none.

    ids = chat_prompt_ids(tokenizer, "What is 2+2?", template)   # a user turn + the assistant header
    describe_chat(choice, tokenizer)                              # what `auto` chose, in words

`data.chat_template`: `auto` (the default) wraps each prompt in the tokenizer's own chat template when it has
one (an Instruct model is trained on the prompts it was tuned on) and leaves it raw text when it has none;
`none` always raw text; `plain` the ASCII template (envs/chat_format.py PLAIN_TEMPLATE, the episodes' too); or
a `.jinja` file.  The prompt is one user message rendered with `add_generation_prompt`, so the response starts
where the assistant's turn does.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.envs.chat_format import TEMPLATES

CHOICES = ("auto", "none", "plain")


def chat_jinja(choice: str, tokenizer: Any) -> str | None:
    """The Jinja template `choice` means with `tokenizer` (None: raw text)."""
    if choice == "none":
        return None
    if choice == "auto":
        return getattr(tokenizer, "chat_template", None) or None
    return TEMPLATES.get(choice, choice)


def describe_chat(choice: str, tokenizer: Any) -> str:
    """Which template prompts get, in words (the run's log and the dry run say it)."""
    if choice == "auto":
        return ("the tokenizer's own chat template (data.chat_template auto)" if chat_jinja(choice, tokenizer)
                else "raw text: the tokenizer has no chat template (data.chat_template auto)")
    if choice == "none":
        return "raw text (data.chat_template none)"
    return "the plain chat template" if choice == "plain" else "the chat template of data.chat_template"


def _ids(encoded: Any) -> list[int]:
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def chat_prompt_ids(tokenizer: Any, text: str | list[dict], template: str) -> list[int]:
    """`text` as one user turn (or a list of {role, content} turns) in `template`, ending with the assistant
    header, as token ids."""
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    return _ids(tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                              tokenize=True))
