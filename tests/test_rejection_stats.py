"""Statistics of the implemented (vectorised) sampler against the exact law.

Each case draws N draft trees the way a real drafter would, runs ``rejection_sample`` on
all of them in one batch, and compares the emitted tokens of the step with the exact law
(chi-square goodness of fit, rare bins pooled, Holm-corrected over the cases). The test
computes its own power: moving 0.02 of probability (TV 0.02) between the two most likely
outcomes must be detected with probability >= 0.9 at the Holm-adjusted level.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from specdec.eval.exact_law import SyntheticCase, sample_trees, step_law
from specdec.eval.negative_controls import BROKEN_RULES

from specdec.rejection import EXACT, rejection_sample
from specdec.sampling import SamplingConfig
from specdec.tree import DraftMode

N = 30_000
ALPHA = 0.01
TV = 0.02
CASES = {
    "chain-independent": SyntheticCase(6, (1, 1), DraftMode.INDEPENDENT, SamplingConfig(True), seed=11),
    "tree-independent-topk": SyntheticCase(6, (2, 1), DraftMode.INDEPENDENT, SamplingConfig(True, 0.8, 4), seed=12),
    "without-replacement": SyntheticCase(6, (3,), DraftMode.WITHOUT_REPLACEMENT, SamplingConfig(True, 1.0, 5), seed=13),
    "deterministic-tree": SyntheticCase(6, (2, 2), DraftMode.DETERMINISTIC, SamplingConfig(True, 1.2), seed=14),
    "plain-topp": SyntheticCase(6, (), DraftMode.DETERMINISTIC, SamplingConfig(True, 1.5, 0, 0.9), seed=15),
}


def run_sampler(case, rule=EXACT, n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    trees, logits = sample_trees(case, n, g)
    accs = rejection_sample(trees, logits, case.sampling, g, rule=rule)
    return [tuple(a.accepted_tokens.tolist()) + (a.next_token,) for a in accs], accs


def gof(samples, law):
    """(p-value, power at TV 0.02 and level ALPHA / len(CASES)) of a pooled chi-square test."""
    n = len(samples)
    counts: dict = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
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
    p = stats.chisquare(obs, np.array(exp) * sum(obs) / sum(exp)).pvalue
    p1, p2 = (law[k] for k in keys[:2]) if len(keys) > 1 else (1.0, 1.0)
    lam = n * TV**2 * (1 / p1 + 1 / p2)
    crit = stats.chi2.ppf(1 - ALPHA / len(CASES), len(obs) - 1)
    return p, 1 - stats.ncx2.cdf(crit, len(obs) - 1, lam)


def holm(pvalues: dict[str, float], alpha: float) -> list[str]:
    rejected = []
    for i, (name, p) in enumerate(sorted(pvalues.items(), key=lambda kv: kv[1])):
        if p > alpha / (len(pvalues) - i):
            break
        rejected.append(name)
    return rejected


@pytest.mark.slow
def test_sampler_matches_exact_law_holm_corrected():
    pvalues, powers = {}, {}
    for name, case in CASES.items():
        samples, _ = run_sampler(case)
        law = step_law(case, EXACT)(case.prefix)
        pvalues[name], powers[name] = gof(samples, dict(law))
    assert all(pw >= 0.9 for pw in powers.values()), f"too few samples to detect TV {TV}: {powers}"
    assert not holm(pvalues, ALPHA), f"sampler deviates from the exact law: {pvalues}"


@pytest.mark.slow
@pytest.mark.parametrize("rule_name", ["always_accept", "resample_from_target", "no_sibling_renormalisation"])
def test_broken_sampler_is_caught_by_the_same_harness(rule_name):
    case = CASES["tree-independent-topk"] if rule_name != "resample_from_target" else CASES["chain-independent"]
    samples, _ = run_sampler(case, BROKEN_RULES[rule_name], n=N)
    p, _ = gof(samples, dict(step_law(case, EXACT)(case.prefix)))
    assert p < 1e-6, f"{rule_name} not detected: p = {p}"


def test_acceptance_rate_matches_sum_of_min():
    case = SyntheticCase(8, (1,), DraftMode.INDEPENDENT, SamplingConfig(True, 0.9), seed=21)
    expected = float(torch.minimum(case.target_probs(case.prefix), case.draft_probs(case.prefix)).sum())
    _, accs = run_sampler(case, n=20_000, seed=1)
    accepted = sum(int(a.accepted_nodes.numel()) for a in accs)
    p = stats.binomtest(accepted, len(accs), expected).pvalue
    assert p > 1e-3, (accepted / len(accs), expected)


def test_chain_mean_accepted_length_matches_closed_form():
    k = 4
    case = SyntheticCase(8, (1,) * k, DraftMode.INDEPENDENT, SamplingConfig(True), seed=22,
                         prefix_independent=True, draft_sharpness=1.0)
    a = float(torch.minimum(case.target_probs(()), case.draft_probs(())).sum())
    expected_tau = (1 - a ** (k + 1)) / (1 - a)
    _, accs = run_sampler(case, n=20_000, seed=2)
    committed = np.array([a_.accepted_nodes.numel() + 1 for a_ in accs], float)
    z = (committed.mean() - expected_tau) / (committed.std(ddof=1) / math.sqrt(len(committed)))
    assert abs(z) < 4, (committed.mean(), expected_tau)
    accepted = torch.stack([a_.depth_accepted for a_ in accs]).sum(0).double()
    tried = torch.stack([a_.depth_tried for a_ in accs]).sum(0).double()
    z_depth = (accepted / tried - a) / torch.sqrt(a * (1 - a) / tried)  # P(accept at d | parent accepted) = a
    assert bool((z_depth.abs() < 4).all()), (accepted / tried, a)
