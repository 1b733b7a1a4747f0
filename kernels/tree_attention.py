"""Tree attention over the paged KV cache: one Triton kernel family for prefill, decode and tree verify.

Semantics are those of :func:`specdec.attention.paged_attention` (the PyTorch reference):
query token ``i`` of a sequence attends to every key visible to the whole sequence (its
committed tokens, read through the block table) plus the keys of this forward that its mask
row selects. Per sequence the kernel sees::

    keys [0, ctx_len)                          visible to every query (no mask work)
    keys [ctx_len, ctx_len + num_masked)       causal (key j <= query i) or, in tree mode,
                                               bit j of the query's 64-bit ancestor mask

Use :func:`paged_tree_attention` with the engine's :class:`~specdec.attention.AttentionPlan`
(what ``paged_attention`` dispatches to on CUDA), or :func:`tree_attention` with a
:class:`TreeAttentionMetadata` built from real block tables (tests, benchmarks).

Grid ``(query tiles, kv heads, splits)``. A query tile is up to ``BLOCK_Q`` new tokens of ONE
sequence times the ``GROUP`` query heads sharing a KV head, packed into the M rows of the
tile, so each K/V tile is loaded once per group. With split-KV, programs ``0..S-1`` each take
one chunk of the unmasked prefix and program ``S`` takes the masked keys; each writes a
normalised partial output and its log-sum-exp. A small tile's parts (a decode's, a short chain's)
are merged by the last of its programs to finish (an atomic count per tile and KV head, reset by
it): no second launch; a large tile's by :func:`_merge_kernel`, over every row and head at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import triton
import triton.language as tl
from specdec.kernels.dispatch import BackendError
from specdec.kernels.host_ints import cdiv, next_power_of_2

from specdec.errors import InputError
from specdec.host_copy import to_device
from specdec.tree import MAX_TREE_NODES

LOG2E = 1.4426950408889634
MIN_SPLIT_CHUNK = 256  # keys per split program below which splitting does not pay
MERGE_SEQS = 16  # sequences the merge reads at a time (finding a row's sequence; one kernel for every batch size)
# a split launch whose tiles have at most this many elements (rows x BLOCK_D) merges its parts itself: one program
# per tile reads them all, meant to cost less than a second launch for a decode's or a short chain's tile (16 or 32
# rows; untimed: bench_speed_gpu.py times plain decoding both ways), not a 65-token tree's 128 rows over 33 parts
# (2 MB read by one program of each KV head)
MERGE_IN_KERNEL_MAX = 32 * 128
# largest head_dim the kernel takes: up to 512 its tiles compile for sm_90 without spilling registers
# (python -m specdec.kernels.compile_check); at 1024 even the smallest float32 tile spills 1.6 KB per thread
MAX_HEAD_DIM = 512
# a product and a sum contracted into one FMA, as Triton compiled these kernels by default up to 3.9 (where every GPU
# measurement of docs/gpu was made); said at each launch: Triton 3.9 warns of a launch that leaves it unsaid, and 3.10
# turns the default off
FP_FUSION = True
_BIT_WEIGHTS = torch.ones(MAX_TREE_NODES, dtype=torch.long) << torch.arange(MAX_TREE_NODES)  # bit 63 wraps: ok


@lru_cache(maxsize=8)
def _bit_weights(device: torch.device) -> torch.Tensor:  # [64] int64 on device, copied once
    return _BIT_WEIGHTS.to(device)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC: tl.constexpr):
    # s [M, N] scores in log2 units (-inf = masked), v [N, D]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay at 0
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(K, V, bt, pos, ok, kvh, d, d_ok, stride_kvt, stride_kvh, PAGE_SIZE: tl.constexpr,
                  OFF64: tl.constexpr):
    # pos [N] positions of the sequence -> slots through its block table; K and V share strides, so
    # one offset tensor serves both (int32 unless the cache has >= 2**31 elements: fewer registers)
    blk = tl.load(bt + pos // PAGE_SIZE, mask=ok, other=0)
    if OFF64:
        blk = blk.to(tl.int64)
    slot = blk * PAGE_SIZE + pos % PAGE_SIZE
    off = slot[:, None] * stride_kvt + kvh * stride_kvh + d[None, :]
    m2 = ok[:, None] & d_ok[None, :]
    k = tl.load(K + off, mask=m2, other=0.0)
    v = tl.load(V + off, mask=m2, other=0.0)
    return k, v


# integers that change with a step's keys or splits are not specialised (==1, divisible by 16): each new class
# would compile the kernel again (~1 s) in the middle of a timed run
@triton.jit(do_not_specialize=["stride_bt", "num_splits", "masked_split"])
def _tree_attn_kernel(
    Q, K, V, Out, PartO, PartLse, Arrivals,
    BlockTables, CtxLens, NumMasked, QStarts, QLens, TreeMode, QBits, TileSeq, TileQ0,
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh, stride_kvt, stride_kvh, stride_ot, stride_oh, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, num_splits, masked_split,
    SPLIT: tl.constexpr, MERGE_IN_KERNEL: tl.constexpr, DOT_PREC: tl.constexpr, OFF64: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(TileSeq + tile)
    q0 = tl.load(TileQ0 + tile)  # first token of this tile, relative to the sequence
    ctx_len = tl.load(CtxLens + seq)
    num_masked = tl.load(NumMasked + seq)
    q_start = tl.load(QStarts + seq)
    q_len = tl.load(QLens + seq)
    tree = tl.load(TreeMode + seq)
    # a tile past its sequence's tokens (static CUDA-graph buckets pad sequences) reads no keys
    ctx_len = tl.where(q0 < q_len, ctx_len, 0)
    num_masked = tl.where(q0 < q_len, num_masked, 0)
    bt = BlockTables + seq.to(tl.int64) * stride_bt

    rows = tl.arange(0, BLOCK_M)
    tok = q0 + rows // GROUP_PAD  # [M] query token (within the sequence) of each row
    g = rows % GROUP_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g  # query heads kvh*GROUP .. +GROUP-1 share KV head kvh
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    t_idx = (q_start + tok).to(tl.int64)
    q = tl.load(Q + t_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # ---- unmasked prefix: this split's chunk of [0, ctx_len) ------------------------------------
    # at least MIN_CHUNK keys a chunk: a short context over a bucket's many splits fills a few, the rest write nothing
    chunk = tl.maximum(tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    lo = split * chunk  # the masked program (split == num_splits) gets lo >= ctx_len: no prefix
    hi = tl.minimum(lo + chunk, ctx_len)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        k, v = _load_kv_tile(K, V, bt, pos, ok, kvh, d, d_ok, stride_kvt, stride_kvh, PAGE_SIZE, OFF64)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    # ---- masked keys of this forward: causal or ancestor bits -----------------------------------
    if split == masked_split:  # num_splits with split-KV, else 0 (the only program)
        bits = tl.load(QBits + t_idx, mask=row_ok, other=0)  # [M] int64
        # causal: no key past the tile's last token; tree: parents precede children, but masks are
        # free-form bits, so all masked keys are scanned (at most 64)
        last = tl.minimum(q0 + BLOCK_Q, q_len)
        j_end = tl.where(tree != 0, num_masked, tl.minimum(num_masked, last))
        for j0 in range(0, j_end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            ok = j < j_end
            k, v = _load_kv_tile(K, V, bt, ctx_len + j, ok, kvh, d, d_ok, stride_kvt, stride_kvh, PAGE_SIZE, OFF64)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
            jb = tl.minimum(j, 63).to(tl.int64)
            vis_tree = ((bits[:, None] >> jb[None, :]) & 1) != 0
            vis_causal = j[None, :] <= tok[:, None]
            vis = tl.where(tree != 0, vis_tree, vis_causal) & ok[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, DOT_PREC)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    m2 = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 units
        # a chunk without keys stores its lse (-inf) only: no merge reads its output (weight 0, or past with_keys)
        if (hi > lo) | (split == masked_split):
            tl.store(PartO + split * stride_ps + t_idx[:, None] * stride_pt + head[:, None] * stride_ph
                     + d[None, :], out, mask=m2)
        tl.store(PartLse + split * stride_ls + t_idx * stride_lt + head, lse, mask=row_ok)
        if MERGE_IN_KERNEL:
            # the last of the tile's num_splits + 1 programs to arrive merges the parts: each thread's stores are
            # issued (barrier) before the count is raised, with release; the last one's acquire orders its reads
            # after them, and those reads bypass L1 (.cg), where another launch's parts may still be cached
            tl.debug_barrier()
            arrivals = Arrivals + tile * tl.num_programs(1) + kvh
            if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_splits:
                tl.store(arrivals, 0)  # zero again for the next launch (the next layer, a graph's replay)
                # only the prefix chunks that hold keys (a graph bucket splits for its capacity), then the masked part
                with_keys = tl.where(chunk > 0, tl.cdiv(ctx_len, tl.maximum(chunk, 1)), 0)
                _merge_parts(PartO, PartLse, Out, t_idx, head, row_ok, with_keys, num_splits, stride_ps, stride_pt,
                             stride_ph, stride_ls, stride_lt, stride_ot, stride_oh, BLOCK_M, HEAD_DIM, BLOCK_D)
    else:
        tl.store(Out + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=m2)


@triton.jit
def _merge_parts(PartO, PartLse, Out, t_idx, head, row_ok, with_keys, masked_part, stride_ps, stride_pt, stride_ph,
                 stride_ls, stride_lt, stride_ot, stride_oh, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    # parts 0 .. with_keys - 1 and masked_part, merged by an online softmax over them (every real row of every part
    # was written: an empty one as 0 with lse -inf, weighing nothing). UNROLL parts are read at once, so a program
    # waits for memory once per UNROLL parts, not per part; offsets within a part are int32 (a split step's T * H * D
    # is far below 2**31: few tiles split), the part's own start a scalar, and wide heads are merged 128 columns at a
    # time: [M, D] 64-bit pointers next to the accumulator, or a whole head_dim 512 row, spilled registers on sm_90
    MERGE_D: tl.constexpr = BLOCK_D if BLOCK_D < 128 else 128
    UNROLL: tl.constexpr = 4 if BLOCK_M * MERGE_D <= 2048 else 2 if BLOCK_M * MERGE_D <= 4096 else 1
    lse_rows = (t_idx * stride_lt + head).to(tl.int32)  # [M]
    o_rows = (t_idx * stride_pt + head * stride_ph).to(tl.int32)  # [M]
    n = with_keys + 1
    for c0 in tl.static_range(0, BLOCK_D, MERGE_D):
        d = c0 + tl.arange(0, MERGE_D)
        d_ok = d < HEAD_DIM
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, MERGE_D], tl.float32)
        for i0 in range(0, n, UNROLL):
            for u in tl.static_range(UNROLL):
                i = i0 + u
                p = tl.where(i == with_keys, masked_part, i)
                # [M]: a boolean scalar & the row mask came out int32 in the Triton interpreter
                rows_ok = row_ok & (tl.zeros([BLOCK_M], tl.int32) + i < n)
                lse = tl.load(PartLse + p * stride_ls + lse_rows, mask=rows_ok, other=float("-inf"),
                              cache_modifier=".cg")
                o = tl.load(PartO + p * stride_ps + o_rows[:, None] + d[None, :],
                            mask=rows_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_i, lse)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_use)
                w = tl.exp2(lse - m_use)
                acc = acc * alpha[:, None] + o * w[:, None]
                den = den * alpha + w
                m_i = m_new
        out = acc / tl.where(den > 0.0, den, 1.0)[:, None]
        tl.store(Out + t_idx[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# the number of parts is a runtime value: an eager step's split count grows with its context (one more every
# MIN_SPLIT_CHUNK keys), and as a constexpr each count compiled a kernel of its own; BLOCK_S (a power of two) only;
# likewise the batch's sequences, read MERGE_SEQS at a time
@triton.jit(do_not_specialize=["num_parts", "num_seqs"])
def _merge_kernel(PartO, PartLse, Out, QStarts, QLens, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                  stride_ot, stride_oh, num_parts, num_seqs, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    # a padding row of a CUDA-graph bucket (in no sequence's q_starts .. + q_lens) has no part the attention kernel
    # wrote: none is read, and it gets zeros (no fill of its parts per layer)
    covered = 0  # 1 for a real row, else 0
    for b0 in range(0, num_seqs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        b_ok = b < num_seqs
        q_start = tl.load(QStarts + b, mask=b_ok, other=0)
        q_len = tl.load(QLens + b, mask=b_ok, other=0)
        covered += tl.sum(((t >= q_start) & (t < q_start + q_len)).to(tl.int32), 0)
    sidx = tl.arange(0, BLOCK_S)
    s_ok = sidx < tl.where(covered > 0, num_parts, 0)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(PartLse + sidx * stride_ls + t * stride_lt + h, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # [S], 0 for empty parts
    used = w > 0.0
    o = tl.load(PartO + sidx[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                mask=(s_ok & used)[:, None] & d_ok[None, :], other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(den > 0.0, den, 1.0)
    tl.store(Out + t * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def _mask_bits(mask: torch.Tensor, seq: int) -> tuple[int, int, torch.Tensor]:
    """(lead, tree_mode, bits [n] int64) for an [n, m] bool mask of a sequence's n queries over its last m keys.

    ``lead`` columns join the unmasked prefix (every query sees them), the ``m - lead`` after them are the
    masked keys. Up to 64 columns: tree mode, no host sync. Wider: a lower-triangular mask over exactly the new
    tokens stays causal; otherwise the leading columns visible to every query also join the prefix (the
    root of a 64-node tree, a model drafter's committed keys) and the rest must fit in 64 bits. These
    checks sync with the device, only for such wide masks.
    """
    n, m = mask.shape
    weights = _bit_weights(mask.device)
    if m <= MAX_TREE_NODES:
        return 0, 1, (mask.long() * weights[:m]).sum(-1)
    host = mask.cpu()
    if m == n and torch.equal(host, torch.ones(n, n, dtype=torch.bool).tril()):
        return 0, 0, torch.zeros(n, dtype=torch.long, device=mask.device)
    lead = 0
    all_cols = host.all(0).tolist()
    while lead < m and all_cols[lead]:
        lead += 1
    if m - lead > MAX_TREE_NODES:
        raise ValueError(
            f"sequence {seq}: a non-causal mask needs <= {MAX_TREE_NODES} key columns after the leading ones "
            f"visible to every query (it has {m - lead} of {m}); the tree kernel's ancestor mask is 64 bits"
        )
    return lead, 1, (mask[:, lead:].long() * weights[: m - lead]).sum(-1)


# ---- metadata --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeAttentionMetadata:
    """Per-forward kernel inputs, shared by every layer. Build with :meth:`build` or :meth:`from_plan`."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    page_size: int
    ctx_lens: torch.Tensor  # [B] int32 keys visible to all queries of the sequence
    num_masked: torch.Tensor  # [B] int32 keys after ctx_len under the causal / tree mask
    q_starts: torch.Tensor  # [B] int32 first row of the sequence in q
    q_lens: torch.Tensor  # [B] int32
    tree_mode: torch.Tensor  # [B] int32: 1 = ancestor bits, 0 = causal
    q_bits: torch.Tensor  # [T] int64 ancestor bitmask of each query (tree mode)
    host_q_lens: tuple[int, ...]
    max_ctx_len: int  # upper bound, host side (split heuristic)
    _tiles: dict = field(default_factory=dict, compare=False, repr=False)
    _arrivals: dict = field(default_factory=dict, compare=False, repr=False)
    _launches: dict = field(default_factory=dict, compare=False, repr=False)  # _LaunchPlan per layer shape

    @property
    def num_tokens(self) -> int:
        return sum(self.host_q_lens)

    def tiles(self, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:  # ([tiles] seq, [tiles] first token)
        if block_q not in self._tiles:
            seq, q0 = [], []
            for b, n in enumerate(self.host_q_lens):
                for t in range(0, n, block_q):
                    seq.append(b)
                    q0.append(t)
            dev = self.q_lens.device
            self._tiles[block_q] = (to_device(seq, torch.int32, dev), to_device(q0, torch.int32, dev))
        return self._tiles[block_q]

    def arrivals(self, programs: int) -> torch.Tensor:  # [programs] int32, zero between launches
        """A split launch's count of finished parts per (tile, KV head); its last program sets it back to 0, so
        every layer of the forward (every replay of a CUDA graph) reuses the one made at the first."""
        if programs not in self._arrivals:
            self._arrivals[programs] = torch.zeros(programs, dtype=torch.int32, device=self.q_lens.device)
        return self._arrivals[programs]

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        page_size: int,
        cache_lens: list[int],  # committed keys per sequence (the new tokens follow them in the table)
        new_masks: list[torch.Tensor | int],  # per sequence: [n, n] bool tree mask, or n = causal run of n
        device: torch.device | str = "cpu",
    ) -> "TreeAttentionMetadata":
        """From real block tables (tests, benchmarks). The new tokens' K/V sit at positions
        ``cache_len .. cache_len + n - 1`` of each table; a tree mask has at most 64 rows."""
        if not (len(block_tables) == len(cache_lens) == len(new_masks)):
            raise ValueError("block_tables, cache_lens and new_masks need one entry per sequence")
        ctx, nm, qs, ql, tree, bits = [], [], [], [], [], []
        start = 0
        for b, (table, c, m) in enumerate(zip(block_tables, cache_lens, new_masks, strict=True)):
            n = m if isinstance(m, int) else int(m.shape[0])
            if n < 1:
                raise ValueError(f"sequence {b} has no new tokens")
            if (c + n) > len(table) * page_size:
                raise ValueError(f"sequence {b}: {c + n} keys but its block table covers {len(table) * page_size}")
            if not isinstance(m, int) and tuple(m.shape) != (n, n):
                raise ValueError(f"sequence {b}: the new-token mask must be square, got {tuple(m.shape)}")
            lead, mode, b_bits = (0, 0, torch.zeros(n, dtype=torch.long)) if isinstance(m, int) else _mask_bits(m, b)
            tree.append(mode)
            bits.append(b_bits.cpu())
            ctx.append(c + lead)
            nm.append(n - lead)
            qs.append(start)
            ql.append(n)
            start += n
        width = max(len(t) for t in block_tables)
        bt = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for b, t in enumerate(block_tables):
            bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32)

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        return cls(bt.to(device), page_size, i32(ctx), i32(nm), i32(qs), i32(ql), i32(tree),
                   torch.cat(bits).to(device), tuple(ql), max(ctx))

    @classmethod
    def from_plan(cls, plan) -> "TreeAttentionMetadata":
        """From an AttentionPlan, as it is: its key_slots become a page-size-1 block table (one slot per
        position), ``num_visible`` the unmasked prefix, ``ancestor_bits`` the tree-mode bits (None: causal).
        No host sync: nothing is read back from the device."""
        seqs = plan.seqs
        device = plan.write_slots.device
        # one pad and one cast for the batch, not one launch per sequence (this runs every step)
        slot_rows = torch.nn.utils.rnn.pad_sequence([s.key_slots for s in seqs], batch_first=True).to(torch.int32)
        if all(s.ancestor_bits is None for s in seqs):  # causal everywhere (plain decoding, prefill)
            bits = [torch.zeros(sum(s.num_new for s in seqs), dtype=torch.long, device=device)]
        else:
            bits = [torch.zeros(s.num_new, dtype=torch.long, device=device) if s.ancestor_bits is None
                    else to_device(s.ancestor_bits, torch.long, device) for s in seqs]

        def i32(x):
            return to_device(x, torch.int32, device)

        return cls(slot_rows, 1, i32([s.num_visible for s in seqs]), i32([s.num_masked for s in seqs]),
                   i32([s.query_start for s in seqs]), i32([s.num_new for s in seqs]),
                   i32([int(s.ancestor_bits is not None) for s in seqs]), torch.cat(bits),
                   tuple(s.num_new for s in seqs), max(s.num_visible for s in seqs))


# ---- launch ----------------------------------------------------------------------------------------
def _default_splits(meta: TreeAttentionMetadata, programs: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = cdiv(2 * sms, max(programs, 1))
    return max(1, min(want, meta.max_ctx_len // MIN_SPLIT_CHUNK, 64))


def min_split_chunk(block_m: int, element_size: int) -> int:
    """Fewest keys a split program takes: each writes a float32 partial of its tile (``block_m`` rows x head_dim)
    that the merge reads back, so its chunk reads at least as many bytes of K and V (2 x keys x head_dim elements).
    A decode's or a chain's tile (16-32 rows) splits as finely as before; a large tree's 128-row tiles over a short
    context fill a few parts, not every one of a CUDA-graph bucket's splits (sized for its key capacity)."""
    return cdiv(block_m * 4, 2 * element_size)


def launch_config(group: int, head_dim: int, max_new: int, dtype: torch.dtype, gpu: bool = True) -> dict:
    """Tile shape of the attention kernel (constexprs + num_warps). BLOCK_M = BLOCK_Q * GROUP_PAD rows in
    [16, 128], covering the largest per-sequence token count when it can; BLOCK_N 32 for head_dim 128
    keeps a decode tile at ~184 registers on sm_90 (64 needs 255), see ``python -m specdec.kernels.compile_check``.
    float32 on a GPU (``gpu``) takes tiles of at most 32 x 16, 32-row ones on 8 warps: 64-row tiles spilled
    registers on sm_90 at every published shape (up to 9 KB of stack per thread); the Triton interpreter keeps the
    larger tiles, which it runs faster."""
    group_pad = next_power_of_2(group)
    fp32_gpu = dtype == torch.float32 and gpu
    block_d = max(16, next_power_of_2(head_dim))
    # 16-bit tiles of 64 rows over head_dim 512 spilled up to 1.7 KB of registers per thread on sm_90
    max_m = 32 if fp32_gpu or block_d > 256 else 64 if dtype == torch.float32 else 128
    block_q = max(max(1, 16 // group_pad), min(next_power_of_2(max_new), max(1, max_m // group_pad)))
    block_m = block_q * group_pad
    if fp32_gpu:
        block_n, num_warps = 16, 8 if block_m >= 32 else 4
    else:
        block_n, num_warps = 32 if block_d >= 128 else 64, 8 if block_m * block_d >= 64 * 128 else 4
    return dict(
        HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=block_d, DOT_PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=num_warps,
    )


def check_head_dim(head_dim: int) -> None:
    """InputError for a head_dim the kernel does not take (above MAX_HEAD_DIM), naming the way out."""
    if head_dim > MAX_HEAD_DIM:
        raise InputError(f"head_dim {head_dim} exceeds the Triton tree-attention kernel's limit of {MAX_HEAD_DIM}; "
                         f"use the reference backend (backend='reference' or SPECDEC_ATTENTION=reference)")


def _interpreted() -> bool:
    """Whether the kernels run in the Triton interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_tree_attn_kernel, InterpretedFunction)


def _partials(parts: int, T: int, H: int, D: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised split partials: outputs [parts, T, H, D] and log-sum-exps [parts, T, H], float32."""
    return (torch.empty(parts, T, H, D, dtype=torch.float32, device=device),
            torch.empty(parts, T, H, dtype=torch.float32, device=device))


@dataclass(frozen=True)
class _LaunchPlan:
    """What a tree-attention launch takes beyond its tensors, the same for every layer of a forward (one metadata,
    one layer shape): worked out at the first layer's call and kept on the metadata."""

    cfg: dict  # launch_config's constexprs (num_warps apart)
    num_warps: int
    tile_seq: torch.Tensor  # [tiles] int32
    tile_q0: torch.Tensor  # [tiles] int32
    num_splits: int
    split: bool
    parts: int  # partial results per row: num_splits + 1 when split (the masked keys' own), else 1
    merge_in_kernel: bool
    min_chunk: int
    placeholders: tuple[torch.Tensor, torch.Tensor] | None  # an unsplit launch's unused partials (valid strides)


def _launch_plan(meta: TreeAttentionMetadata, H: int, KVH: int, D: int, q: torch.Tensor, num_splits: int | None,
                 block_n: int | None) -> _LaunchPlan:
    check_head_dim(D)
    if q.dtype == torch.bfloat16 and not q.is_cuda and _interpreted():
        raise BackendError("bfloat16 attention cannot run in the Triton interpreter (its bf16 dot products come out "
                           "wrong): use float32 or float16 there, or the reference backend")
    cfg = launch_config(H // KVH, D, max(meta.host_q_lens), q.dtype, q.is_cuda)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    num_warps = cfg.pop("num_warps")
    tile_seq, tile_q0 = meta.tiles(cfg["BLOCK_Q"])
    if num_splits is None:
        num_splits = _default_splits(meta, tile_seq.numel() * KVH, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split = num_splits > 1
    T = meta.num_tokens
    # a real row's every part is written by the kernel (a padding row's none: the merge kernel reads it so); the
    # in-kernel merge's offsets within a part are int32
    merge_in_kernel = (split and cfg["BLOCK_Q"] * cfg["GROUP_PAD"] * cfg["BLOCK_D"] <= MERGE_IN_KERNEL_MAX
                       and T * H * D < 2**31)
    return _LaunchPlan(cfg, num_warps, tile_seq, tile_q0, num_splits, split, num_splits + 1 if split else 1,
                       merge_in_kernel, min_split_chunk(cfg["BLOCK_Q"] * cfg["GROUP_PAD"], q.element_size()),
                       None if split else _partials(1, 1, 1, 1, q.device))


def tree_attention(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_slots, KVH, D]
    v_cache: torch.Tensor,
    meta: TreeAttentionMetadata,
    scale: float,
    num_splits: int | None = None,  # prefix chunks per (tile, kv head); None = heuristic (1 off GPU)
    block_n: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    if T != meta.num_tokens:
        raise ValueError(f"q has {T} tokens but the metadata describes {meta.num_tokens}")
    if H % KVH or k_cache.shape != v_cache.shape or k_cache.shape[2] != D:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("q, k_cache and v_cache need a contiguous last (head_dim) dimension, and k_cache and "
                         "v_cache the same strides")
    key = (H, KVH, D, q.dtype, q.device, num_splits, block_n)
    launch = meta._launches.get(key)
    if launch is None:  # the forward's first layer: every other layer launches alike
        launch = meta._launches[key] = _launch_plan(meta, H, KVH, D, q, num_splits, block_n)
    cfg, split, parts, n_tiles = launch.cfg, launch.split, launch.parts, launch.tile_seq.numel()
    out = torch.empty_like(q)
    # unused placeholders with valid strides when not split
    part_o, part_lse = _partials(parts, T, H, D, q.device) if split else launch.placeholders
    arrivals = meta.arrivals(n_tiles * KVH) if launch.merge_in_kernel else part_lse
    _tree_attn_kernel[(n_tiles, KVH, parts)](
        q, k_cache, v_cache, out, part_o, part_lse, arrivals,
        meta.block_tables, meta.ctx_lens, meta.num_masked, meta.q_starts, meta.q_lens, meta.tree_mode,
        meta.q_bits, launch.tile_seq, launch.tile_q0,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1), meta.block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        PAGE_SIZE=meta.page_size, num_splits=launch.num_splits, masked_split=launch.num_splits if split else 0,
        SPLIT=split, MERGE_IN_KERNEL=launch.merge_in_kernel, OFF64=max(k_cache.numel(), v_cache.numel()) >= 2**31,
        num_warps=launch.num_warps, MIN_CHUNK=launch.min_chunk, enable_fp_fusion=FP_FUSION, **cfg,
    )
    if split and not launch.merge_in_kernel:
        num_seqs = meta.q_lens.numel()
        _merge_kernel[(T, H)](
            part_o, part_lse, out, meta.q_starts, meta.q_lens, part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            num_parts=parts, num_seqs=num_seqs, BLOCK_S=next_power_of_2(parts), BLOCK_B=MERGE_SEQS,
            HEAD_DIM=D, BLOCK_D=cfg["BLOCK_D"], enable_fp_fusion=FP_FUSION,
        )
    return out


def paged_tree_attention(q, k_cache, v_cache, plan, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """Drop-in for :func:`specdec.attention.paged_attention` (same arguments, same result)."""
    return tree_attention(q, k_cache, v_cache, plan.kernel_metadata, scale, num_splits=num_splits)
