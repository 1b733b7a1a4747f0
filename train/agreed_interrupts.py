"""Ctrl-C and SIGTERM in a run of several processes, acted on after a step every process agrees on.

A signal reaches one process (``kill``), or each at another point (a terminal's Ctrl-C, a scheduler's SIGTERM,
the launcher passing one on). Stopping where it lands would leave the other processes waiting in a collective, so
none could save. Here each process records the signal instead; every step the processes add up what they
recorded in a collective the step makes anyway, so all see it at the same step, finish that step, the main
process saves it, and each stops as its own signal would have stopped it (one that got none takes its peers':
SIGTERM if any got it, else SIGINT).

    with InterruptsHeld() as held:
        while training:
            seen = accelerator.reduce(held.recorded())    # on every process, at the same point of each step
            ...                                           # the rest of the step
            if seen.any():
                save(); held.stop(seen)

A signal after the last such collective is handled when the block ends. Outside the main thread, where Python
cannot set handlers, nothing is held.
"""
from __future__ import annotations

import contextlib
import signal
from typing import NoReturn

import torch
from specdec.train.deferred_interrupts import SIGNALS, handle_as_before


class InterruptsHeld:
    """Records SIGINT and SIGTERM while the block runs; :meth:`stop` or the block's end handles them."""

    def __init__(self) -> None:
        self.caught: list[int] = []
        self.previous: dict = {}

    def __enter__(self) -> InterruptsHeld:
        # a handler set outside Python (getsignal gives None) could not be put back: that signal is left alone
        held = [s for s in SIGNALS if signal.getsignal(s) is not None]
        with contextlib.suppress(ValueError):  # not the main thread
            self.previous = {s: signal.signal(s, self._record) for s in held}
        return self

    def _record(self, signum, frame) -> None:
        self.caught.append(signum)

    def recorded(self, device=None) -> torch.Tensor:
        """Whether this process got each of SIGINT, SIGTERM (1.0 / 0.0): summed over the processes, what they got."""
        return torch.tensor([float(s in self.caught) for s in SIGNALS], device=device)

    def _restore(self) -> dict:
        previous, self.previous = self.previous, {}
        for s, handler in previous.items():
            signal.signal(s, handler)
        return previous

    def stop(self, seen: torch.Tensor) -> NoReturn:
        """Stop as this process's first signal would have, else as its peers' (``seen``: :meth:`recorded` summed over
        the processes); KeyboardInterrupt where every handler ignores them (the peers stop all the same)."""
        previous = self._restore()
        peers = [s for s, n in reversed(list(zip(SIGNALS, seen.tolist()))) if n > 0]  # SIGTERM first
        for s in dict.fromkeys(self.caught + peers):
            handle_as_before(s, previous.get(s, signal.getsignal(s)))
        raise KeyboardInterrupt

    def __exit__(self, exc_type, exc, tb) -> None:
        previous = self._restore()
        if exc_type is None:  # a signal after the last agreement: handled now
            for s in dict.fromkeys(self.caught):
                handle_as_before(s, previous.get(s))
