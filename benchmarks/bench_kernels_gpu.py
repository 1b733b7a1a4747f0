"""Tree-attention kernel sweep on a GPU: time, KV-read bandwidth vs copy bandwidth, and speed vs SDPA.

    python benchmarks/bench_kernels_gpu.py                  # the full sweep of the kernel goals (docs/gpu/kernels.md)
    python benchmarks/bench_kernels_gpu.py --quick              # a few points
    python benchmarks/bench_kernels_gpu.py --batch 1 --context 8192 --tree 1,16 --json out.json

Per point (batch x context x tree size x page size x head shape, bf16 by default):

* ``tri_us``: the Triton kernel over a paged cache with SHUFFLED block tables (``do_bench`` median,
  L2 flushed; ``--graph``: CUDA-graph replays);
  ``contig``: the same over a contiguous block table, as a ratio shuffled / contiguous;
* ``GB/s`` and ``%copy``: bytes of K/V read (batch x (context + tree) x kv_heads x head_dim x 2 x
  dtype size) per second, against a device-to-device copy measured in the same run
  ((read + write bytes) / time);
* ``sdpa_us`` / ``speedup``: ``scaled_dot_product_attention`` on the gathered (contiguous) cache
  with a dense bool mask for trees (no mask for decode);
* ``causal``: the kernel with a causal block of the same size instead of the tree mask (ratio
  tree / causal: the cost of the ancestor mask);
* ``vs_decode``: time of this tree size / time of a 1-token decode at the same batch, context, page;
* ``err``: max abs difference to SDPA (bf16: ~1e-2 expected).

A tree of size t is t query tokens: the root plus t - 1 nodes of a random tree. All sequences of
a batch have the same context (so SDPA runs as one batched call). Refuses to run without CUDA.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_overwrite, check_new_files  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402

SHAPES = {"llama8b": (32, 8, 128), "embedded": (9, 3, 64), "tiny": (4, 2, 16)}  # query heads, kv heads, head dim
DEVICE = "cuda"  # "cpu" only for --cpu-smoke (Triton interpreter, fp32, plumbing check, no meaningful times)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", default="512,2048,8192,32768")
    ap.add_argument("--tree", default="1,4,16,64", help="query tokens per sequence (root + nodes)")
    ap.add_argument("--page", default="16,64")
    ap.add_argument("--shapes", default="llama8b,embedded", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--quick", action="store_true", help="batch 1,8; context 2048,8192; tree 1,16; page 16")
    ap.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays (no launch overhead, but no L2 flush: small caches stay in L2)")
    ap.add_argument("--json", help="also write every point to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="check the script's plumbing on CPU in the Triton interpreter (tiny shape, times meaningless)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_new_files(ap, args.overwrite, args.json)
    if args.cpu_smoke:
        args.batch, args.context, args.tree, args.page, args.shapes = "2", "40", "1,5", "16", "tiny"
    if args.quick:
        args.batch, args.context, args.tree, args.page = "1,8", "2048,8192", "1,16", "16"
    for name in args.shapes.split(","):
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    for t in map(int, args.tree.split(",")):
        if not 1 <= t <= 64:
            ap.error("tree sizes must be in 1..64 (the kernel's ancestor mask is 64 bits)")
    return args


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def bench_us(fn, graph: bool) -> float:
    if DEVICE == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing as tt

    fn()  # warm-up: compiles, fills the metadata's tile cache outside any graph capture
    torch.cuda.synchronize()
    if graph:
        ms = tt.do_bench_cudagraph(fn, rep=50, return_mode="median")
    else:  # flushes L2 before every call, as the reference points were measured
        ms = tt.do_bench(fn, warmup=25, rep=100, return_mode="median")
    return ms * 1e3


def copy_bandwidth(graph: bool) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted)."""
    n = 1 << 29 if DEVICE == "cuda" else 1 << 20  # bf16 elements = 1 GiB
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), graph)
    return 2 * src.numel() * src.element_size() / (us * 1e-6)


def build_point(batch, context, tree, page, shape, dtype, shuffle, gen, masks=None):
    """Paged cache + metadata for `batch` sequences of `context` cached tokens and `tree` new tokens each."""
    from specdec.kernels.testing import random_tree_mask
    from specdec.kernels.tree_attention import TreeAttentionMetadata

    heads, kv_heads, head_dim = shape
    per_seq = -(-(context + tree) // page)
    num_blocks = batch * per_seq
    ids = torch.randperm(num_blocks, generator=gen).tolist() if shuffle else list(range(num_blocks))
    tables = [ids[b * per_seq:(b + 1) * per_seq] for b in range(batch)]
    if masks is None:
        masks = [random_tree_mask(tree - 1, gen) if tree > 1 else 1 for _ in range(batch)]
    meta = TreeAttentionMetadata.build(tables, page, [context] * batch, masks, device=DEVICE)
    k = torch.randn(num_blocks * page, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(batch * tree, heads, head_dim, device=DEVICE, dtype=dtype)
    return q, k, v, meta, tables, masks


def gathered_sdpa(q, k, v, tables, masks, batch, context, tree, page, shape):
    """SDPA inputs on the gathered cache: q [B, H, n, D], k/v [B, KVH, L, D], mask [B, 1, n, L] or None."""
    heads, kv_heads, head_dim = shape
    total = context + tree
    pos = torch.arange(total, device=DEVICE)
    slots = torch.stack([torch.tensor(t, device=DEVICE)[pos // page] * page + pos % page for t in tables])
    kg = k[slots].permute(0, 2, 1, 3).contiguous()  # [B, KVH, L, D]
    vg = v[slots].permute(0, 2, 1, 3).contiguous()
    qg = q.view(batch, tree, heads, head_dim).transpose(1, 2).contiguous()
    mask = None
    if tree > 1:
        mask = torch.ones(batch, 1, tree, total, dtype=torch.bool, device=DEVICE)
        for b, m in enumerate(masks):
            mask[b, 0, :, context:] = m.to(DEVICE)
    return qg, kg, vg, mask


def measure_point(batch, context, tree, page, shape_name, dtype, gen, graph) -> dict:
    import torch.nn.functional as F
    from specdec.kernels.tree_attention import TreeAttentionMetadata, tree_attention

    shape = SHAPES[shape_name]
    heads, kv_heads, head_dim = shape
    scale = head_dim**-0.5
    q, k, v, meta, tables, masks = build_point(batch, context, tree, page, shape, dtype, True, gen)
    meta_c = build_point(batch, context, tree, page, shape, dtype, False, gen, masks)[3]
    tri_us = bench_us(lambda: tree_attention(q, k, v, meta, scale), graph)
    contig_us = bench_us(lambda: tree_attention(q, k, v, meta_c, scale), graph)
    causal_us = None
    if tree > 1:
        meta_causal = TreeAttentionMetadata.build(tables, page, [context] * batch, [tree] * batch, device=DEVICE)
        causal_us = bench_us(lambda: tree_attention(q, k, v, meta_causal, scale), graph)
    qg, kg, vg, mask = gathered_sdpa(q, k, v, tables, masks, batch, context, tree, page, shape)

    def sdpa():
        return F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale, enable_gqa=True)

    sdpa_us = bench_us(sdpa, graph)
    ref = sdpa().transpose(1, 2).reshape(batch * tree, heads, head_dim)
    err = (tree_attention(q, k, v, meta, scale).float() - ref.float()).abs().max().item()
    kv_bytes = 2 * batch * (context + tree) * kv_heads * head_dim * q.element_size()
    return dict(shape=shape_name, batch=batch, context=context, tree=tree, page=page, triton_us=tri_us,
                contiguous_us=contig_us, sdpa_us=sdpa_us, causal_us=causal_us,
                kv_gbps=kv_bytes / (tri_us * 1e-6) / 1e9, max_abs_err=err)


def main(argv=None) -> int:
    global DEVICE
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_kernels_gpu.py needs a CUDA GPU (none found); the kernels are tested on CPU by "
              "tests/test_kernels_*.py in the Triton interpreter.", file=sys.stderr)
        return 2
    torch.set_grad_enabled(False)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.cpu_smoke:
        dtype = torch.float32
    gen = torch.Generator().manual_seed(args.seed)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)"
    copy_bps = copy_bandwidth(args.graph)
    timing = "CUDA graph" if args.graph else "do_bench"
    print(f"# {gpu}, {datetime.date.today()}, torch {torch.__version__}, {args.dtype}, "
          f"copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + write), timing: {timing}")
    print(f"{'shape':>9} {'B':>3} {'ctx':>6} {'tree':>4} {'page':>4} {'tri_us':>9} {'GB/s':>7} {'%copy':>6} "
          f"{'contig':>6} {'sdpa_us':>9} {'speedup':>7} {'causal':>6} {'vs_decode':>9} {'err':>8}")
    rows = []
    nan = float("nan")
    for shape_name in args.shapes.split(","):
        for batch in ints(args.batch):
            for context in ints(args.context):
                for page in ints(args.page):
                    decode_us = None
                    for tree in sorted(ints(args.tree)):
                        row = measure_point(batch, context, tree, page, shape_name, dtype, gen, args.graph)
                        if DEVICE == "cuda":
                            torch.cuda.empty_cache()
                        if tree == 1:
                            decode_us = row["triton_us"]
                        row.update(gpu=gpu, copy_fraction=row["kv_gbps"] * 1e9 / copy_bps,
                                   vs_decode=row["triton_us"] / decode_us if decode_us else None)
                        rows.append(row)
                        t = row["triton_us"]
                        print(f"{shape_name:>9} {batch:>3} {context:>6} {tree:>4} {page:>4} {t:9.1f} "
                              f"{row['kv_gbps']:7.0f} {100 * row['copy_fraction']:5.0f}% "
                              f"{t / row['contiguous_us']:6.2f} {row['sdpa_us']:9.1f} {row['sdpa_us'] / t:6.2f}x "
                              f"{t / row['causal_us'] if row['causal_us'] else nan:6.2f} "
                              f"{row['vs_decode'] or nan:9.2f} {row['max_abs_err']:8.1e}", flush=True)
    if args.json:
        write_json(args.json, dict(gpu=gpu, date=str(datetime.date.today()), copy_bytes_per_s=copy_bps,
                                   dtype=args.dtype, timing="cuda_graph" if args.graph else "do_bench", points=rows),
                   indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
