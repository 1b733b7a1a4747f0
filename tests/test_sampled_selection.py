"""Choosing or pruning a sampled tree may use only what was fixed before its tokens were drawn.

Two reproductions, each exact (float64 enumeration of the first token's law with the real selection code) and
statistical (generate() on a tiny model, 4,000 copies of one prompt, chi-square on the first new token), and each
with its negative control, which must fail both: a combined drafter ranking a sampled child by its drawn
token's score, and a sizer cutting a sampled tree by its own token-dependent shape. Plus the model drafters
without replacement under top-k and top-p, whose child count depends on the drawn tokens. Then each rule alone on
the case that breaks it (a draft time, an order, a child's shape, the certificate's earlier shape).
"""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.base import SequenceView, TokenView
from specdec.drafters.combined import CombinedDrafter
from specdec.eval.negative_controls import ScoreChoosingCombined, ShapeAwareSizer
from specdec.eval.selection_law import (
    DRAFT,
    TARGET,
    SelectionCase,
    first_token_law,
    selection_cases,
    token_shaped_tree,
)
from specdec.eval.statistics import goodness_of_fit

from specdec.generate import generate
from specdec.rejection import rejection_sample
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.testing import build_tiny_model
from specdec.tree import DraftMode, DraftTree
from specdec.tree_sizing import TreeSizer
from tests.fixed_costs import fix_costs

N = 4000
PROMPT = [1, 2, 3]


def test_exact_selections_keep_the_law_and_the_broken_ones_do_not():
    exact, broken = selection_cases(), selection_cases(controls=True)
    assert exact and broken  # an empty set of cases would pass having checked nothing
    for name, case in exact.items():
        assert case.max_error() < 1e-12, name
    for name, case in broken.items():
        assert case.max_error() > 0.05, name


class Sampled:
    """A sampled one-token chain x ~ DRAFT, scored by DRAFT[x] (the contract allows scores on sampled trees);
    with ``grow`` the token-shaped tree instead (six children when it drew token 0; ``grow=True``: always)."""

    name = "sampled"

    def __init__(self, grow: bool | None = None, seed: int = 3) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.grow = grow

    def propose(self, seqs):
        out = []
        for _ in seqs:
            x = int(torch.multinomial(DRAFT, 1, generator=self.g))
            if self.grow is None:
                out.append(DraftTree([x], [-1], DRAFT.float()[None], DraftMode.INDEPENDENT,
                                     scores=torch.tensor([float(DRAFT[x])])))
            else:
                out.append(token_shaped_tree(0 if self.grow else x, DRAFT.float()))
        return out


class Zero:
    name = "zero"

    def propose(self, seqs):
        return [DraftTree([0], [-1], scores=torch.tensor([0.5])) for _ in seqs]


def first_tokens(trees: list[DraftTree], seed: int = 0) -> list[int]:
    """The first token each tree commits under the real rejection sampler, target law TARGET at every row."""
    width = 1 + max(t.num_nodes for t in trees)
    logits = TARGET.log().float().expand(len(trees), width, -1).contiguous()
    accs = rejection_sample(trees, logits, SamplingConfig(do_sample=True), torch.Generator().manual_seed(seed))
    return [(*a.accepted_tokens, a.next_token)[0] for a in accs]


def law_test(tokens: list[int], exact: bool) -> None:
    p, power = goodness_of_fit(tokens, {t: float(q) for t, q in enumerate(TARGET)}, tv=0.045, alpha=1e-3)
    assert len(tokens) >= 4000 and power > 0.9, power
    assert (p > 1e-3) if exact else (p < 1e-6), p


def views(n: int) -> list[SequenceView]:
    return [SequenceView(i, TokenView(PROMPT), len(PROMPT)) for i in range(n)]


@pytest.mark.parametrize("combined_cls, exact", [(CombinedDrafter, True), (ScoreChoosingCombined, False)])
def test_the_combined_drafter_never_chooses_a_sampled_child_by_its_drawn_token(combined_cls, exact):
    drafter = combined_cls([Sampled(), Zero()], mode="best", gate=False)
    law_test(first_tokens(drafter.propose(views(N))), exact)


@pytest.fixture
def seven_nodes_pay(monkeypatch):
    """Seven verified nodes pay, one does not; drafting is free; nothing of this machine's timings counts."""
    return fix_costs(monkeypatch, {1: 1.0, 2: 2.0, 8: 1.0, 65: 60.0})


def sized_generate(model, prompts, **kw):
    """generate() with tree sizing, sampling from a fixed seed of torch's own generator: a ``seed=`` (or
    ``generator=``) of standard sampling verifies every tree whole (specdec.engine_setup._policy), so the sizer
    these tests are about would never run."""
    with torch.random.fork_rng():
        torch.manual_seed(kw.pop("torch_seed"))
        return generate(model, prompts, speculation="auto", do_sample=True, sampler="standard", **kw)


@pytest.mark.parametrize("sizer_cls, exact", [(TreeSizer, True), (ShapeAwareSizer, False)])
def test_sizing_never_cuts_a_sampled_tree_by_its_own_token_dependent_shape(seven_nodes_pay, sizer_cls, exact):
    sizer = sizer_cls(seven_nodes_pay)
    sizer.last_shape = token_shaped_tree(0).parents.tolist()  # an earlier step showed the seven-node shape
    trees = Sampled(grow=False).propose(views(N))
    law_test(first_tokens(sizer.size_call(list(range(N)), trees, batch=1, draft_seconds=0.0)), exact)


@pytest.mark.slow
def test_generate_sizes_token_shaped_sampled_trees_exactly(seven_nodes_pay):
    """End to end through generate(speculation="auto"): an earlier call showed the sizer the seven-node shape
    (remembered per drafter), then 1,000 copies of a prompt; the first new token keeps the target's law
    (chi-square; this sample size detects TV 0.09 with power 0.9) and the sampled node is verified."""
    model = build_tiny_model(vocab_size=4, seed=5)
    with torch.no_grad():
        law = model(torch.tensor([PROMPT])).logits[0, -1].double().softmax(-1)
    kw = dict(audit_drafts=False, max_new_tokens=3, return_dict=True)
    sized_generate(model, [PROMPT], drafter=Sampled(grow=True), torch_seed=1, **kw)
    out = sized_generate(model, [PROMPT] * 1000, drafter=Sampled(grow=False), torch_seed=11, **kw)
    assert all(s.step_nodes[0] >= 1 for s in out.stats)
    assert any(0 in s.step_nodes[1:] for s in out.stats)  # the sizer ran: a later one-node tree does not pay
    p, power = goodness_of_fit([s[len(PROMPT)] for s in out.sequences], dict(enumerate(law.tolist())), tv=0.09,
                               alpha=1e-3)
    assert power > 0.9 and p > 1e-3, (p, power)


def two_token_law(model, sampling: SamplingConfig) -> dict:
    """Exact law of the first two new tokens after PROMPT under ``sampling``."""
    with torch.no_grad():
        first = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1].double(), sampling)
        law = {}
        for t1, p1 in enumerate(first.tolist()):
            if p1 > 0:
                second = logits_to_probs(model(torch.tensor([PROMPT + [t1]])).logits[0, -1].double(), sampling)
                law.update({(t1, t2): p1 * p2 for t2, p2 in enumerate(second.tolist()) if p2 > 0})
    return law


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(top_k=2), dict(top_p=0.8)], ids=["top_k=2", "top_p=0.8"])
def test_model_drafters_without_replacement_keep_the_law_when_sized(monkeypatch, sampling):
    """Their child count is min(width, support), so it depends on the drawn tokens under top-k / top-p; sizing
    with speculation="auto" keeps the law of the first two new tokens (chi-square, power >= 0.9 at TV 0.07)."""
    model = build_tiny_model(vocab_size=4, seed=5)
    draft = build_tiny_model(vocab_size=4, seed=6, num_hidden_layers=1)  # one of the target's size is never asked
    # two verified nodes pay best, a whole tree less: trees are cut (by the shape an earlier call showed the sizer),
    # and the earlier call's whole tree still paid, so the guard does not skip the call's first step
    fix_costs(monkeypatch, {1: 1.0, 3: 1.0, 7: 1.5, 65: 100.0})
    law = two_token_law(model, SamplingConfig(do_sample=True, **sampling))
    kw = dict(drafter="draft-model", audit_drafts=False, **sampling, return_dict=True,
              drafter_options={"model": draft, "num_draft_tokens": 2, "widths": [3, 2], "mode": "without_replacement",
                               "seed": 3})
    sized_generate(model, [PROMPT], max_new_tokens=4, torch_seed=1, **kw)
    out = sized_generate(model, [PROMPT] * 2000, max_new_tokens=2, torch_seed=5, **kw)
    assert sum(s.step_nodes[0] for s in out.stats) >= 2000  # drafts were verified, not pruned away
    assert max(s.step_nodes[0] for s in out.stats) == 2  # ... but cut to the two that pay (the sizer ran)
    p, power = goodness_of_fit([tuple(s[len(PROMPT):]) for s in out.sequences], law, tv=0.07, alpha=1e-3)
    assert power >= 0.9 and p > 1e-3, (p, power)


# ---- the rules one at a time, each on the case that breaks it (float64 laws) -----------------------------------


def test_a_sampled_calls_own_draft_time_never_moves_its_cut():
    """A sampled call's draft time is recorded after its trees are sized: a drafter that is fast exactly when it
    drew token 0 moved the cut of the tree it drew (a one-node tree whose node pays only behind a slow draft),
    and the first token's law by TV 0.07."""
    from specdec.cost_model import CostModel

    costs = CostModel({}, {1: {1: 1.0, 2: 2.0, 8: 1.2, 65: 60.0}})

    def verified(x: int) -> DraftTree:
        sizer = TreeSizer(costs)
        sizer.last_shape = [-1]  # an earlier sampled tree of one node
        seconds = 0.0 if x == 0 else 50 * costs.decode_seconds(1)
        return sizer.size_call([0], [token_shaped_tree(x)], batch=1, draft_seconds=seconds)[0]

    assert SelectionCase("", TARGET, DRAFT, verified).max_error() < 1e-12


def _independent_roots_law(tree: DraftTree) -> torch.Tensor:
    """The first token's law given a tree of independently drawn root children, tried in node order."""
    residual, out, weight = TARGET.clone(), torch.zeros_like(TARGET), 1.0
    for i in range(tree.num_nodes):
        x, q = int(tree.tokens[i]), tree.draft_probs[i].to(torch.float64)
        r = residual / residual.sum()
        a = min(1.0, float(r[x] / q[x]))
        out[x] += weight * a
        weight *= 1 - a
        residual = (r - q).clamp(min=0.0)
    return out + weight * residual / residual.sum()


def test_a_sampled_tree_is_cut_to_a_prefix_of_its_node_order():
    """Not to its best-rated nodes: here root children r0, r1 are drawn, and two more when r0 drew token 0, whose
    sibling ranks the sizer has seen accepted most. Verifying r2, r3 instead of r0, r1 exactly when r0 = 0 moved
    the first token's law by TV 0.07."""
    import itertools

    from specdec.cost_model import CostModel

    costs = CostModel({}, {1: {1: 1.0, 65: 1.01}})  # verifying is nearly free: the earlier shape pays whole
    law = torch.zeros_like(TARGET)
    for r in itertools.product(range(4), repeat=4):
        n = 4 if r[0] == 0 else 2
        sizer = TreeSizer(costs)
        sizer.unscored = {(1, k): [a, 100.0] for k, a in enumerate([30.0, 10.0, 60.0, 60.0])}
        sizer.last_shape = [-1, -1]
        tree = sizer.size(0, DraftTree(list(r[:n]), [-1] * n, DRAFT.expand(n, -1), DraftMode.INDEPENDENT), batch=1)
        assert tree.tokens.tolist() == list(r[:2])
        law += torch.prod(DRAFT[list(r)]) * _independent_roots_law(tree)
    assert float((law - TARGET).abs().max()) < 1e-12


class _FixedChild:
    name = "fixed"

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree

    def propose(self, seqs):
        return [self.tree for _ in seqs]


def test_the_combined_drafter_values_a_sampled_child_by_its_previous_shape_not_the_drawn_one():
    """A sampled child whose tree grows when it drew token 0, against a deterministic chain: valued by the tree it
    drew, it was chosen exactly when it drew token 0 (TV 0.07)."""
    def verified(x: int) -> DraftTree:
        sampled, greedy = token_shaped_tree(x), DraftTree([0], [-1], scores=torch.tensor([0.5]))
        combined = CombinedDrafter([_FixedChild(sampled), _FixedChild(greedy)], mode="best", gate=False)
        return combined._combine([sampled, greedy])

    assert SelectionCase("", TARGET, DRAFT, verified).max_error() < 1e-12


class _OwnShapeOnceKnown(TreeSizer):
    """Broken: once it has seen any earlier sampled shape, it cuts a sampled tree by its own."""

    def _sampled_prefix(self, seq_id, tree, draft, batch, costs):
        if self.shapes.get(seq_id, self.last_shape) is None:
            return tree.num_nodes
        return ShapeAwareSizer._sampled_prefix(self, seq_id, tree, draft, batch, costs)


def test_the_certificates_sizer_case_has_seen_an_earlier_shape():
    """Its sizer must know an earlier sampled shape, the only state in which a cut is possible: without one, a
    sizer that cuts by the tree's own shape once it knows any passed the certificate."""
    from specdec.eval.selection_law import sizer_case

    assert sizer_case(_OwnShapeOnceKnown).max_error() > 0.05


def test_the_exact_law_of_deterministic_candidates_is_the_target():
    """Deterministic root children are accepted in turn with their share of what the earlier ones left:
    token 0 with 0.145; token 1 with 0.573 / (1 - 0.145) = 0.670, i.e. 0.855 * 0.670 = 0.573 in all; the rest,
    0.282, sampled from the residual [0, 0, 0.121, 0.161] / 0.282: the target itself, whatever the draft law."""
    law = first_token_law(TARGET, DRAFT, lambda x: DraftTree([0, 1], [-1, -1]))
    assert torch.allclose(law, TARGET, atol=1e-12), law
