"""Atomic file writes: a reader (or a resumed run) sees the old file or the new one, never half.

    write_json(out / "settings.json", settings, indent=1)

The data is written to a temporary file beside the target and renamed over it
(``os.replace`` is atomic on POSIX and Windows within one filesystem).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_json(path: str | os.PathLike, data, *, indent: int | None = None) -> Path:
    """Serialise ``data`` first (a TypeError leaves any existing file untouched), then swap it in."""
    path = Path(path)
    text = json.dumps(data, indent=indent) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # per process: concurrent writers never share it
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
