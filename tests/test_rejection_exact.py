"""Exact law: the emitted-token distribution of the acceptance procedure equals the target's
to 1e-12 in float64, for every drafting mode and sampling transform (transformers' warpers included); broken
rules fail."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from specdec.eval.exact_law import SyntheticCase, emitted_law, max_abs_error, target_law
from specdec.eval.negative_controls import BROKEN_RULES

from specdec.rejection import EXACT, rejection_sample
from specdec.sampling import WARPERS, SamplingConfig, logits_to_probs
from specdec.tree import DraftMode, DraftTree

SAMPLINGS = {
    "t1": SamplingConfig(do_sample=True),
    "t0.7-topk3": SamplingConfig(do_sample=True, temperature=0.7, top_k=3),
    "t1.3-topp0.8": SamplingConfig(do_sample=True, temperature=1.3, top_p=0.8),
    "greedy": SamplingConfig(do_sample=False),
}
SHAPES = [(1,), (3,), (1, 1, 1), (2, 2), (3, 1), (1, 3), (2, 1, 2), (3, 3, 3)]
MODES = [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT, DraftMode.DETERMINISTIC]
# transformers' other warpers (specdec.warpers), each set to remove tokens of the 6-token cases below
WARPED = {
    "t0.9-minp0.1": SamplingConfig(do_sample=True, temperature=0.9, min_p=0.1),
    "typical0.8": SamplingConfig(do_sample=True, typical_p=0.8),
    "t1.2-epsilon0.05": SamplingConfig(do_sample=True, temperature=1.2, epsilon_cutoff=0.05),
    "eta0.1": SamplingConfig(do_sample=True, eta_cutoff=0.1),
    "toph0.8": SamplingConfig(do_sample=True, top_h=0.8),
    "all": SamplingConfig(True, 0.8, 5, 0.95, min_p=0.05, typical_p=0.9, epsilon_cutoff=0.01, eta_cutoff=0.02,
                          top_h=0.9),
}
WARPED_SHAPES = [(1,), (3,), (2, 2), (2, 1, 2)]


def cases():
    for vocab, shape, mode, sname in itertools.product((4, 6, 8), SHAPES, MODES, SAMPLINGS):
        if vocab > 4 and shape == (3, 3, 3):
            continue  # enumeration grows as vocab^width per level; 4 covers the widest tree
        yield pytest.param(SyntheticCase(vocab, shape, mode, SAMPLINGS[sname], seed=vocab),
                           id=f"v{vocab}-{'x'.join(map(str, shape))}-{mode.value}-{sname}")


def warped_cases():
    for shape, mode, sname in itertools.product(WARPED_SHAPES, MODES, WARPED):
        yield pytest.param(SyntheticCase(6, shape, mode, WARPED[sname], seed=6),
                           id=f"v6-{'x'.join(map(str, shape))}-{mode.value}-{sname}")


@pytest.mark.parametrize("case", list(cases()) + list(warped_cases()))
def test_exact_law_equals_target(case):
    length = 2 if len(case.widths) > 1 else 3
    err = max_abs_error(emitted_law(case, EXACT, length), target_law(case, length))
    assert err < 1e-12, err


@pytest.mark.parametrize("rule_name", sorted(BROKEN_RULES))
def test_every_broken_rule_fails_the_exact_law(rule_name):
    rule = BROKEN_RULES[rule_name]
    worst = 0.0
    for vocab, shape, mode, sname in itertools.product((4, 6), [(1,), (2, 2), (3, 1)], MODES, ["t1", "t0.7-topk3"]):
        case = SyntheticCase(vocab, shape, mode, SAMPLINGS[sname], seed=vocab)
        worst = max(worst, max_abs_error(emitted_law(case, rule, 2), target_law(case, 2)))
    assert worst > 1e-3, f"{rule_name} passed the exact-law test (max error {worst})"


@pytest.mark.parametrize("sname", list(WARPED))
def test_each_warper_removes_tokens_where_the_exact_law_looks(sname):
    """The warped cases test something: each warper (after the temperature) removes tokens of the target at some
    prefix the two-step laws visit; the combined setting (whose warpers overlap: on 6 tokens some of them remove
    nothing the others leave) removes tokens the temperature alone keeps."""
    sampling = WARPED[sname]
    case = SyntheticCase(6, (1,), sampling=sampling, seed=6)
    prefixes = [(0,)] + [(0, t) for t in range(6)]
    on = [name for name, off in WARPERS.items() if getattr(sampling, name) != off]
    offs = [WARPERS] if len(on) > 1 else [{on[0]: WARPERS[on[0]]}]
    for off in offs:
        without = replace(sampling, **off)
        assert any(not torch.equal(logits_to_probs(case.target_logits(p), sampling),
                                   logits_to_probs(case.target_logits(p), without)) for p in prefixes), on


def test_plain_decoding_law():
    case = SyntheticCase(5, (), DraftMode.DETERMINISTIC, SAMPLINGS["t1.3-topp0.8"])
    assert max_abs_error(emitted_law(case, EXACT, 3), target_law(case, 3)) < 1e-12


# ---- the implemented sampler on hand-built cases ------------------------------------------
def _logits_for(rows: list[list[float]]) -> torch.Tensor:
    return torch.log(torch.tensor(rows, dtype=torch.float64).clamp_min(1e-30))[None]


def test_greedy_walks_the_matching_branch():
    # root -> a(5) -> c(7) ; root -> b(6) -> d(8). Target argmax: root 6, b 8, d 2
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 1])
    logits = torch.full((1, 5, 10), -5.0)
    for row, tok in [(0, 6), (1, 1), (2, 8), (3, 3), (4, 2)]:
        logits[0, row, tok] = 5.0
    acc = rejection_sample([tree], logits, SamplingConfig())[0]
    assert acc.accepted_nodes == (1, 3) and acc.accepted_tokens == (6, 8)
    assert acc.next_token == 2 and acc.is_bonus
    assert acc.depth_tried == (1, 1) and acc.depth_accepted == (1, 1)


def test_greedy_walk_on_random_trees_with_repeated_siblings():
    """The greedy walk (follow_choices) against a plain reading of its rule, on random trees whose siblings may
    repeat a token (the first matching child is taken) and choices that often match: path, tokens, next token,
    bonus and the per-depth counts."""
    import random

    from specdec.rejection import follow_choices

    def reference(tree, best):
        tokens, parents, path, node = tree.tokens.tolist(), tree.parents.tolist(), [], -1
        while True:
            kids = [i for i, p in enumerate(parents) if p == node]
            match = next((c for c in kids if tokens[c] == best[node + 1]), None)
            if match is None:
                depth, tried = tree.max_depth, min(len(path) + bool(kids), tree.max_depth)
                return (tuple(path), tuple(tokens[i] for i in path), best[node + 1], not kids,
                        (1,) * tried + (0,) * (depth - tried), (1,) * len(path) + (0,) * (depth - len(path)))
            path.append(match)
            node = match

    rng = random.Random(3)
    trees = [DraftTree([rng.randrange(3) for _ in range(n)], [rng.randrange(-1, i) for i in range(n)])
             for n in [0, 1, 2, 5, 9, 17, 40] * 4]
    choices = [[rng.randrange(3) for _ in range(t.num_nodes + 1)] for t in trees]
    for tree, best, acc in zip(trees, choices, follow_choices(trees, choices), strict=True):
        assert (acc.accepted_nodes, acc.accepted_tokens, acc.next_token, acc.is_bonus, acc.depth_tried,
                acc.depth_accepted) == reference(tree, best)


def test_greedy_rejection_gives_recovered_argmax():
    tree = DraftTree.chain([4, 4])
    logits = torch.zeros(1, 3, 6)
    logits[0, 0, 3] = 9.0
    acc = rejection_sample([tree], logits, SamplingConfig())[0]
    assert len(acc.accepted_nodes) == 0 and acc.next_token == 3 and not acc.is_bonus
    assert acc.depth_tried == (1, 0) and acc.depth_accepted == (0, 0)


def test_ragged_batch_and_empty_trees():
    trees = [DraftTree.empty(), DraftTree.chain([1, 2, 3]), DraftTree([1, 2], [-1, -1])]
    logits = torch.randn(3, 4, 8)
    out = rejection_sample(trees, logits, SamplingConfig(do_sample=True), torch.Generator().manual_seed(0))
    assert len(out) == 3 and out[0].is_bonus and len(out[0].accepted_nodes) == 0
    for tree, acc in zip(trees, out, strict=True):
        assert len(acc.depth_tried) == tree.max_depth
        path = list(acc.accepted_nodes)
        assert all(int(tree.parents[b]) == a for a, b in itertools.pairwise([-1, *path]))  # a root-to-node path


def test_deterministic_candidate_with_target_mass_one_is_always_accepted():
    tree = DraftTree.chain([2])
    logits = _logits_for([[0, 0, 1, 0], [0.25] * 4])
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        acc = rejection_sample([tree], logits, SamplingConfig(do_sample=True), g)[0]
        assert acc.accepted_tokens == (2,)


def test_impossible_draft_is_never_accepted_and_never_recovered():
    # target gives token 1 zero mass: a draft of 1 must be rejected and 1 never emitted
    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0]])
    tree = DraftTree.chain([1], torch.tensor([[0.1, 0.6, 0.2, 0.1]]), DraftMode.INDEPENDENT)
    logits = _logits_for([probs[0].tolist(), [0.25] * 4])
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        acc = rejection_sample([tree], logits, SamplingConfig(do_sample=True), g)[0]
        assert len(acc.accepted_nodes) == 0 and acc.next_token in (0, 2)


def test_a_sampled_walk_that_accepts_a_leaf_tries_no_deeper_level():
    """Root children: a leaf (token 1) and a branch 2 -> 3; the target puts all its mass on token 1. Accepting the
    leaf ends the walk, so level 2 was not tried, sampled as greedy (counting the leaf's row as trying its
    children made the sampled acceptance per depth, eval's and the stats', disagree with greedy's)."""
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 1]))
    logits = torch.full((1, 4, 5), -30.0)
    logits[0, :, 1] = 30.0
    sampled = rejection_sample([tree], logits, SamplingConfig(do_sample=True), torch.Generator().manual_seed(0))[0]
    greedy = rejection_sample([tree], logits, SamplingConfig(), None)[0]
    assert sampled.accepted_nodes == greedy.accepted_nodes == (0,)
    assert sampled.depth_tried == greedy.depth_tried == (1, 0)
    assert sampled.depth_accepted == greedy.depth_accepted == (1, 0)
