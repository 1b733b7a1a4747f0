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
may depend on wall times use it (``active``), so seeded text never depends on it.

**Fixed times** (seeded sampling, :mod:`specdec.draft_cost`): ``_begin(None, fixed_times)`` starts from the per-part
seconds a calibration measured for one sequence (the drafter's cached cost profile); wall times recorded later are
ignored and nothing is kept or restored, so a decision depends on the cached values and the tokens only. A part
that prices its own calls from its profile (a combined drafter's EAGLE child, at the depth it chose) replaces its
time with those prices (``_record_profiled``). A part's cost per call is its time per sequence times the batch.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from specdec.tree_sizing import DraftTime


def memory_key(drafter, runner) -> tuple:
    """The key what a drafter learned is kept under: its cost key (checkpoint and settings) and the target's shape,
    dtype and device (``runner`` may be None: a test's stand-in target)."""
    return (drafter.cost_key(), repr(getattr(runner, "shape", None)), str(getattr(runner, "dtype", None)),
            str(getattr(runner, "device", None)))


def profile_times(profile: dict, key: str, parts: int) -> list[float] | None:
    """``profile[key]`` when it holds a time for each of ``parts`` parts (a usable cached profile: module doc, Fixed
    times), else None (not cached, or cached for another shape): the decision then stays off under a seed."""
    times = profile.get(key)
    if isinstance(times, list) and len(times) == parts and all(isinstance(t, (int, float)) for t in times):
        return [float(t) for t in times]
    return None


class CallMemory:
    _store: dict  # memory key -> (records, times) of the last finished call; set by each subclass

    def __init__(self, parts: int, window: int, ema: float) -> None:
        self._parts, self._ema = parts, ema
        self.memory_key: tuple | None = None
        self.records: deque = deque(maxlen=window)  # the most recent records, what the decision weighs
        self.times = [DraftTime(ema) for _ in range(parts)]  # seconds per call of each part
        self.fixed = False  # times come from a cached profile (module doc, Fixed times)

    @property
    def active(self) -> bool:  # the decision is on (subclasses): only then is anything kept or restored
        raise NotImplementedError

    def _begin(self, memory_key: tuple | None, fixed_times: Sequence[float] | None = None) -> None:
        """A new call: the last finished call's records and times under ``memory_key``, else none; with
        ``fixed_times`` (one per part), those times for good and no memory (module doc, Fixed times)."""
        self.fixed = fixed_times is not None
        if self.fixed and len(fixed_times) != self._parts:
            raise ValueError(f"a cost profile of {len(fixed_times)} parts for {self._parts}")
        self.memory_key = None if self.fixed else memory_key
        self.records.clear()
        self.times = [DraftTime(self._ema) for _ in range(self._parts)]
        if self.fixed:  # provisional: a part's first profiled price replaces the calibrated one
            self.times = [DraftTime(self._ema, seconds=float(s), provisional=True) for s in fixed_times]
        elif self.active and memory_key in self._store:
            records, times = self._store[memory_key]
            self.records.extend(records)
            self.times = [replace(t) for t in times]

    def _record(self, part: int, seconds: float, catch_up: bool) -> None:
        """Wall seconds of one call of ``part`` (ignored with fixed times)."""
        if not self.fixed:
            self.times[part].record(seconds, catch_up)

    def _record_profiled(self, part: int, seconds: float | None, batch: int) -> None:
        """With fixed times: one call of ``part`` over ``batch`` sequences priced at ``seconds`` by its own profile
        (None: it has none, its calibrated time stands). Ignored otherwise."""
        if self.fixed and seconds is not None:
            self.times[part].record(seconds / max(batch, 1))

    def call_seconds(self, part: int, batch: int) -> float | None:
        """Seconds of one call of ``part`` at ``batch`` sequences: the wall time of such calls, or with fixed times
        the time per sequence times the batch; None: never timed."""
        seconds = self.times[part].seconds
        return None if seconds is None else seconds * (max(batch, 1) if self.fixed else 1)

    def finish(self) -> None:
        """A sequence finished: what was learned is kept for the next call with the same key."""
        if self.active and self.memory_key is not None:
            self._store[self.memory_key] = (list(self.records), [replace(t) for t in self.times])
