"""Row-invariant versions of the forward's ops: a row's result never depends on the other rows of the call.

The bit-exact mode (``LlamaRunner(..., invariant=True)``, ``generate(..., invariant=True)``) computes every token
row with the same kernels and the same reduction order whatever else shares the forward (tree nodes, other
sequences, a prompt), so a verify row's logits are bitwise those of a one-row decode at the same position:

* :func:`linear`: the rows go through the product in blocks of exactly ``ROW_BLOCK`` rows (the last block padded
  with zero rows that are dropped), so the library sees one shape per weight whatever the row count and picks
  one kernel and one K-reduction order; on the Triton backend a fixed-tile kernel (``kernels/invariant_ops.py``).
* :func:`attention`: each query row attends to exactly its visible keys, gathered in position order into a
  fresh tensor, through one call of its own: the call's shape depends only on how many keys the row sees,
  which is its position + 1 whatever the tree or batch. On the Triton backend one program per (row, head)
  reduces the row's keys in position order in fixed blocks, with no split.
* :class:`RopeTable`: cos / sin of each position computed in fixed chunks of positions, then looked up.
* RMSNorm, SiLU and the residual add are per-row element-wise work (the reference and the fused kernels alike).

Padding rows are zeros and every row of a block is computed independently, so padding changes nothing but time.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# rows per product call on the reference path: each call costs about what ROW_BLOCK rows cost, so a one-row decode
# pays for ROW_BLOCK rows and a verify of up to ROW_BLOCK rows costs the same (docs/bit-exact.md has the trade-off)
ROW_BLOCK = 8
ROPE_CHUNK = 1024  # positions per cos / sin computation


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, backend=None) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T (+ bias), every row computed by one fixed-shape product."""
    if backend is not None and backend.triton:
        return backend.invariant.linear(x, weight, bias)
    m, block = x.shape[0], ROW_BLOCK
    pad = -m % block
    x = torch.cat([x, x.new_zeros(pad, x.shape[1])]) if pad else x.contiguous()
    # every block 64-byte aligned, as a fresh allocation is: a library may take another path for unaligned data
    blocks = [b if b.data_ptr() % 64 == 0 else b.clone() for b in x.split(block)]
    out = torch.cat([F.linear(b, weight) for b in blocks]) if len(blocks) > 1 else F.linear(blocks[0], weight)
    out = out[:m] if pad else out
    return out if bias is None else out + bias


class RopeTable:
    """cos / sin [position, head_dim] of a runner's rotary embedding, computed ``ROPE_CHUNK`` positions at a time
    by one fixed-shape call and kept, so a position's values never depend on the other positions of a forward."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq, self.scaling, self.dtype = inv_freq.float(), scaling, dtype
        self.cos = self.sin = None

    def _grow(self, positions: int) -> None:
        have = 0 if self.cos is None else self.cos.shape[0]
        chunks_cos, chunks_sin = [], []
        for start in range(have, positions, ROPE_CHUNK):
            pos = torch.arange(start, start + ROPE_CHUNK, device=self.inv_freq.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            chunks_cos.append((emb.cos() * self.scaling).to(self.dtype))
            chunks_sin.append((emb.sin() * self.scaling).to(self.dtype))
        if chunks_cos:
            self.cos = torch.cat(([] if self.cos is None else [self.cos]) + chunks_cos)
            self.sin = torch.cat(([] if self.sin is None else [self.sin]) + chunks_sin)

    def __call__(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """2 x [T, 1, head_dim] for ``positions`` [T]; ``max_position`` bounds them (host side, no sync)."""
        self._grow(max_position + 1)
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


def row_key_slots(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, max_keys] int64 cache slot of each row's visible keys in position order, padded with the row's first
    slot; [T] int64 keys per row) for an AttentionPlan. No host sync: built from each sequence's mask. A lone causal
    run (a prompt's prefill, a decode step) sees a prefix of its keys in each row: its table is a view of its key
    slots, every row the same (row stride 0; past ``lens[t]`` a row holds later keys, never read), not a
    [num_new, keys] copy (prompt x prompt int64: 2 GiB at a 16k-token prompt, and its sort more)."""
    if len(plan.seqs) == 1 and plan.seqs[0].ancestor_bits is None:
        s = plan.seqs[0]
        lens = torch.arange(s.num_visible + 1, s.num_visible + s.num_new + 1, device=s.key_slots.device)
        return s.key_slots.expand(s.num_new, s.key_slots.numel()), lens
    slots, lens = [], []
    width = max(s.key_slots.numel() for s in plan.seqs)
    for s in plan.seqs:
        keys = s.key_slots.numel()
        mask = s.dense_mask  # [num_new, keys] bool, None = a single new token that sees every key
        if mask is None:
            mask = torch.ones(s.num_new, keys, dtype=torch.bool, device=s.key_slots.device)
        # a stable sort of "not visible" moves each row's visible keys to the front, in position order
        order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices  # [num_new, keys]
        row = s.key_slots[order]
        row = torch.where(torch.arange(keys, device=row.device) < mask.sum(1, keepdim=True), row, row[:, :1])
        slots.append(F.pad(row, (0, width - keys), value=0) if width > keys else row)
        lens.append(mask.sum(1))
    slots_t = torch.cat(slots)
    lens_t = torch.cat(lens)
    pad = torch.arange(width, device=slots_t.device)[None, :] >= lens_t[:, None]
    return torch.where(pad, slots_t[:, :1], slots_t), lens_t


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan, scale: float,
              backend=None) -> torch.Tensor:
    """Paged attention (semantics of :func:`specdec.attention.paged_attention`), each row reduced on its own."""
    if backend is not None and backend.triton:
        slots, lens = plan.invariant_rows
        return backend.invariant.attention(q, k_cache, v_cache, slots, lens, scale)
    out = torch.empty_like(q)
    for keys, rows in plan.invariant_row_keys:  # per row: its key slots, in position order
        for row, row_slots in zip(rows, keys, strict=True):
            ks = k_cache.index_select(0, row_slots).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, keys, dim]
            vs = v_cache.index_select(0, row_slots).transpose(0, 1).unsqueeze(0)
            out[row] = _row_attention(q[row], ks, vs, scale)
    return out


def _row_attention(q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row q [heads, dim] over its keys ks / vs [1, kv_heads, keys, dim]: SDPA in float32; in half
    precision the same maths upcast to float32 by hand (on CPU several times faster than half SDPA)."""
    heads, dim = q.shape
    if q.dtype == torch.float32:
        o = F.scaled_dot_product_attention(q[None, :, None, :], ks, vs, scale=scale, enable_gqa=True)
        return o[0, :, 0]
    kv_heads = ks.shape[1]
    qf = q.float().view(kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(qf, ks[0].float().transpose(1, 2)) * scale  # [kv_heads, group, keys]
    return torch.matmul(torch.softmax(scores, -1), vs[0].float()).view(heads, dim).to(q.dtype)
