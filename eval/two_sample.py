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


def two_sample_chi2(a: Sequence[Hashable], b: Sequence[Hashable], tv: float = 0.05,
                    alpha: float = 1e-3) -> tuple[float, float]:
    """(p-value, power to detect TV ``tv`` at level ``alpha``) of a two-sample chi-square test.

    Bins whose expected count is below 5 are pooled into one. The power is computed for
    moving ``tv`` of mass between the two most likely bins (noncentrality
    ``n_a n_b / (n_a + n_b) * tv^2 * (1/p1 + 1/p2)``), the hardest such alternative.
    """
    if not a or not b:
        raise ValueError("two_sample_chi2 needs samples on both sides")
    count_a, count_b = Counter(a), Counter(b)
    keys = sorted(set(count_a) | set(count_b), key=repr)
    ca = np.array([count_a[k] for k in keys], float)
    cb = np.array([count_b[k] for k in keys], float)
    expected_min = (ca + cb) * min(len(a), len(b)) / (len(a) + len(b))
    rare = expected_min < 5
    if rare.any():
        ca = np.append(ca[~rare], ca[rare].sum())
        cb = np.append(cb[~rare], cb[rare].sum())
    table = np.stack([ca, cb])
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0, 0.0  # one outcome only: nothing to compare, no power
    p = float(stats.chi2_contingency(table)[1])
    # against a shift between the two likeliest outcomes, as eval.statistics.chi2_power (not the hardest one)
    pooled = np.sort(table.sum(0) / table.sum())[::-1]
    lam = len(a) * len(b) / (len(a) + len(b)) * tv**2 * (1 / pooled[0] + 1 / pooled[1])
    df = table.shape[1] - 1
    power = float(1 - stats.ncx2.cdf(stats.chi2.ppf(1 - alpha, df), df, lam))
    return p, power
