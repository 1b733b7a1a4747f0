"""The drafter contract: what the engine asks of anything that proposes tokens.

Each step the engine calls ``propose`` with a read-only view of every live sequence and
gets one :class:`~specdec.tree.DraftTree` per sequence back (the empty tree is allowed:
that sequence decodes plainly this step). The engine validates every tree before the
target verifies it, so a drafter cannot silently break exactness. After the commit it
calls ``on_accept`` with the tokens committed for that sequence, and ``release`` when a
sequence finishes.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from specdec.tree import DraftTree


@dataclass(frozen=True)
class SequenceView:
    seq_id: int
    # prompt + every committed token; the last one is the root of the next draft tree
    token_ids: Sequence[int]
    num_prompt_tokens: int


class Drafter(ABC):
    """Base class of all drafters. Subclasses set ``name`` and implement ``propose``."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        """One draft tree per sequence, in the order of ``seqs``."""

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        """Tokens committed to ``seq_id`` this step (accepted drafts + recovered/bonus)."""

    def release(self, seq_id: int) -> None:
        """Forget everything about a finished sequence."""
