"""Large-sample statistics of the real (vectorised) rejection sampler against the exact law.

Used by ``tests/test_rejection_stats.py`` and by the certificate (``specdec eval lossless``):

    samples, acceptances = run_sampler(case, n=30_000)           # one batched rejection_sample
    p, power = goodness_of_fit(samples, exact_step_law, tv=0.02, alpha=0.01 / 5)
    rejected = holm({"case-a": p_a, "case-b": p_b}, alpha=0.01)

The power is the probability of rejecting, at level ``alpha``, the hardest alternative at
total-variation distance ``tv`` over the test's bins (moving ``tv`` of mass from one half of
the law to the other), so callers can check their sample size was able to fail.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from scipy import optimize, stats
from specdec.eval.exact_law import Law, SyntheticCase, sample_trees

from specdec.rejection import EXACT, AcceptanceRule, rejection_sample
from specdec.tree import DraftMode


def run_sampler(case: SyntheticCase, rule: AcceptanceRule = EXACT, n: int = 30_000, seed: int = 0):
    """Emitted tokens of one step for ``n`` drafted trees: ([tuple], [Acceptance])."""
    g = torch.Generator().manual_seed(seed)
    trees, logits = sample_trees(case, n, g)
    accs = rejection_sample(trees, logits, case.sampling, g, rule=rule)
    return [a.accepted_tokens + (a.next_token,) for a in accs], accs


@dataclass(frozen=True)
class ChiSquare:
    """A chi-square test's result. It unpacks as ``p, power = ...``; ``detects_tv`` is the smallest TV from the
    tested law it catches with probability 0.9 at its level (None: one bin, nothing to test, so it catches none)."""

    p_value: float
    power: float  # at the TV asked for, against the hardest alternative (chi2_power)
    detects_tv: float | None

    def __iter__(self):
        return iter((self.p_value, self.power))

    @classmethod
    def of(cls, p_value: float, n: float, df: int, tv: float, alpha: float) -> "ChiSquare":
        """The result of a test of size ``n`` (a two-sample test's n_a n_b / (n_a + n_b)) with ``df`` degrees of
        freedom; none (one bin) has no power."""
        if df < 1:
            return cls(p_value, 0.0, None)
        return cls(p_value, chi2_power(n, tv, alpha, df), detectable_tv(n, alpha, df))


def goodness_of_fit(samples: list, law: Law, tv: float, alpha: float) -> ChiSquare:
    """Chi-square test of ``samples`` against ``law``, rare bins pooled (two bins, one expecting under 5 draws: the
    exact binomial test): p-value, power at TV ``tv`` and level ``alpha``, and the TV it detects."""
    n = len(samples)
    counts = Counter(samples)
    forbidden = any(law.get(k, 0.0) == 0.0 for k in counts)  # an outcome the exact law forbids: p = 0
    # outcomes of probability 0 (a candidate the warpers removed) are the forbidden test's: pooled, an empty bin
    # expected to hold 0 gave 0 / 0, a NaN p-value
    keys = sorted((k for k in law if law[k] > 0.0), key=law.get, reverse=True)
    big = [k for k in keys if law[k] * n >= 5]
    small = [k for k in keys if law[k] * n < 5]
    # the pooled bin too must expect 5 draws: one expecting 0.3 took a legitimate rare draw or two for a deviation
    # (a correct sampler failed 1.7% of tests at level 1%); the least likely big outcomes join it until it does,
    # while two bins remain (one bin tests nothing: a sampler drawing only rare outcomes would pass)
    while small and len(big) > 1 and sum(law[k] for k in small) * n < 5:
        small.insert(0, big.pop())
    obs = [counts.get(k, 0) for k in big]
    exp = [law[k] * n for k in big]
    if small:
        obs.append(sum(counts.get(k, 0) for k in small))
        exp.append(sum(law[k] for k in small) * n)
    if forbidden or len(obs) < 2:
        return ChiSquare.of(0.0 if forbidden else 1.0, n, len(obs) - 1, tv, alpha)
    if len(obs) == 2 and min(exp) < 5:
        # one common outcome left and a pooled bin expecting under 5 draws: the chi-square's tail is no longer the
        # statistic's (a correct sampler failed 2.3% of tests at level 1% at expectations 299.4 and 0.6), so the
        # exact binomial test of the pooled bin's count, whose rate of false rejections never exceeds alpha
        p = float(stats.binomtest(obs[1], sum(obs), exp[1] / sum(exp)).pvalue)
    else:
        p = float(stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue)
    return ChiSquare.of(p, n, len(obs) - 1, tv, alpha)


def chi2_power(n: float, tv: float, alpha: float, df: int) -> float:
    """Power of a chi-square test with ``df`` degrees of freedom at level ``alpha`` against EVERY alternative at
    total variation ``tv`` from the tested law, over the test's bins (a shift inside a pooled bin is invisible).

    The noncentrality of a shift delta is n * sum(delta^2 / p); at a given TV it is least, 4 n tv^2, when tv of
    mass moves from one half of the law to the other in proportion to it, so this is a lower bound on the power
    against any such alternative. ``n`` is the sample size (a two-sample test's n_a n_b / (n_a + n_b))."""
    crit = stats.chi2.ppf(1 - alpha, df)
    return float(1 - stats.ncx2.cdf(crit, df, 4 * n * tv**2))


def detectable_tv(n: float, alpha: float, df: int, power: float = 0.9) -> float:
    """The smallest TV that :func:`chi2_power` detects with probability ``power``: what a test of this size can
    claim."""
    crit = stats.chi2.ppf(1 - alpha, df)
    lam = optimize.brentq(lambda lam: 1 - stats.ncx2.cdf(crit, df, lam) - power, 0.0, 1e6)
    return math.sqrt(lam / (4 * n))


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
    """Names whose hypothesis Holm's step-down procedure rejects at family-wise level ``alpha``. A p-value that is
    not a number (a broken test) is rejected first, never sorted among the others (where it stopped the procedure
    early, leaving every hypothesis after it untested)."""
    rejected = []
    for i, (name, p) in enumerate(sorted(pvalues.items(), key=lambda kv: -1.0 if math.isnan(kv[1]) else kv[1])):
        if not math.isnan(p) and p > alpha / (len(pvalues) - i):
            break
        rejected.append(name)
    return rejected


def analytic_acceptance(case: SyntheticCase, prefix: tuple[int, ...]) -> float:
    """P(one of the root's children is accepted) in closed form, for the draft kinds that have one: a single sampled
    child (independent or drawn without replacement, the same for one child), sum(min(target_probs, draft_probs));
    deterministic candidates x_1..x_w, sum(target_probs[x_i]) (each is accepted with its share of what the earlier
    ones left). Several sampled siblings have none (each rejection reshapes the residual the next is tested on):
    the exact law covers them."""
    target, width = case.target_probs(prefix), case.widths[0]
    if case.mode is DraftMode.DETERMINISTIC:
        return float(target[case.candidates(prefix, width)].sum())
    if width != 1:
        raise ValueError("no closed form for the acceptance of several sampled siblings")
    return float(torch.minimum(target, case.draft_probs(prefix)).sum())


def acceptance_rate_test(case: SyntheticCase, n: int, seed: int = 1, rule: AcceptanceRule = EXACT):
    """One level of children: (measured rate, :func:`analytic_acceptance`, binomial p-value)."""
    if len(case.widths) != 1:
        raise ValueError("acceptance_rate_test takes one level of children")
    expected = analytic_acceptance(case, case.prefix)
    _, accs = run_sampler(case, rule, n=n, seed=seed)
    accepted = sum(len(a.accepted_nodes) for a in accs)
    return accepted / n, expected, float(stats.binomtest(accepted, n, expected).pvalue)


def chain_tau_test(case: SyntheticCase, n: int, seed: int = 2, rule: AcceptanceRule = EXACT):
    """Prefix-independent chain of k (a sampled or a deterministic draft): (mean committed, (1 - a^(k+1)) / (1 - a),
    z, per-depth z), ``a`` the :func:`analytic_acceptance` of one node, the same at every depth. At a = 1 tau is
    k + 1 and a z with no spread is 0 where the draws meet the formula exactly, else infinite."""
    if not case.prefix_independent or any(w != 1 for w in case.widths):
        raise ValueError("chain_tau_test takes a prefix-independent chain")
    k = len(case.widths)
    a = analytic_acceptance(case, ())
    expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
    _, accs = run_sampler(case, rule, n=n, seed=seed)
    committed = np.array([len(x.accepted_nodes) + 1 for x in accs], float)
    spread = committed.std(ddof=1) / math.sqrt(n)
    z = (committed.mean() - expected) / spread if spread > 0 else (0.0 if committed.mean() == expected else math.inf)
    accepted = torch.tensor([x.depth_accepted for x in accs], dtype=torch.float64).sum(0)
    tried = torch.tensor([x.depth_tried for x in accs], dtype=torch.float64).sum(0)
    rate = accepted / tried
    if 0 < a < 1:
        z_depth = ((rate - a) / torch.sqrt(a * (1 - a) / tried)).tolist()
    else:  # every node is accepted (a = 1) or none (a = 0): no spread, as z above; a depth never tried says nothing
        z_depth = torch.where((rate == a) | (tried == 0), 0.0, math.inf).tolist()
    return float(committed.mean()), expected, float(z), z_depth
