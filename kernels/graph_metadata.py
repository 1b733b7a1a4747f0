"""The CUDA-graph buckets' per-step inputs (``specdec.cuda_graphs``): buffers that never move, loaded by one copy.

A CUDA graph replays the same launches on the same memory, so a bucket's inputs (at most ``batch`` sequences of
at most ``tokens_per_seq`` new tokens, ``rows = batch * tokens_per_seq``) live in one device buffer shared by every
bucket, each laid out from its start:

    int64 [rows] token ids | int64 [rows] positions | int64 [rows] ancestor bits | int32 [rows] KV write slots |
    int32 [5, batch] ctx_lens, num_masked, q_starts, q_lens, tree_mode | int32 [batch, max_blocks] block tables

Before each replay :meth:`StaticInputs.load_` writes the step's values there from the host alone (the builder's
token ids, positions and ancestor bits; each sequence's blocks in the cache, pages of ``block_size`` slots) into a
pinned buffer and moves the bucket's layout in one asynchronous copy: no other launch, no read of the device.
The real tokens come first; padded rows are token 0 at position 0 writing into the scratch slot, and padded
sequences have ``q_len`` 0, so the kernel gives them no tile. Warm up once before capturing (the tile list is
copied to the device on first use).

    inputs = StaticInputs(max_batch=32, max_tokens_per_seq=64, max_keys=8192, block_size=16, scratch_slot=s,
                          device="cuda")
    bucket = inputs.bucket(batch=2, tokens_per_seq=4)    # views: the graph's inputs
    inputs.load_(bucket, forward_batch)                   # outside the graph, every step
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from specdec.kernels.tree_attention import TreeAttentionMetadata

from specdec.kv_cache import blocks_for

FIELDS = ("ctx_lens", "num_masked", "q_starts", "q_lens", "tree_mode")  # the [5, batch] int32 rows, in order


@dataclass(frozen=True)
class BucketInputs:
    """One bucket's views of the shared buffer: what its graph reads."""

    batch: int
    tokens_per_seq: int
    words: int  # int64 words of its layout (the copy's length)
    token_ids: torch.Tensor  # [rows] int64
    positions: torch.Tensor  # [rows] int64
    write_slots: torch.Tensor  # [rows] int32
    metadata: TreeAttentionMetadata  # over the bits, the [5, batch] rows and the block tables

    @property
    def rows(self) -> int:
        return self.batch * self.tokens_per_seq


class StaticInputs:
    def __init__(self, max_batch: int, max_tokens_per_seq: int, max_keys: int, block_size: int, scratch_slot: int,
                 device: torch.device | str) -> None:
        if min(max_batch, max_tokens_per_seq, max_keys, block_size) < 1:
            raise ValueError(f"max_batch, max_tokens_per_seq, max_keys and block_size must be >= 1, got {max_batch}, "
                             f"{max_tokens_per_seq}, {max_keys}, {block_size}")
        self.max_batch, self.max_tokens_per_seq, self.max_keys = max_batch, max_tokens_per_seq, max_keys
        self.block_size, self.scratch_slot = block_size, scratch_slot
        self.max_blocks = blocks_for(max_keys, block_size)
        self.device = torch.device(device)
        words = self._words(max_batch, max_batch * max_tokens_per_seq)
        self.buffer = torch.zeros(words, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":  # two pinned buffers in turn, each reused once its copy has run
            self.staging = [torch.zeros(words, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self.copied: list[torch.cuda.Event | None] = [None, None]
        else:  # the host's memory is the device's: written in place
            self.staging, self.copied = [self.buffer], [None]
        self.turn = 0
        self._host_parts: dict[tuple[int, int, int], tuple] = {}  # (turn, batch, rows) -> the staging buffer's parts

    def _words(self, batch: int, rows: int) -> int:
        return 3 * rows + (rows + len(FIELDS) * batch + batch * self.max_blocks + 1) // 2

    def _split(self, buf, batch: int, rows: int, int32):
        """``buf`` (a tensor or a numpy array of int64 words) -> the layout's parts (module doc) as views."""
        tokens, positions, bits = buf[:rows], buf[rows : 2 * rows], buf[2 * rows : 3 * rows]
        small = buf[3 * rows : self._words(batch, rows)].view(int32)
        meta_end = rows + len(FIELDS) * batch
        tables = small[meta_end : meta_end + batch * self.max_blocks].reshape(batch, self.max_blocks)
        return tokens, positions, bits, small[:rows], small[rows:meta_end].reshape(len(FIELDS), batch), tables

    def bucket(self, batch: int, tokens_per_seq: int) -> BucketInputs:
        if not (1 <= batch <= self.max_batch and 1 <= tokens_per_seq <= self.max_tokens_per_seq):
            raise ValueError(f"a {batch} x {tokens_per_seq} bucket does not fit in inputs sized for "
                             f"{self.max_batch} x {self.max_tokens_per_seq}")
        rows = batch * tokens_per_seq
        tokens, positions, bits, slots, meta, tables = self._split(self.buffer, batch, rows, torch.int32)
        metadata = TreeAttentionMetadata(
            block_tables=tables, page_size=self.block_size, ctx_lens=meta[0], num_masked=meta[1], q_starts=meta[2],
            q_lens=meta[3], tree_mode=meta[4], q_bits=bits, host_q_lens=(tokens_per_seq,) * batch,
            max_ctx_len=self.max_keys,
        )
        return BucketInputs(batch, tokens_per_seq, self._words(batch, rows), tokens, positions, slots, metadata)

    def pad_(self, bucket: BucketInputs) -> None:
        """Fill ``bucket``'s inputs with padding alone (no sequence has a query; every row is token 0 at position 0
        writing the scratch slot): a forward over them, a warm-up or a capture ahead of any step, changes no
        sequence's K/V."""
        self.buffer[: bucket.words].zero_()  # on the stream of any copy load_ queued before
        bucket.write_slots.fill_(self.scratch_slot)

    def load_(self, bucket: BucketInputs, batch) -> None:
        """Write ``batch``'s step (a :class:`~specdec.attention.ForwardBatch` over this cache) into ``bucket``'s
        inputs: built on the host, one asynchronous copy to the device."""
        seqs, n = batch.plan.seqs, len(batch.tokens)
        if len(seqs) > bucket.batch or n > bucket.rows:
            raise ValueError(f"the step has {len(seqs)} sequences and {n} tokens; the bucket holds {bucket.batch} "
                             f"and {bucket.rows}")
        host = self.staging[self.turn]
        event = self.copied[self.turn]
        if event is not None:
            event.synchronize()  # this buffer's last copy has long run (a step reads the device before the next)
        key = (self.turn, bucket.batch, bucket.rows)
        if key not in self._host_parts:  # numpy views of the staging buffer, made once per bucket (they never move)
            self._host_parts[key] = self._split(host.numpy(), bucket.batch, bucket.rows, np.int32)
        tokens, positions, bits, slots, meta, tables = self._host_parts[key]
        tokens[:n], tokens[n:] = batch.tokens, 0
        positions[:n], positions[n:] = batch.position_list, 0
        slots[n:] = self.scratch_slot
        bits[n:] = 0
        meta[:, len(seqs):] = 0
        # per sequence, Python lists only; each field is stored once for the whole step (rows in query order)
        new_slots: list[int] = []
        new_bits: list[int] = []
        fields: list[tuple[int, ...]] = []
        for b, (s, seq_id) in enumerate(zip(seqs, batch.seq_ids, strict=True)):
            keys = s.key_slots.numel()
            if s.num_new > bucket.tokens_per_seq or keys > self.max_keys:
                raise ValueError(f"sequence {b}: {s.num_new} new tokens / {keys} keys exceed the bucket "
                                 f"({bucket.tokens_per_seq} / {self.max_keys})")
            table = batch.cache.block_tables[seq_id][: blocks_for(keys, self.block_size)]
            tables[b, : len(table)] = table
            # a builder writes the new tokens to the last keys
            new_slots += batch.cache.host_slots(seq_id, range(keys - s.num_new, keys))
            # on the host as the builder was given them
            new_bits += [0] * s.num_new if s.ancestor_bits is None else s.ancestor_bits.tolist()
            fields.append((s.num_visible, s.num_masked, s.query_start, s.num_new, s.ancestor_bits is not None))
        slots[:n], bits[:n] = new_slots, new_bits
        meta[:, : len(seqs)] = np.array(fields, dtype=np.int32).T
        if host is not self.buffer:
            self.buffer[: bucket.words].copy_(host[: bucket.words], non_blocking=True)
            if self.copied[self.turn] is None:
                self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()
            self.turn = 1 - self.turn
