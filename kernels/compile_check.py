"""Compile every kernel for a CUDA architecture WITHOUT a GPU (Triton's bundled ptxas), and report registers.

    python -m specdec.kernels.compile_check              # sm_90 (H100), the launch configs the wrappers use
    python -m specdec.kernels.compile_check --arch 80 --resources

The interpreter checks semantics but not what the GPU compiler accepts (layouts, dot shapes, register
spills); this catches those errors on a CPU-only machine. It must run with TRITON_INTERPRET unset
(interpreted kernels cannot be compiled); the test suite runs it in a subprocess.
"""
from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import tempfile

import torch

HEAD_SHAPES = {"llama8b": (4, 128), "embedded": (3, 64), "mha": (1, 128), "gqa8": (8, 128)}  # (group, head_dim)


def _types(kernel, pointers: dict[str, str], default: str = "i32") -> dict[str, str]:
    sig = {n: default for n in inspect.signature(kernel.fn).parameters}
    sig.update(pointers)
    return sig


def _compile(kernel, types: dict[str, str], consts: dict, arch: int, num_warps: int = 4):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})


def _resources(compiled) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    fields = [line.strip() for line in out.splitlines() if "REG:" in line]
    return " ".join(fields[0].split()[:2]) if fields else "?"


def _stack_bytes(resources: str) -> int:
    """The per-thread stack (register spills) in a :func:`_resources` line, 0 when it names none."""
    field = next((f for f in resources.split() if f.startswith("STACK:")), "STACK:0")
    return int(field.split(":")[1])


def configs():
    """(name, kernel, types, constexprs, num_warps) for what the wrappers launch on a GPU."""
    import triton
    from specdec.kernels import fused_ops as fo
    from specdec.kernels import kv_write as kw
    from specdec.kernels import tree_attention as ta

    out = []
    for dtype, tname in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
        shapes = HEAD_SHAPES.items() if tname == "bf16" else [("llama8b", HEAD_SHAPES["llama8b"])]
        for shape, (group, head_dim) in shapes:
            # page 16: the CUDA-graph buckets (the cache's blocks); page 1: an eager step's slot table
            for max_new, page, split in ((1, 16, True), (17, 16, False), (17, 1, False), (65, 16, True),
                                         (65, 64, True), (512, 16, False)):
                cfg = ta.launch_config(group, head_dim, max_new, dtype)
                warps = cfg.pop("num_warps")
                cfg.update(PAGE_SIZE=page, SPLIT=split, OFF64=False)
                types = _types(ta._tree_attn_kernel, dict(
                    Q=f"*{tname}", K=f"*{tname}", V=f"*{tname}", Out=f"*{tname}", PartO="*fp32", PartLse="*fp32",
                    BlockTables="*i32", CtxLens="*i32", NumMasked="*i32", QStarts="*i32", QLens="*i32",
                    TreeMode="*i32", QBits="*i64", TileSeq="*i32", TileQ0="*i32", qk_scale="fp32"))
                out.append((f"attn {tname} {shape} new={max_new} page={page} split={split}", ta._tree_attn_kernel,
                            types, cfg, warps))
    out.append(("merge", ta._merge_kernel, _types(ta._merge_kernel, dict(PartO="*fp32", PartLse="*fp32", Out="*bf16")),
                dict(NUM_PARTS=9, BLOCK_S=16, HEAD_DIM=128, BLOCK_D=128), 4))
    out.append(("kv write", kw._write_kernel, _types(kw._write_kernel, dict(K="*bf16", V="*bf16", Dst="*bf16",
                                                                           Slots="*i32")),
                dict(WIDTH=1024, BLOCK_W=1024), 4))
    out.append(("compact", kw._compact_kernel, _types(kw._compact_kernel, dict(KV="*bf16", Src="*i32", Dst="*i32")),
                dict(WIDTH=192, BLOCK_W=256), 4))
    for hidden, heads, head_dim, width, kv_heads in ((576, 9, 64, 1536, 3), (4096, 32, 128, 14336, 8)):  # embedded, 8B
        out.append((f"add+rmsnorm {hidden}", fo._add_rms_norm_kernel,
                    _types(fo._add_rms_norm_kernel, dict(H="*bf16", Delta="*bf16", W="*bf16", Out="*bf16",
                                                         eps="fp32")),
                    dict(HAS_DELTA=True, BLOCK=triton.next_power_of_2(hidden)), 4))
        out.append((f"rope {heads}x{head_dim}", fo._rope_kernel,
                    _types(fo._rope_kernel, dict(X="*bf16", Cos="*bf16", Sin="*bf16")),
                    dict(HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads), BLOCK_HALF=head_dim // 2), 4))
        out.append((f"rope+kv write {heads}+{kv_heads}x{head_dim}", fo._rope_write_kernel,
                    _types(fo._rope_write_kernel, dict(X="*bf16", V="*bf16", Cos="*bf16", Sin="*bf16", Dst="*bf16",
                                                       Slots="*i32")),
                    dict(HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(heads + kv_heads),
                         BLOCK_HALF=head_dim // 2, BLOCK_V=triton.next_power_of_2(kv_heads * head_dim)), 4))
        out.append((f"silu*mul {width}", fo._silu_mul_kernel,
                    _types(fo._silu_mul_kernel, dict(G="*bf16", U="*bf16", Out="*bf16")), dict(BLOCK=1024), 4))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100, 80 = A100)")
    ap.add_argument("--resources", action="store_true", help="print registers / stack (spills) per kernel")
    ap.add_argument("--quick", action="store_true",
                    help="one config per kernel (three for attention: bf16 decode and tree, a float32 tree)")
    ap.add_argument("--max-stack", type=int, default=None, metavar="BYTES",
                    help="fail an attention config that spills more than BYTES of stack per thread (implies "
                         "--resources)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    todo = configs()
    if args.quick:  # + merge, KV, embedded fused; the float32 tree tile, which spilled on sm_90 at 64 rows
        todo = (todo[:2] + [c for c in todo if c[0].startswith("attn fp32") and "new=65" in c[0]][:1]
                + [c for c in todo if not c[0].startswith("attn")][:6])
    failed = 0
    for name, kernel, types, consts, warps in todo:
        try:
            compiled = _compile(kernel, types, consts, args.arch, warps)
        except Exception as e:  # report every failing config, not only the first
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}")
            continue
        resources = _resources(compiled) if args.resources or args.max_stack is not None else ""
        if args.max_stack is not None and name.startswith("attn") and _stack_bytes(resources) > args.max_stack:
            failed += 1
            print(f"FAIL {name}: spills registers ({resources}; at most {args.max_stack} bytes of stack allowed)")
            continue
        extra = f"  {resources}" if resources else ""
        print(f"ok   {name}  warps={warps} shared={compiled.metadata.shared}B{extra}", flush=True)
    print(f"{len(todo) - failed}/{len(todo)} kernels compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
