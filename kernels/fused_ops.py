"""Fused element-wise kernels of the model forward on the GPU path: fewer, larger launches.

A decode forward of a small model is launch-bound on a GPU (docs/gpu/kernels.md). These replace
chains of small PyTorch ops in ``specdec/models/llama.py`` when the Triton backend is on:

* :func:`add_rms_norm`: ``h += delta`` (the residual add, in place) and ``RMSNorm(h) * weight``;
  one launch instead of ~7;
* :func:`rope_`: rotary embedding of q and k in place; one launch instead of ~10;
* :func:`rope_write_`: the same over a fused QKV product's q and k, and the rotated k and v stored into the
  KV cache's slots (as ``kv_write.write_kv``); one launch instead of two (with Qwen3's per-head q / k RMSNorm
  first: instead of ~20);
* :func:`silu_mul`: ``silu(gate) * up``; one launch instead of 2.

Each rounds where the PyTorch reference rounds (every op's result to the activation dtype;
the norm's statistics in fp32), so in fp32 they agree with it to summation order and in
bf16 / fp16 to about one unit in the last place. They launch with ``enable_fp_fusion=False``:
on a GPU the compiler otherwise contracts a product and a sum into one FMA, skipping the
product's rounding, and bf16 / fp16 results part from PyTorch's. Rows are token rows of contiguous
``[num_tokens, ...]`` tensors: one a program on a GPU, a block of them in the interpreter, fewer the wider the row
(:func:`.launch_rows.block_rows`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels import launch_rows
from specdec.kernels.host_ints import cdiv, next_power_of_2
from specdec.kernels.launch_rows import token_rows


@triton.jit(do_not_specialize=["T"])
def _add_rms_norm_kernel(H, Delta, W, Out, stride_h, stride_d, stride_o, T, N, eps, HAS_DELTA: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = token_rows(ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    ok = (rows < T) & (cols < N)
    h = tl.load(H + rows * stride_h + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(Delta + rows * stride_d + cols, mask=ok, other=0.0)
        h = (h.to(tl.float32) + d.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + rows * stride_h + cols, h, mask=ok)
    x = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1)[:, None] / N + eps)
    normed = (x * inv).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(Out + rows * stride_o + cols, (w * normed).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rope_rows(X, Cos, Sin, t, T, stride_xt, stride_xh, stride_ct, num_heads, HALF: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QW, KW, num_q_heads, q_eps, k_eps,
               HAS_NORM: tl.constexpr):
    """Token rows t [ROWS, 1, 1] (those < T) of X: their heads rotated in place, each first RMS-normed over head_dim
    with QW (the first num_q_heads heads) or KW (the others) when HAS_NORM. Returns (heads, cols, ok, a1, a2): the
    halves, stored; every block is [ROWS, BLOCK_H, BLOCK_HALF] or broadcasts to it."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    cols = tl.arange(0, BLOCK_HALF)[None, None, :]
    c_ok = (t < T) & (cols < HALF)
    ok = c_ok & (heads < num_heads)
    dt = X.dtype.element_ty
    c1 = tl.load(Cos + t * stride_ct + cols, mask=c_ok, other=0.0).to(tl.float32)
    c2 = tl.load(Cos + t * stride_ct + HALF + cols, mask=c_ok, other=0.0).to(tl.float32)
    s1 = tl.load(Sin + t * stride_ct + cols, mask=c_ok, other=0.0).to(tl.float32)
    s2 = tl.load(Sin + t * stride_ct + HALF + cols, mask=c_ok, other=0.0).to(tl.float32)
    base = X + t * stride_xt + heads * stride_xh + cols
    x1 = tl.load(base, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=ok, other=0.0).to(tl.float32)
    if HAS_NORM:  # reference rms_norm: statistics in fp32, the normed row rounded, then the weight's product rounded
        is_q = heads < num_q_heads
        eps = tl.where(is_q, q_eps, k_eps)
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=2)[:, :, None] + tl.sum(x2 * x2, axis=2)[:, :, None]) / (2 * HALF)
                            + eps)
        w_ok = cols < HALF
        w1 = tl.where(is_q, tl.load(QW + cols, mask=w_ok, other=0.0), tl.load(KW + cols, mask=w_ok, other=0.0))
        w2 = tl.where(is_q, tl.load(QW + HALF + cols, mask=w_ok, other=0.0),
                      tl.load(KW + HALF + cols, mask=w_ok, other=0.0))
        x1 = (w1.to(tl.float32) * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2.to(tl.float32) * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # reference: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum rounded
    a1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
    a2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base, a1, mask=ok)
    tl.store(base + HALF, a2, mask=ok)
    return heads, cols, ok, a1, a2


@triton.jit(do_not_specialize=["T"])
def _rope_kernel(X, Cos, Sin, stride_xt, stride_xh, stride_ct, T, num_heads, HALF: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    _rope_rows(X, Cos, Sin, token_rows(ROWS)[:, None, None], T, stride_xt, stride_xh, stride_ct, num_heads, HALF,
               BLOCK_H, BLOCK_HALF, X, X, 0, 0.0, 0.0, False)


@triton.jit(do_not_specialize=["T"])
def _rope_write_kernel(X, V, Cos, Sin, Dst, Slots, QW, KW, stride_xt, stride_xh, stride_vt, stride_ct, stride_plane,
                       stride_slot, T, num_heads, num_q_heads, kv_width, q_eps, k_eps, HALF: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_V: tl.constexpr,
                       HAS_NORM: tl.constexpr):
    # X: one token row holds num_q_heads q heads, then the k heads; Dst: the layer's K plane (V: stride_plane on)
    t = token_rows(ROWS)
    heads, cols, ok, a1, a2 = _rope_rows(X, Cos, Sin, t[:, None, None], T, stride_xt, stride_xh, stride_ct,
                                         num_heads, HALF, BLOCK_H, BLOCK_HALF, QW, KW, num_q_heads, q_eps, k_eps,
                                         HAS_NORM)
    slot = tl.load(Slots + t, mask=t < T, other=0).to(tl.int64)
    is_k = ok & (heads >= num_q_heads)
    k_dst = Dst + slot[:, None, None] * stride_slot + (heads - num_q_heads) * (2 * HALF) + cols
    tl.store(k_dst, a1.to(Dst.dtype.element_ty), mask=is_k)
    tl.store(k_dst + HALF, a2.to(Dst.dtype.element_ty), mask=is_k)
    t, slot = t[:, None], slot[:, None]  # [ROWS, 1]
    v_cols = tl.arange(0, BLOCK_V)[None, :]
    v_ok = (t < T) & (v_cols < kv_width)
    v = tl.load(V + t * stride_vt + v_cols, mask=v_ok)
    tl.store(Dst + stride_plane + slot * stride_slot + v_cols, v.to(Dst.dtype.element_ty), mask=v_ok)


@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, T, N, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = token_rows(ROWS)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    ok = (rows < T) & (cols < N)
    g = tl.load(G + rows * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + rows * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + rows * stride_o + cols, (act * u).to(Out.dtype.element_ty), mask=ok)


def _check_rows(x: torch.Tensor, name: str, dim: int) -> None:
    if x.dim() != dim or x.stride(-1) != 1:
        raise ValueError(f"{name} must be a {dim}-D tensor with a contiguous last dimension, got shape "
                         f"{tuple(x.shape)}, strides {x.stride()}")


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, N] += delta [T, N] (in place, when given); returns (h, RMSNorm(h) * weight)."""
    _check_rows(h, "h", 2)
    if delta is not None:
        _check_rows(delta, "delta", 2)
        if delta.shape != h.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    T, N = h.shape
    if weight.shape != (N,):
        raise ValueError(f"weight must be [{N}], got {tuple(weight.shape)}")
    out = torch.empty_like(h)
    if T:
        d = delta if delta is not None else h
        block = next_power_of_2(N)
        rows = launch_rows.block_rows(h.device, T, block)
        _add_rms_norm_kernel[(cdiv(T, rows),)](h, d, weight.contiguous(), out, h.stride(0), d.stride(0),
                                               out.stride(0), T, N, eps, HAS_DELTA=delta is not None,
                                               ROWS=rows, BLOCK=block, enable_fp_fusion=False)
    return h, out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, heads, D] in place; cos, sin [T, 1, D] (as ``LlamaRunner.rope``)."""
    _check_rows(x, "x", 3)
    T, heads, D = x.shape
    if D % 2 or cos.shape != (T, 1, D) or sin.shape != cos.shape:
        raise ValueError(f"x {tuple(x.shape)} needs an even head_dim and cos / sin of shape [{T}, 1, {D}], "
                         f"got {tuple(cos.shape)} / {tuple(sin.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    if T:
        block_h, block_half = next_power_of_2(heads), next_power_of_2(D // 2)
        rows = launch_rows.block_rows(x.device, T, block_h * block_half)
        _rope_kernel[(cdiv(T, rows),)](x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), T, heads,
                                       HALF=D // 2, ROWS=rows, BLOCK_H=block_h, BLOCK_HALF=block_half,
                                       enable_fp_fusion=False)
    return x


def rope_write_(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                layer: int, slots: torch.Tensor, num_q_heads: int,
                norms: tuple[torch.Tensor, torch.Tensor, float, float] | None = None) -> torch.Tensor:
    """:func:`rope_` of ``qk`` [T, q_heads + kv_heads, D] in place (the q heads, then the k heads), and the rotated
    k and ``v`` [T, kv_heads, D] stored at ``slots`` [T] of layer ``layer`` of the cache ``kv`` [layers, 2, slots,
    kv_heads, D] (``kv_write.write_kv``), in one launch. ``norms`` (q weight [D], k weight [D], q eps, k eps): each
    head RMS-normed over D first, as Qwen3's q_norm / k_norm (``llama.rms_norm``). Returns ``qk``."""
    _check_rows(qk, "qk", 3)
    T, heads, D = qk.shape
    kv_heads = heads - num_q_heads
    if D % 2 or cos.shape != (T, 1, D) or sin.shape != cos.shape:
        raise ValueError(f"qk {tuple(qk.shape)} needs an even head_dim and cos / sin of shape [{T}, 1, {D}], "
                         f"got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if not kv.is_contiguous() or kv.dim() != 5 or kv.shape[3:] != (kv_heads, D) or v.shape != (T, kv_heads, D):
        raise ValueError(f"v {tuple(v.shape)} and a contiguous cache of {kv_heads} heads x {D} (got "
                         f"{tuple(kv.shape)}) must match qk's {kv_heads} k heads")
    if slots.shape != (T,):
        raise ValueError(f"slots must be [{T}], got {tuple(slots.shape)}")
    if v.stride(2) != 1 or v.stride(1) != D:
        v = v.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    slots = slots.to(device=kv.device, dtype=torch.int32)
    if norms is not None:
        q_w, k_w, q_eps, k_eps = norms
        if q_w.shape != (D,) or k_w.shape != (D,):
            raise ValueError(f"norms: the q and k weights must be [{D}], got {tuple(q_w.shape)} / "
                             f"{tuple(k_w.shape)}")
        q_w, k_w = q_w.contiguous(), k_w.contiguous()
    else:  # placeholders the kernel never reads: qk itself, never a copy of it (a strided qk's copy is a launch)
        q_w, k_w, q_eps, k_eps = qk, qk, 0.0, 0.0
    if T:
        block_h, block_half, block_v = next_power_of_2(heads), next_power_of_2(D // 2), next_power_of_2(kv_heads * D)
        rows = launch_rows.block_rows(qk.device, T, max(block_h * block_half, block_v))
        _rope_write_kernel[(cdiv(T, rows),)](
            qk, v, cos, sin, kv[layer, 0], slots, q_w, k_w, qk.stride(0), qk.stride(1),
            v.stride(0), cos.stride(0), kv.stride(1), kv.stride(2), T, heads, num_q_heads, kv_heads * D, float(q_eps),
            float(k_eps), HALF=D // 2, ROWS=rows, BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_V=block_v,
            HAS_NORM=norms is not None, enable_fp_fusion=False)
    return qk


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, both [T, N]."""
    _check_rows(gate, "gate", 2)
    _check_rows(up, "up", 2)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    T, N = gate.shape
    out = torch.empty_like(gate)
    block = min(1024, next_power_of_2(N))
    if T:
        rows = launch_rows.block_rows(gate.device, T, block)
        _silu_mul_kernel[(cdiv(T, rows), cdiv(N, block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), T, N, ROWS=rows, BLOCK=block,
            enable_fp_fusion=False)
    return out
