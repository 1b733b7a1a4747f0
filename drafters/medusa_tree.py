"""Medusa tree construction: static trees from ``medusa_choices`` and best-first dynamic trees.

A Medusa *path* is a tuple of top-k ranks, one per depth: ``(2, 0)`` is the best token of
head 1 under the third-best token of head 0 (the ``medusa_choices`` convention of
FasterDecoding/Medusa). A static tree is a list of paths closed under prefixes; a dynamic
tree is grown per step from the heads' own log-probabilities.

    paths = validate_choices([[0], [1], [0, 0]], num_heads=3)    # sorted by (depth, path)
    tree = static_tree(paths, top_tokens)                        # top_tokens[depth][rank] -> token id
    tree = dynamic_tree(top_tokens, top_logp, max_nodes=16)      # the 16 most probable paths
    paths = default_choices(num_heads=3, max_nodes=16, top_k=8)  # a static tree without a checkpoint's
"""
from __future__ import annotations

import heapq
import math
import operator
from collections.abc import Sequence

from specdec.errors import InputError
from specdec.tree import MAX_TREE_NODES, DraftTree

# Prior of the default static tree: P(head d's rank-r token is right) ~ HEAD_ACCURACY[d] * RANK_DECAY**r.
# Roughly the shape of trained Medusa heads' top-k accuracies (the deeper, the worse; top-1 dominates).
HEAD_ACCURACY = (0.6, 0.4, 0.3, 0.25, 0.2)
RANK_DECAY = 0.35


def check_paths(choices, allow_repeats: bool = False) -> tuple[tuple[int, ...], ...]:
    """Sorted by (depth, path): what can be checked without the heads (ranks, prefixes, size). ``allow_repeats``: a
    path listed twice counts once (a checkpoint's saved list); else it is refused (a given list: a typo)."""
    if isinstance(choices, (str, bytes)):
        raise InputError(f"medusa_choices must be a list of top-k paths such as [[0], [1], [0, 0]], got {choices!r}")
    try:
        listed = [tuple(_rank(k) for k in p) for p in choices]
    except TypeError as err:
        raise InputError(f"medusa_choices must be a list of lists of integer ranks, got {choices!r}") from err
    if not listed:
        raise InputError("medusa_choices is empty")
    paths = sorted(set(listed), key=lambda p: (len(p), p))
    if len(paths) < len(listed) and not allow_repeats:
        twice = next(p for i, p in enumerate(listed) if p in listed[:i])
        raise InputError(f"medusa_choices lists path {list(twice)} more than once")
    if len(paths) > MAX_TREE_NODES:
        raise InputError(f"medusa_choices has {len(paths)} paths; a tree holds at most {MAX_TREE_NODES} nodes")
    known = set()
    for p in paths:
        if not p or min(p) < 0:
            raise InputError(f"medusa_choices path {list(p)} must be a non-empty list of ranks >= 0")
        if len(p) > 1 and p[:-1] not in known:
            raise InputError(f"medusa_choices path {list(p)} lacks its prefix {list(p[:-1])}")
        known.add(p)
    return tuple(paths)


def check_ranks(paths: Sequence[Sequence[int]], draft_size: int, reduced: bool) -> None:
    """Refuse a rank the heads cannot score: ``draft_size`` tokens per head (``reduced``: a draft vocabulary)."""
    worst = max((max(p) for p in paths if p), default=-1)
    if worst >= draft_size:
        what = "draft vocabulary" if reduced else "vocabulary"
        raise InputError(f"medusa_choices use rank {worst}, but the {what} has {draft_size} tokens")


def _rank(k) -> int:  # an int, not a bool, float (0.5 was taken as rank 0) or text ("1" was taken as rank 1)
    if isinstance(k, bool):
        raise TypeError("a bool")
    return operator.index(k)


def validate_choices(choices: Sequence[Sequence[int]], num_heads: int) -> tuple[tuple[int, ...], ...]:
    """:func:`check_paths` (a repeated path counts once), and no path deeper than the ``num_heads`` heads."""
    paths = check_paths(choices, allow_repeats=True)
    for p in paths:
        if len(p) > num_heads:
            raise InputError(f"medusa_choices path {list(p)} is deeper than the {num_heads} Medusa heads")
    return paths


def static_tree(paths: Sequence[tuple[int, ...]], top_tokens: Sequence[Sequence[int]]) -> DraftTree:
    """paths: validated (sorted, prefix-closed); top_tokens[d][r]: rank-r token of head d."""
    index: dict[tuple[int, ...], int] = {}
    tokens, parents = [], []
    for p in paths:
        index[p] = len(tokens)
        tokens.append(top_tokens[len(p) - 1][p[-1]])
        parents.append(index[p[:-1]] if len(p) > 1 else -1)
    return DraftTree(tokens, parents)


def best_paths(logp: Sequence[Sequence[float]], max_nodes: int) -> list[tuple[tuple[int, ...], int]]:
    """The ``max_nodes`` most probable paths, best first, as (path, parent node index).

    ``logp[d][r]`` is the log-probability of rank r at depth d (non-increasing in r). The
    score of a path is the sum over its depths, so a path never outscores its prefix and
    popping in score order yields a prefix-closed set (parents come before children)."""
    out: list[tuple[tuple[int, ...], int]] = []
    heap = [(-logp[0][r], (r,), -1) for r in range(len(logp[0]))]
    heapq.heapify(heap)
    while heap and len(out) < max_nodes:
        neg, path, parent = heapq.heappop(heap)
        node = len(out)
        out.append((path, parent))
        depth = len(path)
        if depth < len(logp):
            for r in range(len(logp[depth])):
                heapq.heappush(heap, (neg - logp[depth][r], path + (r,), node))
    return out


def dynamic_tree(top_tokens: Sequence[Sequence[int]], top_logp: Sequence[Sequence[float]], max_nodes: int) -> DraftTree:
    """Per-step tree: the max_nodes paths with the highest joint head probability."""
    chosen = best_paths(top_logp, max_nodes)
    tokens = [top_tokens[len(p) - 1][p[-1]] for p, _ in chosen]
    return DraftTree(tokens, [parent for _, parent in chosen])


def default_choices(num_heads: int, max_nodes: int, top_k: int) -> tuple[tuple[int, ...], ...]:
    """A static tree for heads without saved choices: the best paths under the fixed prior above."""
    logp = [
        [math.log(HEAD_ACCURACY[min(d, len(HEAD_ACCURACY) - 1)]) + r * math.log(RANK_DECAY) for r in range(top_k)]
        for d in range(num_heads)
    ]
    paths = [p for p, _ in best_paths(logp, max_nodes)]
    return tuple(sorted(paths, key=lambda p: (len(p), p)))
