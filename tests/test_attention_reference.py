"""The PyTorch reference attention (specdec.attention): the padded batch path (one SDPA call for
every sequence of a decode/verify forward) against the per-sequence path and a float64 softmax
written out by hand, on ragged batches with shuffled block tables, trees and GQA."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from specdec.kernels.testing import random_case

from specdec.attention import AttentionPlan, BatchBuilder, SeqAttention, paged_attention
from specdec.kv_cache import PagedKVCache


def _dense_float64(case) -> torch.Tensor:
    """Softmax attention over exactly the keys each query may see, in float64."""
    q, k, v = case.q.double(), case.k_cache.double(), case.v_cache.double()
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for s in case.plan.seqs:
        keys = k[s.key_slots].repeat_interleave(group, dim=1)  # [keys, heads, dim]
        values = v[s.key_slots].repeat_interleave(group, dim=1)
        for t in range(s.num_new):  # the plan's own description, expanded here by hand
            visible = torch.zeros(s.key_slots.numel(), dtype=torch.bool)
            visible[: s.num_visible] = True
            for j in range(s.num_masked):
                if (t >= j) if s.ancestor_bits is None else bool((int(s.ancestor_bits[t]) >> j) & 1):
                    visible[s.num_visible + j] = True
            scores = torch.einsum("hd,khd->hk", q[s.query_start + t], keys[visible]) * case.scale
            out[s.query_start + t] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[visible])
    return out


def _per_sequence(case) -> torch.Tensor:
    out = torch.empty_like(case.q)
    for s in case.plan.seqs:
        one = AttentionPlan((s,))
        assert one.padded is None
        rows = slice(s.query_start, s.query_start + s.num_new)
        out[rows] = paged_attention(case.q, case.k_cache, case.v_cache, one, case.scale)[rows]
    return out


CASES = {
    "decode_ragged": ([3, 17, 40, 1], [1, 1, 1, 1]),
    "trees_ragged": ([5, 33, 0, 12], [("tree", 7), ("tree", 1), ("tree", 9), 1]),
    "chain_and_decode": ([20, 8], [4, 1]),
}


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_padded_batch_matches_per_sequence_and_float64(name, group):
    lens, new = CASES[name]
    case = random_case(lens, new, num_kv_heads=2, group=group, seed=len(name) + group)
    assert case.plan.padded is not None  # the batched path is the one under test
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.plan, case.scale)
    assert torch.allclose(got, _per_sequence(case), atol=1e-5, rtol=0)
    assert torch.allclose(got.double(), _dense_float64(case), atol=1e-5, rtol=0)


def test_padding_never_reads_an_unwritten_slot():
    """Slots no sequence owns hold NaN (as never-written cache memory may): the padded batch still gives
    the per-sequence result. Padding that read slot 0 turned whole sequences' outputs into NaN."""
    case = random_case([3, 17, 40], [("tree", 5), 1, 2], num_kv_heads=2, group=3, seed=7)
    used = torch.zeros(case.k_cache.shape[0], dtype=torch.bool)
    for seq in case.plan.seqs:
        used[seq.key_slots] = True
    assert not used[0], "the case must leave slot 0 unowned"
    case.k_cache[~used] = float("nan")
    case.v_cache[~used] = float("nan")
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.plan, case.scale)
    assert not got.isnan().any()
    assert torch.allclose(got, _per_sequence(case), atol=1e-5, rtol=0)


def test_prefill_keeps_the_per_sequence_path():
    case = random_case([0, 6], [5, 1], seed=3)  # a prompt prefill (causal run) next to a decode
    assert case.plan.padded is None
    got = paged_attention(case.q, case.k_cache, case.v_cache, case.plan, case.scale)
    assert torch.allclose(got.double(), _dense_float64(case), atol=1e-5, rtol=0)


def test_a_wrong_mask_is_caught():
    """The float64 check can fail: letting one tree node see a non-ancestor changes its output."""
    case = random_case([6, 9], [("tree", 6), 1], seed=5)
    s = case.plan.seqs[0]
    row, hidden = next((r, j) for r in range(s.num_new) for j in range(s.num_masked)
                       if not (int(s.ancestor_bits[r]) >> j) & 1)  # the random tree hides some node from a row
    bits = s.ancestor_bits.clone()
    bits[row] |= 1 << hidden
    bad = AttentionPlan((dataclasses.replace(s, ancestor_bits=bits),) + case.plan.seqs[1:])
    got = paged_attention(case.q, case.k_cache, case.v_cache, bad, case.scale)
    assert not torch.allclose(got.double(), _dense_float64(case), atol=1e-5, rtol=0)


@pytest.mark.parametrize("new", [1, 5, ("tree", 7)])
def test_contiguous_keys_are_read_in_place_with_the_same_result(new):
    """A lone sequence whose blocks are consecutive reads a view of the cache instead of a
    gathered copy; shuffled blocks still gather. Both must equal the float64 softmax."""
    in_order = random_case([37], [new], shuffle=False, spare_blocks=0, seed=11)
    shuffled = random_case([37], [new], shuffle=True, seed=11)
    s = in_order.plan.seqs[0]
    assert s.contiguous_start == int(s.key_slots[0])
    assert shuffled.plan.seqs[0].contiguous_start is None
    for case in (in_order, shuffled):
        got = paged_attention(case.q, case.k_cache, case.v_cache, case.plan, case.scale)
        assert torch.allclose(got.double(), _dense_float64(case), atol=1e-5, rtol=0)


def test_contiguous_start_needs_every_slot_in_order():
    """Right endpoints are not enough: blocks [0, 2, 1, 3] span 0..15 but are out of order."""
    slots = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15])
    assert SeqAttention(0, 1, slots, 15).contiguous_start is None
    assert SeqAttention(0, 1, torch.arange(16) + 32, 15).contiguous_start == 32


def test_prefill_builds_no_quadratic_mask():
    """A prompt's prefill is a causal run: no [n, n] bool mask (about 1 GiB at 32k tokens) is built for it,
    on any device; the attention takes SDPA's causal path (or the kernel's causal mode) instead."""
    from torch.overrides import TorchFunctionMode

    import specdec
    from specdec.testing import build_tiny_model

    n = 400

    class BoolSizes(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.largest = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dtype == torch.bool:
                self.largest = max(self.largest, out.numel())
            return out

    with BoolSizes() as sizes:
        specdec.generate(build_tiny_model(), [[1 + i % 90 for i in range(n)]], max_new_tokens=2)
    assert sizes.largest < n * 4, f"a {sizes.largest}-element bool tensor for a {n}-token prompt"


def test_a_sequence_description_that_does_not_add_up_is_refused():
    keys = torch.arange(70)
    assert SeqAttention(0, 5, keys[:20], 15).causal_run
    with pytest.raises(ValueError, match="num_visible=21 is outside"):
        SeqAttention(0, 1, keys[:20], 21)
    with pytest.raises(ValueError, match="causal run of 5 new tokens needs exactly 5 masked keys"):
        SeqAttention(0, 5, keys[:20], 10)
    with pytest.raises(ValueError, match="at most 64 masked keys"):
        SeqAttention(0, 2, keys, 5, torch.ones(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"ancestor_bits must be \[3\]"):
        SeqAttention(0, 3, keys[:20], 15, torch.ones(2, dtype=torch.long))


def test_the_builder_keeps_int64_bits_ids_and_positions_whatever_the_caller_built():
    """BatchBuilder stores a tree's ancestor bits as the int64 SeqAttention documents whatever integer type the
    caller built them in (a drafter reading plan.seqs meets one type), and moves token ids and positions as int64;
    positions may be given as a tensor or a range."""
    cache = PagedKVCache(1, 1, 4, 4, 4)
    for seq_id, keys in ((0, 6), (1, 3)):
        cache.add(seq_id)
        cache.reserve(seq_id, keys)
    builder = BatchBuilder(cache, torch.device("cpu"))
    builder.add(0, [7, 8, 9], torch.tensor([2, 3, 3], dtype=torch.int32), 6, 3, torch.tensor([1, 3, 5],
                                                                                               dtype=torch.int32))
    builder.add(1, [4], range(2, 3), 3, 2)
    batch = builder.build()
    tree, decode = batch.plan.seqs
    assert tree.ancestor_bits.dtype == torch.long and tree.ancestor_bits.tolist() == [1, 3, 5]
    assert decode.ancestor_bits is None and batch.position_list == [2, 3, 3, 2]
    assert all(type(p) is int for p in batch.position_list)  # host ints, not 0-d tensors
    assert batch.token_ids.dtype == batch.positions.dtype == torch.long
    assert batch.token_ids.tolist() == [7, 8, 9, 4] and batch.positions.tolist() == [2, 3, 3, 2]
