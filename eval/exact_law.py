"""Exact (float64) law of the tokens the acceptance procedure emits, on tiny synthetic cases.

A :class:`SyntheticCase` is a tiny vocabulary, a target and a drafter given as functions
of the token prefix (random logits keyed by the prefix, then the sampling transform), a
tree shape (children per node at each depth) and a draft mode. :func:`emitted_law`
enumerates every draft outcome and every accept / reject branch of an
:class:`~specdec.rejection.AcceptanceRule`, steps after steps, and returns the exact
distribution of the first ``length`` emitted tokens; :func:`target_law` is what it must
equal. Used by the tests and by the losslessness certificate:

    case = SyntheticCase(vocab_size=5, widths=(2, 2), mode=DraftMode.INDEPENDENT)
    err = max_abs_error(emitted_law(case, EXACT, 2), target_law(case, 2))   # ~1e-16
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from functools import cache, lru_cache

import torch

from specdec.rejection import AcceptanceRule
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import DraftMode

Law = dict[tuple[int, ...], float]


@dataclass(frozen=True)
class SyntheticCase:
    vocab_size: int
    widths: tuple[int, ...]  # children per node at depth 1, 2, ...; () = plain decoding
    mode: DraftMode = DraftMode.INDEPENDENT
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(do_sample=True))
    seed: int = 0
    prefix: tuple[int, ...] = (0,)
    target_sharpness: float = 2.0
    draft_sharpness: float = 2.0
    prefix_independent: bool = False  # same target / draft distribution after every prefix

    def __post_init__(self) -> None:
        if self.mode is DraftMode.DETERMINISTIC and any(w > self.vocab_size for w in self.widths):
            raise ValueError("deterministic candidates are distinct: width <= vocab_size")

    def _logits(self, prefix: tuple[int, ...], salt: int, sharpness: float) -> torch.Tensor:
        key = hash(()) if self.prefix_independent else hash(prefix)  # tuple-of-int hashes are stable
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + salt * 7919 + key) % (2**62))
        return torch.randn(self.vocab_size, generator=g, dtype=torch.float64) * sharpness

    def target_logits(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        return self._logits(prefix, 1, self.target_sharpness)

    def draft_logits(self, prefix: tuple[int, ...]) -> torch.Tensor:  # [vocab]
        return self._logits(prefix, 2, self.draft_sharpness)

    def target_probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        return logits_to_probs(self.target_logits(prefix), self.sampling)

    def draft_probs(self, prefix: tuple[int, ...]) -> torch.Tensor:
        # the drafter samples with the same sampling transform; when decoding greedily
        # it still proposes from its softened distribution (a stochastic drafter under greedy)
        sampling = self.sampling if self.sampling.do_sample else SamplingConfig(do_sample=True)
        return logits_to_probs(self.draft_logits(prefix), sampling)

    def candidates(self, prefix: tuple[int, ...], width: int) -> list[int]:
        """Deterministic candidates: the drafter's top-`width` tokens."""
        return torch.topk(self.draft_logits(prefix), width).indices.tolist()


def true_sibling_draw(draft_probs: torch.Tensor, tried: list[int], mode: DraftMode) -> torch.Tensor | None:
    """How the drafter really drew the next sibling (independent of any acceptance rule);
    None when drawing without replacement has exhausted the draft's support (fewer children)."""
    if mode is DraftMode.WITHOUT_REPLACEMENT and tried:
        rest = draft_probs.clone()
        rest[tried] = 0
        return rest / rest.sum() if rest.sum() > 0 else None
    return draft_probs


def _branch(rule: AcceptanceRule, residual, draft, token: int, deterministic: bool) -> tuple[float, torch.Tensor]:
    """(accept probability, residual after a rejection) of one candidate, via the batched rule."""
    tok, det = torch.tensor([token]), torch.tensor([deterministic])
    a = float(rule.accept_prob(residual[None], draft[None], tok, det)[0])
    return a, rule.after_reject(residual[None], draft[None], tok, det)[0]


def step_law(case: SyntheticCase, rule: AcceptanceRule) -> "callable":
    """Returns law(prefix) of one step's emitted tokens (accepted + recovered/bonus)."""

    @cache
    def node_law(prefix: tuple[int, ...], level: int, own_draft_key: tuple[int, ...] | None) -> Law:
        target = case.target_probs(prefix)
        width = case.widths[level] if level < len(case.widths) else 0
        out: Law = defaultdict(float)
        if width == 0:
            has_own = own_draft_key is not None and case.mode is not DraftMode.DETERMINISTIC
            own = case.draft_probs(own_draft_key) if has_own else torch.zeros_like(target)
            bonus = rule.bonus_dist(target[None], own[None], torch.tensor([has_own]))[0]
            for x, p in enumerate(bonus.tolist()):
                if p > 0:
                    out[(x,)] += p
            return out

        def accept_into(x: int, weight: float) -> None:
            for tail, p in node_law(prefix + (x,), level + 1, prefix).items():
                out[(x,) + tail] += weight * p

        def siblings(k: int, residual: torch.Tensor, tried: list[int], weight: float) -> None:
            if weight == 0.0:
                return
            draft = None if case.mode is DraftMode.DETERMINISTIC else case.draft_probs(prefix)
            drawn_from = None if draft is None else true_sibling_draw(draft, tried, case.mode)
            if k == width or (draft is not None and drawn_from is None):
                for x, p in enumerate(rule.recovered_dist(residual[None], target[None])[0].tolist()):
                    if p > 0:
                        out[(x,)] += weight * p
                return
            if case.mode is DraftMode.DETERMINISTIC:
                x = case.candidates(prefix, width)[k]
                a, after = _branch(rule, residual, torch.zeros_like(residual), x, True)
                accept_into(x, weight * a)
                siblings(k + 1, after, tried + [x], weight * (1 - a))
                return
            tried_mask = torch.zeros(case.vocab_size, dtype=torch.bool)
            tried_mask[tried] = True
            wr = torch.tensor([case.mode is DraftMode.WITHOUT_REPLACEMENT])
            believed = rule.sibling_draft(draft[None], tried_mask[None], wr)[0]
            for x, px in enumerate(drawn_from.tolist()):
                if px <= 0:
                    continue
                a, after = _branch(rule, residual, believed, x, False)
                accept_into(x, weight * px * a)
                siblings(k + 1, after, tried + [x], weight * px * (1 - a))

        siblings(0, target, [], 1.0)
        return out

    return lambda prefix: node_law(prefix, 0, None)


def emitted_law(case: SyntheticCase, rule: AcceptanceRule, length: int) -> Law:
    """Exact law of the first `length` emitted tokens, running as many steps as needed."""
    one_step = step_law(case, rule)

    @cache
    def law(prefix: tuple[int, ...], remaining: int) -> Law:
        out: Law = defaultdict(float)
        for emitted, p in one_step(prefix).items():
            if len(emitted) >= remaining:
                out[emitted[:remaining]] += p
            else:
                for tail, q in law(prefix + emitted, remaining - len(emitted)).items():
                    out[emitted + tail] += p * q
        return dict(out)

    return law(case.prefix, length)


def target_law(case: SyntheticCase, length: int) -> Law:
    """The target's own autoregressive law of the next `length` tokens."""
    out: Law = {(): 1.0}
    for _ in range(length):
        nxt: Law = defaultdict(float)
        for seq, p in out.items():
            for x, q in enumerate(case.target_probs(case.prefix + seq).tolist()):
                if q > 0:
                    nxt[seq + (x,)] += p * q
        out = nxt
    return dict(out)


def sample_trees(case: SyntheticCase, n: int, generator: torch.Generator) -> tuple[list, torch.Tensor]:
    """Draw `n` draft trees from the case's drafter, as a real drafter would, plus the target
    logits the verifier would return for them: ([DraftTree], [n, num_nodes + 1, vocab])."""
    from specdec.tree import DraftTree

    parents: list[int] = []
    frontier = [-1]
    for width in case.widths:  # breadth-first layout, identical for every tree
        nxt = []
        for p in frontier:
            for _ in range(width):
                parents.append(p)
                nxt.append(len(parents) - 1)
        frontier = nxt
    num = len(parents)
    paths = [[case.prefix] * n]  # paths[j + 1][i] = token prefix at node j of tree i
    tokens = torch.zeros(n, num, dtype=torch.long)
    draft_cache = lru_cache(maxsize=None)(case.draft_probs)
    for j, p in enumerate(parents):
        first_sibling = j == 0 or parents[j - 1] != p
        if first_sibling:  # draw all children of p at once, grouped by p's prefix
            width = parents.count(p)
            groups: dict[tuple, list[int]] = defaultdict(list)
            for i, pre in enumerate(paths[p + 1]):
                groups[pre].append(i)
            for pre, members in groups.items():
                if case.mode is DraftMode.DETERMINISTIC:
                    draws = torch.tensor(case.candidates(pre, width)).expand(len(members), width)
                else:
                    probs = draft_cache(pre).float().expand(len(members), -1)
                    draws = torch.multinomial(probs, width, replacement=case.mode is DraftMode.INDEPENDENT,
                                              generator=generator)
                tokens[members, j : j + width] = draws
        paths.append([pre + (int(tokens[i, j]),) for i, pre in enumerate(paths[p + 1])])
    logit_cache = lru_cache(maxsize=None)(case.target_logits)
    logits = torch.stack([torch.stack([logit_cache(paths[k][i]) for k in range(num + 1)]) for i in range(n)])
    trees = []
    for i in range(n):
        probs = None
        if case.mode is not DraftMode.DETERMINISTIC and num:
            probs = torch.stack([draft_cache(paths[p + 1][i]) for p in parents])
        trees.append(DraftTree(tokens[i], parents, probs, case.mode if num else DraftMode.DETERMINISTIC))
    return trees, logits


def max_abs_error(law: Law, reference: Law) -> float:
    keys = set(law) | set(reference)
    return max(abs(law.get(k, 0.0) - reference.get(k, 0.0)) for k in keys)
