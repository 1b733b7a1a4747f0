"""The processes of a run sharing a job: each takes its part, one piece per round, and they exchange what they made.

    team = Team.alone()                                  # one process: exchange(x) == [x], nothing waits
    for mine, pieces in team.rounds(batches):            # this process's piece of the round (None: it has none)
        made = work(mine) if mine is not None else None
        for piece, theirs in zip(pieces, team.exchange(made), strict=False):  # every process's, in process order
            ...

A last round may have fewer pieces than processes: the exchange still returns one entry per process (None from
those without a piece), hence ``strict=False``. Every process goes through the same rounds, so their exchanges pair
up, and a round waits only for the slowest piece of that round, never for another process's whole share (a
collective times out: after 10 minutes on NCCL by default). Several processes get their team from the pipeline
(train/pipeline.py), where ``meet`` and ``exchange`` are the meetings that carry Ctrl-C and SIGTERM
(train/agreed_interrupts.py): a process a signal stopped makes the others' next meeting with it, and all stop there.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Team:
    """``index`` of ``size`` processes; ``meet()`` waits for all of them, ``exchange(x)`` returns every process's
    ``x`` (picklable) in process order. Each is called by every process at the same point."""

    index: int
    size: int
    meet: Callable[[], None]
    exchange: Callable[[Any], list]

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size:
            raise ValueError(f"process index {self.index} is not one of {self.size} processes")

    @classmethod
    def alone(cls) -> Team:
        return cls(0, 1, lambda: None, lambda made: [made])

    def rounds(self, pieces: Sequence) -> Iterator[tuple[Any, list]]:
        """Per round, this process's piece (None where it has none) and the round's pieces in process order:
        process ``p`` takes pieces ``p``, ``p + size``, ... . A run of one process goes through them one by one."""
        for first in range(0, len(pieces), self.size):
            those = list(pieces[first : first + self.size])
            yield (those[self.index] if self.index < len(those) else None), those
