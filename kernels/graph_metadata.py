"""Fixed-capacity tree-attention metadata: the inputs of the CUDA-graph buckets (``specdec.cuda_graphs``).

A CUDA graph replays the same launches on the same memory, so the kernel's inputs must live in
buffers that never move. :func:`static_metadata` allocates them for a bucket (at most ``batch``
sequences of at most ``tokens_per_seq`` new tokens and ``max_keys`` keys each); before each
replay :func:`load_plan_` copies the step's :class:`~specdec.attention.AttentionPlan` into them.
The launch grid depends only on the bucket: tiles past a sequence's real tokens, and sequences
past the real batch (``q_len = 0``), read no keys and write nothing.

    meta = static_metadata(batch=8, tokens_per_seq=17, max_keys=4096, device="cuda")
    small = bucket_view(meta, batch=2, tokens_per_seq=4)   # a smaller bucket over the same buffers
    load_plan_(meta, plan)                      # outside the graph, every step
    tree_attention(q_padded, k_cache, v_cache, meta, scale, num_splits=S)   # q: [8 * 17, H, D]

Warm up once before capturing (the tile list is copied to the device on first use) and keep
``num_splits`` fixed per bucket: it is part of the launch.
"""
from __future__ import annotations

import dataclasses

import torch
from specdec.kernels.tree_attention import TreeAttentionMetadata


def static_metadata(
    batch: int, tokens_per_seq: int, max_keys: int, device: torch.device | str
) -> TreeAttentionMetadata:
    if min(batch, tokens_per_seq, max_keys) < 1:
        raise ValueError(f"batch, tokens_per_seq and max_keys must be >= 1, got {batch}, {tokens_per_seq}, {max_keys}")

    def zeros(*shape, dtype=torch.int32):
        return torch.zeros(*shape, dtype=dtype, device=device)

    return TreeAttentionMetadata(
        block_tables=zeros(batch, max_keys),  # page size 1: one slot per key, as from_plan
        page_size=1,
        ctx_lens=zeros(batch),
        num_masked=zeros(batch),
        q_starts=zeros(batch),
        q_lens=zeros(batch),
        tree_mode=zeros(batch),
        q_bits=zeros(batch * tokens_per_seq, dtype=torch.long),
        host_q_lens=(tokens_per_seq,) * batch,
        max_ctx_len=max_keys,
        padded=True,
    )


def bucket_view(static: TreeAttentionMetadata, batch: int, tokens_per_seq: int) -> TreeAttentionMetadata:
    """The metadata of a smaller bucket as prefix views of ``static``'s buffers (no copy): buckets of
    different shapes can share one allocation, each with its own launch grid (tile list)."""
    rows = batch * tokens_per_seq
    if batch > static.block_tables.shape[0] or rows > static.q_bits.numel():
        raise ValueError(f"a {batch} x {tokens_per_seq} bucket does not fit in the static metadata")
    return dataclasses.replace(
        static, block_tables=static.block_tables[:batch], ctx_lens=static.ctx_lens[:batch],
        num_masked=static.num_masked[:batch], q_starts=static.q_starts[:batch], q_lens=static.q_lens[:batch],
        tree_mode=static.tree_mode[:batch], q_bits=static.q_bits[:rows], host_q_lens=(tokens_per_seq,) * batch,
        _tiles={},
    )


def load_plan_(static: TreeAttentionMetadata, plan) -> None:
    """Copy ``plan``'s kernel metadata into the buffers of ``static`` (in place; device copies only)."""
    batch, max_keys = static.block_tables.shape
    per_seq = static.host_q_lens[0]
    seqs = plan.seqs
    if len(seqs) > batch:
        raise ValueError(f"plan has {len(seqs)} sequences, the bucket holds {batch}")
    for b, s in enumerate(seqs):
        if s.num_new > per_seq or s.key_slots.numel() > max_keys:
            raise ValueError(f"sequence {b}: {s.num_new} new tokens / {s.key_slots.numel()} keys exceed the bucket "
                             f"({per_seq} / {max_keys})")
    dyn = plan.kernel_metadata
    if dyn.num_tokens > static.q_bits.numel():
        raise ValueError(f"plan has {dyn.num_tokens} tokens, the bucket holds {static.q_bits.numel()}")
    n = len(seqs)
    static.block_tables[:n, : dyn.block_tables.shape[1]].copy_(dyn.block_tables)
    for name in ("ctx_lens", "num_masked", "q_starts", "q_lens", "tree_mode"):
        buf = getattr(static, name)
        buf[:n].copy_(getattr(dyn, name))
        buf[n:].zero_()  # q_len 0: the padded sequences' tiles are inert
    static.q_bits[: dyn.num_tokens].copy_(dyn.q_bits)
