"""Compile every kernel launch the engine makes for a CUDA architecture WITHOUT a GPU (Triton's bundled ptxas).

    python -m specdec.kernels.compile_check              # sm_90 (H100 / H200): every recorded launch
    python -m specdec.kernels.compile_check --cover      # a pairwise cover of them (the test suite's)
    python -m specdec.kernels.compile_check --quick      # a handful (8B decode and tree, head_dim 512 tree, ...)
    python -m specdec.kernels.compile_check --list       # what would be compiled, without compiling
    python -m specdec.kernels.compile_check --arch 80 --resources

The interpreter checks semantics, not what the GPU compiler accepts (layouts, dot shapes, register spills).
Launches are recorded, not listed: the wrappers run on CPU tensors of real model shapes and dtypes (eager steps,
every CUDA-graph bucket) with each kernel's ``run`` replaced by a recorder, tiles, split counts and rows per program
as on a GPU with ``SMS`` SMs. Each distinct (kernel, signature, constexprs, attrs, options) compiles once,
specialised as a GPU launch of the same arguments is (alignment hints, integers equal to 1 made constants); an
attention or merge launch that spills more than ``--max-stack`` bytes of stack per thread fails. ``--cover``
compiles fewer launches of each kernel, chosen so that each of its settings, and each pair of them, is still met.
Run with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import itertools
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from types import SimpleNamespace
from unittest import mock

import torch

SMS = 132  # H100 SXM / H200: split-KV counts as chosen there
CUDA = torch.device("cuda")  # what the attention's split heuristic is told it runs on (no GPU is touched)
DEFAULT_MAX_STACK = 8  # stack bytes per thread an attention or merge launch may spill (16-bit tiles spill none)


@dataclass(frozen=True)
class Model:
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    # Qwen3: q and k normed per head, inside rope_write_ with a fused QKV product, else by PyTorch (new tensors)
    qk_norm: bool = False


MODELS = {
    "llama8b": Model(32, 8, 128, 4096, 14336),  # Llama-3.1-8B
    "qwen3-1.7b": Model(16, 8, 128, 2048, 6144, qk_norm=True),
    "llama1b": Model(32, 8, 64, 2048, 8192),  # Llama-3.2-1B
    "smollm2": Model(9, 3, 64, 576, 1536),  # SmolLM2-135M
}
# the widest head the tree-attention kernel takes (tree_attention.MAX_HEAD_DIM), no published shape: its attention
WIDE_HEADS = Model(8, 2, 512, 4096, 8192)
WIDE_HEAD_STEPS = [(b, n, c) for b in (1, 8) for n in (1, 9, 65) for c in (100, 8000)]  # (batch, new, cached keys)
DTYPES = {"bf16": (torch.bfloat16, tuple(MODELS)), "fp16": (torch.float16, ("llama8b", "smollm2")),
          "fp32": (torch.float32, ("llama8b", "smollm2"))}
EAGER_BATCHES = (1, 2, 8, 32)
EAGER_NEW = (1, 2, 3, 5, 9, 17, 33, 65)  # tokens per sequence of a decode, chain or tree step
EAGER_CONTEXTS = (100, 1000, 8000)  # cached keys: no split, and split counts of a short and a long context
PREFILLS = (1, 40, 128, 512, 8192)  # prompt lengths (batches 1 and 2, nothing cached)
GRAPH_MAX_KEYS = (8192, 131072)  # a CUDA-graph bucket's key capacity (its split counts)
GRAPH_PAGE = 16  # the KV cache's default block size: a bucket's block-table pages
HUGE_CACHE_STEPS = ((1, 1, 8000), (4, 65, 100))  # eager steps over a K plane of >= 2**31 elements (OFF64)
INVARIANT_ROWS = (1, 7, 32)  # a forward's rows in the bit-exact mode: M == 1, other, divisible by 16
INVARIANT_KEYS = (1, 17, 2048)  # its slot table's width (the most keys of a row): == 1, other, divisible by 16
KERNEL_NAMES = {"_tree_attn_kernel": "attn", "_merge_kernel": "merge", "_write_kernel": "kv write",
                "_compact_kernel": "compact", "_add_rms_norm_kernel": "add+rmsnorm", "_rope_kernel": "rope",
                "_rope_write_kernel": "rope+kv write", "_silu_mul_kernel": "silu*mul",
                "_linear_kernel": "invariant linear", "_attention_kernel": "invariant attn"}
SHOWN = ("BLOCK_Q", "BLOCK_N", "PAGE_SIZE", "SPLIT", "MERGE_IN_KERNEL", "OFF64", "BLOCK_S", "HAS_DELTA", "BLOCK_H",
         "HAS_BIAS", "HAS_NORM")
STACK_CHECKED = ("_tree_attn_kernel", "_merge_kernel")


# ---- recording launches ------------------------------------------------------------------------------------------
@dataclass
class Launch:
    """One distinct kernel compilation: what ``triton.compile`` gets for a GPU launch, and where it was first met."""

    module: str
    kernel_name: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    dtype: str
    label: str

    @property
    def key(self) -> str:
        return json.dumps([self.kernel_name, self.signature, sorted(map(repr, self.constexprs.items())),
                           sorted(map(repr, self.attrs.items())), sorted(map(repr, self.options.items()))])

    @property
    def name(self) -> str:
        names = list(self.signature)
        shown = " ".join(f"{names[i]}={v}" for (i,), v in self.constexprs.items() if names[i] in SHOWN)
        return " ".join(filter(None, (KERNEL_NAMES[self.kernel_name], self.dtype, self.label, shown)))

    def kernel(self):
        return getattr(importlib.import_module(self.module), self.kernel_name)

    @property
    def settings(self) -> frozenset:
        """What its compilation depends on, as (what, value) pairs: each constexpr, argument type, alignment hint
        and option."""
        names = list(self.signature)
        return frozenset([*((n, repr(v)) for n, v in self.signature.items() if v != "constexpr"),
                          *((names[i], repr(v)) for (i,), v in self.constexprs.items()),
                          *((f"{names[i]} attrs", repr(v)) for (i,), v in self.attrs.items()),
                          *((f"option {k}", repr(v)) for k, v in self.options.items())])


def pairwise_cover(launches: list[Launch]) -> list[Launch]:
    """Launches of ``launches`` (in their order) such that, for each kernel, every setting of its launches and every
    pair of settings found together in one of them is found in one chosen: greedily, the launch meeting the most
    pairs not met yet first. A fault of one setting, or of two together, still has a launch to show it."""
    chosen = set()
    for kernel in dict.fromkeys(la.kernel_name for la in launches):
        mine = [i for i, la in enumerate(launches) if la.kernel_name == kernel]
        pairs = {i: {frozenset(p) for p in itertools.combinations_with_replacement(launches[i].settings, 2)}
                 for i in mine}
        left = set().union(*pairs.values())
        while left:
            best = max(mine, key=lambda i: (len(pairs[i] & left), -i))
            chosen.add(best)
            left -= pairs[best]
    return [la for i, la in enumerate(launches) if i in chosen]


def _specialise(kernel, args, kwargs) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of a launch as ``JITFunction.run`` builds them on a CUDA device."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    params = inspect.signature(kernel.fn).parameters
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, bound.arguments.values(), strict=True)):
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        ty, attr = native_specialize_impl(CUDABackend, value, param.is_const, not param.do_not_specialize,
                                          not param.do_not_specialize_on_alignment)
        signature[param.name] = ty
        if ty == "constexpr":  # an integer equal to 1
            constexprs[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = CUDABackend.parse_attr(attr)
    return signature, constexprs, attrs, {k: v for k, v in kwargs.items() if k not in params}


def _kernels() -> list:
    from specdec.kernels import fused_ops as fo
    from specdec.kernels import invariant_ops as io
    from specdec.kernels import kv_write as kw
    from specdec.kernels import tree_attention as ta

    return [ta._tree_attn_kernel, ta._merge_kernel, kw._write_kernel, kw._compact_kernel, fo._add_rms_norm_kernel,
            fo._rope_kernel, fo._rope_write_kernel, fo._silu_mul_kernel, io._linear_kernel, io._attention_kernel]


@dataclass
class Recorder:
    """Replaces each kernel's ``run`` with a recorder, and the attention's tile and split choices with a GPU's."""

    launches: dict = field(default_factory=dict)  # key -> Launch, in order of first launch
    label: str = ""
    dtype: str = ""

    @contextlib.contextmanager
    def installed(self):
        from specdec.kernels import launch_rows
        from specdec.kernels import tree_attention as ta

        config, splits = ta.launch_config, ta._default_splits
        sms = SimpleNamespace(multi_processor_count=SMS)

        def gpu_tiles(group, head_dim, max_new, dtype, gpu=False):
            return config(group, head_dim, max_new, dtype, True)

        def gpu_splits(meta, programs, device):
            return splits(meta, programs, CUDA)

        with contextlib.ExitStack() as stack:
            for kernel in _kernels():
                stack.enter_context(mock.patch.object(kernel, "run", self._runner(kernel)))
            stack.enter_context(mock.patch.object(ta, "launch_config", gpu_tiles))
            stack.enter_context(mock.patch.object(launch_rows, "rows_per_program", lambda device, rows: 1))
            stack.enter_context(mock.patch.object(ta, "_default_splits", gpu_splits))
            stack.enter_context(mock.patch.object(torch.cuda, "get_device_properties", lambda device: sms))
            yield self

    def _runner(self, kernel):
        def run(*args, grid, warmup, **kwargs):
            signature, constexprs, attrs, options = _specialise(kernel, args, kwargs)
            launch = Launch(kernel.fn.__module__, kernel.fn.__name__, signature, constexprs, attrs, options,
                            self.dtype, self.label)
            self.launches.setdefault(launch.key, launch)

        return run


# ---- driving the wrappers at real shapes ---------------------------------------------------------------------------
def _q(rows: int, m: Model, dtype, fused: bool = True) -> torch.Tensor:
    """q as the runner passes it to attention. ``fused``: a view of one QKV product [rows, (q + k + v heads) *
    head_dim], whose row stride is that whole width (RoPE, and Qwen3's norm, applied in place in it); else separate
    products (a model not packed), a contiguous tensor."""
    if not fused:
        return torch.empty(rows, m.heads, m.head_dim, dtype=dtype)
    out = torch.empty(rows, (m.heads + 2 * m.kv_heads) * m.head_dim, dtype=dtype)
    return out[:, : (m.heads + m.kv_heads) * m.head_dim].view(rows, m.heads + m.kv_heads, m.head_dim)[:, : m.heads]


_LAYOUT = {True: "", False: " separate q"}  # a launch's label: q of a fused QKV product, or of its own product


def _kv(m: Model, dtype, slots: int = 4096, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    kv = torch.empty(1, 2, slots, m.kv_heads, m.head_dim, dtype=dtype, device=device)  # a layer of the cache
    return kv[0, 0], kv[0, 1]


def _eager_meta(batch: int, new: int, ctx: int):
    """``TreeAttentionMetadata.from_plan`` of a step: a page-size-1 slot table over each sequence's keys."""
    from specdec.kernels import tree_attention as ta

    def i32():
        return torch.zeros(batch, dtype=torch.int32)

    table = torch.zeros(batch, ctx + new, dtype=torch.int32)
    return ta.TreeAttentionMetadata(table, 1, i32(), i32(), i32(), i32(), i32(),
                                    torch.zeros(batch * new, dtype=torch.long), (new,) * batch, ctx)


def _eager_steps() -> list[tuple[int, int, int]]:
    """(batch, new tokens per sequence, cached keys) of the eager steps driven: decode, chains, trees, prefills."""
    steps = [(b, n, c) for b in EAGER_BATCHES for n in EAGER_NEW for c in EAGER_CONTEXTS]
    return steps + [(b, n, 0) for b in (1, 2) for n in PREFILLS]


def _graph_buckets():
    """(bucket, label) of every CUDA-graph bucket, at each key capacity."""
    from specdec.kernels.graph_metadata import StaticInputs

    from specdec.cuda_graphs import GraphConfig

    cfg = GraphConfig()
    for max_keys in GRAPH_MAX_KEYS:
        inputs = StaticInputs(cfg.batch_sizes[-1], cfg.tokens_per_seq[-1], max_keys, GRAPH_PAGE, 0, "cpu")
        for b in cfg.batch_sizes:
            for t in cfg.tokens_per_seq:
                yield inputs.bucket(b, t), f"graph B={b} t={t} keys={max_keys}"


def _eager_attention(rec: Recorder, name: str, m: Model, dtype, steps, huge: bool = False) -> None:
    """``tree_attention`` over eager steps; ``huge``: a K plane of >= 2**31 elements (meta tensors, no memory)."""
    from specdec.kernels import tree_attention as ta

    k, v = _kv(m, dtype, 2**31 // (m.kv_heads * m.head_dim) + 1, "meta") if huge else _kv(m, dtype)
    for batch, new, ctx in steps:
        for fused in (True, False):
            rec.label = f"{name} eager B={batch} n={new} ctx={ctx}" + (" huge cache" if huge else "") + _LAYOUT[fused]
            ta.tree_attention(_q(batch * new, m, dtype, fused), k, v, _eager_meta(batch, new, ctx), m.head_dim**-0.5)


def _graph_attention(rec: Recorder, name: str, m: Model, dtype) -> None:
    from specdec.kernels import tree_attention as ta

    k, v = _kv(m, dtype)
    for bucket, label in _graph_buckets():
        for fused in (True, False):
            rec.label = f"{name} {label}{_LAYOUT[fused]}"
            ta.tree_attention(_q(bucket.rows, m, dtype, fused), k, v, bucket.metadata, m.head_dim**-0.5)


def _layer_ops(rec: Recorder, name: str, m: Model, dtype, slots: torch.Tensor, label: str) -> None:
    """A layer's fused ops and KV store over ``slots`` (a step's write slots), with a fused QKV product or not."""
    from specdec.kernels import fused_ops as fo
    from specdec.kernels import kv_write as kw

    rec.label = f"{name} {label}"
    rows, d = slots.numel(), m.head_dim
    kv = torch.empty(2, 2, 64, m.kv_heads, d, dtype=dtype)  # [layers, 2, slots, kv heads, head_dim]
    h = torch.empty(rows, m.hidden, dtype=dtype)
    weight = torch.empty(m.hidden, dtype=dtype)
    fo.add_rms_norm(h, torch.empty_like(h), weight, 1e-5)
    fo.add_rms_norm(h, None, weight, 1e-5)  # the first layer's norm
    cos, sin = torch.empty(rows, 1, d, dtype=dtype), torch.empty(rows, 1, d, dtype=dtype)
    qkv = torch.empty(rows, (m.heads + 2 * m.kv_heads) * d, dtype=dtype)
    v = qkv[:, (m.heads + m.kv_heads) * d:].view(rows, m.kv_heads, d)
    # a fused QKV product: RoPE and KV store in one launch, after Qwen3's per-head q / k norms in the same launch
    norms = (torch.empty(d, dtype=dtype), torch.empty(d, dtype=dtype), 1e-6, 1e-6) if m.qk_norm else None
    fo.rope_write_(qkv[:, : (m.heads + m.kv_heads) * d].view(rows, -1, d), v, cos, sin, kv, 1, slots, m.heads, norms)
    fo.rope_(torch.empty(rows, m.heads, d, dtype=dtype), cos, sin)  # separate products (normed apart, in PyTorch)
    fo.rope_(torch.empty(rows, m.kv_heads, d, dtype=dtype), cos, sin)
    kw.write_kv(kv, 1, slots, torch.empty(rows, m.kv_heads, d, dtype=dtype), v)
    gate_up = torch.empty(rows, 2 * m.intermediate, dtype=dtype)
    fo.silu_mul(gate_up[:, : m.intermediate], gate_up[:, m.intermediate:])
    fo.silu_mul(torch.empty(rows, m.intermediate, dtype=dtype), torch.empty(rows, m.intermediate, dtype=dtype))


def _compaction(rec: Recorder, name: str, m: Model, dtype) -> None:
    from specdec.kernels import kv_write as kw

    rec.label = f"{name} commit"
    pairs = torch.arange(10).view(2, 5)  # the cache's src / dst slots: rows of one [2, n] tensor
    kw.compact_kv(torch.empty(2, 2, 64, m.kv_heads, m.head_dim, dtype=dtype), pairs[0], pairs[1])


def _invariant_ops(rec: Recorder, name: str, m: Model, dtype) -> None:
    """The bit-exact mode: every product and the attention through ``invariant_ops`` (unfused, contiguous q)."""
    from specdec.kernels import invariant_ops as io

    k, v = _kv(m, dtype)
    hd = m.heads * m.head_dim
    products = ((hd, m.hidden), (m.kv_heads * m.head_dim, m.hidden), (m.hidden, hd), (m.intermediate, m.hidden),
                (m.hidden, m.intermediate), (49152, m.hidden))
    for rows in INVARIANT_ROWS:
        rec.label = f"{name} bit-exact rows={rows}"
        for n_out, n_in in products:
            io.linear(torch.empty(rows, n_in, dtype=dtype), torch.empty(n_out, n_in, dtype=dtype))
        io.linear(torch.empty(rows, m.hidden, dtype=dtype), torch.empty(hd, m.hidden, dtype=dtype),
                  torch.empty(hd, dtype=dtype))
        for keys in INVARIANT_KEYS:
            rec.label = f"{name} bit-exact rows={rows} keys={keys}"
            io.attention(torch.empty(rows, m.heads, m.head_dim, dtype=dtype), k, v,
                         torch.zeros(rows, keys, dtype=torch.long), torch.ones(rows, dtype=torch.long),
                         m.head_dim**-0.5)


def _drive_all(rec: Recorder) -> None:
    for dname, (dtype, models) in DTYPES.items():
        rec.dtype = dname
        for name in models:
            m = MODELS[name]
            _eager_attention(rec, name, m, dtype, _eager_steps())
            _graph_attention(rec, name, m, dtype)
            _eager_attention(rec, name, m, dtype, HUGE_CACHE_STEPS, huge=True)
            for rows in (1, 7, 64):
                _layer_ops(rec, name, m, dtype, torch.zeros(rows, dtype=torch.int32), f"eager rows={rows}")
            for bucket, label in _graph_buckets():  # write slots inside the static buffer: alignment varies
                _layer_ops(rec, name, m, dtype, bucket.write_slots, label)
            _compaction(rec, name, m, dtype)
            _invariant_ops(rec, name, m, dtype)
        _eager_attention(rec, "head512", WIDE_HEADS, dtype, WIDE_HEAD_STEPS)


def _drive_quick(rec: Recorder) -> None:
    """The 8B shape: a split bf16 decode (merged by its own programs), bf16 65-token trees unsplit and split (and
    its merge), a float32 one, KV store, one norm; a bf16 65-token tree over head_dim 512."""
    from specdec.kernels import fused_ops as fo
    from specdec.kernels import kv_write as kw

    m = MODELS["llama8b"]
    rec.dtype = "bf16"
    _eager_attention(rec, "llama8b", m, torch.bfloat16, [(1, 1, 1000), (1, 65, 100), (1, 65, 1000)])
    _eager_attention(rec, "head512", WIDE_HEADS, torch.bfloat16, [(1, 65, 100)])
    rec.dtype = "fp32"
    _eager_attention(rec, "llama8b", m, torch.float32, [(1, 65, 100)])
    rec.dtype, rec.label = "bf16", "llama8b eager rows=1"
    kv = torch.empty(2, 2, 64, m.kv_heads, m.head_dim, dtype=torch.bfloat16)
    kv_rows = torch.empty(1, m.kv_heads, m.head_dim, dtype=torch.bfloat16)
    kw.write_kv(kv, 1, torch.zeros(1, dtype=torch.int32), kv_rows, kv_rows)
    fo.add_rms_norm(torch.empty(1, m.hidden, dtype=torch.bfloat16), torch.empty(1, m.hidden, dtype=torch.bfloat16),
                    torch.empty(m.hidden, dtype=torch.bfloat16), 1e-5)
    _compaction(rec, "llama8b", m, torch.bfloat16)


def record(quick: bool = False) -> list[Launch]:
    """Every distinct launch of the wrappers at the real shapes, in order of first launch (``quick``: a handful)."""
    rec = Recorder()
    with rec.installed():
        try:
            (_drive_quick if quick else _drive_all)(rec)
        except Exception as e:  # a wrapper rejecting a real shape: name the step
            raise RuntimeError(f"{rec.dtype} {rec.label}: {type(e).__name__}: {' '.join(str(e).split())}") from e
    return list(rec.launches.values())


# ---- compiling -----------------------------------------------------------------------------------------------------
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
    entry = next((f for f in resources.split() if f.startswith("STACK:")), "STACK:0")
    return int(entry.split(":")[1])


def _compile(launch: Launch, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=launch.kernel(), signature=launch.signature, constexprs=launch.constexprs, attrs=launch.attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))


def check(launch: Launch, arch: int, max_stack: int, show_resources: bool) -> tuple[bool, str]:
    """(ok, the CLI's line) for one launch: compiled, and within ``max_stack`` if an attention or merge kernel."""
    try:
        compiled = _compile(launch, arch)
    except Exception as e:  # report every failing launch, not only the first
        return False, f"FAIL {launch.name}: {type(e).__name__}: {' '.join(str(e).split())[:2000]}"
    resources = _resources(compiled)
    if launch.kernel_name in STACK_CHECKED and _stack_bytes(resources) > max_stack:
        return False, f"FAIL {launch.name}: spills registers ({resources}; at most {max_stack} bytes of stack allowed)"
    extra = f"  {resources}" if show_resources else ""
    warps = launch.options.get("num_warps", 4)
    return True, f"ok   {launch.name}  warps={warps} shared={compiled.metadata.shared}B{extra}"


def _check_all(todo: list[Launch], args):
    """The lines of :func:`check`, in order; on ``args.jobs`` processes when there is more than a handful."""
    work = [(la, args.arch, args.max_stack, args.resources) for la in todo]
    if args.jobs <= 1 or len(todo) < 16:
        yield from (check(*w) for w in work)
        return
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        yield from pool.map(check, *zip(*work, strict=True), chunksize=4)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100, 80 = A100)")
    ap.add_argument("--resources", action="store_true", help="print registers / stack (spills) per kernel")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true",
                       help="a handful: bf16 decode and tree and a float32 tree of the 8B shape, merge, KV, norm, a "
                            "bf16 tree over head_dim 512")
    which.add_argument("--cover", action="store_true",
                       help="of each kernel, only launches that meet each of its settings and each pair of them "
                            "(about a quarter of the launches)")
    ap.add_argument("--list", action="store_true", help="print what would be compiled, compile nothing")
    ap.add_argument("--max-stack", type=int, default=DEFAULT_MAX_STACK, metavar="BYTES",
                    help=f"fail an attention or merge launch that spills more than BYTES of stack per thread "
                         f"(default {DEFAULT_MAX_STACK})")
    ap.add_argument("--jobs", type=int, default=_cpus(), help="compiler processes (default: the CPUs usable)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    try:
        todo = record(args.quick)
    except RuntimeError as e:
        print(f"FAIL driving the wrappers at {e}")
        return 1
    if args.cover:
        cover = pairwise_cover(todo)
        print(f"a pairwise cover: {len(cover)} of {len(todo)} launches")
        todo = cover
    if args.list:
        print("\n".join(la.name for la in todo))
        print(f"{len(todo)} kernels to compile")
        return 0
    failed = 0
    for ok, line in _check_all(todo, args):
        failed += not ok
        print(line, flush=True)
    print(f"{len(todo) - failed}/{len(todo)} kernels compiled for sm_{args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
