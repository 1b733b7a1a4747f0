"""A training run's output directory: what a run writes there, when a new run may use it, what --resume reads.

    resume_from = prepare_output_dir(cfg, model_fingerprint(model))  # the checkpoint to resume from, or None
    history = read_history(out / "history.jsonl")

A fresh run needs an empty directory, or one holding only a run that stopped before its first checkpoint (then
replaced; a run still going holds the folder, :mod:`specdec.folder_lock`, and is never taken for one).
``--overwrite`` empties a directory only where everything in it, at any depth, is a name a run writes (``RUN_NAMES``;
a checkpoint's files in the checkpoint directories), and never the working directory, one of its parents or the
home directory. ``--resume`` needs a readable checkpoint of the same configuration and target model;
an input file changed since that checkpoint is named in a warning. Every refusal is an ``OutputDirError``.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from specdec.drafters.eagle_checkpoint import WEIGHTS_FILE as EAGLE_WEIGHTS_FILE
from specdec.drafters.medusa_heads import CONFIG_FILE, WEIGHTS_FILE
from specdec.train import checkpoint as ckpt_io
from specdec.train.config import TrainConfig, resolved_path

from specdec.atomic_write import leftover_of
from specdec.errors import SpecdecError
from specdec.output_dirs import first_undeletable, sticky_for_others

logger = logging.getLogger(__name__)
RUN_FILE = "run.json"
NO_CHECKPOINT_RUN = frozenset({RUN_FILE, "train.log", "history.jsonl"})  # a run stopped before it saved anything


class OutputDirError(SpecdecError, ValueError):
    """The output directory holds another run (or resume finds nothing / a different configuration)."""


# what a training run writes into its output directory (Medusa or EAGLE weights), and into its checkpoint
# directories; --overwrite deletes a directory holding nothing else, at any depth
RUN_NAMES = frozenset({RUN_FILE, "train.log", "history.jsonl", "report.json", "report.md", CONFIG_FILE, WEIGHTS_FILE,
                       EAGLE_WEIGHTS_FILE})
CHECKPOINT_DIRS = (ckpt_io.CKPT, ckpt_io.TMP, ckpt_io.OLD)


def _written_by_a_run(name: str, names: frozenset[str] | tuple[str, ...] = RUN_NAMES) -> bool:
    """A name a run writes, or the leftover of an interrupted atomic write of one (specdec.atomic_write)."""
    return name in names or leftover_of(name) in names


def _foreign(out: Path) -> list[str]:
    """Paths under ``out`` (relative) that a training run does not write: any file or link of another name, any
    directory but the checkpoint's, and anything in a checkpoint directory but a checkpoint's files."""
    foreign = []
    for p in sorted(out.iterdir()):
        if p.is_dir() and not p.is_symlink() and p.name in CHECKPOINT_DIRS:
            foreign += [f"{p.name}/{q.name}" for q in sorted(p.iterdir())
                        if q.is_symlink() or not q.is_file() or not _written_by_a_run(q.name, ckpt_io.FILES)]
        elif p.is_symlink() or not p.is_file() or not _written_by_a_run(p.name):
            foreign.append(p.name)
    return foreign


def _check_deletable(out: Path) -> None:
    """Raise OutputDirError unless ``out`` is recognisably a specdec training run that --overwrite may delete."""
    target, here = out.resolve(), Path.cwd().resolve()
    if target == here or target in here.parents or target == Path.home().resolve():
        raise OutputDirError(f"--overwrite will not delete {out}: it is the working directory, one of its parents "
                             "or the home directory; choose a dedicated --output-dir")
    if not any(_written_by_a_run(p.name, (RUN_FILE,)) for p in out.iterdir()):  # or a kill's leftover of it
        raise OutputDirError(f"--overwrite will not delete {out}: it holds no {RUN_FILE}, so it is not a specdec "
                             "training run; empty it yourself or choose another --output-dir")
    foreign = _foreign(out)
    if foreign:
        raise OutputDirError(f"--overwrite will not delete {out}: it holds files a training run does not write "
                             f"({', '.join(foreign[:5])}); move them or choose another --output-dir")
    # checked before anything goes: another user's run in a shared folder was emptied in part, then a PermissionError
    # named a bare file of its checkpoint
    folder = first_undeletable([out] + [out / name for name in CHECKPOINT_DIRS if (out / name).is_dir()])
    if folder is not None:
        raise OutputDirError(f"--overwrite cannot delete {out}: this user may not delete what {folder} holds "
                             "(another user's run?); ask its owner to delete it, or choose another --output-dir")


def check_resume_writable(out: Path) -> None:
    """Refuse, before the model loads, a ``--resume`` of a run whose files this user cannot carry on writing
    (another user's run in a shared folder): each save replaces the checkpoint, which deletes the earlier one's
    files, and train.log is appended to. Found after the first steps, a bare "[Errno 13] Permission denied" or
    "[Errno 39] Directory not empty" stopped the run, the other user's checkpoint left renamed to checkpoint.old."""
    if not out.is_dir():
        return
    if sticky_for_others(out, RUN_NAMES | set(CHECKPOINT_DIRS)):  # saves rename its checkpoint, replace its reports
        raise OutputDirError(f"--resume: {out} has the sticky bit (as /tmp) and holds another user's files, which "
                             f"only their owner may replace there; copy the run to a folder of your own (cp -r {out} "
                             "NEW) and resume with --output-dir NEW")
    stuck = first_undeletable([out / name for name in CHECKPOINT_DIRS
                               if (out / name).is_dir() and not (out / name).is_symlink()])
    if stuck is None and (out / "train.log").is_file() and not os.access(out / "train.log", os.W_OK):
        stuck = out / "train.log"
    if stuck is not None:
        raise OutputDirError(f"--resume: this user cannot write {stuck} (another user's run?); ask its owner to let "
                             f"you write it (chmod -R g+w {out}), or copy the run to a folder of your own "
                             f"(cp -r {out} NEW) and resume with --output-dir NEW")


def prepare_output_dir(cfg: TrainConfig, target: str | None = None) -> Path | None:
    """Apply the refusal rules; returns the checkpoint to resume from (or None). ``target``: the
    :func:`~specdec.models.fingerprint.model_fingerprint` of the model loaded now, which a resume requires to be
    the checkpoint's."""
    out = Path(cfg.output_dir)
    if cfg.resume:
        ckpt = ckpt_io.find_checkpoint(out)
        if ckpt is None:
            if not out.exists():  # a mistyped folder, or no run there yet
                raise OutputDirError(f"--resume: {out} does not exist, so there is no run to resume; check the path, "
                                     "or run without --resume to start one")
            left = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
            if left and all(_written_by_a_run(name, NO_CHECKPOINT_RUN) for name in left):
                raise OutputDirError(f"--resume: {out} holds no checkpoint to resume from: its run stopped before its "
                                     "first one (see --save-every); rerun without --resume to start it again")
            raise OutputDirError(f"--resume: {out} holds no checkpoint to resume from")
        ckpt_io.check_readable(ckpt)
        state = ckpt_io.read_state(ckpt)
        diff = cfg.differences(state["config"])  # the fields decide, not the fingerprint: it differs where
        # nothing trained changes (--epochs under --max-steps, another spelling of a path) and holds paths as given
        if diff:
            raise OutputDirError(f"--resume: the checkpoint in {out} is from a different configuration "
                                 f"({'; '.join(diff)})")
        trained_on = state["config"].get("target")  # None: a checkpoint saved before targets were recorded
        if target is not None and trained_on is not None and trained_on != target:
            raise OutputDirError(f"--resume: the target model {cfg.model} is not the one the checkpoint in {out} was "
                                 f"trained on (its config or weights changed: fingerprint {trained_on} then, "
                                 f"{target} now); restore that model, or start afresh with --overwrite")
        before, now = state["config"].get("inputs"), cfg.input_stamps()
        if before is not None:  # keyed by the path as given: compared resolved
            before = {resolved_path(p): stamp for p, stamp in before.items()}
        changed = sorted(p for p in now if before is not None and before.get(resolved_path(p)) != now[p])
        if changed:  # the path is the same, so the configuration is: what it holds may not be
            logger.warning("--resume: %s changed since the checkpoint was saved (size or modification time); the "
                           "resumed run reads it as it is now", ", ".join(changed))
        ckpt_io.remove_leftovers(out)
        return ckpt
    if out.exists() and any(out.iterdir()):
        left = sorted(p.name for p in out.iterdir())
        # nothing to resume, nothing a rerun would lose (a kill while run.json was written leaves its leftover)
        if not cfg.overwrite and all(_written_by_a_run(name, NO_CHECKPOINT_RUN) for name in left):
            _check_deletable(out)
            logger.warning("%s holds a run that ended before its first checkpoint (%s): replacing it", out,
                           ", ".join(left))
            _empty(out)
            return None
        if not cfg.overwrite:
            raise OutputDirError(f"{out} is not empty (it holds another run?): pass --resume to continue it or "
                                 "--overwrite to replace it")
        _check_deletable(out)
        _empty(out)
    return None


def _empty(out: Path) -> None:
    """Delete what ``out`` holds, not ``out`` itself: the run holds its lock on the folder (specdec.folder_lock).
    run.json goes last: it marks the folder as a run's, so one emptied in part (Ctrl-C, a kill) is still taken by
    the next --overwrite."""
    for p in sorted(out.iterdir(), key=lambda p: _written_by_a_run(p.name, (RUN_FILE,))):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def read_history(path: Path) -> list[dict]:
    """The records of ``history.jsonl``; a last line cut short (a kill mid-append) is dropped with a warning: the
    checkpoint, not the history, says where a resumed run starts."""
    lines = path.read_text(encoding="utf-8").splitlines()
    history = []
    for i, line in enumerate(lines):
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i < len(lines) - 1:
                raise OutputDirError(f"{path} line {i + 1} is not JSON ({err.msg}); delete the line to resume") \
                    from err
            logger.warning("%s: its last line was cut short (the run was killed while writing it): dropped", path)
    return history
