"""KV-cache store and compaction kernels (Triton), with the semantics of :class:`specdec.kv_cache.PagedKVCache`.

* :func:`write_kv`: K and V of the new tokens of one layer into their slots, one launch
  (``PagedKVCache.write``).
* :func:`compact_kv`: after verification, move the accepted path's K/V into place for all
  layers, K and V, in ONE launch (the data movement of ``PagedKVCache.commit``).

Both treat a slot's ``num_kv_heads * head_dim`` values as one contiguous row; programs own a
column chunk of that row, so the copy is coalesced. Launched with ``enable_fp_fusion=False`` (said, as every
kernel's launch says it: a copy has no product and sum to fuse).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels import launch_rows
from specdec.kernels.host_ints import cdiv, next_power_of_2
from specdec.kernels.launch_rows import token_rows


@triton.jit(do_not_specialize=["n"])
def _write_kernel(K, V, Dst, Slots, stride_k, stride_v, stride_plane, stride_slot, n, WIDTH: tl.constexpr,
                  ROWS: tl.constexpr, BLOCK_W: tl.constexpr):
    # Dst: the layer's K plane; its V plane is stride_plane further. ROWS token rows a program (launch_rows)
    t = token_rows(ROWS)[:, None]
    cols = (tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W))[None, :]
    ok = (t < n) & (cols < WIDTH)
    slot = tl.load(Slots + t, mask=t < n, other=0).to(tl.int64)
    k = tl.load(K + t * stride_k + cols, mask=ok)
    v = tl.load(V + t * stride_v + cols, mask=ok)
    tl.store(Dst + slot * stride_slot + cols, k.to(Dst.dtype.element_ty), mask=ok)
    tl.store(Dst + stride_plane + slot * stride_slot + cols, v.to(Dst.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for any number of pairs (see tree_attention)
def _compact_kernel(KV, Src, Dst, num_pairs, stride_plane, stride_slot, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    # one program per (layer x {K, V} plane, column chunk); pairs run in list order, so a pair never
    # sees a slot overwritten by a later one -- equal to gather-then-scatter when no pair reads a slot an
    # earlier pair wrote (true for commit: reads are at offsets >= the positions written so far)
    plane = KV + tl.program_id(0).to(tl.int64) * stride_plane
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = cols < WIDTH
    for i in range(0, num_pairs):
        src = tl.load(Src + i).to(tl.int64)
        dst = tl.load(Dst + i).to(tl.int64)
        row = tl.load(plane + src * stride_slot + cols, mask=ok)
        tl.store(plane + dst * stride_slot + cols, row, mask=ok)


def _block_w(width: int) -> int:
    return min(1024, next_power_of_2(width))


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:  # [n, kv_heads, head_dim] -> contiguous rows
    if x.dim() != 3:
        raise ValueError(f"{name} must be [num_tokens, num_kv_heads, head_dim], got {tuple(x.shape)}")
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def write_kv(kv: torch.Tensor, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """kv [layers, 2, slots, kv_heads, head_dim] (contiguous); k, v [n, kv_heads, head_dim] -> slots [n]."""
    if not kv.is_contiguous():
        raise ValueError("the KV storage must be contiguous")
    n = slots.numel()
    if k.shape != v.shape or k.shape[0] != n or k.shape[1:] != kv.shape[3:]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match {n} slots of a "
                         f"{tuple(kv.shape[3:])} cache")
    if n == 0:
        return
    width = kv.shape[3] * kv.shape[4]
    slots = slots.to(device=kv.device, dtype=torch.int32)
    bw = _block_w(width)
    k, v, dst = _rows(k, "k"), _rows(v, "v"), kv[layer, 0]
    rows = launch_rows.rows_per_program(kv.device, n)
    _write_kernel[(cdiv(n, rows), cdiv(width, bw))](k, v, dst, slots, k.stride(0), v.stride(0), kv.stride(1),
                                                    kv.stride(2), n, WIDTH=width, ROWS=rows, BLOCK_W=bw,
                                                    enable_fp_fusion=False)


def compact_kv(kv: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """For every layer and K/V plane: ``kv[:, :, dst] = kv[:, :, src]`` (pairs applied in order, one launch)."""
    if not kv.is_contiguous() or kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be a contiguous [layers, 2, slots, kv_heads, head_dim] tensor, got "
                         f"{tuple(kv.shape)}")
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(f"src and dst slots must be 1-D of equal length, got {tuple(src_slots.shape)} and "
                         f"{tuple(dst_slots.shape)}")
    n = src_slots.numel()
    if n == 0:
        return
    width = kv.shape[3] * kv.shape[4]
    bw = _block_w(width)
    src = src_slots.to(device=kv.device, dtype=torch.int32)
    dst = dst_slots.to(device=kv.device, dtype=torch.int32)
    _compact_kernel[(kv.shape[0] * 2, cdiv(width, bw))](kv, src, dst, n, kv.stride(1), kv.stride(2),
                                                        WIDTH=width, BLOCK_W=bw, enable_fp_fusion=False)
