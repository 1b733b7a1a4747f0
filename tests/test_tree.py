"""DraftTree structure: depths, positions, ancestor mask, paths, pruning, validation."""
from __future__ import annotations

import random

import pytest
import torch

from specdec.tree import DraftError, DraftMode, DraftTree


def random_tree(rng: random.Random, n: int) -> DraftTree:
    parents = [rng.randint(-1, i - 1) for i in range(n)]
    return DraftTree([rng.randint(0, 9) for _ in range(n)], parents)


def test_chain_is_a_tree_with_parent_i_minus_1():
    t = DraftTree.chain([5, 6, 7])
    assert t.parents.tolist() == [-1, 0, 1]
    assert t.depths.tolist() == [1, 2, 3]
    assert t.position_ids(10).tolist() == [11, 12, 13]
    assert t.ancestor_mask.equal(torch.ones(3, 3, dtype=torch.bool).tril())
    assert t.paths() == [[0, 1, 2]] and t.mode is DraftMode.DETERMINISTIC


@pytest.mark.parametrize("seed", range(20))
def test_ancestor_mask_matches_parent_walk(seed):
    rng = random.Random(seed)
    t = random_tree(rng, rng.randint(1, 64))
    for i in range(t.num_nodes):
        anc, j = {i}, i
        while (j := int(t.parents[j])) >= 0:
            anc.add(j)
        assert set(t.ancestor_mask[i].nonzero().flatten().tolist()) == anc
        assert int(t.depths[i]) == len(anc)
        bits = int(t.ancestor_bits()[i])
        assert {k for k in range(t.num_nodes) if bits >> k & 1} == anc
    leaves = [p[-1] for p in t.paths()]
    assert sorted(leaves) == [i for i in range(t.num_nodes) if i not in set(t.parents.tolist())]


@pytest.mark.parametrize("seed", range(10))
def test_prune_by_depth_keeps_structure(seed):
    rng = random.Random(seed)
    t = random_tree(rng, 30)
    keep = t.depths <= 2
    p = t.prune(keep)
    assert p.num_nodes == int(keep.sum())
    assert p.tokens.tolist() == t.tokens[keep].tolist()
    assert p.depths.tolist() == t.depths[keep].tolist()


def test_prune_refuses_orphans():
    t = DraftTree.chain([1, 2, 3])
    with pytest.raises(ValueError):
        t.prune(torch.tensor([False, True, True]))


def test_validation_errors():
    with pytest.raises(DraftError, match="parent"):
        DraftTree([1, 2, 3], [-1, 2, 0])  # parent after child
    with pytest.raises(DraftError, match="parent"):
        DraftTree([1], [-2])
    with pytest.raises(DraftError, match="nodes"):
        DraftTree([1, 2], [-1])
    with pytest.raises(DraftError, match="no draft_probs"):
        DraftTree([1], [-1], torch.ones(1, 4) / 4, DraftMode.DETERMINISTIC)
    t = DraftTree.chain([3, 1], torch.tensor([[0.5, 0.5, 0, 0], [0.25, 0.25, 0.25, 0.25]]))
    with pytest.raises(DraftError, match="probability 0"):
        t.validate(4, "d")


def test_duplicate_siblings_without_replacement_are_refused():
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]] * 3)
    t = DraftTree([1, 0, 1], [-1, -1, -1], probs, DraftMode.WITHOUT_REPLACEMENT)
    with pytest.raises(DraftError, match=r"d: nodes 0 and 2 .*token 1.*without replacement"):
        t.validate(4, "d")
    DraftTree([1, 0, 1], [-1, -1, 0], probs, DraftMode.WITHOUT_REPLACEMENT).validate(4, "d")  # cousins may repeat
    DraftTree([1, 0, 1], [-1, -1, -1], probs, DraftMode.INDEPENDENT).validate(4, "d")  # i.i.d. siblings may repeat


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-15)])
def test_validate_renormalises_rows_within_tolerance(mode, dtype, tol):
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.125, 0.125, 0.25, 0.5]], dtype=torch.float64)
    off = (probs * torch.tensor([[1 + 9e-5], [1 - 9e-5]], dtype=torch.float64)).to(dtype)  # accepted: atol 1e-4
    t = DraftTree.chain([0, 1], off, mode)
    t.validate(4, "d")
    assert t.draft_probs.dtype == dtype
    assert (t.draft_probs.double().sum(-1) - 1).abs().max() < tol  # the rule sees distributions
    torch.testing.assert_close(t.draft_probs.double(), probs, atol=tol, rtol=0)
