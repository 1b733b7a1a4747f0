"""Training data for Medusa heads: local JSONL / Parquet / saved ``datasets`` dirs -> token-id sequences.

    texts = load_texts("data.jsonl", field="text")          # list[str]; chat messages are rendered
    seqs = tokenize_texts(tokenizer, texts, seq_len=512)     # list[list[int]], each 2..seq_len tokens

Each record holds either a text field (``--text-field``, default ``text``) or chat messages
(``--messages-field``, default ``messages``: a list of ``{"role", "content"}``), which are rendered
with the tokenizer's chat template; one file may mix the two. Anything else is a :class:`TrainDataError`
naming the record.
"""
from __future__ import annotations

import hashlib
import json
import logging
from contextlib import contextmanager
from pathlib import Path

from specdec.errors import SpecdecError, first_line


class TrainDataError(SpecdecError, ValueError):
    """Training data is missing, unreadable, empty, or lacks the requested field."""


def _load_dataset(path: Path):
    try:
        import datasets
    except ImportError as err:  # pragma: no cover
        raise TrainDataError("reading training data needs 'datasets': pip install 'specdec[train]'") from err
    try:
        if path.is_dir():
            if not ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()):
                raise TrainDataError(f"{path} is a directory but not a dataset saved with datasets.save_to_disk")
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                split = "train" if "train" in ds else next(iter(ds))
                ds = ds[split]
            return ds
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json", ".parquet"):
            if path.stat().st_size == 0:
                raise TrainDataError(f"training data {path} is empty")
            with _datasets_errors_unlogged():
                return datasets.load_dataset("parquet" if suffix == ".parquet" else "json", data_files=str(path),
                                             split="train")
    except TrainDataError:
        raise
    except Exception as err:  # datasets raises many types for bad files
        raise TrainDataError(f"cannot read training data {path}: {_what_is_wrong(path, err)}") from err
    raise TrainDataError(f"unknown data format {path.name!r}: use .jsonl/.json, .parquet or a saved datasets dir")


@contextmanager
def _datasets_errors_unlogged():
    """datasets logs a bad file's error (on its own handler and again through the root logger) before raising it;
    the error reaches the user once, as a TrainDataError."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


class _DuplicateKey(ValueError):
    """A JSON object that holds one key twice (Python keeps the last value; datasets refuses the file)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _what_is_wrong(path: Path, err: Exception) -> str:
    """What makes ``path`` unreadable: for a JSON Lines file its first line that is not JSON or holds a key twice,
    else the innermost cause datasets wraps (its own DatasetGenerationError says only that generating failed)."""
    if path.suffix.lower() == ".jsonl":
        try:
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    try:
                        json.loads(line, object_pairs_hook=_unique_keys) if line.strip() else None
                    except json.JSONDecodeError as bad:
                        return f"line {number} is not JSON ({bad.msg}, column {bad.colno})"
                    except _DuplicateKey as twice:
                        return f"line {number} holds the key {twice.args[0]!r} twice in one object"
        except (UnicodeDecodeError, OSError):
            pass  # said below, from datasets' error
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    return f"{type(err).__name__}: {first_line(err)}"


def load_texts(data: str, text_field: str = "text", messages_field: str = "messages", tokenizer=None) -> list[str]:
    """The texts of ``data``, record by record: a string in ``text_field`` (empty ones skipped), else chat messages
    in ``messages_field`` rendered with ``tokenizer``'s chat template; any other record is a TrainDataError naming
    it (0-based, in file order)."""
    path = Path(data).expanduser()
    if not path.exists():
        raise TrainDataError(f"training data not found: {path}")
    ds = _load_dataset(path)
    if len(ds) == 0:
        raise TrainDataError(f"training data {path} is empty")
    columns = set(ds.column_names)
    if text_field not in columns and messages_field not in columns:
        raise TrainDataError(
            f"{path} has neither a {text_field!r} nor a {messages_field!r} field (columns: {sorted(columns)}); "
            "pass --text-field or --messages-field"
        )
    try:  # datasets decodes a JSON file's text lazily
        text_column = ds[text_field] if text_field in columns else [None] * len(ds)
        messages_column = ds[messages_field] if messages_field in columns else [None] * len(ds)
        texts = []
        for i, (text, messages) in enumerate(zip(text_column, messages_column, strict=True)):
            text = _record_text(path, i, text, messages, text_field, messages_field, tokenizer)
            if text.strip():
                texts.append(text)
    except UnicodeDecodeError as err:
        raise TrainDataError(f"training data {path} is not UTF-8 text (byte {err.start}: {err.reason})") from err
    if not texts:
        raise TrainDataError(f"training data {path} holds no non-empty texts")
    return texts


def _record_text(path: Path, i: int, text, messages, text_field: str, messages_field: str, tokenizer) -> str:
    """Record ``i``'s text: its ``text_field`` string, else its chat messages rendered."""
    if isinstance(text, str):
        return text
    if text is not None:
        raise TrainDataError(f"{path} record {i}: {text_field!r} must be a string, got {type(text).__name__}")
    if messages is None:
        raise TrainDataError(f"{path} record {i} has neither a {text_field!r} string nor {messages_field!r}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise TrainDataError(f"{path} record {i}: {messages_field!r} must be a list of {{role, content}}")
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise TrainDataError(f"{path} holds chat messages but the model's tokenizer has no chat template")
    return tokenizer.apply_chat_template(messages, tokenize=False)


def tokenize_texts(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """Tokenize and cut to ``seq_len``; sequences shorter than 3 tokens are dropped (nothing to learn)."""
    seqs = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len]
        if len(ids) >= 3:
            seqs.append(list(ids))
    if not seqs:
        raise TrainDataError("no training sequence has at least 3 tokens")
    return seqs


def split_held_out(seqs: list[list[int]], fraction: float) -> tuple[list[list[int]], list[list[int]]]:
    """Deterministic split by content hash (same data -> same split, whatever the order or process count).

    Every sequence lands on exactly one side. With ``fraction > 0`` the held-out side is never empty:
    if no hash falls under ``fraction``, the sequence with the smallest hash moves there.
    """
    keyed = [(int(hashlib.sha256(str(s).encode()).hexdigest()[:8], 16) / 0xFFFFFFFF, s) for s in seqs]
    train = [s for h, s in keyed if h >= fraction]
    held = [s for h, s in keyed if h < fraction]
    if fraction > 0 and not held and len(train) > 1:
        smallest = min(range(len(keyed)), key=lambda i: keyed[i][0])
        held = [keyed[smallest][1]]
        train = [s for i, (_, s) in enumerate(keyed) if i != smallest]
    if not train or (fraction > 0 and not held):
        raise TrainDataError(f"{len(seqs)} sequence(s) cannot be split into training and held-out data with "
                             f"held-out fraction {fraction}: give more data or --held-out-fraction 0")
    return train, held
