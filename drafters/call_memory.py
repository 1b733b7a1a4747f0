"""What a drafter-side decision learns in one generate() call, kept for the next call with the same key: a window of
records and a draft time per part. Base of the combined drafter's child gate (parts: children) and of EAGLE's depth
chooser (parts: draft levels).

    class ChildGate(CallMemory):
        _store = _REMEMBERED                    # the subclass's module dict (tests clear it)
    key = memory_key(drafter, target.runner)    # the drafter's cost key and the target it drafts for
    gate._begin(key)                            # in start(): fresh state, or the last finished call's of that key
    gate.finish()                               # a sequence finished: keep what was learned

Why kept: as the engine's guard does (:mod:`specdec.tree_sizing`, Memory), so that a server calling generate()
once per short answer does not pay the warm-up or the first probes again on every answer. Only decisions that
may depend on wall times use it (``active``: off under seeded standard sampling).
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace

from specdec.tree_sizing import DraftTime


def memory_key(drafter, runner) -> tuple:
    """The key what a drafter learned is kept under: its cost key (checkpoint and settings) and the target's shape,
    dtype and device (``runner`` may be None: a test's stand-in target)."""
    return (drafter.cost_key(), repr(getattr(runner, "shape", None)), str(getattr(runner, "dtype", None)),
            str(getattr(runner, "device", None)))


class CallMemory:
    _store: dict  # memory key -> (records, times) of the last finished call; set by each subclass

    def __init__(self, parts: int, window: int, ema: float) -> None:
        self._parts, self._ema = parts, ema
        self.memory_key: tuple | None = None
        self.records: deque = deque(maxlen=window)  # the most recent records, what the decision weighs
        self.times = [DraftTime(ema) for _ in range(parts)]  # seconds per call of each part

    @property
    def active(self) -> bool:  # the decision is on (subclasses): only then is anything kept or restored
        raise NotImplementedError

    def _begin(self, memory_key: tuple | None) -> None:
        """A new call: the last finished call's records and times under ``memory_key``, else none."""
        self.memory_key = memory_key
        self.records.clear()
        self.times = [DraftTime(self._ema) for _ in range(self._parts)]
        if self.active and memory_key in self._store:
            records, times = self._store[memory_key]
            self.records.extend(records)
            self.times = [replace(t) for t in times]

    def _record(self, part: int, seconds: float, catch_up: bool) -> None:
        """Wall seconds of one call of ``part``."""
        self.times[part].record(seconds, catch_up)

    def call_seconds(self, part: int, batch: int) -> float | None:
        """Seconds of one call of ``part`` (at ``batch`` sequences: the wall time of such calls); None: never timed."""
        return self.times[part].seconds

    def finish(self) -> None:
        """A sequence finished: what was learned is kept for the next call with the same key."""
        if self.active and self.memory_key is not None:
            self._store[self.memory_key] = (list(self.records), [replace(t) for t in self.times])
