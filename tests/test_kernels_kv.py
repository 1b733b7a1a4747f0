"""KV store / compaction kernels vs PagedKVCache's reference write and commit, and the dispatch switch.

Interpreter on CPU (TRITON_INTERPRET=1), natively when a GPU is present.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from specdec.kernels.testing import kernel_device

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
# generate() with a drafter: in the interpreter, speculation="auto" first calibrates the cost model (~65 verify
# sizes, 30-60 s per test on CPU) and its guard may prune the trees these tests push through the kernels; on a
# GPU the default runs
SPECULATION = "auto" if DEVICE == "cuda" else "always"
pytest.importorskip("triton")

import torch  # noqa: E402
from specdec.kernels.dispatch import requested, resolve_backend  # noqa: E402
from specdec.kernels.kv_write import compact_kv, write_kv  # noqa: E402

from specdec.kv_cache import PagedKVCache  # noqa: E402


@pytest.fixture
def backend_env(monkeypatch):
    def set_backend(name: str) -> None:
        monkeypatch.setenv("SPECDEC_ATTENTION", name)

    return set_backend


def make_cache(seed: int, layers=3, kv_heads=2, head_dim=8, blocks=24, block_size=4,
               backend: str | None = None) -> PagedKVCache:
    cache = PagedKVCache(layers, kv_heads, head_dim, blocks, block_size, device=DEVICE, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    cache._free = torch.randperm(blocks, generator=gen).tolist()  # shuffled block tables
    return cache


def test_write_matches_index_copy():
    cache = make_cache(0)
    ref = cache.kv.clone()
    slots = torch.tensor([17, 3, 40, 41, 90], device=DEVICE)
    k = torch.randn(5, 2, 8, device=DEVICE)
    v = torch.randn(5, 2, 8, device=DEVICE)
    write_kv(cache.kv, 1, slots, k, v)
    ref[1, 0].index_copy_(0, slots, k)
    ref[1, 1].index_copy_(0, slots, v)
    assert torch.equal(cache.kv, ref)
    with pytest.raises(ValueError, match="do not match"):
        write_kv(cache.kv, 1, slots[:2], k, v)


def test_write_non_contiguous_source():
    cache = make_cache(1)
    ref = cache.kv.clone()
    big = torch.randn(3, 4, 8, device=DEVICE)
    k, v = big[:, :2], big[:, 2:]  # row stride 32, not 16
    slots = torch.tensor([5, 6, 60], device=DEVICE)
    write_kv(cache.kv, 2, slots, k, v)
    ref[2, 0].index_copy_(0, slots, k)
    ref[2, 1].index_copy_(0, slots, v)
    assert torch.equal(cache.kv, ref)
    # heads not packed: a [heads, tokens, dim] tensor seen as [tokens, heads, dim] (head stride 3 * 8, not 8); a
    # kernel reading it as packed once wrote the next token's head 0 as head 1
    k, v = (torch.randn(2, 3, 8, device=DEVICE).transpose(0, 1) for _ in range(2))
    write_kv(cache.kv, 1, slots, k, v)
    ref[1, 0].index_copy_(0, slots, k)
    ref[1, 1].index_copy_(0, slots, v)
    assert torch.equal(cache.kv, ref)
    # a [dim, heads, tokens] tensor seen as [tokens, heads, dim]: the head stride is the head size (8 tokens of
    # dim 8), but the values of a row are 16 apart, not packed
    k, v = (torch.randn(8, 2, 8, device=DEVICE).permute(2, 1, 0) for _ in range(2))
    assert k.stride(1) == k.shape[2] and k.stride(2) != 1
    slots = torch.tensor([5, 6, 60, 7, 30, 31, 2, 90], device=DEVICE)
    write_kv(cache.kv, 0, slots, k, v)
    ref[0, 0].index_copy_(0, slots, k)
    ref[0, 1].index_copy_(0, slots, v)
    assert torch.equal(cache.kv, ref)


def test_rows_wider_than_one_column_chunk_are_written_and_moved_whole():
    """A slot's row of 3 heads x 384 = 1152 values spans two programs' column chunks (1024, then 128 masked): both
    kernels launch a program per chunk, so the row's tail past the first chunk is written and moved too."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 2, 6, 3, 384, generator=gen).to(DEVICE)
    ref = kv.clone()
    k, v = (torch.randn(2, 3, 384, generator=gen).to(DEVICE) for _ in range(2))
    slots = torch.tensor([4, 1], device=DEVICE)
    write_kv(kv, 1, slots, k, v)
    ref[1, 0].index_copy_(0, slots, k)
    ref[1, 1].index_copy_(0, slots, v)
    assert torch.equal(kv, ref)
    src, dst = torch.tensor([4, 5], device=DEVICE), torch.tensor([0, 3], device=DEVICE)
    compact_kv(kv, src, dst)
    ref[:, :, dst] = ref[:, :, src]
    assert torch.equal(kv, ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_commit_compaction_matches_reference(seed, monkeypatch):
    """Commits that compact accepted tree tokens: a cache built on the Triton backend (its compaction kernel, seen
    launched) ends with the block tables, lengths and every slot's values of one built on the reference."""
    from specdec.kernels import kv_write

    kernel_calls = []
    real = kv_write.compact_kv
    monkeypatch.setattr(kv_write, "compact_kv", lambda *a: kernel_calls.append(1) or real(*a))
    gen = torch.Generator().manual_seed(100 + seed)
    caches = {name: make_cache(seed, backend=name) for name in ("reference", "triton")}  # each with its backend
    assert caches["triton"].backend.triton and not caches["reference"].backend.triton
    launches = dict.fromkeys(caches, 0)  # compaction kernel launches by each cache's commits
    lens = [0, 5, 9, 2]
    for cache in caches.values():
        for sid, n in enumerate(lens):
            cache.add(sid)
            cache.reserve(sid, n)
            cache.commit({sid: range(n)})
    for _step in range(3):
        tree_sizes = torch.randint(1, 12, (len(lens),), generator=gen).tolist()
        keeps = {}
        for sid, n in enumerate(tree_sizes):
            # root (offset 0) + an increasing random subset of the tree offsets, like an accepted path
            picked = sorted(torch.randperm(n, generator=gen)[: int(torch.randint(0, n, (), generator=gen))].tolist())
            keeps[sid] = [0] + [1 + i for i in picked]
        for name, cache in caches.items():
            cache.reserve_many({sid: 1 + n for sid, n in enumerate(tree_sizes)})
            before = len(kernel_calls)
            cache.commit(keeps)
            launches[name] += len(kernel_calls) - before
    assert launches["reference"] == 0 and launches["triton"] > 0, launches  # the kernel ran, on the Triton side only
    ref, tri = caches["reference"], caches["triton"]
    assert ref.block_tables == tri.block_tables and ref.lengths == tri.lengths
    for sid in ref.lengths:
        slots = ref.slots(sid, 0, ref.lengths[sid])
        assert torch.equal(ref.kv[:, :, slots], tri.kv[:, :, slots]), f"sequence {sid} differs after compaction"
    assert torch.equal(ref.kv, tri.kv)  # nothing else was touched either


def test_compaction_refuses_unpaired_slots_and_moves_nothing():
    kv = torch.arange(2 * 2 * 6 * 1 * 4, dtype=torch.float32, device=DEVICE).reshape(2, 2, 6, 1, 4)
    before = kv.clone()
    with pytest.raises(ValueError, match="equal length"):  # 3 sources, 2 destinations
        compact_kv(kv, torch.tensor([3, 4, 5], device=DEVICE), torch.tensor([0, 1], device=DEVICE))
    assert torch.equal(kv, before)


def test_compaction_overlapping_pairs_in_order():
    # pair 0 reads slot 2 which pair 1 later overwrites: sequential order must read before writing
    kv = torch.arange(2 * 2 * 6 * 1 * 4, dtype=torch.float32, device=DEVICE).reshape(2, 2, 6, 1, 4)
    ref = kv.clone()
    src, dst = torch.tensor([2, 4], device=DEVICE), torch.tensor([1, 2], device=DEVICE)
    ref[:, :, dst] = ref[:, :, src]
    compact_kv(kv, src, dst)
    assert torch.equal(kv, ref)


def test_dispatch_switch(backend_env):
    backend_env("reference")
    assert not resolve_backend(DEVICE).triton
    backend_env("auto")
    assert resolve_backend(DEVICE).triton is (DEVICE == "cuda")  # auto never picks the interpreter on CPU
    backend_env("triton")
    assert resolve_backend(DEVICE).triton  # on CPU: TRITON_INTERPRET=1 is set by this module
    assert not resolve_backend(DEVICE, "reference").triton  # an explicit choice beats the environment
    backend_env("bogus")
    with pytest.raises(ValueError, match="SPECDEC_ATTENTION"):
        requested()
    with pytest.raises(ValueError, match="backend='nope'"):
        resolve_backend(DEVICE, "nope")


INTERPRETER_ORDER = """
import os, sys
from specdec.kernels.dispatch import BackendError, resolve_backend

for value in sys.argv[1:]:  # TRITON_INTERPRET at each call; the first call imports the kernels
    os.environ["TRITON_INTERPRET"] = value
    try:
        resolve_backend("cpu", "triton")
        print("accepted")
    except BackendError as e:
        print("refused:", e)
"""


def interpreter_order(*values: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPECDEC_ATTENTION")}
    proc = subprocess.run([sys.executable, "-P", "-c", INTERPRETER_ORDER, *values], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_forced_triton_on_cpu_is_refused_unless_its_kernels_run_in_the_interpreter():
    """Triton decides when a kernel is decorated: without TRITON_INTERPRET the kernels are refused on CPU in one line;
    set after specdec's kernel modules were imported they would run compiled for a GPU, mixed with kernels imported
    later in the interpreter (InterpreterError: "Cannot call @triton.jit'd outside of the scope of a kernel" at the
    first forward): refused too, naming the order. Any value this triton reads as on (TRITON_INTERPRET=yes) works."""
    if DEVICE != "cpu":
        pytest.skip("CPU-only check")
    unset, late = interpreter_order("0", "1")
    assert unset.startswith("refused:") and "needs a CUDA device, or TRITON_INTERPRET=1" in unset, unset
    assert late.startswith("refused:") and "TRITON_INTERPRET=1 is set, but specdec's kernels were imported" in late
    script = ("from triton.runtime.interpreter import InterpretedFunction; from specdec.kernels import launch_rows; "
              "print(isinstance(launch_rows.token_rows, InterpretedFunction))")
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "TRITON_INTERPRET": "yes"}
    reads_yes = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True, env=env,
                               timeout=300).stdout.strip() == "True"
    (answer,) = interpreter_order("yes")
    assert answer == "accepted" if reads_yes else answer.startswith("refused:"), (reads_yes, answer)


def test_backend_is_chosen_once_when_runner_and_cache_are_built(backend_env, tiny_model):
    """The runner and the cache keep the backend they were built with: the environment is not read
    per call (a bogus value set afterwards changes nothing), and generate() gives its cache the
    runner's backend, so one engine never mixes the two."""
    from specdec.generate import generate
    from specdec.models.loader import load_model

    backend_env("triton")
    loaded = load_model(tiny_model("llama-gqa-tied", vocab_size=64), device=DEVICE)
    cache = make_cache(0)
    assert loaded.runner.backend.triton and cache.backend.triton
    backend_env("bogus")  # read per call, this would raise in every forward and KV write
    out = generate(loaded, [[3, 5, 7, 3, 5, 7]], max_new_tokens=4, drafter="ngram", speculation=SPECULATION)
    assert len(out[0]) == 10
    cache.add(0)
    cache.reserve(0, 2)
    kv = torch.randn(2, cache.kv.shape[3], cache.kv.shape[4], device=DEVICE)
    cache.write(0, cache.slots(0, 0, 2), kv, kv)
    assert torch.equal(cache.layer(0)[0][cache.slots(0, 0, 2)], kv)
    backend_env("reference")
    assert generate(loaded, [[3, 5, 7, 3, 5, 7]], max_new_tokens=4) == out


def test_engine_forward_through_dispatch_matches_reference(backend_env, tiny_model, monkeypatch):
    """The model forward (cache writes, attention, commit) with SPECDEC_ATTENTION=triton gives the
    reference's greedy tokens and logits on a tiny model, speculative decoding with trees included."""
    from specdec.kernels import fused_ops
    from specdec.kernels import tree_attention as ta

    from specdec.generate import generate
    from specdec.models.loader import load_model

    calls, fused = [], []
    kernel = ta.tree_attention
    monkeypatch.setattr(ta, "tree_attention", lambda *a, **k: calls.append(a[3].host_q_lens) or kernel(*a, **k))
    for name in ("add_rms_norm", "rope_", "silu_mul"):  # the layer's element-wise steps go through the kernels too
        op = getattr(fused_ops, name)
        monkeypatch.setattr(fused_ops, name, lambda *a, _op=op, _name=name, **k: fused.append(_name) or _op(*a, **k))
    model = tiny_model("llama-gqa-tied", vocab_size=64)
    prompt = [[3, 5, 7, 3, 5, 7, 3, 5], [9, 9, 2], [3, 5, 7, 3, 5, 7, 3, 5]]  # the copy: prefilled once, K/V copied
    outs = {}
    for name in ("reference", "triton"):
        backend_env(name)  # read when load_model builds the runner
        outs[name] = generate(load_model(model, device=DEVICE), prompt, max_new_tokens=6, drafter="ngram",
                              return_dict=True, speculation=SPECULATION)
    assert outs["reference"].new_tokens == outs["triton"].new_tokens
    assert outs["triton"].new_tokens[2] == outs["triton"].new_tokens[0]
    assert calls, "SPECDEC_ATTENTION=triton did not reach the kernel"
    assert {"add_rms_norm", "rope_", "silu_mul"} <= set(fused), "the fused element-wise kernels were not used"
    assert any(max(lens) > 1 and len(lens) > 1 for lens in calls[1:]), "no batched verify forward went through it"
