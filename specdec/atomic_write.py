"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half.

    write_json(out / "settings.json", settings, indent=1)
    with replaced_atomically(path / "weights.safetensors") as tmp:
        save_file(tensors, str(tmp))

The data is written to a temporary file beside the target and renamed over it
(``os.replace`` is atomic on POSIX and Windows within one filesystem).
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replaced_atomically(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on error it is removed
    and ``path`` keeps its old content. Creates the parent directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share it
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, data, *, indent: int | None = None) -> Path:
    """Serialise ``data`` first (a TypeError leaves any existing file untouched), then swap it in."""
    text = json.dumps(data, indent=indent) + "\n"
    with replaced_atomically(path) as tmp:
        tmp.write_text(text)
    return Path(path)
