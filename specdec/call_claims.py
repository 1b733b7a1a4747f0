"""What one generate() call holds alone while it runs: its drafter objects, and the shared CUDA-graph caches.

    with drafter_claimed(request.drafter):        # InputError if another running call drafts with that object
        ...build the engine, run it...
    with CLAIMS:                                  # check-and-set of a shared graph cache's ``serving`` flag
        ...

A drafter keeps one call's state between its ``attach`` and the end of the call (the target's view, its
per-sequence tables, its own model's KV cache), so two calls that draft with one object at once (two threads, or a
streamer calling generate()) corrupt each other: a draft-model drafter died on a bare KeyError / IndexError. The
second call is refused in one line instead; calls with their own drafter objects share one loaded model freely
(docs/serving.md, "Many calls, several threads"). A combined drafter's children are claimed with
it. Objects are held by identity (``id``) for the duration of the call only: nothing is kept after it.

Graph caches kept on a model and reused by later calls (the target's, taken in specdec.engine_setup; a draft
model's and an EAGLE model's, taken by their drafters) serve one call at a time: each is taken through
:func:`held_for_call` and held until the generate() call running on its thread ends (:func:`drafter_claimed` opens
that call's scope); a call that finds one serving verifies or drafts eagerly beside it.

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
# per thread, a list per generate() call running on it (innermost last: a streamer's call runs inside its caller's):
# the drafter-side graph caches that call holds
_CALLS = threading.local()


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
    """Hold ``drafter`` (None: nothing) for one generate() call; an InputError if another running call holds it.
    The graph caches its drafting takes meanwhile (:func:`held_for_call`) are given back when the call ends."""
    ids = set() if drafter is None else {id(o) for o in _objects(drafter)}
    with CLAIMS:
        if ids & _IN_USE:
            raise InputError(f"this {type(drafter).__name__} object is drafting for another generate() call that is "
                             "still running (another thread's, or the caller of this streamer's): a drafter holds one "
                             "call's state, so give each concurrent call a drafter object of its own (a drafter name, "
                             "or a new instance; they may share one loaded model)")
        _IN_USE.update(ids)
    calls = _calls()
    held: list[Any] = []
    calls.append(held)
    try:
        yield
    finally:
        calls.pop()
        with CLAIMS:
            _IN_USE.difference_update(ids)
            for graphs in held:
                graphs.serving = False


def held_for_call(graphs: Any) -> bool:
    """Take ``graphs`` (a graph cache kept on a model for later calls, with a ``serving`` flag) for the generate()
    call running on this thread, until it ends; False if another call, or another drafter of this call, holds it
    (the caller then runs eagerly). The caller holds ``CLAIMS``, so that finding the cache and taking it are one
    step. Outside a generate() call (an Engine driven by hand) nothing would give it back: it is used unmarked."""
    if graphs.serving:
        return False
    calls = _calls()
    if calls:
        graphs.serving = True
        calls[-1].append(graphs)
    return True


def _calls() -> list[list[Any]]:
    """This thread's running generate() calls, innermost last: what each holds."""
    if not hasattr(_CALLS, "stack"):
        _CALLS.stack = []
    return _CALLS.stack


def drafters_in_use() -> int:
    """How many drafter objects running calls hold (tests: none once every call has ended)."""
    return len(_IN_USE)
