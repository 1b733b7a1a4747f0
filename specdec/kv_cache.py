"""Paged KV cache: a pool of fixed-size blocks shared by all sequences, for all layers.

Storage is one tensor ``kv[num_layers, 2, num_slots, num_kv_heads, head_dim]`` with
``num_slots = num_blocks * block_size``; slot ``b * block_size + o`` is offset ``o`` of
block ``b``. Each sequence owns a block table (a list of block ids); the token at
position ``p`` lives in slot ``table[p // block_size] * block_size + p % block_size``.

Life of a sequence::

    cache.add(seq_id)
    cache.reserve(seq_id, n)                  # blocks for positions [length, length + n)
    slots = cache.slots(seq_id, start, end)   # slot mapping for writes / attention reads
    ...forward writes K/V of root + tree nodes at positions length .. length + n - 1...
    cache.commit({seq_id: keep})              # keep[j] (offset from length) -> position length + j
    cache.free(seq_id)

Invariants: positions ``[0, length)`` of a sequence hold committed K/V and ``[length, reserved)`` are writable
(reserved since the last commit); after a commit a sequence owns the ``ceil(length / block_size)`` blocks that
hold it plus at most one *spare*, the next block it had reserved, which the next step's draft tree usually spills
into again (its slot row then stays as it is). Spares are given back when a reservation would otherwise run out of
blocks, so :class:`CacheFullError` is raised exactly when the blocks holding positions leave too few, before
anything is written.

``slots()`` is called for every sequence on every step (attention reads all its keys), so each sequence's
slot row is kept on the cache's device and only grown by the blocks a reservation adds: a step costs a view,
not an O(context) Python list and a host-to-device copy per sequence. Slot rows are never written in place
(growing one makes a new tensor), so a view handed out stays valid.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from specdec.errors import SpecdecError
from specdec.host_copy import to_device
from specdec.kernels.dispatch import Backend, resolve_backend


def table_slots(table: Sequence[int], block_size: int, positions: Iterable[int]) -> list[int]:
    """The slots of ``positions`` of a sequence whose block table is ``table`` (module doc)."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens that hold ``num_tokens`` tokens (ceil division)."""
    return -(-num_tokens // block_size)


def blocks_needed(prompt_lengths, max_new_tokens: int, block_size: int, tree_budget: int) -> int:
    """Blocks to reserve for sequences with prompts of these lengths, in the worst case, so none can run out: every
    answer at ``max_new_tokens``, a whole draft tree of ``tree_budget`` nodes on top (0 without a drafter), and the
    bonus token."""
    return sum(blocks_for(n + max_new_tokens + tree_budget + 1, block_size) for n in prompt_lengths)


def plain_blocks_needed(prompt_lengths, max_new_tokens: int, block_size: int) -> int:
    """The most blocks plain decoding of these prompts can hold: every position but the last new token's (no step
    runs it). A pool this large never runs out with a drafter either: the engine cuts its trees to the free blocks
    (Engine._kv_rooms), and a step whose drafting finds no room in the target's cache (self-draft) decodes plainly."""
    return sum(blocks_for(n + max_new_tokens - 1, block_size) for n in prompt_lengths)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: sized by generate() for the request's worst case

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 or None, got {self.num_blocks}")


class CacheFullError(SpecdecError, RuntimeError):
    """The block pool cannot hold what was asked; nothing was written. Raised by generate() after its prefill,
    ``new_tokens`` holds each sequence's tokens generated until then (in the output's order; else None)."""

    def __init__(self, message: str, new_tokens: list[list[int]] | None = None) -> None:
        super().__init__(message)
        self.new_tokens = new_tokens


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | Backend | None = None,  # None: SPECDEC_ATTENTION now (specdec.kernels.dispatch)
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        # never read before written: attention only gathers slots below a sequence's length
        self.kv = torch.empty(
            num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        # KV write, compaction and attention over this cache: Triton kernels or the PyTorch reference
        self.backend = resolve_backend(self.kv.device, backend)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.reserved: dict[int, int] = {}  # seq_id -> end of its writable positions (>= its length)
        # seq_id -> [len(block_tables[seq_id]) * block_size] int64: the slot of every reserved position
        self._slot_rows: dict[int, torch.Tensor] = {}

    # ---- bookkeeping --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def discard(self) -> None:
        """Free the storage now, though something may still hold this cache (a drafter reused across generate()
        calls keeps the last call's TargetView): it then holds no sequence and no block, and any reservation raises
        CacheFullError."""
        self.kv = self.kv.new_empty((*self.kv.shape[:2], 0, *self.kv.shape[3:]))
        self.num_blocks = 0
        self._free = []
        for table in (self.block_tables, self.lengths, self.reserved, self._slot_rows):
            table.clear()

    def add(self, seq_id: int) -> None:
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self.block_tables[seq_id] = []
        self.lengths[seq_id] = self.reserved[seq_id] = 0
        self._slot_rows[seq_id] = torch.empty(0, dtype=torch.long, device=self.kv.device)

    def free(self, seq_id: int) -> None:
        self._free.extend(reversed(self.block_tables.pop(seq_id)))
        del self.lengths[seq_id], self.reserved[seq_id]
        del self._slot_rows[seq_id]

    def _blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def reserve(self, seq_id: int, num_new: int) -> None:
        """Make positions [length, length + num_new) of seq_id writable."""
        self.reserve_many({seq_id: num_new})

    def reserve_many(self, num_new: Mapping[int, int]) -> None:
        """Like reserve() for several sequences, all-or-nothing."""
        need = {
            s: self._blocks_for(self.lengths[s] + n) - len(self.block_tables[s]) for s, n in num_new.items()
        }
        total = sum(max(0, k) for k in need.values())
        spares = self._spares(num_new) if total > len(self._free) else {}  # (never one of the asked blocks)
        if total > len(self._free) + sum(len(self.block_tables[s]) - keep for s, keep in spares.items()):
            raise CacheFullError(
                f"KV cache out of blocks: {total} more block{'s' * (total != 1)} of {self.block_size} tokens "
                f"{'are' if total != 1 else 'is'} needed, "
                f"{len(self._free)} of {self.num_blocks} are free. Pass a larger num_blocks, or fewer / "
                f"shorter sequences."
            )
        for s, keep in spares.items():  # short: the spares go back first
            self._release_blocks(s, keep)
        taken = self._free[len(self._free) - total:][::-1]  # as many pop()s would give them
        handed = iter(taken)
        grown = {s: [next(handed) for _ in range(k)] for s, k in need.items() if k > 0}
        if grown:  # the new blocks' slots of every sequence in one copy
            size = self.block_size
            slots = to_device([b * size + o for blocks in grown.values() for b in blocks for o in range(size)],
                              torch.long, self.kv.device).split_with_sizes([len(b) * size for b in grown.values()])
            del self._free[len(self._free) - total:]  # only now: an interrupted copy loses no block
            for (s, blocks), new in zip(grown.items(), slots, strict=True):
                self.block_tables[s].extend(blocks)
                row = self._slot_rows[s]
                self._slot_rows[s] = torch.cat([row, new]) if row.numel() else new
        for s, n in num_new.items():
            self.reserved[s] = max(self.reserved[s], self.lengths[s] + n)

    def room(self, seq_ids: Sequence[int], sharing: Collection[int]) -> dict[int, int]:
        """Per sequence of ``seq_ids``, the most positions from its length that one ``reserve_many`` of them all can
        take: the blocks it must hold anyway (its next position and what is reserved already), and for those in
        ``sharing`` an equal share of the rest (the free blocks, and the blocks of ``seq_ids`` past what they must
        hold; where it does not divide, the first ones in ``seq_ids`` get a block more). From block counts alone:
        ``reserve_many({s: n_s})`` with every ``n_s <= room[s]`` never raises if the pool holds every sequence's next
        position; if it does not, the room is 1 (that position: the reservation raises CacheFullError)."""
        base, pool = self._headroom(seq_ids)
        if pool < 0:
            return {s: 1 for s in seq_ids}
        shared = [s for s in seq_ids if s in sharing]
        extra = {s: pool // len(shared) + (i < pool % len(shared)) for i, s in enumerate(shared)}
        return {s: (base[s] + extra.get(s, 0)) * self.block_size - self.lengths[s] for s in seq_ids}

    def _headroom(self, seq_ids: Sequence[int]) -> tuple[dict[int, int], int]:
        """Per sequence, the blocks it must hold (its next position and what is reserved already), and the blocks
        left over once every one of ``seq_ids`` holds them (negative: the pool cannot)."""
        base = {s: self._blocks_for(max(self.reserved[s], self.lengths[s] + 1)) for s in seq_ids}
        return base, len(self._free) + sum(len(self.block_tables[s]) - base[s] for s in seq_ids)

    def _spares(self, num_new: Mapping[int, int]) -> dict[int, int]:
        """{seq_id: blocks it keeps} for the sequences holding a block in which none of their positions lies
        (committed, reserved, or asked by ``num_new``)."""
        out = {}
        for s, table in self.block_tables.items():
            keep = self._blocks_for(max(self.reserved[s], self.lengths[s] + num_new.get(s, 0)))
            if keep < len(table):
                out[s] = keep
        return out

    def _release_blocks(self, seq_id: int, keep: int) -> None:
        """Free the sequence's blocks past its first ``keep``."""
        table = self.block_tables[seq_id]
        if keep < len(table):
            self._free.extend(reversed(table[keep:]))
            del table[keep:]
            self._slot_rows[seq_id] = self._slot_rows[seq_id][: keep * self.block_size]

    def host_slots(self, seq_id: int, positions: Iterable[int]) -> list[int]:
        """The slots of ``positions`` of ``seq_id``, from its block table on the host (no device read)."""
        return table_slots(self.block_tables[seq_id], self.block_size, positions)

    def committed_length(self, seq_id: int) -> int:
        """Positions of ``seq_id`` that hold committed K/V."""
        return self.lengths[seq_id]

    def reserve_scratch(self, num_new: Mapping[int, int]) -> None:
        """The scratch region: positions ``[committed_length, committed_length + n)`` per sequence, reserved
        (all-or-nothing) for a drafter that runs layers of the target over this cache (self-draft). The engine
        owns it: its next verify overwrites those positions and its commit keeps or releases them; a drafter
        writes only there and never commits. Only from the blocks left once every sequence holds its next position
        (else CacheFullError): a sequence the drafter was not asked for still decodes in a pool of plain decoding's
        size, though the scratch would fit in the blocks it needs next (or a spare block it holds)."""
        base, pool = self._headroom(list(self.block_tables))
        extra = sum(max(0, self._blocks_for(self.lengths[s] + n) - base[s]) for s, n in num_new.items())
        if extra > pool:
            raise CacheFullError(f"KV cache out of blocks for drafting: {extra} more block{'s' * (extra != 1)} of "
                                 f"{self.block_size} tokens {'are' if extra != 1 else 'is'} needed, {max(pool, 0)} "
                                 f"{'is' if max(pool, 0) == 1 else 'are'} left once every sequence holds its next "
                                 "position. Pass a larger num_blocks.")
        self.reserve_many(num_new)

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:  # [end - start] int64
        if end > self.reserved[seq_id]:
            raise IndexError(f"positions up to {end} of sequence {seq_id} are not reserved")
        return self._slot_rows[seq_id][start:max(start, end)]  # a view: never write into it

    # ---- data ---------------------------------------------------------------------------
    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_slots, kv_heads, head_dim]
        return self.kv[layer, 0], self.kv[layer, 1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] into slots [num_tokens]."""
        if self.backend.triton:
            self.backend.kv.write_kv(self.kv, layer, slots, k, v)
            return
        self.kv[layer, 0].index_copy_(0, slots, k)
        self.kv[layer, 1].index_copy_(0, slots, v)

    def write_rotated(self, layer: int, slots: torch.Tensor, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, num_q_heads: int, norms=None) -> None:
        """Triton backend: RoPE of qk [num_tokens, q_heads + kv_heads, head_dim] (q heads, then k heads) in place,
        and the rotated k and v [num_tokens, kv_heads, head_dim] into slots [num_tokens]: :meth:`write` fused with
        the RoPE before it, one launch (``kernels.fused_ops.rope_write_``; ``norms``: Qwen3's per-head q / k
        RMSNorm before the RoPE, in the same launch)."""
        if not self.backend.triton:
            raise ValueError("write_rotated needs the Triton backend; the reference runs RoPE, then write()")
        self.backend.fused.rope_write_(qk, v, cos, sin, self.kv, layer, slots, num_q_heads, norms)

    def copy_prefix(self, src: int, dsts: Sequence[int], n: int) -> None:
        """Copy the K/V of positions ``[0, n)`` of ``src`` into the same positions of every sequence of ``dsts``, all
        layers: one gather of src's rows, one scatter into each copy's own blocks (Engine.add prefills identical
        prompts once). Afterwards every copy holds bit for bit what ``src`` holds there. No block is shared: each
        sequence still writes, commits and frees only its own. ``[0, n)`` must be written in ``src`` and reserved in
        every copy (IndexError otherwise, nothing copied); it stays uncommitted, as the writes of a forward would."""
        if src in dsts or len(set(dsts)) != len(dsts):
            raise ValueError(f"copy_prefix: the copies {list(dsts)} must be distinct and differ from {src}")
        if not dsts or n <= 0:
            return
        from_slots = self.slots(src, 0, n)
        to_slots = torch.stack([self.slots(d, 0, n) for d in dsts])  # [copies, n]
        self.kv[:, :, to_slots] = self.kv[:, :, from_slots].unsqueeze(2)  # broadcast: src's rows are read once

    def commit(self, keep: Mapping[int, Sequence[int]]) -> None:
        """Per sequence, keep the K/V written at offsets ``keep`` (relative to its length,
        strictly increasing) as its next positions; release every block past the new end but one (the spare).

        One copy of the slots, then one gather + one scatter, move the kept K/V of all sequences in all layers.
        """
        # check every sequence before changing any: a bad entry leaves the cache as it was (all-or-nothing)
        checked: list[tuple[int, list[int]]] = []
        for seq_id, offsets in keep.items():
            offsets = [int(o) for o in offsets]
            if any(b <= a for a, b in pairwise(offsets)) or (offsets and offsets[0] < 0):
                raise ValueError(f"keep offsets must be increasing and >= 0, got {offsets}")
            if seq_id not in self.lengths:
                raise KeyError(f"sequence {seq_id} is not in the cache")
            if offsets and self.lengths[seq_id] + offsets[-1] >= self.reserved[seq_id]:
                raise IndexError(f"sequence {seq_id}: offset {offsets[-1]} was never reserved")
            checked.append((seq_id, offsets))
        src: list[int] = []  # slots, computed on the host from the block tables: one copy for all sequences
        dst: list[int] = []
        for seq_id, offsets in checked:
            length = self.lengths[seq_id]
            moved = [j for j, off in enumerate(offsets) if off != j]
            if moved:
                first = moved[0]  # offsets[j] >= j, so everything before `first` is in place
                src += self.host_slots(seq_id, (length + o for o in offsets[first:]))
                dst += self.host_slots(seq_id, range(length + first, length + len(offsets)))
            self.lengths[seq_id] = self.reserved[seq_id] = length + len(offsets)
            self._release_blocks(seq_id, self._blocks_for(self.lengths[seq_id]) + 1)  # keeps the spare (module doc)
        if src:  # the kernel's slots are int32: made so on the host, not by two conversions on the device
            src_t, dst_t = to_device([src, dst], torch.int32 if self.backend.triton else torch.long, self.kv.device)
            if self.backend.triton:  # one launch; pairs in order, reads never follow a write of their slot
                self.backend.kv.compact_kv(self.kv, src_t, dst_t)
            else:
                self.kv[:, :, dst_t] = self.kv[:, :, src_t]  # RHS is gathered first: overlap-safe


# ---- memory estimate (checked by generate() before allocating) ------------------------------
def cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                dtype: torch.dtype) -> int:
    """Bytes of a :class:`PagedKVCache`'s storage: K and V of every slot of every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * num_blocks * block_size * itemsize


def available_memory_bytes(device: torch.device | str) -> int | None:
    """Memory a new allocation on ``device`` can take now (None: unknown, e.g. meta / mps). CPU: MemAvailable of
    /proc/meminfo, else the free physical pages; CUDA: free device memory plus what torch holds unused."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
