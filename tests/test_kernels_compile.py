"""The kernels compile for sm_90 (H100) with Triton's bundled ptxas -- no GPU needed.

The interpreter tests check semantics; this catches what only the GPU compiler rejects. Runs
`python -m specdec.kernels.compile_check` in a subprocess with TRITON_INTERPRET unset; the q it builds is
compared with the q a tiny model's forward passes to attention (in this process, the interpreter on CPU).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from specdec.kernels.testing import kernel_device

DEVICE = kernel_device()  # for the in-process runner test: sets TRITON_INTERPRET=1 without a GPU (the check's
# own subprocesses run with it unset)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None,
    reason="needs triton with its NVIDIA backend",
)


def run_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-P", "-m", "specdec.kernels.compile_check", *args], capture_output=True,
                          text=True, env=env, timeout=600)


def test_kernels_compile_for_h100_quick():
    """A handful of launches compile as a GPU launch specialises them, and attention does not spill registers beyond
    the default --max-stack: float32 tree tiles of 64 rows spilled up to 9 KB of stack per thread on sm_90, a slow
    local-memory round trip in every tile, and so did bf16 tiles of 64 rows over head_dim 512."""
    proc = run_check("--quick", "--resources")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "9/9 kernels compiled for sm_90" in proc.stdout, proc.stdout
    for name in ("attn bf16 llama8b eager B=1 n=1 ctx=1000", "merge bf16", "attn bf16 llama8b eager B=1 n=65",
                 "attn bf16 head512 eager B=1 n=65", "attn fp32 llama8b eager B=1 n=65", "kv write bf16",
                 "compact bf16", "add+rmsnorm bf16"):
        assert f"ok   {name}" in proc.stdout, name
    # a decode's small tile merges its own parts, a split 65-token tree's tile hands them to the merge kernel
    assert "ctx=1000 BLOCK_Q=4 BLOCK_N=32 PAGE_SIZE=1 SPLIT=True MERGE_IN_KERNEL=True" in proc.stdout, proc.stdout
    assert "n=65 ctx=1000 BLOCK_Q=32 BLOCK_N=32 PAGE_SIZE=1 SPLIT=True MERGE_IN_KERNEL=False" in proc.stdout


def test_the_check_covers_what_the_engine_launches():
    """The full check's launches are recorded from the wrappers at real shapes (no compile here): every model shape
    and dtype, the CUDA-graph buckets' 8- and 16-token tiles, eager page-size-1 steps split and not, 64-bit offsets,
    merges of up to 65 parts, and the bit-exact mode's kernels."""
    proc = run_check("--list")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = proc.stdout.splitlines()
    assert names[-1].endswith(" kernels to compile") and int(names[-1].split()[0]) == len(names) - 1 > 100, names[-1]

    def found(prefix: str, *parts: str) -> bool:
        return any(n.startswith(prefix) and all(p in n for p in parts) for n in names)

    for model in ("llama8b", "qwen3-1.7b", "llama1b", "smollm2"):
        for tile in ("BLOCK_Q=8 ", "BLOCK_Q=16 "):
            assert found(f"attn bf16 {model} graph", tile, "PAGE_SIZE=16"), (model, tile)
        for split in ("SPLIT=True", "SPLIT=False"):
            assert found(f"attn bf16 {model} eager", "PAGE_SIZE=1 ", split), (model, split)
        assert found(f"attn bf16 {model}", "OFF64=True"), model
        assert found(f"invariant attn bf16 {model}"), model
    for dtype in ("bf16", "fp16", "fp32"):
        for kernel in ("rope", "silu*mul", "compact", "invariant linear", "invariant attn"):
            assert found(f"{kernel} {dtype} "), (kernel, dtype)
        for model in ("llama8b", "smollm2"):  # launches of one key are named after the first shape met
            for kernel in ("attn", "kv write", "rope+kv write", "add+rmsnorm"):
                assert found(f"{kernel} {dtype} {model}"), (kernel, dtype, model)
            # float32 tiles on a GPU are small enough to merge their own parts; 16-bit trees' are not
            assert found(f"attn {dtype} {model}", "SPLIT=True", "MERGE_IN_KERNEL=True"), (dtype, model)
            assert found(f"merge {dtype} {model}") == (dtype != "fp32"), (dtype, model)
        for graph_split in ("MERGE_IN_KERNEL=True", "MERGE_IN_KERNEL=False")[: 1 if dtype == "fp32" else 2]:
            assert found(f"attn {dtype} llama8b graph", "SPLIT=True", graph_split), (dtype, graph_split)
    assert found("merge bf16 smollm2", "BLOCK_S=128")
    assert found("rope+kv write bf16 qwen3-1.7b", "HAS_NORM=True")  # Qwen3's q / k norms in the same launch
    assert found("rope+kv write bf16 llama8b", "HAS_NORM=False")


FP_FUSION_SAID = """
from specdec.kernels.compile_check import record
print(sorted({la.kernel_name for la in record() if "enable_fp_fusion" not in la.options}))
"""


def test_every_launch_says_whether_products_and_sums_fuse():
    """Triton 3.9 warns at the first compile of a launch that leaves ``enable_fp_fusion`` unsaid (every GPU run's
    first step showed a UserWarning about TRITON_DEFAULT_FP_FUSION), and 3.10 turns fusion off by default: a kernel
    that left it unsaid would change its rounding with the Triton installed. Every recorded launch says it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-c", FP_FUSION_SAID], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", f"launches that leave enable_fp_fusion unsaid: {proc.stdout.strip()}"


@pytest.mark.parametrize("variant", ["qwen3-qknorm", "llama-gqa-tied"])
def test_the_checked_q_is_laid_out_as_the_runner_passes_it(variant, monkeypatch):
    """Triton specialises a kernel on its strides (equal to 1, divisible by 16), so the check builds q as the
    runner's forward passes it to attention: with a fused QKV product a view of that product, whose row stride is
    its whole (q + k + v heads) width, Qwen3's q too (normed in place by the RoPE launch); with separate products a
    contiguous tensor. The check built Qwen3's q contiguous, another variant than its fused path runs."""
    import copy
    import dataclasses

    from specdec.kernels import compile_check

    from specdec.generate import generate
    from specdec.models import llama
    from specdec.models.fused_projections import pack_projections
    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    model = build_tiny_model(variant, vocab_size=64)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = compile_check.Model(c.num_attention_heads, c.num_key_value_heads, head_dim, c.hidden_size,
                                c.intermediate_size, qk_norm=variant.startswith("qwen3"))
    seen = []
    real = llama.paged_attention
    monkeypatch.setattr(llama, "paged_attention", lambda q, *args: seen.append(q) or real(q, *args))
    for fused in (True, False):
        own = copy.deepcopy(model)
        if fused:
            pack_projections(own)
        loaded = load_model(own, device=DEVICE)
        runner = llama.LlamaRunner(loaded.model, backend="triton")
        assert (runner.fused_projections() is not None) == fused
        seen.clear()
        generate(dataclasses.replace(loaded, runner=runner), [[1, 2, 3]], max_new_tokens=2)
        rows = {q.shape[0] for q in seen}
        assert min(rows) == 1 < max(rows), rows  # a prefill's rows and a decode's
        for q in seen:
            checked = compile_check._q(q.shape[0], shape, q.dtype, fused)
            assert (checked.shape, checked.stride()) == (q.shape, q.stride()), (fused, q.shape)
            if fused and q.shape[0] > 1:  # a view of the packed product: rows as wide as the q, k and v heads
                assert q.stride(0) == (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim


@pytest.mark.slow
def test_a_pairwise_cover_of_the_launches_compiles_for_h100():
    """Every kernel, each of its settings and each pair of them, compiled for sm_90: fewer than half the recorded
    launches, every kernel among them. The full check (every launch) took ~6 minutes on a 2-core machine with
    Triton's cache empty, as on a fresh clone; the cover about a fifth of that."""
    import re

    from specdec.kernels.compile_check import KERNEL_NAMES

    proc = run_check("--cover")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
    lines = proc.stdout.splitlines()
    compiled = sum(line.startswith("ok   ") for line in lines)
    assert lines[-1] == f"{compiled}/{compiled} kernels compiled for sm_90", lines[-1]
    cover = re.fullmatch(r"a pairwise cover: (\d+) of (\d+) launches", lines[0])
    assert cover and int(cover[1]) == compiled > 50 and compiled < int(cover[2]) / 2, lines[0]
    for kernel in KERNEL_NAMES.values():
        assert any(line.startswith(f"ok   {kernel} ") for line in lines), kernel


def _launch(kernel: str, **constexprs):
    from specdec.kernels.compile_check import Launch

    signature = {"x_ptr": "*bf16", **{name: "constexpr" for name in constexprs}}
    return Launch("m", kernel, signature, {(i + 1,): v for i, v in enumerate(constexprs.values())}, {}, {}, "bf16",
                  "")


def test_the_cover_meets_every_pair_of_settings_of_each_kernel():
    """Of four launches of one kernel over two settings of two values each, every one shows a pair no other does: all
    four are compiled; a launch adding nothing is not; another kernel's launches are covered on their own."""
    import itertools

    from specdec.kernels.compile_check import pairwise_cover

    grid = [_launch("a", BLOCK=b, SPLIT=s) for b in (16, 32) for s in (False, True)]
    again = _launch("a", BLOCK=16, SPLIT=False)
    again.options = {"num_warps": 4}  # a third setting: its pairs with the others must be met too
    other = [_launch("b", BLOCK=16), _launch("b", BLOCK=16), _launch("b", BLOCK=64)]
    launches = [*grid, again, *other]
    chosen = pairwise_cover(launches)
    assert [launches.index(la) for la in chosen] == [1, 2, 3, 4, 5, 7]  # `again` covers grid[0]'s pairs
    for kernel in ("a", "b"):
        met = {p for la in chosen if la.kernel_name == kernel
               for p in itertools.combinations_with_replacement(sorted(la.settings), 2)}
        assert all(p in met for la in launches if la.kernel_name == kernel
                   for p in itertools.combinations_with_replacement(sorted(la.settings), 2))


SPECIALISATIONS = """
import inspect, torch
from triton.backends.nvidia.compiler import CUDABackend
from triton._C.libtriton import native_specialize_impl
from specdec.kernels import kv_write as kw, tree_attention as ta

keys = {}
def recorder(kernel):
    def run(*args, grid, warmup, **kwargs):  # the key a GPU launch compiles under, as JITFunction.run builds it
        bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items()
                                                           if k in kernel.arg_names})
        pairs = list(zip(kernel.params, bound.arguments.values()))
        consts = tuple(v for p, v in pairs if p.is_constexpr)  # the tile shape: a kernel of its own anyway
        key = tuple(native_specialize_impl(CUDABackend, v, p.is_const, not p.do_not_specialize,
                                           not p.do_not_specialize_on_alignment)
                    for p, v in pairs if not p.is_constexpr)
        keys.setdefault(kernel.fn.__name__, {}).setdefault(consts, set()).add(key)
    kernel.run = run
recorder(ta._tree_attn_kernel)
recorder(kw._compact_kernel)
recorder(ta._merge_kernel)  # after a split
k = v = torch.zeros(4096, 3, 64, dtype=torch.bfloat16)
i32 = lambda: torch.zeros(1, dtype=torch.int32)
for n, ctx in ((40, 0), (128, 0), (144, 0), (1, 2000), (1, 2048)):  # prefills of 40, 128 and 144 keys, decodes
    table = torch.zeros(1, ctx + n, dtype=torch.int32)  # an eager step's page-size-1 slot table: stride ctx + n
    meta = ta.TreeAttentionMetadata(table, 1, i32(), i32(), i32(), i32(), i32(), torch.zeros(n, dtype=torch.long),
                                    (n,), ctx)
    for splits in (1, 2, 16) if ctx else (1,):
        ta.tree_attention(torch.zeros(n, 9, 64, dtype=torch.bfloat16), k, v, meta, 0.125, num_splits=splits)
kv = torch.zeros(2, 2, 64, 3, 64, dtype=torch.bfloat16)
for pairs in (1, 4, 16):
    kw.compact_kv(kv, torch.arange(pairs), torch.arange(pairs) + 32)
# the most runtime specialisations of one tile shape, per kernel
print({name: max(map(len, found.values())) for name, found in sorted(keys.items()) if name != "_merge_kernel"})
keys.clear()
meta = ta.TreeAttentionMetadata(torch.zeros(1, 16385, dtype=torch.int32), 1, i32(), i32(), i32(), i32(), i32(),
                                torch.zeros(1, dtype=torch.long), (1,), 16384)
tree = ta.TreeAttentionMetadata(torch.zeros(1, 16449, dtype=torch.int32), 1, i32(), i32(), i32(), i32(), i32(),
                                torch.zeros(65, dtype=torch.long), (65,), 16384)
for splits in range(2, 65):  # an eager step's split count grows with its context: a decode's and a tree's
    ta.tree_attention(torch.zeros(1, 9, 64, dtype=torch.bfloat16), k, v, meta, 0.125, num_splits=splits)
    ta.tree_attention(torch.zeros(65, 9, 64, dtype=torch.bfloat16), k, v, tree, 0.125, num_splits=splits)
print(sum(map(len, keys["_tree_attn_kernel"].values())), sum(map(len, keys["_merge_kernel"].values())))
"""


def test_a_steps_key_count_or_splits_compile_no_new_kernel():
    """On a GPU Triton compiles a kernel again for each class of an integer argument (equal to 1, divisible by 16,
    other), and for each value of a constexpr: a prefill of 128 keys, a new split count or 16 compacted pairs met
    first inside a timed run compiled there (~1 s), and the merge compiled once per split count (a constexpr), so an
    eager generation compiled one more every 256 keys of context. Such arguments are not specialised."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-c", SPECIALISATIONS], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[-3] == "{'_compact_kernel': 1, '_tree_attn_kernel': 1}", proc.stdout
    # over 63 split counts: the decode's and the tree's attention (one merging its own parts, one not), and the tree's
    # merge, one kernel per power of two of parts (BLOCK_S), not per split count
    attention, merges = map(int, proc.stdout.split("\n")[-2].split())
    assert attention == 2 and merges <= 7, proc.stdout
