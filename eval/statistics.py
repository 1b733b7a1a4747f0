"""Large-sample statistics of the real (vectorised) rejection sampler against the exact law.

Used by ``tests/test_rejection_stats.py`` and by the certificate (``specdec eval lossless``):

    samples, acceptances = run_sampler(case, n=30_000)           # one batched rejection_sample
    p, power = goodness_of_fit(samples, exact_step_law, tv=0.02, alpha=0.01 / 5)
    rejected = holm({"case-a": p_a, "case-b": p_b}, alpha=0.01)

The power is the probability of rejecting, at level ``alpha``, the hardest alternative at
total-variation distance ``tv`` for this statistic (moving ``tv`` of mass between the two
most likely outcomes), so callers can check their sample size was able to fail.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
from scipy import stats
from specdec.eval.exact_law import Law, SyntheticCase, sample_trees

from specdec.rejection import EXACT, AcceptanceRule, rejection_sample


def run_sampler(case: SyntheticCase, rule: AcceptanceRule = EXACT, n: int = 30_000, seed: int = 0):
    """Emitted tokens of one step for ``n`` drafted trees: ([tuple], [Acceptance])."""
    g = torch.Generator().manual_seed(seed)
    trees, logits = sample_trees(case, n, g)
    accs = rejection_sample(trees, logits, case.sampling, g, rule=rule)
    return [a.accepted_tokens + (a.next_token,) for a in accs], accs


def goodness_of_fit(samples: list, law: Law, tv: float, alpha: float) -> tuple[float, float]:
    """(p-value, power at TV ``tv`` and level ``alpha``) of a chi-square test, rare bins pooled."""
    n = len(samples)
    counts = Counter(samples)
    if any(law.get(k, 0.0) == 0.0 for k in counts):
        return 0.0, 1.0  # an outcome the exact law forbids
    keys = sorted(law, key=law.get, reverse=True)
    big = [k for k in keys if law[k] * n >= 5]
    small = [k for k in keys if law[k] * n < 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [law[k] * n for k in big]
    if small:
        obs.append(sum(counts.get(k, 0) for k in small))
        exp.append(sum(law[k] for k in small) * n)
    if len(obs) < 2:
        return 1.0, 0.0
    p = float(stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)
    return p, chi2_power(n, law, tv, alpha, len(obs) - 1)


def chi2_power(n: int, law: Law, tv: float, alpha: float, df: int) -> float:
    """Power of the chi-square test against a shift of ``tv`` between the law's two likeliest outcomes. That is
    not the hardest alternative at that TV (mass moved between two halves of the law, noncentrality 4 n tv^2), so
    this overstates the power against subtle biases: docs/evaluation.md says so."""
    keys = sorted(law, key=law.get, reverse=True)
    p1, p2 = (law[k] for k in keys[:2]) if len(keys) > 1 else (1.0, 1.0)
    lam = n * tv**2 * (1 / p1 + 1 / p2)
    crit = stats.chi2.ppf(1 - alpha, df)
    return float(1 - stats.ncx2.cdf(crit, df, lam))


def samples_for_power(law: Law, tv: float, alpha: float, power: float = 0.9, df: int | None = None) -> int:
    """Smallest n (to 2 significant digits) whose chi2_power reaches ``power``."""
    df = df or max(1, sum(1 for v in law.values() if v > 0) - 1)
    n = 100
    while chi2_power(n, law, tv, alpha, df) < power:
        n = int(n * 1.25) + 1
    return n


def total_variation_bound(samples: list, law: Law, confidence: float = 0.99) -> float:
    """Upper confidence bound on TV(sampler, law): empirical TV + a Bretagnolle-Huber-Carol term."""
    n = len(samples)
    counts = Counter(samples)
    keys = set(law) | set(counts)
    empirical = 0.5 * sum(abs(counts.get(k, 0) / n - law.get(k, 0.0)) for k in keys)
    support = len(keys)
    slack = math.sqrt((support * math.log(2) + math.log(1 / (1 - confidence))) / (2 * n))
    return empirical + slack


def holm(pvalues: dict[str, float], alpha: float) -> list[str]:
    """Names whose hypothesis Holm's step-down procedure rejects at family-wise level ``alpha``."""
    rejected = []
    for i, (name, p) in enumerate(sorted(pvalues.items(), key=lambda kv: kv[1])):
        if p > alpha / (len(pvalues) - i):
            break
        rejected.append(name)
    return rejected


def acceptance_rate_test(case: SyntheticCase, n: int, seed: int = 1, rule: AcceptanceRule = EXACT):
    """Single-node chain: (measured rate, sum(min(target_probs, draft_probs)), binomial p-value)."""
    expected = float(torch.minimum(case.target_probs(case.prefix), case.draft_probs(case.prefix)).sum())
    _, accs = run_sampler(case, rule, n=n, seed=seed)
    accepted = sum(len(a.accepted_nodes) for a in accs)
    return accepted / n, expected, float(stats.binomtest(accepted, n, expected).pvalue)


def chain_tau_test(case: SyntheticCase, n: int, seed: int = 2, rule: AcceptanceRule = EXACT):
    """Prefix-independent chain of k: (mean committed, (1 - a^(k+1)) / (1 - a), z, per-depth z)."""
    k = len(case.widths)
    a = float(torch.minimum(case.target_probs(()), case.draft_probs(())).sum())
    expected = (1 - a ** (k + 1)) / (1 - a)
    _, accs = run_sampler(case, rule, n=n, seed=seed)
    committed = np.array([len(x.accepted_nodes) + 1 for x in accs], float)
    spread = committed.std(ddof=1) / math.sqrt(n)
    z = (committed.mean() - expected) / spread if spread > 0 else (0.0 if committed.mean() == expected else math.inf)
    accepted = torch.tensor([x.depth_accepted for x in accs], dtype=torch.float64).sum(0)
    tried = torch.tensor([x.depth_tried for x in accs], dtype=torch.float64).sum(0)
    z_depth = ((accepted / tried - a) / torch.sqrt(a * (1 - a) / tried)).tolist()
    return float(committed.mean()), expected, float(z), z_depth
