"""What the speculation policy learned in one generate() call, kept for the next calls of this process: one store.

    value = recall("guard", key)        # None: nothing kept under that key (or key is None)
    remember("guard", key, value)       # a sequence finished: what was learned so far

Keys name what the learning depends on: the break-even guard and tree sizing (``"guard"``: the cost model's file and
the drafter's cost key, :mod:`specdec.tree_sizing`), the combined drafter's child gate (``"child gate"``) and EAGLE's
depth chooser (``"depth"``), both keyed by :func:`specdec.drafters.call_memory.memory_key`. Values are copies: a
later call starts from what was kept and never changes it in place. Tests clear it with :func:`forget_all`.
"""
from __future__ import annotations

from typing import Any

_STORE: dict[tuple[str, tuple], Any] = {}  # (decider, key) -> what it learned by the end of its last finished call


def recall(decider: str, key: tuple | None) -> Any:
    """What ``decider`` kept under ``key`` (None when nothing is kept, or ``key`` is None: start fresh)."""
    return None if key is None else _STORE.get((decider, key))


def remember(decider: str, key: tuple | None, value: Any) -> None:
    """Keep ``value`` (a copy the caller no longer mutates) for ``decider``'s next call under ``key``."""
    if key is not None:
        _STORE[(decider, key)] = value


def forget_all() -> None:
    """Forget everything (tests: no test depends on which tests ran before it in the same process)."""
    _STORE.clear()
