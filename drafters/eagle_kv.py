"""The EAGLE drafter's own keys / values: one slab for every sequence, a row each, rows reused as sequences finish.

    kv = EagleKV(kv_heads, head_dim, dtype, device)
    kv.append(seq_ids, new_k, new_v, counts)  # [B, kv_heads, L, head_dim]: sequence b's first counts[b] columns
    kv.copy_prefix(src, dsts, n)              # new sequences start with src's first n columns (copies of a prompt)
    k, v = kv.gather(seq_ids)                 # [B, kv_heads, P, head_dim] right-padded; None, None when no
                                              # sequence has a key
    kv.release(seq_id)

The slab is ``[rows, kv_heads, capacity, head_dim]`` for keys and for values. A step's write for all its sequences is
one indexed store per tensor, and a read one gather (a view, for a single sequence), where per-sequence caches
grown by ``torch.cat`` cost two launches per sequence and a copy of the whole cache each step. Rows and capacity
double when full (one copy, amortised).

Invariant: row ``r`` of a sequence holds its keys in columns ``[0, length)``; every other column holds zeros or
another (finite) sequence's stale keys, which the reader masks by ``lengths``: a masked key weighs exactly 0, so
results are the same bits as with zero padding.
"""
from __future__ import annotations

import torch

from specdec.host_copy import to_device


class EagleKV:
    """Keys / values of the EAGLE layer for every sequence (module doc)."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, rows: int = 4,
                 capacity: int = 256) -> None:
        self.device = device
        self.k = torch.zeros(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.row: dict[int, int] = {}  # seq_id -> its row
        self.length: dict[int, int] = {}  # seq_id -> keys held
        self.free = list(range(rows - 1, -1, -1))  # rows not held, popped from the end (row 0 first)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.row

    def lengths(self, seq_ids) -> list[int]:
        return [self.length.get(i, 0) for i in seq_ids]

    def append(self, seq_ids, new_k: torch.Tensor, new_v: torch.Tensor, counts) -> None:
        """Sequence b (``seq_ids[b]``) gains the first ``counts[b]`` columns of ``new_k`` / ``new_v`` [B, kv_heads, L,
        head_dim]; a sequence seen for the first time gets a row."""
        for seq_id in seq_ids:
            if seq_id not in self.row:
                self._take_row(seq_id)
        needed = max(self.length[i] + n for i, n in zip(seq_ids, counts, strict=True))
        if needed > self.k.shape[2]:
            capacity = self.k.shape[2]
            while capacity < needed:
                capacity *= 2
            self._grow(capacity=capacity)
        if len(seq_ids) == 1:  # one sequence (batch 1): a slice copy each, no index to build and upload
            (seq_id,), (n,) = seq_ids, counts
            row, start = self.row[seq_id], self.length[seq_id]
            self.k[row, :, start : start + n] = new_k[0, :, :n]
            self.v[row, :, start : start + n] = new_v[0, :, :n]
            self.length[seq_id] = start + n
            return
        index: list[list[int]] = [[], [], [], []]  # slab row, slab column, source row, source column
        for b, (seq_id, n) in enumerate(zip(seq_ids, counts, strict=True)):
            start = self.length[seq_id]
            index[0] += [self.row[seq_id]] * n
            index[1] += range(start, start + n)
            index[2] += [b] * n
            index[3] += range(n)
            self.length[seq_id] = start + n
        if not index[0]:
            return
        row, col, src_b, src_j = to_device(index, torch.long, self.device)
        self.k[row, :, col] = new_k[src_b, :, src_j]
        self.v[row, :, col] = new_v[src_b, :, src_j]

    def copy_prefix(self, src: int, dsts, n: int) -> None:
        """Each sequence of ``dsts`` (none holds keys yet) gets a row of its own holding ``src``'s first ``n`` keys /
        values, bit for bit: one indexed store per tensor (copies of a prompt at their first catch-up,
        drafters/prompt_copies.py). ``src`` must hold at least ``n``."""
        if self.length.get(src, 0) < n or any(d in self.row or d == src for d in dsts) or len(set(dsts)) != len(dsts):
            raise ValueError(f"copy_prefix: {n} keys of sequence {src} into {list(dsts)}: the copies must be new and "
                             f"distinct, and {src} must hold them")
        for d in dsts:
            self._take_row(d)
            self.length[d] = n
        if not dsts or n <= 0:
            return
        rows, src_row = to_device([self.row[d] for d in dsts], torch.long, self.device), self.row[src]
        self.k[rows, :, :n] = self.k[src_row, :, :n]  # broadcast: src's columns are read once
        self.v[rows, :, :n] = self.v[src_row, :, :n]

    def _take_row(self, seq_id: int) -> None:
        """A free row for a sequence seen for the first time, holding no key (the slab grows when none is free)."""
        if not self.free:
            self._grow(rows=2 * self.k.shape[0])
        self.row[seq_id], self.length[seq_id] = self.free.pop(), 0

    def gather(self, seq_ids) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The sequences' keys / values right-padded to the longest ([B, kv_heads, P, head_dim] each; None when P
        is 0): sequence b's first ``lengths([...])[b]`` columns are its own."""
        lengths = self.lengths(seq_ids)
        P = max(lengths, default=0)
        if P == 0:
            return None, None
        if len(seq_ids) == 1:
            r = self.row[seq_ids[0]]
            return self.k[r : r + 1, :, :P], self.v[r : r + 1, :, :P]
        rows = to_device([self.row.get(i, self.row[seq_ids[lengths.index(P)]]) for i in seq_ids], torch.long,
                         self.device)  # a sequence without keys reads any row: all its columns are masked
        return self.k[:, :, :P].index_select(0, rows), self.v[:, :, :P].index_select(0, rows)

    def release(self, seq_id: int) -> None:
        row = self.row.pop(seq_id, None)
        self.length.pop(seq_id, None)
        if row is not None:
            self.free.append(row)

    def _grow(self, rows: int | None = None, capacity: int | None = None) -> None:
        old_rows, kv_heads, old_capacity, head_dim = self.k.shape
        rows, capacity = rows or old_rows, capacity or old_capacity
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(rows, kv_heads, capacity, head_dim)
            new[:old_rows, :, :old_capacity] = old
            setattr(self, name, new)
        self.free = list(range(rows - 1, old_rows - 1, -1)) + self.free
