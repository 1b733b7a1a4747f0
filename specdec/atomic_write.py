"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half.

    write_json(out / "settings.json", settings, indent=1)
    write_text(out / "report.md", markdown)
    save_tensors(path / "weights.safetensors", tensors, metadata={"format": "pt"})
    with replaced_atomically(path / "optimizer.pt") as tmp:
        torch.save(optimizer.state_dict(), tmp)

The data is written to a temporary file beside the target, ``NAME.PID.THREAD.tmp`` (one per process and thread:
concurrent writers never share one), and renamed over it (``os.replace`` is atomic on POSIX and Windows within one
filesystem). :func:`leftover_of` recognises the temporary file an interrupted write left.

A writer holds its temporary file (``flock``) while it writes, and removes the ones earlier writers of the same
name left that nobody holds: a process killed between its write and the rename (a distillation's cache entry of
hundreds of MB, an evaluation's cell) leaves its temporary file until the next write of that name, not for good. A
file another process (another node, on a shared disk) is writing now is held, and stays; where the system or the
file system has no ``flock`` (Windows; some network mounts) none is removed.
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


logger = logging.getLogger(__name__)


@contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed
    and ``path`` keeps its old content (an OSError that names no file, as a full disk's, or the temporary file, as a
    read-only folder's, is raised naming ``path``). Creates the parent directory; removes the temporary files killed
    writers of ``path`` left (:func:`remove_leftovers`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    hold = None
    try:
        hold = _hold(tmp)
        remove_leftovers(path)
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        # a write that fails names no file (a full disk: ENOSPC) or the temporary one (a folder this user may not
        # write); the user's error line names the one meant
        if err.errno is None or err.filename not in (None, str(tmp)):
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err
    finally:
        if os.path.lexists(tmp):  # never made (a read-only file system): its unlink raised EROFS, not ENOENT
            tmp.unlink(missing_ok=True)
        if hold is not None:
            os.close(hold)  # the lock goes with the descriptor


def _hold(tmp: Path) -> int | None:
    """Create ``tmp`` and hold it (``flock``) for the write; the descriptor, or None where nothing can be held. A
    file removed or replaced while the hold was taken (by :func:`remove_leftovers`, for a dead writer's of the same
    name) is made anew, so the file the write goes into is the one held."""
    if fcntl is None:
        return None
    while True:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(tmp)):
                return fd
        except FileNotFoundError:  # removed meanwhile: made anew
            pass
        except OSError as err:  # a file system without flock: written unheld, as before
            logger.debug("%s: not held (%s)", tmp, err.strerror or err)
            os.close(fd)
            return None
        os.close(fd)


def remove_leftovers(path: str | os.PathLike) -> None:
    """Remove the temporary files that interrupted writes of ``path`` left beside it (this module's, of any earlier
    version), except those a writer holds now: the write of ``path`` calls it, and a command that holds its output
    folder (specdec.folder_lock) may call it for the files it replaces."""
    path = Path(path)
    if fcntl is None:  # a live writer's file cannot be told from a dead one's
        return
    name = re.compile(re.escape(path.name) + r"\.\d+(?:\.\d+)?\.tmp")
    try:
        found = sorted(entry.name for entry in os.scandir(path.parent) if name.fullmatch(entry.name))
    except OSError:  # no folder (yet), or not listable
        return
    for left in found:
        size = _remove_unheld(path.parent / left)
        if size is not None:
            logger.warning("removed %s (%.1f MB), left by a write that was stopped before it ended",
                           path.parent / left, size / 1e6)


def _remove_unheld(left: Path) -> int | None:
    """Remove ``left`` if no writer holds it; its size, or None where it stays (held, gone, or not lockable)."""
    try:
        fd = os.open(left, os.O_WRONLY)  # for writing: NFS emulates flock by fcntl locks, which need it
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held (BlockingIOError) or no flock here: it stays
        st = os.fstat(fd)
        if not os.path.samestat(st, os.stat(left)):  # replaced meanwhile: not the file found unheld
            return None
        os.unlink(left)
        return st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)


def leftover_of(name: str) -> str | None:
    """The file name whose interrupted atomic write left the temporary file ``name`` (``NAME.PID.THREAD.tmp``, or
    ``NAME.PID.tmp`` as earlier versions named it); None for any other name."""
    match = re.fullmatch(r"(.+?)\.\d+(?:\.\d+)?\.tmp", name)
    return None if match is None else match.group(1)


def write_json(path: str | os.PathLike, data, *, indent: int | None = None) -> Path:
    """Serialise ``data`` first (a TypeError leaves any existing file untouched), then swap it in."""
    return write_text(path, json.dumps(data, indent=indent) + "\n")


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``text``, as UTF-8, swapped in for ``path``'s content."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def save_tensors(path: str | os.PathLike, tensors: dict, *, metadata: dict | None = None) -> Path:
    """safetensors' ``save_file``, atomically. A write the disk refuses (full, read-only) is an OSError naming
    ``path``, as :func:`replaced_atomically` raises it: safetensors raises its own SafetensorError ("Error while
    serializing: I/O error: No space left on device (os error 28)"), which no caller took for a disk's refusal."""
    from safetensors import SafetensorError  # (safetensors.torch imports torch: not before a write needs it)
    from safetensors.torch import save_file

    with replaced_atomically(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except SafetensorError as err:
            code = re.search(r"\(os error (\d+)\)", str(err))
            if code is None:  # not the disk's refusal (tensors safetensors cannot write): as it was
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from err
        as_created(tmp)
    return Path(path)


def as_created(path: str | os.PathLike) -> None:
    """Give the file ``path`` the permissions a file created by this process gets (0666 less the umask):
    safetensors' ``save_file`` writes its files readable by their owner alone, whatever the umask, so a server
    running as another user could not read the heads a training run wrote."""
    os.chmod(path, 0o666 & ~umask())


def umask() -> int:
    """This process's umask: read from /proc on Linux, else set and restored at once (os.umask has no read-only
    form: a file another thread creates in between gets umask 022)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask
