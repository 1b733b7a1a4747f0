"""Two-sample tests of "same distribution": speculative output vs plain output.

Used by the end-to-end sampling tests and by ``specdec eval lossless``:

    p_value, power = two_sample_chi2(plain_samples, spec_samples, tv=0.05)

Samples are hashable outcomes (e.g. tuples of the first k tokens). The power reported is
the probability of rejecting at level ``alpha`` the hardest alternative at total-variation
distance ``tv`` for this statistic, so a test can assert it was able to fail.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np
from scipy import stats
from specdec.eval.statistics import ChiSquare


def two_sample_chi2(a: Sequence[Hashable], b: Sequence[Hashable], tv: float = 0.05,
                    alpha: float = 1e-3) -> ChiSquare:
    """A two-sample chi-square test: p-value, power to detect TV ``tv`` at level ``alpha``, and the TV it detects
    (:class:`specdec.eval.statistics.ChiSquare`, which unpacks as ``p, power``).

    Bins whose expected count is below 5 are pooled into one, with the least likely others until it expects 5
    too while two bins remain (two bins, one expecting under 5 draws: Fisher's exact test). The power is against
    the hardest alternative at that TV over the bins (:func:`specdec.eval.statistics.chi2_power`, with the
    effective size ``n_a n_b / (n_a + n_b)``).
    """
    if not a or not b:
        raise ValueError("two_sample_chi2 needs samples on both sides")
    count_a, count_b = Counter(a), Counter(b)
    keys = sorted(set(count_a) | set(count_b), key=repr)
    ca = np.array([count_a[k] for k in keys], float)
    cb = np.array([count_b[k] for k in keys], float)
    expected_min = (ca + cb) * min(len(a), len(b)) / (len(a) + len(b))
    rare = expected_min < 5
    # the pooled bin too expects 5, while two bins remain (one bin tests nothing)
    while rare.any() and (~rare).sum() > 1 and expected_min[rare].sum() < 5:
        common = np.flatnonzero(~rare)
        rare[common[np.argmin(expected_min[common])]] = True
    if rare.any():
        ca = np.append(ca[~rare], ca[rare].sum())
        cb = np.append(cb[~rare], cb[rare].sum())
    table = np.stack([ca, cb])
    table = table[:, table.sum(0) > 0]
    n, df = len(a) * len(b) / (len(a) + len(b)), table.shape[1] - 1
    if df < 1:
        return ChiSquare.of(1.0, n, df, tv, alpha)  # one outcome only: nothing to compare, no power
    _, p, _, expected = stats.chi2_contingency(table)
    if df == 1 and expected.min() < 5:
        # one common outcome left and a pooled bin expecting under 5 draws of one side: the chi-square's tail is not
        # the statistic's (at 50 and 5,000 draws, expectations 0.25 and 25, a correct sampler failed 1.4% of tests
        # at level 1%), so Fisher's exact test, whose rate of false rejections never exceeds alpha
        p = stats.fisher_exact(table).pvalue
    return ChiSquare.of(float(p), n, df, tv, alpha)
