"""Fixed-shape (CUDA-graph) verify forwards vs the engine's eager forward.

On CPU the padded static forward runs eagerly in the Triton interpreter (nothing to capture);
with a GPU the same tests capture and replay real CUDA graphs.
"""
from __future__ import annotations

import pytest
from specdec.kernels.testing import PADDED_ROWS_WARNINGS, LaunchSpy, kernel_device, triton_tiny_model

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
import weakref  # noqa: E402

import torch  # noqa: E402
from specdec.drafters.base import Drafter  # noqa: E402

from specdec.attention import BatchBuilder  # noqa: E402
from specdec.cuda_graphs import (  # noqa: E402
    GraphConfig,
    GraphedForward,
    auto_uses_graphs,
    current_model_graphs,
    model_graphs,
    release_model_graphs,
)
from specdec.engine import Engine  # noqa: E402
from specdec.errors import InputError, InputTypeError  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.kv_cache import CacheFullError, PagedKVCache  # noqa: E402
from specdec.models.llama import LlamaRunner  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.rejection import rejection_sample  # noqa: E402
from specdec.sampling import SamplingConfig  # noqa: E402
from specdec.stopping import StopCriteria  # noqa: E402
from specdec.testing import RandomTreeDrafter, build_tiny_model, ragged_prompts  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402

VOCAB = 64
CAPTURE = DEVICE == "cuda"
pytestmark = [pytest.mark.filterwarnings(w) for w in PADDED_ROWS_WARNINGS]  # padded rows' garbage


@pytest.fixture(scope="module")
def loaded():
    """The tiny model on the Triton backend (interpreter on CPU): runner and, through it, every cache."""
    return triton_tiny_model(VOCAB, DEVICE)


def small_model_graphs(monkeypatch, where, **buckets):
    """The model's own graph cache (``model_graphs``, as ``cuda_graphs="auto"`` builds it) gets only these buckets:
    ``where`` is the name its caller looks ``model_graphs`` up by."""
    monkeypatch.setattr(where, functools.partial(model_graphs, config=GraphConfig(capture=CAPTURE, **buckets)))


def on_reference(loaded):
    """The same weights on the PyTorch reference backend."""
    return dataclasses.replace(loaded, runner=LlamaRunner(loaded.model, backend="reference"))


def make_cache(runner, blocks: int = 64, seed: int = 0) -> PagedKVCache:
    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, blocks, 4, runner.dtype, runner.device,
                         runner.backend)
    cache._free = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed)).tolist()  # shuffled tables
    return cache


def test_buckets_give_the_eager_logits_step_after_step(loaded):
    """Several verify steps of a ragged batch with random trees, through buckets that are reused with
    other contents and other sizes: the real rows' logits and hidden states equal the eager forward's."""
    runner = loaded.runner
    cache = make_cache(runner)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1, 2, 4), tokens_per_seq=(1, 4, 8, 16),
                                                        capture=CAPTURE))
    drafter = RandomTreeDrafter(VOCAB, max_nodes=12, max_depth=4, seed=3)
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(40), drafter=drafter)
    engine.add(ragged_prompts(3, VOCAB, seed=1, max_len=30))
    seen, steps = set(), 0
    for step in range(12):
        live = engine.live
        if not live:
            break
        if step == 6:  # a lone sequence: the batch-1 bucket after the batch-4 one
            for s in live[1:]:
                s.finish_reason = "length"
            live = live[:1]
        trees = engine.propose(live)
        batch = engine.verify_batch(live, trees)
        eager = engine.verify(batch)
        key = graphed.bucket_for(len(live), max(1 + t.num_nodes for t in trees))
        seen.add(key)
        static = graphed(batch)
        assert static is not None and static.logits.shape == eager.logits.shape
        # the bucket's forward stops at the final hidden states of all its (padded) rows: no rows x vocab
        # logits; the LM head ran on the step's real rows only
        assert graphed.buckets[key].output.logits is None and static.logits.shape[0] == batch.token_ids.numel()
        err = (static.logits - eager.logits).abs().max().item()
        assert err <= 1e-4, f"step {step}: logits differ by {err:.3g}"
        assert (static.hidden - eager.hidden).abs().max().item() <= 1e-4
        acceptances = rejection_sample(trees, eager.logits[batch.row_index], engine.sampling, None)
        engine.commit(live, acceptances)
        steps += 1
    assert len(seen) >= 3, f"the test exercised only buckets {seen}"
    assert graphed.replays == steps >= 8


def test_engine_with_buckets_is_greedy_identical(loaded):
    """Whole generations of a ragged batch: random-tree drafts (rejections and compaction) through the
    buckets give the tokens of the reference engine (PyTorch ops, eager); so does generate()
    with the n-gram drafter and cuda_graphs=True."""
    reference = on_reference(loaded)
    # smaller in the Triton interpreter (CPU), where this test alone took ~3 of CI's 25 minutes
    num_prompts, new_tokens = (3, 16) if CAPTURE else (2, 10)
    prompts = ragged_prompts(num_prompts, VOCAB, seed=2, max_len=24)
    outs = {}
    for backend in ("reference", "triton"):
        runner = reference.runner if backend == "reference" else loaded.runner
        cache = make_cache(runner, blocks=96, seed=1)
        graphed = GraphedForward(runner, cache, GraphConfig(capture=CAPTURE)) if backend == "triton" else None
        engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(new_tokens),
                        drafter=RandomTreeDrafter(VOCAB, seed=5),
                        graphed=graphed)
        seqs = engine.add(prompts)
        while engine.live:
            engine.step()
        outs[backend] = [s.new_tokens for s in seqs]
        if graphed is not None:
            assert graphed.replays == engine.forward_passes > 0
            assert graphed.prefill_replays == 1  # the prompts' prefill: one chunk (GraphedForward.prefill_chunk)
    assert outs["triton"] == outs["reference"]
    # in the interpreter, speculation="auto" first calibrates the cost model: ~65 verify sizes, 80 of this test's
    # 112 s on CPU; on a GPU the default runs, calibration and tree sizing included
    via_api = generate(loaded, prompts, max_new_tokens=new_tokens, drafter="ngram", cuda_graphs=True,
                       speculation="auto" if CAPTURE else "always")
    plain = generate(reference, prompts, max_new_tokens=new_tokens)
    assert via_api == plain


def test_draft_model_forwards_run_through_buckets_of_its_own(loaded):
    """The draft-model drafter's forwards after its first catch-up (a prefill: eager) run through graph buckets over
    a cache kept with the draft model and reused by the next call. Drafting with the target itself, while the
    target verifies through its own buckets, the two caches stay apart: the trees (there pending: verified before
    the host reads them) are those of eager drafting on the reference backend, the tokens plain decoding's."""
    from specdec.drafters.draft_model import DraftModelDrafter

    class Recorder(DraftModelDrafter):
        def propose(self, seqs):
            return self.record(seqs, super().propose(seqs))

        def propose_pending(self, seqs):  # the target's verify through buckets: the trees stay on the device
            pending = super().propose_pending(seqs)
            self.pending += 1
            return dataclasses.replace(pending, read=lambda: self.record(seqs, pending.read()))

        def record(self, seqs, trees):
            self.seen.update((tuple(v.token_ids), (t.tokens.tolist(), t.parents.tolist()))
                             for v, t in zip(seqs, trees, strict=True))
            return trees

    reference = on_reference(loaded)
    prompts = ragged_prompts(3, VOCAB, seed=3, max_len=16)[1:]
    kw = dict(max_new_tokens=8, speculation="always")
    eager = Recorder(model=reference, num_draft_tokens=3, widths=(2,), cuda_graphs=False)
    eager.seen, eager.pending = {}, 0
    plain = generate(reference, prompts, max_new_tokens=8)
    assert generate(reference, prompts, drafter=eager, **kw) == plain
    graphed = Recorder(model=loaded, num_draft_tokens=3, widths=(2,), cuda_graphs=True)
    graphed.seen, graphed.pending = {}, 0
    verify_graphs = model_graphs(loaded.runner, 16, 16)  # what cuda_graphs="auto" gives the target on a GPU
    assert generate(loaded, prompts, drafter=graphed, cuda_graphs=verify_graphs, **kw) == plain
    assert graphed.seen == eager.seen and graphed.graphed.replays == graphed.draft_forwards - 1 > 0
    assert graphed.pending > 0 == eager.pending  # the target's verify replays buckets only for the second
    assert graphed.graphed is not verify_graphs and graphed.graphed.cache is graphed.cache
    assert verify_graphs.replays > 0 and model_graphs(loaded.runner, 16, 16) is verify_graphs  # both kept
    again = DraftModelDrafter(model=loaded, num_draft_tokens=3, widths=(2,), cuda_graphs=True)
    assert generate(reference, prompts, drafter=again, **kw) == plain
    assert again.graphed is graphed.graphed  # kept with the draft model
    assert release_model_graphs(loaded) and release_model_graphs(loaded) is False
    with pytest.raises(InputError, match="Triton backend"):
        generate(reference, prompts, drafter="draft-model", drafter_options={"model": reference, "cuda_graphs": True},
                 **kw)


def test_two_draft_model_drafters_over_one_model_do_not_share_its_graph_cache(loaded):
    """Two children of the combined drafter over one draft model, both through CUDA graphs: sharing the model's
    draft graph cache, each catch-up found the other's sequences caught up to the root and started them over (a
    whole prefill per step). The second drafts eagerly in a cache of its own; the text stays plain decoding's."""
    from specdec.drafters.combined import CombinedDrafter
    from specdec.drafters.draft_model import DraftModelDrafter

    release_model_graphs(loaded)
    prompts = ragged_prompts(3, VOCAB, seed=5, max_len=16)[1:]
    kw = dict(max_new_tokens=10, speculation="always")
    first, second = (DraftModelDrafter(model=loaded, num_draft_tokens=3, widths=w, cuda_graphs=True)
                     for w in ((1,), (2,)))
    restarts = []
    real_free = PagedKVCache.free

    def free(cache, seq_id):  # a sequence freed in a draft cache while it is still being generated
        restarts.append(seq_id)
        return real_free(cache, seq_id)

    PagedKVCache.free = free
    try:
        out = generate(loaded, prompts, drafter=CombinedDrafter([first, second]), cuda_graphs=False, **kw)
    finally:
        PagedKVCache.free = real_free
    assert out == generate(loaded, prompts, max_new_tokens=10, cuda_graphs=False)
    assert first.graphed is not None and first.cache is first.graphed.cache
    assert second.graphed is None and second.cache is not first.cache
    # each sequence freed at its end from the target's cache and each drafter's, never restarted mid-generation
    assert len(restarts) == 3 * len(prompts)
    again = DraftModelDrafter(model=loaded, num_draft_tokens=3, widths=(1,), cuda_graphs=True)
    generate(loaded, prompts, drafter=again, cuda_graphs=False, **kw)  # a later call: the graphs are its own
    assert again.graphed is first.graphed
    release_model_graphs(loaded)


def test_fused_projections_on_the_triton_path(loaded):
    """A packed copy of the model (one QKV and one gate/up product per layer, so q, k and v reach the RoPE and
    KV-write kernels as row-strided views) decodes the reference backend's tokens through graph buckets."""
    import copy

    from specdec.models.fused_projections import pack_projections

    packed = copy.deepcopy(loaded.model)
    pack_projections(packed)
    fused = dataclasses.replace(loaded, model=packed, runner=LlamaRunner(packed, backend="triton"))
    assert fused.runner.fused_projections()
    prompts = ragged_prompts(2, VOCAB, seed=4, max_len=12)
    plain = generate(on_reference(loaded), prompts, max_new_tokens=6)
    assert generate(fused, prompts, max_new_tokens=6, cuda_graphs=True) == plain


def test_warm_up_builds_the_buckets_ahead_and_writes_only_the_scratch_slot(loaded):
    """A measurement's warm-up builds (on CUDA: captures) every bucket of up to N sequences on padding alone: no
    sequence's K/V changes, and the generations after it meet no new bucket and give the eager tokens."""
    runner = loaded.runner
    graphed = GraphedForward(runner, make_cache(runner, seed=1),  # shuffled: the scratch slot is not slot 0
                             GraphConfig(batch_sizes=(1, 2, 4), tokens_per_seq=(1, 4, 8), capture=CAPTURE))
    assert graphed.scratch_slot != 0
    kv = graphed.cache.kv
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)).to(kv))
    before = kv.clone()
    assert graphed.warm_up(2) == 6 and graphed.warm_up(1) == 0  # batches 1 and 2 x 3 sizes, once
    scratch = torch.zeros(kv.shape[2], dtype=torch.bool)
    scratch[graphed.scratch_slot] = True
    assert torch.equal(kv[:, :, ~scratch], before[:, :, ~scratch])
    buckets = dict(graphed.buckets)
    assert sorted(buckets) == [(b, t) for b in (1, 2) for t in (1, 4, 8)]
    assert all((b.graph is not None) == CAPTURE for b in buckets.values())
    prompts = [[4, 5, 6, 4, 5, 6, 4], [7, 8, 9]]
    drafter = RandomTreeDrafter(VOCAB, max_nodes=7, seed=2)
    out = generate(loaded, prompts, max_new_tokens=10, cuda_graphs=graphed, drafter=drafter, speculation="always",
                   block_size=4)
    assert out == generate(loaded, prompts, max_new_tokens=10)
    assert graphed.buckets == buckets and graphed.replays > 0  # every step met a bucket built ahead
    assert graphed.warm_up(3) == 3  # up to the bucket that holds 3 sequences
    with pytest.raises(ValueError, match="at most 4"):
        graphed.warm_up(5)


def test_warm_up_model_graphs_sizes_the_models_cache_once(loaded, monkeypatch):
    from specdec import cuda_graphs

    assert cuda_graphs.warm_up_model_graphs(on_reference(loaded).runner, [[5]], 8) is None  # "auto" is eager there
    release_model_graphs(loaded)
    monkeypatch.setattr(cuda_graphs, "auto_uses_graphs", lambda runner: True)  # as on CUDA
    small_model_graphs(monkeypatch, "specdec.cuda_graphs.model_graphs", batch_sizes=(1, 2, 4), tokens_per_seq=(1, 8))
    graphed = cuda_graphs.warm_up_model_graphs(loaded.runner, [[30], [3, 100]], 20)
    assert graphed is loaded.model.__dict__["_specdec_graphed_forward"]
    assert graphed.cache.num_blocks - 1 == 6 + 12  # the largest call's blocks (a whole tree on top), and the scratch
    assert sorted(graphed.buckets) == [(1, 1), (1, 8), (2, 1), (2, 8)]  # up to the largest call's sequences
    assert len(cuda_graphs.warm_up_model_graphs(loaded.runner, [[5] * 6], 8).buckets) == 6  # more than any bucket
    monkeypatch.setattr("specdec.kv_cache.available_memory_bytes", lambda device: 1)
    with pytest.raises(CacheFullError, match="only 0.00 GiB are available"):  # as generate() refuses it, in a line
        cuda_graphs.warm_up_model_graphs(loaded.runner, [[5] * 600], 8)
    with pytest.raises(ValueError, match="at least one prompt"):
        cuda_graphs.warm_up_model_graphs(loaded.runner, [[]], 8)
    release_model_graphs(loaded)


def test_the_largest_tree_verifies_through_a_bucket(loaded):
    """The root and a 64-node tree, 65 query tokens, the largest step the engine verifies, runs through a bucket of
    the default config as every smaller step does. The buckets stopped at 64 tokens: on a GPU such a step ran
    eagerly, and so did the cost model's calibration of that size, from which every tree of 33-64 nodes was
    priced."""
    from specdec.eval.oracle_drafter import AcceptanceProfile, OracleDrafter, reference_continuations

    from specdec.cost_model import CalibrationConfig
    from specdec.tree import MAX_TREE_NODES

    assert max(CalibrationConfig().sizes) <= GraphConfig().tokens_per_seq[-1]  # every size calibrated is replayed
    prompts = [[1, 2, 3, 4, 5, 6]]
    reference = reference_continuations(loaded, prompts, 10, eos_token_id=[])
    graphed = GraphedForward.with_cache(loaded.runner, max_tokens=256, config=GraphConfig(capture=CAPTURE))
    oracle = OracleDrafter(reference, AcceptanceProfile.for_tau(3.0, 8, 8), seed=1)  # 8 levels x 8: 64 nodes
    out = generate(loaded, prompts, max_new_tokens=10, eos_token_id=[], cuda_graphs=graphed, drafter=oracle,
                   speculation="always", return_dict=True)
    assert out.new_tokens == [reference[tuple(prompts[0])]]
    assert out.stats[0].step_nodes[0] == MAX_TREE_NODES
    assert graphed.replays == out.forward_passes


def test_steps_outside_every_bucket_fall_back(loaded, caplog):
    runner = loaded.runner
    cache = make_cache(runner)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1,), tokens_per_seq=(1, 2), capture=CAPTURE))
    assert graphed.bucket_for(1, 1) == (1, 1) and graphed.bucket_for(1, 2) == (1, 2)
    assert graphed.bucket_for(2, 1) is None and graphed.bucket_for(1, 3) is None
    drafter = RandomTreeDrafter(VOCAB, max_nodes=6, seed=0)
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(12), drafter=drafter, graphed=graphed)
    seqs = engine.add([[1, 2, 3, 4, 5]])
    with caplog.at_level(logging.INFO, logger="specdec.cuda_graphs"):
        while engine.live:
            engine.step()
    reference = generate(loaded, [[1, 2, 3, 4, 5]], max_new_tokens=12)[0][5:]
    assert seqs[0].new_tokens == reference
    assert 0 < graphed.replays < engine.forward_passes  # some steps fit (1-2 tokens), the larger ones did not
    said = [r for r in caplog.records if "fits no CUDA-graph bucket" in r.getMessage()]
    assert len(said) == 1 and "(at most 1 x 2" in said[0].getMessage()  # once, not at every such step
    assert cache.num_free_blocks < cache.num_blocks  # the scratch block stays reserved


def _decode_step(cache, token: int):
    """A one-token step of sequence 0 over 3 cached keys (random K/V: the cache's memory may hold NaN)."""
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(0)).to(cache.kv))
    cache.add(0)
    cache.reserve(0, 4)
    builder = BatchBuilder(cache, cache.kv.device)
    builder.add(0, [token], [3], num_keys=4, num_visible=3)
    return builder.build()


def test_a_step_of_exactly_the_buckets_keys_fits_and_one_more_does_not(loaded):
    graphed = GraphedForward(loaded.runner, make_cache(loaded.runner), GraphConfig(capture=CAPTURE))
    assert graphed.fits(1, 1, graphed.max_keys) and not graphed.fits(1, 1, graphed.max_keys + 1)


def test_a_prompt_of_exactly_the_buckets_keys_is_prefilled_in_chunks(loaded):
    # 32 blocks of 4: max_keys = 128 (the tiny model's positions reach further), 128 / 64 = 2 chunks
    graphed = GraphedForward(loaded.runner, make_cache(loaded.runner, blocks=32), GraphConfig(capture=CAPTURE))
    assert graphed.max_keys == 128
    assert graphed.prefill_chunk([128]) == 64 and graphed.prefill_chunk([129]) is None


def test_token_ids_past_the_vocabulary_run_as_the_last_id(loaded):
    """A drafter's device token ids past the vocabulary (a row with no law) are clamped to the last id, VOCAB - 1:
    the same logits as the step given that id, not an embedding read out of range."""
    runner = loaded.runner
    graphed = GraphedForward(runner, make_cache(runner), GraphConfig(batch_sizes=(1,), tokens_per_seq=(1,),
                                                                     capture=CAPTURE))
    batch = _decode_step(graphed.cache, VOCAB - 1)
    want = graphed(batch).logits.clone()
    assert want.isfinite().all()
    for past in (VOCAB, VOCAB + 7):
        got = graphed(batch, token_ids=torch.tensor([past], device=runner.device))
        assert torch.equal(got.logits, want)


def test_an_eager_step_after_a_failed_capture_is_not_reported_again(loaded, caplog):
    """After a failed capture (warned then) every step runs eagerly: no info line that a step fits no bucket."""
    graphed = GraphedForward(loaded.runner, make_cache(loaded.runner), GraphConfig(capture=CAPTURE))
    graphed.failed = True
    with caplog.at_level(logging.DEBUG, logger="specdec.cuda_graphs"):
        assert graphed(_decode_step(graphed.cache, 5)) is None
    assert not caplog.records


def test_a_models_graph_cache_counts_the_scratch_block_against_what_fits(loaded):
    """model_graphs asks check_fits for the request's blocks plus the scratch slot's: 5 blocks need 6."""
    release_model_graphs(loaded)
    asked = []

    def check_fits(blocks):
        asked.append(blocks)
        if blocks > 5:
            raise CacheFullError("too big")

    with pytest.raises(CacheFullError):
        model_graphs(loaded.runner, 16, 5, check_fits, config=GraphConfig(capture=CAPTURE))
    assert asked == [6] and current_model_graphs(loaded.runner) is None


def test_a_graphed_forwards_cache_serves_a_request_needing_exactly_its_free_blocks(loaded):
    # max_tokens 64 in blocks of 16: 4 blocks + the scratch block, 4 free
    graphed = GraphedForward.with_cache(loaded.runner, 64, 16, GraphConfig(capture=CAPTURE))
    assert graphed.cache_for(loaded.runner, 16, 4) is graphed.cache
    with pytest.raises(InputError, match="may need 5 KV blocks"):
        graphed.cache_for(loaded.runner, 16, 5)


def test_releasing_a_model_frees_its_draft_graph_cache_too(loaded):
    release_model_graphs(loaded)
    draft = model_graphs(loaded.runner, 16, 2, config=GraphConfig(capture=CAPTURE), role="draft")
    assert current_model_graphs(loaded.runner) is None and current_model_graphs(loaded.runner, "draft") is draft
    assert release_model_graphs(loaded)  # it had one: as a draft model
    assert current_model_graphs(loaded.runner, "draft") is None and draft.discarded and draft.cache.kv.numel() == 0


def test_a_failed_capture_falls_back_to_eager_forwards(loaded, monkeypatch, caplog):
    """A capture that raises (an unsupported op, out of memory) costs the graphs, not the generation: the engine
    verifies eagerly from then on, with the same tokens, and says so once."""
    runner = loaded.runner
    graphed = GraphedForward.with_cache(runner, max_tokens=256, block_size=16, config=GraphConfig(capture=CAPTURE))
    graphed.config = dataclasses.replace(graphed.config, capture=True)  # as on CUDA, where buckets get captured
    captures = []

    def failing(bucket):
        captures.append(bucket)
        graphed._run(bucket)  # the warm-up, which writes the loaded step's K/V, ran before capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed, "_capture", failing)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    drafter = RandomTreeDrafter(VOCAB, max_nodes=6, seed=0)
    with caplog.at_level(logging.WARNING, logger="specdec.cuda_graphs"):
        out = generate(loaded, prompts, max_new_tokens=10, cuda_graphs=graphed, drafter=drafter,
                       speculation="always")
    assert out == generate(loaded, prompts, max_new_tokens=10)
    assert graphed.failed and len(captures) == 1 and graphed.replays == 0
    assert sum("CUDA-graph capture failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("queue_ahead", [False, True])
def test_a_graphed_step_moves_its_inputs_in_one_copy(loaded, monkeypatch, gpu_products, queue_ahead):
    """Outside the replayed forward a plain graphed step runs the LM head and the greedy choice, and moves its
    inputs (token ids, positions, write slots, the attention metadata) in at most one copy: no per-field copies,
    fills or index uploads, each of which is a launch, and on a GPU the host's time, every step. Queued ahead
    (specdec.decode_ahead), a step launches the next one's: the same, the roots' copy from the device and their
    clamp, and the choices' copy to the host."""
    from specdec.launches import Launches

    runner, s = loaded.runner, loaded.runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 4, 32, runner.dtype, runner.device, runner.backend)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 2), capture=CAPTURE))
    counter, real_run = Launches(), GraphedForward._run

    def run(self, *args):  # what a replay runs is counted apart
        counter.inside += 1
        try:
            return real_run(self, *args)
        finally:
            counter.inside -= 1

    monkeypatch.setattr(GraphedForward, "_run", run)

    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(10), graphed=graphed,
                    queue_ahead=queue_ahead)
    engine.add(ragged_prompts(2, VOCAB, seed=5, max_len=9))
    engine.step()  # the first replay of the bucket (a capture on a GPU); queued ahead, the second's launch too
    steps = 0
    while engine.live:
        with counter:
            engine.step()
        steps += 1
    ops = counter.ops
    launches = steps - 1 if queue_ahead else steps  # queued ahead, the last step launches none
    assert graphed.replays == launches + 1 + queue_ahead and steps >= 6
    # the LM head once a launch and the inputs' one copy; nothing reserved a block (32-token blocks)
    assert ops["linear"] == launches, ops
    assert not {"zero_", "fill_", "index", "index_select", "cat", "masked_fill_"} & set(ops), ops
    if not queue_ahead:
        assert ops["copy_"] <= steps, ops
        # on a GPU the read of the greedy choices copies them to the host (to_copy, to outside inference mode), once
        # a step: the step's one synchronisation; on the CPU the read copies nothing
        assert ops["_to_copy"] + ops["to"] <= (steps if CAPTURE else 0), ops
    else:  # the roots' copy into the graph's inputs; on a GPU the inputs' copy, and the choices' to pinned memory
        assert ops["clamp"] == launches and ops["copy_"] <= (3 if CAPTURE else 1) * launches, ops
        assert ops["_to_copy"] + ops["to"] == 0, ops


def test_the_buckets_rope_table_is_the_eager_rope(loaded):
    """A replay gathers cos / sin from a table the eager forward's own rope() computed once: the same bits at every
    position a bucket can see, the first and the last included."""
    runner = loaded.runner
    graphed = GraphedForward(runner, make_cache(runner), GraphConfig(batch_sizes=(1,), tokens_per_seq=(1,),
                                                                     capture=CAPTURE))
    cos, sin = graphed.rope_table
    assert cos.shape[0] == graphed.max_keys
    positions = torch.tensor([0, 1, 17, 100, graphed.max_keys - 1], device=runner.device)
    want_cos, want_sin = runner.rope(positions)
    assert torch.equal(cos[positions], want_cos) and torch.equal(sin[positions], want_sin)


def test_bad_configs_and_backends_are_refused(loaded):
    """Each a one-line specdec error naming the argument (they were bare ValueErrors, and a size that is no sequence,
    a LoadedModel for the runner or a config of another type a TypeError / AttributeError from deep inside)."""
    for bad in (dict(batch_sizes=()), dict(batch_sizes=(2, 1)), dict(tokens_per_seq=(0, 4)),
                dict(tokens_per_seq=(1, 66)), dict(batch_sizes=(1, 1))):
        with pytest.raises(InputError, match=f"^GraphConfig: {next(iter(bad))} "):
            GraphConfig(**bad)
    for bad in (dict(batch_sizes=8), dict(tokens_per_seq=(1, 2.0)), dict(batch_sizes="124"), dict(capture="yes")):
        with pytest.raises(InputTypeError, match=f"^GraphConfig: {next(iter(bad))} must be "):
            GraphConfig(**bad)
    assert GraphConfig(batch_sizes=[1, 2]).batch_sizes == (1, 2)  # a list is taken, kept as a tuple
    runner = loaded.runner
    with pytest.raises(InputTypeError, match=r"runner must be a LlamaRunner \(a loaded model's .runner.*LoadedModel"):
        GraphedForward.with_cache(loaded, max_tokens=64)
    with pytest.raises(InputTypeError, match="max_tokens must be an int, got str '16k'"):
        GraphedForward.with_cache(runner, max_tokens="16k")
    with pytest.raises(InputError, match="max_tokens must be >= 1, got 0"):
        GraphedForward.with_cache(runner, max_tokens=0)
    with pytest.raises(InputTypeError, match="config must be a GraphConfig, got dict"):
        GraphedForward(runner, make_cache(runner), dict(capture=False))
    with pytest.raises(InputTypeError, match="cache must be a specdec.kv_cache.PagedKVCache, got Tensor"):
        GraphedForward(runner, torch.zeros(4), GraphConfig(capture=False))
    reference = on_reference(loaded)
    with pytest.raises(InputError, match="Triton attention backend"):
        GraphedForward(reference.runner, make_cache(reference.runner))
    why = (r"the Triton attention backend, and the model runs on the reference one: load it with backend='auto'"
           if CAPTURE else "a CUDA device, and the model runs on cpu")  # not "needs a CUDA device" on one
    with pytest.raises(ValueError, match=rf"^cuda_graphs=True needs {why}"):
        generate(reference, [[1, 2, 3]], max_new_tokens=2, cuda_graphs=True)  # one line, in the user's terms
    if not CAPTURE:
        runner = loaded.runner
        with pytest.raises(InputError, match="capture=True needs a CUDA device.*GraphConfig\\(capture=False\\)"):
            GraphedForward(runner, make_cache(runner), GraphConfig(capture=True))


def test_a_reused_graphed_forward_keeps_its_cache_and_buckets(loaded):
    runner = loaded.runner
    graphed = GraphedForward.with_cache(runner, max_tokens=256, block_size=16, config=GraphConfig(capture=CAPTURE))
    prompts = [[4, 5, 6, 4, 5, 6, 4], [7, 8, 9]]
    first = generate(loaded, prompts, max_new_tokens=8, cuda_graphs=graphed)
    buckets = dict(graphed.buckets)
    graphed.cache.add(99)  # as if an earlier call had raised mid-generation
    graphed.cache.reserve(99, 5)
    second = generate(loaded, prompts, max_new_tokens=8, cuda_graphs=graphed)
    assert first == second == generate(loaded, prompts, max_new_tokens=8)
    assert buckets and all(graphed.buckets[k] is b for k, b in buckets.items())  # not rebuilt / recaptured
    assert 99 not in graphed.cache.lengths
    with pytest.raises(ValueError, match="larger max_tokens"):
        generate(loaded, [list(range(1, 60))] * 4, max_new_tokens=64, cuda_graphs=graphed)
    with pytest.raises(ValueError, match="another model"):
        generate(load_model(build_tiny_model("llama-gqa-tied", VOCAB, seed=1)), prompts, max_new_tokens=2,
                 cuda_graphs=graphed)
    with pytest.raises(ValueError, match="block_size"):
        generate(loaded, prompts, max_new_tokens=2, cuda_graphs=graphed, block_size=8)
    with pytest.raises(TypeError, match="bool, \"auto\" or a GraphedForward"):
        generate(loaded, prompts, max_new_tokens=2, cuda_graphs="yes")


def test_a_graphed_forward_of_a_model_changed_since_is_refused(loaded):
    """A GraphedForward runs the runner it was built with: after its model's LM head was replaced it kept decoding
    with the old one. It is now refused in one line."""
    graphed = GraphedForward.with_cache(loaded.runner, max_tokens=64, config=GraphConfig(capture=CAPTURE))
    head = loaded.model.lm_head
    loaded.model.lm_head = torch.nn.Linear(loaded.model.config.hidden_size, VOCAB, bias=False).to(DEVICE)
    try:
        with pytest.raises(ValueError, match=r"^cuda_graphs: this GraphedForward's model was changed since it was "
                                             r"built \(its LM head was replaced\): build a new GraphedForward$"):
            generate(loaded, [[4, 5, 6]], max_new_tokens=2, cuda_graphs=graphed)
    finally:
        loaded.model.lm_head = head  # the module's model, as the other tests use it


def test_a_graphed_forward_after_an_edit_of_the_rope_frequencies_is_refused(loaded):
    """Its RoPE table is computed once from the model's inv_freq: after an in-place edit of the frequencies (a RoPE
    scaling tried in a notebook) it decoded the text of the frequencies before, where transformers and the eager
    path read the new ones. The model's own graph cache (cuda_graphs="auto") is built again for the same reason."""
    graphed = GraphedForward.with_cache(loaded.runner, max_tokens=64, config=GraphConfig(capture=CAPTURE))
    generate(loaded, [[4, 5, 6]], max_new_tokens=2, cuda_graphs=graphed)
    inv_freq = loaded.model.model.rotary_emb.inv_freq
    before = inv_freq.clone()
    inv_freq.mul_(0.5)
    try:
        assert loaded.runner.stale() == "the rotary embedding's inv_freq was changed"
        with pytest.raises(ValueError, match=r"changed since it was built \(the rotary embedding's inv_freq was "
                                             r"changed\): build a new GraphedForward$"):
            generate(loaded, [[4, 5, 6]], max_new_tokens=2, cuda_graphs=graphed)
    finally:
        inv_freq.copy_(before)
    assert loaded.runner.stale() is None


def test_a_graphed_forward_after_a_weight_was_given_other_memory_is_refused():
    """Its captured graphs read each weight at the address it had then; a model passed as an object has no fused
    projections, whose addresses stale() compares, so ``param.data = ...`` went unseen (on a GPU the graphs would
    read the freed memory)."""
    own = triton_tiny_model(VOCAB, DEVICE)  # not the module's: its weights move
    graphed = GraphedForward.with_cache(own.runner, max_tokens=64, config=GraphConfig(capture=CAPTURE))
    generate(own, [[4, 5, 6]], max_new_tokens=2, cuda_graphs=graphed)
    up = own.model.model.layers[0].mlp.up_proj.weight
    up.data = up.data.clone()
    with pytest.raises(ValueError, match=r"changed since it was built \(a weight was given other memory"):
        generate(own, [[4, 5, 6]], max_new_tokens=2, cuda_graphs=graphed)


def test_self_distillation_through_buckets_equals_eager_and_keeps_its_own_cache(loaded, tmp_path, caplog):
    """train-medusa / train-eagle's self-distillation decodes chunk after chunk through one GraphedForward (buckets
    1, 2, 4 and 5 for batches of 5, the last chunk smaller): the eager tokens, cached under a key of their own."""
    from specdec.train.distill import decoding_graphs, self_distill, use_graphs

    from specdec.errors import InputError

    prompts = ragged_prompts(6, VOCAB, max_len=12)
    kwargs = dict(max_new_tokens=6, batch_size=5, cache_dir=tmp_path, progress=False)
    with caplog.at_level(logging.INFO, logger="specdec.train.distill"):
        eager = self_distill(loaded, prompts, cuda_graphs=False, **kwargs)
        graphed = self_distill(loaded, prompts, cuda_graphs=True, **kwargs)
    assert graphed == eager and all(len(s) == len(p) + 6 for s, p in zip(eager, prompts, strict=True))
    # the log says how the data was made and how fast: the GPU recipe's main cost
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("self-distilled")]
    assert len(said) == 2 and all("6 sequences (36 new tokens)" in m for m in said), said
    assert "eagerly, batch 5" in said[0], said
    assert ("through CUDA graphs, batch 5" if DEVICE == "cuda" else "through uncaptured graph buckets, batch 5") in \
        said[1], said
    assert len(list(tmp_path.glob("*.json"))) == 2
    assert use_graphs(loaded, None) == (DEVICE == "cuda")  # auto: captured graphs on a GPU, eager on CPU
    forward = decoding_graphs(loaded, [len(p) for p in prompts], 6, 5)
    assert forward.config.batch_sizes == (1, 2, 4, 5) and forward.config.tokens_per_seq == (1,)
    # the cache is what the largest chunk needs, as eager generate() allocates it, plus the scratch block
    need = max(sum(-(-(len(p) + 7) // 16) for p in prompts[i : i + 5]) for i in (0, 5))
    assert forward.cache.num_blocks == need + 1
    assert forward.config.capture == (DEVICE == "cuda")
    assert not use_graphs(on_reference(loaded), None) and not use_graphs(loaded, False)
    with pytest.raises(InputError, match="Triton backend"):
        use_graphs(on_reference(loaded), True)


def test_auto_decides_by_device_and_backend(loaded):
    assert not auto_uses_graphs(on_reference(loaded).runner)  # PyTorch reference backend: never
    assert auto_uses_graphs(loaded.runner) == CAPTURE  # Triton backend: on CUDA only, not in the interpreter
    if not CAPTURE:  # the CPU path unchanged: "auto" builds the engine False builds, the cache the request's
        from specdec.engine_setup import build_engine
        from specdec.generate import prepare

        engines = [build_engine(prepare(m, [[1, 2, 3]], max_new_tokens=4, **kw))
                   for m in (loaded, on_reference(loaded)) for kw in ({}, dict(cuda_graphs=False))]
        assert all(e.graphed is None for e in engines)
        assert len({e.cache.num_blocks for e in engines}) == 1
        assert "_specdec_graphed_forward" not in loaded.model.__dict__


def test_one_graph_cache_per_model_is_reused_and_grows(loaded):
    runner = loaded.runner
    config = GraphConfig(capture=CAPTURE)
    release_model_graphs(loaded)
    first = model_graphs(runner, 16, 6, config=config)
    first.cache.add(7)  # an earlier call's leftover sequence
    first.cache.reserve(7, 3)
    assert model_graphs(runner, 16, 4, config=config) is first and 7 not in first.cache.lengths
    old_kv = weakref.ref(first.cache.kv)  # `first` holds the old cache, as a drafter reused across calls does
    grown = model_graphs(runner, 16, 9, config=config)  # outgrown: twice the blocks, when they fit
    assert grown is not first and grown.cache.num_blocks - 1 == 12
    assert old_kv() is None and first.cache.num_blocks == 0  # the old KV memory was freed for the new cache
    first.cache.add(0)
    with pytest.raises(CacheFullError):
        first.cache.reserve(0, 1)
    with pytest.raises(InputError, match="released"):  # it wrote its warm-up into the freed cache
        first.warm_up(1)
    with pytest.raises(InputError, match="released"):
        generate(loaded, [[1, 2, 3]], max_new_tokens=2, cuda_graphs=first)
    refused = []

    def check_fits(blocks):
        if blocks > 14:
            refused.append(blocks)
            raise CacheFullError("too big")

    exact = model_graphs(runner, 16, 13, check_fits, config=config)  # doubling to 24 does not fit: exactly 13
    assert refused == [25] and exact.cache.num_blocks - 1 == 13
    other = model_graphs(runner, 8, 2, config=config)
    assert other is not exact  # another block size
    assert release_model_graphs(loaded.model) and not release_model_graphs(loaded.model)
    assert other.cache.kv.numel() == 0  # released now, though this test still holds it


def test_a_model_whose_weights_moved_gets_new_graphs():
    """Module.to() keeps a model's Parameter objects and swaps their storage: graphs captured over the old storage
    would read freed memory, so a model moved away and back (offloading) or cast gets a new graph cache. The check
    compared the Parameters with themselves, and passed."""
    model = load_model(build_tiny_model("llama-gqa-tied", VOCAB), device=DEVICE)
    runner = LlamaRunner(model.model, backend="triton")
    config = GraphConfig(capture=CAPTURE)
    first = model_graphs(runner, 16, 4, config=config)
    assert model_graphs(runner, 16, 4, config=config) is first
    model.model.to(torch.float64).to(torch.float32)  # the same Parameters, new storage
    assert model_graphs(runner, 16, 4, config=config) is not first
    release_model_graphs(model)


@pytest.mark.skipif(not CAPTURE, reason="captures CUDA graphs")
def test_auto_on_cuda_reuses_the_models_graphs_across_calls(loaded):
    release_model_graphs(loaded)
    prompts = [[4, 5, 6, 4, 5, 6, 4], [7, 8, 9]]
    first = generate(loaded, prompts, max_new_tokens=8, drafter="ngram", speculation="always")
    graphed = loaded.model.__dict__["_specdec_graphed_forward"]
    buckets, replays = dict(graphed.buckets), graphed.replays
    second = generate(loaded, prompts, max_new_tokens=8, drafter="ngram", speculation="always")
    assert replays > 0 and graphed.replays > replays
    assert loaded.model.__dict__["_specdec_graphed_forward"] is graphed
    assert all(graphed.buckets[k] is b for k, b in buckets.items())  # not recaptured
    assert first == second == generate(loaded, prompts, max_new_tokens=8, cuda_graphs=False)
    release_model_graphs(loaded)


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_verify_costs_measured_through_the_buckets(loaded, monkeypatch):
    """The speed command's c(n) on a GPU: measure_verify_costs(graphs=True) runs the engine's graphed verify."""
    from specdec.verify_cost import measure_verify_costs

    calls = []
    replay = GraphedForward.__call__
    monkeypatch.setattr(GraphedForward, "__call__",
                        lambda self, *a, **kw: calls.append(kw.get("prefill", False)) or replay(self, *a, **kw))
    costs = measure_verify_costs(loaded.runner, [[1, 2, 3, 4]], [1, 3], SamplingConfig(), repeats=1, graphs=True)
    assert sorted(costs) == [1, 3] and all(c > 0 for c in costs.values())
    assert calls.count(False) == 4  # 2 rounds x 2 sizes, every verify through the buckets


def _eagle_head(loaded, draft_vocab=(), packed=False):
    """``packed``: its QKV and gate/up weights side by side, as specdec lays out its own heads on CUDA."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    from specdec.models.fused_projections import pack_layers

    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(loaded.model.config, draft_vocab=tuple(draft_vocab), depth=3, top_k=3,
                                              max_nodes=8))
    eagle.init_from_target(loaded.model)
    eagle = eagle.to(DEVICE)
    if packed:
        assert pack_layers(eagle.layers) == 2
    return eagle


def test_pending_eagle_trees_are_verified_before_the_host_reads_them(loaded, monkeypatch):
    """With every tree verified whole and the verify through buckets, EAGLE's trees stay on the device until the
    verify is launched (specdec.pending_trees): the device writes the nodes' tokens (through a reduced vocabulary),
    positions and ancestor bits into the bucket. Each such step's logits equal the eager forward's over the trees the
    host then reads; near the token budget the trees are read first. The head's projections are packed, as specdec
    lays out its own heads on CUDA, and its catch-up and growth take the packed products (their values: the fused-op
    layer test)."""
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_model import EagleModel

    runner = loaded.runner
    cache = make_cache(runner, blocks=96)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 16), capture=CAPTURE))
    drafter = EagleDrafter(model=_eagle_head(loaded, range(0, VOCAB, 2), packed=True), adapt_depth=False,
                           cuda_graphs=True)
    found = []
    projections = EagleModel.projections
    monkeypatch.setattr(EagleModel, "projections", lambda self: found.append(projections(self)) or found[-1])
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(9), drafter=drafter, graphed=graphed)
    assert engine.pending
    events, outs = [], []
    propose, verify, read = Engine.propose, Engine.verify, Engine._read

    def verified(self, batch, *roots):  # roots: the reference generate()'s queued plain steps on CUDA
        events.append("verify")
        outs.append(verify(self, batch, *roots))
        return outs[-1]

    def checked(self, step):
        after = events[-1] == "verify"  # else read first: this step's verify comes next
        trees, seconds = read(self, step)
        events.append("pending read after its verify" if after else "pending read first")
        if after:
            host = self.verify_batch(self.live, trees)  # the same slots, the host's values (every sequence drafted)
            eager = self.runner.forward(host.token_ids, host.positions, host.plan, self.cache,
                                        torch.arange(len(host.tokens), device=DEVICE))
            assert (outs[-1].logits - eager.logits).abs().max().item() <= 1e-4
        return trees, seconds

    monkeypatch.setattr(Engine, "propose", lambda self, live: events.append("propose") or propose(self, live))
    monkeypatch.setattr(Engine, "verify", verified)
    monkeypatch.setattr(Engine, "_read", checked)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7]]
    seqs = engine.add(prompts)
    while engine.live:
        engine.step()
    assert events.count("pending read after its verify") >= 2 and events.count("pending read first") >= 1, events
    assert found and all(p.qkv is not None and p.gate_up is not None for p in found)
    assert all(len(s.new_tokens) == 9 for s in seqs)
    assert [s.new_tokens for s in seqs] == [t[len(p):] for p, t in zip(
        prompts, generate(loaded, prompts, max_new_tokens=9), strict=True)]


def test_pending_trees_the_free_blocks_cannot_hold_are_read_first(loaded):
    """Where the pool may run short (an explicit num_blocks below the request's worst case: fit_free_blocks), pending
    trees are verified before the host reads them only if the free KV blocks hold them; else they are read first,
    and cut to the blocks (Engine._sized), as near the token budget."""
    from specdec.engine import PendingStep
    from specdec.pending_trees import PendingTrees

    runner = loaded.runner
    cache = make_cache(runner, blocks=4)  # blocks of 4 positions: the graphs' scratch block and 3 for the sequence
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1,), tokens_per_seq=(1, 16), capture=CAPTURE))
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(8), graphed=graphed,
                    fit_free_blocks=True)
    seq, = engine.add([[1, 2, 3, 4, 5, 6]])  # 5 positions in 2 blocks, 1 free: the root and 6 nodes fit

    def pending(n: int) -> PendingStep:
        zeros = torch.zeros(n, dtype=torch.long, device=DEVICE)
        return PendingStep(PendingTrees((n,), zeros, zeros + 1, zeros, 1, list, lambda: 0.0), [seq], False)

    assert engine._verifiable([seq], pending(6)) and not engine._verifiable([seq], pending(7))
    engine.fit_free_blocks = False  # a pool sized for every tree
    assert engine._verifiable([seq], pending(7))


def test_the_drafting_a_gpu_runs_inside_the_verify_is_priced_as_drafting(loaded, monkeypatch):
    """On CUDA the device drafts pending trees after propose() returns, ahead of the verify on its stream, so the
    verify's wall time holds what was left of the drafting, which the policy also prices as the draft's time. The
    engine moves that part (from t1 to the drafting's end, its device seconds after its clock started; at most half
    the span) from the verify's seconds, by which tree sizes are priced, to the draft's. On the CPU nothing moves:
    the drafting ends inside propose()."""
    from specdec.drafters.eagle import EagleDrafter

    from specdec.engine import PendingStep
    from specdec.pending_trees import PendingTrees
    from specdec.tree import DraftTree

    runner = loaded.runner
    cache = make_cache(runner, blocks=96)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 16), capture=CAPTURE))
    drafter = EagleDrafter(model=_eagle_head(loaded), adapt_depth=False, cuda_graphs=True)
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(9), drafter=drafter, graphed=graphed)
    assert engine.pending and engine.drafts_during_verify == CAPTURE
    engine.drafts_during_verify = True  # as on CUDA, from here on
    one = torch.zeros(1, dtype=torch.long)
    step = PendingStep(PendingTrees((1,), one, one, one, 1, list, lambda: 0.004, started_at=10.0), [], False)
    assert engine.drafting_after(10.001, 10.011, step) == pytest.approx(0.003)  # 4 ms drafted, 1 ms before t1
    assert engine.drafting_after(10.005, 10.011, step) == 0.0  # all of it before t1
    assert engine.drafting_after(10.001, 10.003, step) == pytest.approx(0.001)  # at most half the span
    assert engine.drafting_after(10.001, 10.011, [DraftTree.empty()]) == 0.0  # trees read in propose()
    # in the steps (where the CPU's drafting ended before t1, a quarter of each pending step's span stands in)
    records, moved = [], []
    observe = engine.policy.observe
    monkeypatch.setattr(engine.policy, "observe", lambda record: records.append(record) or observe(record))
    monkeypatch.setattr(Engine, "drafting_after", lambda self, t1, t2, drafts: moved.append(
        (t2 - t1) / 4 if isinstance(drafts, PendingStep) else 0.0) or moved[-1])
    engine.add([[1, 2, 3, 4, 5, 6, 7]])
    while engine.live:
        engine.step()
    assert len(moved) == len(records) == engine.forward_passes and sum(moved) > 0
    # what the policy saw (on a GPU a step that captured a graph is left out: verify_seconds None)
    timed = [r.verify_seconds for r in records if r.verify_seconds is not None]
    assert timed and engine.seconds["verify"] >= sum(timed) - 1e-9
    assert CAPTURE or engine.seconds["verify"] == pytest.approx(sum(timed))
    assert all(r.verify_seconds == pytest.approx(3 * m)
               for r, m in zip(records, moved, strict=True) if m and r.verify_seconds)
    assert engine.seconds["draft"] >= sum(moved)


@pytest.mark.parametrize("shape", ["tree", "chain", "eager chain"])
def test_eagle_pending_fields_from_its_graph_describe_the_trees_it_reads(loaded, monkeypatch, shape):
    """The tokens, depths and ancestor bits a graphed EAGLE call hands the verify (computed in its replay, over a
    reduced vocabulary and reranked trees; a chain's depths and bits the bucket's constants, its 3 sequences padded
    to a bucket of 4; or a chain drafted eagerly) are those of the trees the host reads, node for node."""
    from specdec.drafters.eagle import EagleDrafter

    graphed = shape != "eager chain"
    drafter = EagleDrafter(model=_eagle_head(loaded, draft_vocab=range(1, VOCAB, 2)), adapt_depth=False,
                           cuda_graphs=graphed, **({} if shape == "tree" else dict(top_k=1, depth=5)))
    seen = []
    real = EagleDrafter.propose_pending

    def recorded(self, seqs):
        pending = real(self, seqs)
        fields = [t.tolist() for t in (pending.tokens, pending.depths, pending.ancestor_bits)]  # before a next call
        return dataclasses.replace(pending, read=lambda: seen.append((fields, pending.read())) or seen[-1][1])

    monkeypatch.setattr(EagleDrafter, "propose_pending", recorded)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]] + ([] if shape == "tree" else [[9, 10, 11, 12]])
    out = generate(loaded, prompts, max_new_tokens=8, drafter=drafter, cuda_graphs=True, speculation="always")
    assert out == generate(loaded, prompts, max_new_tokens=8)
    assert drafter.graphs.replays > 0 if graphed else drafter.graphs is None
    assert any(max(t.num_nodes for t in trees) > 1 for _, trees in seen)
    if shape != "tree":
        assert all(t.parents.tolist() == list(range(-1, t.num_nodes - 1)) for _, trees in seen for t in trees)
        if graphed:
            buckets = drafter.graphs.buckets
            assert 4 in {batch for batch, _, _ in buckets} and all(set(b.chain_fields) == {5} for b in buckets.values())
    for (tokens, depths, bits), trees in seen:
        assert tokens == [x for t in trees for x in t.tokens.tolist()]
        assert depths == [x for t in trees for x in t.depth_list]
        assert bits == [x for t in trees for x in t.ancestor_bit_list]
    assert all(x % 2 == 1 for (tokens, _, _), _ in seen for x in tokens)  # target ids of the reduced vocabulary


@pytest.mark.parametrize("drafter,sampled", [("eagle", "greedy"), ("eagle", "rejection"), ("eagle", "coupled"),
                                             ("draft-model", "rejection")])
def test_pending_trees_give_the_text_of_trees_read_first(loaded, drafter, sampled, monkeypatch):
    """generate(cuda_graphs=True, speculation="always"): the same tokens whether the drafter's trees are verified
    pending or read first (the same trees, the same walk; a draft model's sampled trees keep their draft_probs), and
    greedy, the target's plain tokens."""
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.eagle import EagleDrafter

    kind = EagleDrafter if drafter == "eagle" else DraftModelDrafter
    eagle = _eagle_head(loaded)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    kw = {} if sampled == "greedy" else dict(do_sample=True, temperature=0.9, seed=3,
                                             sampler="coupled" if sampled == "coupled" else "standard")
    outs, pending = [], []
    for allowed in (True, False):
        pending.clear()
        monkeypatch.setattr(kind, "pending_trees", allowed)
        monkeypatch.setattr(kind, "propose_pending",
                            lambda self, seqs, m=kind.propose_pending: pending.append(1) or m(self, seqs))
        small = build_tiny_model("llama-gqa-tied", VOCAB, seed=7).to(DEVICE)
        proposer = (EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True) if drafter == "eagle" else
                    DraftModelDrafter(model=small, num_draft_tokens=3, cuda_graphs=False))
        outs.append(generate(loaded, prompts, max_new_tokens=8, drafter=proposer, cuda_graphs=True,
                             speculation="always", **kw))
        assert bool(pending) == allowed
    assert outs[0] == outs[1]
    if sampled == "greedy":
        assert outs[0] == generate(loaded, prompts, max_new_tokens=8)


@pytest.mark.parametrize("cuts", [False, True])
def test_pending_trees_under_tree_sizing(loaded, cuts, monkeypatch):
    """With the speculation policy's sizer (speculation="auto"), trees are left pending while its last sizing cut
    none: verified whole, then sized after the read (what it would cut is learned). Once it cuts, the next steps
    size their trees before the verify, as drafters without pending trees do. Greedy stays the target's."""
    from specdec.drafters.eagle import EagleDrafter

    from specdec.cost_model import CostModel
    from specdec.speculation_policy import SpeculationPolicy
    from specdec.tree_sizing import TreeSizer

    kept_tree = TreeSizer._kept_tree

    def sizing(self, seq_id, tree):  # the sizer's own choice (its learning, the guard), then a fixed answer
        kept_tree(self, seq_id, tree)
        return tree.prune(tree.depths <= 1) if cuts and tree.num_nodes else tree

    monkeypatch.setattr(TreeSizer, "_kept_tree", sizing)
    monkeypatch.setattr(TreeSizer, "wants_draft", lambda self, seq_id: True)
    calls = []
    for name in ("propose", "propose_pending"):
        method = getattr(EagleDrafter, name)
        monkeypatch.setattr(EagleDrafter, name, lambda self, seqs, m=method, n=name: calls.append(n) or m(self, seqs))
    runner = loaded.runner
    cache = make_cache(runner, blocks=96)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1, 2), tokens_per_seq=(1, 16), capture=CAPTURE))
    policy = SpeculationPolicy(TreeSizer(CostModel({}, {1: {1: 1.0, 65: 1.0}})))
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(8), graphed=graphed, policy=policy,
                    drafter=EagleDrafter(model=_eagle_head(loaded), adapt_depth=False, cuda_graphs=True))
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    seqs = engine.add(prompts)
    while engine.live:
        engine.step()
    assert calls[0] == "propose_pending"
    if cuts:  # the first step's trees were verified whole; sizing cut them, so every later step sized first
        assert calls[1:] and set(calls[1:]) == {"propose"}
        assert max(n for s in seqs for n in s.step_nodes[1:]) <= 3  # top_k root children
    else:
        assert set(calls) == {"propose_pending"} and max(seqs[0].step_nodes) == 8
    assert [s.new_tokens for s in seqs] == [t[len(p):] for p, t in zip(
        prompts, generate(loaded, prompts, max_new_tokens=8), strict=True)]


def test_eagle3_feature_layers_come_back_from_buckets_of_their_own(loaded):
    """An EAGLE-3 head reads the residual streams entering three target layers: a bucket asked for them returns
    them (and the logits) as the eager forward does, apart from the plain buckets, so the head's verify steps
    replay too; its trees (pending, speculation="always") give plain greedy's tokens."""
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    runner = loaded.runner
    layers = (0, 1, 2)  # a 2-layer model: both inputs and the last stream
    cache = make_cache(runner)
    graphed = GraphedForward(runner, cache, GraphConfig(batch_sizes=(1, 2, 4), tokens_per_seq=(1, 8, 16),
                                                        capture=CAPTURE))
    engine = Engine(runner, cache, sampling=SamplingConfig(), stop=StopCriteria(8),
                    drafter=RandomTreeDrafter(VOCAB, max_nodes=7, max_depth=3, seed=1))
    engine.add(ragged_prompts(3, VOCAB, seed=6, max_len=20))
    live = engine.live
    batch = engine.verify_batch(live, engine.propose(live))
    eager = runner.forward(batch.token_ids, batch.positions, batch.plan, cache,
                           torch.arange(len(batch.tokens), device=DEVICE), feature_layers=layers)
    static = graphed(batch, feature_layers=layers)
    assert static.features.shape == eager.features.shape == (len(batch.tokens), 3 * runner.shape.hidden_size)
    assert (static.features - eager.features).abs().max().item() <= 1e-4
    assert (static.logits - eager.logits).abs().max().item() <= 1e-4
    assert graphed(batch).features is None and {len(k) for k in graphed.buckets} == {2, 3}  # plain and EAGLE-3

    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(loaded.model.config, arch="eagle3", depth=3, top_k=3, max_nodes=8))
    head.init_from_target(loaded.model)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    graphs = GraphedForward.with_cache(runner, max_tokens=256, block_size=16, config=GraphConfig(capture=CAPTURE))
    out = generate(loaded, prompts, max_new_tokens=8, drafter=EagleDrafter(model=head.to(DEVICE), adapt_depth=False),
                   cuda_graphs=graphs, speculation="always", return_dict=True)
    assert out.sequences == generate(loaded, prompts, max_new_tokens=8)
    assert graphs.replays == out.forward_passes and any(len(k) == 3 for k in graphs.buckets)


def test_the_oracle_leaves_its_trees_pending_as_eagle_does(loaded, monkeypatch):
    """With an EAGLE head for its cost, the oracle offers pending trees as EAGLE does: its trees' fields go to the
    device with the head's drafting, and the head's candidates are read after the verify's launch (where EAGLE's
    own pending step reads them), not after the target's choices, when the device would idle. Greedy output stays
    the reference's."""
    from specdec.drafters.eagle import EagleDrafter
    from specdec.eval.oracle_drafter import AcceptanceProfile, OracleDrafter, reference_continuations

    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    references = reference_continuations(loaded, prompts, 10)
    events = []
    for owner, name in ((Engine, "propose"), (Engine, "verify"), (Engine, "accept"), (EagleDrafter, "_finish")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _r=real, _n=name, **k: events.append(_n) or _r(*a, **k))
    oracle = OracleDrafter(references, AcceptanceProfile.constant(0.7, 3),
                           inner=EagleDrafter(model=_eagle_head(loaded), adapt_depth=False, cuda_graphs=True), seed=2)
    assert oracle.pending_trees
    graphs = GraphedForward.with_cache(loaded.runner, max_tokens=256, block_size=16, config=GraphConfig(
        capture=CAPTURE))
    out = generate(loaded, prompts, max_new_tokens=10, drafter=oracle, cuda_graphs=graphs, speculation="always",
                   return_dict=True)
    assert out.new_tokens == [references[tuple(p)] for p in prompts] and max(out.stats[0].step_nodes) == 3
    steps = "".join({"propose": "p", "verify": "v", "_finish": "r", "accept": "a"}[e] for e in events).split("a")
    # propose, verify, read: pending; propose, read, verify: read first (near the token budget)
    assert set(steps[:-1]) <= {"pvr", "prv"} and steps.count("pvr") >= 2 and steps[-1] == "", steps


def test_a_call_made_while_another_runs_keeps_out_of_its_graph_cache(loaded, monkeypatch):
    """A streamer that calls generate() on the same model (a tool call, a judge) met the model's shared graph cache
    in use: the inner call freed the outer call's sequences, which then died on a bare KeyError. The inner call now
    runs eagerly beside it (cuda_graphs="auto"), or is refused in one line (a caller's GraphedForward)."""
    from specdec import cuda_graphs

    release_model_graphs(loaded)
    prompts, inner_prompt = [[1, 2, 3, 4]], [[7, 8, 9]]
    plain = generate(on_reference(loaded), prompts, max_new_tokens=4)
    inner_plain = generate(on_reference(loaded), inner_prompt, max_new_tokens=2)
    monkeypatch.setattr("specdec.engine_setup.auto_uses_graphs", lambda runner: True)  # as on CUDA
    small_model_graphs(monkeypatch, "specdec.engine_setup.model_graphs", batch_sizes=(1,), tokens_per_seq=(1,))
    inner = []

    def streamer(seq, tokens):
        if not inner:  # once, mid-call
            inner.append(generate(loaded, inner_prompt, max_new_tokens=2))

    assert generate(loaded, prompts, max_new_tokens=4, streamer=streamer) == plain
    assert inner == [inner_plain]
    graphed = loaded.model.__dict__["_specdec_graphed_forward"]
    assert not graphed.serving and graphed.cache.lengths.keys() <= {cuda_graphs.SCRATCH_SEQ_ID}

    own = GraphedForward.with_cache(loaded.runner, max_tokens=64, config=GraphConfig(capture=CAPTURE))
    with pytest.raises(InputError, match=r"^this GraphedForward is serving another generate\(\) call"):
        generate(loaded, prompts, max_new_tokens=4, cuda_graphs=own,
                 streamer=lambda seq, tokens: generate(loaded, inner_prompt, max_new_tokens=2, cuda_graphs=own))
    assert not own.serving and generate(loaded, prompts, max_new_tokens=4, cuda_graphs=own) == plain
    release_model_graphs(loaded)


def test_a_call_failing_after_it_took_the_models_graph_cache_gives_it_back(loaded, monkeypatch):
    """The model's graph cache is held from the engine's build to the call's end, whatever ends the call: a build
    that fails after taking it, or a step that raises, leaves it free for the next call."""
    from specdec import engine_setup

    release_model_graphs(loaded)
    monkeypatch.setattr("specdec.engine_setup.auto_uses_graphs", lambda runner: True)  # as on CUDA
    small_model_graphs(monkeypatch, "specdec.engine_setup.model_graphs", batch_sizes=(1,), tokens_per_seq=(1,))
    real = engine_setup.ensure_row_policy

    def failing(runner):  # after _kv_cache took the graphs
        raise RuntimeError("built halfway")

    monkeypatch.setattr(engine_setup, "ensure_row_policy", failing)
    with pytest.raises(RuntimeError, match="built halfway"):
        generate(loaded, [[1, 2, 3]], max_new_tokens=3)
    graphed = loaded.model.__dict__["_specdec_graphed_forward"]
    assert not graphed.serving
    monkeypatch.setattr(engine_setup, "ensure_row_policy", real)

    def stop(seq, tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(loaded, [[1, 2, 3]], max_new_tokens=3, streamer=stop)
    assert not graphed.serving and graphed.replays > 0
    release_model_graphs(loaded)


def test_two_threads_never_take_the_models_graph_cache_both(loaded, monkeypatch):
    """A call marked the model's graph cache as serving only when its run() began: another thread's call that built
    its engine in between took the same cache, and both ran their sequences in it. Taking the cache is now one
    check-and-set under a lock, at the engine's build: the second call runs eagerly beside the first."""
    import threading

    from specdec import cuda_graphs, engine_setup

    release_model_graphs(loaded)
    first, second = [[1, 2, 3, 4]], [[7, 8, 9]]
    plain = [generate(on_reference(loaded), p, max_new_tokens=4) for p in (first, second)]
    monkeypatch.setattr("specdec.engine_setup.auto_uses_graphs", lambda runner: True)  # as on CUDA
    small_model_graphs(monkeypatch, "specdec.engine_setup.model_graphs", batch_sizes=(1,), tokens_per_seq=(1,))
    built, go, out = threading.Event(), threading.Event(), {}
    real = engine_setup.ensure_row_policy

    def paused(runner):  # the first call stops between taking its KV cache and running
        if threading.current_thread() is thread:
            built.set()
            go.wait(timeout=60)
        return real(runner)

    def held(seq, tokens):  # the second call, mid-generation, lets the first one run to its end
        if not go.is_set():
            go.set()
            thread.join(timeout=60)

    monkeypatch.setattr(engine_setup, "ensure_row_policy", paused)
    thread = threading.Thread(target=lambda: out.update(first=generate(loaded, first, max_new_tokens=4)))
    thread.start()
    try:
        assert built.wait(timeout=60)
        out["second"] = generate(loaded, second, max_new_tokens=4, streamer=held)
    finally:
        go.set()
        thread.join(timeout=60)
    assert [out.get("first"), out["second"]] == plain
    graphed = loaded.model.__dict__["_specdec_graphed_forward"]
    assert not graphed.serving and graphed.cache.lengths.keys() <= {cuda_graphs.SCRATCH_SEQ_ID}
    release_model_graphs(loaded)


def test_two_threads_drafting_with_one_draft_model_never_share_its_graph_cache(loaded, caplog):
    """Two draft-model drafter objects over one draft model, in two threads' calls: the second call's drafter took
    the model's draft graph cache while the first call drafted in it (only drafters of one call kept apart), and
    grew it for its larger batch, freeing the first call's cache under it (the first call died). The cache is now
    taken by one check-and-set for the whole call: the second call drafts eagerly in a cache of its own, said at
    info level; both outputs are plain decoding's, and the graphs are given back at the first call's end."""
    import threading

    from specdec.drafters.draft_model import DraftModelDrafter

    release_model_graphs(loaded)
    first, second = [[1, 2, 3, 4]], [[7, 8, 9], [5, 6]]  # the second needs more KV blocks
    target, kw = on_reference(loaded), dict(max_new_tokens=5, speculation="always")  # the drafter's model: Triton
    plain = [generate(target, p, max_new_tokens=5) for p in (first, second)]
    drafters = [DraftModelDrafter(model=loaded, num_draft_tokens=1, cuda_graphs=True) for _ in range(2)]
    stepped, out = threading.Event(), {}

    def held(seq, tokens):  # the first call, after a step drafted through the graphs, waits for the second's end
        stepped.set()
        thread.join(timeout=120)

    thread = threading.Thread(target=lambda: stepped.wait(timeout=120) and out.update(
        second=generate(target, second, drafter=drafters[1], **kw)))
    thread.start()
    try:
        with caplog.at_level(logging.INFO, logger="specdec.drafters.model_drafter"):
            out["first"] = generate(target, first, drafter=drafters[0], streamer=held, **kw)
    finally:
        stepped.set()
        thread.join(timeout=120)
    assert [out["first"], out.get("second")] == plain
    graphed = drafters[0].graphed
    assert graphed is not None and graphed.replays == drafters[0].draft_forwards - 1 > 0  # undisturbed
    assert drafters[1].graphed is None and drafters[1].cache is not graphed.cache
    assert "drafts eagerly in a cache of its own" in caplog.text
    assert not graphed.serving  # given back: a later call takes it
    release_model_graphs(loaded)


def test_the_speed_commands_merge_launched_baseline_merges_by_a_second_launch(loaded, monkeypatch):
    """``bench_speed_gpu.py``'s same-run baseline of merging a small tile's split parts in the attention kernel:
    plain decoding over graphs of its own with every split merged by the merge kernel, the same tokens, and the
    in-kernel merge restored afterwards (here every forward splits in two, as a GPU's bucket splits for its
    capacity)."""
    from specdec.kernels import tree_attention as ta

    from tests.script_loading import load_script

    bench = load_script("bench_speed_gpu")
    monkeypatch.setattr(ta, "_default_splits", lambda meta, programs, device: 2)
    spy = LaunchSpy(ta._merge_kernel)
    monkeypatch.setattr(ta, "_merge_kernel", spy)
    launched = spy.grids
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]
    plain = generate(loaded, prompts, max_new_tokens=4, eos_token_id=[], return_dict=True).new_tokens
    assert not launched  # a tiny model's decode tiles merge their own parts
    keep = ta.MERGE_IN_KERNEL_MAX
    row = bench.plain_merge_launched(loaded, prompts, 4, max_tokens=128, capture=CAPTURE)
    assert row["outputs"] == plain and launched and ta.MERGE_IN_KERNEL_MAX == keep


class _HiddenReader(Drafter):
    """Proposes nothing; keeps the target's hidden rows (or those layers' input streams) of every prompt row."""

    name = "hidden-reader"
    needs_hidden_states = True

    def __init__(self, feature_layers: tuple[int, ...] = ()) -> None:
        self.feature_layers = feature_layers

    def propose(self, seqs):
        return [DraftTree.empty() for _ in seqs]


def _prefilled(loaded, prompts, graphs: GraphedForward | None, feature_layers: tuple[int, ...] = ()):
    """The sequences engine.add made of ``prompts`` (through ``graphs``' buckets, or eagerly) and their cache."""
    cache = graphs.cache if graphs is not None else make_cache(loaded.runner, blocks=96, seed=1)
    engine = Engine(loaded.runner, cache, sampling=SamplingConfig(), stop=StopCriteria(4),
                    drafter=_HiddenReader(feature_layers), graphed=graphs)
    return engine.add(prompts), cache


def _same_prefill(loaded, prompts, eager, chunked) -> None:
    """Every prompt position's K/V and the drafter's rows of the prompt agree (float rounding apart)."""
    (eager, eager_cache), (chunked, chunked_cache) = eager, chunked
    for a, b, prompt in zip(eager, chunked, prompts, strict=True):
        assert a.new_hidden.shape == b.new_hidden.shape == (len(prompt) - 1, a.new_hidden.shape[1])
        assert (a.new_hidden - b.new_hidden).abs().max().item() <= 1e-4
        slots = [eager_cache.slots(a.seq_id, 0, len(prompt) - 1), chunked_cache.slots(b.seq_id, 0, len(prompt) - 1)]
        for layer in range(loaded.runner.shape.num_layers):
            for kv in (0, 1):
                x, y = eager_cache.kv[layer, kv][slots[0]], chunked_cache.kv[layer, kv][slots[1]]
                assert (x - y).abs().max().item() <= 1e-4, (layer, kv)


PREFILL_PROMPTS = [torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (2, 70, 140)]


@pytest.mark.parametrize("feature_layers", [(), (1,)])
def test_a_prefill_runs_through_the_buckets_in_chunks(loaded, feature_layers):
    """Prompts of up to 4 x 64 rows are prefilled a chunk of 64 per replay through the buckets (on a GPU an eager
    prefill waits for its host's launches: 10-35 ms against ~1-5 ms a replay): every prompt position's K/V and the
    drafter's rows of the prompt are the eager prefill's, across chunks where the sequences drop out one by one (2, 70
    and 140 tokens: 3 chunks of 3, 2 and 1 sequences)."""
    graphs = GraphedForward(loaded.runner, make_cache(loaded.runner, blocks=96, seed=1), GraphConfig(capture=CAPTURE))
    chunked = _prefilled(loaded, PREFILL_PROMPTS, graphs, feature_layers)
    assert graphs.prefill_replays == 3 and graphs.replays == 0
    _same_prefill(loaded, PREFILL_PROMPTS, _prefilled(loaded, PREFILL_PROMPTS, None, feature_layers), chunked)


def test_a_capture_failing_in_a_prefill_costs_the_graphs_not_the_prefill(loaded, monkeypatch, caplog):
    """A chunk whose bucket's capture raises runs the bucket's static forward uncaptured, as do the chunks after it:
    the prefill is the eager one's; later prefills are eager (a GPU's capture, raised here on purpose)."""
    graphs = GraphedForward(loaded.runner, make_cache(loaded.runner, blocks=96, seed=1), GraphConfig(capture=False))
    graphs.config = GraphConfig(capture=True)  # as on a GPU, where the capture fails

    def fails(bucket):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", fails)
    with caplog.at_level(logging.WARNING, logger="specdec.cuda_graphs"):
        chunked = _prefilled(loaded, PREFILL_PROMPTS, graphs)
    assert graphs.failed and graphs.prefill_replays == 3 and caplog.text.count("CUDA-graph capture failed") == 1
    _same_prefill(loaded, PREFILL_PROMPTS, _prefilled(loaded, PREFILL_PROMPTS, None), chunked)
    assert graphs.prefill_chunk([10]) is None


def test_a_prefill_is_chunked_by_its_sizes_alone(loaded):
    """GraphedForward.prefill_chunk: the largest bucket of at most 64 tokens per sequence, where every prompt takes
    at most PREFILL_REPLAYS replays (past that, and beyond the buckets' batch or keys, the eager forward). Never by
    what earlier calls captured, so that a prompt's K/V (in bf16, its text at a near-tie) do not depend on them."""
    from specdec.cuda_graphs import PREFILL_CHUNK, PREFILL_REPLAYS

    def graphs(**config):
        return GraphedForward(loaded.runner, make_cache(loaded.runner, blocks=96), GraphConfig(capture=False, **config))

    g = graphs()
    assert PREFILL_CHUNK == 64 and g.prefill_chunk([3, 20]) == 64 == g.prefill_chunk([PREFILL_REPLAYS * 64])
    assert g.prefill_chunk([PREFILL_REPLAYS * 64 + 1]) is None and g.prefill_chunk([]) is None
    assert g.prefill_chunk([g.max_keys + 1]) is None and g.prefill_chunk([5] * 33) is None  # 32 sequences at most
    g.buckets[(1, 64)] = "captured"  # a bucket an earlier call captured changes nothing
    assert g.prefill_chunk([3, 20]) == 64
    small = graphs(tokens_per_seq=(1, 2, 4))
    assert small.prefill_chunk([4 * PREFILL_REPLAYS]) == 4 and small.prefill_chunk([4 * PREFILL_REPLAYS + 1]) is None
    g.failed = True
    assert g.prefill_chunk([3, 20]) is None


def test_the_speed_command_times_a_prefill_in_chunks_and_eagerly(loaded):
    """``bench_speed_gpu.py``'s same-run baseline of the prefill in chunks: one eager forward (prefill_chunk None)
    and 2 chunks of up to 64 tokens through a graph cache of its own (a 100-token prompt), the same first tokens, and
    prefill_chunk restored afterwards; the report's line says both."""
    from tests.script_loading import load_script

    bench = load_script("bench_speed_gpu")
    prompts = [torch.randint(VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (100, 30)]
    chunk_of = GraphedForward.prefill_chunk
    row = bench.prefill_eager_and_chunked(loaded, prompts, max_tokens=256, capture=CAPTURE, repeats=1)
    assert GraphedForward.prefill_chunk is chunk_of
    assert row["chunk"] == 64 and row["replays"] == 2 and row["eager_replays"] == 0 and row["same_tokens"]
    assert row["eager_ms"] > 0 and row["chunked_ms"] > 0 and (row["batch"], row["prompt_tokens"]) == (2, 100)
    line = bench._prefill_line(row)[-1]
    assert "prefill of 99 tokens, batch 2" in line and "2 replays of up to 64 tokens" in line
