"""Prompt datasets: examples with reference answers (envs/example.py `Example`), a content-hash version,
prompt templates.

    ds = Dataset(name="mine", split="train", examples=[Example(id="0", question="1+1", answer="2")])
    ds.dataset_version                      # sha256 of the canonical content
    tmpl = PromptTemplate("Q: {question}\\nA:")
    tmpl.render(ds[0]); tmpl.encode(ds[0], tokenizer)   # tokenizer: a HF (Auto)Tokenizer

Two datasets with the same examples in the same order have the same version, whatever file or
generator they came from; change one character and the version changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from megatron_rl.config import DataError

if TYPE_CHECKING:
    from megatron_rl.envs.example import Example


def content_hash(examples: Sequence[Example]) -> str:
    """sha256 (hex) of the examples as canonical JSON, in order."""
    h = hashlib.sha256()
    for ex in examples:
        fields = [ex.id, ex.question, ex.answer] + ([ex.metadata] if ex.metadata else [])
        fields += [{"max_tokens": ex.max_tokens}] if ex.max_tokens is not None else []
        fields += [{"messages": ex.messages}] if ex.messages else []
        fields += [{"solution": ex.solution}] if ex.solution else []
        h.update(json.dumps(fields, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    split: str
    examples: tuple[Example, ...]
    dataset_version: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "examples", tuple(self.examples))
        seen: set[str] = set()
        for ex in self.examples:
            if ex.id in seen:
                raise DataError(f"dataset {self.name!r} split {self.split!r}: duplicate example id {ex.id!r}")
            seen.add(ex.id)
        version = content_hash(self.examples)
        if self.dataset_version and self.dataset_version != version:
            raise DataError(
                f"dataset {self.name!r} split {self.split!r}: dataset_version {self.dataset_version} "
                f"does not match its content hash {version}"
            )
        object.__setattr__(self, "dataset_version", version)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Example:
        return self.examples[index]

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)


_TEMPLATE_FIELDS = ("question", "id")


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A str.format template with `{question}` (required) and optionally `{id}`."""

    template: str = "{question}"
    add_special_tokens: bool = True
    """Passed to the tokenizer (e.g. to prepend BOS); raw-text prompts only."""
    chat: str = "none"
    """The chat template prompts are wrapped in (data/chat.py): "auto" (the tokenizer's own, if any), "none",
    "plain", or a Jinja template's text."""

    def __post_init__(self) -> None:
        try:
            names = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        except ValueError as err:
            raise DataError(f"prompt template {self.template!r} is malformed: {err}") from None
        unknown = [n for n in names if n not in _TEMPLATE_FIELDS]
        if unknown:
            raise DataError(f"prompt template {self.template!r}: unknown field {{{unknown[0]}}}; allowed: {list(_TEMPLATE_FIELDS)}")
        if "question" not in names:
            raise DataError(f"prompt template {self.template!r} must contain {{question}}")

    def render(self, example: Example) -> str:
        return self.template.format(question=example.question, id=example.id)

    def encode(self, example: Example, tokenizer: Any) -> list[int]:
        """Prompt token ids from a HF tokenizer (anything callable returning {"input_ids": [...]}): the
        rendered text, as one user turn of the chat template when there is one (`chat`)."""
        from megatron_rl.data.chat import chat_jinja, chat_prompt_ids
        from megatron_rl.envs.chat_format import PLAIN_TEMPLATE

        jinja = chat_jinja(self.chat, tokenizer)
        if example.messages:  # a chat prompt: its turns, in the chat template (plain when there is none)
            return chat_prompt_ids(tokenizer, json.loads(example.messages), jinja or PLAIN_TEMPLATE)
        if jinja is not None:
            return chat_prompt_ids(tokenizer, self.render(example), jinja)
        ids = tokenizer(self.render(example), add_special_tokens=self.add_special_tokens)["input_ids"]
        return [int(i) for i in ids]

    def describe(self, tokenizer: Any) -> str:
        """Which chat template the prompts get with `tokenizer`, in words."""
        from megatron_rl.data.chat import describe_chat

        return describe_chat(self.chat, tokenizer)
