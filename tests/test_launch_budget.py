"""What the GPU path launches, held to its budget: a decode layer's kernels, a graphed plain step's outside its replay,
a commit's, an EAGLE growth level's, and a graphed EAGLE proposal's outside its replay.

On a GPU each launch costs a kernel's start, inside a CUDA graph too, so at batch 1 the counts below are a large
part of a step's time (docs/gpu-speed.md). They are counted on the CPU through the Triton interpreter by
benchmarks/count_launches.py, which these tests run; a change that adds a launch per layer or per level fails
here instead of on the next scarce GPU run. Update the budget on purpose, with the measured step time that pays
for it.
"""
from __future__ import annotations

import collections
import copy

import pytest
from specdec.kernels.testing import kernel_device

from tests.script_loading import load_script

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")
# counted on CPU tensors through the interpreter (as count_launches.py runs), which a GPU machine does not turn on
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="counts launches in the Triton interpreter, on the CPU")

MODEL = "synthetic:llama-3.1-8b@tiny"  # GQA, untied, Llama 3 RoPE; 2 layers


def _count_launches():
    return load_script("count_launches")


@pytest.fixture
def counting(monkeypatch, gpu_products):
    """The benchmark's setting: the Triton backend, products as a GPU runs them (no CPU row policy)."""
    from specdec import engine_setup

    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    monkeypatch.setattr(engine_setup, "ensure_row_policy", lambda runner: None)
    from specdec.models.loader import load_model

    return _count_launches(), load_model(MODEL, device="cpu")


@pytest.mark.parametrize("new_tokens", [1, 5])  # a decode step, a chain's verify (a strided q / k: no copy of it)
def test_a_packed_decode_layer_launches_nine_kernels_with_split_attention(counting, monkeypatch, new_tokens):
    count, loaded = counting
    from specdec.kernels import tree_attention as ta

    from specdec.models.fused_projections import pack_projections
    from specdec.models.llama import LlamaRunner

    # a CUDA-graph bucket's attention splits its keys (its capacity reaches 2 x MIN_SPLIT_CHUNK): its last programs
    # merge the parts, no launch of their own
    monkeypatch.setattr(ta, "_default_splits", lambda meta, programs, device: 2)
    model = copy.deepcopy(loaded.model)
    pack_projections(model)
    runner = LlamaRunner(model, backend="triton")
    full, one = count.forward_launches(runner, new_tokens), count.forward_launches(runner.truncated(1), new_tokens)
    per_layer = collections.Counter({k: full[k] - one[k] for k in full if full[k] != one[k]})
    assert per_layer == {
        "linear": 4,  # QKV, o, gate/up, down
        "triton:_add_rms_norm_kernel": 2,  # each residual add with the next norm
        "triton:_rope_write_kernel": 1,  # RoPE of q and k, and the K/V write
        "triton:_tree_attn_kernel": 1,
        "triton:_silu_mul_kernel": 1,
    }, dict(per_layer)


def test_a_graphed_plain_step_launches_six_kernels_outside_its_replay(counting):
    count, loaded = counting
    counter, steps = count.step_launches(loaded, 1)
    outside = collections.Counter(counter.ops)
    outside.pop("cat", None)  # a sequence's slot row grows by a block every 16 positions
    # the LM head, the greedy choice (its no-law check: gt, where), the choices' copy to the host (a clone on the
    # CPU), and the queued step's token input: copied from the choices on the device and clamped into the vocabulary
    # in one launch (every step but the first, whose roots are the host's)
    assert outside == {"linear": steps, "max": steps, "gt": steps, "where": steps, "clone": steps,
                       "clamp": steps - 1}, (steps, dict(outside))


def test_a_commit_that_moves_kv_launches_one_kernel():
    """The accepted path's K/V moved into place for all layers: the compaction kernel alone, its slot lists made as
    it reads them (int32) on the host, not converted on the device (two launches a speculative step)."""
    import torch

    from specdec.kv_cache import PagedKVCache
    from specdec.launches import Launches

    cache = PagedKVCache(2, 2, 16, 4, 16, torch.float32, "cpu", "triton")
    cache.add(0)
    cache.reserve(0, 8)
    with Launches() as counter:
        cache.commit({0: [0, 2, 5]})  # the root in place; offsets 2 and 5 move to 1 and 2
    assert dict(counter.ops) == {"triton:_compact_kernel": 1}


def test_an_eagle_growth_level_stays_within_twenty_launches(counting):
    count, loaded = counting
    # a chain (top-k 1), as the speed command's oracle rows draft; each call's growth one level deeper
    (ops2, calls2), (ops3, calls3) = (count.eagle_launches(loaded, depth, 1, "triton", calls=2) for depth in (2, 3))
    per_call = [sum(ops.values()) / calls for ops, calls in ((ops2, calls2), (ops3, calls3))]
    level = per_call[1] - per_call[0]
    assert 0 < level <= 20, (level, dict(ops3 - ops2))
    # the rest of a call (the catch-up over the accepted tokens, the first level, the reranked pool)
    assert per_call[0] - 2 * level <= 54, (per_call, dict(ops2))
    assert ops3["triton:_add_rms_norm_kernel"] and not {"rsqrt", "silu"} & set(ops3), dict(ops3)  # the fused path
    # the catch-up's and the levels' RoPE rows are gathered from the bucket's table, not computed per call
    assert not {"cos", "sin"} & set(ops3), dict(ops3)
    # a chain's one candidate per level is one max reduction: CUDA's topk is a radix select of ~8 device operations
    assert "topk" not in ops3 and ops3["max"] >= 3, dict(ops3)


@pytest.mark.parametrize("top_k", [2, 1], ids=["tree", "chain"])
def test_a_graphed_eagle_proposal_launches_its_trees_fields_inside_the_replay(counting, top_k):
    """A pending proposal's tokens, depths and ancestor bits come out of the drafting's graph: around the replay the
    host issues only the K/V bookkeeping (the slab's append and the bucket's load) and the candidates' host copy.
    A tree's depths and bits are computed in the replay by pointer doubling; a chain's are constants its bucket
    keeps, so its replay maps only the tokens."""
    count, loaded = counting
    counter, calls = count.pending_launches(loaded, 3, top_k, calls=2)
    outside = collections.Counter({k: v for k, v in counter.ops.items() if not k.startswith(("zeros", "new_zeros"))})
    inside = counter.inside_ops
    assert calls == 2 and inside["linear"] >= 3 * calls, (calls, dict(inside))
    # per call: the catch-up's keys and values into the slab (a slice copy each at batch 1), the slab into the
    # bucket (two copies), the catch-up's hidden rows into it and its metadata from the host (a copy each), the
    # candidates' host copy (a clone on the CPU); the fields (the token mapping, a tree's pointer doubling) run in
    # the replay
    assert outside == {"copy_": 6 * calls, "clone": calls}, dict(outside)
    if top_k > 1:  # the pointer doubling: gather, or, add
        assert inside["gather"] and inside["__or__"], dict(inside)
    else:  # depth 3: 96 launches a call, 119 with the pointer doubling (23 ops)
        assert sum(inside.values()) <= 100 * calls and not {"__or__", "__lshift__"} & set(inside), dict(inside)
    assert not {"cos", "sin"} & set(inside), dict(inside)  # RoPE rows gathered from the bucket's table


def test_top_k_is_topk_and_a_single_candidate_the_first_maximum():
    import torch
    from specdec.drafters.top_k import top_k

    scores = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.5], [3.0, 0.0, 3.0, -2.0, 1.0]])
    values, indices = top_k(scores, 1)
    assert values.tolist() == [[2.0], [3.0]] and indices.tolist() == [[1], [0]]  # ties: the first
    for k in (2, 5):
        assert [t.tolist() for t in top_k(scores, k)] == [t.tolist() for t in torch.topk(scores, k)]


def test_a_gpu_s_triton_launches_are_counted_once_and_its_warm_ups_not(monkeypatch):
    """On a GPU the kernels are JITFunctions, not the interpreter's: each launch counts once (they went uncounted,
    and the fused-op layer test failed on an H200), a warm-up (compiling only) not at all, the launch's own tensor
    work not either; leaving puts the launch back."""
    import types

    import torch
    import triton.runtime.jit as jit

    from specdec.launches import Launches

    warmups = []

    def launch(fn, *args, grid, warmup, **kwargs):
        warmups.append(warmup)
        torch.ones(2).add_(1)

    def _rope_kernel():
        pass

    monkeypatch.setattr(jit.JITFunction, "run", launch)
    kernel = types.SimpleNamespace(fn=_rope_kernel)
    with Launches() as counter:
        jit.JITFunction.run(kernel, 1, grid=(1,), warmup=False)
        jit.JITFunction.run(kernel, 1, grid=(1,), warmup=True)
        torch.zeros(2).add_(1)
    assert warmups == [False, True]
    assert dict(counter.ops) == {"triton:_rope_kernel": 1, "zeros": 1, "add_": 1}, dict(counter.ops)
    assert jit.JITFunction.run is launch


def test_the_interpreters_launches_are_counted_without_a_run_method(monkeypatch):
    """Triton 3.0-3.2 (3.2 is the one torch 2.6, specdec's floor, brings) has no InterpretedFunction.run: a
    ``kernel[grid](...)`` runs its GridExecutor directly, and entering Launches failed with an AttributeError. Every
    3.x runs a launch in GridExecutor.__call__: each counts once, its own tensor work not; leaving puts it back."""
    import types

    import torch
    import triton.runtime.interpreter as interpreter

    from specdec.launches import Launches

    def execute(executor, *args, **kwargs):
        torch.ones(2).add_(1)

    def _rope_kernel():
        pass

    monkeypatch.delattr(interpreter.InterpretedFunction, "run", raising=False)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", execute)
    executor = types.SimpleNamespace(fn=_rope_kernel)
    with Launches() as counter:
        interpreter.GridExecutor.__call__(executor, 1)
        torch.zeros(2).add_(1)
    assert dict(counter.ops) == {"triton:_rope_kernel": 1, "zeros": 1, "add_": 1}, dict(counter.ops)
    assert interpreter.GridExecutor.__call__ is execute


def test_an_eager_forward_computes_its_grids_without_tritons_constexpr_helpers(counting, monkeypatch):
    """A prefill or an uncaptured step runs its launches from the host, each with its grid and block widths: Triton's
    ``cdiv`` / ``next_power_of_2`` are constexpr functions whose host calls unwrap every argument (hundreds of calls
    an eager forward), so the kernels' host code takes plain ints from :mod:`specdec.kernels.host_ints`."""
    import sys

    import triton

    count, loaded = counting
    from specdec.kernels import host_ints

    from specdec.models.llama import LlamaRunner

    ours = []
    for name in ("cdiv", "next_power_of_2"):
        theirs = getattr(triton, name)

        def counted(*args, _theirs=theirs, _name=name):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("specdec."):
                ours.append(_name)
            return _theirs(*args)

        monkeypatch.setattr(triton, name, counted)
    for tokens in (1, 5):
        count.forward_launches(LlamaRunner(loaded.model, backend="triton"), tokens)
    assert ours == []
    # the same values as Triton's, where its are defined (n >= 1)
    for n in range(1, 2050):
        assert host_ints.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 16, 128):
            assert host_ints.cdiv(n, d) == triton.cdiv(n, d), (n, d)
