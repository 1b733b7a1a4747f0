"""Choose a static ``medusa_choices`` tree from measured per-head rank accuracies.

``rank_acc[d][k]`` = P(head ``d``'s rank-``k`` token is the target's token). A path
``(k0, k1, ...)`` is accepted with estimated probability ``prod_d rank_acc[d][k_d]``; the tree
keeps the ``budget`` paths of highest estimate, grown greedily (a node is only added after its
parent, so every prefix is present).

    choices, est_tau = choose_tree(rank_acc, budget=64)
"""
from __future__ import annotations

import heapq


def choose_tree(rank_acc: list[list[float]], budget: int) -> tuple[list[tuple[int, ...]], float]:
    """Returns (paths sorted by depth then ranks, estimated tau = 1 + sum of path probabilities)."""
    if budget < 1:
        raise ValueError(f"tree budget must be >= 1, got {budget}")
    if not rank_acc or not rank_acc[0]:
        raise ValueError("rank accuracies are empty")
    heap = [(-rank_acc[0][k], (k,)) for k in range(len(rank_acc[0])) if rank_acc[0][k] > 0]
    heapq.heapify(heap)
    chosen: list[tuple[tuple[int, ...], float]] = []
    while heap and len(chosen) < budget:
        neg, path = heapq.heappop(heap)
        chosen.append((path, -neg))
        depth = len(path)
        if depth < len(rank_acc):
            for k, a in enumerate(rank_acc[depth]):
                if a > 0:
                    heapq.heappush(heap, (neg * a, path + (k,)))
    if not chosen:  # heads never right: a single best-guess node
        chosen = [((0,), 0.0)]
    paths = sorted((p for p, _ in chosen), key=lambda p: (len(p), p))
    return paths, 1.0 + sum(prob for _, prob in chosen)
