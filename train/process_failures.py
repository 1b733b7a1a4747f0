"""An error on one process of several: the others stop with one line naming it, not a gloo traceback.

A process whose run fails (an exception; signals are train/agreed_interrupts.py's) cannot tell its peers at a
collective: they may be inside another one (a gradient all-reduce) or computing. So, wherever it fails, it leaves
a note in the process group's key-value store (the launcher's, which outlives the processes) and goes on as one
process would: its line, its exit. Its exit closes its connections, so a peer's pending or next collective fails
at once (gloo: "Connection closed by peer"); a peer whose collective fails so, or that the launcher's SIGTERM
reaches (sent when the first process exits), reads the notes and raises :class:`PeerFailed` naming the process
that failed. A lost connection with no note (a process killed) waits up to ``NOTE_WAIT_S`` for one, then says so.

    notes = FailureNotes.of(accelerator)          # every process, once per run
    except KeyboardInterrupt:
        notes.interrupted()                       # raises PeerFailed where another process failed
    except Exception as err:
        notes.stop(err)                           # raises PeerFailed, or (this process's own error) returns
        raise

A refusal (``REFUSED``: what the CLI says in one line, exit 2) that process 0 meets too is said once: another
process whose own refusal is process 0's, word for word (every process checks the same command line, inputs and
model), and a process a refusal of process 0 alone stopped (its output folder's rules), exit with status 2 quietly.

A stopping process ignores SIGTERM from then on: the launcher's must not cut its line. Nothing else changes: what
a process had saved (checkpoints, self-distilled batches) stays, as in one process. On NCCL a collective does not
fail when a peer exits: a peer waiting in one stops when the launcher kills it.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import re
import signal
import time
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

NOTE_WAIT_S = 2.0  # how long a process that lost a peer's connection waits for that peer's note
# what a collective raises when a peer is gone (gloo, NCCL, the store): a peer's failure, not this process's
LOST = re.compile(r"closed by peer|reset by peer|broken pipe|timed out|connection refused|communicator was aborted|"
                  r"socket closed|NCCL error", re.IGNORECASE)
T = TypeVar("T")
_RUNS = itertools.count()  # runs in one process group (tests run several): each keeps its own notes
REFUSED = (ValueError, FileNotFoundError)  # what the CLI says as a refusal, in one line with exit status 2


class PeerFailed(Exception):
    """Another process of the run failed (its own line says why): this one stopped. ``process``: its index, None
    where it stopped without a note (killed); ``refused``: its error was a refusal (``REFUSED``)."""

    def __init__(self, process: int | None, detail: str = "", refused: bool = False) -> None:
        self.process, self.refused = process, refused
        if process is None:
            super().__init__(f"another process stopped without a word ({detail})")
        else:
            super().__init__(f"process {process} failed (its error is above)")


class FailureNotes:
    """The notes of one run of ``size`` processes in ``store`` (None: none reachable; a peer's failure then reads
    as a lost connection), this process being ``index``."""

    def __init__(self, store, index: int, size: int, run: int) -> None:
        self.store, self.index, self.size = store, index, size
        self.prefix = f"specdec/run{run}"

    @classmethod
    def of(cls, accelerator) -> FailureNotes:
        store = None
        try:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        except Exception as err:  # no store (an unusual launcher): the lines only lose the process's number
            logger.debug("no process-group store: %s", err)
        return cls(store, accelerator.process_index, accelerator.num_processes, next(_RUNS))

    def _key(self, process: int) -> str:
        return f"{self.prefix}/failed/{process}"

    def failed(self) -> int | None:
        """The first other process that left a note, else None."""
        if self.store is None:
            return None
        try:
            return next((p for p in range(self.size) if p != self.index and self.store.check([self._key(p)])),
                        None)
        except Exception:  # the store gone too
            return None

    def note(self, process: int) -> str | None:
        """The note ``process`` left (``refused ...`` or ``failed ...``), else None."""
        if self.store is None:
            return None
        try:
            note = self.store.get(self._key(process)) if self.store.check([self._key(process)]) else None
        except Exception:  # the store gone too
            return None
        return note.decode() if isinstance(note, bytes) else note

    def stop(self, err: Exception) -> None:
        """This process stops with ``err``. Where ``err`` is what another process's failure did to it (a collective
        failed: a RuntimeError while that process's note is there, or on a lost connection, then after up to
        ``NOTE_WAIT_S`` for a note), raises :class:`PeerFailed` naming that process; else ``err`` is this process's
        own error: it leaves its note and returns. A refusal of another process than process 0 that process 0 says
        too (its note, waited for up to ``NOTE_WAIT_S``, the same) is marked ``said_by_process_0``."""
        _ignore_sigterm()
        if isinstance(err, PeerFailed):
            return
        process = self.failed() if isinstance(err, RuntimeError) else None
        lost = isinstance(err, RuntimeError) and bool(LOST.search(str(err)))
        if process is None and not lost:
            note = f"{'refused' if isinstance(err, REFUSED) else 'failed'} {type(err).__name__}: {err}"
            note = note.split("\n")[0][:500]
            self._note(note)
            if self.index != 0 and isinstance(err, REFUSED):
                err.said_by_process_0 = self._wait(lambda: self.note(0)) == note
            return
        process = process if process is not None else self._wait(self.failed)
        raise self._peer_failed(process, str(err).split("\n")[0][:200]) from None

    def interrupted(self) -> None:
        """This process got a signal: where another process failed (the launcher stops the others when it exits),
        raises :class:`PeerFailed` naming it; else returns (the signal stops the processes)."""
        process = self.failed()
        if process is not None:
            _ignore_sigterm()
            raise self._peer_failed(process) from None

    def _peer_failed(self, process: int | None, detail: str = "") -> PeerFailed:
        refused = process is not None and (self.note(process) or "").startswith("refused ")
        return PeerFailed(process, detail, refused=refused)

    @staticmethod
    def _wait(found: Callable[[], T | None]) -> T | None:
        """``found()``, asked again for up to ``NOTE_WAIT_S`` while it is None."""
        deadline = time.monotonic() + NOTE_WAIT_S
        while (answer := found()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return answer

    def _note(self, line: str) -> None:
        """Leave this process's note (before it exits, which fails the others' collectives)."""
        if self.store is None:
            return
        try:
            self.store.set(self._key(self.index), line)
        except Exception as gone:
            logger.debug("could not leave a note: %s", gone)


def _ignore_sigterm() -> None:
    """The process is stopping: the launcher's SIGTERM (sent to the others when one exits) must not cut its line."""
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
