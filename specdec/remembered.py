"""What the speculation policy learned in one generate() call, kept for the next calls: one store.

    value = recall("guard", key, persist=True)      # None: nothing kept under that key (or key is None)
    remember("guard", key, value, persist=True)     # a sequence finished: what was learned so far
    save()                                          # a run ended: persisted values written, once each

Keys name what the learning depends on: the break-even guard and tree sizing (``"guard"``: the cost model's cache
file and measured curve, and the drafter's cost key, :mod:`specdec.tree_sizing`), the combined drafter's child
gate (``"child gate"``) and EAGLE's depth chooser (``"depth"``), both keyed by
:func:`specdec.drafters.call_memory.memory_key`. Values
are copies: a later call starts from what was kept and never changes it in place.

``persist=True`` (the guard, whose key is the cost model's): also kept across processes, as JSON in the cost cache
(``<cost dir>/remembered/``), read once per process and key and written by :func:`save` (the speculation policy
calls it when a run's last sequence finishes, not at every finished sequence); the value must be JSON-able. Where
the cost cache has no folder (no home directory), values are kept in this process only. A decider that passes
``damaged`` to :func:`recall` has a value it cannot use (a damaged file's) named in a warning, once, and starts
fresh. Tests give each test its own folder with :func:`use_folder` and clear the process's store with
:func:`forget_all`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specdec.atomic_write import write_json

logger = logging.getLogger(__name__)
_STORE: dict[tuple[str, tuple], Any] = {}  # (decider, key) -> what it learned by the end of its last finished call
_UNSAVED: set[tuple[str, tuple]] = set()  # persisted (decider, key) remembered since the last save()
_MISSING = object()  # read from disk once and absent there
_FOLDER: Path | None = None  # use_folder(); None: <cost dir>/remembered
_UNSAVED_LOCK = threading.Lock()  # concurrent generate() calls: save() takes its batch while others remember
_UNWRITABLE: set[Path] = set()  # folders a save could not write into: said once per process, not at every call


def use_folder(folder: str | Path | None) -> None:
    """Keep persisted values in ``folder`` (None: the cost cache's ``remembered/``)."""
    global _FOLDER
    _FOLDER = None if folder is None else Path(folder)


def _file(decider: str, key: tuple) -> Path | None:
    """Where ``decider``'s value under ``key`` is persisted (None: the cost cache has no folder)."""
    if _FOLDER is not None:
        folder = _FOLDER
    else:
        from specdec.cost_model import cache_dir

        costs = cache_dir()
        if costs is None:
            return None
        folder = costs / "remembered"
    digest = hashlib.sha256(json.dumps([decider, key], default=str).encode()).hexdigest()[:20]
    return folder / f"{decider.replace(' ', '-')}-{digest}.json"


def _read(decider: str, key: tuple) -> Any:
    file = _file(decider, key)
    try:
        data = json.loads(file.read_text()) if file is not None and file.is_file() else None
    except (OSError, ValueError):
        logger.warning("remembered: unreadable %s; starting fresh", file)
        return _MISSING
    if not isinstance(data, dict) or data.get("key") != json.loads(json.dumps([decider, key], default=str)):
        return _MISSING  # another key's file under the same digest (or an old format): not ours
    return data.get("value", _MISSING)


def recall(decider: str, key: tuple | None, persist: bool = False,
           damaged: Callable[[Any], str | None] | None = None) -> Any:
    """What ``decider`` kept under ``key`` (None when nothing is kept, or ``key`` is None: start fresh).
    ``damaged(value)``: what makes a value unusable (None: nothing); such a value is named in a warning, with its
    file, and forgotten: None, now and at the next recalls."""
    if key is None:
        return None
    if persist and (decider, key) not in _STORE:  # read the disk once per process and key
        _STORE[(decider, key)] = _read(decider, key)
    value = _STORE.get((decider, key), _MISSING)
    why = None if value is _MISSING or damaged is None else damaged(value)
    if why is not None:
        where = _file(decider, key) if persist else None
        logger.warning("remembered: damaged %s value in %s (%s); starting fresh", decider, where or "this process", why)
        _STORE[(decider, key)] = value = _MISSING
    return None if value is _MISSING else value


def remember(decider: str, key: tuple | None, value: Any, persist: bool = False) -> None:
    """Keep ``value`` (a copy the caller no longer mutates) for ``decider``'s next call under ``key``; with
    ``persist``, for the next processes too, from the next :func:`save` (JSON-able values)."""
    if key is None:
        return
    _STORE[(decider, key)] = value
    if persist:
        with _UNSAVED_LOCK:
            _UNSAVED.add((decider, key))


def save() -> None:
    """Write every persisted value remembered since the last save to the cost cache (one remembered meanwhile, by
    another thread's call, waits for the next save)."""
    with _UNSAVED_LOCK:
        batch = sorted(_UNSAVED, key=repr)
        _UNSAVED.clear()
    for decider, key in batch:
        file = _file(decider, key)
        if file is None:  # no cache folder (the cost model said so): this process still remembers
            continue
        try:
            write_json(file, {"key": [decider, key], "value": _STORE[(decider, key)]})
        except OSError as err:  # a read-only cache: this process still remembers
            if file.parent not in _UNWRITABLE:
                _UNWRITABLE.add(file.parent)
                logger.warning("remembered: cannot write into %s (%s); what this process learns is not kept for the "
                               "next", file.parent, err.strerror or err)


def forget_all() -> None:
    """Forget what this process holds, saved or not (tests: no test depends on which tests ran before it in the same
    process)."""
    _STORE.clear()
    _UNSAVED.clear()
