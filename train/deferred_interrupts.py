"""Ctrl-C and SIGTERM held back while a training step is applied, so an interrupt never leaves it half done.

    with interrupts_deferred():
        optimizer.step(); scheduler.step(); step += 1

Inside the block SIGINT and SIGTERM are recorded instead of handled; when it ends the handlers in place before
are put back and handle a recorded signal then (Ctrl-C's KeyboardInterrupt, the CLI's SIGTERM-as-interrupt),
where the step is complete. Outside the main thread, where Python cannot set handlers, the block runs as it is.
"""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    caught: list[int] = []

    def hold(signum, frame):
        caught.append(signum)

    # a handler set outside Python (getsignal gives None) could not be put back: that signal is left alone
    deferred = [s for s in SIGNALS if signal.getsignal(s) is not None]
    try:
        previous = {s: signal.signal(s, hold) for s in deferred}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):  # in the order they came; the first that raises ends the rest
            handle_as_before(s, previous[s])


def handle_as_before(signum: int, handler) -> None:
    """What ``handler`` (a handler ``signal.signal`` returned) does with ``signum``: call it, or for the default
    action send the signal again (SIGTERM then ends the process); an ignored signal does nothing."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        os.kill(os.getpid(), signum)
