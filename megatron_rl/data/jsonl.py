"""Load a math dataset from a JSONL file (one JSON object per line), versioned by content hash.

    ds = load_jsonl("gsm8k_train.jsonl", question_field="question", answer_field="answer",
                    answer_delimiter="####")
    ds.dataset_version   # sha256 of the loaded examples

Field names are configurable; `answer_delimiter` keeps only the text after its last
occurrence (GSM8K writes the reasoning, then "#### 42").  An optional `max_tokens` (int >= 1) is the
prompt's own response budget: its samples stop after min(max_tokens, rollout.max_tokens) tokens
(e.g. a length curriculum; benchmarks/stream_training.py sets long-tailed lengths with it).  Blank lines are skipped.  A line
that is not a JSON object, or lacks a field, is an error naming the file, the line number
and the field; nothing is loaded partially.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_rl.data.dataset import Dataset, Example
from megatron_rl.config import DataError


def _field(record: dict, field: str, where: str, key: str | None = None) -> str:
    """record[field] as text; a missing field is an error naming the config key that chooses it (`key`)."""
    if field not in record:
        hint = f": set {key} to the field that holds it" if key else ""
        raise DataError(f"{where}: missing field {field!r} (fields present: {', '.join(sorted(record))}){hint}")
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {field!r} must be a string or number, got {type(value).__name__}")
    return str(value)


def load_jsonl(
    path: str | Path,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_delimiter: str | None = None,
    name: str | None = None,
    split: str = "train",
) -> Dataset:
    """Read `path` into a Dataset; ids come from `id_field` or are the 1-based line numbers."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    examples: list[Example] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
            question = _field(record, question_field, where, "data.question_field")
            answer = _field(record, answer_field, where, "data.answer_field")
            if answer_delimiter is not None:
                if answer_delimiter not in answer:
                    raise DataError(f"{where}: field {answer_field!r} has no answer delimiter {answer_delimiter!r} "
                                    f"(data.answer_delimiter)")
                answer = answer.rsplit(answer_delimiter, 1)[1]
            answer = answer.strip()
            if not answer:
                raise DataError(f"{where}: field {answer_field!r} is empty")
            ex_id = _field(record, id_field, where) if id_field else str(lineno)
            budget = record.get("max_tokens")
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
                raise DataError(f"{where}: field 'max_tokens' must be an int >= 1 (the prompt's response budget), "
                                f"got {budget!r}")
            examples.append(Example(id=ex_id, question=question, answer=answer, max_tokens=budget))
    if not examples:
        raise DataError(f"{path}: no examples (file is empty)")
    return Dataset(name=name or path.stem, split=split, examples=examples)
