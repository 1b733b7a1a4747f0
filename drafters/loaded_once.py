"""Draft checkpoints loaded once per process: a drafter built for each generate() call (``drafter="eagle",
drafter_options={"path": ...}``) takes the module an earlier call loaded from the same files, instead of reading
and checking the checkpoint again (~0.14 s for the EAGLE quick-recipe layer on a 2-core CPU, 10-20% of a
short answer).

Keyed by the directory's files (name, size, modification time) and by what the loader was asked for (target,
dtype, device): a checkpoint rewritten on disk is read again. The last ``KEEP`` modules are held. Invariant: a
cached module is only read by drafters (inference), never changed by them.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
KEEP = 4
_LOADED: OrderedDict[tuple, object] = OrderedDict()


def _files(directory: Path) -> tuple:
    return tuple(sorted((f.name, s.st_size, s.st_mtime_ns) for f in directory.iterdir() if f.is_file()
                        for s in [f.stat()]))


def load_once(kind: str, directory: str | os.PathLike, request: Hashable, load: Callable[[], T]) -> T:
    """``load()``'s module for ``kind`` checkpoints in ``directory`` asked with ``request``, loaded at most once
    while the files stay as they are. A directory that cannot be listed is left to ``load`` (its error)."""
    path = Path(directory)
    try:
        key = (kind, str(path.resolve()), _files(path), request)
    except OSError:
        return load()
    if key in _LOADED:
        _LOADED.move_to_end(key)
        return _LOADED[key]  # type: ignore[return-value]
    module = load()
    _LOADED[key] = module
    while len(_LOADED) > KEEP:
        _LOADED.popitem(last=False)
    return module


def forget() -> None:
    """Drop every held module (tests)."""
    _LOADED.clear()
