"""Rejection sampling over a draft tree: the one place where tokens are accepted.

The walk starts at the root with ``residual = target_probs[root]``. The children of the
current node are tried in order:

- stochastic child ``x`` drawn from ``draft_probs`` (INDEPENDENT; WITHOUT_REPLACEMENT
  renormalises away earlier siblings): accept with ``min(1, residual[x] / draft[x])``,
  else ``residual <- norm(max(0, residual - draft))``;
- deterministic candidate ``x`` (no draft_probs): accept with ``residual[x]``, else zero
  it and renormalise.

An accepted child becomes the current node with ``residual = target_probs[child]``. If all
children are rejected, the *recovered* token is drawn from the residual; at a node with no
children, the *bonus* token is drawn from ``target_probs`` there. Greedy (temperature 0)
is the limit case: target_probs are one-hot, so the child equal to the argmax is accepted.
The law lives in :class:`AcceptanceRule`, shared with the exact-law enumerator
(``specdec.eval.exact_law``) so that deliberately broken rules can be certified to fail.

    acceptances = rejection_sample(trees, target_logits, sampling, generator)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import DraftMode, DraftTree


def _normalise(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = x.sum()
    # total == 0 only on branches of probability 0 (e.g. residual == draft exactly, yet rejected)
    return x / total if total > 1e-12 else fallback


class AcceptanceRule:
    """The exact acceptance law (lossless). Subclasses in ``specdec.eval.negative_controls`` break it."""

    name = "exact"
    lossy = False

    def sibling_draft(self, draft_probs: torch.Tensor, tried: list[int], mode: DraftMode) -> torch.Tensor:
        """Distribution the next sibling was drawn from, given earlier siblings' tokens."""
        if mode is DraftMode.WITHOUT_REPLACEMENT and tried:
            excluded = draft_probs.clone()
            excluded[tried] = 0
            return _normalise(excluded, draft_probs)
        return draft_probs

    def accept_prob(self, residual: torch.Tensor, draft: torch.Tensor | None, token: int) -> float:
        if draft is None:  # deterministic candidate
            return float(residual[token])
        return min(1.0, float(residual[token] / draft[token]))

    def after_reject(self, residual: torch.Tensor, draft: torch.Tensor | None, token: int) -> torch.Tensor:
        if draft is None:
            zeroed = residual.clone()
            zeroed[token] = 0
            return _normalise(zeroed, residual)
        return _normalise((residual - draft).clamp_min(0), residual)

    def recovered_dist(self, residual: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
        return residual

    def bonus_dist(self, target_probs: torch.Tensor, draft_probs_of_node: torch.Tensor | None) -> torch.Tensor:
        return target_probs


EXACT = AcceptanceRule()


@dataclass(frozen=True)
class Acceptance:
    """What one sequence commits in one step: ``accepted_tokens + [next_token]``."""

    accepted_nodes: torch.Tensor  # [num_accepted] node indices of the accepted path, root-to-leaf
    accepted_tokens: torch.Tensor  # [num_accepted] their token ids
    next_token: int  # recovered token (a rejection ended the path) or bonus token
    is_bonus: bool
    depth_tried: torch.Tensor  # [max_depth] 1 where a child at depth d+1 was tried (parent accepted)
    depth_accepted: torch.Tensor  # [max_depth] 1 where a node at depth d+1 was accepted


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.float(), 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, dtype=torch.float64))


def _finish(tree: DraftTree, path: list[int], next_token: int, is_bonus: bool, tried_depths: int) -> Acceptance:
    max_depth = tree.max_depth
    depth_tried = torch.zeros(max_depth, dtype=torch.long)
    depth_tried[:tried_depths] = 1
    depth_accepted = torch.zeros(max_depth, dtype=torch.long)
    depth_accepted[: len(path)] = 1
    nodes = torch.tensor(path, dtype=torch.long)
    return Acceptance(nodes, tree.tokens[nodes], next_token, is_bonus, depth_tried, depth_accepted)


def _greedy_walk(tree: DraftTree, argmax: list[int]) -> Acceptance:
    """argmax[i] = target's greedy token after row i (row 0 = root, row 1 + j = node j)."""
    tokens = tree.tokens.tolist()
    path: list[int] = []
    node = -1
    while True:
        kids = tree.children[node + 1]
        want = argmax[node + 1]
        if not kids:
            return _finish(tree, path, want, True, len(path))
        match = next((c for c in kids if tokens[c] == want), None)
        if match is None:
            return _finish(tree, path, want, False, len(path) + 1)
        path.append(match)
        node = match


def _stochastic_walk(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [num_nodes + 1, vocab] float64
    rule: AcceptanceRule,
    generator: torch.Generator | None,
) -> Acceptance:
    tokens = tree.tokens.tolist()
    draft_rows = None if tree.draft_probs is None else tree.draft_probs.to(torch.float64)
    path: list[int] = []
    node = -1
    while True:
        kids = tree.children[node + 1]
        node_probs = target_probs[node + 1]
        if not kids:
            own = None if node < 0 or draft_rows is None else draft_rows[node]
            return _finish(tree, path, _draw(rule.bonus_dist(node_probs, own), generator), True, len(path))
        residual = node_probs
        tried: list[int] = []
        accepted = None
        for child in kids:
            draft = None if draft_rows is None else rule.sibling_draft(draft_rows[child], tried, tree.mode)
            tok = tokens[child]
            if _uniform(generator) < rule.accept_prob(residual, draft, tok):
                accepted = child
                break
            residual = rule.after_reject(residual, draft, tok)
            tried.append(tok)
        if accepted is None:
            recovered = _draw(rule.recovered_dist(residual, node_probs), generator)
            return _finish(tree, path, recovered, False, len(path) + 1)
        path.append(accepted)
        node = accepted


def rejection_sample(
    trees: Sequence[DraftTree],
    target_logits: torch.Tensor,  # [batch, max_nodes + 1, vocab]; row 0 = root, row 1 + i = node i
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    rule: AcceptanceRule = EXACT,
) -> list[Acceptance]:
    if target_logits.dim() != 3 or target_logits.shape[0] != len(trees):
        raise ValueError(f"target_logits must be [batch={len(trees)}, max_nodes + 1, vocab], got {tuple(target_logits.shape)}")
    if sampling.greedy and rule is EXACT:
        argmax = target_logits.argmax(-1).tolist()  # [batch, max_nodes + 1]
        return [_greedy_walk(tree, row) for tree, row in zip(trees, argmax)]
    out: list[Acceptance | None] = [None] * len(trees)
    plain = [b for b, t in enumerate(trees) if t.num_nodes == 0]
    if plain:  # empty trees: one batched draw of the bonus tokens
        probs = logits_to_probs(target_logits[plain, 0].double(), sampling)
        for b, tok in zip(plain, torch.multinomial(probs.float(), 1, generator=generator)[:, 0].tolist()):
            out[b] = _finish(trees[b], [], tok, True, 0)
    for b, tree in enumerate(trees):
        if tree.num_nodes:
            probs = logits_to_probs(target_logits[b, : tree.num_nodes + 1].double(), sampling)
            out[b] = _stochastic_walk(tree, probs, rule, generator)
    return out  # type: ignore[return-value]
