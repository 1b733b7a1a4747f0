"""What one generate() call holds alone while it runs: its drafter objects, and the model's shared CUDA-graph cache.

    with drafter_claimed(request.drafter):        # InputError if another running call drafts with that object
        ...build the engine, run it...
    with CLAIMS:                                  # check-and-set of GraphedForward.serving (specdec.engine_setup)
        ...

A drafter keeps one call's state between its ``attach`` and the end of the call (the target's view, its
per-sequence tables, its own model's KV cache), so two calls that draft with one object at once (two threads, or a
streamer calling generate()) corrupt each other: a draft-model drafter died on a bare KeyError / IndexError. The
second call is refused in one line instead; calls with their own drafter objects share one loaded model freely
(docs/getting-started.md, Threads). A combined drafter's children are claimed with it. Objects are held by
identity (``id``) for the duration of the call only: nothing is kept after it.

Invariant: a drafter object is in ``_IN_USE`` exactly while one generate() call runs with it; every change to
``_IN_USE`` and to a shared graph cache's ``serving`` flag happens under ``CLAIMS``.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from specdec.drafters.base import _ObjectDrafter
from specdec.errors import InputError

CLAIMS = threading.Lock()
_IN_USE: set[int] = set()  # id() of the drafter objects of the generate() calls running now


def _objects(drafter: Any) -> list[Any]:
    """The user's objects behind ``drafter``: itself (the wrapped object of a plain ``propose`` object), and the
    children of a drafter made of drafters, recursively."""
    own = drafter.obj if isinstance(drafter, _ObjectDrafter) else drafter
    found = [own]
    for child in getattr(drafter, "children", None) or ():
        found += _objects(child)
    return found


@contextmanager
def drafter_claimed(drafter: Any) -> Iterator[None]:
    """Hold ``drafter`` (None: nothing) for one generate() call; an InputError if another running call holds it."""
    if drafter is None:
        yield
        return
    ids = {id(o) for o in _objects(drafter)}
    with CLAIMS:
        if ids & _IN_USE:
            raise InputError(f"this {type(drafter).__name__} object is drafting for another generate() call that is "
                             "still running (another thread's, or the caller of this streamer's): a drafter holds one "
                             "call's state, so give each concurrent call a drafter object of its own (a drafter name, "
                             "or a new instance; they may share one loaded model)")
        _IN_USE.update(ids)
    try:
        yield
    finally:
        with CLAIMS:
            _IN_USE.difference_update(ids)


def drafters_in_use() -> int:
    """How many drafter objects running calls hold (tests: none once every call has ended)."""
    return len(_IN_USE)
