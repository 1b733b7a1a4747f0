"""EAGLE-3 heads in the eagle drafter on tiny models: the engine's feature layers are the target's own residual
streams, greedy identity (batched and single, reduced vocabulary, norm_before_residual), the exact law in each
sampling mode with broken rules caught, and coupled sampling's identity with plain coupled sampling."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel, default_feature_layers
from specdec.eval.certificate import CertificateSizes, run_certificate

import specdec
from specdec.attention import BatchBuilder
from specdec.errors import InputError
from specdec.generate import generate
from specdec.kv_cache import PagedKVCache
from specdec.models.llama import LlamaRunner, rms_norm
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model, ragged_prompts
from tests.test_eagle_drafter import Recorder


def eagle3_head(model, vocab=(), seed=0, **fields) -> EagleModel:
    torch.manual_seed(seed)
    head = EagleModel(EagleConfig.for_target(model.config, arch="eagle3", draft_vocab=tuple(vocab), **fields))
    head.init_from_target(model)
    return head


def test_default_feature_layers_are_the_published_low_middle_high():
    assert default_feature_layers(32) == (2, 16, 29)
    assert default_feature_layers(30) == (2, 15, 27)
    assert default_feature_layers(2) == (0, 1, 2)  # too shallow for distinct published ids
    assert default_feature_layers(3) == (0, 1, 3)  # (2, 1, 0) is distinct but high / middle / low
    assert all(a < b < c for a, b, c in map(default_feature_layers, range(2, 80)))
    with pytest.raises(InputError, match="distinct"):
        EagleConfig.for_target(build_tiny_model().config, arch="eagle3", feature_layers=(1, 1, 2))
    with pytest.raises(InputError, match="EAGLE-3 options"):
        EagleConfig.for_target(build_tiny_model().config, feature_layers=(0, 1, 2))
    one_layer = build_tiny_model(num_hidden_layers=1).config  # its defaults (0, 0, 1) were refused as not distinct
    with pytest.raises(InputError, match=r"a 1-layer target has two: give feature_layers=\(0, 1\)"):
        EagleConfig.for_target(one_layer, arch="eagle3")
    assert EagleConfig.for_target(one_layer, arch="eagle3", feature_layers=(0, 1)).num_features == 2


def engine_features(model, ids: list[int], layers: tuple[int, ...]):
    """The runner's prefill forward over ``ids`` with ``feature_layers=layers`` (the engine's verify path)."""
    runner = LlamaRunner(model)
    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks=4)
    cache.add(0)
    cache.reserve_many({0: len(ids)})
    builder = BatchBuilder(cache, runner.device)
    builder.add(0, ids, range(len(ids)), num_keys=len(ids), num_visible=0)
    batch = builder.build()
    return runner.forward(batch.token_ids, batch.positions, batch.plan, cache, torch.arange(len(ids)),
                          feature_layers=layers)


def test_runner_features_are_the_residual_streams_entering_the_layers():
    model = build_tiny_model(num_hidden_layers=4)
    ids = [3, 9, 27, 81, 5, 7]
    asked = (3, 0, 4, 2)
    out = engine_features(model, ids, asked)
    with torch.no_grad():  # transformers: [0] the embeddings, [i] the output of layer i - 1, [L] after the norm
        ref = [h[0] for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states]
    got = out.features.view(len(ids), len(asked), model.config.hidden_size)
    norm = model.model.norm.weight
    for slot, layer in enumerate(asked):  # id 4: before the final norm, so normed here to compare
        mine = got[:, slot] if layer < 4 else rms_norm(got[:, slot], norm, model.config.rms_norm_eps)
        torch.testing.assert_close(mine, ref[layer], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.hidden, ref[4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab,before", [((), False), (tuple(range(0, 96, 3)) + (89,), True)])
def test_greedy_output_is_the_targets_batched_and_single(vocab, before):
    model = build_tiny_model()
    head = eagle3_head(model, vocab, norm_before_residual=before, depth=4, top_k=3, max_nodes=10)
    prompts = ragged_prompts(3, seed=2)
    plain = generate(model, prompts, max_new_tokens=16, return_dict=True).new_tokens
    drafter = Recorder(model=head)
    batched = generate(model, prompts, max_new_tokens=16, drafter=drafter, return_dict=True, speculation="always")
    assert batched.new_tokens == plain
    assert sum(s.steps for s in batched.stats) < sum(s.new_tokens for s in batched.stats)  # it drafted usefully
    single = [generate(model, [p], max_new_tokens=16, drafter=EagleDrafter(model=head), return_dict=True,
                       speculation="always").new_tokens[0] for p in prompts[:2]]
    assert single == plain[:2]
    trees = [t for t in drafter.trees if t.num_nodes]
    assert trees and all(t.num_nodes <= 10 and t.max_depth <= 4 for t in trees)
    if vocab:
        assert set(torch.cat([t.tokens for t in trees]).tolist()) <= set(vocab)


def test_graph_buckets_draft_the_eager_trees_with_fused_features():
    """EAGLE-3 through the padded static call that CUDA graphs replay (uncaptured here): the catch-up fuses the
    three feature layers inside the call, over a reduced vocabulary, and every tree is the eager call's."""
    model = build_tiny_model()
    head = eagle3_head(model, tuple(range(0, 96, 2)), depth=3, top_k=3, max_nodes=8)
    prompts = ragged_prompts(3, seed=4, max_len=30)
    trees = {}
    for graphs in (False, True):
        drafter = Recorder(model=head, adapt_depth=False, cuda_graphs=graphs)
        out = generate(model, prompts, max_new_tokens=20, drafter=drafter, speculation="always")
        trees[graphs] = out, [(t.tokens.tolist(), t.parents.tolist()) for t in drafter.trees]
    assert trees[True] == trees[False] and len(trees[True][1]) > 6
    assert any(key[2] for key in drafter.graphs.buckets)  # a catch-up ran inside the call


def test_the_head_cannot_silently_read_final_hidden_states(monkeypatch):
    """Inside the combined drafter the engine passes final-norm states: refused in one line at attach, before the
    prompt's forward (it was refused at the first propose, after the prefill)."""
    from specdec.engine import Engine

    def no_prefill(*args):
        raise AssertionError("the prompt ran through the target before the head was refused")

    monkeypatch.setattr(Engine, "add", no_prefill)
    model = build_tiny_model()
    head = eagle3_head(model, depth=2, top_k=2, max_nodes=3)
    with pytest.raises(InputError, match="EAGLE-3 head cannot run inside the combined drafter"):
        generate(model, [[4, 5, 6, 7]], max_new_tokens=4, drafter="combined",
                 drafter_options={"drafters": ["ngram", EagleDrafter(model=head)]}, speculation="always")


@pytest.mark.parametrize("sampling,levels", [
    pytest.param(SamplingConfig(True, 0.9, 6), ("exact", "e2e"), marks=pytest.mark.slow),  # ~40 s on 2 cores
    (SamplingConfig(True, 1.0, 0, 0.8), ("exact",))])
def test_exact_law_passes_and_broken_rules_fail(sampling, levels):
    """The exact law (synthetic, in the head's draft mode) and, end to end, the head's sampled output in the
    target's law with a broken engine caught."""
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    head = eagle3_head(loaded.model, depth=2, top_k=2, max_nodes=3)
    sizes = CertificateSizes(stat_samples=2000, identity_prompts=3, identity_tokens=12, sample_sequences=400,
                             sample_tokens=2, e2e_tv=0.15)
    prompts = lambda n: [[1, 2, 3, 1, 2, 3], [5, 6, 7, 5], [9, 4, 9, 4, 9]][:n]  # noqa: E731
    cert = run_certificate(loaded, "eagle", {"model": head}, sampling, sizes, prompts, levels=levels)
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    controls = [c for c in cert.checks if c.control]
    assert controls and all(not c.passed for c in controls)


def test_coupled_speculative_output_is_plain_coupled_output():
    model = build_tiny_model()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8], [10, 20, 30, 10, 20, 30]]
    kw = dict(max_new_tokens=32, do_sample=True, temperature=1.0, seed=11, sampler="coupled")
    plain = specdec.generate(model, prompts, **kw)
    head = eagle3_head(model, depth=3, top_k=3, max_nodes=8)
    spec = specdec.generate(model, prompts, drafter=EagleDrafter(model=head), speculation="always",
                            return_dict=True, **kw)
    assert spec.sequences == plain
    assert sum(s.steps for s in spec.stats) < sum(s.new_tokens for s in spec.stats)


@pytest.mark.slow
@pytest.mark.embedded
def test_embedded_model_greedy_identity_with_an_eagle3_tree():
    """The embedded SmolLM2-135M (30 layers: features of layers 2, 15, 27), an untrained EAGLE-3 head: 3 chat
    prompts x 32 tokens batched, speculative == plain greedy (tests/test_embedded.py runs EAGLE-1 at 20 x 128)."""
    from specdec.eval.prompts import load_prompts

    loaded = load_model("default")
    tok = loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                       return_dict=False) for t in load_prompts("chat", 3)]
    head = eagle3_head(loaded.model, tuple(range(4096)), depth=3, top_k=2, max_nodes=4)
    assert head.config.feature_layers == (2, 15, 27)
    with torch.no_grad():
        plain = specdec.generate(loaded, prompts, max_new_tokens=32)
        spec = specdec.generate(loaded, prompts, max_new_tokens=32, drafter=EagleDrafter(model=head),
                                speculation="always", return_dict=True)
    assert spec.sequences == plain
    assert sum(s.steps for s in spec.stats) < sum(s.new_tokens for s in spec.stats)


def test_the_acceptance_suite_and_the_oracle_hand_an_eagle3_head_its_feature_layers(tmp_path, monkeypatch):
    """Wrappers of a drafter (the suite's counting drafter, the oracle around a real drafter's forward) pass its
    feature layers on: the suite once failed on every EAGLE-3 head ("the engine passed final hidden states"). On
    CUDA the suite's warm-up also captures the verify buckets that return those layers' streams."""
    from types import SimpleNamespace

    from specdec.eval.acceptance import SuiteConfig, run_suite

    warmed = []
    graphs = SimpleNamespace(config=SimpleNamespace(batch_sizes=(1, 2, 4)),
                             warm_up=lambda n, layers=(): warmed.append((n, layers)))
    monkeypatch.setattr("specdec.eval.acceptance.warm_up_model_graphs", lambda *args: graphs)  # as on CUDA
    from specdec.eval.oracle_drafter import AcceptanceProfile, OracleDrafter, reference_continuations

    model = build_tiny_model()
    loaded = load_model(model)
    head = eagle3_head(model, depth=2, top_k=2, max_nodes=3)
    prompts = {"rep": ragged_prompts(2, seed=4)}
    config = SuiteConfig((("eagle", {"model": head}),), ("rep",), prompts_per_category=2, max_new_tokens=8,
                         hf_baseline=False, calibration_repeats=0)
    cells = run_suite(loaded, prompts, config, tmp_path)
    assert cells["eagle", "rep"].new_tokens == cells["plain", "rep"].new_tokens == 16
    assert cells["eagle", "rep"].drafts > 0
    assert warmed == [(1, head.config.feature_layers)] and head.config.feature_layers  # batches of 1 prompt
    references = reference_continuations(loaded, prompts["rep"], 8)
    oracle = OracleDrafter(references, AcceptanceProfile((0.5,)), inner=EagleDrafter(model=head))
    assert oracle.feature_layers == head.config.feature_layers
    out = generate(loaded, prompts["rep"], max_new_tokens=8, drafter=oracle, speculation="always", return_dict=True)
    assert out.new_tokens == [references[tuple(p)] for p in prompts["rep"]]
