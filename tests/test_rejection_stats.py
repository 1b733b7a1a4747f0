"""Statistics of the implemented (vectorised) sampler against the exact law.

Each case draws N draft trees the way a real drafter would, runs ``rejection_sample`` on
all of them in one batch, and compares the emitted tokens of the step with the exact law
(chi-square goodness of fit, rare bins pooled, Holm-corrected over the cases). The test
computes its own power: every law at TV 0.025 from the exact one (the hardest: 0.025 of
probability moved from one half of the law to the other) must be detected with probability
>= 0.9 at the Holm-adjusted level.
"""
from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from specdec.eval.exact_law import SyntheticCase, step_law
from specdec.eval.negative_controls import BROKEN_RULES
from specdec.eval.statistics import (
    acceptance_rate_test,
    analytic_acceptance,
    chain_tau_test,
    goodness_of_fit,
    holm,
    run_sampler,
    total_variation_bound,
)

from specdec.rejection import EXACT, AcceptanceRule
from specdec.sampling import SamplingConfig
from specdec.tree import DraftMode

N = 30_000
ALPHA = 0.01
TV = 0.025
CASES = {
    "chain-independent": SyntheticCase(6, (1, 1), DraftMode.INDEPENDENT, SamplingConfig(True), seed=11),
    "tree-independent-topk": SyntheticCase(6, (2, 1), DraftMode.INDEPENDENT, SamplingConfig(True, 0.8, 4), seed=12),
    "without-replacement": SyntheticCase(6, (3,), DraftMode.WITHOUT_REPLACEMENT, SamplingConfig(True, 1.0, 5), seed=13),
    "deterministic-tree": SyntheticCase(6, (2, 2), DraftMode.DETERMINISTIC, SamplingConfig(True, 1.2), seed=14),
    "plain-topp": SyntheticCase(6, (), DraftMode.DETERMINISTIC, SamplingConfig(True, 1.5, 0, 0.9), seed=15),
    # transformers' other warpers; seeds where each removes tokens at the root or a child the step reaches
    "tree-independent-minp-eta": SyntheticCase(6, (2, 1), DraftMode.INDEPENDENT,
                                               SamplingConfig(True, 0.9, min_p=0.1, eta_cutoff=0.05), seed=26),
    "deterministic-typical-epsilon-toph": SyntheticCase(
        6, (2, 2), DraftMode.DETERMINISTIC, SamplingConfig(True, 1.2, typical_p=0.9, epsilon_cutoff=0.05, top_h=0.95),
        seed=39),
}


def gof(samples, law):
    """(p-value, power at TV ``TV`` and the Holm-worst level ALPHA / len(CASES))."""
    return goodness_of_fit(samples, law, TV, ALPHA / len(CASES))


@pytest.mark.slow
def test_sampler_matches_exact_law_holm_corrected():
    pvalues, powers = {}, {}
    for name, case in CASES.items():
        samples, _ = run_sampler(case)
        law = step_law(case, EXACT)(case.prefix)
        pvalues[name], powers[name] = gof(samples, dict(law))
    assert all(pw >= 0.9 for pw in powers.values()), f"too few samples to detect TV {TV}: {powers}"
    assert not holm(pvalues, ALPHA), f"sampler deviates from the exact law: {pvalues}"


def test_siblings_drawn_without_replacement_follow_the_exact_law():
    """The fast suite's check of the vectorised sampler on siblings drawn without replacement (the slow test above
    covers every case): a sampler that forgot which sibling tokens were already rejected moved the step's law by
    TV 0.05 and passed every fast test. Fixed draws; 8,000 trees detect TV 0.04 with power 0.9 at level 1e-3."""
    case = CASES["without-replacement"]
    samples, _ = run_sampler(case, n=8_000)
    fit = goodness_of_fit(samples, dict(step_law(case, EXACT)(case.prefix)), 0.04, 1e-3)
    assert fit.power >= 0.9 and fit.p_value > 1e-3, fit


@pytest.mark.slow
@pytest.mark.parametrize("rule_name", ["always_accept", "resample_from_target", "no_sibling_renormalisation"])
def test_broken_sampler_is_caught_by_the_same_harness(rule_name):
    case = CASES["tree-independent-topk"] if rule_name != "resample_from_target" else CASES["chain-independent"]
    samples, _ = run_sampler(case, BROKEN_RULES[rule_name], n=N)
    p, _ = gof(samples, dict(step_law(case, EXACT)(case.prefix)))
    assert p < 1e-6, f"{rule_name} not detected: p = {p}"


def test_acceptance_rate_matches_sum_of_min():
    case = SyntheticCase(8, (1,), DraftMode.INDEPENDENT, SamplingConfig(True, 0.9), seed=21)
    rate, expected, p = acceptance_rate_test(case, n=20_000)
    assert p > 1e-3, (rate, expected)


def test_chain_mean_accepted_length_matches_closed_form():
    case = SyntheticCase(8, (1,) * 4, DraftMode.INDEPENDENT, SamplingConfig(True), seed=22,
                         prefix_independent=True, draft_sharpness=1.0)
    mean, expected, z, z_depth = chain_tau_test(case, n=20_000)
    assert abs(z) < 4, (mean, expected)
    assert all(abs(x) < 4 for x in z_depth), z_depth  # P(accept at d | parent accepted) = a at every depth


class NeverAccept(AcceptanceRule):
    name = "never_accept"
    lossy = True

    def accept_prob(self, residual, draft, token, deterministic):
        return torch.zeros_like(token, dtype=residual.dtype)


@pytest.mark.parametrize("mode", [DraftMode.INDEPENDENT, DraftMode.DETERMINISTIC])
def test_a_chain_accepted_whole_has_tau_k_plus_1_and_every_z_0(mode):
    """At a = 1 (top-k 1: target and draft put all their mass on one token, the same one at seed 2) the formula's
    (1 - a^(k+1)) / (1 - a) is 0 / 0: tau is k + 1, every draw commits the whole chain, and z and the per-depth z,
    which have no spread, are 0 (they were NaN per depth, failing |z| < 4 for an exact sampler); a sampler that
    rejects once at a = 1 gets an infinite z."""
    case = SyntheticCase(4, (1,) * 3, mode, SamplingConfig(True, top_k=1), seed=2, prefix_independent=True)
    assert analytic_acceptance(case, ()) == 1.0
    assert chain_tau_test(case, n=200) == (4.0, 4.0, 0.0, [0.0, 0.0, 0.0])
    mean, expected, z, z_depth = chain_tau_test(case, n=200, rule=NeverAccept())
    assert (mean, expected, z) == (1.0, 4.0, math.inf) and z_depth == [math.inf, 0.0, 0.0]


def test_acceptance_checks_fail_for_a_broken_rule():
    case = SyntheticCase(8, (1,), DraftMode.INDEPENDENT, SamplingConfig(True, 0.9), seed=21)
    assert acceptance_rate_test(case, n=20_000, rule=BROKEN_RULES["always_accept"])[2] < 1e-6


def test_deterministic_candidates_accept_with_their_summed_target_probs():
    """w deterministic candidates at a node: one is accepted with probability sum(target_probs[candidates]) (each
    with its share of what the earlier ones left); a chain of them has tau (1 - a^(k+1)) / (1 - a) with that a."""
    siblings = SyntheticCase(8, (3,), DraftMode.DETERMINISTIC, SamplingConfig(True, 0.9, 6), seed=25)
    rate, expected, p = acceptance_rate_test(siblings, n=20_000)
    assert 0.2 < expected < 0.9 and p > 1e-3, (rate, expected)
    chain = SyntheticCase(8, (1,) * 4, DraftMode.DETERMINISTIC, SamplingConfig(True), seed=24, prefix_independent=True,
                          draft_sharpness=1.0)
    mean, expected, z, z_depth = chain_tau_test(chain, n=20_000)
    assert expected > 1.2 and abs(z) < 4 and all(abs(x) < 4 for x in z_depth), (mean, expected, z_depth)
    assert acceptance_rate_test(siblings, n=20_000, rule=BROKEN_RULES["always_accept"])[2] < 1e-6


def test_the_tv_upper_bound_covers_the_true_tv():
    """The certificate's "bound" column is a 99% upper confidence bound on the sampler's TV from the law: at least
    the true TV (0.3 here) in all but ~1% of runs, and not far above it with 20,000 draws. Halving the empirical TV
    gave 0.155 and no test noticed."""
    import random

    law = {0: 0.5, 1: 0.5}
    rng = random.Random(0)
    for n in (500, 20_000):
        samples = [0 if rng.random() < 0.8 else 1 for _ in range(n)]  # a sampler at TV 0.3 from the law
        bound = total_variation_bound(samples, law)
        assert 0.3 <= bound < 0.3 + (0.2 if n == 500 else 0.03), (n, bound)


def test_goodness_of_fit_reports_the_power_and_detectable_tv_of_its_degrees_of_freedom():
    """Two equal bins of 50 draws: df 1, noncentrality 4 n tv^2 = 4 at tv 0.1, so at level 0.05 (critical |Z| 1.96)
    the power is P(|Z + 2| > 1.96) = Phi(0.04) + Phi(-3.96) = 0.5160; power 0.9 needs sqrt(lambda) = 1.96 + 1.2816,
    a TV of 3.2416 / (2 sqrt(100)) = 0.1621."""
    fit = goodness_of_fit(["a", "b"] * 50, {"a": 0.5, "b": 0.5}, tv=0.1, alpha=0.05)
    assert fit.p_value == pytest.approx(1.0)
    assert fit.power == pytest.approx(0.5160, abs=1e-3)
    assert fit.detects_tv == pytest.approx(0.1621, abs=1e-3)
    assert goodness_of_fit(["a"] * 50, {"a": 1.0}, 0.1, 0.05).p_value == 1.0  # one bin: nothing to reject


def test_goodness_of_fit_keeps_a_bin_expecting_exactly_five_draws():
    """Expected 50, 30, 15, 5 of 100 draws: every outcome is its own bin (5 is enough), df 3. Observed 50, 30, 10,
    10: chi2 = 25 / 15 + 25 / 5 = 6.667 on 3 df."""
    samples = ["a"] * 50 + ["b"] * 30 + ["c"] * 10 + ["d"] * 10
    fit = goodness_of_fit(samples, {"a": 0.5, "b": 0.3, "c": 0.15, "d": 0.05}, tv=0.1, alpha=0.05)
    assert fit.p_value == pytest.approx(stats.chi2.sf(25 / 15 + 25 / 5, 3))


def test_goodness_of_fit_pools_a_rare_outcome_with_the_least_likely_common_one():
    """Expected 50, 49, 1 of 100: the rare bin expects under 5, so the least likely common outcome (b) joins it:
    bins a (50 expected) and b + c (50 expected). Observed 50 and 45 + 5 = 50 fit exactly (p 1), although c drew
    five times its expectation (unpooled, (5 - 1)^2 / 1 = 16 alone)."""
    samples = ["a"] * 50 + ["b"] * 45 + ["c"] * 5
    assert goodness_of_fit(samples, {"a": 0.5, "b": 0.49, "c": 0.01}, 0.1, 0.05).p_value == pytest.approx(1.0)


def test_goodness_of_fit_never_pools_its_last_common_bin():
    """Expected 76, 2.4, 1.6 of 80: the pooled rare bin expects 4, but pooling the one common outcome too would
    leave a single bin that tests nothing. A sampler drawing only the rare outcomes (0 against 76 expected) fails."""
    fit = goodness_of_fit(["b"] * 80, {"a": 0.95, "b": 0.03, "c": 0.02}, 0.1, 0.05)
    assert fit.p_value < 1e-10 and fit.detects_tv is not None


def test_goodness_of_fit_tests_a_pooled_bin_expecting_under_five_draws_exactly():
    """Expected 299.4 and 0.6 of 300: one common outcome is left, so the rare bin keeps an expectation under 5, where
    the chi-square's tail is not the statistic's. Three rare draws have binomial probability 0.023 (a correct sampler
    does that), but chi2 = 2.4^2 / 0.6 + 2.4^2 / 299.4 = 9.62 on 1 df reads p 0.0019, a failure at level 0.01 (a
    correct sampler failed 2.3% of tests at that level); the exact binomial test keeps the level."""
    fit = goodness_of_fit(["a"] * 297 + ["b"] * 3, {"a": 0.998, "b": 0.002}, tv=0.1, alpha=0.01)
    assert fit.p_value == pytest.approx(stats.binomtest(3, 300, 0.002).pvalue)
    assert fit.p_value > 0.01


def test_holm_steps_down_to_a_larger_level_after_each_rejection():
    """Holm at 0.05 over three p-values: 0.01 <= 0.05 / 3, 0.02 <= 0.05 / 2, 0.04 <= 0.05 / 1, so all three are
    rejected (Bonferroni's 0.05 / 3 for each rejects only the first); 0.03 then 0.026 > 0.025 stops the steps."""
    assert sorted(holm({"a": 0.01, "b": 0.02, "c": 0.04}, 0.05)) == ["a", "b", "c"]
    assert holm({"a": 0.01, "b": 0.026, "c": 0.03}, 0.05) == ["a"]


def test_the_tv_bound_adds_the_bretagnolle_huber_carol_slack():
    """400 of 500 draws on one of two equally likely outcomes: empirical TV 0.3, slack at 99% over 2 outcomes
    sqrt((2 ln 2 + ln 100) / (2 * 500)) = sqrt(5.9915 / 1000) = 0.07740."""
    assert total_variation_bound([0] * 400 + [1] * 100, {0: 0.5, 1: 0.5}) == pytest.approx(0.3 + 0.07740, abs=1e-4)
