"""Triton tree attention vs the PyTorch reference (specdec.attention.paged_attention).

Runs in the Triton interpreter on CPU (fp32, tight tolerance) and natively when a GPU is present
(also bf16/fp16). Covers prefill, decode, random trees, ragged batches, GQA, page sizes,
shuffled block tables, split-KV and the plan path the engine uses.
"""
from __future__ import annotations

import dataclasses

import pytest
from specdec.kernels.testing import LaunchSpy, kernel_device, random_case, reference_attention

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")

import torch  # noqa: E402
from specdec.kernels import tree_attention as ta  # noqa: E402
from specdec.kernels.tree_attention import TreeAttentionMetadata, tree_attention  # noqa: E402

from specdec.errors import InputError  # noqa: E402

TREE = "tree"


FP32_ATOL = 2e-5 if DEVICE == "cpu" else 1e-4  # GPU: other summation orders in both kernel and SDPA


def check(case, num_splits: int, atol: float = FP32_ATOL, via_plan: bool = False) -> None:
    meta = case.plan.kernel_metadata if via_plan else case.metadata()
    out = tree_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, num_splits=num_splits)
    ref = reference_attention(case)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


def test_interpreter_is_active():
    """The interpreter on CPU, native kernels on a GPU: what DEVICE says the tests of this file run."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(ta._tree_attn_kernel, InterpretedFunction)
    assert interpreted == (DEVICE == "cpu"), (
        "TRITON_INTERPRET=1 did not take effect: the kernels were imported before the test set it" if DEVICE == "cpu"
        else "the kernels run in the interpreter on a GPU: the tests would not check the native ones"
    )


CASES = {
    # name: (cache_lens, new tokens per sequence)
    "decode_ragged": ([9, 0, 23, 4], [1, 1, 1, 1]),
    "prefill_causal": ([0, 0], [7, 19]),
    "chunked_prefill": ([6, 11], [9, 5]),
    "tree_single": ([13], [(TREE, 10)]),
    "tree_ragged_mixed": ([5, 17, 0, 30], [(TREE, 6), 1, 4, (TREE, 12)]),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("group", [1, 3, 4])
def test_matches_reference(name, group):
    cache_lens, new = CASES[name]
    case = random_case(cache_lens, new, num_kv_heads=2, group=group, page_size=4, seed=group, device=DEVICE)
    check(case, num_splits=1)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_page_sizes_and_split_kv(page_size, num_splits):
    # contexts cross page and split boundaries; trees with many query tokens under split-KV
    case = random_case([37, 70, 2], [(TREE, 9), 1, 3], num_kv_heads=1, group=4, page_size=page_size,
                       seed=page_size + num_splits, device=DEVICE)
    check(case, num_splits=num_splits)


def test_split_kv_more_splits_than_keys():
    # empty split programs must merge as nothing (lse = -inf), not as zeros with weight
    case = random_case([3, 0], [(TREE, 4), 2], group=2, page_size=2, seed=5, device=DEVICE)
    check(case, num_splits=6)


def _poisoned_empty(monkeypatch):
    """torch.empty's and torch.empty_like's memory is whatever was there: here NaN, so what the kernels do not write
    shows (the partial results' workspace, the output)."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)

        def poisoned(*args, real=real, **kwargs):
            out = real(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        monkeypatch.setattr(torch, name, poisoned)


def _merge_launches(monkeypatch) -> list:
    """The grids of the launches of the merge kernel from now on (it still runs)."""
    spy = LaunchSpy(ta._merge_kernel)
    monkeypatch.setattr(ta, "_merge_kernel", spy)
    return spy.grids


def test_a_large_trees_short_context_fills_few_splits_and_the_empty_ones_write_nothing(monkeypatch):
    """A 65-token tree's 128-row tiles in half precision take chunks of at least 128 keys (``min_split_chunk``): over
    a context of ~300 keys, 3 of a CUDA-graph bucket's 8 splits hold keys. The others store no partial output (it
    stays as torch.empty left it, here NaN) and the merge reads none of it: the result is the reference's."""
    monkeypatch.setattr(ta, "MERGE_IN_KERNEL_MAX", 0)  # the merge kernel, as a 65-token tree's tiles on a GPU
    case = random_case([300], [(TREE, 64)], num_kv_heads=1, group=4, head_dim=16, page_size=16, seed=4,
                       device=DEVICE, dtype=torch.float16)
    _poisoned_empty(monkeypatch)
    parts, real = [], ta._partials
    monkeypatch.setattr(ta, "_partials", lambda *a, **k: parts.append(real(*a, **k)) or parts[-1])
    meta = case.plan.kernel_metadata
    out = tree_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, num_splits=8)
    err = (out.float() - reference_attention(case).float()).abs().max().item()
    assert err <= 2e-2, f"max abs error {err:.3g}"
    assert ta.min_split_chunk(128, 2) == 128
    keyed = -(-int(meta.ctx_lens[0]) // 128)
    part_o = parts[0][0]  # [9, T, H, D]: 8 splits and the masked keys' part
    assert keyed == 3 and part_o.shape[0] == 9
    assert torch.isfinite(part_o[:keyed]).all() and torch.isfinite(part_o[8]).all()
    assert torch.isnan(part_o[keyed:8]).all(), "a split without keys wrote its partial output"


def test_a_forwards_layers_share_one_launch_plan_per_shape(monkeypatch):
    """Every layer of a forward launches through the same metadata alike: its tile shape, tiles and split count are
    worked out at the first layer's call, not at each (host time of every eager forward, a prefill's). Another
    layer shape (split count, heads) gets a plan of its own, and every launch matches the reference."""
    case = random_case([9, 4], [(TREE, 5), 1], num_kv_heads=2, group=2, head_dim=16, page_size=4, seed=3,
                       device=DEVICE)
    planned = []
    real = ta.launch_config
    monkeypatch.setattr(ta, "launch_config", lambda *a, **k: planned.append(a) or real(*a, **k))
    meta = case.plan.kernel_metadata
    ref = reference_attention(case)
    for splits in (1, 1, 1, 2, 2):
        out = tree_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, num_splits=splits)
        assert (out - ref).abs().max().item() <= FP32_ATOL
    assert len(planned) == 2, planned  # one per split count
    q = case.q[:, :2]  # half the heads: a group of one over the same keys
    tree_attention(q, case.k_cache, case.v_cache, meta, case.scale, num_splits=1)
    assert len(planned) == 3 and planned[-1][0] == 1


def test_split_parts_are_merged_by_their_last_program_launch_after_launch(monkeypatch):
    """A small tile (here every one: head_dim 16) launches no merge: the last of each (tile, KV head)'s programs
    merges the parts and sets its count back to 0, so the next launch through the same metadata (the next layer, a
    CUDA graph's replay) merges again. A batch of decode rows and trees, by the plan and by the builder, two launches
    each."""
    n = 7
    case = random_case([5 + 3 * b for b in range(n)], [(TREE, 3) if b % 4 == 0 else 1 for b in range(n)],
                       num_kv_heads=2, group=2, head_dim=16, page_size=4, seed=13, device=DEVICE)
    ref = reference_attention(case)
    merges = []
    if DEVICE == "cpu":  # the interpreter calls the merge as Python; a GPU compiles it, and a patched one fails to
        real_merge = ta._merge_parts
        monkeypatch.setattr(ta, "_merge_parts", lambda *a, **k: merges.append(1) or real_merge(*a, **k))
    _poisoned_empty(monkeypatch)
    merge_launches = _merge_launches(monkeypatch)
    for meta, splits in ((case.metadata(), 2), (case.plan.kernel_metadata, 3)):
        for launch in range(2):
            merges.clear()
            out = tree_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, num_splits=splits)
            err = (out - ref).abs().max().item()
            assert err <= FP32_ATOL, f"{splits} splits, launch {launch}: max abs error {err:.3g}"
            (counts,) = meta._arrivals.values()
            pairs = meta.tiles(4)[0].numel() * 2  # (tile, KV head) pairs: BLOCK_Q 4 for GROUP 2, head_dim 16
            assert counts.numel() == pairs and not counts.any().item(), counts
            if DEVICE == "cpu":
                assert len(merges) == pairs, f"{len(merges)} merges for {pairs} tiles x KV heads: one program each"
    assert not merge_launches


def test_split_merge_of_large_tiles_over_more_sequences_than_it_reads_at_once(monkeypatch):
    """Tiles above MERGE_IN_KERNEL_MAX elements (a 65-token tree's) hand their parts to the merge kernel, which finds
    a row's sequence reading the batch MERGE_SEQS sequences at a time (one kernel for every batch size): a batch of
    more, decode rows and trees, every row merged from its parts, by the plan and by the builder."""
    monkeypatch.setattr(ta, "MERGE_IN_KERNEL_MAX", 0)
    merge_launches = _merge_launches(monkeypatch)
    n = ta.MERGE_SEQS + 3
    case = random_case([5 + 3 * b for b in range(n)], [(TREE, 3) if b % 4 == 0 else 1 for b in range(n)],
                       num_kv_heads=1, group=2, head_dim=16, page_size=4, seed=13, device=DEVICE)
    check(case, num_splits=2)
    check(case, num_splits=3, via_plan=True)
    assert len(merge_launches) == 2


def test_split_merge_reads_this_launchs_parts_launch_after_launch():
    """The last program of a tile reads parts the other programs of its launch wrote just before (their stores
    released, its reads acquired, past L1). On a GPU a read that came too early would find the workspace as the
    previous launch left it: the launches here alternate between two queries, so such a read shows as the other
    query's answer. Each output is compared bitwise with the first launch of its query (the merge reads the parts
    in one order, whichever program is last). Few launches in the interpreter, which runs programs in turn."""
    gpu = DEVICE != "cpu"
    launches = 200 if gpu else 2
    case = random_case([300, 77, 1000, 5, 640] * (2 if gpu else 1), [1, (TREE, 9), 1, 3, 1] * (2 if gpu else 1),
                       num_kv_heads=2, group=4, head_dim=64 if gpu else 16, page_size=16, seed=21, device=DEVICE)
    queries = (case.q, torch.flip(case.q, dims=(0,)).contiguous())
    meta = case.plan.kernel_metadata
    first = [tree_attention(q, case.k_cache, case.v_cache, meta, case.scale, num_splits=8) for q in queries]
    assert (first[0] - reference_attention(case)).abs().max().item() <= FP32_ATOL
    for launch in range(launches):
        out = tree_attention(queries[launch % 2], case.k_cache, case.v_cache, meta, case.scale, num_splits=8)
        assert torch.equal(out, first[launch % 2]), f"launch {launch} differs from the first of its query"


def test_contiguous_block_table_and_head_dim_not_power_of_two():
    case = random_case([20], [(TREE, 5)], num_kv_heads=1, group=3, head_dim=24, page_size=8, shuffle=False,
                       seed=9, device=DEVICE)
    check(case, num_splits=2)


def test_plan_path_with_65_token_tree_and_long_chunked_prefill():
    # the engine's 64-node tree has 65 new tokens (root + nodes): the root column is visible to all
    # queries and moves into the unmasked prefix; a >64-token causal run stays causal
    case = random_case([10, 3], [(TREE, 64), 70], num_kv_heads=1, group=2, page_size=16, seed=3, device=DEVICE)
    meta = case.plan.kernel_metadata
    assert meta.tree_mode.tolist() == [1, 0]
    assert meta.ctx_lens.tolist() == [11, 3] and meta.num_masked.tolist() == [64, 70]
    check(case, num_splits=2, via_plan=True)
    check(case, num_splits=2)  # the same tree through TreeAttentionMetadata.build (the kernel benchmark's path)


@pytest.mark.parametrize("name", ["decode_ragged", "tree_ragged_mixed"])
def test_plan_path_matches_block_table_path(name):
    cache_lens, new = CASES[name]
    case = random_case(cache_lens, new, group=3, page_size=4, seed=11, device=DEVICE)
    check(case, num_splits=1, via_plan=True)
    check(case, num_splits=2, via_plan=True)


def test_tree_bits_are_the_ancestor_rows():
    case = random_case([4], [(TREE, 63)], seed=2, device=DEVICE)
    meta = case.metadata()
    mask = case.new_masks[0]
    bits = meta.q_bits.cpu()
    for i in range(mask.shape[0]):
        got = [(int(bits[i]) >> j) & 1 == 1 for j in range(mask.shape[0])]
        assert got == mask[i].tolist()


def test_bad_inputs_are_named():
    case = random_case([4], [3], device=DEVICE)
    meta = case.metadata()
    with pytest.raises(ValueError, match="tokens"):
        tree_attention(case.q[:2], case.k_cache, case.v_cache, meta, case.scale)
    with pytest.raises(ValueError, match="64 bits"):  # 70 tokens, each seeing only itself: not a 64-bit tree
        TreeAttentionMetadata.build([list(range(18))], 4, [0], [torch.eye(70, dtype=torch.bool)])
    with pytest.raises(ValueError, match="square"):
        TreeAttentionMetadata.build([[0, 1]], 4, [0], [torch.ones(2, 3, dtype=torch.bool)])
    with pytest.raises(ValueError, match="block table covers"):
        TreeAttentionMetadata.build([[0]], 4, [3], [2])
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention(case.q, case.k_cache, case.v_cache, meta, case.scale, num_splits=0)


def test_a_block_table_filled_to_its_last_slot_is_taken():
    """2 cached keys + 2 new tokens = 4 keys: exactly the one block of 4 (3 + 2 = 5 does not fit, see above)."""
    meta = TreeAttentionMetadata.build([[0]], 4, [2], [2])
    assert meta.ctx_lens.tolist() == [2] and meta.num_masked.tolist() == [2] and meta.q_lens.tolist() == [2]


def test_a_causal_mask_wider_than_64_tokens_stays_causal():
    """A lower-triangular mask over more than 64 new tokens (a long prefill given as a mask) is the causal run it
    describes: no ancestor bits, every new token masked after the cached keys. Read as a tree it would need 99 bits
    after its first column (the only one every query sees) and be refused."""
    mask = torch.ones(100, 100, dtype=torch.bool).tril()
    meta = TreeAttentionMetadata.build([list(range(26))], 4, [3], [mask])  # 3 + 100 keys in 26 blocks of 4
    assert meta.tree_mode.tolist() == [0] and meta.ctx_lens.tolist() == [3] and meta.num_masked.tolist() == [100]
    assert not meta.q_bits.any()


def test_launch_config_tiles_keep_16_to_128_rows_as_documented():
    """BLOCK_M = BLOCK_Q * GROUP_PAD rows, at least 16 (the dots' smallest M), at most 128 in 16 bits up to head_dim
    256 (only wider heads, over 256, take 32-row tiles); float32 on a GPU runs its 32-row tiles on 8 warps."""
    def rows(group, head_dim, max_new, dtype, gpu=True):
        cfg = ta.launch_config(group, head_dim, max_new, dtype, gpu)
        return cfg["BLOCK_Q"] * cfg["GROUP_PAD"]

    assert rows(1, 64, 1, torch.float16) == 16  # a decode's one token: BLOCK_Q = 16 // 1 = 16
    assert ta.launch_config(4, 64, 1, torch.float16)["BLOCK_Q"] == 4  # 16 // GROUP_PAD 4 = 4 tokens, 16 rows
    assert rows(1, 256, 65, torch.float16) == 128  # next_power_of_2(65) = 128 tokens, the 16-bit cap of 128
    assert rows(1, 512, 65, torch.float16) == 32  # block_d 512 > 256: 32 rows
    assert ta.launch_config(1, 128, 32, torch.float32, gpu=True)["num_warps"] == 8  # 32 rows: 8 warps
    assert ta.launch_config(1, 128, 1, torch.float32, gpu=True)["num_warps"] == 4  # 16 rows: 4 warps


def test_a_split_tile_of_exactly_the_in_kernel_limit_merges_in_the_kernel():
    """MERGE_IN_KERNEL_MAX is the most elements (rows x BLOCK_D) a split tile may have and still merge its own
    parts: a tile of exactly that many takes no second launch, one of twice as many does."""
    # 32 causal tokens, group 1, head_dim 128, float32 off a GPU: BLOCK_Q = min(32, 64) = 32 rows, 32 x 128 = 4096
    meta = TreeAttentionMetadata.build([list(range(16))], 4, [20], [32])
    plan = ta._launch_plan(meta, 1, 1, 128, torch.zeros(32, 1, 128), 2, None)
    assert plan.cfg["BLOCK_Q"] * plan.cfg["BLOCK_D"] == 4096 == ta.MERGE_IN_KERNEL_MAX
    assert plan.split and plan.merge_in_kernel
    # 33 tokens: next_power_of_2(33) = 64 rows x 128 = 8192 > 4096
    meta = TreeAttentionMetadata.build([list(range(16))], 4, [20], [33])
    assert not ta._launch_plan(meta, 1, 1, 128, torch.zeros(33, 1, 128), 2, None).merge_in_kernel


@pytest.mark.skipif(DEVICE != "cuda", reason="half-precision kernels are checked natively on a GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_gpu(dtype):
    case = random_case([300, 1000, 7], [(TREE, 16), 1, 40], num_kv_heads=2, group=4, head_dim=128, page_size=16,
                       seed=1, device=DEVICE, dtype=dtype)
    check(case, num_splits=4, atol=2e-2)


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter's limits")
def test_bf16_is_refused_in_the_interpreter_whose_bf16_dots_are_wrong():
    """The interpreter's bf16 tl.dot returns garbage (output errors ~1e9): a bf16 model on the Triton backend on CPU
    got nonsense attention silently. It is refused by name; float16 runs there and matches the reference."""
    from specdec.kernels.dispatch import BackendError

    case = random_case([5], [(TREE, 3)], seed=4, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(BackendError, match="bfloat16 attention cannot run in the Triton interpreter"):
        tree_attention(case.q, case.k_cache, case.v_cache, case.metadata(), case.scale)
    half = random_case([5, 0], [(TREE, 3), 4], seed=4, device=DEVICE, dtype=torch.float16)
    check(half, num_splits=2, atol=4e-3)


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton interpreter's limits")
def test_a_bf16_model_is_refused_in_the_interpreter_also_in_the_bit_exact_mode(monkeypatch):
    """The bit-exact mode's kernels never reach tree attention's refusal: a bf16 model on the Triton backend in the
    interpreter ran there silently, its logits off the GPU kernels' by the interpreter's truncating bf16 casts
    (SPECDEC_ATTENTION=triton specdec generate --dtype bfloat16 --invariant). The runner refuses it when built."""
    from specdec.kernels.dispatch import BackendError

    import specdec
    from specdec.testing import build_tiny_model

    monkeypatch.setenv("SPECDEC_ATTENTION", "triton")
    model = build_tiny_model(vocab_size=32, num_hidden_layers=1).to(torch.bfloat16)
    with pytest.raises(BackendError, match="^a bfloat16 model cannot run on the Triton backend in the Triton "
                                           "interpreter"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, invariant=True)


@pytest.mark.parametrize("head_dim", [320, 512])
def test_heads_wider_than_256_match_reference(head_dim):
    """Up to MAX_HEAD_DIM the kernel matches the reference (16-bit tiles over such heads are capped at 32 rows:
    wider ones spilled registers on sm_90, see test_kernels_compile); past it the runner refuses the Triton backend
    when it is built, in one line naming head_dim and the limit, instead of compiling tiles that spill."""
    from specdec.models.llama import LlamaRunner
    from specdec.testing import build_tiny_model

    case = random_case([9, 3], [(TREE, 5), 1], num_kv_heads=1, group=2, head_dim=head_dim, seed=1, device=DEVICE)
    check(case, num_splits=2)
    assert ta.launch_config(4, head_dim, 65, torch.bfloat16)["BLOCK_Q"] * 4 == 32
    model = build_tiny_model(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=2 * head_dim)
    model = model.to(DEVICE)  # on a GPU, a CPU model is refused the Triton backend before its head_dim is judged
    with pytest.raises(InputError, match=rf"^head_dim {2 * head_dim} exceeds the Triton tree-attention kernel's "
                                         rf"limit of 512; use the reference backend"):
        LlamaRunner(model, backend="triton")


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_sweep(group, page_size, num_splits):
    gen = torch.Generator().manual_seed(group * 100 + page_size * 10 + num_splits)
    cache_lens = torch.randint(0, 90, (4,), generator=gen).tolist()
    kinds = [1, (TREE, 31), (TREE, 64), 17]
    case = random_case(cache_lens, kinds, num_kv_heads=2, group=group, head_dim=32, page_size=page_size,
                       seed=group + page_size, device=DEVICE)
    check(case, num_splits=num_splits, atol=1.5 * FP32_ATOL)
    check(case, num_splits=num_splits, atol=1.5 * FP32_ATOL, via_plan=True)


def test_static_bucket_inputs_match_reference_across_steps():
    """CUDA-graph buckets: one fixed buffer, two different steps (ragged, trees, shuffled pages) loaded into a
    bucket in place from the host, and a smaller bucket over the same memory: the kernel on the loaded metadata
    gives the reference's attention, and the staged write slots are the plan's."""
    from specdec.kernels.graph_metadata import StaticInputs

    inputs = StaticInputs(max_batch=4, max_tokens_per_seq=8, max_keys=64, block_size=4, scratch_slot=99,
                          device=DEVICE)
    bucket = inputs.bucket(batch=4, tokens_per_seq=8)
    buffers = [bucket.metadata.block_tables.data_ptr(), bucket.metadata.q_bits.data_ptr(), bucket.token_ids.data_ptr()]
    for seed, (cache_lens, new) in enumerate([([9, 30, 3], [1, (TREE, 6), 2]), ([40, 0], [(TREE, 7), 5])]):
        case = random_case(cache_lens, new, num_kv_heads=2, group=3, page_size=4, seed=seed, device=DEVICE)
        inputs.load_(bucket, case.forward_batch())
        n = case.q.shape[0]
        assert torch.equal(bucket.write_slots[:n].long(), case.plan.write_slots.to(DEVICE))
        assert bucket.write_slots[n:].eq(99).all() and bucket.metadata.q_lens[len(cache_lens):].eq(0).all()
        q = torch.zeros(32, *case.q.shape[1:], dtype=case.q.dtype, device=DEVICE)
        q[:n] = case.q
        for splits in (1, 2):
            out = tree_attention(q, case.k_cache, case.v_cache, bucket.metadata, case.scale, num_splits=splits)[:n]
            err = (out - reference_attention(case)).abs().max().item()
            assert err <= FP32_ATOL, f"step {seed}, {splits} splits: max abs error {err:.3g}"
    assert buffers == [bucket.metadata.block_tables.data_ptr(), bucket.metadata.q_bits.data_ptr(),
                       bucket.token_ids.data_ptr()]
    small = inputs.bucket(batch=2, tokens_per_seq=4)  # the same memory, its own layout and grid
    case = random_case([5, 11], [(TREE, 3), 1], num_kv_heads=2, group=3, page_size=4, seed=7, device=DEVICE)
    inputs.load_(small, case.forward_batch())
    assert small.token_ids.data_ptr() == bucket.token_ids.data_ptr() and small.metadata.num_tokens == 8
    q = torch.zeros(8, *case.q.shape[1:], dtype=case.q.dtype, device=DEVICE)
    q[: case.q.shape[0]] = case.q
    out = tree_attention(q, case.k_cache, case.v_cache, small.metadata, case.scale)[: case.q.shape[0]]
    assert (out - reference_attention(case)).abs().max().item() <= FP32_ATOL
    too_long = random_case([3], [9], device=DEVICE)
    with pytest.raises(ValueError, match="exceed the bucket"):
        inputs.load_(bucket, too_long.forward_batch())
    with pytest.raises(ValueError, match="does not fit"):
        inputs.bucket(batch=8, tokens_per_seq=8)


def test_a_buckets_padding_is_token_0_at_position_0_writing_the_scratch_slot_after_a_larger_step():
    """What a bucket's graph reads past a step's real rows is the module's padding, not the last larger step's
    values: token 0 at position 0 with no ancestor bits writing the scratch slot, and padded sequences all zero (no
    query, no keys); pad_ (a warm-up's inputs) leaves that padding alone in every row."""
    from specdec.kernels.graph_metadata import StaticInputs

    inputs = StaticInputs(max_batch=4, max_tokens_per_seq=8, max_keys=64, block_size=4, scratch_slot=99,
                          device=DEVICE)
    bucket = inputs.bucket(batch=4, tokens_per_seq=8)
    meta = bucket.metadata
    fields = (meta.ctx_lens, meta.num_masked, meta.q_starts, meta.q_lens, meta.tree_mode)
    for seed, (cache_lens, new) in enumerate([([9, 30, 3], [2, (TREE, 7), (TREE, 6)]), ([5], [(TREE, 3)])]):
        case = random_case(cache_lens, new, num_kv_heads=2, group=3, page_size=4, seed=seed, device=DEVICE)
        n = case.q.shape[0]
        step = dataclasses.replace(case.forward_batch(), tokens=list(range(11, 11 + n)),
                                   position_list=list(range(40, 40 + n)))
        inputs.load_(bucket, step)
        assert bucket.token_ids[:n].tolist() == step.tokens and bucket.positions[:n].tolist() == step.position_list
        assert meta.q_bits[:n].ne(0).any() and all(f[len(cache_lens) - 1] > 0 for f in fields[:2] + fields[3:])
    assert n == 4 and bucket.token_ids[n:].eq(0).all() and bucket.positions[n:].eq(0).all()
    assert meta.q_bits[n:].eq(0).all() and bucket.write_slots[n:].eq(99).all()
    assert all(f[1:].eq(0).all() for f in fields)
    inputs.pad_(bucket)
    assert bucket.write_slots.eq(99).all()
    assert all(t.eq(0).all() for t in (bucket.token_ids, bucket.positions, meta.q_bits, *fields))


@pytest.mark.parametrize("in_kernel", [True, False])
def test_split_launch_of_a_padded_bucket_whatever_the_memory_held(monkeypatch, in_kernel):
    """A CUDA-graph bucket's padding rows are covered by no tile: a split launch's real rows are merged from parts
    its programs wrote, whatever the workspace held before (poisoned with NaN here), and nothing is filled per layer
    to make it so. The merge kernel, which runs over every row, must not read a padding row's unwritten parts (it
    knows them by the sequences' query rows) and gives it zeros; a tile that merges its own parts leaves them as
    they were, as without splits (nothing reads them)."""
    from specdec.kernels.graph_metadata import StaticInputs

    if not in_kernel:
        monkeypatch.setattr(ta, "MERGE_IN_KERNEL_MAX", 0)
    real_full = torch.full
    inputs = StaticInputs(4, 8, max_keys=64, block_size=4, scratch_slot=0, device=DEVICE)
    bucket = inputs.bucket(batch=4, tokens_per_seq=8)
    meta = bucket.metadata
    case = random_case([9, 30, 3], [1, (TREE, 6), 2], num_kv_heads=2, group=3, page_size=4, seed=0, device=DEVICE)
    inputs.load_(bucket, case.forward_batch())
    n = case.q.shape[0]
    q = torch.zeros(32, *case.q.shape[1:], dtype=case.q.dtype, device=DEVICE)
    q[:n] = case.q
    planned = case.plan.kernel_metadata  # unpadded: every part of every row is written
    fills = []
    _poisoned_empty(monkeypatch)
    monkeypatch.setattr(torch, "full", lambda *a, **k: fills.append(a) or real_full(*a, **k))
    out = tree_attention(q, case.k_cache, case.v_cache, meta, case.scale, num_splits=2)
    out_planned = tree_attention(case.q, case.k_cache, case.v_cache, planned, case.scale, num_splits=2)
    monkeypatch.undo()
    ref = reference_attention(case)
    assert (out[:n] - ref).abs().max().item() <= FP32_ATOL
    if in_kernel:
        assert out[n:].isnan().all(), "a padding row is in no tile: no program writes it"
    else:
        assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padded rows must get zeros, not merged garbage"
    assert (out_planned - ref).abs().max().item() <= FP32_ATOL
    assert not fills  # no launch per layer prepares the parts


# ---- plans whose masked keys start before the new tokens (model drafters, issue 18) -----------------
def _drafter_plan_seq(committed: int, parents: list[int], num_new: int, query_start: int, slots: torch.Tensor):
    """A SeqAttention built like ModelDrafter._forward_nodes: `committed` keys (prefix + root) every query
    sees, then the scratch nodes of the tree so far (``parents[i] < i``, -1 = the root) in node order; the
    queries are the last `num_new` nodes, each seeing itself and its ancestors only. Earlier-depth nodes
    that are not ancestors sit among the keys BEFORE the new tokens and must stay hidden."""
    from specdec.attention import SeqAttention

    bits = []
    for i in range(len(parents) - num_new, len(parents)):
        word = 0
        while i != -1:
            word |= 1 << i
            i = parents[i]
        bits.append(word)
    keys = committed + len(parents)
    return SeqAttention(query_start, num_new, slots[:keys].to(DEVICE), committed,
                        torch.tensor(bits, dtype=torch.long, device=DEVICE))


WIDE_TREE = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]  # widths (2, 2, 2): the depth-3 level is the last 8


def _hidden_columns_case(committed: int, seed: int = 0):
    import types

    from specdec.attention import AttentionPlan, SeqAttention

    gen = torch.Generator().manual_seed(seed)
    num_slots = committed + len(WIDE_TREE) + 40
    slots = torch.randperm(num_slots, generator=gen)
    drafter = _drafter_plan_seq(committed, WIDE_TREE, 8, 0, slots)
    # the same forward also holds an engine-style verify (12 cached keys + root visible, 5 nodes) and a decode
    verify_slots = torch.randperm(num_slots, generator=gen)[:12 + 6].to(DEVICE)
    verify = random_case([12], [(TREE, 5)], seed=seed).plan.seqs[0]
    verify = SeqAttention(8, 6, verify_slots, 13, verify.ancestor_bits.to(DEVICE))
    decode = SeqAttention(14, 1, torch.randperm(num_slots, generator=gen)[:31].to(DEVICE), 30)
    seqs = (drafter, verify, decode)
    plan = AttentionPlan(seqs)
    kvh, group, dim = 2, 3, 16
    k_cache = torch.randn(num_slots, kvh, dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(num_slots, kvh, dim, generator=gen).to(DEVICE)
    q = torch.randn(15, kvh * group, dim, generator=gen).to(DEVICE)
    return types.SimpleNamespace(q=q, k_cache=k_cache, v_cache=v_cache, plan=plan, scale=dim**-0.5)


@pytest.mark.parametrize("committed", [5, 70])
def test_plan_path_honours_keys_hidden_before_the_new_tokens(committed):
    # issue 18: from_plan treated every key before a sequence's new tokens as visible to all its queries,
    # so a draft tree wider than 1 let depth >= 2 nodes see their uncles (0.2-0.4 off in the draft logits)
    case = _hidden_columns_case(committed, seed=committed)
    ref = reference_attention(case)
    for splits in (1, 2):
        out = ta.paged_tree_attention(case.q, case.k_cache, case.v_cache, case.plan, case.scale, num_splits=splits)
        err = (out - ref).abs().max().item()
        assert err <= FP32_ATOL, f"{splits} splits: max abs error {err:.3g}"
    meta = case.plan.kernel_metadata  # read from the plan as it is: the visible prefix, then the bits
    assert meta.ctx_lens.tolist() == [committed, 13, 30]
    assert meta.num_masked.tolist() == [len(WIDE_TREE), 5, 1]
    assert meta.tree_mode.tolist() == [1, 1, 0]


def test_draft_model_tree_logits_match_the_reference_backend(monkeypatch):
    """End to end through a draft-model drafter with a tree wider than 1 (issue 18): every draft forward
    (catch-up, then one per depth) gives the reference backend's logits under SPECDEC_ATTENTION=triton."""
    from specdec.drafters.draft_model import DraftModelDrafter

    from specdec.generate import generate
    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    target_model = build_tiny_model("llama-gqa-tied", 64).to(DEVICE)
    draft = build_tiny_model("llama-gqa-tied", 64, seed=7)

    class Spy(DraftModelDrafter):
        def _forward(self, *args, **kwargs):
            logits = super()._forward(*args, **kwargs)
            if self.record:
                self.logits.append(logits.float().cpu())
            return logits

        def propose(self, seqs):
            self.record = not self.logits  # the first proposal only: later ones depend on acceptance
            return super().propose(seqs)

        def propose_pending(self, seqs):  # on CUDA, through the verify's graphs, the static tree stays pending
            self.record = not self.logits
            return super().propose_pending(seqs)

    logits = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SPECDEC_ATTENTION", backend)  # read when the runners and caches are built
        spy = Spy(draft, widths=(2, 2), num_draft_tokens=3)
        spy.logits = []
        # "always": a draft model the target's size never pays, so the break-even guard would never ask it
        # 4 new tokens: the first tree is verified to depth 3, so the drafter runs every level (on a sequence's last
        # token it drafts nothing: no node would be verified)
        generate(load_model(target_model), [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9]], max_new_tokens=4, drafter=spy,
                 speculation="always")
        logits[backend] = spy.logits
    assert len(logits["triton"]) == len(logits["reference"]) == 3  # catch-up, depth 1, depth 2 (hidden uncles)
    for depth, (a, b) in enumerate(zip(logits["triton"], logits["reference"], strict=True)):
        assert a.shape == b.shape
        err = (a - b).abs().max().item()
        assert err <= 1e-4, f"draft forward {depth}: triton vs reference logits differ by {err:.3g}"
