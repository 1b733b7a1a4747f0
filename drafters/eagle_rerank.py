"""EAGLE's rerank on the device: each pool's ``max_nodes`` candidates with the highest cumulative log-probability,
in pool order, their parents renumbered among them.

A function of tensors only, with no host read, so it runs inside the drafting call's CUDA graph, and the host reads
``max_nodes`` candidates per sequence instead of the whole pool (it used to sort every pool in Python). Ties go to
the earlier candidate (a stable sort). The kept set is closed under parents: a child's cumulative log-probability
is its parent's plus a log-probability <= 0 (a float32 sum, never above its parent's), and a parent precedes its
children in the pool, so it ranks at least as high. A candidate whose parent was left out all the same (NaN
scores) gets the parent -2; the drafter makes it a root child.

    rows = rerank(pool, max_nodes)  # [B, 4, M]: reduced token index, parent among the kept (-1: the root),
                                    # cumulative and conditional log-probability; M = min(max_nodes, S)
"""
from __future__ import annotations

import torch


def rerank(pool: torch.Tensor, max_nodes: int) -> torch.Tensor:
    """[B, 4, S] candidate pools (drafters/eagle_grow.py) -> [B, 4, M] the kept candidates (module doc)."""
    B, _, S = pool.shape
    M = min(max_nodes, S)
    if M == S:  # every candidate kept, in pool order, parents as they are (a chain's pool, most often): no launch
        return pool
    tok, parent, cum, cond = pool.unbind(1)
    best = torch.sort(-cum, dim=1, stable=True).indices[:, :M]
    kept = torch.sort(best, dim=1).values  # [B, M] in pool order: parents before children
    # a pool index's place among the kept (-2: not kept); column S stands for the root
    place = torch.full((B, S + 1), -2.0, dtype=pool.dtype, device=pool.device)
    place[:, S] = -1.0
    place.scatter_(1, kept, torch.arange(M, dtype=pool.dtype, device=pool.device).expand(B, M))
    parents = parent.gather(1, kept).long()
    parents = place.gather(1, torch.where(parents < 0, S, parents))
    return torch.stack([tok.gather(1, kept), parents, cum.gather(1, kept), cond.gather(1, kept)], dim=1)
