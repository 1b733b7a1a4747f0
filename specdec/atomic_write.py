"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half.

    write_json(out / "settings.json", settings, indent=1)
    write_text(out / "report.md", markdown)
    save_tensors(path / "weights.safetensors", tensors, metadata={"format": "pt"})
    with replaced_atomically(path / "optimizer.pt") as tmp:
        torch.save(optimizer.state_dict(), tmp)

The data is written to a temporary file beside the target, ``NAME.PID.THREAD.tmp`` (one per process and thread:
concurrent writers never share one), and renamed over it (``os.replace`` is atomic on POSIX and Windows within one
filesystem). :func:`leftover_of` recognises the temporary file an interrupted write left.
"""
from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed
    and ``path`` keeps its old content (an OSError that names no file, as a full disk's, is raised naming
    ``path``). Creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as err:
        if err.filename is not None or err.errno is None:
            raise
        # a write that fails (a full disk: ENOSPC) names no file; the user's error line names the one meant
        raise OSError(err.errno, err.strerror, str(path)) from err
    finally:
        tmp.unlink(missing_ok=True)


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
    return Path(path)
