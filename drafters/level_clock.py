"""The wall seconds of each part of a drafting call, measured without making the host wait for the device.

On CUDA the host queues a part's kernels and moves on, so the host's clock between parts measures launches, not
work, and waiting for the device after each part would add a synchronisation per part to every step. Instead each
part's end is marked with a CUDA event; once the call has read its result from the device (every part is then
done), :meth:`LevelClock.split` shares the call's wall seconds among the parts in proportion to the device time
between their marks. On the CPU the work is synchronous and each part's wall time is measured directly.

    clock = LevelClock(device)       # the call starts
    ... the catch-up ...; clock.mark()
    ... the growth ...;   clock.mark()
    rows = pool.tolist()             # the call's one read of the device
    catch_up, growth = clock.split() # wall seconds, summing to the call's so far

Invariant: the parts' seconds are non-negative and sum to the wall time from the clock's start to ``split()``;
time after the last mark counts to the last part.
"""
from __future__ import annotations

import time
from itertools import pairwise

import torch


class LevelClock:
    """Marks the ends of a call's parts (module doc)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.start = time.perf_counter()
        self.marks: list = [self._now()]  # the start, then each part's end: CUDA events or host seconds
        self.stopped: float | None = None  # stop()'s time

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        """The part running since the last mark (or the start) ends here."""
        self.marks.append(self._now())

    def stop(self) -> None:
        """The call's work is all queued, and the host goes on to other work before reading its result (a pending
        proposal, specdec/pending_trees.py): the parts' seconds are then the call's own, on the CPU the wall time
        until now, on CUDA the device's time between the marks."""
        self.stopped = time.perf_counter()

    def split(self) -> list[float]:
        """Seconds of each marked part; call after the device has finished the marked work (a read of its result)."""
        total = (self.stopped or time.perf_counter()) - self.start
        marks = self.marks
        if len(marks) < 2:
            return []
        if self.cuda:
            parts = [max(a.elapsed_time(b), 0.0) for a, b in pairwise(marks)]  # device milliseconds
            if self.stopped is not None:
                return [p / 1000.0 for p in parts]
        else:
            parts = [b - a for a, b in pairwise(marks)]
            parts[-1] += total - sum(parts)  # the host's time after the last mark
            return parts
        device = sum(parts)
        if device <= 0.0:
            return [total / len(parts)] * len(parts)
        return [total * p / device for p in parts]
