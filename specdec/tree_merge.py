"""Merging draft trees: the union of several drafters' proposals for one sequence, as one trie.

Every root-to-node path of every input tree is a path of the merged tree; identical tokens under the same
parent become one node (shared prefixes share nodes). Only DETERMINISTIC trees can be merged: a node of an
INDEPENDENT / WITHOUT_REPLACEMENT tree carries the distribution it was *sampled* from, and a node two
drafters both proposed (or a sibling set mixing both drafters' draws) was drawn from no single distribution,
so the exact acceptance rule has nothing to test it against. :func:`merge_trees` refuses those.

Each merged node keeps an acceptance estimate (``DraftTree.scores``): the input tree's own score where it has
one, else that tree's ``default_scores`` entry; a node proposed by several trees keeps the highest estimate.
When the union has more than ``max_nodes`` nodes, the nodes with the highest *path score* (product of the
scores from the root down to the node) are kept; the kept set is ancestor-closed, since a path score never
exceeds its parent's.

    merged = merge_trees([ngram_tree, medusa_tree], default_scores=[0.6, 0.4], max_nodes=64)
    expected_committed_tokens(merged)  # 1 + sum of path scores: committed tokens per step if verified
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.tree import MAX_TREE_NODES, DraftError, DraftMode, DraftTree


def node_scores(tree: DraftTree, default: float) -> list[float]:
    """Per-node acceptance estimates [num_nodes]: the tree's own scores, or ``default`` for every node."""
    if tree.scores is not None:
        return [float(s) for s in tree.scores.tolist()]
    return [float(default)] * tree.num_nodes


def path_scores(tree: DraftTree, default: float = 0.5) -> list[float]:
    """Estimated probability that each node is accepted [num_nodes]: product of node scores along its path."""
    scores = node_scores(tree, default)
    out: list[float] = []
    for i, p in enumerate(tree.parents.tolist()):
        out.append(scores[i] * (1.0 if p < 0 else out[p]))
    return out


def expected_committed_tokens(tree: DraftTree, default: float = 0.5) -> float:
    """Expected tokens one verify of ``tree`` commits: 1 (recovered / bonus) + sum over nodes of P(accepted)."""
    return 1.0 + sum(path_scores(tree, default))


def merge_trees(trees: Sequence[DraftTree], default_scores: Sequence[float] | float = 0.5,
                max_nodes: int = MAX_TREE_NODES) -> DraftTree:
    """The trie union of DETERMINISTIC ``trees`` (host tensors), at most ``max_nodes`` nodes, with scores.

    ``default_scores``: one value per tree (or one for all) used where a tree has no scores. Raises DraftError
    for a tree with draft_probs (INDEPENDENT / WITHOUT_REPLACEMENT): such trees cannot be merged exactly.
    """
    if not 0 <= max_nodes <= MAX_TREE_NODES:
        raise ValueError(f"merge_trees: max_nodes must be in [0, {MAX_TREE_NODES}], got {max_nodes}")
    defaults = [float(default_scores)] * len(trees) if isinstance(default_scores, (int, float)) \
        else [float(d) for d in default_scores]
    if len(defaults) != len(trees):
        raise ValueError(f"merge_trees: {len(trees)} trees but {len(defaults)} default scores")
    defaults = [min(max(d, 0.0), 1.0) for d in defaults]  # acceptance estimates; ranked paths must not grow deeper
    for k, tree in enumerate(trees):
        if tree.mode is not DraftMode.DETERMINISTIC or tree.draft_probs is not None:
            raise DraftError(f"tree {k} is {tree.mode.value} (it carries draft_probs): only deterministic trees "
                             "can be merged exactly; pick one tree instead")
    index: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    for tree, default in zip(trees, defaults, strict=True):
        own = node_scores(tree, default)
        to_merged: list[int] = []  # this tree's node -> merged node; parents come first (parents[i] < i)
        for i, (tok, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
            key = (-1 if p < 0 else to_merged[p], int(tok))
            j = index.get(key)
            if j is None:
                j = index[key] = len(tokens)
                tokens.append(key[1])
                parents.append(key[0])
                scores.append(own[i])
            else:
                scores[j] = max(scores[j], own[i])
            to_merged.append(j)
    keep = _top_paths(parents, scores, max_nodes)
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree(
        torch.tensor([tokens[i] for i in keep], dtype=torch.long),
        torch.tensor([-1 if parents[i] < 0 else new_index[parents[i]] for i in keep], dtype=torch.long),
        scores=torch.tensor([scores[i] for i in keep], dtype=torch.float32),
    )


def _top_paths(parents: list[int], scores: list[float], max_nodes: int) -> list[int]:
    """Indices (increasing, so still topological) of the ``max_nodes`` nodes with the highest path score,
    ancestor-closed: ties go to the shallower node, then the earlier one, so a parent always ranks first."""
    n = len(parents)
    if n <= max_nodes:
        return list(range(n))
    path: list[float] = []
    depth: list[int] = []
    for i, p in enumerate(parents):
        path.append(scores[i] * (1.0 if p < 0 else path[p]))
        depth.append(1 if p < 0 else depth[p] + 1)
    kept: set[int] = set()
    for i in sorted(range(n), key=lambda i: (-path[i], depth[i], i)):
        if len(kept) == max_nodes:
            break
        if parents[i] < 0 or parents[i] in kept:  # always true by the ordering; kept as a guarantee
            kept.add(i)
    return sorted(kept)
