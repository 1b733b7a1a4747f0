"""Exact (float64) law of the first emitted token when something chooses or prunes a sampled draft.

Rejection sampling is exact for any tree a drafter proposes, but not for a tree that was *chosen* by what it
drew: a combined drafter picking a sampled child by its scores, or a sizer cutting a tree by a shape that depends
on its tokens. ``first_token_law`` enumerates the token ``x ~ draft_probs`` drawn at the sampled root child,
asks ``verified(x)`` which tree is then verified (the real selection code, run on that draw), and sums the
first token's law under exact acceptance; it equals ``target_probs`` iff the selection is exact. The two
selections of the certificate (:func:`selection_cases`) are the tree sizer on a drafter whose tree grows when it
draws token 0, and the combined drafter choosing between a sampled chain and a deterministic one.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.tree import DraftMode, DraftTree


def _conditional_law(target_probs: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """Law of the first emitted token given the verified ``tree`` (its drawn tokens fixed): only the root's
    children matter. A sampled root child is accepted with min(1, target/draft), else the residual is sampled;
    deterministic candidates are accepted with their residual probability in turn."""
    roots = [i for i, p in enumerate(tree.parents.tolist()) if p < 0]
    residual = target_probs.clone()
    out = torch.zeros_like(target_probs)
    weight = 1.0
    for i in roots:
        x = int(tree.tokens[i])
        if tree.mode is DraftMode.DETERMINISTIC:
            a = float(residual[x] / residual.sum())
            after = residual.clone()
            after[x] = 0.0
        else:
            if len(roots) > 1:
                raise ValueError("first_token_law handles one sampled root child")
            draft = tree.draft_probs[i].to(torch.float64)
            a = min(1.0, float(residual[x] / draft[x])) if draft[x] > 0 else 0.0
            after = (residual - draft).clamp(min=0.0)
        out[x] += weight * a
        weight *= 1.0 - a
        residual = after
    if weight > 0:
        out += weight * residual / residual.sum()
    return out


def first_token_law(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                    verified: Callable[[int], DraftTree]) -> torch.Tensor:
    """Exact law of the first emitted token: ``x ~ draft_probs`` is drawn at the sampled root child and
    ``verified(x)`` is the tree the engine then verifies (after any choice or pruning)."""
    target = target_probs.to(torch.float64)
    law = torch.zeros_like(target)
    for x, qx in enumerate(draft_probs.to(torch.float64).tolist()):
        if qx > 0:
            law += qx * _conditional_law(target, verified(x))
    return law


@dataclass(frozen=True)
class SelectionCase:
    """A selection of sampled trees whose exactness is checked: ``verified(x)`` runs the selection code once."""

    name: str
    target_probs: torch.Tensor  # [V]
    draft_probs: torch.Tensor  # [V]
    verified: Callable[[int], DraftTree]

    def max_error(self) -> float:
        law = first_token_law(self.target_probs, self.draft_probs, self.verified)
        return float((law - self.target_probs.to(torch.float64)).abs().max())


TARGET = torch.tensor([0.145, 0.573, 0.121, 0.161], dtype=torch.float64)
DRAFT = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)


def token_shaped_tree(x: int, draft_probs: torch.Tensor = DRAFT, children: int = 6) -> DraftTree:
    """A sampled root child ``x``; when it drew token 0 it gets ``children`` sampled children (their tokens do
    not matter for the first token's law)."""
    n = 1 + (children if x == 0 else 0)
    return DraftTree([x] + [0] * (n - 1), [-1] + [0] * (n - 1), draft_probs.expand(n, -1),
                     DraftMode.INDEPENDENT)


def sizer_case(sizer_cls=None) -> SelectionCase:
    """The tree sizer on :func:`token_shaped_tree` under a cost curve where seven nodes pay and one does not.
    The sizer has seen the seven-node shape in an earlier step (the case where a cut is possible at all)."""
    from specdec.cost_model import CostModel
    from specdec.tree_sizing import TreeSizer

    costs = CostModel({}, {1: {1: 1.0, 2: 2.0, 8: 1.2, 65: 60.0}})
    sizer_cls = sizer_cls or TreeSizer

    def verified(x: int) -> DraftTree:
        sizer = sizer_cls(costs)
        sizer.last_shape = token_shaped_tree(0).parents.tolist()
        return sizer.size(0, token_shaped_tree(x), batch=1)

    return SelectionCase("tree sizing of a token-shaped sampled tree", TARGET, DRAFT, verified)


def combined_case(combined_cls=None) -> SelectionCase:
    """The combined drafter choosing between a sampled one-token chain scored by its draft probability and a
    deterministic chain [0] scored 0.5."""
    from specdec.drafters.combined import CombinedDrafter

    combined_cls = combined_cls or CombinedDrafter

    class Fixed:
        name = "fixed"

        def __init__(self, tree: DraftTree) -> None:
            self.tree = tree

        def propose(self, seqs):
            return [self.tree for _ in seqs]

    def verified(x: int) -> DraftTree:
        sampled = DraftTree([x], [-1], DRAFT[None], DraftMode.INDEPENDENT,
                            scores=torch.tensor([float(DRAFT[x])]))
        greedy = DraftTree([0], [-1], scores=torch.tensor([0.5]))
        combined = combined_cls([Fixed(sampled), Fixed(greedy)], mode="best", gate=False)
        return combined._combine([sampled, greedy])

    return SelectionCase("combined drafter choosing a sampled child", TARGET, DRAFT, verified)


def selection_cases(controls: bool = False) -> dict[str, SelectionCase]:
    """The real selections, or (``controls``) the broken ones of :mod:`specdec.eval.negative_controls`."""
    if not controls:
        return {"exact": sizer_case(), "exact-combined": combined_case()}
    from specdec.eval.negative_controls import ScoreChoosingCombined, ShapeAwareSizer

    return {"shape_aware_sizer": sizer_case(ShapeAwareSizer),
            "score_choosing_combined": combined_case(ScoreChoosingCombined)}
