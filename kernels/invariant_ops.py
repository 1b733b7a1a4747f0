"""Row-invariant Triton kernels of the bit-exact mode: a row's result never depends on the other rows.

* :func:`linear`: x @ W^T (+ bias) over fixed tiles (``BLOCK_M`` x ``BLOCK_N``, K reduced in ``BLOCK_K`` steps
  in order, products of fp32-widened inputs, tf32 for half inputs where that is exact): one compiled kernel per
  (dtype, shape of W) whatever the row count, every row of a tile computed alike, no split-K. cuBLAS chooses its
  algorithm by M; this kernel does not.
* :func:`attention`: one program per (query row, head) reduces the row's visible keys (``Slots`` [T, max_keys],
  in position order, ``Lens`` [T] of them) in blocks of ``BLOCK_N`` by an online softmax in fp32, never split:
  the order of a row's reduction is fixed by how many keys it sees, which is its position + 1 whatever the tree
  or batch. Scores and the weighted sum are element-wise products reduced by ``tl.sum`` (no tensor-core tile
  whose shape follows the row count).

The PyTorch reference with the same semantics is :mod:`specdec.models.invariant_ops` (not bitwise the same:
another reduction order, each row-invariant on its own). Launched with ``enable_fp_fusion=False``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.host_ints import cdiv, next_power_of_2

LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32
ATTN_BLOCK_N = 32


@triton.jit
def _linear_kernel(X, W, Bias, Out, M, N, K, stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + rn[None, :] * stride_wn + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # half inputs widened to fp32: exact in tf32 too (bf16 / fp16 mantissas fit in its 10 bits), and the
        # interpreter has no bf16 product
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PREC)
    out = acc.to(Out.dtype.element_ty)
    if HAS_BIAS:  # as the reference: the product rounded, then the bias added and rounded
        b = tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + b[None, :]).to(Out.dtype.element_ty)
    tl.store(Out + rm[:, None] * stride_om + rn[None, :], out, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _attention_kernel(Q, K, V, Out, Slots, Lens, qk_scale, stride_qt, stride_qh, stride_kvt, stride_kvh, stride_ot,
                      stride_oh, stride_st, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + t * stride_qt + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    n_keys = tl.load(Lens + t)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j < n_keys
        slot = tl.load(Slots + t * stride_st + j, mask=ok, other=0).to(tl.int64)
        off = slot[:, None] * stride_kvt + kvh * stride_kvh + d[None, :]
        m2 = ok[:, None] & d_ok[None, :]
        k = tl.load(K + off, mask=m2, other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], 1) * qk_scale, float("-inf"))  # [BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(s, 0))  # finite from the first block on: every row sees a key
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(V + off, mask=m2, other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(Out + t * stride_ot + h * stride_oh + d, (acc / l_i).to(Out.dtype.element_ty), mask=d_ok)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T (+ bias [out]), every row by the same fixed-tile program."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    x, weight = x.contiguous(), weight.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        _linear_kernel[(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))](
            x, weight, bias if bias is not None else weight, out, M, N, K, x.stride(0), weight.stride(0),
            out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", enable_fp_fusion=False,
        )
    return out


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D]; k_cache / v_cache [num_slots, KVH, D]; slots [T, max_keys] (row t's keys in position order,
    the first ``lens[t]`` of them); returns [T, H, D]."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    if H % KVH or k_cache.stride() != v_cache.stride() or q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("attention: q heads must be a multiple of the KV heads, K and V share strides, "
                         "head_dim contiguous")
    if slots.shape[0] != T or lens.shape != (T,):
        raise ValueError(f"attention: slots {tuple(slots.shape)} / lens {tuple(lens.shape)} do not cover {T} rows")
    if slots.stride(-1) != 1:  # a row stride of 0 (one row read by every query: row_key_slots) is kept
        slots = slots.contiguous()
    out = torch.empty_like(q)
    if T:
        _attention_kernel[(T, H)](
            q, k_cache, v_cache, out, slots, lens, scale * LOG2E, q.stride(0), q.stride(1), k_cache.stride(0),
            k_cache.stride(1), out.stride(0), out.stride(1), slots.stride(0), GROUP=H // KVH, HEAD_DIM=D,
            BLOCK_N=ATTN_BLOCK_N, BLOCK_D=max(16, next_power_of_2(D)), enable_fp_fusion=False,
        )
    return out
