"""The eagle drafter on tiny models: greedy identity (batched and single, full and reduced draft
vocabulary), sampled output in the target's law with a broken rule caught, checkpoints (round trip,
published layout, refusals naming both sides), and the unrolled training loss."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from specdec.drafters.draft_vocab import frequent_tokens
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, load_eagle, save_eagle
from specdec.drafters.eagle_graphs import CachedKeys, EagleGraphConfig, EagleGraphs, release
from specdec.drafters.eagle_kv import EagleKV
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.eval.certificate import CertificateSizes, run_certificate
from specdec.train.eagle_loss import eagle_loss, unrolled_mask

from specdec.errors import InputError
from specdec.generate import generate
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model, ragged_prompts


def _eagle(model, vocab=(), seed=0, **tree):
    torch.manual_seed(seed)
    cfg = EagleConfig.for_target(model.config, draft_vocab=tuple(vocab), **tree)
    eagle = EagleModel(cfg)
    eagle.init_from_target(model)
    return eagle


class Recorder(EagleDrafter):
    """Keeps every proposed tree."""

    def _finish(self, call, pools):  # propose() and, on CUDA, propose_pending()'s read both end here
        trees = super()._finish(call, pools)
        self.trees = getattr(self, "trees", []) + trees
        return trees


@pytest.mark.parametrize("vocab", [(), tuple(range(0, 96, 3))])
def test_greedy_output_is_the_targets_batched_and_single(device, vocab):
    model = build_tiny_model().to(device)
    eagle = _eagle(model, vocab, depth=4, top_k=3, max_nodes=10)
    prompts = ragged_prompts(5, seed=2)
    plain = generate(model, prompts, max_new_tokens=24, return_dict=True).new_tokens
    drafter = Recorder(model=eagle)
    # every tree verified: under the guard a machine busy with other work can leave the drafter out altogether
    batched = generate(model, prompts, max_new_tokens=24, drafter=drafter, return_dict=True, speculation="always")
    assert batched.new_tokens == plain
    assert sum(s.steps for s in batched.stats) < sum(s.new_tokens for s in batched.stats)  # it drafted usefully
    single = [generate(model, [p], max_new_tokens=24, drafter=EagleDrafter(model=eagle), return_dict=True)
              .new_tokens[0] for p in prompts]
    assert single == plain
    trees = [t for t in drafter.trees if t.num_nodes]
    assert trees and all(t.num_nodes <= 10 and t.max_depth <= 4 for t in trees)
    assert all(t.scores is not None and bool(((t.scores > 0) & (t.scores <= 1)).all()) for t in trees)
    if vocab:  # only tokens of the reduced vocabulary are ever proposed
        assert set(torch.cat([t.tokens for t in trees]).tolist()) <= set(vocab)


class ByPrefix(EagleDrafter):
    """Keeps each proposed tree under its sequence's tokens (prompt + committed)."""

    def propose(self, seqs):
        trees = super().propose(seqs)
        self.seen.update((tuple(v.token_ids), t) for v, t in zip(seqs, trees, strict=True))
        return trees


@pytest.mark.parametrize("sampling", [{}, dict(do_sample=True, temperature=0.8, seed=3, sampler="coupled")],
                         ids=["greedy", "coupled"])
def test_batched_drafting_proposes_the_trees_each_sequence_gets_alone(sampling):
    """All sequences draft together, one forward per depth (caches and catch-ups of different lengths right-padded
    and masked): each gets the tree it gets drafting alone, same tokens and parents, scores equal to rounding."""
    model = build_tiny_model()
    eagle = _eagle(model, depth=4, top_k=3, max_nodes=10)
    prompts = ragged_prompts(5, seed=2)
    kw = dict(max_new_tokens=24, speculation="always", **sampling)
    batched = ByPrefix(model=eagle, adapt_depth=False)
    batched.seen = {}
    generate(model, prompts, drafter=batched, **kw)
    alone = {}
    for p in prompts:
        drafter = ByPrefix(model=eagle, adapt_depth=False)
        drafter.seen = alone
        generate(model, [p], drafter=drafter, **kw)
    assert batched.seen.keys() == alone.keys() and len(alone) > 3 * len(prompts)
    assert len({len(key) for key in alone}) > 5  # ragged: the batch padded caches of many lengths
    for key, tree in batched.seen.items():
        assert tree.tokens.tolist() == alone[key].tokens.tolist(), key
        assert tree.parents.tolist() == alone[key].parents.tolist(), key
        torch.testing.assert_close(tree.scores, alone[key].scores, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sampling", [{}, dict(do_sample=True, temperature=0.8, seed=3, sampler="coupled")],
                         ids=["greedy", "coupled"])
def test_graph_buckets_grow_the_trees_the_eager_growth_does(device, sampling):
    """The padded static call that CUDA graphs replay (on the CPU uncaptured, cuda_graphs=True), catch-up and
    growth, proposes the eager call's trees: 3 sequences padded to a batch of 4, cached keys padded to 64 and then
    128, catch-ups to 8 rows, their keys written into the bucket and then the drafter's cache. Its graphs are kept
    on the EAGLE model for the same settings, and a call outside every bucket runs eagerly."""
    model = build_tiny_model().to(device)
    eagle = _eagle(model, depth=4, top_k=3, max_nodes=10)
    prompts = ragged_prompts(3, seed=0, max_len=60)  # 1, 48 and 56 tokens
    kw = dict(max_new_tokens=24, speculation="always", **sampling)
    runs = {}
    for graphs in (False, True):
        drafter = ByPrefix(model=eagle, adapt_depth=False, cuda_graphs=graphs)
        drafter.seen = {}
        runs[graphs] = generate(model, prompts, drafter=drafter, **kw), drafter
    (eager_out, eager), (static_out, static) = runs[False], runs[True]
    assert static_out == eager_out and eager.graphs is None
    # the CPU pads without changing a bit; a GPU's products of other shapes may round a rare near-tie otherwise, and
    # a tree that differs may commit another count of tokens, so that later calls see other prefixes
    shared = static.seen.keys() & eager.seen.keys()
    cpu = device == "cpu"
    assert shared == static.seen.keys() == eager.seen.keys() if cpu else len(shared) >= 0.8 * len(eager.seen)
    same = [static.seen[k].tokens.tolist() == eager.seen[k].tokens.tolist()
            and static.seen[k].parents.tolist() == eager.seen[k].parents.tolist() for k in shared]
    assert all(same) if cpu else sum(same) >= 0.9 * len(same)
    graphs = static.graphs
    # the first calls catch up on prompts eagerly and replay the growth; later ones replay the catch-up too
    assert {(4, 64, 0), (4, 128, 8)} <= set(graphs.buckets) and graphs.replays > len(eager.seen) // 3
    assert graphs.config.capture == (device == "cuda")
    again = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True)
    generate(model, prompts[:2], drafter=again, **kw)
    assert again.graphs is graphs  # the same settings: the same buckets and graphs
    other = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True, top_k=2)
    generate(model, prompts[:2], drafter=other, **kw)
    assert other.graphs is not graphs
    assert graphs.bucket_for(3, 65) == (4, 128, 0) and graphs.bucket_for(3, 57, 5) == (4, 128, 8)
    assert graphs.bucket_for(33, 10) is None and graphs.bucket_for(1, graphs.config.max_keys + 1) is None
    assert graphs.bucket_for(1, 10, 33) is None  # a catch-up longer than every bucket


def test_drafters_over_one_model_replay_its_graphs_with_its_draft_ids():
    """A captured EAGLE graph reads the reduced vocabulary's token ids by address, and later drafters over the same
    model replay it (its graphs are kept on the model): the ids are one tensor of the model, not one per drafter,
    whose own was freed with it under a graph that still read it (on a GPU: other data, or a device assert)."""
    import gc
    import weakref

    model = build_tiny_model()
    eagle = _eagle(model, vocab=range(0, 96, 3), depth=3, top_k=2, max_nodes=6)
    prompts, kw = ragged_prompts(2, seed=0, max_len=20), dict(max_new_tokens=8, speculation="always")
    first = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True)
    generate(model, prompts, drafter=first, **kw)
    graphs, read = first.graphs, weakref.ref(first.grower.draft_ids)  # what the graphs were built to read
    del first
    gc.collect()
    later = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True)
    generate(model, prompts, drafter=later, **kw)
    assert later.graphs is graphs and read() is not None and later.grower.draft_ids is read()


def test_draft_ids_follow_a_d2t_changed_in_place_or_replaced():
    """The reduced vocabulary's token ids are made from ``d2t`` once and kept (graphs read them by address): a
    ``d2t`` loaded in place (load_state_dict) left them as they were, so drafts named the old tokens; they now
    change in place with it. A ``d2t`` replaced gives new ids, and graphs of their own (the kept ones read the old)."""
    model = build_tiny_model()
    eagle = _eagle(model, vocab=range(0, 96, 3), depth=3, top_k=2, max_nodes=6)
    ids = eagle.draft_ids
    assert ids.tolist() == list(range(0, 96, 3))
    state = eagle.state_dict()
    state["d2t"] = torch.arange(1, 97, 3) - torch.arange(32)  # the vocabulary 1, 4, ..., 94
    eagle.load_state_dict(state)
    assert eagle.draft_ids is ids and ids.tolist() == list(range(1, 97, 3))
    prompts, kw = ragged_prompts(2, seed=0, max_len=20), dict(max_new_tokens=8, speculation="always")
    first = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True)
    assert generate(model, prompts, drafter=first, **kw) == generate(model, prompts, **kw)
    eagle.d2t = torch.arange(2, 98, 3) - torch.arange(32)
    later = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True)
    assert generate(model, prompts, drafter=later, **kw) == generate(model, prompts, **kw)
    assert later.grower.draft_ids.tolist() == list(range(2, 98, 3)) and later.graphs is not first.graphs


def test_two_threads_drafting_over_one_eagle_model_never_share_its_graphs(monkeypatch, caplog):
    """Two EAGLE drafter objects over one EagleModel with equal settings, in two threads' calls: both drafted
    through the one EagleGraphs kept on the model, so the second call's inputs overwrote the first one's static
    buffers between its load and its run, and the first call drafted from the other call's keys (a wrong tree,
    and wrong keys in its cache; on a GPU the pending trees read the other call's pool). The graphs are now taken
    by one check-and-set for the whole call: the second call drafts eagerly, said at info level, and every tree
    is the one each call drafts alone; a later call takes the graphs again."""
    import threading

    model = build_tiny_model()
    eagle = _eagle(model, depth=3, top_k=2, max_nodes=6)
    first, second = [[1, 2, 3, 4, 5, 6, 7]], [[9, 8, 7, 6]]  # one sequence each: the same buckets
    kw = dict(max_new_tokens=10, speculation="always")
    alone = []
    for prompt in (first, second):
        drafter = ByPrefix(model=eagle, adapt_depth=False, cuda_graphs=False)
        drafter.seen = {}
        alone.append((generate(model, prompt, drafter=drafter, **kw), drafter.seen))
    drafters = [ByPrefix(model=eagle, adapt_depth=False, cuda_graphs=True) for _ in range(2)]
    for d in drafters:
        d.seen = {}
    out, runs, main = {}, [], threading.current_thread()
    thread = threading.Thread(target=lambda: out.update(second=generate(model, second, drafter=drafters[1], **kw)))
    run = EagleGraphs._run

    def paused(self, bucket, depth):  # the first call's second graph call waits, loaded, for the other call's end
        runs.append(threading.current_thread())
        if runs[-1] is main and runs.count(main) == 2:
            thread.start()
            thread.join(timeout=120)
        return run(self, bucket, depth)

    monkeypatch.setattr(EagleGraphs, "_run", paused)
    with caplog.at_level(logging.INFO, logger="specdec.drafters.eagle"):
        out["first"] = generate(model, first, drafter=drafters[0], **kw)
    thread.join(timeout=120)
    assert [out["first"], out.get("second")] == [a[0] for a in alone]
    def trees(seen):  # prefix by prefix, in the order drafted
        return [(prefix, t.tokens.tolist(), t.parents.tolist()) for prefix, t in seen.items()]

    assert [trees(d.seen) for d in drafters] == [trees(a[1]) for a in alone]  # none from the other call's keys
    graphs = drafters[0].graphs
    assert graphs is not None and drafters[1].graphs is None and not graphs.serving
    assert "drafts eagerly" in caplog.text
    again = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=True)
    generate(model, second, drafter=again, **kw)
    assert again.graphs is graphs


def test_a_drafting_call_that_captured_a_graph_prices_no_level(monkeypatch):
    """EAGLE's depth chooser prices its levels by its calls' times: a call that captured a CUDA graph (~0.1-1 s on
    a GPU) is a one-off there, as a sequence's first call is, and its time prices no level."""
    from specdec.drafters.eagle_depth import DepthChooser

    from specdec.cuda_graphs import note_capture

    flags, calls = [], []
    record, call = DepthChooser.record_seconds, EagleGraphs._call

    def capturing_at_the_second(self, bucket, depth):
        calls.append(depth)
        if len(calls) == 2:
            note_capture()
        return call(self, bucket, depth)

    monkeypatch.setattr(DepthChooser, "record_seconds", lambda self, seconds, catch_up: flags.append(catch_up)
                        or record(self, seconds, catch_up))
    monkeypatch.setattr(EagleGraphs, "_call", capturing_at_the_second)
    model = build_tiny_model()
    drafter = EagleDrafter(model=_eagle(model, depth=3, top_k=2, max_nodes=6), adapt_depth=False, cuda_graphs=True)
    generate(model, [[5, 6, 7, 8, 9, 10, 11, 12]], max_new_tokens=10, drafter=drafter, speculation="always")
    assert flags[:2] == [True, True] and not any(flags[2:]) and len(flags) >= 3  # the prompt's catch-up, a capture


def test_a_bfloat16_head_rotates_by_the_float32_frequencies():
    """An EAGLE head in bfloat16 (as on a GPU) rotates by the float32 RoPE frequencies it was trained with: as a
    buffer, Module.to(bfloat16) rounded them by up to 0.4%, about a radian of angle 256 positions apart."""
    eagle = _eagle(build_tiny_model())
    positions = torch.arange(0, 2048, 37)
    wanted = eagle.rope(positions, torch.float32)
    got = eagle.to(torch.bfloat16).rope(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, wanted, strict=True))


def test_stats_record_the_nodes_each_step_verified():
    model = build_tiny_model()
    drafter = Recorder(model=_eagle(model, depth=3, top_k=2, max_nodes=5))
    out = generate(model, [[4, 5, 6, 7]], max_new_tokens=30, drafter=drafter, return_dict=True,
                   speculation="always")
    nodes, proposed = out.stats[0].step_nodes, [t.num_nodes for t in drafter.trees]
    assert len(nodes) == out.stats[0].steps == len(proposed)
    assert all(n <= p for n, p in zip(nodes, proposed, strict=True))
    assert nodes[:-3] == tuple(proposed[:-3])  # cut near the end
    assert max(nodes) == 5


def test_one_token_prompt_and_stop_tokens():
    model = build_tiny_model()
    eagle = _eagle(model, depth=3, top_k=2, max_nodes=4)
    prompts = [[5], [7, 8, 9, 10]]
    plain = generate(model, prompts, max_new_tokens=12, return_dict=True).new_tokens
    spec = generate(model, prompts, max_new_tokens=12, drafter="eagle", drafter_options={"model": eagle},
                    return_dict=True).new_tokens
    assert spec == plain


def test_a_given_eagle_model_is_left_in_its_mode():
    """A layer the caller is training (train mode) drafts as in eval mode (no dropout) and stays in train mode, as
    the target and Medusa heads do: attach switched it to eval mode for good."""
    model = build_tiny_model()
    eagle = _eagle(model, depth=2, top_k=2, max_nodes=4).train()
    prompts = [[5, 6, 7]]
    plain = generate(model, prompts, max_new_tokens=6)
    assert generate(model, prompts, max_new_tokens=6, drafter="eagle", drafter_options={"model": eagle}) == plain
    assert all(m.training for m in eagle.modules())


def test_sampled_law_certificate_passes_and_controls_fail():
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    eagle = _eagle(loaded.model, depth=2, top_k=2, max_nodes=3)
    sizes = CertificateSizes(stat_samples=4000, identity_prompts=4, identity_tokens=16, sample_sequences=600,
                             sample_tokens=2, e2e_tv=0.12)
    prompts = lambda n: [[1, 2, 3, 1, 2, 3], [5, 6, 7, 5], [9, 4, 9, 4, 9], [8, 2, 8, 2, 10]][:n]  # noqa: E731
    cert = run_certificate(loaded, "eagle", {"model": eagle}, SamplingConfig(True, 0.9, 6), sizes, prompts,
                           levels=("exact", "e2e"))
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    controls = [c for c in cert.checks if c.control]
    assert controls and all(not c.passed for c in controls)  # a broken rule / engine is caught


# ---- checkpoints ------------------------------------------------------------------------------
def test_checkpoint_round_trip_and_published_layout(tmp_path):
    model = build_tiny_model()
    ids = frequent_tokens([list(range(50)), list(range(0, 96, 2))], 40, always=[2])
    eagle = _eagle(model, ids, depth=3, top_k=2, max_nodes=5)
    save_eagle(eagle, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["hidden_size"] == model.config.hidden_size and raw["draft_vocab_size"] == 40
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight", "lm_head.weight", "d2t"} <= keys
    assert all(k.startswith(("fc.", "layers.0.", "lm_head.", "d2t", "norm.")) for k in keys)
    loaded = load_eagle(tmp_path, model.config)
    assert loaded.config.draft_vocab == tuple(ids) and loaded.config.max_nodes == 5
    want, got = eagle.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)  # the same tensors by name, none missing or extra
    for k, a in want.items():
        assert torch.equal(a, got[k]), k
    prompts = ragged_prompts(2, seed=5)
    a = generate(model, prompts, max_new_tokens=10, drafter="eagle", drafter_options={"path": str(tmp_path)})
    assert a == generate(model, prompts, max_new_tokens=10)


def test_a_published_eagle1_layer_without_norms_loads_and_drafts(tmp_path):
    """The published EAGLE-1 layout has no norm tensors: such a checkpoint is read as one without norms, where
    assuming norms refused it ("the weights do not match config.json"), and its drafts keep the target's tokens."""
    from safetensors.torch import load_file

    model = build_tiny_model()
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, norms=False))
    eagle.init_from_target(model)
    save_eagle(eagle, tmp_path)
    assert not any("norm" in k and "layernorm" not in k for k in load_file(str(tmp_path / "model.safetensors")))
    assert load_eagle(tmp_path, model.config).config.norms is False
    prompts = ragged_prompts(2, seed=3)
    assert generate(model, prompts, max_new_tokens=8, drafter="eagle", drafter_options={"path": str(tmp_path)},
                    speculation="always") == generate(model, prompts, max_new_tokens=8)


@pytest.mark.parametrize("layers, fits", [((0, 1, 2), True), ((0, 1, 3), False)])
def test_an_eagle3_head_reading_a_layer_past_the_targets_is_refused(tmp_path, layers, fits):
    """A 2-layer target has feature ids 0..2 (2: the last stream before the final norm); a head reading id 3 was made
    for another target and is refused when it loads."""
    model = build_tiny_model()
    assert model.config.num_hidden_layers == 2
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, arch="eagle3", feature_layers=layers))
    save_eagle(eagle, tmp_path)
    if fits:
        assert load_eagle(tmp_path, model.config).config.feature_layers == layers
    else:
        with pytest.raises(EagleCheckpointError, match=r"reads target layers \[0, 1, 3\] but the target model has 2 "
                                                       "layers: it was made for another target"):
            load_eagle(tmp_path, model.config)


@pytest.mark.parametrize("arch", ["eagle1", "eagle3"])
def test_top_k_beyond_the_draft_vocabulary_is_refused_before_the_cost_measurement(tmp_path, monkeypatch, arch):
    """Refused when the layer loads for the target; it was refused at attach, after speculation="auto" had measured
    the verify costs (minutes on a large target)."""
    def no_measurement(*args, **kwargs):
        raise AssertionError("the verify costs were measured before top_k was refused")

    monkeypatch.setattr("specdec.engine_setup.load_cost_model", no_measurement)
    model = build_tiny_model()
    torch.manual_seed(0)
    save_eagle(EagleModel(EagleConfig.for_target(model.config, arch=arch, draft_vocab=(1, 2, 3))), tmp_path)
    with pytest.raises(InputError, match="^eagle: top_k=4 exceeds the draft vocabulary of 3 tokens"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, drafter="eagle",
                 drafter_options={"path": str(tmp_path), "top_k": 4}, speculation="auto")


def test_a_top_k_above_max_nodes_is_refused():
    """A tree of max_nodes nodes keeps no more than max_nodes children of a node, nor expands more nodes a depth: a
    larger top_k drafted the trees of top_k=max_nodes (the same trees, every one compared), more slowly, without a
    word. Refused when both are given, and against the layer's max_nodes when only top_k is."""
    with pytest.raises(InputError, match=r"^eagle: top_k=8 exceeds max_nodes=4: .* drafts as top_k=4"):
        EagleDrafter(model=_eagle(build_tiny_model()), top_k=8, max_nodes=4)
    model = build_tiny_model()
    eagle = _eagle(model, depth=3, top_k=2, max_nodes=4)
    with pytest.raises(InputError, match=r"^eagle: top_k=5 exceeds the layer's max_nodes=4: .*\(lower top_k"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=EagleDrafter(model=eagle, top_k=5))
    assert generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=EagleDrafter(model=eagle, top_k=4))  # its budget


def test_a_checkpoint_is_loaded_once_per_process_until_its_files_change(tmp_path, monkeypatch):
    """generate(drafter="eagle", path=...) once per answer read and checked the checkpoint in every call (0.14 s of
    a 16-token answer's ~1 s on a 2-core CPU); the layer is now taken from the last call while the files stay.
    A loaded layer is laid out for CUDA at every attach (EagleModel.pack_on_cuda: on the CPU as built), a layer
    passed in as an object never."""
    from specdec.drafters import eagle as eagle_module
    from specdec.drafters.loaded_once import forget

    forget()
    reads, packs = [], []
    real = eagle_module.load_eagle
    monkeypatch.setattr(eagle_module, "load_eagle", lambda *a, **k: reads.append(1) or real(*a, **k))
    real_pack = EagleModel.pack_on_cuda
    monkeypatch.setattr(EagleModel, "pack_on_cuda", lambda self: packs.append(self) or real_pack(self))
    model = build_tiny_model()
    save_eagle(_eagle(model, depth=2, top_k=2, max_nodes=3), tmp_path)
    prompts = ragged_prompts(2, seed=6)
    plain = generate(model, prompts, max_new_tokens=8)
    drafted = [generate(model, prompts, max_new_tokens=8, drafter="eagle", drafter_options={"path": str(tmp_path)},
                        speculation="always") for _ in range(3)]
    assert drafted == [plain] * 3 and len(reads) == 1
    assert len(packs) == 3 and len({id(m) for m in packs}) == 1
    given = EagleDrafter(model=_eagle(model, depth=2, top_k=2, max_nodes=3))
    assert generate(model, prompts, max_new_tokens=8, drafter=given, speculation="always") == plain
    assert len(packs) == 3
    save_eagle(_eagle(model, seed=1, depth=2, top_k=2, max_nodes=3), tmp_path)  # rewritten: read again
    assert generate(model, prompts, max_new_tokens=8, drafter="eagle", drafter_options={"path": str(tmp_path)},
                    speculation="always") == plain and len(reads) == 2
    forget()


def test_loaded_weights_are_owned_not_views_of_the_file(tmp_path):
    """The loader builds the layer on the meta device and takes the checkpoint's tensors as its parameters: those
    must be copies, or a checkpoint overwritten in place (a training run saving again) changes a loaded drafter."""
    model = build_tiny_model()
    save_eagle(_eagle(model), tmp_path)
    loaded = load_eagle(tmp_path, model.config)
    before = {k: v.clone() for k, v in loaded.state_dict().items()}
    file = tmp_path / "model.safetensors"
    other = _eagle(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    save_eagle(other, tmp_path / "other")
    with open(file, "r+b") as f:  # in place: the same inode, the same length
        f.write((tmp_path / "other" / "model.safetensors").read_bytes())
    assert all(torch.isfinite(t).all() for t in loaded.rope(torch.arange(8), torch.float32))  # built, not meta
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_wrong_target_pickles_and_broken_eagle3_are_refused(tmp_path):
    model = build_tiny_model()
    save_eagle(_eagle(model), tmp_path / "ok")
    other = build_tiny_model(vocab_size=80)
    with pytest.raises(EagleCheckpointError, match="vocab_size=96 but the target model has vocab_size=80"):
        load_eagle(tmp_path / "ok", other.config)
    narrower = build_tiny_model(hidden_size=32, intermediate_size=64)
    with pytest.raises(EagleCheckpointError, match="hidden_size=64 but the target model has hidden_size=32"):
        generate(narrower, [[1, 2, 3]], max_new_tokens=2, drafter="eagle",
                 drafter_options={"path": str(tmp_path / "ok")})
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(EagleCheckpointError, match="pickle.*never loaded.*save_file"):
        load_eagle(tmp_path / "pickled", model.config)
    # an EAGLE-3 layout (midlayer.*) missing most of its layer: the weights do not match (tests/test_head_layouts.py
    # loads whole ones)
    from safetensors.torch import save_file

    H = model.config.hidden_size
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    save_file({"fc.weight": torch.zeros(H, 3 * H), "midlayer.input_layernorm.weight": torch.ones(H),
               "d2t": torch.zeros(8, dtype=torch.long)}, str(tmp_path / "e3" / "model.safetensors"))
    with pytest.raises(EagleCheckpointError, match="weights do not match config.json"):
        load_eagle(tmp_path / "e3", model.config)
    with pytest.raises(EagleCheckpointError, match="config.json is missing"):
        load_eagle(tmp_path / "pickled" / "..", model.config)


def test_depth_beyond_max_nodes_grows_no_more_levels_than_a_tree_can_hold():
    """depth=50 with max_nodes=4 grew 50 levels per call, and the tree kept at most 4 of them."""
    model = build_tiny_model()
    prompts = ragged_prompts(2, seed=5)
    plain = generate(model, prompts, max_new_tokens=8)
    depths = []

    class Depths(EagleDrafter):
        def _finish(self, call, pools):
            depths.append(call.depth)
            return super()._finish(call, pools)

    drafter = Depths(model=_eagle(model, depth=2, top_k=2, max_nodes=4), depth=50, max_nodes=4, adapt_depth=False)
    assert generate(model, prompts, max_new_tokens=8, drafter=drafter, speculation="always") == plain
    assert depths and max(depths) == 4 and drafter.chooser.max_depth == 4  # adapt_depth's bound too


def test_bad_options_are_one_line_errors():
    from specdec.errors import InputError

    with pytest.raises(InputError, match="exactly one of path"):
        EagleDrafter()
    with pytest.raises(InputError, match="max_nodes must be <= 64"):
        EagleDrafter(path="x", max_nodes=65)
    with pytest.raises(InputError, match="depth must be a positive integer"):
        EagleDrafter(path="x", depth=0)


# ---- training loss ----------------------------------------------------------------------------
def test_unrolled_mask_sees_the_ancestors_a_draft_tree_would():
    m = unrolled_mask(5, 3, "cpu")  # pass 3, query 3: pass-1 keys 0..1, pass-2 key 2, itself
    assert m[3].nonzero().flatten().tolist() == [0, 1, 5 + 2, 10 + 3]
    assert unrolled_mask(4, 1, "cpu").equal(torch.ones(4, 4, dtype=torch.bool).tril())


def test_one_optimizer_step_lowers_the_loss_and_oov_labels_are_misses():
    model = build_tiny_model()
    eagle = _eagle(model, vocab=tuple(range(48)))
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        labels = model.lm_head(hidden).argmax(-1)
    embed, lm = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    opt = torch.optim.AdamW(eagle.parameters(), lr=3e-3)
    before, correct, count = eagle_loss(eagle, ids, hidden, labels, mask, embed, lm, steps=3)
    assert len(correct) == 3 and count[0] == 3 * 19 and count[2] == 3 * 17  # deeper passes start later
    before.backward()
    opt.step()
    after, _, _ = eagle_loss(eagle, ids, hidden, labels, mask, embed, lm, steps=3)
    assert after.item() < before.item()
    oov = labels.clone().fill_(90)  # outside the reduced vocabulary: never correct
    _, correct, _ = eagle_loss(eagle, ids, hidden, oov, mask, embed, lm, steps=2)
    assert correct == [0, 0]


def test_the_loss_pairs_each_query_with_the_token_and_feature_after_its_input():
    """Query j reads (f_j, t_{j+1}). Pass 1's loss is the cross-entropy against the target's token after t_{j+1}
    (labels[j + 1]) over the queries whose targets are in the draft vocabulary, divided by their count, plus the
    smooth-L1 regression onto f_{j+1} over every real query, divided by that count times H. Pass 2 reads pass 1's
    prediction made at query j - 1 (zeros at query 0). Shifting the tokens or the features, dropping the
    regression, dividing the cross-entropy by every position, or feeding pass 2 unshifted each trained a worse head
    and passed the test above."""
    import torch.nn.functional as F

    model = build_tiny_model()
    eagle = _eagle(model, vocab=tuple(range(48)))  # a draft token's index is its id; ids 48-95 are outside
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # padding
    embed, lm = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        labels = model.lm_head(hidden).argmax(-1)
        calls = []
        real = eagle.forward
        eagle.forward = lambda *a: (lambda out: calls.append((a[1], out[0])) or out)(real(*a))  # (f, out)
        ce_alone = eagle_loss(eagle, ids, hidden, labels, mask, embed, lm, steps=1, reg_weight=0.0)[0]
        with_reg = eagle_loss(eagle, ids, hidden, labels, mask, embed, lm, steps=1, reg_weight=1.0)[0]
        calls.clear()
        eagle_loss(eagle, ids, hidden, labels, mask, embed, lm, steps=2)
    out = calls[0][1]  # pass 1's predictions: query j at out[:, j]
    valid = mask[:, 1:].bool()  # query j predicts position j + 2, a real token where mask[j + 1] is
    want_tokens = labels[:, 1:][valid]
    in_vocab = want_tokens < 48
    assert 0 < int(in_vocab.sum()) < len(want_tokens)  # both kinds, or the divisor goes untested
    logits = eagle.logits(out[valid], lm).float()
    ce = F.cross_entropy(logits[in_vocab], want_tokens[in_vocab], reduction="sum") / int(in_vocab.sum())
    reg = F.smooth_l1_loss(out[valid], hidden[:, 1:][valid], reduction="sum") / (out.shape[-1] * int(valid.sum()))
    assert ce_alone.item() == pytest.approx(ce.item(), rel=1e-5)
    assert with_reg.item() == pytest.approx((ce + reg).item(), rel=1e-5)
    (first_features, first_out), (second_features, _) = calls
    assert torch.equal(second_features[:, 0], torch.zeros_like(first_out[:, 0]))
    assert torch.equal(second_features[:, 1:], first_out[:, :-1])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_a_checkpoint_error(tmp_path, value):
    """A damaged or diverged checkpoint is named as one when it loads, not found later as NaN draft logits."""
    model = build_tiny_model()
    eagle = _eagle(model)
    with torch.no_grad():
        eagle.fc.weight[0, 0] = value
    save_eagle(eagle, tmp_path)
    with pytest.raises(EagleCheckpointError, match=r"model.safetensors: weights hold NaN or infinite values \(fc"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, drafter="eagle", drafter_options={"path": str(tmp_path)})


def test_the_kv_slab_holds_each_sequences_keys_through_growth_and_reused_rows():
    """drafters/eagle_kv.py against per-sequence concatenation: appends of 1-5 columns for sequences that come and
    go, with rows and capacity growing from 2 x 4; a gather is each sequence's keys, right-padded and masked."""
    gen = torch.Generator().manual_seed(0)
    kv = EagleKV(2, 3, torch.float32, torch.device("cpu"), rows=2, capacity=4)
    want: dict[int, torch.Tensor] = {}
    live, next_id = [], 0
    for step in range(40):
        if len(live) < 5 and step % 3 == 0:
            live.append(next_id)
            next_id += 1
        if step % 7 == 6:
            gone = live.pop(0)
            kv.release(gone)
            want.pop(gone, None)
        counts = [int(torch.randint(1, 6, (1,), generator=gen)) for _ in live]
        new_k = torch.randn(len(live), 2, max(counts), 3, generator=gen)
        kv.append(live, new_k, -new_k, counts)
        for b, (i, n) in enumerate(zip(live, counts, strict=True)):
            want[i] = torch.cat([want.get(i, torch.zeros(2, 0, 3)), new_k[b, :, :n]], dim=1)
        for ids in (live, live[-1:]):
            k, v = kv.gather(ids)
            assert k.shape[2] == max(kv.lengths(ids))
            for b, i in enumerate(ids):
                n = want[i].shape[1]
                assert kv.lengths(ids)[b] == n
                assert torch.equal(k[b, :, :n], want[i]) and torch.equal(v[b, :, :n], -want[i])
    assert kv.k.shape[0] >= 5 and kv.k.shape[2] > 4 and len(kv.row) == len(live)
    assert kv.gather([next_id])[0] is None  # a sequence never seen has no keys


def test_a_full_kv_row_keeps_every_column_when_the_slab_grows():
    """Capacity 4: sequence 0 fills its row (4 columns), then a fifth column doubles the capacity to 8; all five are
    there after the copy into the larger slab, the last of the old four included."""
    kv = EagleKV(1, 1, torch.float32, torch.device("cpu"), rows=1, capacity=4)
    cols = torch.arange(5.0).reshape(1, 1, 5, 1)
    kv.append([0], cols[:, :, :4], -cols[:, :, :4], [4])
    kv.append([0], cols[:, :, 4:], -cols[:, :, 4:], [1])
    k, v = kv.gather([0])
    assert kv.k.shape[2] == 8 and k.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0] and torch.equal(v, -k)


def test_the_kv_slab_copies_a_prefix_only_from_a_sequence_holding_it_into_new_ones():
    kv = EagleKV(1, 2, torch.float32, torch.device("cpu"), rows=2, capacity=4)
    keys = torch.arange(6.0).reshape(1, 1, 3, 2)  # sequence 0: three columns [0, 1], [2, 3], [4, 5]
    kv.append([0], keys, -keys, [3])
    with pytest.raises(ValueError, match="must hold them"):
        kv.copy_prefix(0, [1], 4)  # sequence 0 holds 3 keys, not 4
    with pytest.raises(ValueError, match="must be new and distinct"):
        kv.copy_prefix(0, [0, 1], 2)  # a sequence cannot be its own copy
    assert 1 not in kv
    kv.copy_prefix(0, [1, 2], 2)  # the slab grows a row for the second copy
    k, v = kv.gather([1, 2])
    assert kv.lengths([1, 2]) == [2, 2] and k.tolist() == [[[[0.0, 1.0], [2.0, 3.0]]]] * 2
    assert torch.equal(v, -k)
    row = kv.row[1]
    kv.release(1)
    kv.append([3], keys, keys, [1])  # a released row is reused: no growth past the 4 rows of the copy above
    assert kv.row[3] == row and kv.k.shape[0] == 4


def test_a_graph_bucket_holds_exactly_its_keys_and_the_config_refuses_bad_sizes():
    graphs = EagleGraphs(None, EagleGraphConfig(capture=False))
    assert graphs.bucket_for(1, 64) == (1, 64, 0)  # 64 keys fill the smallest bucket exactly
    assert graphs.bucket_for(2, 56, 8) == (2, 64, 8)  # 56 cached + 8 catch-up rows = 64
    assert graphs.bucket_for(1, 1 << 16) == (1, 1 << 16, 0)  # max_keys itself still fits
    for bad in ({"batch_sizes": (0, 1)}, {"catch_up_rows": (8, 8)}, {"min_keys": 128, "max_keys": 64}):
        with pytest.raises(ValueError):
            EagleGraphConfig(**bad)


def test_a_call_ending_lets_go_only_of_its_own_grower():
    """release(graphs, grower) at the end of a call: a later call's grower, set on the graphs since, stays."""
    graphs = EagleGraphs(None, EagleGraphConfig(capture=False))
    first, later = object(), object()
    graphs.grower = later
    release(graphs, first)
    assert graphs.grower is later
    release(graphs, later)
    assert graphs.grower is None


def _pools(batch: int, top_k: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """Random candidate pools as the growth lays them out ([B, 4, S]): parents before children, cumulative
    log-probabilities that never rise along a path, rounded so that candidates tie."""
    S = top_k + (depth - 1) * top_k * top_k
    pools = torch.zeros(batch, 4, S, dtype=torch.float64)
    for b in range(batch):
        parent = [-1] * top_k
        for d in range(1, depth):
            start, width = (0, top_k) if d == 1 else (top_k + (d - 2) * top_k * top_k, top_k * top_k)
            parent += [start + int(torch.randint(width, (1,), generator=gen)) for _ in range(top_k * top_k)]
        cond = -(torch.rand(S, generator=gen) * 4).round(decimals=0)  # 0, -1, ..., -4: many ties
        cum = [0.0] * S
        for i, p in enumerate(parent):
            cum[i] = float(cond[i]) + (cum[p] if p >= 0 else 0.0)
        pools[b, 0] = torch.randint(100, (S,), generator=gen).double()
        pools[b, 1], pools[b, 2], pools[b, 3] = torch.tensor(parent).double(), torch.tensor(cum), cond.double()
    return pools


def test_the_device_rerank_keeps_the_best_candidates_closed_under_parents():
    """drafters/eagle_rerank.py against the rule written out on the host: the max_nodes best by cumulative
    log-probability (ties to the earlier candidate), in pool order, parents renumbered; with ties everywhere the
    kept set is still closed under parents. A candidate whose parent is left out (NaN scores) is marked and the
    drafter makes it a root child."""
    from specdec.drafters.eagle_rerank import rerank

    gen = torch.Generator().manual_seed(0)
    for top_k, depth, max_nodes in ((2, 3, 5), (3, 4, 10), (4, 5, 64), (2, 2, 64)):
        pools = _pools(6, top_k, depth, gen)
        got = rerank(pools, max_nodes)
        for b in range(6):
            tok, parent, cum, cond = pools[b].tolist()
            keep = sorted(sorted(range(len(tok)), key=lambda i: (-cum[i], i))[:max_nodes])
            place = {i: n for n, i in enumerate(keep)}
            assert all(parent[i] < 0 or parent[i] in place for i in keep)  # closed
            want = [[tok[i] for i in keep], [place.get(int(parent[i]), -1) for i in keep], [cum[i] for i in keep],
                    [cond[i] for i in keep]]
            assert got[b].tolist() == want, (top_k, depth, b)
    whole = _pools(2, 2, 2, gen)
    assert rerank(whole, whole.shape[2]) is whole  # every candidate kept (a chain's pool): the pool itself
    pools = _pools(1, 2, 3, gen)
    pools[0, 2, 1] = float("nan")  # candidate 1 sorts last and is left out; its children are kept
    reranked = rerank(pools, 5)
    rows = reranked[0].tolist()
    assert -2.0 in rows[1]
    model = build_tiny_model()
    drafter = EagleDrafter(model=_eagle(model, depth=3, top_k=2, max_nodes=5))
    drafter.draft_ids = None
    (tree,) = drafter._trees(reranked)
    # every candidate kept, node for node (pending trees were verified so); an orphan becomes a root child
    assert tree.num_nodes == len(rows[1]) and tree.tokens.tolist() == [int(t) for t in rows[0]]
    assert tree.parents.tolist() == [-1 if p == -2 else int(p) for p in rows[1]]
    assert tree.num_nodes >= 1 and all(p < i for i, p in enumerate(tree.parents.tolist()))


@pytest.mark.parametrize("coupled", [False, True], ids=["greedy", "coupled"])
def test_a_chain_grows_the_pool_the_ranking_path_grows(coupled):
    """top_k 1: each level's one child is the next level's parent, so the growth ranks and gathers nothing; its
    pool is the general path's bit for bit (tokens, parents, cumulative and conditional log-probabilities), for a
    batch whose cached keys have padding columns, greedy and under coupled sampling's noise."""
    from specdec.drafters.eagle_grow import GrowInputs, TreeGrower

    from specdec.coupling import Coupling
    from specdec.sampling import SamplingConfig

    model = build_tiny_model()
    eagle = _eagle(model, depth=5, top_k=1, max_nodes=5).eval()
    c, gen = eagle.config, torch.Generator().manual_seed(3)
    B, P = 3, 9
    x = GrowInputs(torch.randn(B, c.hidden_size, generator=gen), torch.randn(B, c.num_kv_heads, P, c.head_dim,
                                                                              generator=gen),
                   torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen),
                   torch.arange(P)[None] < torch.tensor([[9], [4], [1]]), torch.tensor([20, 8, 3]),
                   torch.tensor([5, 6, 7]))
    sampling = SamplingConfig(do_sample=True, temperature=0.8) if coupled else SamplingConfig()
    grower = TreeGrower(eagle, model.get_input_embeddings().weight.detach(),
                        model.get_output_embeddings().weight.detach(), sampling, Coupling(seed=11) if coupled else None,
                        1, c.vocab_size, 5)
    assert grower.chain
    with torch.inference_mode():
        fast = grower.pool(x, 5)
        grower.chain = False  # the ranking path: sorts, gathers and parents by index
        ranked = grower.pool(x, 5)
    assert fast.shape == (B, 4, 5) and torch.equal(fast, ranked)
    assert fast[:, 1].tolist() == [[-1, 0, 1, 2, 3]] * B


def _greedy_chain_graphs(model, eagle, max_nodes: int):
    """A greedy chain grower (top-k 1) over ``model``'s embeddings and its uncaptured EagleGraphs."""
    from specdec.drafters.eagle_grow import TreeGrower

    grower = TreeGrower(eagle, model.get_input_embeddings().weight.detach(),
                        model.get_output_embeddings().weight.detach(), SamplingConfig(), None, 1,
                        model.config.vocab_size, max_nodes)
    return grower, EagleGraphs(grower, EagleGraphConfig(capture=False))


def test_a_chains_graph_bucket_hands_out_constant_fields_equal_to_its_trees():
    """A chain kept whole (top_k 1, depth <= max_nodes): its padded static call (what a CUDA graph replays) hands the
    verify the bucket's constant depths and ancestor bits (specdec.pending_trees.chain_fields, made once per bucket
    and depth before the call, not by it), which equal tree_fields of the parents it drafted: 3 sequences padded to
    a bucket of 4, depths 1 to 64, one sequence's scores NaN. Its tokens are the drafts' target ids."""
    from specdec.drafters.eagle_rerank import parents

    from specdec.pending_trees import tree_fields

    model = build_tiny_model()
    eagle = _eagle(model, vocab=range(0, 96, 3), depth=64, top_k=1, max_nodes=64).eval()
    c, gen = eagle.config, torch.Generator().manual_seed(3)
    grower, graphs = _greedy_chain_graphs(model, eagle, 64)
    B, P = 3, 9
    k, v = (torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen) for _ in range(2))
    past = CachedKeys(k, v, [9, 4, 1], [20, 8, 3], [5, 6, 7], torch.device("cpu"))
    h_root = torch.randn(B, c.hidden_size, generator=gen)
    h_root[1] = float("nan")
    made = {}
    with torch.inference_mode():
        for depth in (1, 2, 6, 7, 64, 6):
            out = graphs.pool(past, h_root, depth, fields=True)
            bucket = graphs.buckets[(4, 64, 0)]
            depths, bits = made.setdefault(depth, bucket.chain_fields[depth])  # made once, then kept
            assert bucket.chain_fields[depth] == (depths, bits) and depths.shape == bits.shape == (4, depth)
            f = out.fields
            assert f.depths.data_ptr() == depths.data_ptr() and f.ancestor_bits.data_ptr() == bits.data_ptr()
            assert out.rows.shape == (B, 4, depth) and f.depths.shape == (B, depth)
            assert [t.tolist() for t in (f.depths, f.ancestor_bits)] == [
                t.tolist() for t in tree_fields(parents(out.rows), depth)], depth
            assert f.tokens.tolist() == grower.draft_ids[out.rows[:, 0].long()].tolist()
            assert out.rows[1, 2].isnan().all() and not out.rows[0, 2].isnan().any()
    assert set(bucket.chain_fields) == {1, 2, 6, 7, 64}


def test_a_graph_bucket_gathers_rope_from_its_table_and_leaves_a_call_beyond_it_to_the_eager_path():
    """A bucket's calls gather their RoPE rows from a table of twice its keys' positions, made once per key count
    before any capture; a call whose tree would reach past it fits no bucket (None: the caller drafts eagerly),
    where gathering would read out of bounds. Both parts of the call (catch-up and growth) read the table."""
    from specdec.drafters.eagle_catch_up import CatchUpRows

    model = build_tiny_model()
    eagle = _eagle(model, depth=4, top_k=1, max_nodes=4).eval()
    c, gen = eagle.config, torch.Generator().manual_seed(3)
    grower, graphs = _greedy_chain_graphs(model, eagle, 4)
    B, P = 2, 9
    k, v = (torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen) for _ in range(2))
    rows = CatchUpRows(torch.randn(B, 2, c.hidden_size, generator=gen), [[3, 4], [5, 0]], [[123, 124], [3, 0]],
                       [2, 1])
    with torch.inference_mode():
        for last_root, fits in ((124, True), (125, False)):  # positions up to root + depth - 1 < 2 x 64
            past = CachedKeys(k, v, [9, 2], [last_root, 3], [5, 6], torch.device("cpu"))
            assert (graphs.caught_up_pool(past, rows, 4) is not None) == fits
            assert (graphs.pool(past, torch.randn(B, c.hidden_size, generator=gen), 4) is not None) == fits
    table = graphs.rope_tables[64]
    assert table.shape == (2, 128, c.head_dim) and set(graphs.rope_tables) == {64}
    buckets = graphs.buckets
    assert buckets[(2, 64, 8)].catch.rope_table is table and buckets[(2, 64, 0)].inputs.rope_table is table


def test_a_path_drafter_reused_with_a_target_of_another_dtype_leaves_the_shared_layer_as_loaded(tmp_path):
    """A layer loaded from a path is shared per (target, dtype, device) by every drafter of that checkpoint
    (drafters/loaded_once.py): a drafter object reused with a bfloat16 target moved the float32 target's shared
    layer to bfloat16 in place, under every other drafter holding it. Each call now takes its target's own."""
    model = build_tiny_model()
    save_eagle(_eagle(model, depth=2, top_k=2, max_nodes=3), tmp_path)
    drafter = EagleDrafter(path=str(tmp_path))
    prompts, kw = ragged_prompts(2, seed=0, max_len=12), dict(max_new_tokens=6, speculation="always")
    plain = generate(model, prompts, **kw)
    assert generate(model, prompts, drafter=drafter, **kw) == plain
    shared = drafter.model
    generate(build_tiny_model().to(torch.bfloat16), prompts, drafter=drafter, **kw)
    assert drafter.model is not shared and next(shared.parameters()).dtype == torch.float32
    assert generate(model, prompts, drafter=EagleDrafter(path=str(tmp_path)), **kw) == plain


def test_a_given_layer_of_another_dtype_is_refused_not_converted_for_good():
    """model= was converted to the target's dtype in place: a float32 head used once with a bfloat16 target came
    back bfloat16, and back in float32 it kept the bfloat16 rounding."""
    model = build_tiny_model()
    eagle = _eagle(model, depth=2, top_k=2, max_nodes=3)
    before = {k: v.clone() for k, v in eagle.state_dict().items()}
    with pytest.raises(InputError, match=r"^eagle: the model= given is in torch.float32 but the target runs in "
                                         r"torch.bfloat16: convert it first \(model.to\(torch.bfloat16\)\)$"):
        generate(build_tiny_model().to(torch.bfloat16), [[1, 2, 3]], max_new_tokens=4,
                 drafter=EagleDrafter(model=eagle))
    assert all(torch.equal(v, before[k]) for k, v in eagle.state_dict().items())
    prompts = ragged_prompts(2, seed=0, max_len=12)
    assert generate(model, prompts, max_new_tokens=6, drafter=EagleDrafter(model=eagle),
                    speculation="always") == generate(model, prompts, max_new_tokens=6)
