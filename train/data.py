"""Training data for Medusa heads: local JSONL / Parquet / saved ``datasets`` dirs -> token-id sequences.

    texts = load_texts("data.jsonl", field="text")          # list[str]; chat messages are rendered
    seqs = tokenize_texts(tokenizer, texts, seq_len=512)     # list[list[int]], each 2..seq_len tokens

Each record holds either a text field (``--text-field``, default ``text``) or chat messages
(``--messages-field``, default ``messages``: a list of ``{"role", "content"}``, content a string, null or a list of
text parts ``{"type": "text", "text": ...}``, which are joined; or ShareGPT's ``{"from", "value"}``, its
``human`` / ``gpt`` read as ``user`` / ``assistant``), rendered with the tokenizer's chat template; one file may mix
the two. JSON Lines files are read record by record with the json module (records may differ in
shape anywhere in the file); other formats through ``datasets`` (a .json file it cannot read is named with where
it breaks). Anything else, and a record the chat template cannot render, is a :class:`TrainDataError` naming the
file and the record.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
from pathlib import Path

from specdec.eval.prompt_files import DuplicateKey, is_saved_dataset, unique_keys

from specdec.errors import SpecdecError, first_line, lone_surrogate_at, not_utf8_at
from specdec.log_levels import logger_at

logger = logging.getLogger(__name__)


class TrainDataError(SpecdecError, ValueError):
    """Training data is missing, unreadable, empty, or lacks the requested field."""


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}  # ShareGPT's "from" -> the chat role
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython", "function")  # what chat templates know


def _load_dataset(path: Path):
    # what datasets cannot read is refused first: without datasets installed, a .csv was told to install it
    suffix = path.suffix.lower()
    if path.is_dir():
        if not is_saved_dataset(path):
            raise TrainDataError(f"{path} is a directory but not a dataset saved with datasets.save_to_disk")
    elif suffix not in (".json", ".parquet"):  # .jsonl: _jsonl_records
        raise TrainDataError(f"unknown data format {path.name!r}: use .jsonl/.json, .parquet or a saved datasets dir")
    elif path.stat().st_size == 0:
        raise TrainDataError(f"training data {path} is empty")
    try:
        import datasets
    except ImportError as err:
        raise TrainDataError(f"reading training data {path} needs 'datasets' (a .jsonl file does not): "
                             "pip install 'specdec[train]'") from err
    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                split = "train" if "train" in ds else next(iter(ds))
                ds = ds[split]
            return ds
        try:
            # datasets logs a bad file's error (on its own handler and again through the root logger)
            # before raising it: it reaches the user once, as a TrainDataError
            with logger_at("datasets", logging.CRITICAL):
                return datasets.load_dataset("parquet" if suffix == ".parquet" else "json", data_files=str(path),
                                             split="train")
        except Exception:
            if suffix == ".json":
                _refuse_json(path)
            raise
    except TrainDataError:
        raise
    except Exception as err:  # datasets raises many types for bad files
        raise TrainDataError(f"cannot read training data {path}: {_what_is_wrong(err)}") from err


def _what_is_wrong(err: Exception) -> str:
    """The innermost cause datasets wraps (its own DatasetGenerationError says only that generating failed); for its
    CastError (a record of other fields or types than those of the file's first chunk), what to do."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    cause = f"{type(err).__name__}: {first_line(err)}"
    if type(err).__name__ == "CastError":
        return (f"{cause} (records differ in their fields or types: name the file .jsonl, which is read record by "
                "record)")
    return cause


def _refuse_json(path: Path) -> None:
    """Where datasets cannot read the .json file ``path``, raise a TrainDataError saying what is wrong in the file's
    terms: datasets said "Instruction "train" corresponds to no data!" for a file of blank lines or ``[]``, and
    "Trailing data at position 22" for a JSON Lines line that is not JSON. Returns where it cannot tell (datasets'
    message stands)."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except (OSError, UnicodeDecodeError):
        return
    if not text.strip():
        raise TrainDataError(f"training data {path} is empty")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as bad:
        if bad.msg != "Extra data":  # not JSON: where the file's JSON breaks
            raise TrainDataError(f"cannot read training data {path}: it is not JSON ({bad.msg}, line {bad.lineno}, "
                                 f"column {bad.colno})") from None
        for _ in _jsonl_lines(path):  # more than one document: JSON Lines, each line one record
            pass
        return
    if isinstance(document, (list, dict)) and not document:
        raise TrainDataError(f"training data {path} holds no records (it is {text.strip()})")
    if not isinstance(document, (list, dict)):
        raise TrainDataError(f"cannot read training data {path}: it is a JSON {type(document).__name__}, not a list "
                             "of records or one record per line")


def _jsonl_lines(path: Path):
    """``(line number, record)`` of each non-blank line of the JSON Lines file ``path``; a line that is not UTF-8 or
    not a JSON object, or that holds a key twice, is a TrainDataError naming it."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise TrainDataError(f"training data {path} is not UTF-8 text ({not_utf8_at(raw, err, number)})") \
                    from err
            if not line.strip():
                continue
            try:  # without the line break: an error at the line's end is at its last column, not the next line's first
                record = json.loads(line.rstrip("\r\n"), object_pairs_hook=unique_keys)
            except json.JSONDecodeError as bad:
                raise TrainDataError(f"cannot read training data {path}: line {number} is not JSON ({bad.msg}, "
                                     f"column {bad.colno})") from None
            except DuplicateKey as twice:
                raise TrainDataError(f"cannot read training data {path}: line {number} holds the key "
                                     f"{twice.args[0]!r} twice in one object") from None
            if not isinstance(record, dict):
                raise TrainDataError(f"cannot read training data {path}: line {number} is a JSON "
                                     f"{type(record).__name__}, not an object (one record per line)")
            yield number, record


def _jsonl_records(path: Path, text_field: str, messages_field: str):
    """Each record's (where, text, messages) of a JSON Lines file, in file order (None where a field is absent; where:
    ``line N``, as the file's other errors name it), read line by line: datasets' reader fixes the columns and their
    types from its first chunk of the file and refuses a later record of another shape (a chat record after many
    texts) with a bare "Couldn't cast"."""
    if path.stat().st_size == 0:
        raise TrainDataError(f"training data {path} is empty")
    fieldless, keys, has_field = [], set(), False  # lines of the records before the first that holds either field
    for number, record in _jsonl_lines(path):
        if not has_field:  # as datasets' columns: the file lacks both fields only if every record does
            if text_field not in record and messages_field not in record:
                fieldless.append(number)
                keys.update(record)
                continue
            has_field = True
            yield from [(f"line {n}", None, None) for n in fieldless]  # named by _record_text, in file order
        yield f"line {number}", record.get(text_field), record.get(messages_field)
    if not has_field:
        if not fieldless:
            raise TrainDataError(f"training data {path} is empty")
        raise _no_field(path, keys, text_field, messages_field)


def _no_field(path: Path, columns, text_field: str, messages_field: str) -> TrainDataError:
    return TrainDataError(f"{path} has neither a {text_field!r} nor a {messages_field!r} field (columns: "
                          f"{sorted(columns)}); pass --text-field or --messages-field")


def _dataset_records(path: Path, text_field: str, messages_field: str):
    """Each record's (where, text, messages) of a Parquet / JSON file or a saved dataset, read through datasets
    (where: ``record i``, counted from 0 as datasets indexes them)."""
    ds = _load_dataset(path)
    if len(ds) == 0:
        raise TrainDataError(f"training data {path} is empty")
    columns = set(ds.column_names)
    if text_field not in columns and messages_field not in columns:
        raise _no_field(path, columns, text_field, messages_field)
    text_column = ds[text_field] if text_field in columns else [None] * len(ds)
    messages_column = ds[messages_field] if messages_field in columns else [None] * len(ds)
    return ((f"record {i}", text, messages)
            for i, (text, messages) in enumerate(zip(text_column, messages_column, strict=True)))


def load_texts(data: str, text_field: str = "text", messages_field: str = "messages", tokenizer=None) -> list[str]:
    """The texts of ``data``, record by record: a string in ``text_field`` (empty ones skipped, counted in a
    warning), else chat messages in ``messages_field`` rendered with ``tokenizer``'s chat template; any other record
    is a TrainDataError naming it (a JSON Lines file's by its line, counted from 1; a dataset's by its index)."""
    path = Path(data).expanduser()
    if not path.exists():
        raise TrainDataError(f"training data not found: {path}")
    if path.is_file() and path.suffix.lower() == ".jsonl":
        records = _jsonl_records(path, text_field, messages_field)
    else:
        records = _dataset_records(path, text_field, messages_field)
    try:  # datasets decodes a JSON file's text lazily
        texts, read, odd_roles = [], 0, collections.Counter()
        for where, text, messages in records:
            read += 1
            text = _record_text(path, where, text, messages, text_field, messages_field, tokenizer, odd_roles)
            if (bad := lone_surrogate_at(text)) is not None:  # the tokenizer's TypeError named no record
                raise TrainDataError(f"{path} {where}: its text holds a lone surrogate ({bad}, a \\u escape without "
                                     "its pair), which is no text a tokenizer encodes")
            if text.strip():
                texts.append(text)
    except UnicodeDecodeError as err:
        raise TrainDataError(f"training data {path} is not UTF-8 text (byte {err.start}: {err.reason})") from err
    if not texts:
        raise TrainDataError(f"training data {path} holds no non-empty texts")
    if len(texts) < read:
        logger.warning("%d of %d records of %s hold an empty text and are skipped", read - len(texts), read, path)
    if odd_roles:  # "human" / "gpt" in {role, content} messages: the template renders them as written
        logger.warning("%d messages of %s have roles chat templates do not know (%s; they know %s): the template "
                       "renders them as written", sum(odd_roles.values()), path,
                       ", ".join(repr(r) for r, _ in odd_roles.most_common(3)), ", ".join(CHAT_ROLES))
    return texts


def _record_text(path: Path, where: str, text, messages, text_field: str, messages_field: str, tokenizer,
                 odd_roles: collections.Counter) -> str:
    """The text of the record at ``where`` (``line N`` / ``record i``): its ``text_field`` string, else its chat
    messages rendered; roles no chat template knows are counted in ``odd_roles``."""
    if isinstance(text, str):
        return text
    if text is not None:
        raise TrainDataError(f"{path} {where}: {text_field!r} must be a string, got {type(text).__name__}")
    if messages is None:
        raise TrainDataError(f"{path} {where} has neither a {text_field!r} string nor {messages_field!r}")
    messages = _sharegpt_as_chat(messages)
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise TrainDataError(f"{path} {where}: {messages_field!r} must be a list of {{role, content}} (or "
                             "ShareGPT's {from, value})")
    messages = [_with_text_content(f"{path} {where}", j, m) for j, m in enumerate(messages)]
    odd_roles.update(m["role"] for m in messages if m["role"] not in CHAT_ROLES)
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise TrainDataError(f"{path} holds chat messages but the model's tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as err:  # jinja2's TemplateError (raise_exception), TypeError, transformers' ValueError, ...
        raise TrainDataError(f"{path} {where}: the tokenizer's chat template cannot render its {messages_field!r} "
                             f"({type(err).__name__}: {first_line(err)})") from err


def _sharegpt_as_chat(messages):
    """ShareGPT's messages (each ``{from, value}``, none with a role) as ``{role, content}``, its human / gpt / system
    read as user / assistant / system (another sender, as written); any other messages as they are."""
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and m.keys() >= {"from", "value"} and "role" not in m for m in messages)):
        return messages
    return [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]) if isinstance(m["from"], str) else m["from"],
             "content": m["value"]} for m in messages]


def _with_text_content(where: str, j: int, message: dict) -> dict:
    """``message`` with its content a string or None: a list of text parts (OpenAI's and transformers' form) is
    joined with nothing between the parts, as the chat templates that take parts render them; a template given the
    list itself renders its Python repr. A part that is not text (an image, audio) cannot be trained on. A role that
    is not a string is refused here: templates failed on it with "can only concatenate str (not "int") to str", or,
    for null, "'dict object' has no attribute 'role'"."""
    if not isinstance(message["role"], str):
        raise TrainDataError(f"{where}: message {j}'s role must be a string, got {type(message['role']).__name__}")
    content = message["content"]
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise TrainDataError(f"{where}: message {j}'s content must be a string, null or a list of text parts "
                             f"({{\"type\": \"text\", \"text\": ...}}), got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text":
            raise TrainDataError(f"{where}: message {j}'s content part {k} is of type {kind!r}: only text parts "
                                 "({\"type\": \"text\", \"text\": ...}) can be trained on")
        if not isinstance(part.get("text"), str):
            raise TrainDataError(f"{where}: message {j}'s content part {k} has no 'text' string")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def tokenize_texts(tokenizer, texts: list[str], seq_len: int, source: str = "the training data") -> list[list[int]]:
    """Tokenize with the tokenizer's special tokens (a BOS, as every prompt the heads will draft for has it) and cut
    to ``seq_len``; a text that already starts with the BOS (a chat template writes it) keeps one. Sequences shorter
    than 3 tokens are dropped (nothing to learn), with a warning that counts them; ``source`` names where the texts
    come from in both."""
    bos = getattr(tokenizer, "bos_token_id", None)
    seqs = []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        if bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]
        ids = ids[:seq_len]
        if len(ids) >= 3:
            seqs.append(list(ids))
    if not seqs:
        raise TrainDataError(f"no text of {source} has at least 3 tokens: there is nothing to train on")
    if len(seqs) < len(texts):
        logger.warning("%d of %d texts of %s tokenize to fewer than 3 tokens and are not trained on",
                       len(texts) - len(seqs), len(texts), source)
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
