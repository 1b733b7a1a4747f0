"""How far a long sampling step has come, said in a few lines through the certificate's ``progress`` callback.

    counter = TokenProgress(progress, "end to end: the exact rule", total=2 * 600 * 36)
    generate(loaded, prompts, streamer=counter, ...)   # a callable streamer: fn(batch_index, tokens)

A line at each tenth of ``total`` committed tokens, but only once ``quiet_seconds`` have passed since the step began or
the last line: a check that takes minutes on a CPU says how far it is about every tenth, one that takes seconds says
nothing more. The library never prints: the callback is the caller's (the CLI prints it, tests collect it).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

TENTHS = 10


class TokenProgress:
    """A callable streamer counting committed tokens towards ``total``; tells ``progress`` as module doc says."""

    def __init__(self, progress: Callable[[str], None], what: str, total: int, quiet_seconds: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.progress, self.what, self.total = progress, what, max(1, total)
        self.quiet_seconds, self.clock = quiet_seconds, clock
        self.done = 0
        self.tenth = 0  # tenths of total passed and said (or passed while quiet)
        self.last = clock()

    def __call__(self, batch_index: int, tokens: Sequence[int]) -> None:
        self.done += len(tokens)
        tenth = min(TENTHS, self.done * TENTHS // self.total)
        if tenth <= self.tenth:
            return
        self.tenth = tenth
        now = self.clock()
        if now - self.last >= self.quiet_seconds:
            self.last = now
            self.progress(f"{self.what}: {tenth * 100 // TENTHS}% of the sampled tokens ({self.done:,} of "
                          f"{self.total:,})")
