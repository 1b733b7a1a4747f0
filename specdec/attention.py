"""Attention over the paged KV cache: the PyTorch reference path (CPU and fallback).

Semantics, shared with the Triton kernels in ``specdec.kernels``: each query token of a
sequence attends to every committed token of that sequence (positions ``[0, length)``,
read through its block table) plus the new tokens of this forward selected by its row of
``new_mask`` (its tree ancestors and itself; a causal mask for prefill). Nothing else.

:class:`AttentionPlan` is built once per forward (slot mappings, masks) and reused by
every layer; :func:`paged_attention` runs one layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from specdec.kernels.dispatch import REFERENCE, Backend

CAUSAL = "causal"  # AttentionPlan.build's new_mask for a causal run of new tokens (prefill)


@dataclass(frozen=True)
class SeqAttention:
    query_start: int  # first row of this sequence in the flattened new tokens
    num_new: int  # new tokens of this sequence in this forward
    key_slots: torch.Tensor  # [num_cached + num_new] cache slots of every key, position order
    # [num_new, num_cached + num_new] bool, True = may attend; None = all visible (decode)
    mask: torch.Tensor | None
    causal: bool  # new tokens are a plain causal run with no cached prefix (prefill)
    # leading key columns that `mask` shows to every query, when the builder knows it (build(): the cached
    # keys; a model drafter: its committed keys). The Triton path then reads only the mask after them and
    # needs no host sync. None: the kernel path derives it from the mask (a host sync when > 64 columns).
    visible_prefix: int | None = None

    @cached_property
    def contiguous_start(self) -> int | None:
        """The first slot if the keys occupy consecutive slots, else None.

        A lone sequence usually does (the pool hands out blocks lowest id first), and then
        attention reads a view of the cache instead of gathering a copy: at a 1,500-token
        context the gather moved ~70 MB per forward of the embedded model."""
        slots = self.key_slots
        n = slots.numel()
        if n == 0:
            return None
        first = int(slots[0])
        if int(slots[-1]) - first != n - 1:
            return None
        if not torch.equal(slots, torch.arange(first, first + n, dtype=slots.dtype, device=slots.device)):
            return None
        return first


@dataclass(frozen=True)
class PaddedBatch:
    """Every sequence of a decode/verify forward as one padded batch, for a single SDPA call."""

    # [batch, max_keys] cache slot of each key; padding repeats the sequence's first key, which is always
    # written (an arbitrary slot such as 0 may never have been: uninitialised memory can hold NaN, and a
    # masked NaN value still turns the output into NaN)
    key_slots: torch.Tensor
    query_rows: torch.Tensor  # [batch, max_new] row of q per (sequence, new token); padding reads row 0
    mask: torch.Tensor  # [batch, 1, max_new, max_keys] bool; a padding row sees only its sequence's first key
    out_index: torch.Tensor  # [num_tokens] flat (sequence * max_new + token) index of each real row


@dataclass(frozen=True)
class AttentionPlan:
    seqs: tuple[SeqAttention, ...]
    write_slots: torch.Tensor  # [num_tokens] slot each new token's K/V is written to

    @cached_property
    def padded(self) -> PaddedBatch | None:
        """The batched form of a forward of 2+ sequences with no prefill among them, else None.

        One padded SDPA call per layer instead of one per sequence: on CPU the per-call cost
        (gather + kernel launch, ~0.15 ms) dominated batched decoding. Masked padding keys add
        exact zeros, so the result differs from the per-sequence path only by summation order."""
        if len(self.seqs) < 2 or any(s.causal for s in self.seqs):
            return None
        device = self.write_slots.device
        batch = len(self.seqs)
        max_keys = max(s.key_slots.numel() for s in self.seqs)
        max_new = max(s.num_new for s in self.seqs)
        key_slots = torch.zeros(batch, max_keys, dtype=torch.long, device=device)
        query_rows = torch.zeros(batch, max_new, dtype=torch.long, device=device)
        mask = torch.zeros(batch, 1, max_new, max_keys, dtype=torch.bool, device=device)
        mask[:, 0, :, 0] = True
        out_index = []
        for b, s in enumerate(self.seqs):
            keys = s.key_slots.numel()
            key_slots[b, :keys] = s.key_slots
            key_slots[b, keys:] = s.key_slots[0]
            query_rows[b, : s.num_new] = torch.arange(s.query_start, s.query_start + s.num_new, device=device)
            mask[b, 0, : s.num_new, :keys] = True if s.mask is None else s.mask
            out_index.extend(range(b * max_new, b * max_new + s.num_new))
        return PaddedBatch(key_slots, query_rows, mask, torch.tensor(out_index, dtype=torch.long, device=device))

    @cached_property
    def kernel_metadata(self):
        """Inputs of the Triton tree-attention kernel, built once per forward and shared by every layer."""
        from specdec.kernels.tree_attention import TreeAttentionMetadata

        return TreeAttentionMetadata.from_plan(self)

    @staticmethod
    def build(
        num_cached: int, key_slots: torch.Tensor, new_mask: torch.Tensor | str | None, query_start: int
    ) -> SeqAttention:
        """One sequence: `new_mask` [num_new, num_new] over the new tokens, ``CAUSAL`` for a causal run
        (prefill; no mask is built when nothing is cached, so a 32k-token prompt costs no 1 GiB mask),
        or None for a single token."""
        num_new = key_slots.numel() - num_cached
        if new_mask is None:
            if num_new != 1:
                raise ValueError("new_mask may be omitted only for a single new token")
            return SeqAttention(query_start, 1, key_slots, None, False)
        if isinstance(new_mask, str):
            if new_mask != CAUSAL:
                raise ValueError(f"new_mask must be a bool tensor, {CAUSAL!r} or None, got {new_mask!r}")
            causal = num_cached == 0
            if not causal:  # a causal run after cached keys (chunked prefill): the reference path needs the mask
                new_mask = torch.ones(num_new, num_new, dtype=torch.bool, device=key_slots.device).tril()
        else:
            causal = num_cached == 0 and bool(
                torch.equal(new_mask, torch.ones(num_new, num_new, dtype=torch.bool, device=new_mask.device).tril())
            )
        full = None
        if not causal:
            full = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=key_slots.device)
            full[:, num_cached:] = new_mask.to(key_slots.device)
        return SeqAttention(query_start, num_new, key_slots, full, causal, visible_prefix=num_cached)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
    k_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim], new K already written
    v_cache: torch.Tensor,  # [num_slots, num_kv_heads, head_dim]
    plan: AttentionPlan,
    scale: float,
    backend: Backend = REFERENCE,  # the cache's (specdec.kernels.dispatch), chosen when it was built
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if backend.triton:
        return backend.attention.paged_tree_attention(q, k_cache, v_cache, plan, scale)
    padded = plan.padded
    if padded is not None:
        batch, max_keys = padded.key_slots.shape
        flat = padded.key_slots.reshape(-1)
        qs = q[padded.query_rows].transpose(1, 2)  # [batch, heads, max_new, dim]
        ks = k_cache.index_select(0, flat).view(batch, max_keys, *k_cache.shape[1:]).transpose(1, 2)
        vs = v_cache.index_select(0, flat).view(batch, max_keys, *v_cache.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=padded.mask, scale=scale, enable_gqa=True)
        return o.transpose(1, 2).reshape(-1, *q.shape[1:])[padded.out_index]
    out = torch.empty_like(q)
    for s in plan.seqs:
        rows = slice(s.query_start, s.query_start + s.num_new)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
        first = s.contiguous_start
        if first is None:
            ks, vs = k_cache.index_select(0, s.key_slots), v_cache.index_select(0, s.key_slots)
        else:  # the same values, read in place
            ks, vs = k_cache[first : first + s.key_slots.numel()], v_cache[first : first + s.key_slots.numel()]
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, kv_heads, keys, dim]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=s.mask, is_causal=s.causal, scale=scale, enable_gqa=True
        )
        out[rows] = o[0].transpose(0, 1)
    return out
