"""specdec's error types: every problem the user can fix raises a :class:`SpecdecError`.

A caller (or the CLI) catches ``SpecdecError`` to tell "your input / drafter / checkpoint is
wrong" (one line, no traceback) apart from a bug. Each subclass also derives from the builtin
that matches its meaning (``ValueError``, ``TypeError``, ``RuntimeError``, ``FileNotFoundError``), so code written
against the builtins keeps working. Errors that belong to one module (``DraftError`` in
``tree.py``, ``CacheFullError`` in ``kv_cache.py``, ...) are defined there on this base.

The message is one line that names the argument or file and says what was expected.
"""
from __future__ import annotations

import codecs
import difflib
from collections.abc import Iterable


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate that ``name`` most likely misspells (difflib's closest match above its cutoff), or None: the
    name a one-line refusal offers as the one meant."""
    return next(iter(difflib.get_close_matches(name, list(candidates), n=1)), None)


class SpecdecError(Exception):
    """Base of every error specdec raises on purpose."""


class InputError(SpecdecError, ValueError):
    """An argument has the right type but a value specdec cannot use (empty prompt, id outside the vocabulary)."""


class InputTypeError(SpecdecError, TypeError):
    """An argument has a type specdec does not accept (a float token id, ``stop=5``)."""


class ModelNotFoundError(SpecdecError, FileNotFoundError):
    """The model named is not there: no checkpoint directory, ``.gguf`` file or alias by that name (the message says
    what was looked for and where; specdec never downloads)."""


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message ("" for none): what a one-line error quotes of another error."""
    return (str(err).strip().splitlines() or [""])[0]


# byte-order marks of the other Unicode encodings (UTF-32's first: UTF-16 LE's is the start of UTF-32 LE's)
_OTHER_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
               (codecs.BOM_UTF16_BE, "UTF-16"))


def other_unicode(data: bytes) -> str | None:
    """"UTF-16" / "UTF-32" where ``data`` starts with that encoding's byte-order mark (Windows Notepad's "Unicode"
    writes UTF-16): text, only not UTF-8; None otherwise."""
    return next((name for bom, name in _OTHER_BOMS if data.startswith(bom)), None)


def not_utf8_at(data: bytes, err: UnicodeDecodeError, first: int = 1) -> str:
    """Where decoding ``data`` (whose first line is line ``first`` of its file) met ``err``, as a refusal of a text
    file says it: ``line L, byte B: reason``, B counted from the line's start, and what the file is where its
    byte-order mark says (:func:`other_unicode`). A ``utf-8-sig`` decode counts ``err.start`` past a UTF-8 mark: the
    file's count is wanted (3 short, it named the wrong byte, or line)."""
    at = err.start + len(data) - len(err.object)
    line, start = data.count(b"\n", 0, at) + first, data.rfind(b"\n", 0, at) + 1
    other = other_unicode(data) if first == 1 else None
    what = f"; it is {other} text, by its byte-order mark: convert it to UTF-8" if other else ""
    return f"line {line}, byte {at - start}: {err.reason}{what}"


def lone_surrogate_at(text: str) -> str | None:
    """Where ``text`` holds a lone surrogate (a JSON string's ``"\\ud800"`` escape without its pair reads as one),
    which no tokenizer encodes (transformers' fast ones fail in a TypeError about ``TextEncodeInput``), as a refusal
    says it: ``U+D800 at character 1``; None for valid text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return f"U+{ord(text[err.start]):04X} at character {err.start}"
    return None


def require_package(name: str, extra: str | None = None) -> None:
    """A ModuleNotFoundError naming ``name`` where it is not installed, before work that would need it later or fail
    inside a library without naming it; its message names specdec's ``extra`` that installs it, for a caller of the
    Python API (the CLI says the extra of its command)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        hint = f"; install it with pip install 'specdec[{extra}]'" if extra else ""
        raise ModuleNotFoundError(f"No module named {name!r}{hint}", name=name)
