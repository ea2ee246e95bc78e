"""Reading a run directory's files when they may be damaged (a torn write, a flipped byte, a hand edit).

    cfg = read_json(run_dir / "config.json")                  # a JSON object, else ConfigError naming the file
    rows = read_jsonl(run_dir / "metrics" / "metrics.jsonl", key="step")   # readable rows; rows.skipped
    rows = read_jsonl(outcomes, strict=True)                  # a bad line is a ConfigError instead
    for (payload,) in query_sqlite(db, "SELECT payload FROM traj"): ...   # read-only; ConfigError when damaged

What cannot be read raises ConfigError with one line naming the file and what is wrong, so every command
that reads a run directory (audit, eval, doctor, report, experiment, a resume) ends with that line and
exit 2 (megatron_rl/cli.py), never a traceback, and changes nothing on disk.  A log read line by line
(metrics.jsonl) is the exception: a line that is not a JSON object in UTF-8 is skipped, and the lines
skipped are counted in one warning, so one bad byte never blocks a resume or a report.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any, Iterator

from megatron_rl.config import ConfigError

logger = logging.getLogger(__name__)

_KINDS = {dict: "object", list: "array"}


class Rows(list):
    """read_jsonl's result: the JSON objects of the readable lines, in file order; `lines` holds the text of
    each (for rewriting the file without re-encoding), `skipped` the 1-based numbers of the lines skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.skipped: list[int] = []


def read_bytes(path: str | Path) -> bytes:
    """The file's bytes; ConfigError naming it when it cannot be read (missing, a directory, no permission)."""
    path = Path(path)
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot be read ({err.strerror or err})") from None


def decode_text(path: str | Path, data: bytes) -> str:
    """`data` (the bytes of `path`) as UTF-8 text; ConfigError naming the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}); "
                          "the file is damaged") from None


def read_json(path: str | Path, *, expect: type | None = dict) -> Any:
    """The JSON value of `path` (by default it must be an object); ConfigError naming the file otherwise."""
    path = Path(path)
    text = decode_text(path, read_bytes(path))
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON (line {err.lineno} column {err.colno}: {err.msg}); "
                          "the file is damaged") from None
    except RecursionError:
        raise ConfigError(f"{path}: JSON nested too deeply to read; the file is damaged") from None
    if expect is not None and not isinstance(value, expect):
        raise ConfigError(f"{path}: expected a JSON {_KINDS.get(expect, expect.__name__)}, got "
                          f"{type(value).__name__}; the file is damaged")
    return value


def read_jsonl(path: str | Path, *, key: str | None = None, strict: bool = False, warn: bool = True) -> Rows:
    """The JSON objects of `path`, one a line (blank lines ignored).  A line that is not an object in UTF-8
    (or, with `key`, has no non-negative integer under it) is skipped, and the lines skipped are counted
    in one warning (`warn`); with `strict` it is a ConfigError naming the file and line instead."""
    path = Path(path)
    rows = Rows()
    for n, raw in enumerate(read_bytes(path).split(b"\n"), start=1):
        if not raw.strip():
            continue
        row = _row(raw, key)
        if row is not None:
            rows.append(row)
            rows.lines.append(raw.decode("utf-8").rstrip("\r"))
        elif strict:
            raise ConfigError(f"{path} line {n}: not a JSON object in UTF-8 text"
                              + (f" with an integer {key!r}" if key else "") + "; the file is damaged")
        else:
            rows.skipped.append(n)
    if rows.skipped and warn:
        logger.warning("%s: %s", path, skipped_lines(rows.skipped))
    return rows


def skipped_lines(numbers: list[int]) -> str:
    """How read_jsonl's warning names the lines it skipped."""
    shown = ", ".join(str(n) for n in numbers[:5]) + (", ..." if len(numbers) > 5 else "")
    return (f"{len(numbers)} unreadable line(s) skipped (not a JSON object in UTF-8: a torn write or damaged "
            f"bytes; line {shown})")


def _row(raw: bytes, key: str | None) -> dict | None:
    try:
        row = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(row, dict):
        return None
    if key is not None and (type(row.get(key)) is not int or row[key] < 0):
        return None
    return row


def query_sqlite(path: str | Path, sql: str, params: tuple = ()) -> Iterator[tuple]:
    """The rows of `sql` over the SQLite file `path`, opened read-only (nothing is written, no journal is
    replayed into it); ConfigError naming the file when it is not a readable SQLite database."""
    path = Path(path)
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    except sqlite3.Error as err:
        raise ConfigError(f"{path}: cannot be opened as a SQLite database ({err})") from None
    try:
        yield from conn.execute(sql, params)
    except sqlite3.Error as err:
        raise ConfigError(f"{path}: not a readable SQLite database ({err}); the file is damaged") from None
    finally:
        conn.close()
