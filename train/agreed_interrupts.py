"""Ctrl-C and SIGTERM in a run of several processes: every process stops at a collective all of them make.

A signal reaches one process (``kill``), or each at another point (a terminal's Ctrl-C, a scheduler's SIGTERM,
the launcher passing one on). Stopping where it lands would leave the other processes waiting in a collective (or
failing in it: "Connection closed by peer"). Here each process records the signal, and the collectives the
processes make anyway carry what they recorded (summed), so all learn it at the same one and stop there, each as
its own signal would have stopped it (one that got none takes its peers': SIGTERM if any got it, else SIGINT).

    with InterruptsHeld() as held:                        # the training loop: held, acted on after a whole step
        while training:
            seen = accelerator.reduce(held.recorded())    # on every process, at the same point of each step
            ...                                           # the rest of the step
            if seen.any():
                save(); held.stop(seen)

    with InterruptsHeld(hold=False) as agreed:            # the rest of a run: a signal acts at once, as in one process
        try:
            prepare(); agreed.meet(accelerator)           # in place of a barrier
        except KeyboardInterrupt as err:
            agreed.meet_after(accelerator, err)           # the others' next meeting: they stop there too

A held signal after the last collective is handled when the block ends. Outside the main thread, where Python
cannot set handlers, nothing is recorded.
"""
from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch
from specdec.train.deferred_interrupts import SIGNALS, handle_as_before

from specdec.sigterm import again_after_a_finalizer

logger = logging.getLogger(__name__)
T = TypeVar("T")


class InterruptsHeld:
    """Records SIGINT and SIGTERM while the block runs. Held (the default), a signal is only recorded: :meth:`stop`
    or the block's end handles it. With ``hold=False`` each is also handled as it comes, as without the block, except
    during :meth:`meet`."""

    def __init__(self, hold: bool = True) -> None:
        self.caught: list[int] = []
        self.previous: dict = {}
        self.hold = hold

    def __enter__(self) -> InterruptsHeld:
        # a handler set outside Python (getsignal gives None) could not be put back: that signal is left alone
        held = [s for s in SIGNALS if signal.getsignal(s) is not None]
        with contextlib.suppress(ValueError):  # not the main thread
            self.previous = {s: signal.signal(s, self._record) for s in held}
        return self

    def _record(self, signum, frame) -> None:
        self.caught.append(signum)
        if not self.hold and not again_after_a_finalizer(signum, frame):
            self._handle(signum)

    def _handle(self, signum: int) -> None:
        """What the handler in place before the block does with ``signum`` (the default action ends the process)."""
        previous = self.previous.get(signum)
        if previous == signal.SIG_DFL:  # sent again below: it must not reach _record
            self._restore()
        handle_as_before(signum, previous)

    def recorded(self, device=None) -> torch.Tensor:
        """Whether this process got each of SIGINT, SIGTERM (1.0 / 0.0): summed over the processes, what they got."""
        return torch.tensor([float(s in self.caught) for s in SIGNALS], device=device)

    def _restore(self) -> dict:
        previous, self.previous = self.previous, {}
        for s, handler in previous.items():
            signal.signal(s, handler)
        return previous

    def meet(self, accelerator, last: bool = False, then: Callable[[], T] | None = None) -> T | None:
        """Every process, at the same point (a barrier that carries the signals): where any process recorded one,
        every process stops here (:meth:`stop`); else they do ``then()`` together (another collective, e.g. an
        exchange of what they made: train/process_team.py) and its result is returned. A signal during the
        meeting is held; with ``hold=False`` it is handled right after, and the others learn it at the next meeting
        (:meth:`meet_after`). After the ``last`` meeting signals are held: the block's end handles them."""
        hold, self.hold, before = self.hold, True, len(self.caught)
        try:
            seen = accelerator.reduce(self.recorded(accelerator.device), reduction="sum")
            if bool(seen.any()):
                self.stop(seen)
            together = then() if then is not None else None
        finally:
            self.hold = hold or last
        if not self.hold:
            for s in dict.fromkeys(self.caught[before:]):
                self._handle(s)
        return together

    def meet_after(self, accelerator, err: KeyboardInterrupt) -> None:
        """This process was stopped by a signal it recorded (``err``) outside the loop, where the others go on to
        their next :meth:`meet`: it makes that meeting with its signal, so they stop there too, and marks ``err``
        ``processes_stopped_together``. Signals are only recorded from here on: this process is stopping."""
        if not self.caught or getattr(err, "processes_stopped_together", False):
            return  # not a signal this block recorded (the others' meeting could be another collective), or done
        self.hold = True
        try:
            accelerator.reduce(self.recorded(accelerator.device), reduction="sum")
        except RuntimeError as gone:  # the others had stopped already (gloo: "Connection closed by peer")
            logger.warning("interrupted: the other processes had already stopped (%s)", str(gone).split("\n")[0])
            return
        err.processes_stopped_together = True

    def stop(self, seen: torch.Tensor) -> NoReturn:
        """Stop as this process's first signal would have, else as its peers' (``seen``: :meth:`recorded` summed over
        the processes); KeyboardInterrupt where every handler ignores them (the peers stop all the same). What it
        raises is marked ``processes_stopped_together``."""
        previous = self._restore()
        peers = [s for s, n in reversed(list(zip(SIGNALS, seen.tolist(), strict=True))) if n > 0]  # SIGTERM first
        try:
            for s in dict.fromkeys(self.caught + peers):
                handle_as_before(s, previous.get(s, signal.getsignal(s)))
            raise KeyboardInterrupt
        except KeyboardInterrupt as err:
            err.processes_stopped_together = True
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        previous = self._restore()
        if exc_type is None and self.hold:  # a signal after the last agreement: handled now
            for s in dict.fromkeys(self.caught):
                handle_as_before(s, previous.get(s))
