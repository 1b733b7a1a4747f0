"""The versions of specdec's dependencies installed here, against the oldest its tests were run on (pyproject's floors).

specdec runs its own forward on the weights transformers loads, so the loading must be one its checks were run
against. transformers 4.56 (pyproject's floor once) loaded a checkpoint missing a tensor with random weights and
read 5.x's configs with another RoPE base; 5.12 computed dynamic RoPE otherwise than specdec. :data:`OLDEST` is
the oldest transformers the model tests (loading, generation against transformers, GGUF) were run against and
passed but for refusal messages transformers words itself. transformers 5.25 runs no model on a torch older than
2.6 (it disables torch; loading failed in a many-line ImportError), the oldest torch the model tests were run on:
:data:`OLDEST_TORCH`. :func:`check_installed` refuses an older one of either in one line wherever a model is
loaded, since pip only warns when another package's install brings one; each is pyproject.toml's floor too (tests
hold them equal). gguf 0.10 and 0.11 read no file under numpy 2 (``ndarray.newbyteorder`` is gone):
:func:`check_gguf_installed` refuses a gguf older than :data:`OLDEST_GGUF` before a conversion.
:func:`check_written_by` refuses a config.json a later transformers major version wrote.
"""
from __future__ import annotations

import functools
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.version import Version

from specdec.errors import InputError

OLDEST = "5.17"
OLDEST_TORCH = "2.6"
OLDEST_GGUF = "0.13"


class TransformersTooOld(InputError):
    """The installed transformers is older than :data:`OLDEST`."""


class TorchTooOld(InputError):
    """The installed torch is older than :data:`OLDEST_TORCH`."""


class GGUFTooOld(InputError):
    """The installed gguf is older than :data:`OLDEST_GGUF`."""


@functools.cache
def check_installed() -> None:
    """Refuse a transformers older than :data:`OLDEST` or a torch older than :data:`OLDEST_TORCH` (checked once per
    process)."""
    installed = metadata.version("transformers")
    if Version(installed) < Version(OLDEST):
        raise TransformersTooOld(f"transformers {installed} is installed; specdec needs {OLDEST} or later, whose "
                                 f"loading its forward is checked against (older ones load some models as other "
                                 f"models, silently): pip install 'transformers>={OLDEST}'")
    torch_installed = metadata.version("torch")
    if Version(torch_installed) < Version(OLDEST_TORCH):
        raise TorchTooOld(f"torch {torch_installed} is installed; specdec needs {OLDEST_TORCH} or later, the oldest "
                          f"its model tests were run on (transformers {installed} runs no model on an older one): "
                          f"pip install 'torch>={OLDEST_TORCH}'")


def check_gguf_installed() -> None:
    """Refuse a gguf older than :data:`OLDEST_GGUF`, whose reader fails on every file under numpy 2 with a message
    that blames the file's metadata."""
    installed = metadata.version("gguf")
    if Version(installed) < Version(OLDEST_GGUF):
        raise GGUFTooOld(f"gguf {installed} is installed; converting a .gguf needs {OLDEST_GGUF} or later (older ones "
                         f"read no file under numpy 2): pip install 'gguf>={OLDEST_GGUF}'")


def check_written_by(file: Path, saved: Any) -> None:
    """Refuse a config.json written by a later major version of transformers than the one installed: transformers 4
    reads transformers 5's without a word and builds another model (its RoPE base in ``rope_parameters`` unread,
    the default used), whose text is then silently another."""
    installed = metadata.version("transformers")
    major = saved.split(".")[0] if isinstance(saved, str) else ""
    if major.isdigit() and int(major) > int(installed.split(".")[0]):
        raise InputError(f"{file} was written by transformers {saved}, and this transformers {installed} would read "
                         f"it as another model (its RoPE settings among others): upgrade transformers (pip install "
                         f"'transformers>={major}')")
