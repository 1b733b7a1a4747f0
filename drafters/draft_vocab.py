"""Reduced draft vocabulary: a draft head scores only the N most frequent tokens of its training data.

With a 49k-token vocabulary the LM head is a fifth of a small target; a draft head that projects onto
the few thousand tokens that carry most of the text is many times cheaper per drafted token. The
ids are stored in the checkpoint. ``draft_probs`` are zero outside the reduced vocabulary, which the
exact rejection sampler treats as any other draft distribution (FR-Spec).

    ids = frequent_tokens(train_seqs, 4096, always=[eos_id])   # list[int], sorted
    vocab = DraftVocab(torch.tensor(ids), vocab_size=49152)
    full_ids = vocab.to_full(topk_indices)                      # reduced index -> token id
    labels = vocab.to_reduced(token_ids)                        # token id -> reduced index, -100 outside
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import torch

from specdec.errors import InputError
from specdec.host_copy import to_device

IGNORE = -100  # reduced label of a token outside the draft vocabulary (cross-entropy's ignore_index)


def frequent_tokens(seqs: Iterable[Sequence[int]], n: int, always: Iterable[int] = ()) -> list[int]:
    """The ``n`` most frequent token ids of ``seqs`` (ties: smaller id first) plus ``always``, sorted."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError(f"draft vocabulary size must be a positive integer, got {n!r}")
    counts = Counter(t for s in seqs for t in s)
    keep = set(int(t) for t in always)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(keep) >= n:
            break
        keep.add(int(tok))
    return sorted(keep)


SIZES = (1024, 2048, 4096, 8192, 16384, 32768)  # sizes a training run chooses from ("auto")


def coverage(seqs: Iterable[Sequence[int]], ids: Iterable[int]) -> float:
    """Share of the tokens of ``seqs`` that lie in ``ids``."""
    keep = set(ids)
    counts = Counter(t for s in seqs for t in s)
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t in keep) / total if total else 1.0


def choose_size(seqs: Sequence[Sequence[int]], target: float, sizes: Sequence[int] = SIZES) -> tuple[int, dict]:
    """The smallest of ``sizes`` whose most frequent tokens cover ``target`` of ``seqs``' tokens, and the
    coverage of every size tried ({size: share}); the largest size if none reaches it."""
    table = {}
    for n in sizes:
        table[n] = coverage(seqs, frequent_tokens(seqs, n))
        if table[n] >= target:
            return n, table
    return sizes[-1], table


class DraftVocab:
    """The token ids [N] a reduced draft head scores, and the maps between reduced and full ids."""

    def __init__(self, ids: torch.Tensor | Sequence[int], vocab_size: int) -> None:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise InputError("a draft vocabulary needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise InputError(f"draft vocabulary ids must lie in [0, {vocab_size}), got {int(ids.min())}.."
                             f"{int(ids.max())}: the checkpoint was made for another vocabulary")
        if torch.unique(ids).numel() != ids.numel():
            raise InputError("draft vocabulary ids must be distinct")
        self.ids = ids  # [N] reduced index -> token id
        self.vocab_size = vocab_size
        self._reduced = torch.full((vocab_size,), IGNORE, dtype=torch.long)  # [vocab] token id -> reduced index
        self._reduced[ids] = torch.arange(ids.numel())

    def __len__(self) -> int:
        return int(self.ids.numel())

    def to(self, device) -> "DraftVocab":
        self.ids, self._reduced = self.ids.to(device), self._reduced.to(device)
        return self

    def to_full(self, reduced: torch.Tensor) -> torch.Tensor:
        """Reduced indices (any shape) -> token ids."""
        return self.ids[reduced]

    def to_reduced(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (any shape) -> reduced indices, ``IGNORE`` (-100) for tokens outside."""
        return self._reduced.to(token_ids.device)[token_ids]

    def expand(self, reduced_probs: torch.Tensor) -> torch.Tensor:
        """[..., N] probabilities over the reduced vocabulary -> [..., vocab], zero outside it."""
        out = reduced_probs.new_zeros(*reduced_probs.shape[:-1], self.vocab_size)
        out[..., to_device(self.ids, torch.long, out.device)] = reduced_probs  # no blocking copy
        return out

    def rows(self, lm_head: torch.Tensor) -> torch.Tensor:
        """The LM-head rows [N, hidden] of these tokens (a reduced head initialised from the target's)."""
        return lm_head[self.ids.to(lm_head.device)]
