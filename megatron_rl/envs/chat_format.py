"""Turn separators from a tokenizer's chat template: the prompt, and each observation's tokens.

    fmt = ChatFormat(tokenizer, system="...", tools=[...], observation_role="tool")
    prompt = fmt.prompt_tokens(first_observation)             # system + user turn + assistant header
    obs = fmt.observation_tokens(text, assistant_ended=True)  # end of the assistant turn, the tool
                                                              # (or user) turn, the next assistant header

Token-in/token-out: the episode never re-renders the conversation.  What the template puts between
the end of an assistant message and the start of the next one is measured once, here, by
rendering a probe conversation (placeholder texts) and cutting it at the placeholders.  An
observation is then `separator_before + text + separator_after`, tokenized once and appended.
For templates whose rendering is prefix-stable (Qwen-style ChatML), the episode's tokens equal
`apply_chat_template` of the same conversation (tests/unit/test_env_chat_format.py shows it).

The assistant turn ends with `end_of_turn` (default: the tokenizer's eos token, `<|im_end|>` for
Qwen), which the policy samples itself; when it did not (the turn was cut off), the observation
begins with it.  Special-token strings inside an observation (a tool that prints `<|im_end|>`)
are tokenized as plain text, so a tool cannot forge a turn boundary.

PLAIN_TEMPLATE is the chat template for tokenizers that have none, for episodes and for prompts alike
(`plain` of data.env.chat_template and of data.chat_template, data/chat.py).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from megatron_rl.config import ConfigError
from megatron_rl.envs.protocol import OBSERVATION_ROLES

logger = logging.getLogger(__name__)

PLAIN_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{ m.content + '\n' }}"
    "{%- elif m.role == 'user' -%}{{ 'U: ' + m.content + '\n' }}"
    "{%- elif m.role == 'tool' -%}{{ 'T: ' + m.content + '\n' }}"
    "{%- elif m.role == 'assistant' -%}{{ 'A: ' + (m.content or '') + eos_token + '\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'A: ' }}{%- endif -%}"
)
"""A chat template of plain ASCII lines for tokenizers that have none (the tiny models' character
tokenizer): `U: ` user, `T: ` tool, `A: ` assistant turns, each assistant turn ended by the EOS token."""
TEMPLATES = {"plain": PLAIN_TEMPLATE}

_Q, _A, _O = "\u2063PROBE_QUESTION\u2063", "\u2063PROBE_ANSWER\u2063", "\u2063PROBE_OBSERVATION\u2063"


def _ids(encoded: Any) -> list[int]:
    """Token ids from what apply_chat_template / a tokenizer call returns (list or BatchEncoding)."""
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def env_chat_format(cfg, tokenizer) -> "ChatFormat":
    """The chat format of an `env:` section's episodes (envs/config.py EnvConfig) with `tokenizer`: its chat
    template (cfg.template replaces the tokenizer's; a tokenizer without one gets the plain template), the
    environment's system prompt (or cfg.system_prompt)
    and tools, and the role its observations take.  One construction for rollouts and demonstrations."""
    from megatron_rl.envs.registry import get_environment

    if cfg.template is not None:
        tokenizer.chat_template = cfg.template
    elif not getattr(tokenizer, "chat_template", None):  # a tokenizer without one: the plain template, said once
        logger.warning("the tokenizer has no chat template: episodes use the plain one (data.env.chat_template)")
        tokenizer.chat_template = PLAIN_TEMPLATE
    probe = get_environment(cfg.name, cfg.options)
    try:
        system = probe.system_prompt if cfg.system_prompt is None else (cfg.system_prompt or None)
        return ChatFormat(tokenizer, system=system, tools=probe.tools, observation_role=probe.observation_role)
    finally:
        probe.close()


class ChatFormat:
    """The prompt and observation token layout of one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, *, system: str | None = None, tools: Sequence[dict] | None = None,
                 observation_role: str = "tool", end_of_turn: str | None = None,
                 template_kwargs: dict | None = None):
        if observation_role not in OBSERVATION_ROLES:
            raise ConfigError(f"observation_role {observation_role!r} is not one of {list(OBSERVATION_ROLES)}")
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat_template: multi-turn episodes need one")
        self.tokenizer = tokenizer
        self.system = system
        self.tools = list(tools) if tools else None
        self.observation_role = observation_role
        self.template_kwargs = dict(template_kwargs or {})
        self.end_of_turn = end_of_turn if end_of_turn is not None else tokenizer.eos_token
        if not self.end_of_turn:
            raise ConfigError("end_of_turn is empty and the tokenizer has no eos_token")
        eot_ids = _ids(tokenizer(self.end_of_turn, add_special_tokens=False))
        if len(eot_ids) != 1:
            raise ConfigError(f"end_of_turn {self.end_of_turn!r} is {len(eot_ids)} tokens, not one token")
        self.end_of_turn_id = eot_ids[0]
        self._before, self._after = self._measure_separators()
        self._specials = [tok for tok in getattr(tokenizer, "all_special_tokens", None) or [] if tok]
        # A fast tokenizer's own encoder: the ids its __call__ gives without special tokens, for less Python,
        # and holding the GIL (__call__ releases it in Rust and waits to get it back: on a busy rollout
        # actor's event loop a call took ~180 us against ~23 us alone, profiled on 2 cores).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def messages(self, first_observation: str) -> list[dict]:
        """The prompt as chat messages: the system message (if any) and the user's first turn."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [{"role": "user", "content": first_observation}]

    def render(self, messages: list[dict], *, add_generation_prompt: bool, tokenize: bool):
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=tokenize,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **self.template_kwargs)

    def prompt_tokens(self, first_observation: str) -> list[int]:
        """The episode's prompt: the template's rendering up to and including the assistant header."""
        return _ids(self.render(self.messages(first_observation), add_generation_prompt=True, tokenize=True))

    def observation_tokens(self, text: str, *, assistant_ended: bool) -> list[int]:
        """The tokens after an assistant turn: (end of turn,) the observation turn, the next assistant header."""
        if not isinstance(text, str):
            raise TypeError(f"an observation must be a str, got {type(text).__name__}")
        head = ("" if assistant_ended else self.end_of_turn) + self._before
        if self._has_special(text):  # tokenize the pieces apart so the text's specials stay plain text
            return (self._encode(head) + _ids(self.tokenizer(text, add_special_tokens=False,
                                                             split_special_tokens=True))
                    + self._encode(self._after))
        return self._encode(head + text + self._after)

    def _encode(self, text: str) -> list[int]:
        if not text:
            return []
        if self._backend is not None and not getattr(self._backend, "encode_special_tokens", False):
            # (a __call__ with split_special_tokens leaves the shared encoder splitting them until the next call)
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return _ids(self.tokenizer(text, add_special_tokens=False))

    def _has_special(self, text: str) -> bool:
        return any(tok in text for tok in self._specials)

    def _measure_separators(self) -> tuple[str, str]:
        """(text between an assistant's end of turn and the observation, text after the observation)."""
        probe = self.messages(_Q) + [{"role": "assistant", "content": _A}]
        try:
            rendered = self.render(probe + [{"role": self.observation_role, "content": _O}],
                                   add_generation_prompt=True, tokenize=False)
        except Exception as err:  # a template may raise on a role it does not know; name it
            raise ConfigError(f"the chat template cannot render a {self.observation_role!r} message after an "
                              f"assistant message: {type(err).__name__}: {err}") from None
        for name, marker in (("assistant", _A), ("observation", _O)):
            if rendered.count(marker) != 1:
                raise ConfigError(f"the chat template rendered the {name} probe {rendered.count(marker)} times, "
                                  f"expected once: cannot measure its turn separators")
        after_answer = rendered.split(_A, 1)[1]
        if not after_answer.startswith(self.end_of_turn):
            raise ConfigError(f"the chat template does not end an assistant turn with end_of_turn "
                              f"{self.end_of_turn!r} (it renders {after_answer[:40]!r}); set end_of_turn")
        before, after = after_answer[len(self.end_of_turn):].split(_O, 1)
        if not after:
            raise ConfigError("the chat template adds nothing after an observation: no assistant header "
                              "for the next turn (does it honour add_generation_prompt?)")
        return before, after
