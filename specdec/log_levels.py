"""A logger held at another level for a block of code, and set back to its own afterwards (also on an exception)."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def logger_at(name: str, level: int) -> Iterator[None]:
    """The logger ``name`` at ``level`` for the block, at its own level again after it."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)
