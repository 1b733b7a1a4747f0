"""Atomic training checkpoints: heads + optimizer + scheduler + RNG + step, written tmp-then-rename.

Layout of ``<output>/checkpoint/``: ``heads.safetensors``, ``optimizer.pt`` and ``scheduler.pt``
(tensors and plain values only, read back with ``torch.load(weights_only=True)``), ``rng.pt``, and
``state.json`` (step, config, fingerprint). A kill at any moment leaves either the previous or
the new checkpoint complete: the new one is written to ``checkpoint.tmp`` and swapped in by renames.
A checkpoint whose files cannot be read back (truncated, corrupted) is a :class:`CheckpointError`
naming the file; a truncated one is found when ``--resume`` starts, not minutes later.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import zipfile
from pathlib import Path

import torch

from specdec.atomic_write import save_tensors
from specdec.errors import SpecdecError

logger = logging.getLogger(__name__)

CKPT, TMP, OLD = "checkpoint", "checkpoint.tmp", "checkpoint.old"
FILES = ("state.json", "heads.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt")  # what a checkpoint holds


class CheckpointError(SpecdecError, ValueError):
    """A checkpoint file cannot be read back."""


def save_checkpoint(output_dir: Path, heads, optimizer, scheduler, step: int, config: dict,
                    fingerprint: str, rng_state: torch.Tensor | None = None) -> Path:
    """``rng_state``: the RNG state to record (default: the current one)."""
    tmp, final, old = output_dir / TMP, output_dir / CKPT, output_dir / OLD
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # a full disk: an OSError, which an interrupt's save takes for "not saved" (safetensors raises its own error)
    save_tensors(tmp / "heads.safetensors", {k: v.detach().cpu().contiguous() for k, v in heads.state_dict().items()})
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save({"torch": torch.get_rng_state() if rng_state is None else rng_state}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "fingerprint": fingerprint, "config": config}, indent=2))
    for f in tmp.iterdir():  # make the bytes durable before the rename makes them visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # else checkpoint.old is the complete one (a kill between the renames): kept until replaced
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(output_dir)  # the renames durable before the old checkpoint goes
    shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform whose directories cannot be opened (Windows): renames are what it offers
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_leftovers(output_dir: Path) -> None:
    """Beside a complete ``checkpoint``, remove what a save stopped after its renames (``checkpoint.old``, a whole
    earlier checkpoint) or while writing (``checkpoint.tmp``) left: the next save removes them, but a run killed
    during its last save resumes at its last step and saves no more. A resume calls it, holding the folder."""
    if find_checkpoint(output_dir) != output_dir / CKPT:  # checkpoint.old is the complete one: kept
        return
    for name in (OLD, TMP):
        left = output_dir / name
        if left.is_dir() and not left.is_symlink():
            shutil.rmtree(left, ignore_errors=True)
            logger.warning("removed %s, left by a checkpoint save that was stopped before it ended", left)


def find_checkpoint(output_dir: Path) -> Path | None:
    """The complete checkpoint (``checkpoint``, or ``checkpoint.old`` if a kill hit between the renames)."""
    for name in (CKPT, OLD):
        if (output_dir / name / "state.json").is_file():
            return output_dir / name
    return None


def _read(ckpt: Path, name: str, open_only: bool = False):
    """One file of the checkpoint, or a CheckpointError that names it. ``open_only``: check that the file
    opens (header / zip directory, which a truncated file lacks) without reading its tensors; returns None."""
    from safetensors.torch import load_file, safe_open

    path = ckpt / name
    try:
        if name.endswith(".json"):
            state = json.loads(path.read_text())
            int(state["step"])
            return state
        if open_only:
            if name.endswith(".safetensors"):
                with safe_open(str(path), "pt"):
                    return None
            zipfile.ZipFile(path).close()  # torch.save writes a zip archive
            return None
        if name.endswith(".safetensors"):
            return load_file(str(path))
        return torch.load(path, weights_only=True)
    except Exception as err:  # truncated or corrupted: safetensors, pickle, zip and json each raise their own
        raise CheckpointError(f"checkpoint file {path} cannot be read ({type(err).__name__}: {err}); "
                              "start afresh with --overwrite, or restore the file") from None


def read_state(ckpt: Path) -> dict:
    return _read(ckpt, "state.json")


def checkpoint_step(ckpt: Path) -> int:
    """The training step the checkpoint holds."""
    return int(read_state(ckpt)["step"])


def check_readable(ckpt: Path) -> None:
    """Open every file of the checkpoint, so a truncated one is named before training starts; the tensors
    are read once, by load_checkpoint (damage that still opens is a CheckpointError there)."""
    for name in FILES:
        _read(ckpt, name, open_only=True)


def load_checkpoint(ckpt: Path, heads, optimizer, scheduler) -> int:
    heads.load_state_dict(_read(ckpt, "heads.safetensors"))
    optimizer.load_state_dict(_read(ckpt, "optimizer.pt"))
    scheduler.load_state_dict(_read(ckpt, "scheduler.pt"))
    torch.set_rng_state(_read(ckpt, "rng.pt")["torch"])
    return checkpoint_step(ckpt)
