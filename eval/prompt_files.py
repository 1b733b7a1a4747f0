"""Reading a user's prompt file into conversations, each with its own category.

    conversations = read_prompt_file("question.jsonl")            # -> list[Conversation]
    conversations = read_prompt_file("data.parquet", column="question")
    per_category(conversations, 2)                                # the first 2 of every category

Formats, recognised without conversion (one record per JSONL line or table row):

* Spec-Bench / MT-bench question files: ``{"question_id", "category", "turns": [user turn, ...]}``;
* ``{"prompt": text}`` (or ``"text"``), one turn;
* chat lines ``{"messages": [{"role", "content"}, ...]}``: every user message is a turn the model answers, system
  messages are kept before them, given assistant messages are dropped (the model answers each turn itself);
* CSV, Parquet or a directory saved by ``datasets`` (``save_to_disk``), with the prompt in ``column`` (default: the
  first of ``turns``, ``prompt``, ``text``, ``messages``): a string, a list of turns or a list of messages.

A record's ``category`` field (default ``custom``) is kept, reduced to letters, digits, ``.``, ``_`` and ``-`` (it
names files: a category named like another's turn cell, ``writing.turn2`` beside a two-turn ``writing``, is refused,
:func:`cell_turns`, as are ``mt_bench`` and ``overall``, the names of the report's merged rows). A UTF-8 byte-order
mark is skipped. Anything malformed is a one-line :class:`InputError` naming the file, the line (or row) and the
field.
"""
from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.errors import InputError, lone_surrogate_at, not_utf8_at

DEFAULT_CATEGORY = "custom"
# the report's rows merged over several categories (specdec.eval.spec_bench): no category may take their names
MT_BENCH_GROUP, OVERALL = "mt_bench", "overall"
PROMPT_COLUMNS = ("turns", "prompt", "text", "messages")
_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Conversation:
    category: str
    turns: tuple[str, ...]  # user turns, answered one after the other by the model
    system: tuple[str, ...] = ()  # system messages placed before the first turn
    where: str = ""  # "file:line" (or "file: row r") it was read from

    def __post_init__(self) -> None:
        if not self.turns:
            raise InputError(f"{self.where or 'conversation'}: has no user turn")


class DuplicateKey(ValueError):
    """A JSON object that holds one key twice (Python keeps the last value; datasets refuses the file)."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``json.loads``' ``object_pairs_hook`` that raises :class:`DuplicateKey` for a key given twice in one object."""
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def category_name(value: Any, where: str) -> str:
    if value is None:
        return DEFAULT_CATEGORY
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise InputError(f"{where}: field 'category' must be a string, got {json.dumps(value)[:40]}")
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(value)).strip("_.")
    if not name:
        raise InputError(f"{where}: field 'category' {json.dumps(value)[:40]} has no letter or digit")
    if name in (MT_BENCH_GROUP, OVERALL):
        raise InputError(f"{where}: category {name!r} is the name of the report's row merged over categories; "
                         "rename it")
    return name


def turn_cell(category: str, turn: int, multi_turn: bool) -> str:
    """The cell (category) name of turn ``turn`` (1-based) of a conversation in ``category``."""
    return f"{category}.turn{turn}" if multi_turn else category


def cell_turns(conversations: list[Conversation]) -> dict[str, tuple[str, int]]:
    """Every cell name of a run -> (category, turn), in the order the cells are reported. Two categories that would
    write one cell (``writing.turn2`` beside a two-turn ``writing``) are an :class:`InputError` naming both."""
    multi = {c.category for c in conversations if len(c.turns) > 1}
    names: dict[str, tuple[str, int]] = {}
    for category in dict.fromkeys(c.category for c in conversations):
        turns = max(len(c.turns) for c in conversations if c.category == category)
        for t in range(1, turns + 1):
            name = turn_cell(category, t, category in multi)
            if name in names:
                first, then = (_cell_owner(conversations, *names[name], multi),
                               _cell_owner(conversations, category, t, multi))
                raise InputError(f"{first} and {then} would write the same cells ({name}); rename a category")
            names[name] = (category, t)
    return names


def _cell_owner(conversations: list[Conversation], category: str, turn: int, multi: set[str]) -> str:
    """Who writes a cell, for a message: the category (and turn) and where its first such conversation is."""
    where = next((c.where for c in conversations if c.category == category and len(c.turns) >= turn), "")
    what = f"turn {turn} of category {category!r}" if category in multi else f"category {category!r}"
    return what + (f" ({where})" if where else "")


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where}: field {field!r} must be a non-empty string, got {json.dumps(value)[:40]}")
    if (bad := lone_surrogate_at(value)) is not None:
        raise InputError(f"{where}: field {field!r} holds a lone surrogate ({bad}, a \\u escape without its pair), "
                         "which is no text a tokenizer encodes")
    return value


def _from_messages(messages: Any, where: str, field: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(messages, list) or not messages:
        raise InputError(f"{where}: field {field!r} must be a non-empty list of {{'role', 'content'}} objects")
    system, turns = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InputError(f"{where}: field {field!r}[{i}] must be an object with a 'role' of "
                             f"{', '.join(_ROLES)}, got {json.dumps(m)[:60]}")
        content = _text(m.get("content"), where, f"{field}[{i}].content")
        if m["role"] == "user":
            turns.append(content)
        elif m["role"] == "system":
            if turns:
                raise InputError(f"{where}: field {field!r}[{i}]: a system message after a user turn")
            system.append(content)
    if not turns:
        raise InputError(f"{where}: field {field!r} holds no user message")
    return tuple(system), tuple(turns)


def _from_value(value: Any, where: str, field: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(system, turns) from a prompt value: a string, a list of turns, or a list of messages."""
    if isinstance(value, str):
        return (), (_text(value, where, field),)
    if hasattr(value, "tolist"):  # numpy arrays from Parquet / pandas
        value = value.tolist()
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return _from_messages(value, where, field)
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: field {field!r} must be a string or a non-empty list of turns, got "
                         f"{json.dumps(value, default=str)[:40]}")
    return (), tuple(_text(v, where, f"{field}[{i}]") for i, v in enumerate(value))


def _from_record(obj: Any, where: str, column: str | None) -> Conversation:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    field = column or next((c for c in PROMPT_COLUMNS if c in obj), None)
    if field is None or field not in obj:
        wanted = repr(column) if column else "one of " + ", ".join(f"'{c}'" for c in PROMPT_COLUMNS)
        raise InputError(f"{where}: needs a field {wanted}")
    system, turns = _from_value(obj[field], where, field)
    return Conversation(category_name(obj.get("category"), where), turns, system, where)


def _read_text(path: Path) -> str:
    """The file's text, without a leading byte-order mark (not part of line 1); not UTF-8: the line and the byte."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise InputError(f"prompt file {path}: cannot be read ({err.strerror or err})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise InputError(f"prompt file {path}: not UTF-8 text ({not_utf8_at(data, err)})") from None


def _jsonl(path: Path, column: str | None) -> Iterator[Conversation]:
    # lines end at \n, \r\n or \r only: splitlines() also broke lines at U+2028, U+0085, ..., which JSON keeps
    # unescaped inside a string (json.dumps(ensure_ascii=False) writes them so)
    for i, line in enumerate(io.StringIO(_read_text(path), newline=None), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=unique_keys)
        except DuplicateKey as twice:  # {"prompt": "a", "prompt": "b"} measured "b" unsaid
            raise InputError(f"{path}:{i}: holds the key {twice.args[0]!r} twice in one object") from None
        except json.JSONDecodeError as err:
            # a line of plain text (train-*'s --prompts-file is one prompt per line) is no record: say what one is
            hint = "" if line.lstrip()[:1] in ("{", "[") else (
                "; each line must be a JSON object, e.g. {\"prompt\": \"...\"} (or give a .csv / .parquet file)")
            raise InputError(f"{path}:{i}: not valid JSON ({err.msg}){hint}") from None
        yield _from_record(obj, f"{path}:{i}", column)


def _csv(path: Path, column: str | None) -> Iterator[Conversation]:
    # a quoted field keeps its line breaks; strict: a stray or unclosed quote is refused, not read on to the file's end
    rows = csv.DictReader(io.StringIO(_read_text(path), newline=""), strict=True)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except csv.Error as err:
            raise InputError(f"{path}: not valid CSV after line {rows.line_num} ({err})") from None
        where = f"{path}:{rows.line_num}"
        if None in row:  # more fields than the header names: an unquoted comma cut a prompt, the rest was dropped
            raise InputError(f"{where}: {len(rows.fieldnames) + len(row[None])} fields, but the header names "
                             f"{len(rows.fieldnames)}; quote a field that holds a comma (\"a, b\")")
        yield _from_record(row, where, column)


def _table(rows: Iterator[dict], path: Path, column: str | None) -> Iterator[Conversation]:
    for r, row in enumerate(rows):
        yield _from_record(row, f"{path}: row {r}", column)


def _parquet(path: Path, column: str | None) -> Iterator[Conversation]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(f"prompt file {path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as err:  # noqa: BLE001 (pyarrow raises several types for a damaged file)
        raise InputError(f"prompt file {path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    return _table(iter(rows), path, column)


def is_saved_dataset(path: Path) -> bool:
    """Whether the folder ``path`` holds what ``datasets``' ``save_to_disk`` writes (a Dataset or a DatasetDict): known
    before datasets is imported, so that a folder it cannot read is not answered with "install datasets"."""
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _dataset_dir(path: Path, column: str | None) -> Iterator[Conversation]:
    if not is_saved_dataset(path):
        raise InputError(f"prompt directory {path}: not a dataset saved by datasets' save_to_disk (no "
                         "dataset_info.json or dataset_dict.json in it)")
    try:
        from datasets import load_from_disk
    except ImportError:
        raise InputError(f"prompt directory {path}: reading it needs datasets: pip install datasets") from None
    try:
        data = load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise InputError(f"prompt directory {path}: not a dataset saved by datasets' save_to_disk "
                         f"({str(err).splitlines()[0]})") from None
    if hasattr(data, "keys") and not hasattr(data, "column_names"):  # a DatasetDict: every split, in order
        return (c for split in data.keys() for c in _table(iter(data[split]), path / split, column))
    return _table(iter(data), path, column)


def read_prompt_file(path: str | Path, column: str | None = None) -> list[Conversation]:
    """Every conversation in ``path`` (JSONL, ``.csv``, ``.parquet`` or a saved ``datasets`` directory), in file
    order; ``column``: the field holding the prompt (default: the first of :data:`PROMPT_COLUMNS` present)."""
    path = Path(path)
    if path.is_dir():
        reader = _dataset_dir
    elif not path.is_file():
        raise InputError(f"prompt file {path} does not exist")
    else:
        reader = {".csv": _csv, ".parquet": _parquet}.get(path.suffix.lower(), _jsonl)
    conversations = list(reader(path, column))
    if not conversations:
        raise InputError(f"prompt file {path} holds no prompts")
    cell_turns(conversations)  # two categories writing one cell are refused now, not found overwritten after the run
    return conversations


def per_category(conversations: list[Conversation], n: int | None) -> list[Conversation]:
    """The first ``n`` conversations of every category (all of them when ``n`` is None), in file order."""
    if n is None:
        return list(conversations)
    if n < 1:
        raise InputError(f"prompts per category must be >= 1, got {n}")
    seen: dict[str, int] = {}
    kept = []
    for c in conversations:
        seen[c.category] = seen.get(c.category, 0) + 1
        if seen[c.category] <= n:
            kept.append(c)
    return kept
