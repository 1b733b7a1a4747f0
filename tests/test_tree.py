"""DraftTree structure: depths, positions, ancestor mask, paths, pruning, validation."""
from __future__ import annotations

import random

import pytest
import torch
from specdec.drafters.base import Drafter

import specdec
from specdec.testing import build_tiny_model
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
    with pytest.raises(ValueError, match="parent is dropped"):
        t.subtree([0, 2])


@pytest.mark.parametrize("seed", range(5))
def test_subtree_keeps_the_nodes_given_with_their_probs_and_scores(seed):
    """What tree sizing keeps (ascending indices of an ancestor-closed set): every field, the tree's own paths."""
    rng = random.Random(seed)
    t = random_tree(rng, 30)
    probs = torch.rand(t.num_nodes, 5, generator=torch.Generator().manual_seed(seed))
    t = DraftTree(t.tokens, t.parents, probs / probs.sum(1, keepdim=True), DraftMode.INDEPENDENT,
                  torch.rand(t.num_nodes, generator=torch.Generator().manual_seed(seed)))
    keep = [i for i in range(t.num_nodes) if rng.random() < 0.6]
    parents = t.parents.tolist()
    keep = sorted({a for i in keep for a in _ancestors_and_self(parents, i)})
    sub = t.subtree(keep)
    assert sub.tokens.tolist() == [t.tokens[i].item() for i in keep]
    assert sub.depths.tolist() == [t.depths[i].item() for i in keep]
    assert [-1 if q < 0 else keep[q] for q in sub.parents.tolist()] == [parents[i] for i in keep]  # same edges
    assert torch.equal(sub.draft_probs, t.draft_probs[keep]) and torch.equal(sub.scores, t.scores[keep])
    mask = torch.zeros(t.num_nodes, dtype=torch.bool)
    mask[keep] = True
    pruned = t.prune(mask)
    assert torch.equal(pruned.tokens, sub.tokens) and torch.equal(pruned.parents, sub.parents)
    with pytest.raises(ValueError, match="ascending"):
        t.subtree(keep[::-1])
    with pytest.raises(ValueError, match="ascending"):
        t.subtree([0, t.num_nodes])


@pytest.mark.parametrize("seed", range(3))
def test_subtree_of_the_first_nodes_is_their_rows(seed):
    """The first k nodes (a chain's cut, a level-order tree's depth cut) are taken as rows, no gather: the same
    tree as the gather gives, every field, for every k."""
    rng = random.Random(seed)
    t = random_tree(rng, 20)
    probs = torch.rand(t.num_nodes, 5, generator=torch.Generator().manual_seed(seed))
    t = DraftTree(t.tokens, t.parents, probs / probs.sum(1, keepdim=True), DraftMode.INDEPENDENT,
                  torch.rand(t.num_nodes, generator=torch.Generator().manual_seed(seed)))
    for k in range(t.num_nodes + 1):
        sub = t.subtree(list(range(k)))
        assert sub.num_nodes == k and sub.mode is t.mode
        assert sub.tokens.tolist() == t.tokens.tolist()[:k] and sub.parents.tolist() == t.parents.tolist()[:k]
        assert torch.equal(sub.draft_probs, t.draft_probs[:k]) and torch.equal(sub.scores, t.scores[:k])
        assert sub.children == [[j for j in range(k) if t.parents[j] == i] for i in range(-1, k)]


def _ancestors_and_self(parents, i):
    while i >= 0:
        yield i
        i = parents[i]


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


class _FixedTreeDrafter(Drafter):
    """Proposes DraftTree(tokens, parents) built inside propose(), for every sequence."""

    name = "floaty"

    def __init__(self, tokens, parents) -> None:
        self.tokens, self.parents = tokens, parents

    def propose(self, seqs):
        return [DraftTree(self.tokens, self.parents) for _ in seqs]


@pytest.mark.parametrize("tokens, problem", [
    (torch.tensor([3.7]), r"a torch.float32 tensor \(node 0: 3.7"),
    (torch.tensor([3.0, 1.0]), r"a torch.float32 tensor \(node 0: 3.0\)"),
    (torch.tensor([True, False]), r"a torch.bool tensor \(node 0: True\)"),
    ([3, 2.5], r"float 2.5 at node 1"),
    ([3, True], r"bool True at node 1"),
])
def test_float_or_bool_draft_tokens_are_refused_not_truncated(tokens, problem):
    """Issue 24 #4: a drafter's float / bool token ids used to be truncated to ints (3.7 -> 3, True -> 1) and
    verified as if proposed; now generate() stops with a one-line DraftError naming the drafter."""
    parents = list(range(-1, len(tokens) - 1))
    with pytest.raises(DraftError, match=rf"^floaty: tokens must be integer ids, got {problem}") as err:
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter=_FixedTreeDrafter(tokens, parents))
    assert "\n" not in str(err.value) and "not truncated" in str(err.value)


@pytest.mark.parametrize("kwargs, problem", [
    (dict(tokens=[1, 2], parents=[-1, 0.0]), r"parents must be integer ids, got float 0.0 at node 1"),
    (dict(tokens=[[1, 2]], parents=[-1, 0]), r"tokens must be integer ids, got list \[1, 2\] at node 0"),
    (dict(tokens=torch.tensor([[1, 2]]), parents=[-1, 0]), r"tokens must be 1-D \[num_nodes\], got shape \(1, 2\)"),
    (dict(tokens=["1"], parents=[-1]), r"tokens must be integer ids, got str '1' at node 0"),
    (dict(tokens=None, parents=[]), r"tokens must be a 1-D tensor or list of integer ids, got NoneType"),
    (dict(tokens=[2**70], parents=[-1]), r"tokens: id out of the int64 range"),
    (dict(tokens=[1], parents=[-1], mode="greedy"), r"mode must be one of \['independent', "),
    (dict(tokens=[1], parents=[-1], draft_probs=[[0.5, 0.5]], mode="independent"),
     r"draft_probs must be a floating-point tensor \[num_nodes, vocab\], got <class 'list'>"),
    (dict(tokens=[1], parents=[-1], draft_probs=torch.tensor([[0, 1]]), mode="independent"),
     r"draft_probs must be a floating-point tensor \[num_nodes, vocab\], got torch.int64"),
    (dict(tokens=[1, 2], parents=[-1, 0], scores=torch.tensor([0.5, float("nan")])), r"scores must lie in \[0, 1\]"),
    (dict(tokens=[1, 2], parents=[-1, 0], scores=torch.tensor([1.5, 0.5])), r"scores must lie in \[0, 1\]"),
    (dict(tokens=[1, 2], parents=[-1, 0], scores=torch.tensor([0.5, -1e-6])), r"scores must lie in \[0, 1\]"),
    (dict(tokens=[1, 2], parents=[-1, 0], scores=torch.tensor([0.5])),
     r"scores must be a float tensor \[num_nodes=2\]"),
])
def test_malformed_inputs_raise_one_line_draft_error(kwargs, problem):
    with pytest.raises(DraftError, match=rf"^{problem}") as err:
        DraftTree(**kwargs)
    assert "\n" not in str(err.value)


def test_chain_refuses_float_tokens_too():
    with pytest.raises(DraftError, match=r"^tokens must be integer ids, got float 3.7 at node 1"):
        DraftTree.chain([1, 3.7])
    with pytest.raises(DraftError, match=r"^tokens must be integer ids, got a torch.float64 tensor"):
        DraftTree.chain(torch.tensor([3.7], dtype=torch.float64))
    assert DraftTree.chain(torch.tensor([5, 6], dtype=torch.int32)).tokens.tolist() == [5, 6]


def test_integer_ids_of_any_form_are_kept_exactly():
    import numpy as np

    for tokens in ([3, 1], (3, 1), torch.tensor([3, 1], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.uint8),
                   np.array([3, 1]), [np.int64(3), torch.tensor(1)]):
        t = DraftTree(tokens, [-1, 0])
        assert t.tokens.dtype == torch.long and t.tokens.tolist() == [3, 1]
    assert DraftTree(torch.tensor([]), []).num_nodes == 0  # an empty float tensor is the empty tree


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("vocab", [96, 49152, 152064])
def test_half_precision_rows_pass_with_a_tolerance_of_their_dtype_and_vocabulary(dtype, vocab):
    """A float16 / bfloat16 softmax over a real vocabulary sums to 1 only within ~3e-4 / ~3e-3 (a uniform float16 row
    of 152,064 tokens, all in the subnormal range, within ~4e-3): the fixed 1e-4 refused honest drafters."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=gen) * torch.tensor([[3.0], [10.0], [0.0]])  # row 2: uniform
    probs = torch.cat([torch.softmax(logits, -1).to(dtype), torch.softmax(logits.to(dtype), -1)])
    tokens = probs.float().argmax(-1)
    tree = DraftTree(tokens, [-1] * 6, probs, DraftMode.INDEPENDENT)
    tree.validate(vocab, "half")
    # renormalised in float32 at least: left in their dtype, a bfloat16 row's sum stayed ~2e-3 from 1, and the
    # exact law's TV from the target ~2e-4
    assert tree.draft_probs.dtype == torch.float32
    torch.testing.assert_close(tree.draft_probs.double().sum(-1), torch.ones(6, dtype=torch.float64), rtol=0,
                               atol=1e-6)
    with pytest.raises(DraftError, match="half: draft_probs rows must sum to 1"):  # a real error is still one
        DraftTree(tokens, [-1] * 6, probs * 1.05, DraftMode.INDEPENDENT).validate(vocab, "half")


def test_a_steps_sampled_trees_are_validated_with_one_read_of_the_device(monkeypatch):
    """The engine checks every tree's draft_probs (finite, non-negative, rows summing to 1, drafted tokens possible)
    together: one read of the device for the step, where each check of each tree was one (a host wait per check on
    a GPU). Counted here as reads of boolean results; a bad tree still raises its own message."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from specdec.tree import validate_trees

    reads = []

    class BoolReads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # item / is_nonzero: what inference mode (the engine's) dispatches for a truth value
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "item", "is_nonzero") and (
                    args[0].dtype == torch.bool):
                reads.append("item")
            return func(*args, **(kwargs or {}))

    real_tolist = torch.Tensor.tolist

    def tolist(self):
        if self.dtype == torch.bool:
            reads.append("tolist")
        return real_tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    gen = torch.Generator().manual_seed(0)
    vocab = 12

    def sampled():
        probs = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
        return DraftTree([1, 2, 3], [-1, 0, 0], probs, DraftMode.INDEPENDENT)

    trees = [sampled() for _ in range(5)] + [DraftTree.chain([4, 5])]
    with BoolReads():
        validate_trees(trees, vocab, "d")
    assert reads == ["tolist"]
    reads.clear()
    with torch.inference_mode(), BoolReads():  # as the engine validates
        validate_trees(trees, vocab, "d")
    assert reads == ["tolist"]
    assert all(torch.allclose(t.draft_probs.sum(-1).double(), torch.ones(3, dtype=torch.float64)) for t in trees[:5])
    reads.clear()
    with BoolReads():
        for tree in trees:
            tree.validate(vocab, "d")
    assert len(reads) == 5  # one per sampled tree when validated one by one
    bad = sampled()
    bad.draft_probs[1, 3] = -0.5
    with pytest.raises(DraftError, match="d: draft_probs has negative entries \\(rows of nodes \\[1\\]\\)"):
        validate_trees(trees[:2] + [bad], vocab, "d")
