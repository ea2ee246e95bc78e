"""One task example: a question (or a chat prompt), its reference answer, and what a verifier or a reward
function is given about it.

    ex = Example(id="0", question="1+1", answer="2")
    ex.reference            # what the verifier receives (the answer, or the task entry as JSON)
    ex.reward_fields()      # what a reward function (reward.function) gets beside prompt and response

Made by the data tasks (data/: builtin.py, jsonl.py, reasoning_gym_task.py, running_sum.py; kept in a
data/dataset.py `Dataset`) and by an environment that makes its own (envs/guess_number.py
`make_examples`); an episode starts from one (envs/protocol.py `Environment.reset`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from megatron_rl.config import DataError


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt of a task and its reference answer."""

    id: str
    """Stable identifier, unique within the dataset."""
    question: str
    """The problem text substituted into the prompt template."""
    answer: str
    """Reference final answer the verifier compares against."""
    metadata: str = ""
    """Generator metadata as JSON (reasoning-gym tasks; their scorers may read it), else empty."""
    max_tokens: int | None = None
    """This prompt's response budget in tokens (a JSONL row's `max_tokens`): its samples stop after
    min(max_tokens, rollout.max_tokens) tokens.  None: rollout.max_tokens alone."""
    messages: str = ""
    """A chat prompt as JSON ([{role, content}, ...], a data row's `messages`), rendered with the chat template
    in place of the prompt template; empty for a question prompt."""
    solution: str = ""
    """A worked solution that ends in the answer (running_sum's steps): SFT's target when set, else the answer.
    The verifier still compares against `answer`."""

    def __post_init__(self) -> None:
        budget = self.max_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise DataError(f"example {self.id!r}: max_tokens must be an int >= 1 (or unset), got {budget!r}")

    def reward_fields(self) -> dict[str, Any]:
        """What a reward function (reward.function) gets beside the prompt and the response: the answer, the
        question, the id and the metadata's keys (prompt, response and answer are its own arguments)."""
        fields: dict[str, Any] = {}
        meta = json.loads(self.metadata) if self.metadata else None
        if isinstance(meta, dict):
            fields.update({k: v for k, v in meta.items() if k not in ("prompt", "response", "answer")})
        if self.messages:
            fields["messages"] = json.loads(self.messages)
        return {**fields, "question": self.question, "id": self.id, "answer": self.answer}

    @property
    def reference(self) -> str:
        """What the verifier receives: the answer, or the whole task entry as JSON when the
        example carries generator metadata (reward.grader reasoning_gym)."""
        if not self.metadata:
            return self.answer
        return json.dumps({"answer": self.answer, "metadata": json.loads(self.metadata)})
