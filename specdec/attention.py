"""Attention over the paged KV cache: the attention plan, and the PyTorch reference path.

One forward's attention is described once, compactly, per sequence (:class:`SeqAttention`):
its keys are cache slots in position order; the first ``num_visible`` are seen by every query
(the committed prefix, plus a tree's root); each query sees the remaining ``num_masked`` keys
either causally (a run of new tokens: query i sees masked keys 0..i) or by its ancestor bits
(a draft tree: bit j = the query sees masked key j, itself included). Nothing else. The
reference path expands a dense mask from this only where SDPA needs one
(``SeqAttention.dense_mask``); the Triton kernels read ``num_visible`` / ``ancestor_bits``
as they are (``specdec.kernels.tree_attention.TreeAttentionMetadata.from_plan``).

:class:`AttentionPlan` holds every sequence of the forward and the slots its new K/V are written
to; it is built once per forward by :class:`BatchBuilder` (the engine's verify and prefill, the
model drafters' forwards) and reused by every layer. :func:`paged_attention` runs one layer.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from specdec.host_copy import to_device
from specdec.kernels.dispatch import REFERENCE, Backend
from specdec.tree import MAX_TREE_NODES


@dataclass(frozen=True)
class SeqAttention:
    query_start: int  # first row of this sequence in the flattened new tokens
    num_new: int  # new tokens (queries) of this sequence in this forward
    key_slots: torch.Tensor  # [num_visible + num_masked] cache slots of every key, position order
    num_visible: int  # leading keys every query sees
    # [num_new] int64, bit j = the query sees masked key j; None = causal: the masked keys are the new tokens
    # themselves and query i sees masked keys 0..i. On the host as the drafter built them (the users move them:
    # a CUDA-graph step stages them with its other inputs), or on key_slots' device
    ancestor_bits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        keys = self.key_slots.numel()
        if not 0 <= self.num_visible <= keys:
            raise ValueError(f"num_visible={self.num_visible} is outside the sequence's {keys} keys")
        if self.ancestor_bits is None:
            if self.num_masked != self.num_new:
                raise ValueError(f"a causal run of {self.num_new} new tokens needs exactly {self.num_new} masked keys, "
                                 f"got {self.num_masked}")
        else:
            if self.num_masked > MAX_TREE_NODES:
                raise ValueError(f"ancestor bits cover at most {MAX_TREE_NODES} masked keys, got {self.num_masked}")
            if tuple(self.ancestor_bits.shape) != (self.num_new,):
                raise ValueError(f"ancestor_bits must be [{self.num_new}], got {tuple(self.ancestor_bits.shape)}")

    @property
    def num_masked(self) -> int:
        return self.key_slots.numel() - self.num_visible

    @property
    def causal_run(self) -> bool:
        """Several new tokens under a causal mask (a prefill or a drafter's catch-up)."""
        return self.ancestor_bits is None and self.num_new > 1

    @property
    def prefill(self) -> bool:
        """A causal run with no keys before it: SDPA's causal path and the kernel's causal mode, no dense mask."""
        return self.causal_run and self.num_visible == 0

    @cached_property
    def dense_mask(self) -> torch.Tensor | None:  # [num_new, num_keys] bool, True = may attend; None = all visible
        """Built once per forward (the plan is shared by every layer), only where SDPA needs a mask."""
        if self.ancestor_bits is None and self.num_new == 1:
            return None
        device = self.key_slots.device
        mask = torch.ones(self.num_new, self.key_slots.numel(), dtype=torch.bool, device=device)
        if self.ancestor_bits is None:
            mask[:, self.num_visible :] = torch.ones(self.num_new, self.num_new, dtype=torch.bool, device=device).tril()
        else:
            bit = torch.ones(self.num_masked, dtype=torch.long, device=device) << torch.arange(self.num_masked,
                                                                                               device=device)
            mask[:, self.num_visible :] = (to_device(self.ancestor_bits, torch.long, device)[:, None] & bit) != 0
        return mask

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

    @cached_property
    def write_slots(self) -> torch.Tensor:  # [num_tokens] slot each new token's K/V is written to
        """A sequence's new tokens are written to its last ``num_new`` keys (a lone sequence's: a view)."""
        slots = [s.key_slots[s.key_slots.numel() - s.num_new :] for s in self.seqs]
        return slots[0] if len(slots) == 1 else torch.cat(slots)

    @cached_property
    def padded(self) -> PaddedBatch | None:
        """The batched form of a forward of 2+ sequences with no prefill among them, else None.

        One padded SDPA call per layer instead of one per sequence: on CPU the per-call cost
        (gather + kernel launch) dominated batched decoding. Masked padding keys add
        exact zeros, so the result differs from the per-sequence path only by summation order."""
        if len(self.seqs) < 2 or any(s.prefill for s in self.seqs):
            return None
        device = self.write_slots.device
        max_new = max(s.num_new for s in self.seqs)
        # built from per-sequence lists and whole-batch ops: this runs once per forward for every sequence
        key_slots = torch.nn.utils.rnn.pad_sequence([s.key_slots for s in self.seqs], batch_first=True,
                                                    padding_value=-1)  # [batch, max_keys]
        key_slots = torch.where(key_slots < 0, key_slots[:, :1], key_slots)
        num_keys = to_device([s.key_slots.numel() for s in self.seqs], torch.long, device)  # [batch]
        rows: list[int] = []
        out_index: list[int] = []
        for b, s in enumerate(self.seqs):
            rows.extend(range(s.query_start, s.query_start + s.num_new))
            rows.extend([0] * (max_new - s.num_new))
            out_index.extend(range(b * max_new, b * max_new + s.num_new))
        query_rows = to_device(rows, torch.long, device).view(len(self.seqs), max_new)
        # every real row sees its sequence's keys; a padding row its first key only
        real_row = torch.arange(max_new, device=device) < to_device([s.num_new for s in self.seqs], torch.long,
                                                                    device)[:, None]  # [batch, max_new]
        key_seen = torch.arange(key_slots.shape[1], device=device) < num_keys[:, None]  # [batch, max_keys]
        mask = real_row[:, :, None] & key_seen[:, None, :]
        mask[:, :, 0] = True
        for b, s in enumerate(self.seqs):
            dense = s.dense_mask
            if dense is not None:
                mask[b, : s.num_new, : dense.shape[1]] = dense
        return PaddedBatch(key_slots, query_rows, mask[:, None],
                           to_device(out_index, torch.long, device))

    @cached_property
    def invariant_row_keys(self) -> tuple[tuple[list[torch.Tensor], range], ...]:
        """Per sequence: the cache slots of each query row's visible keys, in position order, and the rows
        (the bit-exact mode's reference attention, :func:`specdec.models.invariant_ops.attention`)."""
        out = []
        for s in self.seqs:
            prefix, masked = s.key_slots[: s.num_visible], s.key_slots[s.num_visible :]
            if s.ancestor_bits is None:
                keys = [s.key_slots[: s.num_visible + i + 1] for i in range(s.num_new)]
            else:
                keys = [torch.cat([prefix, masked[[j for j in range(s.num_masked) if bits >> j & 1]]])
                        for bits in s.ancestor_bits.tolist()]
            out.append((keys, range(s.query_start, s.query_start + s.num_new)))
        return tuple(out)

    @cached_property
    def invariant_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, max_keys] slots of each row's visible keys in position order, [T] keys per row): the bit-exact
        mode's Triton attention (``specdec.kernels.invariant_ops``); built on the device, no host sync."""
        from specdec.models.invariant_ops import row_key_slots

        return row_key_slots(self)

    @cached_property
    def kernel_metadata(self):
        """Inputs of the Triton tree-attention kernel, built once per forward and shared by every layer."""
        from specdec.kernels.tree_attention import TreeAttentionMetadata

        return TreeAttentionMetadata.from_plan(self)


@dataclass(frozen=True)
class ForwardBatch:
    """The model's inputs for one forward over several sequences: built on the host, moved to the device when
    the eager forward asks (a CUDA-graph step stages the host values into its own buffers instead)."""

    tokens: list[int]  # [T] new tokens of every sequence, flattened (host)
    position_list: list[int]  # [T] (host)
    plan: AttentionPlan
    rows: tuple[range, ...]  # rows of T per sequence, in the order added
    seq_ids: tuple[int, ...]  # the cache's sequence of each, in the order added
    cache: "object"  # the PagedKVCache whose slots the plan names
    device: torch.device

    @cached_property
    def _ids(self) -> torch.Tensor:  # [2, T] int64 on the device: tokens and positions, moved by one copy
        return to_device([self.tokens, self.position_list], torch.long, self.device)

    @cached_property
    def token_ids(self) -> torch.Tensor:  # [T] int64 on the device
        return self._ids[0]

    @cached_property
    def positions(self) -> torch.Tensor:  # [T] int64 on the device
        return self._ids[1]


@dataclass
class BatchBuilder:
    """Assembles one forward, sequence by sequence, over a paged KV cache::

        builder = BatchBuilder(cache, device)
        builder.add(seq_id, tokens, positions, num_keys=cached + len(tokens), num_visible=cached)  # causal
        builder.add(seq_id, tokens, positions, num_keys, num_visible, ancestor_bits)               # a tree
        batch = builder.build()

    A sequence's keys are its positions ``[0, num_keys)`` (reserved in the cache); its new tokens are
    written to the LAST ``len(tokens)`` of them."""

    cache: "object"  # PagedKVCache (slots(seq_id, start, end))
    device: torch.device
    _seq_ids: list[int] = field(default_factory=list)
    _tokens: list[int] = field(default_factory=list)
    _positions: list[int] = field(default_factory=list)
    _seqs: list[SeqAttention] = field(default_factory=list)
    _rows: list[range] = field(default_factory=list)

    def add(self, seq_id: int, tokens: Sequence[int], positions: Sequence[int] | torch.Tensor, num_keys: int,
            num_visible: int, ancestor_bits: torch.Tensor | None = None) -> range:
        start, n = len(self._tokens), len(tokens)
        key_slots = self.cache.slots(seq_id, 0, num_keys)
        if ancestor_bits is not None and ancestor_bits.dtype != torch.long:
            ancestor_bits = ancestor_bits.long()
        self._seqs.append(SeqAttention(start, n, key_slots, num_visible, ancestor_bits))
        self._seq_ids.append(seq_id)
        self._tokens.extend(tokens)
        self._positions.extend(positions.tolist() if isinstance(positions, torch.Tensor) else positions)
        self._rows.append(range(start, start + n))
        return self._rows[-1]

    def build(self) -> ForwardBatch:
        return ForwardBatch(self._tokens, self._positions, AttentionPlan(tuple(self._seqs)),
                            tuple(self._rows), tuple(self._seq_ids), self.cache, self.device)


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
        o = F.scaled_dot_product_attention(  # a prefill takes SDPA's own causal path: no n x n mask is built
            qs, ks, vs, attn_mask=None if s.prefill else s.dense_mask, is_causal=s.prefill, scale=scale,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)
    return out
