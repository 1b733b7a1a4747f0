"""What an interrupt (Ctrl-C, SIGTERM) of a training run saves: the checkpoint of its last completed step.

    except KeyboardInterrupt as err:
        record_interrupt(err, run, at)  # saves where it may, and notes on err what is left
        raise

One process saves the steps since its last checkpoint as the interrupt goes on. Several processes save only a step
all of them agreed on (train/agreed_interrupts.py; :func:`stop_together`): the main process saves it once and
every process learns whether it could. One stopped otherwise saves nothing, as the others may wait for it in a
collective. ``err`` then carries ``saved_step``, or ``unsaved_steps`` where the steps since the last checkpoint
are lost (a full disk leaves that checkpoint), and ``processes_stopped_together``; train/cli.py reads them.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, NoReturn

import torch
from specdec.train.agreed_interrupts import InterruptsHeld

if TYPE_CHECKING:
    from specdec.train.loop import Position, Run

logger = logging.getLogger(__name__)


def _keep_on_interrupt(err: KeyboardInterrupt, step: int, saved: int, nproc: int, save) -> None:
    """An interrupt after step ``step``, the last save at ``saved`` (< step): one process saves the checkpoint of
    ``step`` (``save()``) and records it on ``err`` as ``saved_step``. Several processes agree on their step first
    (train/agreed_interrupts.py) and save there; one stopped otherwise (a KeyboardInterrupt no process recorded, e.g.
    outside the main thread) does not save here, as the others may wait for it in a collective: ``err`` records
    ``unsaved_steps``."""
    if nproc > 1:
        err.unsaved_steps = step - saved
        logger.warning("interrupted after step %d: no checkpoint saved; the %d step(s) since the last one are lost",
                       step, step - saved)
        return
    if _saved(save, step):
        err.saved_step = step


def _saved_by_main(accelerator, save, step: int) -> bool:
    """Every process, after the same step: the main process saves its checkpoint (``save()``); whether it could, on
    every process (a full disk leaves the last checkpoint)."""
    ok = float(accelerator.is_main_process and _saved(save, step))
    return bool(accelerator.reduce(torch.tensor([ok], device=accelerator.device), reduction="sum").item())


def _saved(save, step: int) -> bool:
    """Save the checkpoint of step ``step`` (``save()``) and say so; False where it could not be written (a full
    disk: the interrupt still ends the run, with the last checkpoint left)."""
    try:
        save()
    except OSError as err:
        logger.warning("interrupted after step %d: its checkpoint could not be saved (%s)", step, err)
        return False
    logger.info("interrupted after step %d: saved its checkpoint", step)
    return True


def stop_together(run: Run, at: Position, seen: torch.Tensor, held: InterruptsHeld) -> NoReturn:
    """Several processes, an interrupt one of them recorded (``seen``: their flags summed): every process finished
    this step, the one to keep; the main process saves it unless it just did, then each stops (``held.stop``)."""
    if at.step == at.saved or _saved_by_main(run.accelerator, functools.partial(run.save, at), at.step):
        at.saved = at.step
    at.agreed = at.step
    held.stop(seen)


def record_interrupt(err: KeyboardInterrupt, run: Run, at: Position) -> None:
    """On ``err``, what an interrupt leaves (for the CLI's line); one process first saves the steps since the last
    checkpoint (:func:`_keep_on_interrupt`)."""
    if at.agreed is not None:  # every process stops here: the group can be closed as at the end of a run
        err.processes_stopped_together = True
        if at.saved == at.agreed:
            err.saved_step = at.agreed
        else:  # the main process could not save (it said why)
            err.unsaved_steps = at.agreed - at.saved
    elif at.step > at.saved:
        _keep_on_interrupt(err, at.step, at.saved, run.accelerator.num_processes, functools.partial(run.save, at))
