"""The folders a command writes into: one-line errors, naming the option, for one that cannot be made.

    check_creatable(out, "--output-dir")      # before any work: nothing is created
    make_dir(out, "--output-dir")             # when the command writes

A folder cannot be made where a file of that name (or of one of its parents' names) is in the way, or where the
nearest existing parent is not writable; both are said as such, not as the bare ``[Errno 20] Not a directory``.
Errors are :class:`~specdec.errors.InputError` (a ``ValueError``): the CLIs print them in one line, exit code 2.
"""
from __future__ import annotations

import os
from pathlib import Path

from specdec.errors import InputError


def why_uncreatable(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a folder (a file in the way, a read-only parent), or None where nothing stands in the
    way that can be seen without creating it."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a folder"
            if p != path and not os.access(p, os.W_OK | os.X_OK):
                return f"{p} is not writable"
            return None
    return None


def check_creatable(path: str | os.PathLike, option: str) -> None:
    """Refuse, creating nothing, a ``path`` that cannot be made into a folder for ``option``."""
    why = why_uncreatable(path)
    if why is not None:
        raise InputError(f"{option} {path}: cannot create it ({why})")


def make_dir(path: str | os.PathLike, option: str) -> Path:
    """Create the folder ``path`` and its parents for ``option`` (an existing folder is fine); returns it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"{option} {path}: cannot create it ({why_uncreatable(path) or err.strerror or err})") \
            from err
    return path
