"""EAGLE's rerank on the device: each pool's ``max_nodes`` candidates with the highest cumulative log-probability,
in pool order, their parents renumbered among them.

A function of tensors only, with no host read, so it runs inside the drafting call's CUDA graph, and the host reads
``max_nodes`` candidates per sequence instead of the whole pool. Ties go to the earlier candidate (a stable sort).
The kept set is closed under parents: a child's cumulative log-probability is its parent's plus a log-probability
<= 0 (a float32 sum, never above its parent's), and a parent precedes its children in the pool, so it ranks at
least as high. A candidate whose parent was left out all the same (NaN scores) gets the parent -2; the drafter
makes it a root child.

    rows = rerank(pool, max_nodes)  # [B, 4, M]: reduced token index, parent among the kept (-1: the root),
                                    # cumulative and conditional log-probability; M = min(max_nodes, S)
    fields = device_fields(rows, depth, draft_ids)  # what a pending proposal hands the verify (below)

:func:`device_fields` turns the kept candidates into the fields a pending proposal gives the engine
(specdec/pending_trees.py), on the device as well: inside the drafting's CUDA graph the host launches nothing for them.
A chain kept whole (:func:`chain_kept_whole`) has the same depths and ancestor bits whatever its scores: the caller
passes them as constants made once (specdec.pending_trees.chain_fields) and only the token mapping runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.pending_trees import tree_fields


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


def parents(rows: torch.Tensor) -> torch.Tensor:
    """[B, M] parents of the kept candidates ``rows`` [B, 4, M]: -1 (the root) or among the kept. A candidate whose
    parent was left out (-2: only with NaN scores) becomes a root child, on the host as on the device: verified like
    any node, so still exact."""
    return rows[:, 1].long().clamp(min=-1)


@dataclass(frozen=True)
class DeviceFields:
    """The trees of kept candidates as a pending proposal hands them to the verify, on the rows' device."""

    tokens: torch.Tensor  # [B, M] int64 target token ids
    depths: torch.Tensor  # [B, M] int64 depth of each node (a root child: 1)
    ancestor_bits: torch.Tensor  # [B, M] int64, bit j: node j is the node itself or an ancestor


def chain_kept_whole(chain: bool, depth: int, max_nodes: int) -> bool:
    """Whether a pool of ``depth`` levels is a chain (one candidate a level, each the previous one's child) that
    :func:`rerank` keeps whole (M == S): its node j is then the child of node j - 1 whatever the scores (NaN too),
    so its depths and ancestor bits are constants (specdec.pending_trees.chain_fields of [B, depth])."""
    return chain and depth <= max_nodes


def device_fields(rows: torch.Tensor, max_depth: int, draft_ids: torch.Tensor | None,
                  chain: tuple[torch.Tensor, torch.Tensor] | None = None) -> DeviceFields:
    """Kept candidates [B, 4, M] of trees at most ``max_depth`` deep -> their DeviceFields; ``draft_ids`` [N] maps
    a reduced token index to its target id (None: the full vocabulary). ``chain``: for a chain kept whole
    (:func:`chain_kept_whole`), its constant depths and ancestor bits ([B, M] each), taken as they are instead of
    computed from the parents."""
    tokens = rows[:, 0].long()
    if draft_ids is not None:
        tokens = draft_ids[tokens]
    if chain is None:
        return DeviceFields(tokens, *tree_fields(parents(rows), max_depth))
    if any(tuple(t.shape) != tuple(tokens.shape) for t in chain):
        raise ValueError(f"a chain's fields must be {list(tokens.shape)}, got {[list(t.shape) for t in chain]}")
    return DeviceFields(tokens, *chain)
