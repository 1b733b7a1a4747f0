"""The base of a drafter-side decision priced by the speculation policy's costs: what it learns in one generate()
call (a window of records and a draft time per part), kept for the next call with the same key. The combined
drafter's child gate (parts: children) and EAGLE's depth chooser (parts: draft levels) are its two kinds.

    key = memory_key(drafter, target.runner)    # the drafter's cost key and the target it drafts for
    decider.start(target.costs, key)            # at attach: fresh state, or the last finished call's of that key
    decider.finish()                            # a sequence finished: keep what was learned (specdec.remembered)

A subclass names its store (``decider``), its config type, and what a new call resets (``_reset``).

Only decisions that may depend on wall times use it: ``active`` needs the policy's costs (None under
``speculation="always"`` and seeded standard sampling: the decision is off and nothing is kept or restored).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields, replace

from specdec.drafters.base import CostView

from specdec.remembered import recall, remember
from specdec.tree_sizing import DraftTime


def memory_key(drafter, runner) -> tuple:
    """The key what a drafter learned is kept under: its cost key (checkpoint and settings) and the target's shape,
    dtype and device (``runner`` may be None: a test's stand-in target)."""
    return (drafter.cost_key(), repr(getattr(runner, "shape", None)), str(getattr(runner, "dtype", None)),
            str(getattr(runner, "device", None)))


@dataclass(frozen=True)
class DeciderConfig:
    window: int = 32  # records weighed (the most recent)
    probe_budget: float = 0.02  # decode steps per call, on average, spent probing what the decision leaves out
    max_interval: int = 64  # calls between probes at most
    ema: float = 0.2  # weight of a part's newest draft time

    def __post_init__(self) -> None:
        # a subclass's own settings are positive counts or weights
        own = [getattr(self, f.name) for f in fields(self) if f.name not in _BASE_FIELDS]
        if not (self.window >= 1 and self.probe_budget > 0 and self.max_interval >= 1 and 0 < self.ema <= 1
                and all(v > 0 for v in own)):
            raise ValueError(f"invalid {type(self).__name__} {self}")


_BASE_FIELDS = {f.name for f in fields(DeciderConfig)}


class CallMemory:
    decider: str  # its name in the remembered store (set by each subclass)
    config_type: type[DeciderConfig] = DeciderConfig

    def __init__(self, parts: int, config: DeciderConfig | None = None) -> None:
        self.parts, self.config = parts, config or self.config_type()
        self.costs: CostView | None = None  # the policy's costs (start); None: the decision is off
        self.memory_key: tuple | None = None
        self.records: deque = deque(maxlen=self.config.window)  # the most recent records, what the decision weighs
        self.times = [DraftTime(self.config.ema) for _ in range(parts)]  # seconds per call of each part
        self.chosen_counts = [0] * (parts + 1)  # instrumentation, across calls: decisions per choice (subclasses)
        self._reset()

    @property
    def active(self) -> bool:  # the decision is on (subclasses): only then is anything kept or restored
        raise NotImplementedError

    def _reset(self) -> None:
        """The decision's own state at a new call (subclasses)."""

    def start(self, costs: CostView | None, memory_key: tuple | None = None) -> None:
        """A new call: the policy's costs (None: the decision stays off), and the last finished call's records and
        times under ``memory_key``."""
        self.costs, self.memory_key = costs, memory_key
        self.records.clear()
        self.times = [DraftTime(self.config.ema) for _ in range(self.parts)]
        kept = recall(self.decider, memory_key) if self.active else None
        if kept is not None:
            records, times = kept
            self.records.extend(records)
            self.times = [replace(t) for t in times]
        self._reset()

    def _record(self, part: int, seconds: float, catch_up: bool) -> None:
        """Wall seconds of one call of ``part``."""
        self.times[part].record(seconds, catch_up)

    def part_cost(self, part: int, batch: int) -> float | None:
        """One call of ``part`` in plain decode steps at ``batch`` sequences; None: never timed."""
        seconds = self.times[part].seconds
        return None if seconds is None else seconds / max(self.costs.decode_seconds(batch), 1e-9)

    def end_call(self) -> None:
        """The call's end: the policy's costs (which hold the target's cost model and runner) are let go; what was
        learned stays remembered under its key, and the next ``start`` brings the next call's costs."""
        self.costs = None

    def finish(self) -> None:
        """A sequence finished: what was learned is kept for the next call with the same key."""
        if self.active:
            remember(self.decider, self.memory_key, (tuple(self.records), tuple(replace(t) for t in self.times)))
