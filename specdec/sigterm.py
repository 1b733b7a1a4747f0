"""SIGTERM taken as Ctrl-C by the long-running commands (training, ``eval acceptance``, ``eval replay record``).

Schedulers, ``timeout`` and ``kill`` send SIGTERM, which by default ends the process unannounced. Inside
:func:`sigterm_as_interrupt` it raises :class:`Terminated`, a ``KeyboardInterrupt``, so the command's Ctrl-C path
runs: what was finished is kept and the command says how to continue. Outside the block, and off the main thread,
SIGTERM is handled as before. Inside the block Ctrl-C that lands in a finalizer is not lost either (where Python's
own handler took it). :func:`sigterm_ends_at_once` gives SIGTERM back its default action for a wait no Python
handler can cut short (a process group forming).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM (what schedulers, ``timeout`` and ``kill`` send), raised where it arrives: it takes Ctrl-C's path."""


def _raise_terminated(signum, frame):
    if again_after_a_finalizer(signum, frame):
        return
    raise Terminated


def _raise_interrupted(signum, frame):
    if again_after_a_finalizer(signum, frame):
        return
    raise KeyboardInterrupt


def again_after_a_finalizer(signum: int, frame) -> bool:
    """Where a signal handler was called inside a finalizer (a ``__del__``, run by the garbage collector anywhere),
    an exception it raised was printed as "Exception ignored in ..." with its traceback and dropped: the stop was
    lost. There the signal is sent again (True) a moment later, from another thread, until it comes after the
    finalizer (sent at once, Python handles it inside this handler, over and over)."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            again = threading.Timer(0.01, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return True
        frame = frame.f_back
    return False


def sigterm_as_interrupt() -> contextlib.AbstractContextManager:
    """While the block runs, SIGTERM raises :class:`Terminated` instead of ending the process unannounced, and
    Ctrl-C, where Python's own handler took it (not ignored, not the caller's), is sent again after a finalizer it
    landed in as SIGTERM is; the previous handlers are restored after."""
    handlers = contextlib.ExitStack()
    handlers.enter_context(_handled(signal.SIGTERM, _raise_terminated))
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        handlers.enter_context(_handled(signal.SIGINT, _raise_interrupted))
    return handlers


def sigterm_ends_at_once() -> contextlib.AbstractContextManager:
    """While the block runs, SIGTERM ends the process at once (its default action); the handler before is restored
    after. For a wait in C++ that Python's handlers only see once it returns: a process group forming, which waits
    for every process to join. Where one was killed before it joined, the launcher's SIGTERM to the others was
    held until its shutdown timeout (30 s) and they were SIGKILLed, saying nothing."""
    return _handled(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _handled(signum: int, handler):
    """``handler`` takes ``signum`` while the block runs; the one before is put back after, unless the block set
    another (a run stopping on an error ignores SIGTERM then: left so). Off the main thread, where no handler can be
    set, the block runs as it is."""
    try:
        previous = signal.signal(signum, handler)
    except ValueError:  # not the main thread: only the main thread may handle signals
        yield
        return
    try:
        yield
    finally:
        if signal.getsignal(signum) is handler:
            signal.signal(signum, previous)


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's status for a process ended by this signal: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(interrupt, Terminated) else signal.SIGINT)


def how_stopped(interrupt: KeyboardInterrupt) -> str:
    """"terminated (SIGTERM)" or "interrupted", for the command's last line."""
    return "terminated (SIGTERM)" if isinstance(interrupt, Terminated) else "interrupted"
