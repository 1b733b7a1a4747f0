"""One run at a time writes an output folder: an exclusive lock on the folder while a command writes there.

    with only_writer(out, "--output-dir"):   # the folder exists; another run holding it: InputError now
        ...                                  # train, measure, write

Two runs given one folder wrote into it together: a training run that had not saved its first checkpoint yet was
taken for a dead one and deleted, and two evaluations left one's files under the other's report. The lock is
``flock`` on the folder's own descriptor: the system drops it when the process ends, however it ends (a killed run
leaves no lock to clear), and nothing is written into the folder for it. A second hold of a folder is refused in
the same process too (each hold opens the folder anew). Where the system or the file system has no ``flock``
(Windows; some network mounts) nothing is held. The processes of one launch (``accelerate launch --num_processes
N``) share their folder: :func:`launch_writer` holds it on the main process and tells every process the outcome.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from specdec.errors import InputError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None


logger = logging.getLogger(__name__)


class FolderInUse(InputError):
    """Another run is writing into the folder now."""


@contextmanager
def only_writer(folder: str | os.PathLike, option: str, wait: bool = False) -> Iterator[bool]:
    """Hold ``folder`` (which exists) for the body; refused in one line, naming ``option``, where another run
    holds it (with ``wait``: held once that run lets go). Yields whether it holds it (False: the system or the
    folder's file system has no ``flock``)."""
    if fcntl is None:
        yield False
        return
    fd = os.open(Path(folder), os.O_RDONLY)
    try:
        held = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUse(f"{option} {folder}: another run is writing there now; wait for it to end, or choose "
                              "another folder") from None
        except OSError as err:  # a file system without flock (Lustre without -o flock, some network mounts)
            logger.debug("%s %s: not held (%s)", option, folder, err.strerror or err)
            held = False
        yield held  # outside the handlers: an error of the body is not chained to the flock's
    finally:
        os.close(fd)  # the lock goes with the descriptor


@contextmanager
def launch_writer(folder: str | os.PathLike, option: str, main: bool = True,
                  share: Callable[[str | None], str | None] | None = None) -> Iterator[None]:
    """:func:`only_writer` for the processes of one launch, which write ``folder`` together: the ``main`` process
    holds it for the body, and ``share`` (the main process's value -> every process's: a broadcast; None for a
    launch of one process) tells every process whether it was refused, so all of them stop with the same one line
    (the others alone would wait for a main process that had stopped)."""
    with ExitStack() as hold:
        refusal = None
        if main:
            try:
                hold.enter_context(only_writer(folder, option))
            except FolderInUse as err:
                refusal = str(err)
        if share is not None:
            refusal = share(refusal)
        if refusal is not None:
            raise FolderInUse(refusal)
        yield
