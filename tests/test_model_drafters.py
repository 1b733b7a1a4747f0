"""draft-model and self-draft drafters: greedy identity, sampled-law equality, bad input."""
from __future__ import annotations

import logging

import pytest
import torch
from specdec.drafters.base import TargetView
from specdec.drafters.combined import CombinedDrafter
from specdec.drafters.draft_model import DraftModelDrafter, VocabularyMismatchError
from specdec.drafters.model_drafter import DraftConfig, ModelDrafter
from specdec.drafters.self_draft import SelfDraftDrafter
from specdec.eval.negative_controls import generate_with_control
from specdec.eval.two_sample import two_sample_chi2
from transformers.integrations import ggml

import specdec
from specdec import speculation_policy
from specdec.kv_cache import CacheFullError
from specdec.models.llama import LlamaRunner
from specdec.models.loader import load_model
from specdec.rejection import EXACT
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5], [11] * 3 + [12, 13]]

CONFIGS = {
    "self-chain": ("self-draft", dict(num_layers=2, num_draft_tokens=4)),
    "self-dynamic": ("self-draft", dict(num_layers=3, tree="dynamic", max_nodes=12, beam=3)),
    "other-model-static-tree": ("draft-model", dict(widths=(2, 2), num_draft_tokens=3)),
    "target-as-draft-chain": ("draft-model", dict(num_draft_tokens=5)),  # model=target: all accepted
}


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen3-qknorm", "llama-mqa-bias"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_identity_batched_and_single(variant, config, device):
    target = build_tiny_model(variant, num_hidden_layers=4).to(device)
    name, options = CONFIGS[config]
    options = dict(options)
    if name == "draft-model":
        options["model"] = target if config.startswith("target") else build_tiny_model(variant, seed=7).to(device)
    plain = specdec.generate(target, PROMPTS, max_new_tokens=256)
    # speculation="always": whole trees (the guard would rightly stop drafting with the target itself)
    out = specdec.generate(target, PROMPTS, max_new_tokens=256, drafter=name, drafter_options=options,
                           return_dict=True, speculation="always")
    assert out.sequences == plain
    if config.startswith("target"):
        assert out.tau > 5.5  # the accepted path and its K/V really were kept
    for p, ref in zip(PROMPTS[:2], plain[:2], strict=True):
        assert specdec.generate(target, [p], max_new_tokens=256, drafter=name, drafter_options=options)[0] == ref


def test_draft_model_refuses_another_vocabulary():
    target = build_tiny_model(vocab_size=96)
    with pytest.raises(VocabularyMismatchError, match="96"):
        specdec.generate(target, [[1, 2]], max_new_tokens=4, drafter="draft-model",
                         drafter_options={"model": build_tiny_model(vocab_size=64)})


class _Tokens:
    """A tokenizer of ``n`` tokens as the vocabulary check and generate() read one."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def convert_ids_to_tokens(self, i: int) -> str | None:
        return f"t{i}" if i < self.n else None

    def decode(self, ids, **kw) -> str:
        return " ".join(map(str, ids))


def _padded(model, vocab_size: int):
    """``model`` with its vocabulary padded or cut to ``vocab_size`` ids (its other weights the same); rows past
    the old ones copy its first ones, scaled: padding that would be drafted if the drafter read its columns."""
    import copy

    model = copy.deepcopy(model)
    old = model.config.vocab_size
    model.resize_token_embeddings(vocab_size, mean_resizing=False)
    with torch.no_grad():
        for new in range(old, vocab_size):
            model.get_input_embeddings().weight[new] = model.get_input_embeddings().weight[new - old]
            model.lm_head.weight[new] = 2 * model.lm_head.weight[new - old]
    return model


@pytest.mark.parametrize("draft_vocab", [72, 96])
def test_a_draft_model_of_the_targets_tokenizer_padded_to_another_vocabulary_drafts_for_it(draft_vocab):
    """A draft model of the target's tokenizer whose vocabulary is padded to another size (Qwen2.5-0.5B's 151,936
    ids beside Qwen2.5-7B's 152,064) was refused; it drafts among the ids both models have: the target's text, its
    drafts accepted as the target's own weights' (every column where the target's is), and a committed id past the
    draft model's (the prompt's 75 and 79 beside 72 ids, ids of no token) read as its last id."""
    target = build_tiny_model(vocab_size=80, num_hidden_layers=2)
    draft, tokens = _padded(target, draft_vocab), _Tokens(69)
    prompts = [[3, 1, 4, 1, 5], [7, 8], [70, 75, 79, 3]]
    plain = specdec.generate(target, prompts, max_new_tokens=24)
    for options in [{}, {"widths": (2, 2), "num_draft_tokens": 3}, {"tree": "dynamic", "max_nodes": 6}]:
        out = specdec.generate(target, prompts, max_new_tokens=24, drafter="draft-model", tokenizer=tokens,
                               drafter_options={"model": draft, "tokenizer": tokens, **options},
                               speculation="always", return_dict=True)
        assert out.sequences == plain
        if not options:  # a chain of 4: the target's own weights drafted nearly every token it decodes
            assert out.tau > 4.5


@pytest.mark.parametrize("draft_vocab", [6, 10])
def test_a_padded_draft_models_draft_probs_are_its_distribution_over_the_targets_ids(draft_vocab):
    """Sampled children of a draft model padded to another vocabulary size carry the law they were drawn from,
    over the target's ids: its distribution after the target's sampling transform over the ids both models have
    (zero past its own), as the rejection sampler needs for the target's law."""
    target, tokens = build_tiny_model(vocab_size=8, seed=3), _Tokens(6)
    draft = build_tiny_model(vocab_size=draft_vocab, seed=11)
    Spy, trees = _spy_trees(DraftModelDrafter)
    spy = Spy(draft, tokenizer=tokens, seed=0, mode="independent", widths=(3,), num_draft_tokens=2)
    specdec.generate(target, [[1, 2, 3]], max_new_tokens=6, drafter=spy, do_sample=True, seed=0, temperature=0.7,
                     speculation="always", tokenizer=tokens)
    trees = [t for t in trees if t.num_nodes]
    assert trees and all(t.draft_probs is not None and t.draft_probs.shape[-1] == 8 for t in trees)
    with torch.no_grad():
        logits = draft(torch.tensor([[1, 2, 3]])).logits[0, -1, :8]
    expected = torch.zeros(8)
    expected[: logits.numel()] = (logits / 0.7).softmax(-1)
    for i in (trees[0].parents == -1).nonzero().flatten().tolist():
        torch.testing.assert_close(trees[0].draft_probs[i], expected, atol=1e-5, rtol=1e-5)
    assert all(int(t.tokens.max()) < min(draft_vocab, 8) for t in trees)


@pytest.mark.parametrize("draft_tok, target_tok, said", [
    (None, _Tokens(60), "the draft model's tokenizer is unknown"),
    (_Tokens(60), None, "the target's tokenizer is unknown"),
    (None, None, "neither tokenizer is known"),
    (_Tokens(60), _Tokens(61), "their tokenizers have 60 and 61 tokens: the two models need the same tokenizer"),
    (_Tokens(70), _Tokens(70), "their tokenizers both have 70 tokens: the two models need the same tokenizer"),
])
def test_a_draft_model_of_another_vocabulary_size_is_refused_unless_padding_of_one_tokenizer(draft_tok, target_tok,
                                                                                              said):
    """Sizes may differ only by padding: both tokenizers known, alike, and each of their tokens an id of both."""
    from specdec.drafters.draft_model import check_vocabularies

    draft = load_model(build_tiny_model(vocab_size=64)).runner
    target = load_model(build_tiny_model(vocab_size=96)).runner
    with pytest.raises(VocabularyMismatchError, match=rf"^draft-model: the draft model's vocabulary has 64 ids, the "
                                                      rf"target's 96, and {said}"):
        check_vocabularies(draft, draft_tok, target, target_tok)
    check_vocabularies(draft, _Tokens(64), target, _Tokens(64))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_draft_gguf_of_another_vocabulary_is_refused_before_its_conversion(tmp_path, monkeypatch, arch):
    """The draft file was converted first (seconds to minutes, a cache folder written for nothing), then refused
    without its name: now its header's vocabulary size is compared before any conversion work, in one line naming
    the file and both sizes."""
    pytest.importorskip("gguf")
    from tests.test_gguf_llama import HEADS, HIDDEN, KV_HEADS, LAYERS, VOCAB, write_llama_gguf

    biases = {f"blk.{i}.attn_{p}.bias": ((HEADS if p == "q" else KV_HEADS) * (HIDDEN // HEADS),)
              for i in range(LAYERS) for p in "qkv"} if arch == "qwen2" else None
    path = write_llama_gguf(tmp_path / "draft.gguf", arch=arch, extra_tensors=biases)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(VocabularyMismatchError, match=rf"^draft-model: the draft model {path} has a vocabulary of "
                                                      rf"{VOCAB} ids, the target's 96; the two models need the same "
                                                      r"tokenizer$"):
        specdec.generate(build_tiny_model(vocab_size=96), [[1, 2]], max_new_tokens=4, drafter="draft-model",
                         drafter_options={"model": str(path)})
    assert not (tmp_path / "cache").exists()
    if arch == "qwen2" and hasattr(ggml, "GGUFQwen2Converter"):
        pytest.skip("this transformers builds a GGUF's qwen2 tokenizer with its slow-tokenizer converter, which "
                    "cannot build one without merges (the test file's vocabulary has none)")
    target = build_tiny_model("llama-gqa-tied" if arch == "llama" else "qwen2-bias", vocab_size=VOCAB)
    plain = specdec.generate(target, [[1, 5, 9]], max_new_tokens=12)
    assert specdec.generate(target, [[1, 5, 9]], max_new_tokens=12, drafter="draft-model", speculation="always",
                            drafter_options={"model": str(path), "widths": (2, 2)}) == plain


def test_a_draft_gguf_of_another_vocabulary_size_is_left_converted_where_it_may_be_the_targets_tokenizer_padded(
        tmp_path):
    """The header's size check refused a GGUF draft model whose vocabulary is the target's tokenizer padded to
    another size; it refuses one only where its size cannot be that (the target's tokenizer unknown, or holding
    tokens past its ids): the converted model's tokenizer is compared then (check_vocabularies)."""
    pytest.importorskip("gguf")
    from specdec.drafters.draft_model import check_gguf_vocabulary

    from tests.test_gguf_llama import VOCAB, write_llama_gguf

    path = write_llama_gguf(tmp_path / "draft.gguf")
    target = load_model(build_tiny_model(vocab_size=96)).runner
    check_gguf_vocabulary(path, target, _Tokens(VOCAB))
    for tokens in (None, _Tokens(VOCAB + 1)):
        with pytest.raises(VocabularyMismatchError, match=f"has a vocabulary of {VOCAB} ids, the target's 96"):
            check_gguf_vocabulary(path, target, tokens)


def test_draft_model_refuses_a_tokenizer_that_maps_ids_differently():
    from specdec.drafters.draft_model import check_vocabularies

    class Tok:
        lookups = 0

        def __init__(self, shift):
            self.shift = shift

        def convert_ids_to_tokens(self, i):
            Tok.lookups += 1
            return f"t{i + (self.shift if i > 40 else 0)}"

    runner = specdec.models.loader.load_model(build_tiny_model()).runner
    draft, target = Tok(0), Tok(0)
    check_vocabularies(runner, draft, runner, target)
    looked = Tok.lookups
    check_vocabularies(runner, draft, runner, target)  # the same pair again (a later generate() call): not re-read
    assert looked > 0 and Tok.lookups == looked
    shifted = Tok(1)
    for _ in range(2):  # a mismatch is found every time, never remembered as checked
        with pytest.raises(VocabularyMismatchError, match="token id 4[1-9]"):
            check_vocabularies(runner, shifted, runner, target)


def test_draft_model_tokenizer_option_is_a_tokenizer_or_its_directory(tmp_path):
    """tokenizer= took anything and failed deep in the vocabulary check with an AttributeError: a directory (what
    the command line passes) is now loaded, anything else is refused in one line naming the option."""
    from specdec.errors import InputError, InputTypeError
    from specdec.testing import save_tiny_checkpoint

    ckpt = save_tiny_checkpoint(tmp_path / "tiny")
    target = specdec.models.loader.load_model(ckpt)
    with pytest.raises(InputTypeError, match="tokenizer= must be a transformers tokenizer"):
        specdec.generate(target, [[3, 4, 5]], max_new_tokens=4, drafter="draft-model",
                         drafter_options={"model": ckpt, "tokenizer": 5})
    (tmp_path / "empty").mkdir()  # transformers blamed a missing sentencepiece, cut mid-sentence; a missing
    # directory was "Repo id must use alphanumeric chars"
    for spec, said in [("nothing", "is not a directory"), ("empty", "holds no tokenizer files")]:
        with pytest.raises(InputError, match=f"^draft-model: tokenizer='{tmp_path / spec}' {said} "):
            specdec.generate(target, [[3, 4, 5]], max_new_tokens=4, drafter="draft-model",
                             drafter_options={"model": ckpt, "tokenizer": str(tmp_path / spec)})
    plain = specdec.generate(target, [[3, 4, 5]], max_new_tokens=6)
    assert specdec.generate(target, [[3, 4, 5]], max_new_tokens=6, drafter="draft-model",
                            drafter_options={"model": ckpt, "tokenizer": str(ckpt)}) == plain


def test_a_bigger_draft_model_is_one_warning(caplog, monkeypatch):
    """A draft model bigger than the target: with speculation="auto" its shapes say it can never pay, and ONE warning
    says both facts and what to do (there were two: the load's size warning, then the policy's). Where it drafts
    (speculation="always"), its own size warning, once per pair of models, not at every call."""
    monkeypatch.setattr(speculation_policy, "_NEVER_PAYS_WARNED", set())  # warned once per process
    target = build_tiny_model()
    big = build_tiny_model(hidden_size=128, intermediate_size=256, num_attention_heads=4)
    with caplog.at_level(logging.WARNING):
        specdec.generate(target, [[1, 2]], max_new_tokens=4, drafter=DraftModelDrafter(big))
    said = [r.getMessage() for r in caplog.records  # (not a first cost calibration's notice)
            if r.name in ("specdec.drafters.draft_model", "specdec.speculation_policy")
            and "a tokenizer is missing" not in r.getMessage()]
    assert len(said) == 1, said
    assert all(fact in said[0] for fact in ("is bigger than the target", "decoding plainly", "smaller draft model"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.draft_model"):
        for _ in range(3):  # once per pair of models, not at every call (a server's log filled with it)
            specdec.generate(target, [[1, 2]], max_new_tokens=4, drafter=DraftModelDrafter(big), speculation="always")
        specdec.generate(build_tiny_model(), [[1, 2]], max_new_tokens=4, drafter=DraftModelDrafter(big),
                         speculation="always")
    said = [r.getMessage() for r in caplog.records]
    assert sum("bigger than the target" in m for m in said) == 2, said  # the first target, then the second
    assert sum("a tokenizer is missing" in m for m in said) == 1, said  # the second target (the first: above)


def test_a_draft_model_barely_bigger_than_the_target_is_said_in_whole_counts(caplog):
    """Sizes in millions to one decimal said "the draft model (0.1M parameters) is bigger than the target (0.1M)":
    where the two round alike, the counts are said whole, so the message shows the difference it names."""
    target = build_tiny_model()
    big = build_tiny_model(intermediate_size=130)  # a few hundred parameters more
    counts = [sum(p.numel() for p in m.parameters()) for m in (big, target)]
    assert counts[0] > counts[1] and round(counts[0] / 1e6, 1) == round(counts[1] / 1e6, 1)
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.draft_model"):
        specdec.generate(target, [[1, 2]], max_new_tokens=4, drafter=DraftModelDrafter(big), speculation="always")
    said = [r.getMessage() for r in caplog.records if "bigger than the target" in r.getMessage()]
    assert len(said) == 1 and f"the draft model ({counts[0]:,} parameters) is bigger than the target " \
        f"({counts[1]:,})" in said[0], said


def test_a_failed_build_leaves_the_drafter_holding_no_draft_model():
    """build_engine loads the draft model (load_for_target) before its later refusals; a call refused after it (here
    num_blocks too small for the prompt's prefill) drops it again, so a drafter reused across calls holds no whole
    draft model for a call that never ran (alone, or as a combined drafter's child). The next call drafts as usual."""
    target, prompt = build_tiny_model(), list(range(1, 40))
    drafter = DraftModelDrafter(build_tiny_model(seed=7, num_hidden_layers=1))
    combined = CombinedDrafter(["ngram", DraftModelDrafter(build_tiny_model(seed=7, num_hidden_layers=1))])
    for used in (drafter, combined):
        with pytest.raises(CacheFullError):
            specdec.generate(target, [prompt], max_new_tokens=4, drafter=used, num_blocks=1)
    for model_drafter in (drafter, combined.children[1]):
        assert model_drafter._loaded is None and model_drafter.runner is None, model_drafter._loaded
    plain = specdec.generate(target, [prompt], max_new_tokens=6)
    out = specdec.generate(target, [prompt], max_new_tokens=6, drafter=drafter, speculation="always",
                           return_dict=True)
    assert out.sequences == plain and drafter.runner is not None and out.tau > 1


def test_a_draft_model_never_pays_by_its_shapes_only_when_it_does_the_targets_work_as_the_target_runs():
    """Decided from what is fixed before the first token, never a timing: the target itself, or a model with at
    least the target's weights, keys and queries per token on its device and dtype. Fewer layers, fewer KV heads
    (more weights notwithstanding), another dtype, or a target in the slower bit-exact mode: it may pay."""
    target = build_tiny_model()

    def verdict(draft, invariant=False):
        drafter = DraftModelDrafter(draft)
        runner = load_model(target).runner.invariant_mode(invariant)
        drafter.attach(TargetView(runner, None, SamplingConfig()))
        return drafter.never_pays_by_shape()

    assert verdict(target) == "its model is the target itself"
    for same_or_bigger in (build_tiny_model(seed=7), build_tiny_model(intermediate_size=256)):
        assert "at least the target's work per token" in verdict(same_or_bigger)
    assert verdict(build_tiny_model(num_hidden_layers=1)) is None
    assert verdict(build_tiny_model(num_key_value_heads=1, intermediate_size=256)) is None
    assert verdict(build_tiny_model(seed=7).to(torch.bfloat16)) is None
    assert verdict(target, invariant=True) is None


def test_draft_model_named_by_path_loads_in_the_targets_dtype(tmp_path):
    """A draft checkpoint given as a path follows the target's dtype (it loaded in float32 whatever the target's:
    on CUDA a float32 draft beside a bf16 target reads twice its bytes); a loaded draft model keeps its own."""
    build_tiny_model(seed=5).save_pretrained(tmp_path / "draft")
    target = build_tiny_model().to(torch.bfloat16)
    by_path, loaded = DraftModelDrafter(str(tmp_path / "draft")), DraftModelDrafter(build_tiny_model(seed=5))
    for drafter in (by_path, loaded):
        specdec.generate(target, [[1, 2, 3]], max_new_tokens=3, drafter=drafter)
    assert by_path.runner.dtype == torch.bfloat16
    assert loaded.runner.dtype == torch.float32


@pytest.mark.parametrize("bad, match", [
    (dict(num_draft_tokens=0), "num_draft_tokens"), (dict(tree="beam"), "tree"), (dict(mode="typical"), "mode"),
    (dict(widths=(8, 8)), "nodes"), (dict(tree="dynamic", mode="independent"), "deterministic"),
])
def test_bad_draft_config(bad, match):
    with pytest.raises(ValueError, match=match):
        DraftConfig(**bad)


def test_self_draft_drafts_from_the_target_cache():
    drafted_in = set()  # (shares_target_cache, whether the drafter's cache was the target's) at each propose

    class Shared(SelfDraftDrafter):
        def propose(self, seqs):
            trees = super().propose(seqs)
            drafted_in.add((self.shares_target_cache, self.cache is self.target.cache))
            return trees

    class OwnCache(Shared):  # the same drafter recomputing its layers' K/V in a cache of its own
        shares_target_cache = False

    target = build_tiny_model("llama-gqa-tied", num_hidden_layers=4)
    shared, own = Shared(num_layers=2, num_draft_tokens=3), OwnCache(num_layers=2, num_draft_tokens=3)
    # speculation="always": whole trees, so the two runs' step-by-step counts do not depend on timed sizing
    outs = [specdec.generate(target, PROMPTS, max_new_tokens=64, drafter=d, return_dict=True, speculation="always")
            for d in (shared, own)]
    assert drafted_in == {(True, True), (False, False)}
    assert outs[0].sequences == outs[1].sequences == specdec.generate(target, PROMPTS, max_new_tokens=64)
    # same drafts proposed and accepted step by step: the target's K/V of the first layers are the drafter's
    assert [s.depth_accepted for s in outs[0].stats] == [s.depth_accepted for s in outs[1].stats]
    assert sum(sum(s.depth_accepted) for s in outs[0].stats) > 0


def test_self_draft_refuses_all_layers():
    with pytest.raises(ValueError, match="below the target"):
        specdec.generate(build_tiny_model(), [[1, 2]], max_new_tokens=4, drafter=SelfDraftDrafter(num_layers=2))


# ---- sampling: the law of the first three tokens equals plain sampling -----------------------
N = 6000


def _first_tokens(model, drafter, seed, rule=EXACT):
    out = generate_with_control(model, [[1, 2, 3, 1, 2, 3, 1, 2]] * N, rule, max_new_tokens=3, drafter=drafter,
                                do_sample=True, seed=seed, temperature=0.9, top_k=3, return_dict=True,
                                speculation="always")  # drafts verified whole: the law is tested on them
    return [tuple(t[:3]) for t in out.new_tokens]


SAMPLED = {
    "chain": dict(mode="independent", num_draft_tokens=3),
    "independent-tree": dict(mode="independent", widths=(2, 2), num_draft_tokens=3),
    "without-replacement-tree": dict(mode="without_replacement", widths=(3, 2), num_draft_tokens=2),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(SAMPLED))
def test_sampling_law_with_draft_model_matches_plain(kind, device):
    target = build_tiny_model(vocab_size=4, seed=3).to(device)
    draft = build_tiny_model(vocab_size=4, seed=11).to(device)
    plain = _first_tokens(target, None, seed=1)
    drafter = DraftModelDrafter(draft, seed=5, **SAMPLED[kind])
    spec = _first_tokens(target, drafter, seed=2)
    p, power = two_sample_chi2(plain, spec, tv=0.08)
    assert power >= 0.9, f"only {power:.2f} power to detect TV 0.08"
    assert p > 1e-3, f"{kind}: p = {p}"
    assert drafter.draft_forwards > 0


@pytest.mark.slow
def test_sampling_law_test_catches_a_broken_sampler_with_draft_model():
    from specdec.eval import negative_controls

    target, draft = build_tiny_model(vocab_size=4, seed=3), build_tiny_model(vocab_size=4, seed=11)
    plain = _first_tokens(target, None, seed=1)
    rule = negative_controls.BROKEN_RULES["resample_from_target"]
    spec = _first_tokens(target, DraftModelDrafter(draft, seed=5, **SAMPLED["chain"]), seed=2, rule=rule)
    assert two_sample_chi2(plain, spec).p_value < 1e-6


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(temperature=1.2, min_p=0.12), dict(typical_p=0.6),
                                dict(epsilon_cutoff=0.05), dict(eta_cutoff=0.1), dict(top_h=0.6)], ids=str)
def test_sampled_drafts_carry_the_distribution_they_were_drawn_from(kw):
    """Each node's draft_probs row is the draft model's distribution at its parent after the target's sampling
    transform (temperature, top-k and transformers' other warpers)."""
    target = build_tiny_model(vocab_size=8, seed=3)
    Spy, trees = _spy_trees(DraftModelDrafter)
    spy = Spy(target, seed=0, mode="independent", widths=(2,), num_draft_tokens=2)
    specdec.generate(target, [[1, 2, 3]], max_new_tokens=6, drafter=spy, do_sample=True, seed=0, **kw,
                     speculation="always")
    assert trees and all(t.draft_probs is not None for t in trees)
    tree = trees[0]
    with torch.no_grad():
        logits = target(torch.tensor([[1, 2, 3]])).logits[0, -1]
    expected = specdec.sampling.logits_to_probs(logits, specdec.sampling.SamplingConfig(True, **kw))
    assert 1 < int((expected > 0).sum()) < 8  # the setting removes tokens here, not all but one
    for i in (tree.parents == -1).nonzero().flatten().tolist():
        torch.testing.assert_close(tree.draft_probs[i], expected, atol=1e-5, rtol=1e-5)
        assert torch.equal(tree.draft_probs[i] > 0, expected > 0)  # the transform applied to the draft like the target


def test_self_draft_warps_its_draft_probs_as_the_target_samples():
    """Self-draft samples its drafts from its own logits after the target's warpers: every draft_probs row keeps
    only probabilities >= min_p times its largest (min_p), and some row lost tokens to it."""
    target = build_tiny_model(vocab_size=8, seed=3)
    Spy, trees = _spy_trees(SelfDraftDrafter)
    spy = Spy(num_layers=1, seed=0, mode="independent", widths=(2, 1), num_draft_tokens=3)
    specdec.generate(target, [[1, 2, 3]], max_new_tokens=8, drafter=spy, do_sample=True, seed=0, min_p=0.3,
                     speculation="always")
    rows = torch.cat([t.draft_probs for t in trees if t.draft_probs is not None])
    assert len(rows) > 0
    kept = rows > 0
    assert (rows[kept] >= 0.3 * rows.amax(-1, keepdim=True).expand_as(rows)[kept] * (1 - 1e-6)).all()
    assert (kept.sum(-1) < 8).any()


# ---- reproducibility: generate(seed=...) seeds sampled drafts too ----------------------------
@pytest.mark.parametrize("name, options", [
    ("draft-model", dict(mode="independent", widths=(2,), num_draft_tokens=3)),
    ("draft-model", dict(mode="without_replacement", widths=(3,), num_draft_tokens=2)),
    ("self-draft", dict(num_layers=1, num_draft_tokens=3)),  # mode auto: sampled chain
])
def test_seeded_generate_is_reproducible_whatever_the_global_rng(name, options, device):
    target = build_tiny_model(num_hidden_layers=2).to(device)
    if name == "draft-model":  # a layer fewer than the target: one of its size can never pay and is never asked
        options = dict(options, model=build_tiny_model(seed=7, num_hidden_layers=1).to(device))
    outs = []
    for global_seed in (0, 1, 0):
        torch.manual_seed(global_seed)
        outs.append(specdec.generate(target, PROMPTS, max_new_tokens=24, drafter=name, drafter_options=options,
                                     do_sample=True, temperature=1.5, seed=3))
    assert outs[0] == outs[1] == outs[2]
    torch.manual_seed(0)
    other = specdec.generate(target, PROMPTS, max_new_tokens=24, drafter=name, drafter_options=options,
                             do_sample=True, temperature=1.5, seed=4)
    assert other != outs[0]  # the seed does matter


def test_reused_drafter_instance_is_reseeded_by_each_generate_call():
    target = build_tiny_model(num_hidden_layers=2)
    drafter = DraftModelDrafter(build_tiny_model(seed=7, num_hidden_layers=1), mode="independent", widths=(2,),
                                num_draft_tokens=3)
    outs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        outs.append(specdec.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, do_sample=True,
                                     temperature=1.5, seed=3))
        assert drafter.generator.device == drafter.runner.device  # drafts are sampled where draft_probs live
    assert outs[0] == outs[1]
    gens = [torch.Generator().manual_seed(3) for _ in range(2)]  # a generator= works like a seed
    torch.manual_seed(0)
    a = specdec.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, do_sample=True, generator=gens[0])
    torch.manual_seed(1)
    b = specdec.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, do_sample=True, generator=gens[1])
    assert a == b


@pytest.mark.parametrize("call_seeds", [(3, 4), (None, None)], ids=["seeded", "unseeded"])
def test_a_drafters_own_seed_salts_the_calls_randomness_and_never_fixes_its_drafts(call_seeds):
    """A draft model's own ``seed`` gave every call the same first draft whatever the call's seed (or torch's RNG
    for an unseeded call): a draft fixed before the target's draws is not drawn from its draft_probs, so over such
    calls the output's law was not the target's (a chi-square over 12,000 calls: p = 4e-7). The call's randomness
    now moves the drafts; the same call seed still repeats them."""
    target = build_tiny_model(vocab_size=16, num_hidden_layers=2)
    spy_cls, trees = _spy_trees(DraftModelDrafter)
    drafter = spy_cls(build_tiny_model(vocab_size=16, seed=7, num_hidden_layers=1), seed=5, mode="independent",
                      widths=(4,), num_draft_tokens=2)
    first = []
    for call_seed in call_seeds * 4 if call_seeds[0] is None else (*call_seeds, call_seeds[0]):
        trees.clear()
        specdec.generate(target, [[1, 2, 3]], max_new_tokens=3, drafter=drafter, do_sample=True, temperature=2.0,
                         top_k=0, seed=call_seed, speculation="always")
        first.append(trees[0].tokens.tolist())
    if call_seeds[0] is None:
        assert len(set(map(tuple, first))) > 1  # torch's RNG moves them
    else:
        assert first[0] != first[1] and first[0] == first[2]


# ---- tree="dynamic", mode="auto" under sampling: a dynamic tree of deterministic candidates --
def _spy_trees(drafter_cls):
    trees = []

    class Spy(drafter_cls):
        def propose(self, seqs):
            out = super().propose(seqs)
            trees.extend(out)
            return out

    return Spy, trees


def test_dynamic_tree_auto_mode_stays_a_dynamic_tree_when_sampling():
    target = build_tiny_model(num_hidden_layers=2)
    spy_cls, trees = _spy_trees(DraftModelDrafter)
    drafter = spy_cls(build_tiny_model(seed=7), tree="dynamic", max_nodes=10, beam=3, num_draft_tokens=4)
    out = specdec.generate(target, PROMPTS, max_new_tokens=24, drafter=drafter, do_sample=True, seed=0,
                           temperature=0.8, top_k=20, return_dict=True, speculation="always")
    assert drafter.mode.value == "deterministic"
    trees = [t for t in trees if t.num_nodes]
    assert trees and all(t.draft_probs is None for t in trees)
    assert max(t.num_nodes for t in trees) == 10 and max(max(len(k) for k in t.children) for t in trees) > 1
    assert all(len(s) == 24 for s in out.new_tokens)


@pytest.mark.slow
def test_sampling_law_with_dynamic_tree_matches_plain():
    target, draft = build_tiny_model(vocab_size=4, seed=3), build_tiny_model(vocab_size=4, seed=11)
    plain = _first_tokens(target, None, seed=1)
    drafter = DraftModelDrafter(draft, tree="dynamic", max_nodes=8, beam=3, num_draft_tokens=3)
    spec = _first_tokens(target, drafter, seed=2)
    p, power = two_sample_chi2(plain, spec, tv=0.08)
    assert power >= 0.9, f"only {power:.2f} power to detect TV 0.08"
    assert p > 1e-3, f"dynamic tree: p = {p}"
    assert drafter.mode.value == "deterministic" and drafter.draft_forwards > 0


@pytest.mark.parametrize("sampling", [{}, dict(do_sample=True, temperature=0.9, seed=5, sampler="coupled"),
                                      dict(do_sample=True, temperature=0.9, top_p=0.9, seed=5)],
                         ids=["greedy", "coupled", "sampled"])
@pytest.mark.parametrize("name, options", [
    ("self-draft", dict(num_layers=1, num_draft_tokens=4)),
    ("draft-model", dict(widths=(2, 2), num_draft_tokens=3)),
    ("draft-model", dict(num_draft_tokens=3, mode="without_replacement")),
], ids=["self-chain", "draft-model-static-tree", "draft-model-chain-without-replacement"])
def test_static_trees_grown_on_the_device_are_the_host_grown_trees(name, options, sampling):
    """A static tree is grown on the device (the children of a depth, chosen or drawn, run through the next forward
    as device token ids, the host reads the tree once): the trees, depth by depth, with their draft_probs, are those
    of the growth that reads each depth's children on the host (on the CPU a batched draw takes its rows' random
    numbers in the order the host growth's draws, sequence by sequence, take them)."""
    target = build_tiny_model(num_hidden_layers=3)
    kinds = {"self-draft": SelfDraftDrafter, "draft-model": DraftModelDrafter}

    class Recorder(kinds[name]):
        def attach(self, target_view):
            super().attach(target_view)
            self.decided, self.static_on_device = self.static_on_device, self.on_device

        def propose(self, seqs):
            trees = super().propose(seqs)
            self.seen.update((tuple(v.token_ids), (t.tokens.tolist(), t.parents.tolist(), t.mode,
                                                   None if t.draft_probs is None else t.draft_probs.tolist()))
                             for v, t in zip(seqs, trees, strict=True))
            return trees

    extra = {"model": build_tiny_model(seed=7)} if name == "draft-model" else {}
    runs = []
    for on_device in (True, False):
        drafter = Recorder(**extra, **options)
        drafter.on_device, drafter.seen = on_device, {}
        out = specdec.generate(target, PROMPTS, max_new_tokens=20, drafter=drafter, speculation="always", **sampling)
        runs.append((out, drafter.seen))
        assert drafter.decided  # every tree here has its shape before its tokens
    assert runs[0] == runs[1] and len(runs[0][1]) > 10


@pytest.mark.parametrize("shape,penalty", [(dict(), None), (dict(widths=(2, 2), num_draft_tokens=3), None),
                                           (dict(widths=(2, 2), num_draft_tokens=3), 1.3)])
def test_a_draft_model_gone_nan_stops_sampling_with_the_drafters_error(shape, penalty):
    """A draft model whose logits are NaN (a float16 overflow, a damaged checkpoint) stops a sampled call with the
    one-line DraftError of the draft_probs checks, grown on the device or (a logits processor) on the host; its
    draws raised torch.multinomial's bare RuntimeError."""
    from specdec.tree import DraftError

    draft = build_tiny_model(seed=7)
    with torch.no_grad():
        draft.model.norm.weight.fill_(float("nan"))
    # the cause is named: with self-draft the target's own float16 overflow read as the drafter's fault
    with pytest.raises(DraftError, match=r"^draft-model: draft_probs contains NaN .*a float16 overflow"):
        specdec.generate(build_tiny_model(), [[1, 2, 3, 4]], max_new_tokens=4, do_sample=True, seed=0,
                         drafter=DraftModelDrafter(model=draft, **shape), speculation="always",
                         **({} if penalty is None else dict(repetition_penalty=penalty)))


def test_a_second_draft_model_that_can_never_pay_is_warned_about_too(caplog, monkeypatch):
    """The never-pays warning comes once per process for each draft model and cause, not once per drafter name: a
    notebook that tries a second too-big draft model after a first was told nothing about the second."""
    monkeypatch.setattr(speculation_policy, "_NEVER_PAYS_WARNED", set())
    target = build_tiny_model()
    bigs = [build_tiny_model(hidden_size=128, intermediate_size=256, num_attention_heads=4),
            build_tiny_model(hidden_size=256, intermediate_size=512, num_attention_heads=4)]
    with caplog.at_level(logging.WARNING, logger="specdec.speculation_policy"):
        for big in (*bigs, bigs[0]):  # the first again: already told
            specdec.generate(target, [[1, 2]], max_new_tokens=4, drafter=DraftModelDrafter(big))
    said = [r.getMessage() for r in caplog.records if "no draft can pay" in r.getMessage()]
    assert len(said) == 2 and said[0] != said[1], said


def test_a_draft_model_with_a_shorter_context_says_once_where_it_stops_drafting(caplog):
    """A draft model whose context is shorter than the sequence drafted nothing from there on, silently (tau 1.00);
    the output stays the target's. A draft model of the target's context says nothing at the target's end. A
    sliding-window draft model stops at its window + 1, which the message names (it said "context of 9 positions"
    of a Mistral with an 8-token window and a context of 512)."""
    target = build_tiny_model(max_position_embeddings=64, vocab_size=32)
    short = build_tiny_model(max_position_embeddings=16, vocab_size=32, num_hidden_layers=1)
    prompts = [[(7 * i) % 31 + 1 for i in range(12)], [(5 * i) % 31 + 1 for i in range(30)]]
    plain = specdec.generate(target, prompts, max_new_tokens=12)
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.model_drafter"):
        out = specdec.generate(target, prompts, max_new_tokens=12, drafter=DraftModelDrafter(short),
                               speculation="always")
    said = [r.getMessage() for r in caplog.records if r.name == "specdec.drafters.model_drafter"]
    assert out == plain
    assert len(said) == 1 and "a sequence of 30 tokens fills the draft model's context of 16 tokens:" in said[0]
    caplog.clear()
    windowed = build_tiny_model("mistral", vocab_size=32, num_hidden_layers=1, sliding_window=8)
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.model_drafter"):
        out = specdec.generate(target, prompts, max_new_tokens=12, drafter=DraftModelDrafter(windowed),
                               speculation="always")
    said = [r.getMessage() for r in caplog.records if r.name == "specdec.drafters.model_drafter"]
    assert out == plain
    assert len(said) == 1 and ("a sequence of 30 tokens fills the draft model's sliding window of 8 tokens plus the "
                               "last new token (9 in all):") in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.model_drafter"):
        specdec.generate(target, [prompts[1]], max_new_tokens=34, drafter="self-draft",
                         drafter_options={"num_layers": 1}, speculation="always")
    assert not [r for r in caplog.records if r.name == "specdec.drafters.model_drafter"]


def test_independent_children_are_drawn_independently():
    """Each sampled child of a node is its own draw from the node's draft_probs (the rejection rule for siblings
    assumes it): children sharing one uniform had every row correct on its own, passed the draft audit and the slow
    law test, and moved the law of a two-child step by TV 0.07."""
    from types import SimpleNamespace

    from specdec.drafters.model_drafter import ModelDrafter
    from specdec.eval.statistics import goodness_of_fit

    from specdec.tree import DraftMode

    q = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 20_000
    drafter = SimpleNamespace(mode=DraftMode.INDEPENDENT, generator=torch.Generator().manual_seed(0))
    pairs = ModelDrafter._draw(drafter, q.expand(n, -1).contiguous(), 2).tolist()
    law = {(a, b): float(q[a] * q[b]) for a in range(4) for b in range(4)}
    fit = goodness_of_fit([tuple(p) for p in pairs], law, 0.03, 1e-3)
    assert fit.power > 0.9 and fit.p_value > 1e-3, fit



@pytest.mark.parametrize("target_config, drafter", [
    (dict(max_position_embeddings=32), "self-draft"),
    (dict(variant="mistral", sliding_window=24), "self-draft"),  # runs to its window + 1: 25 positions
    (dict(max_position_embeddings=64), "short draft model"),  # its own context: 28 positions
    (dict(max_position_embeddings=32), "long draft model"),  # the target's context: 32 positions
])
@pytest.mark.parametrize("shorter", [None, 5])  # one sequence; a ragged batch with a prompt 5 tokens shorter
def test_model_drafters_draft_no_position_past_a_limit(monkeypatch, target_config, drafter, shorter):
    """Near the end of a context (the target's, its window's, a draft model's own) or of max_new_tokens the drafter
    ran its levels to num_draft_tokens whatever the positions and tokens left: forwards at positions the target
    verifies no node of, or past the draft model's context, and a whole tree for a sequence's last token (lost work;
    the engine cut those nodes). Every forward stays below its runner's limit, every tree reaches the last position
    both limits and the tokens left allow (and no further), and the tokens are plain decoding's."""
    config = dict(target_config)
    target = build_tiny_model(config.pop("variant", "llama-gqa-tied"), vocab_size=32, **config)
    short = build_tiny_model(max_position_embeddings=28 if drafter == "short draft model" else 128, vocab_size=32,
                             num_hidden_layers=1)

    def make(**options):
        if drafter == "self-draft":
            return SelfDraftDrafter(num_layers=1, num_draft_tokens=4, **options)
        return DraftModelDrafter(short, num_draft_tokens=4, **options)

    # the limit the sequences reach: the target's, or the draft model's, which the target decodes past undrafted
    limit = 28 if drafter == "short draft model" else LlamaRunner(target).shape.max_positions
    # the first draft's root is the prompt's last token, at position limit - 7, so its levels run to limit - 3; the
    # steps after it reach the limit. A batch's static tree has one shape: its levels run while any sequence has room
    lengths = [limit - 6] + ([] if shorter is None else [limit - 6 - shorter])
    prompts = [[(3 * i + b) % 31 + 1 for i in range(n)] for b, n in enumerate(lengths)]
    new = 10 if drafter == "short draft model" else 6  # else to the end of the target's limit
    plain = specdec.generate(target, prompts, max_new_tokens=new)
    past = []  # (position, the runner's limit) of every position a forward ran at or past its runner's limit
    forward = LlamaRunner.forward

    def recorded(self, token_ids, positions, *args, **kwargs):
        past.extend((p, self.shape.max_positions) for p in positions.tolist() if p >= self.shape.max_positions)
        return forward(self, token_ids, positions, *args, **kwargs)

    monkeypatch.setattr(LlamaRunner, "forward", recorded)
    depths = []  # (the live sequences' (prompt length, length), the depth their trees were drafted to)
    deepest = ModelDrafter._deepest

    def spied(self, live):
        depths.append(([(v.num_prompt_tokens, len(v.token_ids)) for v in live], deepest(self, live)))
        return depths[-1][1]

    monkeypatch.setattr(ModelDrafter, "_deepest", spied)
    for options in ({}, dict(tree="dynamic", max_nodes=6)):  # a static chain grown on the device; a dynamic tree
        out = specdec.generate(target, prompts, max_new_tokens=new, drafter=make(**options), speculation="always")
        assert out == plain
    assert past == []

    def room(prompt, length):  # a node at depth d sits at position length - 1 + d; the last token is no node's
        return min(limit - length, prompt + new - length - 1)

    # each tree reaches the deepest room a live sequence has; a sequence without room is not drafted for
    assert depths and all(lives and depth == min(4, max(room(*r) for r in lives)) and min(room(*r) for r in lives) > 0
                          for lives, depth in depths), depths
