"""Online calibration of a drafter's ``DraftTree.scores``: observed / predicted acceptance per score bin.

    bins = new_bins()                                  # [accepted, predicted] per bin, decaying sums
    learn(bins, score, accepted, decay)                # one tried node of a deterministic tree
    corrected(scores, bins, prior_weight)              # each score times its bin's factor, capped at 1

Each bin's factor (accepted / predicted) shrinks toward the pooled one (all bins together) by ``prior_weight``
pseudo-observations, not toward 1: a short answer gives each bin a few observations, and a drafter over-confident
by 2x everywhere (EAGLE at T=0.8) was read as over-confident by ~1.2x. The tree sizer keeps one set of bins for the
scores it is offered; the combined drafter keeps one per child, since children's scores mean different things (a
draft probability, an observed rate) and one child's over-confidence must not cut another's nodes, and the sizer
takes its scores as they are (``Drafter.calibrated_scores``). Which nodes a
commit tested: :func:`specdec.tree.tried_nodes`.
"""
from __future__ import annotations

from collections.abc import Sequence

BINS = 10  # score bins: [0, 0.1), ..., [0.9, 1.0]


def new_bins() -> list[list[float]]:
    """Empty evidence: [accepted, predicted] per bin."""
    return [[0.0, 0.0] for _ in range(BINS)]


def learn(bins: list[list[float]], score: float, accepted: bool, decay: float) -> None:
    """One tried node with ``score``: its bin's sums decay by ``decay``, then count it."""
    b = bins[min(int(score * BINS), BINS - 1)]
    b[0] = b[0] * decay + float(accepted)
    b[1] = b[1] * decay + score


def corrected(scores: Sequence[float], bins: list[list[float]], prior_weight: float) -> list[float]:
    """``scores`` times their bins' factors (shrunk toward the pooled factor), each at most 1."""
    pooled = (sum(a for a, _ in bins) + prior_weight) / (sum(p for _, p in bins) + prior_weight)
    factor = [(acc + prior_weight * pooled) / (pred + prior_weight) for acc, pred in bins]
    factor.append(factor[-1])  # a score of 1.0 is in the last bin
    return [min(1.0, s * factor[int(s * BINS)]) for s in scores]

