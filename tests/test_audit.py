"""The draft audit stops drafters whose draft_probs are not what they sampled from, and never honest ones."""
from __future__ import annotations

import re

import pytest
import torch
from specdec.drafters.base import Drafter

import specdec
from specdec.audit import VIEWS, DraftAudit, audit_of
from specdec.errors import InputError
from specdec.testing import build_tiny_model
from specdec.tree import DraftError, DraftMode, DraftTree

VOCAB = 16


def _tree(gen, mode, sample_probs, reported_probs, width=3):
    """Root children drawn from sample_probs (with or without replacement); claims reported_probs."""
    replacement = mode is DraftMode.INDEPENDENT
    tokens = torch.multinomial(sample_probs, width, replacement=replacement, generator=gen)
    child = torch.multinomial(sample_probs, 1, generator=gen)  # one grandchild under node 0
    tokens = torch.cat([tokens, child])
    parents = torch.tensor([-1] * width + [0])
    return DraftTree(tokens, parents, reported_probs.expand(width + 1, VOCAB).clone(), mode)


def _draws_in(err: pytest.ExceptionInfo) -> int:
    return int(re.search(r"after (\d+) sampled draft nodes", str(err.value)).group(1))


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT])
def test_honest_drafts_never_alarm(mode):
    """4,000 honest draws, from a fixed law and from one that changes every proposal (as a model's does)."""
    gen = torch.Generator().manual_seed(0)
    audit = DraftAudit()
    fixed = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, -1)
    for i in range(1000):
        probs = fixed if i % 2 else torch.softmax(torch.randn(VOCAB, generator=gen) * 3, -1)
        audit.observe(_tree(gen, mode, probs, probs), "honest")
    assert audit.draws == 4000
    assert audit.e_value < 1e3  # far from the alarm at 1e6 (it hovers around 1 or below under an honest drafter)


def test_pit_is_exactly_uniform_given_the_past():
    """Under the claimed laws, each node's PIT interval, integrated over V and over its token, is Uniform(0, 1)
    given the nodes before it (exact, no sampling): two root children drawn without replacement from one row
    (the second from the row without the first, renormalised; ties in the row), a grandchild from another."""
    probs = torch.tensor([[0.1, 0.3, 0.05, 0.3, 0.25]] * 2 + [[0.2, 0.2, 0.2, 0.1, 0.3]], dtype=torch.float64)
    audit = DraftAudit()
    edges = torch.linspace(0, 1, 9, dtype=torch.float64)  # 8 equal bins

    def mass(lo, width):  # [len(VIEWS), 8]: mass of Uniform(lo, lo + width) in each bin
        overlap = torch.minimum(edges[1:], (lo + width)[:, None]) - torch.maximum(edges[:-1], lo[:, None])
        return overlap.clamp(min=0) / width[:, None]

    for x0 in range(5):
        given_x0 = torch.zeros(len(VIEWS), 8, dtype=torch.float64)
        for x1 in range(5):
            if x1 == x0:
                continue
            given_x1 = torch.zeros(len(VIEWS), 8, dtype=torch.float64)
            for x2 in range(5):
                tree = DraftTree([x0, x1, x2], [-1, -1, 0], probs.clone(), DraftMode.WITHOUT_REPLACEMENT)
                lo, width = audit.intervals(tree)
                given_x0 += probs[0, x1] / (1 - probs[0, x0]) * probs[2, x2] * mass(lo[1], width[1])
                given_x1 += probs[2, x2] * mass(lo[2], width[2])
            torch.testing.assert_close(given_x1, torch.full_like(given_x1, 1 / 8), rtol=0, atol=1e-12)
        torch.testing.assert_close(given_x0, torch.full_like(given_x0, 1 / 8), rtol=0, atol=1e-12)


def test_a_sibling_after_one_holding_almost_all_the_mass_gets_its_exact_interval():
    """Without replacement, the second sibling's row is the first row without the first token. Subtracting the first
    token's mass from the float32 row's sums cancelled when it held all but 1e-6 of the row: the interval came out
    ~10% off, and an honest drafter with such draft_probs was convicted after ~1,200 steps."""
    q = torch.tensor([1 - 1e-6, 2e-7, 5e-7, 3e-7, 0.0])  # float32, as drafters report them
    tree = DraftTree([0, 2], [-1, -1], q.expand(2, 5).clone(), DraftMode.WITHOUT_REPLACEMENT)
    lo, width = DraftAudit().intervals(tree)
    rest = q.double()[1:].sum()
    # token order: below token 2 lies token 1; probability order: token 2 is the most likely of the rest
    want_lo = torch.tensor([q[1].double() / rest, 0.0], dtype=torch.float64)
    want_width = torch.tensor([q[2].double() / rest] * 2, dtype=torch.float64)
    torch.testing.assert_close(lo[1], want_lo, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(width[1], want_width, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT])
def test_transform_on_the_trees_device_matches_a_float64_reference(device, mode):
    """The PIT is computed where draft_probs live, in their float32; compare with a plain float64 loop (the rounding,
    ~1e-7, is far below the audit's finest bin, 1/64)."""
    gen = torch.Generator().manual_seed(6)
    probs = torch.softmax(torch.randn(5, 300, generator=gen) * 3, -1)
    probs[:, :40] = probs[:, :40].mean(-1, keepdim=True)  # ties in the probability order
    probs /= probs.sum(-1, keepdim=True)
    tokens = torch.multinomial(probs[0], 4, replacement=False, generator=gen).tolist() + [5]
    parents = [-1, -1, 0, -1, 0]
    tree = DraftTree(torch.tensor(tokens, device=device), torch.tensor(parents, device=device),
                     probs.to(device), mode)
    lo, width = DraftAudit().intervals(tree)
    assert lo.device.type == "cpu" and lo.dtype == torch.float64
    for i, (x, parent) in enumerate(zip(tokens, parents, strict=True)):
        q = probs[i].double()
        if mode is DraftMode.WITHOUT_REPLACEMENT:  # earlier siblings removed
            q[[tokens[j] for j in range(i) if parents[j] == parent]] = 0
        q /= q.sum()
        want_lo = [float(q[:x].sum()), float(q[q > q[x]].sum())]
        want_width = [float(q[x]), float(q[q == q[x]].sum())]
        torch.testing.assert_close(lo[i], torch.tensor(want_lo, dtype=torch.float64), rtol=0, atol=1e-6)
        torch.testing.assert_close(width[i], torch.tensor(want_width, dtype=torch.float64), rtol=0, atol=1e-6)


def test_false_alarm_rate_is_bounded_over_the_whole_run():
    """Ville: P(an honest run ever alarms) <= alpha, however long. 300 honest runs of 2,000 draws at alpha = 0.1."""
    gen = torch.Generator().manual_seed(5)
    runs, alpha = 300, 0.1
    alarms = 0
    for _ in range(runs):
        audit = DraftAudit(alpha=alpha)
        try:
            audit.update(torch.rand(2000, len(VIEWS), generator=gen, dtype=torch.float64), "honest")
        except DraftError:
            alarms += 1
    # binomial(300, 0.1): mean 30, sd 5 (measured: 7.3% of 1,000 runs of 5,000 draws). A test that is not a
    # supermartingale (a KS test repeated every window, a bet that counts the draw it bets on) alarms far more often.
    assert alarms <= runs * alpha + 3 * (runs * alpha * (1 - alpha)) ** 0.5


def _one_token_liar(vocab):
    """Always proposes token 7 and claims it was drawn uniformly over the vocabulary."""
    return DraftTree([7], [-1], torch.full((1, vocab), 1.0 / vocab), DraftMode.INDEPENDENT)


def test_blatant_liar_is_stopped_within_100_draws_with_its_name():
    audit = DraftAudit()
    with pytest.raises(DraftError, match=r"one-token-liar: .*not drawn from the draft_probs .*e-value") as err:
        for _ in range(100):
            audit.observe(_one_token_liar(1000), "one-token-liar")
    assert _draws_in(err) == audit.draws <= 20  # measured: 9 draws at alpha = 1e-6


class OneTokenLiar(Drafter):
    name = "one-token-liar"

    def propose(self, seqs):
        return [_one_token_liar(96) for _ in seqs]


def test_generate_stops_the_blatant_liar_at_16_x_100_tokens():
    """Issue 24: this drafter made token 7 45.6% of 16 x 100 sampled tokens (1.3% in plain sampling) unnoticed."""
    model = build_tiny_model()
    with pytest.raises(DraftError, match="one-token-liar: .*not drawn from the draft_probs") as err:
        specdec.generate(model, [[1, 2, 3]] * 16, max_new_tokens=100, drafter=OneTokenLiar(), do_sample=True, seed=0)
    assert _draws_in(err) <= 100


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT])
def test_lying_drafts_are_caught_with_the_drafter_name(mode):
    gen = torch.Generator().manual_seed(1)
    audit = DraftAudit()
    truth = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, -1)
    claim = torch.full((VOCAB,), 1.0 / VOCAB)  # e.g. forgot the temperature: claims a flatter law
    with pytest.raises(DraftError, match="liar: .*not drawn from the draft_probs"):
        for _ in range(1000):
            audit.observe(_tree(gen, mode, truth, claim), "liar")
    assert audit.draws <= 400


def test_temperature_liar_is_caught_when_its_head_moves_around_the_vocabulary():
    """A model's most likely tokens change with the context, so a liar's token-order PIT pools to ~uniform;
    the probability-order PIT still sees that its tokens are too often the most probable ones."""
    gen = torch.Generator().manual_seed(2)
    audit = DraftAudit()
    with pytest.raises(DraftError, match="context-liar: .*probability order"):
        for _ in range(500):
            logits = torch.randn(1000, generator=gen) * 2
            token = torch.multinomial(torch.softmax(logits / 0.5, -1), 1, generator=gen)  # sampled at T = 0.5
            audit.observe(DraftTree(token, [-1], torch.softmax(logits, -1)[None], DraftMode.INDEPENDENT),
                          "context-liar")  # reports T = 1
    assert audit.draws <= 200


def test_float32_sampling_artefacts_stay_below_the_audits_resolution():
    """float32 torch.multinomial cannot draw a token whose probability is below ~3e-8 at its place in the cumulative
    sum (a 1e-9 token after a 0.999 one is never drawn), so an honest drafter's probability-order PIT can miss up to
    ~1e-3 at the top. Bins finer than 1/64 (e.g. 20 geometric bins towards 1) flagged that after 112,000 draws;
    at 1/64 it stays invisible (also over 2,000,000 draws, measured)."""
    gen = torch.Generator().manual_seed(7)
    audit = DraftAudit()
    for _ in range(2):
        u = torch.rand(100_000, len(VIEWS), generator=gen, dtype=torch.float64)
        u[:, 1] *= 1 - 1e-3
        audit.update(u, "float32-sampler")
    assert audit.draws == 200_000 and audit.e_value < 1


class TemperatureLiar(Drafter):
    """Samples its children at temperature 0.3 but reports the temperature-1 distribution."""

    name = "temperature-liar"

    def __init__(self):
        self.gen = torch.Generator().manual_seed(3)
        self.logits = torch.randn(96, generator=self.gen) * 2

    def propose(self, seqs):
        reported = torch.softmax(self.logits, -1)
        sampled = torch.softmax(self.logits / 0.3, -1)
        trees = []
        for _ in seqs:
            tokens = torch.multinomial(sampled, 2, replacement=True, generator=self.gen)
            trees.append(DraftTree(tokens, [-1, -1], reported.expand(2, 96).clone(), DraftMode.INDEPENDENT))
        return trees


def test_temperature_liar_is_caught_within_100_draws():
    audit = DraftAudit()
    liar = TemperatureLiar()
    with pytest.raises(DraftError, match="temperature-liar"):
        for _ in range(100):
            audit.observe(liar.propose([None])[0], "temperature-liar")
    assert audit.draws <= 100  # measured: 21 draws


def test_generate_refuses_a_lying_drafter_and_can_be_told_not_to_audit():
    model = build_tiny_model()
    prompts = [[1, 2, 3]] * 8
    with pytest.raises(DraftError, match="temperature-liar"):
        specdec.generate(model, prompts, max_new_tokens=16, drafter=TemperatureLiar(), do_sample=True, seed=0,
                         speculation="always")
    out = specdec.generate(model, prompts[:2], max_new_tokens=8, drafter=TemperatureLiar(), do_sample=True, seed=0,
                           audit_drafts=False)
    assert len(out) == 2


def test_a_step_audited_at_once_equals_its_trees_one_by_one():
    """observe_many (the engine's call: one batched transform for a step's independent trees) feeds the same
    u-values as observing the same trees one at a time, so the batching changes nothing but the cost."""
    gen = torch.Generator().manual_seed(4)
    trees = []
    for i in range(12):
        probs = torch.softmax(torch.randn(VOCAB, generator=gen) * 2, -1)
        mode = DraftMode.INDEPENDENT if i < 9 else DraftMode.WITHOUT_REPLACEMENT  # observe_many: independent first
        trees.append(_tree(gen, mode, probs, probs))
    trees.insert(4, DraftTree.empty())
    batched, single = DraftAudit(seed=3), DraftAudit(seed=3)
    batched.observe_many(trees, "d")
    for t in trees:
        single.observe(t, "d")
    assert batched.draws == single.draws == 12 * 4
    assert batched.e_value == pytest.approx(single.e_value, rel=1e-12)
    assert torch.equal(batched._counts, single._counts)


def test_a_liar_is_caught_over_many_short_calls_with_the_same_object():
    """Over 200 calls of 2 tokens with speculation="always", a liar's token once made ~80% of the output (0.8% for
    the target) with no alarm, the evidence starting afresh in every call: one drafter object now carries it over."""
    model = build_tiny_model()
    liar = OneTokenLiar()
    with pytest.raises(DraftError, match="one-token-liar: .*not drawn from the draft_probs") as err:
        for call in range(200):
            specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=liar, do_sample=True, seed=call,
                             speculation="always")
    assert call >= 1 and _draws_in(err) <= 100  # more than one call's worth of evidence was needed
    # a duck-typed drafter (an object with propose, seen through the Drafter contract) is remembered the same way
    duck = type("Duck", (), {"name": "duck-liar", "propose": lambda self, seqs: [_one_token_liar(96) for _ in seqs]})()
    with pytest.raises(DraftError, match="duck-liar: "):
        for call in range(200):
            specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=duck, do_sample=True, seed=call,
                             speculation="always")


def test_a_deferred_read_loses_no_draw_and_still_stops_a_liar(monkeypatch):
    """On CUDA a step's transforms are tested at the audit's next use, the last step's when generate() ends: the
    audit sees every sampled node, as when each step is tested at once, and a liar is still stopped."""
    model = build_tiny_model()
    counts = {}
    for deferred in (False, True):
        monkeypatch.setattr("specdec.audit._reads_later", lambda parts, deferred=deferred: deferred)
        drafter = TemperatureLiar()  # its lies are mild: 16 tokens are too few to raise the alarm
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=16, drafter=drafter, do_sample=True, seed=0,
                         speculation="always")
        audit = audit_of(drafter)
        assert audit._waiting is None  # settled at the end of the call
        counts[deferred] = (audit.draws, audit.e_value)
    assert counts[True][0] == counts[False][0] > 0
    assert counts[True][1] == pytest.approx(counts[False][1], rel=1e-12)
    with pytest.raises(DraftError, match="temperature-liar"):
        specdec.generate(model, [[1, 2, 3]] * 8, max_new_tokens=16, drafter=TemperatureLiar(), do_sample=True, seed=0,
                         speculation="always")


def test_an_exhausted_sibling_is_named_by_its_tree_and_node():
    """A step's sampled nodes are audited together, independent trees first: a without-replacement sibling drawn
    after its earlier siblings took all the mass is named by its own tree and node, not its place in the step."""
    only_first = torch.zeros(VOCAB)
    only_first[0] = 1.0
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
    honest = _tree(gen, DraftMode.INDEPENDENT, probs, probs)  # 4 nodes, audited first
    exhausted = DraftTree([0, 1], [-1, -1], only_first.expand(2, VOCAB).clone(), DraftMode.WITHOUT_REPLACEMENT)
    with pytest.raises(DraftError, match=r"^d: node 1 of the step's tree 2 was drawn where draft_probs left it no"):
        DraftAudit().observe_many([DraftTree.empty(), honest, exhausted], "d")
    with pytest.raises(DraftError, match=r"^d: node 1 was drawn where draft_probs left it no mass \(its row"):
        DraftAudit().intervals(exhausted, "d")


@pytest.mark.parametrize("repeat", ["seed=0", "torch.manual_seed(0)", "DraftConfig(seed=0)"])
def test_an_honest_drafter_reused_with_the_same_randomness_is_never_convicted(repeat):
    """A call that redraws an earlier call's random numbers (the same seed=, torch's global RNG reset before it, or
    the same seed= to a drafter that salts it with a seed of its own config) repeats that call's draws: no new
    evidence. One honest drafter object was convicted at the third such call when every call added its draws to the
    evidence kept across calls."""
    from specdec.drafters.draft_model import DraftModelDrafter

    target, small = build_tiny_model(vocab_size=96, seed=0), build_tiny_model(vocab_size=96, seed=1)
    drafter = DraftModelDrafter(small, num_draft_tokens=4, seed=0 if repeat == "DraftConfig(seed=0)" else None)
    texts, draws = set(), []
    for _ in range(6):
        if repeat == "torch.manual_seed(0)":
            torch.manual_seed(0)
        out = specdec.generate(target, [[5, 6, 7, 8]], max_new_tokens=32, drafter=drafter, do_sample=True,
                               seed=None if repeat == "torch.manual_seed(0)" else 0, speculation="always")
        texts.add(tuple(out[0]))
        draws.append(audit_of(drafter).draws)
    assert len(texts) == 1  # every call replayed the first
    assert draws[0] > 0 and set(draws) == {draws[0]}  # the kept evidence holds the first call's draws only


def test_the_audits_time_is_priced_as_drafting(monkeypatch):
    """The audit runs after the drafter's timer and before the verify's: its time was in neither of the two the
    guard and tree sizing price a step by. It is the drafter's cost, so the policy sees it in draft_seconds."""
    import time

    from specdec.speculation_policy import SpeculationPolicy

    pause, priced, observe, size = 0.02, [], DraftAudit.observe_many, SpeculationPolicy.size

    def slow_observe(self, trees, drafter):
        time.sleep(pause)
        observe(self, trees, drafter)

    def spy(self, call):
        priced.append(call.draft_seconds)
        return size(self, call)

    monkeypatch.setattr(DraftAudit, "observe_many", slow_observe)
    monkeypatch.setattr(SpeculationPolicy, "size", spy)
    out = specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=8, drafter=TemperatureLiar(),
                           do_sample=True, seed=0, speculation="always", audit_drafts=True, return_dict=True)
    assert priced and min(priced) >= pause
    assert out.draft_seconds >= pause * len(priced)


def test_only_a_new_draw_source_joins_the_kept_evidence_and_a_conviction_stays():
    from specdec.audit import call_audit

    drafter = TemperatureLiar()
    kept = call_audit(drafter, 1)
    assert kept is audit_of(drafter) and call_audit(drafter, 2) is kept
    assert call_audit(drafter, 1) is not kept  # a repeat: audited on its own
    with pytest.raises(DraftError):
        for _ in range(1000):
            kept.observe(drafter.propose([None])[0], "temperature-liar")
    assert kept.convicted and call_audit(drafter, 1) is kept  # convicted on fresh draws: every call raises again


@pytest.mark.parametrize("kwargs", [{"alpha": 0.0}, {"alpha": 1.0}, {"resolutions": ()}, {"resolutions": (1,)},
                                    {"resolutions": (4, 1)}])
def test_an_audit_refuses_an_alpha_outside_0_1_or_fewer_than_2_bins(kwargs):
    with pytest.raises(InputError, match="DraftAudit: alpha must be in"):
        DraftAudit(**kwargs)


def test_a_pit_of_exactly_1_counts_in_the_top_bin():
    """u = 1 (the top of the PIT's closed range) falls in the top bin of each resolution, like u = 0.9999."""
    top, near_top = DraftAudit(), DraftAudit()
    top.update(torch.ones(2, len(VIEWS), dtype=torch.float64))
    near_top.update(torch.full((2, len(VIEWS)), 0.9999, dtype=torch.float64))
    # the first draw bets 1 everywhere; the second, in the first's bin: K * 1.5 / (1 + K / 2) = 3K / (K + 2) at each
    # K in 2, 4, ..., 64 (the two views alike), and the e-value is their mean
    want = sum(3 * k / (k + 2) for k in (2, 4, 8, 16, 32, 64)) / 6
    assert top.e_value == pytest.approx(want, rel=1e-12) and near_top.e_value == pytest.approx(want, rel=1e-12)
    assert torch.equal(top._counts, near_top._counts)


def test_a_batch_that_crosses_the_threshold_stops_at_the_draw_that_crossed():
    """Draws fed at once count up to the first one that reaches 1 / alpha, as when they are fed one by one (the
    later draws of the batch, whose e-values also lie above it, are not counted)."""
    u = torch.full((200, len(VIEWS)), 0.001, dtype=torch.float64)  # every draw in the bottom bin: a liar
    at_once, one_by_one = DraftAudit(), DraftAudit()
    with pytest.raises(DraftError) as err:
        at_once.update(u, "d")
    with pytest.raises(DraftError):
        for row in u:
            one_by_one.update(row[None], "d")
    assert at_once.draws == one_by_one.draws == _draws_in(err) < 200
    assert at_once.e_value == pytest.approx(one_by_one.e_value, rel=1e-12)


def test_a_zero_draft_probs_row_is_named_by_its_tree_and_node():
    """A sampled node whose row holds no mass, the first node of the step's second tree: named by that tree."""
    honest = DraftTree([1, 2], [-1, -1], torch.full((2, VOCAB), 1.0 / VOCAB), DraftMode.INDEPENDENT)
    empty = DraftTree([3], [-1], torch.zeros(1, VOCAB), DraftMode.INDEPENDENT)
    with pytest.raises(DraftError, match=r"^d: node 0 of the step's tree 1 was drawn where draft_probs left it no"):
        DraftAudit().observe_many([honest, empty], "d")


def test_draw_sources_beyond_the_remembered_number_are_audited_on_their_own(monkeypatch):
    from specdec.audit import call_audit

    monkeypatch.setattr("specdec.audit.MAX_SOURCES", 2)
    drafter = TemperatureLiar()
    kept = call_audit(drafter, "a")
    assert call_audit(drafter, "b") is kept  # the second of 2 remembered sources
    assert call_audit(drafter, "c") is not kept  # a third: not remembered, so audited alone
    assert call_audit(drafter, "c") is not kept
