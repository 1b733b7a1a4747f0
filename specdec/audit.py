"""Draft audit: catches a drafter whose draft_probs are not what it sampled from.

Structural checks (``DraftTree.validate``) cannot see a drafter that draws its tokens
from one distribution and reports another, which breaks exactness silently. The audit
can: for every sampled node it computes the randomised probability integral transform

    u = CDF(token - 1) + V * draft_probs[token],   V ~ Uniform(0, 1)

under the distribution the node claims (for without-replacement siblings: the claimed
distribution with the earlier siblings removed and renormalised). If the claim is true,
the u are i.i.d. Uniform(0, 1). Every ``window`` nodes a Kolmogorov-Smirnov test runs; a
p-value below ``alpha`` raises :class:`~specdec.tree.DraftError` naming the drafter.

The engine audits every stochastic proposal by default (``generate(audit_drafts=False)``
turns it off); it draws from its own generator, so it never changes the output.
"""
from __future__ import annotations

import torch
from scipy import stats

from specdec.tree import DraftError, DraftMode, DraftTree


class DraftAudit:
    def __init__(self, window: int = 2048, alpha: float = 1e-8, seed: int = 0) -> None:
        if window < 100 or not 0 < alpha < 1:
            raise ValueError("DraftAudit needs window >= 100 and 0 < alpha < 1")
        self.window, self.alpha = window, alpha
        self.generator = torch.Generator().manual_seed(seed)
        self.pending: list[float] = []
        self.tests = 0  # KS tests run so far
        self.last_p_value: float | None = None

    def observe(self, tree: DraftTree, drafter: str) -> None:
        if tree.mode is DraftMode.DETERMINISTIC or tree.num_nodes == 0:
            return
        probs = tree.draft_probs.double().cpu()  # [num_nodes, vocab]
        tokens = tree.tokens.tolist()
        parents = tree.parents.tolist()
        tried: dict[int, list[int]] = {}  # parent -> earlier siblings' tokens
        for i, (tok, parent) in enumerate(zip(tokens, parents)):
            row = probs[i]
            if tree.mode is DraftMode.WITHOUT_REPLACEMENT:
                earlier = tried.setdefault(parent, [])
                if earlier:
                    row = row.clone()
                    row[earlier] = 0.0
                    total = float(row.sum())
                    if total <= 0:
                        raise DraftError(f"{drafter}: sibling {i} was drawn after its siblings exhausted draft_probs")
                    row = row / total
                earlier.append(tok)
            below = float(row[:tok].sum())
            v = float(torch.rand((), generator=self.generator, dtype=torch.float64))
            self.pending.append(min(1.0, below + v * float(row[tok])))
        if len(self.pending) >= self.window:
            self._test(drafter)

    def _test(self, drafter: str) -> None:
        p = float(stats.kstest(self.pending, "uniform").pvalue)
        self.tests += 1
        self.last_p_value = p
        self.pending = []
        if p < self.alpha:
            raise DraftError(
                f"{drafter}: its draft tokens were not drawn from the draft_probs it reported "
                f"(audit: Kolmogorov-Smirnov p = {p:.2e} over {self.window} sampled nodes); "
                "speculative sampling would not be exact with this drafter"
            )
