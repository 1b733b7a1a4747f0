"""Reduced draft vocabulary on tiny random models: Medusa checkpoints (round trip, refusals), the Medusa
and self-draft drafters (only in-vocabulary candidates, greedy identity, sampled draft_probs), training
(head_loss, head_accuracies) and the self-draft vocabulary sources."""
from __future__ import annotations

import json

import pytest
import torch
from specdec.drafters.draft_vocab import DraftVocab, choose_size, coverage, frequent_tokens
from specdec.drafters.eagle_checkpoint import save_eagle
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specdec.drafters.self_draft import SelfDraftDrafter
from specdec.drafters.vocab_sources import builtin_prompt_tokens
from specdec.train import evaluate, features, medusa_loss

import specdec
from specdec.errors import InputError
from specdec.testing import build_tiny_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5], [11] * 3 + [12, 13]]
STATIC = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def reduced_heads(model, ids, num_heads=3, shared=False, noise=0.0, seed=0):
    """LM-head-initialised heads over the draft vocabulary ``ids`` (blocks randomised by ``noise``)."""
    cfg = MedusaConfig(num_heads, 1, model.config.hidden_size, model.config.vocab_size, shared_lm_head=shared,
                       draft_vocab=tuple(ids))
    heads = MedusaHeads(cfg)
    heads.init_lm_heads_from(model.get_output_embeddings().weight.detach())
    torch.manual_seed(seed)
    with torch.no_grad():
        for block in (h[0] for h in heads.heads):
            block.linear.weight.normal_(std=noise)
    return heads


def common_ids(model, n=40):
    """The n most frequent tokens of the model's own greedy continuations (as training would choose them)."""
    return frequent_tokens(specdec.generate(model, PROMPTS, max_new_tokens=64), n)


class Spy(MedusaDrafter):
    def propose(self, seqs):
        trees = super().propose(seqs)
        self.seen = getattr(self, "seen", []) + [(v.last_hidden, t) for v, t in zip(seqs, trees, strict=True)]
        return trees


# ---- checkpoints -----------------------------------------------------------------------------------
def test_save_load_round_trip_keeps_the_draft_vocabulary(tmp_path):
    model = build_tiny_model()
    ids = [90, 3, 17, 5, 0]  # any order: column j scores ids[j]
    heads = reduced_heads(model, ids, noise=0.1)
    save_medusa(heads, tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["draft_vocab"] == ids
    again = load_medusa(tmp_path / "h", hidden_size=64, vocab_size=96)
    assert again.config == heads.config and again.config.draft_size == 5
    for k, v in heads.heads.state_dict().items():
        torch.testing.assert_close(again.heads.state_dict()[k], v)
    assert again.heads[0][-1].weight.shape == (5, 64)
    torch.testing.assert_close(heads.heads[1][-1].weight, model.lm_head.weight.detach()[ids])  # the target's rows
    h = torch.randn(2, 64)
    torch.testing.assert_close(again(h), heads(h))
    full = MedusaHeads(MedusaConfig(2, 1, 64, 96))  # a full-vocabulary checkpoint stays in the published layout
    save_medusa(full, tmp_path / "f")
    assert "draft_vocab" not in json.loads((tmp_path / "f" / "config.json").read_text())
    assert load_medusa(tmp_path / "f").config.draft_vocab == ()


@pytest.mark.parametrize("edit, match", [
    (dict(draft_vocab=[1, 2, 3, 96, 5]), r"token id 96, but the vocabulary has vocab_size=96"),
    (dict(draft_vocab=[1, 2, 3, -1, 5]), r"token id -1, but the vocabulary has vocab_size=96"),
    (dict(draft_vocab=[1, 2, 3, 3, 5]), r"token id 3 more than once"),
    (dict(draft_vocab=[1, 2, 3, 4]), r"lists 4 token ids but the LM heads in medusa_lm_head.safetensors have 5 rows"),
    (dict(draft_vocab=[1, 2, "x", 4, 5]), r"list of integer token ids"),
])
def test_bad_draft_vocabulary_in_a_checkpoint_is_refused(edit, match, tmp_path):
    save_medusa(reduced_heads(build_tiny_model(), [1, 2, 3, 4, 5]), tmp_path / "h")
    cfg = tmp_path / "h" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), **edit}))
    with pytest.raises(MedusaCheckpointError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter="medusa",
                         drafter_options={"path": str(tmp_path / "h")})


@pytest.mark.parametrize("ids, match", [((1, 96), "token id 96"), ((4, 4), "more than once"), ((1, True), "integer")])
def test_bad_draft_vocabulary_in_a_config_is_refused(ids, match):
    with pytest.raises(InputError, match=match):
        MedusaConfig(2, 1, 64, 96, draft_vocab=ids)


# ---- the Medusa drafter ----------------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(medusa_choices=STATIC), dict(tree="dynamic", max_nodes=12, top_k=4)],
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("shared", [False, True], ids=["own-lm-heads", "shared-lm-head"])
def test_medusa_drafts_the_top_k_of_its_vocabulary_only(options, shared):
    model = build_tiny_model("llama-mha-untied")
    ids = list(range(0, 96, 3))  # 32 tokens; the target's favourites are mostly outside
    full = reduced_heads(model, range(96), shared=shared, noise=0.3)  # the same heads over every token
    heads = reduced_heads(model, ids, shared=shared, noise=0.3)
    spy = Spy(heads=heads, **options)
    # speculation="always": every step asks the drafter (the guard, timed by wall clock, may skip some)
    specdec.generate(model, PROMPTS, max_new_tokens=10, drafter=spy, speculation="always")
    outside = torch.ones(96, dtype=torch.bool)
    outside[ids] = False
    checked = 0
    for hidden, tree in spy.seen:
        if hidden is None:
            continue
        assert set(tree.tokens.tolist()) <= set(ids)
        logits = full(hidden[None], model.lm_head.weight.detach())[:, 0]  # [heads, 96]: masked reference
        top = logits.masked_fill(outside, float("-inf")).topk(2, dim=-1).indices
        assert int(tree.tokens[0]) == int(top[0, 0])  # first node: head 0's best in-vocabulary token
        if "medusa_choices" in options:
            assert tree.tokens.tolist()[:3] == [int(top[0, 0]), int(top[0, 1]), int(top[1, 0])]
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("options", [dict(medusa_choices=STATIC), dict(tree="dynamic", max_nodes=16)],
                         ids=["static", "dynamic"])
def test_medusa_greedy_identity_with_a_reduced_vocabulary(options):
    model = build_tiny_model("llama-gqa-tied")
    plain = specdec.generate(model, PROMPTS, max_new_tokens=128)
    ids = common_ids(model)
    # speculation="always": every tree verified whole, whatever this machine's verify curve makes the guard do
    # (under a steep one it turned the dynamic trees off: tau 1.06)
    out = specdec.generate(model, PROMPTS, max_new_tokens=128, return_dict=True, speculation="always",
                           drafter=MedusaDrafter(heads=reduced_heads(model, ids), **options))
    assert out.sequences == plain
    assert out.tau > 1.2  # drafts are accepted: the accepted path is exercised
    for p, ref in zip(PROMPTS[:2], plain[:2], strict=True):
        got = specdec.generate(model, [p], max_new_tokens=128, speculation="always",
                               drafter=MedusaDrafter(heads=reduced_heads(model, ids), **options))
        assert got[0] == ref


def test_medusa_choices_deeper_than_the_draft_vocabulary_are_refused():
    heads = reduced_heads(build_tiny_model(), [1, 2, 3])
    with pytest.raises(ValueError, match="rank 3, but the draft vocabulary has 3"):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4,
                         drafter=MedusaDrafter(heads=heads, medusa_choices=[[0], [3]]))


def test_medusa_drafts_with_every_token_of_its_draft_vocabulary():
    """Of a 3-token draft vocabulary, static choices may use ranks 0..2 and a dynamic tree may take top_k=3."""
    model = build_tiny_model()
    plain = specdec.generate(model, [[1, 2, 3]], max_new_tokens=4)
    for options in (dict(medusa_choices=[[0], [1], [2]]), dict(tree="dynamic", top_k=3)):
        spy = Spy(heads=reduced_heads(model, [1, 2, 3]), **options)
        assert specdec.generate(model, [[1, 2, 3]], max_new_tokens=4, drafter=spy, speculation="always") == plain
        trees = [t.tokens.tolist() for h, t in spy.seen if h is not None]
        assert trees
        if "medusa_choices" in options:  # ranks 0, 1, 2 of head 0: the three tokens, one each
            assert all(sorted(t) == [1, 2, 3] for t in trees)


# ---- self-draft ------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [dict(num_layers=2, num_draft_tokens=4),
                                     dict(num_layers=3, tree="dynamic", max_nodes=12, beam=3)],
                         ids=["chain", "dynamic"])
def test_self_draft_greedy_identity_with_a_reduced_vocabulary(options):
    target = build_tiny_model(num_hidden_layers=4)
    plain = specdec.generate(target, PROMPTS, max_new_tokens=128)
    ids = common_ids(target)
    seen = []

    class SelfSpy(SelfDraftDrafter):
        def propose(self, seqs):
            trees = super().propose(seqs)
            seen.extend(trees)
            return trees

    # every tree verified: what is tested is the reduced vocabulary, not whether the guard finds the drafter paying
    out = specdec.generate(target, PROMPTS, max_new_tokens=128, return_dict=True, speculation="always",
                           drafter=SelfSpy(draft_vocab=ids, **options))
    assert out.sequences == plain
    assert sum(sum(s.depth_accepted) for s in out.stats) > 0
    assert all(set(t.tokens.tolist()) <= set(ids) for t in seen) and sum(t.num_nodes for t in seen) > 50
    for p, ref in zip(PROMPTS[:2], plain[:2], strict=True):
        assert specdec.generate(target, [p], max_new_tokens=128, drafter="self-draft",
                                drafter_options=dict(draft_vocab=ids, **options))[0] == ref


def test_self_draft_sampled_draft_probs_live_on_the_reduced_vocabulary():
    target = build_tiny_model(num_hidden_layers=3)
    ids = [2, 5, 7, 11, 13, 40, 41, 90]
    trees = []

    class SelfSpy(SelfDraftDrafter):
        def propose(self, seqs):
            out = super().propose(seqs)
            trees.extend(out)
            return out

    spy = SelfSpy(num_layers=1, draft_vocab=ids, mode="independent", widths=(2,), num_draft_tokens=2, seed=0)
    # speculation="always": the sampled trees exactly as drafted (the seeded guard would first time the drafter
    # in a greedy run of its own, whose trees the spy would see too)
    specdec.generate(target, PROMPTS[:3], max_new_tokens=12, drafter=spy, do_sample=True, seed=0, temperature=0.8,
                     speculation="always")
    probs = torch.cat([t.draft_probs for t in trees if t.num_nodes])  # [nodes, 96]
    outside = torch.ones(96, dtype=torch.bool)
    outside[ids] = False
    assert probs.shape[1] == 96 and float(probs[:, outside].abs().max()) == 0.0
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs)))
    assert set(torch.cat([t.tokens for t in trees]).tolist()) <= set(ids)
    # the root's draft_probs: the first layer's logits over the N tokens, softmax at the target's temperature
    assert (probs[:, ids] > 0).all()


@pytest.mark.slow
def test_self_draft_sampling_law_with_a_reduced_vocabulary_matches_plain():
    """Target tokens outside the draft vocabulary can only come from the residual: the law still holds."""
    from specdec.eval.negative_controls import generate_with_control
    from specdec.eval.two_sample import two_sample_chi2

    from specdec.rejection import EXACT

    target = build_tiny_model(vocab_size=4, seed=3, num_hidden_layers=3)

    def first_tokens(drafter, seed):
        out = generate_with_control(target, [[1, 2, 3, 1, 2, 3, 1, 2]] * 6000, EXACT, max_new_tokens=3,
                                    drafter=drafter, do_sample=True, seed=seed, temperature=0.9, return_dict=True,
                                    speculation="always")
        return [tuple(t[:3]) for t in out.new_tokens], out.tau

    plain, _ = first_tokens(None, 1)
    drafter = SelfDraftDrafter(num_layers=1, draft_vocab=[1, 3], mode="independent", num_draft_tokens=3, seed=4)
    spec, tau = first_tokens(drafter, 2)
    assert tau > 1.1  # drafts are accepted: the rejection rule really meets the reduced draft_probs
    p, power = two_sample_chi2(plain, spec, tv=0.08)
    assert power >= 0.9 and p > 1e-3, (p, power)
    assert {0, 2} <= {t for s in spec for t in s}  # out-of-vocabulary tokens still appear (recovered tokens)


@pytest.mark.parametrize("spec, match", [(0, "positive"), ([], "non-empty"), (1.5, "size"), ([1, 96], "token id 96"),
                                         ([3, 3], "more than once"), (8, "needs the target's tokenizer")])
def test_self_draft_refuses_bad_vocabularies(spec, match):
    with pytest.raises(InputError, match=match):
        specdec.generate(build_tiny_model(num_hidden_layers=3), [[1, 2]], max_new_tokens=4, drafter="self-draft",
                         drafter_options=dict(num_layers=1, draft_vocab=spec))


def test_self_draft_reads_a_checkpoint_list(tmp_path):
    target = build_tiny_model(num_hidden_layers=3)
    save_medusa(reduced_heads(target, [4, 8, 15, 16, 23, 42]), tmp_path / "h")
    (tmp_path / "ids.json").write_text("[4, 8, 15]")
    # an EAGLE head keeps its reduced vocabulary as the d2t map in its weights: it was refused as holding no list
    eagle = EagleModel(EagleConfig.for_target(target.config, arch="eagle3", draft_vocab=[4, 8, 15, 16, 23]))
    save_eagle(eagle, tmp_path / "e")
    for path, n in ((tmp_path / "h", 6), (tmp_path / "ids.json", 3), (tmp_path / "e", 5)):
        d = SelfDraftDrafter(num_layers=1, draft_vocab=str(path))
        specdec.generate(target, PROMPTS[:2], max_new_tokens=4, drafter=d)
        assert d.draft_vocab.ids.tolist() == [4, 8, 15, 16, 23, 42][:n]


def test_a_draft_vocab_path_refusal_names_the_drafter(tmp_path):
    """The path's own refusals (missing, not JSON) began "draft_vocab:", unlike every other self-draft refusal."""
    target = build_tiny_model(num_hidden_layers=3)
    (tmp_path / "bad.json").write_text("{")
    for path, why in ((tmp_path / "missing", "does not exist"), (tmp_path / "bad.json", "is not valid JSON")):
        with pytest.raises(InputError, match=rf"^self-draft: draft_vocab: .* {why}"):
            drafter = SelfDraftDrafter(num_layers=1, draft_vocab=str(path))
            specdec.generate(target, PROMPTS[:1], max_new_tokens=2, drafter=drafter)


def test_builtin_prompt_vocabulary_takes_the_most_frequent_tokens_and_eos():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]")),
                                  unk_token="[UNK]", eos_token="</s>")
    ids = builtin_prompt_tokens(tok, 5)
    assert len(ids) == 5 and 1 in ids and vocab[" "] in ids and vocab["e"] in ids and vocab["q"] not in ids
    assert builtin_prompt_tokens(tok, 100) == list(range(len(vocab)))  # more than the prompts hold: filled up


def test_the_draft_vocabulary_helpers_at_their_edges():
    """Ties go to the smaller id; the size chosen is the smallest that covers the share asked for; an id past the
    vocabulary is refused in one line (no test called choose_size, and a bare IndexError stood in for the refusal)."""
    assert frequent_tokens([[5, 3, 9]], 2) == [3, 5]
    assert choose_size([[7, 8]], 0.5, sizes=(1, 2)) == (1, {1: 0.5})
    assert choose_size([[7, 8]], 0.9, sizes=(1, 2)) == (2, {1: 0.5, 2: 1.0})
    with pytest.raises(InputError, match=r"must lie in \[0, 8\)"):
        DraftVocab([0, 1, 8], vocab_size=8)


def test_the_draft_vocabulary_refuses_a_size_below_one_and_repeated_ids():
    with pytest.raises(InputError, match="positive integer, got 0"):
        frequent_tokens([[1, 2]], 0)
    with pytest.raises(InputError, match="must be distinct"):
        DraftVocab([1, 3, 1], vocab_size=8)


def test_an_empty_corpus_counts_as_covered_so_the_smallest_size_is_chosen():
    # no tokens at all: nothing is left uncovered (share 1.0), so the first size already reaches any target
    assert coverage([], [1, 2]) == 1.0
    assert choose_size([[]], 0.9, sizes=(1, 2)) == (1, {1: 1.0})


# ---- training ------------------------------------------------------------------------------------
def _batch(model):
    ids, mask = features.collate([[1, 5, 9, 2, 7, 3, 3, 8, 4, 4], [4, 4, 6, 1, 2, 9]], "cpu")
    hidden, labels = features.target_features(model, ids, mask)
    return hidden, labels, mask


@pytest.mark.parametrize("loss", ["ce", "kl"])
@pytest.mark.parametrize("shared", [False, True])
def test_reduced_head_loss_lowers_after_a_step(loss, shared):
    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    hidden, labels, mask = _batch(model)
    ids = sorted(set(labels[mask.bool()].tolist()))[:-2] + [60, 61]  # most labels in, two out
    heads = reduced_heads(model, ids, shared=shared)
    lm_w = model.get_output_embeddings().weight.detach()
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)

    def total():
        return sum(medusa_loss.head_loss(heads, i, hidden, labels, mask, lm_w, loss)[0] for i in range(3))

    before = total()
    assert torch.isfinite(before)
    before.backward()
    opt.step()
    with torch.no_grad():
        assert total() < before - 1e-3


def test_reduced_head_loss_ignores_labels_outside_but_counts_them_as_misses():
    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    hidden, labels, mask = _batch(model)
    lm_w = model.get_output_embeddings().weight.detach()
    y = labels[:, 1:][mask[:, 1:].bool()]  # head 0's labels
    inside = sorted(set(y.tolist()))[: len(set(y.tolist())) // 2]
    heads = reduced_heads(model, inside + [62, 63], noise=0.2)
    value, correct, count = medusa_loss.head_loss(heads, 0, hidden, labels, mask, lm_w, "ce")
    logits = heads.heads[0](hidden[:, :-1][mask[:, 1:].bool()])  # [positions, N]
    keep = torch.tensor([t in inside for t in y.tolist()])
    expected = torch.nn.functional.cross_entropy(logits[keep], torch.tensor([inside.index(t) for t in y[keep]]))
    torch.testing.assert_close(value, expected)  # the mean over in-vocabulary labels only
    assert count == y.numel() and keep.sum() < count  # positions outside are counted
    assert correct == int((heads.vocab().to_full(logits.argmax(-1)) == y).sum())
    nothing = reduced_heads(model, [62, 63])  # no label inside: a zero loss, not NaN
    value, correct, count = medusa_loss.head_loss(nothing, 0, hidden, labels, mask, lm_w, "ce")
    assert float(value.detach()) == 0.0 and correct == 0 and count == y.numel()


def test_reduced_kl_averages_over_every_position_and_ce_over_in_vocabulary_labels_only():
    """Draft vocabulary (0, 1) of 3 tokens, identity rows, identity heads at init: head logits are the hidden states.
    3 tokens then padding; labels (0, 1, 2): head 0 meets labels 1 (inside) and 2 (outside), head 1 label 2."""
    import math

    heads = MedusaHeads(MedusaConfig(2, 1, 2, 3, shared_lm_head=True, draft_vocab=(0, 1)))
    lm_w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    ln3 = math.log(3)
    hidden = torch.tensor([[[0.0, 0.0], [ln3, 0.0], [0.0, ln3], [0.0, 0.0]]])
    labels, mask = torch.tensor([[0, 1, 2, 0]]), torch.tensor([[1, 1, 1, 0]])
    assert [medusa_loss.head_loss_count(heads, i, labels, mask, "kl") for i in range(2)] == [2, 1]
    assert [medusa_loss.head_loss_count(heads, i, labels, mask, "ce") for i in range(2)] == [1, 0]
    # head 0, t=0: head (1/2, 1/2) vs target (3/4, 1/4): 0.75 ln 1.5 - 0.25 ln 2 = 0.130812
    #         t=1: head (3/4, 1/4) vs target (1/4, 3/4): 0.25 ln(1/3) + 0.75 ln 3 = 0.5 ln 3 = 0.549306
    # the mean over both positions, the one whose label lies outside included: 0.340059
    first = 0.75 * math.log(1.5) - 0.25 * math.log(2)
    kl, _, count = medusa_loss.head_loss(heads, 0, hidden, labels, mask, lm_w, "kl")
    assert kl.item() == pytest.approx((first + 0.5 * ln3) / 2, abs=1e-6) and count == 2
    ce, correct, count = medusa_loss.head_loss(heads, 0, hidden, labels, mask, lm_w, "ce")
    assert ce.item() == pytest.approx(math.log(2), abs=1e-6)  # only t=0 (label 1): -ln(1/2)
    assert (correct, count) == (0, 2)  # argmax 0 at t=0 misses label 1; label 2 cannot be hit


def test_reduced_head_accuracies_count_out_of_vocabulary_tokens_as_misses():
    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    seqs = [[1, 5, 9, 2, 7, 3, 3, 8, 4, 4], [4, 4, 6, 1, 2, 9], [7, 7, 1, 30, 31]]
    full = reduced_heads(model, range(64), noise=0.3)
    ids = list(range(0, 64, 2))
    heads = reduced_heads(model, ids, noise=0.3)
    got = evaluate.head_accuracies(model, heads, seqs)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    ids_t, mask = features.collate(seqs, "cpu")
    hidden, labels = features.target_features(model, ids_t, mask)
    for i in range(3):  # reference: the full-vocabulary heads with every other token masked out
        valid = mask[:, 1 + i:].bool()
        logits = full.heads[i](hidden[:, : -1 - i][valid]).masked_fill(outside, float("-inf"))
        eq = logits.topk(evaluate.MAX_RANK, -1).indices == labels[:, 1 + i:][valid].unsqueeze(-1)
        torch.testing.assert_close(torch.tensor(got["rank_acc"][i], dtype=torch.float64), eq.double().mean(0))
    assert got["positions"] == evaluate.head_accuracies(model, full, seqs)["positions"]
