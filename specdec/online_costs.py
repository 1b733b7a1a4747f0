"""The calibrated verify-cost curve, corrected by the run's own step times.

    costs = OnlineCosts(cost_model)                 # one per TreeSizer
    costs.record(verify_seconds, n, batch)          # after each step: n query tokens (its largest sequence)
    costs.relative(n, batch)                        # c(n) / c(1): calibrated, times what this run observed
    costs.plain_step_due(batch)                     # before a step: decode it plainly, to measure c(1)

The calibration (:mod:`specdec.cost_model`) times bare chains on a synthetic prompt, perhaps while the machine was
quieter or busier than now; a real step does more for some drafters (EAGLE's hidden states, a tree's mask).

**Correction.** For each (batch bucket, n) the last ``window`` verify times are kept; the correction of n is
``(median at n / median at 1) / calibrated relative(n)``, shrunk toward 1 by the evidence, ``w = k / (k + prior)``
with ``k`` the smaller of the two sample counts, and clipped to [0.5, 2]. Medians, because a shared machine has
outlier steps; a window, because the context grows and the machine drifts. A size seen fewer than ``min_samples``
times (one slow step would set a median of one or two) takes the correction interpolated linearly in n between the
nearest corrected sizes (1 at n = 1; above the largest, the largest's): a curve found too flat where trees were
verified is not believed next to them.

**Plain steps.** The correction divides by 1-token (plain) steps' times. A bucket whose steps all draft (the guard
believes drafting pays, perhaps on a curve too flat) has none: :meth:`plain_step_due` asks for one after
``plain_every[0]`` steps of more tokens while the bucket has fewer than ``min_samples``, after ``plain_every[1]``
(~3% of steps) once it has them, never in a run that decodes plainly that often anyway.

**Measured verifies.** A curve too steep verifies no draft, so no size above 1 is timed. :meth:`measure_due` lets the
sizer keep a node of a tree it cut to nothing while the bucket has under ``window`` drafted times and 2 tokens are
priced above their median by more than the margin (or timed < ``min_samples`` times): ``measure_budget`` per step.

**Across calls** (:meth:`kept`, :meth:`restore`, in the guard's memory): a call starts from the bank and the last
``min_samples`` times of each size, enough to correct its first steps, few enough that a new load soon outvotes them.
"""
from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from specdec.cost_model import CostModel
from specdec.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)
_TOO_STEEP_WARNED: set[str] = set()  # cost cache files already said to be too steep (once per process)


@dataclass
class OnlineCosts:
    """The calibrated curve of ``costs`` corrected by one run's verify times, per batch bucket (module doc)."""

    costs: CostModel
    window: int = 32  # verify times kept per (batch bucket, n)
    prior: float = 8.0  # pseudo-samples behind a correction of 1
    min_samples: int = 3  # samples of a size (and of 1 token) before that size is corrected: a median outvotes one
    # steps of more than 1 token after which a 1-token step is due: while the bucket has fewer than min_samples of
    # them, and after (module doc, Plain steps)
    plain_every: tuple[int, int] = (8, 32)
    # decode steps banked per step (at most one banked) for measured verifies (module doc, Measured verifies)
    measure_budget: float = 0.01
    samples: dict[tuple[int, int], deque] = field(default_factory=dict)  # (batch bucket, n) -> recent seconds
    medians: dict[tuple[int, int], float] = field(default_factory=dict, repr=False)  # ... and their median
    factors: dict[tuple[int, int], float] = field(default_factory=dict)  # (batch bucket, n) -> measured correction
    drafted: dict[int, int] = field(default_factory=dict)  # batch bucket -> steps of n > 1 since its last n = 1
    credit: dict[int, float] = field(default_factory=dict)  # batch bucket -> decode steps banked for measuring
    # batch bucket -> (sizes, corrections) of the measured corrections, (1, 1.0) first: what relative() interpolates
    anchors: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict, repr=False)
    # batch bucket -> relative(n) at index n, up to the largest n asked: sizing asks for every prefix of every tree,
    # every step; recomputed when the bucket's anchors moved (stale)
    known: dict[int, list[float]] = field(default_factory=dict, repr=False)
    stale: set[int] = field(default_factory=set, repr=False)
    calibrated: dict[int, list[float]] = field(default_factory=dict, repr=False)  # ... the cost model's, as known
    # batch buckets whose plain steps moved every size's correction since it was last worked out: it is when the
    # curve is next read (relative), so a run of plain steps (a drafter held off) works out none it never reads
    uncorrected: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if (self.window < 1 or self.prior <= 0 or not 1 <= self.min_samples <= self.window
                or not 1 <= self.plain_every[0] <= self.plain_every[1] or not 0 < self.measure_budget <= 1):
            raise ValueError(f"OnlineCosts needs window >= 1, prior > 0, 1 <= min_samples <= window, 1 <= "
                             f"plain_every[0] <= plain_every[1] and 0 < measure_budget <= 1, got {self.window}, "
                             f"{self.prior}, {self.min_samples}, {self.plain_every}, {self.measure_budget}")

    def record(self, verify_seconds: float, n: int, batch: int) -> None:
        """One step's verify wall time, ``n`` query tokens for its largest sequence."""
        bucket = self.costs.batch_bucket(batch)
        self._add(bucket, n, [verify_seconds])
        self.drafted[bucket] = 0 if n == 1 else self.drafted.get(bucket, 0) + 1
        self.credit[bucket] = min(self.credit.get(bucket, 0.0) + self.measure_budget, 1.0)
        if n == 1:  # a plain step moves every size's correction: worked out when the curve is next read
            self.uncorrected.add(bucket)
        else:  # (a bucket's first record corrects restored samples)
            self._correct(bucket, None if bucket in self.uncorrected or bucket not in self.anchors else n)

    def plain_step_due(self, batch: int) -> bool:
        """Whether this step should verify no draft at all: the bucket's correction needs a 1-token step's time
        (module doc, Plain steps)."""
        bucket = self.costs.batch_bucket(batch)
        thin = len(self.samples.get((bucket, 1), ())) < self.min_samples
        return self.drafted.get(bucket, 0) >= self.plain_every[0 if thin else 1]

    def measure_due(self, batch: int, margin: float) -> bool:
        """Whether this step should time a 2-token verify although sizing kept no draft (module doc, Measured
        verifies); if so, its expected cost is taken from the bucket's bank."""
        bucket = self.costs.batch_bucket(batch)
        if sum(len(s) for (b, n), s in self.samples.items() if b == bucket and n > 1) >= self.window:
            return False  # a window of drafted times: the correction stands on them
        times = min(len(self.samples.get((bucket, n), ())) for n in (1, 2))
        observed, priced = self._observed(bucket, 2) if times else None, self.relative(2, batch)
        if times >= self.min_samples and observed >= priced * (1.0 - margin):
            return False  # the corrected curve prices 2 tokens as this run times them
        charge = max(min((priced if observed is None else observed) - 1.0, 1.0), 0.0)
        if self.credit.get(bucket, 0.0) < charge:
            return False
        self.credit[bucket] = self.credit.get(bucket, 0.0) - charge  # a free measurement (charge 0): none banked yet
        return True

    def relative(self, n: int, batch: int = 1) -> float:
        """c(n) / c(1) in plain decode steps (>= 1), with this run's correction where it has one."""
        if n <= 1:  # a plain step, whatever the correction
            return 1.0
        bucket = self.costs.batch_bucket(batch)
        if bucket in self.uncorrected:
            self._correct(bucket, None)
        curve = self.known.get(bucket, ())
        if n >= len(curve) or bucket in self.stale:
            # recomputed as long as it was, or extended by doubling up to a whole tree (sizing asks for n = 1, 2, ...)
            top = len(curve) - 1 if n < len(curve) else max(n, min(2 * len(curve) - 2, MAX_TREE_NODES + 1))
            curve = self.known[bucket] = self._curve(bucket, top)
            self.stale.discard(bucket)
        return curve[n]

    def kept(self) -> dict:
        """What a later call starts from (:meth:`restore`; JSON-able): the last ``min_samples`` times of each size,
        enough to correct its first steps and few enough that its own times soon outvote them (a machine's load
        changes between calls and processes), and the steps drafted since each bucket's last plain one."""
        return {"verify_times": [[b, n, list(s)[-self.min_samples:]] for (b, n), s in self.samples.items()],
                "since_plain": [[b, d] for b, d in self.drafted.items()],
                "measure_credit": [[b, c] for b, c in self.credit.items()]}

    def restore(self, verify_times: list, since_plain: list, measure_credit: list = ()) -> None:
        """Start from an earlier call's evidence (:meth:`kept`). A bucket is corrected when first used, so no batch
        size is calibrated here."""
        for bucket, n, seconds in verify_times:
            self._add(int(bucket), int(n), [float(x) for x in seconds])
        self.drafted.update((int(b), int(d)) for b, d in since_plain)
        self.credit.update((int(b), min(float(c), 1.0)) for b, c in measure_credit)

    def _add(self, bucket: int, n: int, seconds: list[float]) -> None:
        own = self.samples.setdefault((bucket, n), deque(maxlen=self.window))
        own.extend(seconds)
        self.medians[(bucket, n)] = statistics.median(own)

    def _correct(self, bucket: int, n: int | None) -> None:
        """Recompute the correction of size ``n`` (None: of every size) and the bucket's anchors."""
        if n is None:
            self.uncorrected.discard(bucket)
        sizes = [k for k in self.samples if k[0] == bucket and k[1] != 1] if n is None else [(bucket, n)]
        for key in sizes:
            factor = self._factor(*key)
            if factor is None:
                self.factors.pop(key, None)
            else:
                self.factors[key] = factor
        measured = sorted((k[1], f) for k, f in self.factors.items() if k[0] == bucket)
        anchors = ([1] + [m for m, _ in measured], [1.0] + [f for _, f in measured])
        if anchors != self.anchors.get(bucket):
            self.anchors[bucket] = anchors
            self.stale.add(bucket)

    def _factor(self, bucket: int, n: int) -> float | None:
        """Size ``n``'s measured correction (None: too few samples of n or of 1 token)."""
        base, own = self.samples.get((bucket, 1)), self.samples.get((bucket, n))
        if not base or not own or min(len(base), len(own)) < self.min_samples:
            return None
        observed = self._observed(bucket, n)
        calibrated = self._calibrated(bucket, n)[n]
        raw = observed / calibrated
        if raw < 0.5 and min(len(base), len(own)) >= self.window // 2:
            self._too_steep(n, calibrated, observed)
        weight = min(len(base), len(own)) / (min(len(base), len(own)) + self.prior)
        return min(max(1.0 + weight * (raw - 1.0), 0.5), 2.0)

    def _observed(self, bucket: int, n: int) -> float:
        """c(n) / c(1) as this run's medians have it, unshrunk (both sizes timed)."""
        return self.medians[(bucket, n)] / self.medians[(bucket, 1)]

    def _too_steep(self, n: int, calibrated: float, observed: float) -> None:
        """Say once per process that the cached curve is more than the correction's 2x too steep (it is corrected by
        2x at most, so drafts that would pay are still cut): where the file is, and that deleting it re-measures."""
        where = self.costs.file
        if where is None or str(where) in _TOO_STEEP_WARNED:
            return
        _TOO_STEEP_WARNED.add(str(where))
        logger.warning("the cached verify costs in %s price %d query tokens at %.2f decode steps, where this run "
                       "measures %.2f (a calibration taken while the machine was busy?): speculation='auto' drafts "
                       "less than it should; delete the file to measure them again", where, n, calibrated, observed)

    def _calibrated(self, bucket: int, top: int) -> list[float]:
        """The cost model's relative(n) at ``bucket``, n = 0..top at least (fixed once the bucket's curve exists)."""
        calibrated = self.calibrated.setdefault(bucket, [1.0, 1.0])
        while len(calibrated) <= top:
            calibrated.append(self.costs.relative(len(calibrated), bucket))
        return calibrated

    def _curve(self, bucket: int, top: int) -> list[float]:
        """relative(n) for n = 0..top: the calibrated curve times the measured corrections, interpolated linearly in n
        between them (1 at n = 1), the largest one's above it (module doc)."""
        if bucket not in self.anchors:  # its first use (restored samples, or none yet)
            self._correct(bucket, None)
        sizes, factors = self.anchors[bucket]
        calibrated = self._calibrated(bucket, top)
        out = [1.0, 1.0]
        ends = sizes[1:] + [max(top, sizes[-1]) + 1]  # past the largest: its correction (slope 0)
        for lo, hi, low, high in zip(sizes, ends, factors, factors[1:] + factors[-1:], strict=True):
            slope = (high - low) / (hi - lo)
            out += [max(c * (low + slope * (n - lo)), 1.0)
                    for n, c in enumerate(calibrated[lo + 1:min(hi, top) + 1], lo + 1)]
        return out
