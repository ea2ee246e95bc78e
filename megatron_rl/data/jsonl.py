"""Load a dataset of your own, versioned by content hash: a JSONL file (one JSON object per line), a Parquet
file, or a Hugging Face `datasets` directory (`save_to_disk`), chosen by suffix or `data.format`.

    ds = load_jsonl("gsm8k_train.jsonl", question_field="question", answer_field="answer",
                    answer_delimiter="####")          # also "train.parquet", or a save_to_disk directory
    ds.dataset_version   # sha256 of the loaded examples

A row's prompt is its question field, or a `messages` list of {role, content} turns (a chat prompt, rendered
with the chat template: data/dataset.py PromptTemplate); its answer is the answer field.

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
from typing import Iterator

from megatron_rl.data.dataset import Dataset
from megatron_rl.config import DataError
from megatron_rl.envs.example import Example


def _field(record: dict, field: str, where: str, key: str | None = None) -> str:
    """record[field] as text; a missing field is an error naming the config key that chooses it (`key`)."""
    if record.get(field) is None:  # absent, or null (a Parquet row of a table where others have it)
        hint = f": set {key} to the field that holds it" if key else ""
        raise DataError(f"{where}: missing field {field!r} (fields present: {', '.join(sorted(record))}){hint}")
    value = record[field]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {field!r} must be a string or number, got {type(value).__name__}")
    return str(value)


FORMATS = ("auto", "jsonl", "parquet", "hf")
_HF_SPLITS = {"train": ("train",), "dev": ("validation", "dev", "valid"), "test": ("test",)}


def file_format(path: Path, fmt: str = "auto") -> str:
    """jsonl, parquet or hf (a `datasets` save_to_disk directory): `fmt`, or what the path says."""
    if fmt != "auto":
        return fmt
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            return "hf"
        raise DataError(f"{path}: a directory but not a Hugging Face datasets save_to_disk directory "
                        f"(no dataset_info.json or dataset_dict.json)")
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if path.suffix in (".parquet", ".pq"):
        return "parquet"
    raise DataError(f"{path}: cannot tell its format from the name; set data.format (one of {list(FORMATS[1:])})")


def _rows(path: Path, fmt: str, split: str) -> Iterator[tuple[int, str, dict]]:
    """(row number from 1, where it is for errors, the record) of every row."""
    if fmt == "jsonl":
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
                yield lineno, where, record
        return
    if fmt == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow's own errors: a damaged or foreign file
            raise DataError(f"{path}: not a readable Parquet file ({type(err).__name__}: {err})"[:400]) from None
    elif fmt == "hf":
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: reading a datasets directory needs the datasets package") from None
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            names = [n for n in _HF_SPLITS.get(split, (split,)) if n in loaded]
            if not names:
                raise DataError(f"{path}: no {split} split among {sorted(loaded)} (names tried: {_HF_SPLITS[split]})")
            loaded = loaded[names[0]]
        rows = loaded.to_list()
    else:
        raise DataError(f"data.format must be one of {list(FORMATS)}, got {fmt!r}")
    for i, record in enumerate(rows, start=1):
        yield i, f"{path}: row {i}", record


def _messages(record: dict, where: str) -> list[dict]:
    turns = record["messages"]
    if (not isinstance(turns, list) or not turns
            or not all(isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
                       for t in turns)):
        raise DataError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} strings")
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def load_jsonl(
    path: str | Path,
    *,
    question_field: str = "question",
    answer_field: str = "answer",
    id_field: str | None = None,
    answer_delimiter: str | None = None,
    name: str | None = None,
    split: str = "train",
    fmt: str = "auto",
) -> Dataset:
    """Read `path` (JSONL, Parquet or a datasets directory; `fmt`) into a Dataset; ids come from `id_field`
    or are the 1-based row numbers.  A row with `messages` is a chat prompt (its question: the last user turn)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    examples: list[Example] = []
    for lineno, where, record in _rows(path, file_format(path, fmt), split):
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        messages = _messages(record, where) if "messages" in record and question_field not in record else None
        if messages is not None:
            users = [t["content"] for t in messages if t["role"] == "user"]
            question = users[-1] if users else messages[-1]["content"]
        else:
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
        examples.append(Example(id=ex_id, question=question, answer=answer, max_tokens=budget,
                                messages=json.dumps(messages) if messages is not None else ""))
    if not examples:
        raise DataError(f"{path}: no examples (file is empty)")
    return Dataset(name=name or path.stem, split=split, examples=examples)
