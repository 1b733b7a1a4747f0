"""The calibrated verify-cost curve, corrected by the run's own step times.

    costs = OnlineCosts(cost_model)                 # one per TreeSizer
    costs.record(verify_seconds, n, batch)          # after each step: n query tokens (its largest sequence)
    costs.relative(n, batch)                        # c(n) / c(1): calibrated, times what this run observed

The calibration (:mod:`specdec.cost_model`) times bare chain drafts on a synthetic prompt. A real step does
more, and more for some drafters than others (hidden states for EAGLE and Medusa, a tree's ancestor mask,
acceptance learned from every node), so sizing on the calibrated curve alone keeps trees that do not pay.

**Correction.** For each (batch bucket, n) the last ``window`` verify times are kept; the correction of n is
``(median at n / median at 1) / calibrated relative(n)``, shrunk toward 1 by the evidence, ``w = k / (k +
prior)`` with ``k`` the smaller of the two sample counts, and clipped to [0.5, 2]. Medians, because a shared
machine has outlier steps; a window, because the context grows and the machine drifts. Without steps of 1 token
nothing is corrected. Sizes seen fewer than ``min_samples`` times keep their calibrated cost (the median of one
or two samples is their mean, which one slow step would set for the rest of a run).
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from specdec.cost_model import CostModel


@dataclass
class OnlineCosts:
    costs: CostModel
    window: int = 32  # verify times kept per (batch bucket, n)
    prior: float = 8.0  # pseudo-samples behind a correction of 1
    min_samples: int = 3  # samples of a size (and of 1 token) before that size is corrected: a median outvotes one
    samples: dict[tuple[int, int], deque] = field(default_factory=dict)  # (batch bucket, n) -> recent seconds
    medians: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # ... and their median
    factors: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch bucket, n) -> correction
    # (batch bucket, n) -> relative(n): sizing asks for every prefix of every tree, every step; a correction
    # that moves forgets its own entries (record)
    known: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1 or self.prior <= 0 or not 1 <= self.min_samples <= self.window:
            raise ValueError(f"OnlineCosts needs window >= 1, prior > 0 and 1 <= min_samples <= window, got "
                             f"{self.window}, {self.prior}, {self.min_samples}")

    def record(self, verify_seconds: float, n: int, batch: int) -> None:
        """One step's verify wall time, ``n`` query tokens for its largest sequence."""
        bucket = self.costs.batch_bucket(batch)
        own = self.samples.setdefault((bucket, n), deque(maxlen=self.window))
        own.append(verify_seconds)
        # a plain step moves every size's correction: each keeps its median, computed when its samples change
        self.medians[(bucket, n)] = statistics.median(own)
        for key in [k for k in self.samples if k[0] == bucket and k[1] != 1] if n == 1 else [(bucket, n)]:
            self.factors[key] = self._factor(*key)
            self.known.pop(key, None)

    def _factor(self, bucket: int, n: int) -> float:
        base, own = self.samples.get((bucket, 1)), self.samples.get((bucket, n))
        if not base or not own or min(len(base), len(own)) < self.min_samples:
            return 1.0
        observed = self.medians[(bucket, n)] / self.medians[(bucket, 1)]
        raw = observed / self.costs.relative(n, bucket)
        weight = min(len(base), len(own)) / (min(len(base), len(own)) + self.prior)
        return min(max(1.0 + weight * (raw - 1.0), 0.5), 2.0)

    def relative(self, n: int, batch: int = 1) -> float:
        """c(n) / c(1) in plain decode steps (>= 1), with this run's correction where it has one."""
        key = (self.costs.batch_bucket(batch), n)
        value = self.known.get(key)
        if value is None:
            calibrated = self.costs.relative(n, batch)  # fixed once the bucket's curve exists
            value = self.known[key] = calibrated if n <= 1 else max(calibrated * self.factors.get(key, 1.0), 1.0)
        return value
