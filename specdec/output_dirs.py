"""The folders a command writes into: one-line errors, naming the option, for one that cannot be made.

    check_creatable(out, "--output-dir")      # before any work: nothing is left behind
    make_dir(out, "--output-dir")             # when the command writes

A folder cannot be made where a file of that name (or of one of its parents' names) is in the way, or where the
nearest existing parent is not writable; both are said as such, not as the bare ``[Errno 20] Not a directory``. An
existing folder that cannot be written into (read-only, a read-only file system) is refused before any work too.
Errors are :class:`~specdec.errors.InputError` (a ``ValueError``): the CLIs print them in one line, exit code 2.
"""
from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Collection, Iterable
from pathlib import Path

from specdec.errors import InputError


def why_uncreatable(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be a folder to write into (a file in the way, it or its nearest existing parent not
    writable), or None where nothing stands in the way that can be seen without creating it."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                return f"{p} is a file, not a folder"
            return _unwritable(p)
    return None


def _unwritable(folder: Path) -> str | None:
    """Why nothing can be written into the existing ``folder``, or None. Root passes every permission bit, so
    besides ``os.access`` (which sees a read-only file system and an immutable folder, for root too) a nameless
    file is made and closed there (``O_TMPFILE`` where the file system has it): nothing is left behind."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is on a read-only file system" if _read_only(folder) else f"{folder} is not writable"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"{folder} is not writable: {err.strerror or err}"
    return None


def first_undeletable(folders: Iterable[Path]) -> Path | None:
    """The first of ``folders`` whose entries this user may not delete (another user's run in a shared folder:
    one without write permission, or :func:`sticky_for_others`), else None: checked before an ``--overwrite``
    deletes anything, so that it deletes all of a run or nothing."""
    return next((folder for folder in folders
                 if not os.access(folder, os.W_OK | os.X_OK) or sticky_for_others(folder)), None)


def sticky_for_others(folder: Path, names: Collection[str] | None = None) -> bool:
    """Whether ``folder`` has the sticky bit (as /tmp), is not this user's, and holds an entry of another user (of
    ``names``, where given): there only an entry's owner (or the folder's, or root) may delete it or rename another
    file over it, whatever the folder's write permission."""
    if not hasattr(os, "geteuid"):  # Windows: no sticky bit
        return False
    me = os.geteuid()
    try:
        st = os.stat(folder)
        if me == 0 or not st.st_mode & stat.S_ISVTX or st.st_uid == me:
            return False
        with os.scandir(folder) as entries:
            return any(entry.stat(follow_symlinks=False).st_uid != me for entry in entries
                       if names is None or entry.name in names)
    except OSError:  # gone, or not listable (then not writable either: os.access says so)
        return False


def _read_only(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (Windows)
        return False


def check_creatable(path: str | os.PathLike, option: str) -> None:
    """Refuse, creating nothing, a ``path`` that cannot be made into a folder for ``option``, or an existing folder
    nothing can be written into."""
    why = why_uncreatable(path)
    if why is not None:
        what = "cannot write into it" if Path(path).is_dir() else "cannot create it"
        raise InputError(f"{option} {path}: {what} ({why})")


def make_dir(path: str | os.PathLike, option: str) -> Path:
    """Create the folder ``path`` and its parents for ``option`` (an existing folder is fine); returns it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise InputError(f"{option} {path}: cannot create it ({why_uncreatable(path) or err.strerror or err})") \
            from err
    return path
