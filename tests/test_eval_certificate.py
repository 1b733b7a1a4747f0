"""The losslessness certificate on a tiny model: passes for exact drafters, every negative
control fails (broken acceptance rules and broken engines: an off-by-one tree mask, a wrong
KV compaction slot), and too-small sample sizes void it instead of passing it."""
from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import pytest
import torch
from scipy import stats as sps
from specdec.eval import engine_law
from specdec.eval.certificate import CertificateSizes, run_certificate, sampler_checks
from specdec.eval.divergence import diagnose, greedy_identity
from specdec.eval.negative_controls import ENGINE_FAULTS
from specdec.eval.two_sample import two_sample_chi2

from specdec.generate import generate
from specdec.models.loader import load_model
from specdec.rejection import EXACT
from specdec.sampling import SamplingConfig
from specdec.testing import RandomTreeDrafter, build_tiny_model
from specdec.tree import DraftMode
from tests.cli_runs import run_main

# 7 greedy-identity prompts: this tiny model's answers fall into cycles that few faults disturb, and
# the engine-fault controls must be caught on at least one answer; a window of 4 sampled tokens, not the default
# 8, for time (tests/test_certificate_reach.py runs the default one)
SMALL = CertificateSizes(stat_samples=6000, identity_prompts=7, identity_tokens=24, sample_sequences=800,
                         sample_tokens=2, sample_later=2, e2e_tv=0.1)


def _prompts(n):
    return [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7], [9, 4, 9, 4, 9], [3, 3, 3], [8, 2, 8, 2, 10, 11, 8, 2],
            [4, 11, 0, 4, 11], [7, 3, 10, 6, 7, 3]][:n]


@pytest.mark.parametrize("drafter, options", [
    ("ngram", {}),
    ("draft-model", {"mode": "independent", "widths": [2, 1], "num_draft_tokens": 2}),
])
def test_certificate_passes_and_every_control_is_caught(drafter, options):
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    if drafter == "draft-model":
        options = dict(options, model=build_tiny_model(vocab_size=12, seed=9))
    cert = run_certificate(loaded, drafter, options, SamplingConfig(True, 0.9, 6), SMALL, _prompts)
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    controls = {c.control for c in cert.checks if c.control}
    assert "always_accept" in controls and set(ENGINE_FAULTS) | {"draw_reused"} <= controls
    assert all(not c.passed for c in cert.checks if c.control)
    md = cert.to_markdown()
    assert "PASSED" in md and "always_accept" in md
    assert cert.to_json()["passed"] is True


WARPED = SamplingConfig(True, 0.9, min_p=0.01, eta_cutoff=0.02)  # each removes tokens in some synthetic case


def test_certificate_synthetic_levels_run_transformers_warpers():
    """The exact-law level runs min_p / eta (transformers' warpers) with its controls, records them, and every
    warper removes tokens in some case (no 'removed no token' note); the slow test below runs every level."""
    cert = run_certificate(None, "draft-model", {"mode": "independent"}, WARPED, CertificateSizes(), _prompts,
                           levels=("exact",))
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    assert any(c.control for c in cert.checks) and all(not c.passed for c in cert.checks if c.control)
    assert all("removed no token" not in c.detail for c in cert.checks), [c.detail for c in cert.checks]
    sampling = cert.to_json()["config"]["sampling"]
    assert sampling["min_p"] == 0.01 and sampling["eta_cutoff"] == 0.02


@pytest.mark.slow
def test_certificate_with_warpers_passes_end_to_end():
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    options = {"mode": "independent", "widths": [2, 1], "num_draft_tokens": 2,
               "model": build_tiny_model(vocab_size=12, seed=9)}
    cert = run_certificate(loaded, "draft-model", options, WARPED, SMALL, _prompts)
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed


def test_too_few_samples_void_the_certificate():
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    tiny = CertificateSizes(stat_samples=30, identity_prompts=1, identity_tokens=4, sample_sequences=20)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True), tiny, _prompts, levels=("exact", "stats"))
    assert cert.void and not cert.passed
    assert any("power" in w for w in cert.warnings)
    assert "VOID" in cert.to_markdown()


def test_divergence_is_diagnosed_as_real_or_near_tie():
    model = build_tiny_model(vocab_size=12, seed=3)
    loaded = load_model(model)
    from specdec.eval.negative_controls import BROKEN_RULES

    res = greedy_identity(loaded, _prompts(3), "ngram", {}, 24, rule=BROKEN_RULES["always_accept"])
    assert res.divergences and all(d.kind == "real mismatch" and d.gap > 1e-3 for d in res.divergences)
    assert greedy_identity(loaded, _prompts(3), "ngram", {}, 24, rule=EXACT).identical
    # a forced tie: equal top-2 logits are classified as numerical

    class Tied(torch.nn.Module):
        device = torch.device("cpu")

        def forward(self, ids):
            logits = torch.zeros(ids.shape[0], ids.shape[1], 12)
            logits[..., 4] = logits[..., 7] = 5.0
            return type("Out", (), {"logits": logits})()

    d = diagnose(Tied(), [1, 2], prompt=0, position=0, plain=4, spec=7)
    assert d.kind == "numerical near-tie" and d.gap == 0.0
    # a token far below the tied top two is a bug, not rounding (only the top-2 gap was looked at)
    d = diagnose(Tied(), [1, 2], prompt=0, position=0, plain=4, spec=9)
    assert d.kind == "real mismatch" and d.gap == 5.0


def test_a_coupled_divergence_at_a_warpers_cut_off_is_measured_from_the_cut_off():
    """Under coupled sampling a token the warper cuts has a perturbed logit of -inf: a divergence where rounding
    moved the cut-off past one token (kept on one side, cut on the other) got a gap of inf, a real mismatch under
    any margin. Its gap is now how far below the lowest kept logit the cut token lies."""
    from specdec.coupling import Coupling

    class Cut(torch.nn.Module):  # top-k 2 keeps tokens 1 and 2 (logits 5, 4); tokens 3 (3.999) and 5 (1) are cut
        device = torch.device("cpu")

        def forward(self, ids):
            logits = torch.zeros(ids.shape[0], ids.shape[1], 6)
            logits[..., 1], logits[..., 2], logits[..., 3], logits[..., 5] = 5.0, 4.0, 3.999, 1.0
            return type("Out", (), {"logits": logits})()

    how = (Coupling(0), SamplingConfig(True, temperature=1.0, top_k=2), 7)
    near = diagnose(Cut(), [1, 2], prompt=0, position=0, plain=2, spec=3, near_tie=0.01, coupled=how)
    assert near.kind == "numerical near-tie" and near.gap == pytest.approx(0.001, abs=1e-5)
    far = diagnose(Cut(), [1, 2], prompt=0, position=0, plain=2, spec=5, near_tie=0.01, coupled=how)
    assert far.kind == "real mismatch" and far.gap == pytest.approx(3.0)
    # both tokens cut: the farther one decides (token 3 lies 0.001 below the floor 4.0, token 5 lies 3 below it)
    both = diagnose(Cut(), [1, 2], prompt=0, position=0, plain=3, spec=5, near_tie=0.01, coupled=how)
    assert both.kind == "real mismatch" and both.gap == pytest.approx(3.0)


def test_identity_result_counts_near_ties_as_divergences_and_reports_every_field():
    from specdec.eval.divergence import Divergence, IdentityResult

    tie = Divergence(0, 3, 4, 7, 5.0, 5.0, 0.0, "numerical near-tie")
    bug = Divergence(1, 0, 2, 9, 5.0, 4.0, 5.0, "real mismatch")
    only_tie = IdentityResult(prompts=2, tokens_compared=48, divergences=(tie,), tau=1.5)
    assert not only_tie.identical and only_tie.real_mismatches == 0  # a near-tie is a divergence, not a bug
    assert IdentityResult(2, 48, (tie, bug, bug), 1.5).real_mismatches == 2
    assert IdentityResult(2, 48, (), 1.5).identical
    assert only_tie.to_json() == {
        "prompts": 2, "tokens_compared": 48, "tau": 1.5,
        "divergences": [{"prompt": 0, "position": 3, "plain_token": 4, "speculative_token": 7, "top1_logit": 5.0,
                         "top2_logit": 5.0, "gap": 0.0, "kind": "numerical near-tie"}]}


def test_a_side_that_stops_earlier_is_a_real_mismatch_at_its_first_missing_token():
    """Plain output that ended (EOS) 5 tokens into prompt 0 while the speculative side went on: a real mismatch at
    new token 5, the missing side's token -1; the tokens compared are the plain side's."""
    from specdec.eval.divergence import Divergence

    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    prompts = _prompts(2)
    full = generate(loaded, prompts, max_new_tokens=8)
    plain = [full[0][: len(prompts[0]) + 5], full[1]]
    res = greedy_identity(loaded, prompts, "ngram", {}, 8, plain=plain)
    spec_token = full[0][len(prompts[0]) + 5]  # the speculative side equals plain greedy (EXACT rule)
    assert res.divergences == (Divergence(0, 5, -1, spec_token, 0.0, 0.0, 0.0, "real mismatch"),)
    assert res.tokens_compared == 5 + 8


def test_a_gap_of_exactly_the_near_tie_margin_is_a_real_mismatch():
    """Near-tie means strictly less than ``near_tie`` below the top logit. Logits 1.0, 0.75, 0.5, margin 0.5
    (exact in binary): token 1 is 0.25 below the top (a near-tie), token 2 exactly 0.5 (a real mismatch)."""
    from types import SimpleNamespace

    class Fixed:
        device = torch.device("cpu")

        def __call__(self, ids):
            return SimpleNamespace(logits=torch.tensor([[[1.0, 0.75, 0.5]]]))

    assert diagnose(Fixed(), [0], 0, 0, 0, 1, near_tie=0.5).kind == "numerical near-tie"
    last = diagnose(Fixed(), [0], 0, 0, 0, 2, near_tie=0.5)
    assert (last.gap, last.kind) == (0.5, "real mismatch")


def test_a_divergence_is_diagnosed_on_the_logits_after_the_common_prefix():
    """The logits diagnosed are the target's for the token at the divergence: after the prompt and the new tokens
    both sides share, not one token more or less."""
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    prompts = _prompts(1)
    full = generate(loaded, prompts, max_new_tokens=8)
    at = len(prompts[0]) + 3  # plain's new token 3 replaced: the sides share the prompt and new tokens 0-2
    with torch.no_grad():
        logits = loaded.model(torch.tensor([full[0][:at]])).logits[0, -1].float()
    other = int(logits.argmin())
    plain = [full[0][:at] + [other] + full[0][at + 1:]]
    (d,) = greedy_identity(loaded, prompts, "ngram", {}, 8, plain=plain).divergences
    assert (d.position, d.plain_token, d.speculative_token) == (3, other, full[0][at])
    # the speculative token is the greedy top; the plain one the least likely: gap = top - lowest logit
    assert d.top1_logit == pytest.approx(float(logits.max())) == pytest.approx(float(logits[full[0][at]]))
    assert d.gap == pytest.approx(float(logits.max() - logits.min())) and d.kind == "real mismatch"


def test_coupled_identity_defaults_to_the_coupled_near_tie_margin(monkeypatch):
    """Under coupled sampling the default margin is COUPLED_NEAR_TIE (perturbed float64 logits), not NEAR_TIE."""
    import specdec.eval.divergence as divergence

    margins = []
    real = divergence.diagnose

    def recording(*args):
        margins.append(args[6])
        return real(*args)

    monkeypatch.setattr(divergence, "diagnose", recording)
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    prompts = _prompts(1)
    kw = {"do_sample": True, "seed": 7, "sampler": "coupled"}
    full = generate(loaded, prompts, max_new_tokens=4, **kw)
    at = len(prompts[0]) + 1
    plain = [full[0][:at] + [(full[0][at] + 1) % 12] + full[0][at + 1:]]  # a divergence at new token 1
    greedy_identity(loaded, prompts, "ngram", {}, 4, plain=plain, sampling=kw)
    greedy_identity(loaded, prompts, "ngram", {}, 4, plain=plain)
    assert margins == [divergence.COUPLED_NEAR_TIE, divergence.NEAR_TIE] == [1e-5, 1e-3]


def test_identity_under_sampling_refuses_a_run_it_cannot_compare():
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    with pytest.raises(ValueError, match="sampler='coupled' and do_sample=True"):
        greedy_identity(loaded, _prompts(1), "ngram", {}, 4, sampling={"do_sample": True, "seed": 7})
    with pytest.raises(ValueError, match="needs a seed"):
        greedy_identity(loaded, _prompts(1), "ngram", {}, 4, sampling={"do_sample": True, "sampler": "coupled"})
    coupled = {"do_sample": True, "sampler": "coupled", "seed": 7}
    twice = _prompts(1) * 2  # the batch's second copy draws other noise than a run of its own would
    with pytest.raises(ValueError, match="needs distinct prompts"):
        greedy_identity(loaded, twice, "ngram", {}, 4, batched=False, sampling=coupled)
    assert greedy_identity(loaded, twice, "ngram", {}, 4, sampling=coupled).identical


def _fault_setup():
    """A tiny model and 8 random prompts (3-9 tokens) on which the tiny model's greedy answers
    soon repeat, so n-gram and random-tree drafts get accepted and the tree mask and the
    compaction are exercised. Each fault breaks 4-8 of the 8 answers here (measured)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (int(torch.randint(3, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(8)]
    return load_model(build_tiny_model("llama-mha-untied", vocab_size=32, seed=3)), prompts


def test_single_runs_report_the_tau_of_all_their_tokens_over_all_their_steps():
    """tau of the unbatched identity check is pooled (every new token over every step), as a batched call's is, not
    a mean of each run's tau, which weighs a short run's steps as much as a long one's."""
    loaded, prompts = _fault_setup()
    two = prompts[:2]
    runs = [generate(loaded, [p], max_new_tokens=16, drafter="ngram", speculation="always", return_dict=True).stats[0]
            for p in two]
    assert runs[0].tau != runs[1].tau  # else both rules agree
    res = greedy_identity(loaded, two, "ngram", {}, 16, batched=False)
    assert res.tau == pytest.approx(sum(r.new_tokens for r in runs) / sum(r.steps for r in runs))


@pytest.mark.parametrize("fault", sorted(ENGINE_FAULTS))
@pytest.mark.parametrize("drafter", ["ngram", "random-tree"])
def test_engine_faults_break_greedy_identity(fault, drafter):
    """Each engine fault makes greedy speculative output differ from plain greedy (real
    mismatches, not near-ties) while the exact engine matches it, with drafts accepted in both."""
    loaded, prompts = _fault_setup()
    plain = generate(loaded, prompts, max_new_tokens=32)

    def run(engine_fault):
        # random trees branch, so compaction really moves K/V and the mask has siblings
        d = RandomTreeDrafter(32, seed=1) if drafter == "random-tree" else drafter
        return greedy_identity(loaded, prompts, d, {}, 32, plain=plain, fault=engine_fault)

    exact, broken = run(None), run(ENGINE_FAULTS[fault])
    assert exact.identical and exact.tau > 1.15, exact
    assert broken.tau > 1.15, broken  # drafts were accepted, so the fault was exercised
    assert broken.real_mismatches >= 2, broken


def test_certificate_end_to_end_runs_engine_faults_as_controls():
    loaded, prompts = _fault_setup()
    sizes = CertificateSizes(identity_prompts=8, identity_tokens=32, sample_sequences=40, sample_tokens=1)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True, 0.9, 6), sizes, lambda n: prompts[:n],
                           levels=("e2e",))
    greedy = {c.control: c for c in cert.checks if c.name.startswith("greedy identity")}
    assert set(greedy) == {None, "always_accept", *ENGINE_FAULTS}
    assert greedy[None].passed, greedy[None].detail
    for name in ENGINE_FAULTS:
        assert not greedy[name].passed and greedy[name].as_expected, greedy[name].detail
        assert name in cert.to_markdown()


def test_engine_fault_that_is_never_exercised_voids_the_certificate():
    """Plain decoding never accepts a draft: the engine faults pass the greedy check, and a
    control that passes voids the certificate instead of letting it pass."""
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    sizes = CertificateSizes(identity_prompts=2, identity_tokens=8, sample_sequences=20, sample_tokens=1)
    cert = run_certificate(loaded, None, {}, SamplingConfig(True), sizes, _prompts, levels=("e2e",))
    faults = [c for c in cert.checks if c.control in ENGINE_FAULTS]
    assert len(faults) == len(ENGINE_FAULTS) and all(c.passed and "barely exercised" in c.detail for c in faults)
    assert cert.void and not cert.passed and "VOID" in cert.to_markdown()
    assert any("no draft was accepted" in w for w in cert.warnings)


@pytest.mark.parametrize("level, name, flags", [
    ("end-to-end", "greedy identity vs plain decoding (batched)", "--identity-prompts / --identity-tokens"),
    ("sampler-statistics", "chi-square vs exact law (Holm)", "--stat-samples"),
    ("end-to-end", "sampled 8 tokens (of 9) in a greedy answer vs plain sampling (chi-square on the first 2, "
                   "log-probability KS on all 8)", "--sample-sequences"),
    ("coupled", "plain coupled sampling == target law (first token)", "--stat-samples"),
    ("coupled", "plain coupled generate() on the model == the target's first-token distribution",
     "--sample-sequences"),
    ("bitwise", "ngram text and log-probabilities == plain, bit for bit (batched + single)",
     "--identity-prompts / --identity-tokens"),
])
def test_a_void_certificate_names_the_uncaught_control_and_what_to_raise(level, name, flags):
    """It said only 'VOID (a negative control was not caught)': not which control, nor that a larger run fixes it."""
    from specdec.eval.certificate import Certificate, Check
    from specdec.eval.cli import void_advice

    cert = Certificate({}, [Check(name, level, True), Check(name, level, False, "always_accept"),
                            Check(name, level, True, "wrong_compaction_slot")])
    missed = f"wrong_compaction_slot by {level} {name}"
    assert cert.void and cert.verdict == f"VOID (a negative control was not caught: {missed})"
    assert cert.verdict in cert.to_markdown()
    assert void_advice(cert).endswith(f"rerun with more {flags} than this run's")
    exact = Certificate({}, [Check("emitted law == target law", "exact-law", True, "always_accept")])
    assert "no sample size changes" in void_advice(exact)


def test_a_pass_with_too_little_power_says_so_in_its_verdict():
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    few = CertificateSizes(stat_samples=300, identity_prompts=1, identity_tokens=4, sample_sequences=20)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True, 0.9, 6), few, _prompts,
                           levels=("exact", "stats"))
    assert cert.passed and not cert.void  # its controls are caught even so (they are blunt)
    assert cert.underpowered and cert.verdict.startswith("PASSED, underpowered")
    assert cert.to_json()["underpowered"] is True and "underpowered" in cert.to_markdown()
    assert any("power" in w for w in cert.warnings)


def test_reported_power_is_the_power_against_the_hardest_alternative():
    """The power was computed for a shift between the two likeliest outcomes, easier to see than the hardest
    shift at the same TV (mass moved from one half of the law to the other): it reported 1.00 where the test
    caught such a bias far less often. Simulated here against that hardest alternative, one- and two-sample."""
    import numpy as np
    from scipy import stats as sps
    from specdec.eval.statistics import goodness_of_fit
    from specdec.eval.two_sample import two_sample_chi2

    law = {k: 0.1 for k in range(10)}
    n, tv, alpha = 2000, 0.04, 0.01
    alt = np.array([0.1 * (1 + 2 * tv)] * 5 + [0.1 * (1 - 2 * tv)] * 5)  # tv moved from one half to the other
    rng = np.random.default_rng(0)
    counts = rng.multinomial(n, alt, size=2000)
    caught = np.mean([sps.chisquare(c, [n / 10] * 10).pvalue < alpha for c in counts])
    samples = [k for k, c in enumerate(counts[0]) for _ in range(c)]
    fit = goodness_of_fit(samples, law, tv, alpha)
    assert abs(fit.power - caught) < 0.05, (fit.power, caught)
    p, power = fit  # unpacks as earlier
    assert (p, power) == (fit.p_value, fit.power)

    a = rng.choice(10, size=2 * n, p=[0.1] * 10).tolist()
    b = rng.choice(10, size=2 * n, p=alt).tolist()
    assert abs(two_sample_chi2(a, b, tv, alpha).power - caught) < 0.05  # effective size 2n * 2n / 4n = n


def test_the_pooled_bin_of_rare_outcomes_expects_five_draws():
    """Rare outcomes are pooled into one bin, which then expected as little as 0.3 draws: two legitimate rare draws
    read as a deviation (a correct sampler failed 1.7% of tests at level 1%). The least likely common outcomes now
    join the pool until it expects 5: here the third outcome, its 199.9 draws expected and drawn as expected."""
    from scipy import stats as sps
    from specdec.eval.statistics import goodness_of_fit

    rare = {("r", i): 1e-5 for i in range(10)}  # 0.1 draws expected in all, in 1,000
    law = {"a": 0.5, "b": 0.3, "c": 0.2 - 1e-4, **rare}
    samples = ["a"] * 500 + ["b"] * 300 + ["c"] * 198 + [("r", 0), ("r", 1)]
    fit = goodness_of_fit(samples, law, 0.02, 0.01)
    expected = [500, 300, (0.2 - 1e-4 + 1e-4) * 1000]
    assert fit.p_value == pytest.approx(sps.chisquare([500, 300, 200], expected).pvalue) and fit.p_value > 0.9
    # a pool that expects 5 on its own is left alone; one that takes every outcome leaves a single bin: no test
    alone = goodness_of_fit(samples, {"a": 0.5, "b": 0.3, "c": 0.19, **dict.fromkeys(rare, 1e-3)}, 0.02, 0.01)
    assert alone.p_value == pytest.approx(sps.chisquare([500, 300, 198, 2], [500, 300, 190, 10]).pvalue)
    single = goodness_of_fit(["x", "y"], {"x": 0.5, "y": 0.5}, 0.02, 0.01)
    assert (single.p_value, single.detects_tv) == (1.0, None)
    # the two-sample test pools alike: "r" (1 draw a side expected) joins "c", the least likely common outcome
    from specdec.eval.two_sample import two_sample_chi2

    a, b = ["a"] * 500 + ["b"] * 300 + ["c"] * 198 + ["r"] * 2, ["a"] * 500 + ["b"] * 300 + ["c"] * 200
    table = [[500, 300, 200], [500, 300, 200]]
    assert two_sample_chi2(a, b, 0.02, 0.01).p_value == pytest.approx(sps.chi2_contingency(table)[1])
    # two bins are kept: a sampler drawing only the rare outcome of a law with one common one is still caught
    assert goodness_of_fit([1] * 100, {0: 0.97, 1: 0.03}, 0.02, 0.01).p_value < 1e-6
    assert goodness_of_fit([2] * 100, {0: 0.96, 1: 0.02, 2: 0.02}, 0.02, 0.01).p_value < 1e-6
    assert two_sample_chi2(["x"] * 10_000, ["y"] * 100, 0.02, 0.01).p_value < 1e-6


def test_detectable_tv_is_where_the_power_reaches_0_9():
    from specdec.eval.statistics import chi2_power, detectable_tv

    for n, df in ((3000, 26), (50_000, 45), (300, 8)):
        tv = detectable_tv(n, 0.001, df)
        assert chi2_power(n, tv, 0.001, df) == pytest.approx(0.9, abs=1e-6)
        assert chi2_power(n, tv * 0.9, 0.001, df) < 0.9 < chi2_power(n, tv * 1.1, 0.001, df)


@pytest.mark.parametrize("sizes", [CertificateSizes(), CertificateSizes.full()], ids=["default", "full"])
def test_certificate_sizes_detect_the_tv_they_state(sizes):
    """The sampler statistics' synthetic cases at every mode and a spread of sampling settings: their chi-square
    reaches power 0.9 at the stated TV (at the Holm-worst level of three cases), so a default run is not
    'PASSED, underpowered'."""
    from specdec.eval.certificate import sampler_cases
    from specdec.eval.exact_law import step_law
    from specdec.eval.statistics import detectable_tv

    n = sizes.stat_samples
    for sampling in (SamplingConfig(True), SamplingConfig(True, 1.5), SamplingConfig(True, 0.8, 50),
                     SamplingConfig(True, 1.0, 0, 0.9)):
        cases = sampler_cases(list(DraftMode), sampling)
        assert len(cases) == len(DraftMode), sorted(cases)  # one case per draft mode
        for name, case in cases.items():
            law = step_law(case, EXACT)(case.prefix)
            bins = sum(1 for q in law.values() if q * n >= 5) + any(q * n < 5 for q in law.values())
            assert detectable_tv(n, sizes.alpha / len(cases), bins - 1) <= sizes.stat_tv, (name, sampling)


def test_statistics_alone_run_only_the_controls_that_apply():
    """With --levels stats alone, a broken rule identical to the exact one for the drafter's modes (bonus from the
    drafter, for n-gram's deterministic candidates) passed its statistics and voided the certificate."""
    sizes = CertificateSizes(stat_samples=2000)
    cert = run_certificate(None, "ngram", {}, SamplingConfig(True, 0.9, 6), sizes, _prompts, levels=("stats",))
    assert not cert.void and cert.passed, [(c.control, c.passed) for c in cert.checks]
    assert {c.level for c in cert.checks} == {"sampler-statistics"}
    assert "always_accept" in {c.control for c in cert.checks}


def test_a_biased_shortcut_of_the_sampler_fails_the_exact_level(monkeypatch):
    """The exact law is the acceptance rule's; the sampler's shortcut for deterministic trees (what n-gram, Medusa,
    EAGLE and MTP run) accepting 1% too often passed every level before the fast-path row: it must fail it."""
    from specdec.eval.certificate import fast_path_checks

    import specdec.rejection as rejection

    sampling = SamplingConfig(True, 0.8, 50)
    exact, control = fast_path_checks(sampling)
    assert exact.passed and exact.control is None and not control.passed and control.as_expected
    walk, deterministic = rejection._walk, rejection._deterministic

    def biased(*args):
        def over_accepting(trees, logits, sampling, generator, try_children, *rest):
            def tried(cur, target, live, uniforms):
                return try_children(cur, target, live, uniforms / 1.01)  # u < 1.01 p / left
            return walk(trees, logits, sampling, generator, tried, *rest)

        monkeypatch.setattr(rejection, "_walk", over_accepting)
        try:
            return deterministic(*args)
        finally:
            monkeypatch.setattr(rejection, "_walk", walk)

    monkeypatch.setattr(rejection, "_deterministic", biased)
    assert not fast_path_checks(sampling)[0].passed


def test_another_seed_draws_the_statistics_anew():
    """--seed reached only the coupled and bit-exact levels: every rerun of a certificate drew the same samples,
    so a pass or a chance failure could not be repeated independently."""
    from dataclasses import replace

    from specdec.eval.certificate import sampler_checks

    from specdec.tree import DraftMode

    sizes = replace(CertificateSizes(), stat_samples=2000)

    def p_values(seed):
        checks, _ = sampler_checks([DraftMode.DETERMINISTIC], SamplingConfig(True, 0.8), sizes, set(), seed)
        return [c.p_value for c in checks]

    first = p_values(0)
    assert first[0] is not None and p_values(0) == first and p_values(1) != first


@pytest.mark.parametrize("sampling", [SamplingConfig(True, 0.8, 50), SamplingConfig(True, 1.5, 0, 0.999),
                                      SamplingConfig(True, 2.0, 6, 0.9999), SamplingConfig(True, 0.7, 3, 0.9),
                                      SamplingConfig(True, 0.9, min_p=0.01, eta_cutoff=0.02),
                                      SamplingConfig(True, 1.0, epsilon_cutoff=3e-4),
                                      SamplingConfig(True, typical_p=0.9), SamplingConfig(True, 1.2, top_h=0.9)],
                         ids=str)
def test_every_sampling_transform_bites_in_some_case(sampling):
    """The synthetic cases have 4-8 tokens: top-k 50 (the committed certificates' setting) removed no token of any
    of them, and top-p 0.999 at temperature 1.5 none either, so the exact-law and statistics levels claimed
    transforms they never ran. Each transform that is on must change the target of one case at least (the
    warpers after top-p too: an epsilon_cutoff of 3e-4 removes nothing of a 6-token law unless sharpened; the
    settings are ones where each warper can remove what the ones before it left)."""
    from dataclasses import replace

    from specdec.eval.certificate import acceptance_cases, sampler_cases
    from specdec.eval.synthetic_sampling import TRANSFORMS

    from specdec.sampling import logits_to_probs
    from specdec.tree import DraftMode

    def bites(cases, name, off):
        """The transform changes the target at a case's prefix, applied after the ones before it (temperature,
        top-h, top-k, top-p, ...): a top-k that top-p alone would cut to changes nothing of the final law but is
        still run."""
        names = list(TRANSFORMS)
        later = {n: TRANSFORMS[n] for n in names[names.index(name) + 1:]}
        def probs(c, **kw):
            return logits_to_probs(c.target_logits(c.prefix), replace(c.sampling, **later, **kw))

        return any(not torch.equal(probs(c), probs(c, **{name: off})) for c in cases)

    import specdec.eval.certificate as certificate

    levels = {"stats": list(sampler_cases(list(DraftMode), sampling).values()),
              "acceptance rows": [c for single, chain, _ in acceptance_cases(list(DraftMode), sampling).values()
                                  for c in (single, chain)],
              "exact": certificate.exact_law_cases(list(DraftMode), sampling)}
    for level, cases in levels.items():
        for name, off in TRANSFORMS.items():
            if getattr(sampling, name) != off:
                assert bites(cases, name, off), (level, name)


def test_acceptance_rows_check_deterministic_candidates_in_closed_form():
    """The acceptance-rate and chain-tau rows used an independent draft whatever the drafter: n-gram, Medusa, EAGLE
    and MTP propose deterministic candidates, whose closed form (sum of the candidates' target_probs) went
    unchecked. Their rows now run it, and always-accept fails them."""
    from dataclasses import replace

    from specdec.eval.certificate import sampler_checks

    from specdec.tree import DraftMode

    checks, _ = sampler_checks([DraftMode.DETERMINISTIC], SamplingConfig(True, 0.8, 50),
                               replace(CertificateSizes(), stat_samples=4000), set())
    rows = [c for c in checks if "deterministic candidates" in c.detail]
    assert {c.name for c in rows} == {"acceptance rate == sum(target_probs[candidates])",
                                      "chain tau == (1 - a^(k+1)) / (1 - a), k=4"}
    assert all(c.passed for c in rows if c.control is None) and len(rows) == 4
    assert not any(c.passed for c in rows if c.control == "always_accept")
    assert not any("independent draft" in c.detail for c in checks)  # n-gram draws nothing: not its kind


def test_end_to_end_checks_greedy_identity_on_the_default_speculation_policy():
    """Greedy identity ran only with speculation="always"; users run the default ("auto"), where the guard and the
    tree sizing choose between plain and speculative steps. A row checks that path too, and it can fail."""
    import specdec.eval.divergence as divergence
    from specdec.eval.certificate import default_policy_identity
    from specdec.eval.negative_controls import BROKEN_RULES

    from specdec.generation_config import GenerationConfig

    loaded, prompts = _fault_setup()
    sizes = CertificateSizes(identity_prompts=8, identity_tokens=32, sample_sequences=40, sample_tokens=1)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True, 0.9, 6), sizes, lambda n: prompts[:n],
                           levels=("e2e",))
    default = GenerationConfig().speculation
    rows = [c for c in cert.checks if f"speculation={default!r}" in c.name]
    assert len(rows) == 1 and rows[0].passed and rows[0].control is None, rows

    calls = []
    real = divergence.generate_with_control

    def spy(*args, **kwargs):
        calls.append(kwargs["speculation"])
        return real(*args, **kwargs)

    plain = generate(loaded, prompts, max_new_tokens=32)
    divergence.generate_with_control = spy
    try:
        assert default_policy_identity(loaded, prompts, "ngram", {}, sizes, plain).passed
    finally:
        divergence.generate_with_control = real
    assert calls == [default]
    broken = greedy_identity(loaded, prompts, "ngram", {}, 32, plain=plain, rule=BROKEN_RULES["always_accept"],
                             speculation=default)
    assert broken.real_mismatches > 0  # the speculation argument reaches generate(): this path can fail


def test_end_to_end_power_is_reported_at_the_level_the_check_decides_at(monkeypatch):
    """The sampled end-to-end check fails when Holm over its two tests (chi-square, KS) rejects at alpha, i.e. when
    one p-value is <= alpha / 2; its chi-square power was reported at alpha, more than the check had."""
    import specdec.eval.end_to_end as end_to_end
    from specdec.eval.statistics import holm
    from specdec.eval.two_sample import two_sample_chi2

    seen = []

    def recording(a, b, tv, alpha):
        seen.append((a, b, tv))
        return two_sample_chi2(a, b, tv, alpha)

    monkeypatch.setattr(end_to_end, "two_sample_chi2", recording)
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    sizes = CertificateSizes(sample_sequences=300, sample_tokens=1, e2e_tv=0.1)
    res = end_to_end.sampled_two_sample(loaded, [1, 2, 3, 1, 2], "ngram", {}, SamplingConfig(True), sizes)
    # the largest p-value of the chi-square alone that fails the check, by the certificate's own decision
    level = max(p for p in (sizes.alpha * x / 1000 for x in range(1, 1001))
                if holm({"chi2": p, "ks": 1.0}, sizes.alpha))
    (a, b, tv), = seen
    assert level == pytest.approx(sizes.alpha / 2)
    assert res["power"] == pytest.approx(two_sample_chi2(a, b, tv, level).power)
    assert res["power"] < two_sample_chi2(a, b, tv, sizes.alpha).power


def _late_oracle(reference, profile):
    """An oracle drafter that first proposes at the second step (as Medusa and EAGLE heads, which need the root's
    hidden state)."""
    from specdec.eval.oracle_drafter import OracleDrafter

    from specdec.tree import DraftTree

    class LateOracle(OracleDrafter):
        def _tree(self, view):
            return DraftTree.empty() if len(view.token_ids) == view.num_prompt_tokens else super()._tree(view)

    return LateOracle(reference, profile)


def test_sampled_end_to_end_check_verifies_drafts_for_the_compared_tokens():
    """With max_new_tokens = sample_tokens the step making the last compared token had no room for a draft, so a
    drafter that first proposes at the second step (Medusa and EAGLE heads need the root's hidden state) was never
    verified there: the check compared plain with plain, and a broken acceptance rule could not fail it."""
    import specdec.eval.end_to_end as end_to_end
    from specdec.eval.negative_controls import BROKEN_RULES
    from specdec.eval.oracle_drafter import AcceptanceProfile, reference_continuations

    loaded, prompts = _fault_setup()
    reference = reference_continuations(loaded, prompts[:1], 8)
    sizes = CertificateSizes(sample_sequences=20, sample_tokens=2, sample_later=0)  # the window: 2 tokens
    greedy_like = SamplingConfig(True, 1.0, 1)  # top-k 1: the oracle's greedy tokens are always accepted
    res = end_to_end.sampled_two_sample(loaded, prompts[0], _late_oracle(reference, AcceptanceProfile.constant(1.0, 4)),
                                        {}, greedy_like, sizes)
    assert res["tau"] > 1.4 and res["drafted"] == pytest.approx(0.5)  # the 2nd compared token: an accepted draft
    assert res["chi2_p"] > 0.5
    # a drafter that is always wrong, accepted by a broken rule, now changes the compared tokens
    wrong = _late_oracle(reference, AcceptanceProfile.constant(0.0, 4))
    broken = BROKEN_RULES["always_accept"]
    res = end_to_end.sampled_two_sample(loaded, prompts[0], wrong, {}, greedy_like, sizes, broken)
    assert res["chi2_p"] < 1e-4


def test_the_drafted_share_is_over_the_whole_window():
    """The "drafted" share counts the accepted drafts of the KS test's window (sample_tokens + sample_later), not the
    chi-square's first tokens alone."""
    import specdec.eval.end_to_end as end_to_end
    from specdec.eval.oracle_drafter import AcceptanceProfile, reference_continuations

    loaded, prompts = _fault_setup()
    reference = reference_continuations(loaded, prompts[:1], 8)
    sizes = CertificateSizes(sample_sequences=20, sample_tokens=2, sample_later=2)  # window 4, 5 tokens generated
    res = end_to_end.sampled_two_sample(loaded, prompts[0], _late_oracle(reference, AcceptanceProfile.constant(1.0, 4)),
                                        {}, SamplingConfig(True, 1.0, 1), sizes)
    # step 1 makes token 0 (no draft); step 2 verifies 3 drafts, all accepted, and adds its bonus: tokens 1-4.
    # Drafts in the window of 4: tokens 1, 2, 3 -> 3 / 4 (of the first 2 alone: 1 / 2)
    assert res["tau"] == pytest.approx(5 / 2) and res["drafted"] == pytest.approx(3 / 4)


def test_eval_lossless_takes_the_warper_flags(tmp_path, monkeypatch, capsys):
    """--top-k, --top-p, --min-p, --typical-p, --epsilon-cutoff, --eta-cutoff and --top-h reach the certificate's
    sampling setting; a value out of range is a one-line error before the model loads."""
    import specdec.eval.certificate as certificate

    from specdec.cli import main
    from specdec.testing import save_tiny_checkpoint

    seen = []

    def fake(loaded, drafter, options, sampling, *args, **kwargs):
        seen.append(sampling)
        raise KeyboardInterrupt

    monkeypatch.setattr(certificate, "run_certificate", fake)
    ckpt = save_tiny_checkpoint(tmp_path / "tiny")
    flags = ["--top-k", "7", "--top-p", "0.9", "--min-p", "0.05", "--typical-p", "0.9", "--epsilon-cutoff", "3e-4",
             "--eta-cutoff", "1e-3", "--top-h", "0.8"]
    main(["eval", "lossless", "--model", ckpt, "--temperature", "0.8", *flags, "--out", str(tmp_path / "cert")])
    assert seen == [SamplingConfig(True, 0.8, 7, 0.9, min_p=0.05, typical_p=0.9, epsilon_cutoff=3e-4,
                                   eta_cutoff=1e-3, top_h=0.8)]
    main(["eval", "lossless", "--model", ckpt, "--top-h", "0", "--out", str(tmp_path / "c0")])  # 0: off, as --top-k 0
    assert seen[-1] == SamplingConfig(True, 1.0)
    capsys.readouterr()
    code = main(["eval", "lossless", "--model", "nowhere", "--min-p", "2", "--out", str(tmp_path / "c2")])
    err = capsys.readouterr().err
    assert code == 2 and "error: --min-p must lie in [0, 1]" in err and len(err.strip().splitlines()) == 1, err
    # greedy: the warpers change nothing, and a certificate that recorded them said it checked what it never ran
    main(["eval", "lossless", "--model", ckpt, "--temperature", "0", "--top-k", "5", "--min-p", "0.05", "--out",
          str(tmp_path / "c3")])
    assert seen[-1] == SamplingConfig(False)
    assert "note: --top-k 5, --min-p 0.05 left out: at --temperature 0 (greedy)" in capsys.readouterr().err


def test_the_certificates_own_controls_log_no_warning_while_a_broken_rule_elsewhere_does(caplog):
    """`specdec eval lossless` printed six 'WARNING ... the output is NOT the target's distribution' lines for the
    controls it runs on purpose (and reports in its table); a broken rule built into generate() otherwise still
    warns."""
    import functools
    import logging

    from specdec.eval.negative_controls import BROKEN_RULES, generate_with_control

    from specdec.engine_setup import build_engine
    from specdec.generate import generate_with

    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    rule, fault = BROKEN_RULES["always_accept"], ENGINE_FAULTS["wrong_compaction_slot"]
    kw = dict(drafter="ngram", max_new_tokens=3)

    def said(run):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specdec.engine_setup"):
            run()
        return sorted(r.levelname for r in caplog.records if "NOT the target" in r.message or "injected" in r.message)

    assert said(lambda: generate_with_control(loaded, [[1, 2, 3, 1, 2]], rule=rule, fault=fault, **kw)) == \
        ["INFO", "INFO"]
    assert said(lambda: generate_with(functools.partial(build_engine, rule=rule, fault=fault), loaded,
                                      [[1, 2, 3, 1, 2]], **kw)) == ["WARNING", "WARNING"]


def test_the_end_to_end_level_says_each_check_as_it_starts_and_how_far_sampling_has_come(monkeypatch):
    """`specdec eval lossless` said '... end to end' and then nothing for the minutes its checks take on a CPU; then
    one line for the ~7 minutes of each 600-sequence sampled check: it now says how far both sides have sampled, and
    how far the pilot choosing where sampling starts has (a minute with the embedded model, silent before)."""
    from specdec.eval import end_to_end, sampled_start
    from specdec.eval.token_progress import TokenProgress

    # every tenth said at once (a real run waits 10 s between lines: a quick check says nothing more)
    monkeypatch.setattr(end_to_end, "TokenProgress", functools.partial(TokenProgress, quiet_seconds=0))
    monkeypatch.setattr(sampled_start, "TokenProgress", functools.partial(TokenProgress, quiet_seconds=0))
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    # 8 starts asked for: 2 found, one per prompt (the line said 8)
    sizes = CertificateSizes(identity_prompts=2, identity_tokens=8, sample_sequences=20, sample_tokens=1,
                             start_candidates=8, pilot_sequences=4)
    lines = []
    run_certificate(loaded, "ngram", {}, SamplingConfig(True), sizes, _prompts, levels=("e2e",),
                    progress=lines.append)
    inner = ("end to end: the exact rule: ", "end to end: always_accept: ")  # lines inside a sampled check
    said = [line for line in lines if not line.startswith((*inner, sampled_start.PILOT))]
    tokens = 1 + sizes.sample_later + sizes.sample_lookahead
    # the pilot choosing the start (a minute with the embedded model) said nothing while it sampled
    pilot = [line for line in lines if line.startswith(sampled_start.PILOT)]
    piloted = 2 * 4 * tokens  # starts x pilot_sequences x tokens (no eos)
    assert pilot and pilot[-1] == f"{sampled_start.PILOT}: 100% of the sampled tokens ({piloted} of {piloted})", pilot
    at = lines.index("end to end: choosing where sampling starts (a pilot of 4 sequences at 2 starts)")
    assert lines[at + 1:at + 1 + len(pilot)] == pilot  # said while it runs, before the check's first line
    total = 2 * 20 * tokens  # both sides, every sequence's tokens (no eos)
    for rule in ("the exact rule", "always_accept"):
        start = lines.index(f"end to end: 20 sampled sequences per side, {rule}")
        told = lines[start + 1:start + 1 + next(i for i, line in enumerate(lines[start + 1:] + [""])
                                                 if not line.startswith(f"end to end: {rule}: "))]
        sides = [line for line in told if "sampling, " in line]
        assert [line.split(" sampling, ")[0] for line in sides] == [f"end to end: {rule}: plain",
                                                                      f"end to end: {rule}: speculative"]
        assert told[0] == sides[0] and all(line.endswith(f" + {tokens} tokens") for line in sides)
        shares = [line for line in told if "% of the sampled tokens" in line]
        assert shares[-1] == f"end to end: {rule}: 100% of the sampled tokens ({total:,} of {total:,})" == told[-1]
        percents = [int(line.split(": ")[2].split("%")[0]) for line in shares]
        assert percents == sorted(set(percents)) and len(shares) == len(told) - 2
    assert said == ["end to end", "end to end: plain greedy decoding of 2 prompts x 8 tokens",
                    "end to end: greedy identity, the exact engine", "end to end: greedy identity, always_accept",
                    *[f"end to end: greedy identity, {name}" for name in ENGINE_FAULTS],
                    "end to end: greedy identity, the default speculation policy",
                    "end to end: the first tokens of 20 plain sampled sequences against the target's exact law",
                    "end to end: choosing where sampling starts (a pilot of 4 sequences at 2 starts)",
                    "end to end: 20 sampled sequences per side, the exact rule",
                    "end to end: 20 sampled sequences per side, always_accept"]


def test_an_outcome_of_probability_zero_leaves_the_fit_a_number_and_holm_tests_every_case():
    """The exact law holds outcomes of probability 0 (a candidate the warpers removed): pooled with the rare bins they
    made an empty bin expected to hold 0, a NaN p-value, which failed a one-case certificate with a correct sampler
    (and lost its run writing certificate.json) and, sorted among others, stopped Holm early: the cases after it
    went untested, and a lossy sampler passed."""
    import math

    from specdec.eval import certificate
    from specdec.eval.exact_law import step_law
    from specdec.eval.statistics import goodness_of_fit, holm

    from specdec.tree import DraftMode

    case = certificate.sampler_cases([DraftMode.INDEPENDENT], SamplingConfig(True, 0.8, top_k=50))
    law = dict(step_law(case["independent-(2, 1)"], EXACT)(case["independent-(2, 1)"].prefix))
    assert any(v == 0.0 for v in law.values())  # such laws are the certificate's own
    fit = goodness_of_fit([(0,)] * 480 + [(1,)] * 520, {(0,): 0.5, (1,): 0.5, (2,): 0.0}, 0.02, 0.01)
    assert math.isfinite(fit.p_value) and fit.p_value > 0.1
    assert holm({"fine": 0.5, "broken": math.nan, "lossy": 1e-9}, 0.01) == ["broken", "lossy"]


def test_the_certificate_records_its_seed():
    cert = run_certificate(build_tiny_model(), "ngram", {}, SamplingConfig(True, 0.8), CertificateSizes(),
                           lambda n: [[1, 2, 3]] * n, levels=("exact",), seed=5)
    assert cert.config["seed"] == 5 and "- seed: `5`" in cert.to_markdown()


def test_the_certificate_records_the_levels_it_ran_and_names_them_in_its_header():
    """A `--levels exact` certificate was headed 'Losslessness certificate: PASSED' over the sizes of levels that
    never ran, and its config did not say which levels had run."""
    cert = run_certificate(None, "ngram", {}, SamplingConfig(False), CertificateSizes(), _prompts,
                           levels=("exact",))
    assert cert.config["levels"] == ["exact"] and cert.to_json()["config"]["levels"] == ["exact"]
    assert cert.to_markdown().startswith("# Losslessness certificate (levels exact): PASSED\n")


def test_a_level_given_twice_runs_and_is_recorded_once(ckpt, tmp_path, capsys):
    """`--levels exact,exact` headed the certificate "(levels exact, exact)" and recorded the level twice in its config
    and its first line, for checks that ran once."""
    out = tmp_path / "cert"
    code, captured = run_main(["eval", "lossless", "--model", ckpt, "--levels", "exact,exact", "--out", str(out)],
                              capsys)
    assert code == 0 and ", levels exact, on " in captured.err, captured.err
    assert json.loads((out / "certificate.json").read_text())["config"]["levels"] == ["exact"]
    assert (out / "certificate.md").read_text().startswith("# Losslessness certificate (levels exact): PASSED\n")
    assert captured.out.startswith("certificate PASSED in ")


def test_a_power_below_0_9_never_prints_as_0_9():
    """A power of 0.8997 printed as 0.9 in the table ('power 0.90 < 0.9' in the warning); a TV a check detects
    is rounded up, never down to the TV it falls short of."""
    from specdec.eval.certificate import Certificate, Check, low_power_warning

    cert = Certificate({}, [Check("chi-square vs exact law (Holm)", "sampler-statistics", True, power=0.8997,
                                  detects_tv=0.020004)])
    assert "| 0.899 | 0.0201 |" in cert.to_markdown(), cert.to_markdown()
    warning = low_power_warning("sampler statistics: 300 draws per case", 0.8997, 0.020004, 0.02, "raise it")
    assert "detect TV 0.0201, not 0.02 (power 0.899 < 0.9 there)" in warning, warning


def test_a_test_too_small_to_catch_any_tv_says_so():
    """detectable_tv exceeds 1 for a handful of draws (about 10 a side): the table and the warning printed a TV no
    two laws can be apart by."""
    from specdec.eval.certificate import Certificate, Check, low_power_warning
    from specdec.eval.statistics import detectable_tv

    tv = detectable_tv(5, 0.001, 3)
    assert tv > 1
    cert = Certificate({}, [Check("chi-square vs exact law (Holm)", "sampler-statistics", True, power=0.01,
                                  detects_tv=tv)])
    assert "| none (> 1) |" in cert.to_markdown(), cert.to_markdown()
    warning = low_power_warning("end to end: 5 sequences", 0.01, tv, 0.1, "raise it")
    assert "detect no TV at all, not 0.1 (too few samples" in warning, warning


COUPLED_SMALL = CertificateSizes(stat_samples=4000, stat_tv=0.1, identity_prompts=2, identity_tokens=8,
                                 sample_sequences=400)


def test_the_coupled_level_warns_where_its_law_rows_are_underpowered(monkeypatch):
    """It said 'PASSED, underpowered (see the warnings)' with no warning at all (its model rows left out here)."""
    import specdec.eval.coupled_level as coupled_level
    from specdec.eval.certificate import Certificate

    monkeypatch.setattr(coupled_level, "engine_law_checks", lambda *args: ([], []))
    monkeypatch.setattr(coupled_level, "identity_checks", lambda *args: ([], []))
    few = CertificateSizes(stat_samples=200)
    checks, warnings = coupled_level.coupled_checks(None, "ngram", {}, SamplingConfig(True, 0.9), few, _prompts)
    cert = Certificate({}, checks, warnings)
    assert cert.underpowered and cert.verdict.startswith("PASSED, underpowered"), cert.to_markdown()
    assert len(warnings) == 1 and warnings[0].startswith("coupled law: 200 draws per case detect TV"), warnings
    assert warnings[0].endswith("< 0.9 there); raise --stat-samples"), warnings


def test_a_law_of_one_token_is_not_told_to_draw_more(monkeypatch):
    """At top-k 1 a case's law is one token: its chi-square has no power at any size, and the certificate's warning
    said "raise --stat-samples", which cannot help."""
    import specdec.eval.coupled_level as coupled_level

    one = SamplingConfig(True, 1.0, 1)
    _, warnings = sampler_checks([DraftMode.DETERMINISTIC], one, CertificateSizes(stat_samples=300), set())
    monkeypatch.setattr(coupled_level, "engine_law_checks", lambda *args: ([], []))
    monkeypatch.setattr(coupled_level, "identity_checks", lambda *args: ([], []))
    warnings += coupled_level.coupled_checks(None, "ngram", {}, one, CertificateSizes(stat_samples=300), _prompts)[1]
    assert len(warnings) == 2, warnings
    for warning in warnings:
        assert "raise --stat-samples" not in warning and "leave one token there" in warning, warning


def _coupled_walk_without_top_k(self, live, trees, target_logits):
    """Engine.coupled_walk that drops top-k, in plain and speculative decoding alike (a deliberately wrong engine)."""
    import dataclasses

    from specdec.coupling import coupled_sample

    keys = torch.tensor(self.noise_keys(live), dtype=torch.long)
    wrong = dataclasses.replace(self.sampling, top_k=0)
    return coupled_sample(trees, target_logits, wrong, self.coupling, keys, self.root_positions(live))


def test_the_coupled_level_fails_an_engine_whose_coupled_sampling_ignores_the_warpers(monkeypatch):
    """The law rows tested coupled_tokens() on made-up logits and the identity rows compared the engine with itself,
    so an engine that ignored top-k in every coupled step passed. The first tokens of plain coupled generate() are
    now tested against the target's exact law; its noise_reused control is caught, and the exact engine passes."""
    from specdec.eval.engine_law import ENGINE_LAW_CHECKS

    from specdec.engine import Engine

    ENGINE_LAW_CHECK = ENGINE_LAW_CHECKS["coupled"]

    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    top3 = SamplingConfig(True, 1.0, 3)
    cert = run_certificate(loaded, "ngram", {}, top3, COUPLED_SMALL, _prompts, levels=("coupled",), seed=1)
    rows = {c.control: c for c in cert.checks if c.name == ENGINE_LAW_CHECK}
    assert set(rows) == {None, "noise_reused"} and rows[None].passed and not rows["noise_reused"].passed
    assert cert.passed and not cert.void, cert.to_markdown()
    monkeypatch.setattr(Engine, "coupled_walk", _coupled_walk_without_top_k)
    broken = run_certificate(loaded, "ngram", {}, top3, COUPLED_SMALL, _prompts, levels=("coupled",), seed=1)
    failed = [c.name for c in broken.checks if c.control is None and not c.passed]
    # (its identity controls may go uncaught too, where the broken engine's drafts are never accepted: VOID)
    assert failed == [ENGINE_LAW_CHECK] and not broken.passed, broken.to_markdown()
    assert " outside the support" in broken.checks[[c.name for c in broken.checks].index(ENGINE_LAW_CHECK)].detail


def _rejection_walk_without_top_k(self, live, trees, target_logits):
    """Engine.rejection_walk that drops top-k, in plain and speculative decoding alike (a deliberately wrong
    engine)."""
    import dataclasses

    from specdec.rejection import rejection_sample

    wrong = dataclasses.replace(self.sampling, top_k=0)
    return rejection_sample(trees, target_logits, wrong, self.generator, self.rule)


def test_the_end_to_end_level_fails_an_engine_whose_plain_sampling_ignores_the_warpers(monkeypatch):
    """The default levels compared speculative sampling with the same engine's plain sampling and tested the
    acceptance rule on made-up logits, so an engine that ignored top-k in every step passed all of them. The first
    tokens of plain generate() are now tested against the target's exact law (a row of the end-to-end level:
    test_certificate_passes_and_every_control_is_caught); its draw_reused control is caught, and the exact engine
    passes."""
    from specdec.eval.engine_law import ENGINE_LAW_CHECKS, engine_law_checks

    from specdec.engine import Engine

    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    top3, prompts = SamplingConfig(True, 1.0, 3), _prompts(COUPLED_SMALL.identity_prompts)
    checks, _ = engine_law_checks(loaded, top3, COUPLED_SMALL, prompts, 1, "standard", "end-to-end")
    assert [(c.name, c.control, c.passed) for c in checks] == [(ENGINE_LAW_CHECKS["standard"], None, True),
                                                               (ENGINE_LAW_CHECKS["standard"], "draw_reused", False)]
    monkeypatch.setattr(Engine, "rejection_walk", _rejection_walk_without_top_k)
    broken, _ = engine_law_checks(loaded, top3, COUPLED_SMALL, prompts, 1, "standard", "end-to-end")
    assert not broken[0].passed and " 0 outside the support" not in broken[0].detail, broken[0].detail


def test_an_interrupted_overwrite_leaves_no_earlier_certificate(ckpt, tmp_path, monkeypatch, capsys):
    """--overwrite kept the earlier run's PASSED certificate until the new one was written: a run stopped in
    mid-way left it in --out as if it were this run's. It is removed once this run's inputs are known to be
    good (a run refused before then keeps it)."""
    import specdec.eval.certificate as certificate

    out = tmp_path / "cert"
    out.mkdir()
    for name in ("certificate.json", "certificate.md"):
        (out / name).write_text("an earlier run's\n")
    base = ["eval", "lossless", "--model", ckpt, "--levels", "e2e", "--out", str(out), "--overwrite"]
    code, captured = run_main([*base, "--identity-tokens", "100000"], capsys)  # refused after the model loads
    assert code == 2 and "--identity-tokens" in captured.err, captured.err
    assert (out / "certificate.json").read_text() == "an earlier run's\n"

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(certificate, "run_certificate", stopped)
    code, captured = run_main(base, capsys)
    assert code != 0
    assert not (out / "certificate.json").exists() and not (out / "certificate.md").exists()


def test_a_check_with_power_exactly_0_9_is_not_underpowered():
    """The sizes promise power 0.9 at their TV: a check that reaches exactly 0.9 keeps the plain PASSED; only a power
    below it reads 'underpowered'."""
    from specdec.eval.certificate import Certificate, Check

    at = Certificate({}, [Check("chi-square vs exact law (Holm)", "sampler-statistics", True, power=0.9)])
    assert not at.underpowered and at.verdict == "PASSED"
    below = Certificate({}, [Check("chi-square vs exact law (Holm)", "sampler-statistics", True, power=0.8999)])
    assert below.underpowered and below.verdict.startswith("PASSED, underpowered")


def test_a_detectable_tv_of_exactly_1_prints_as_a_number():
    """TV 1 is the largest two laws can be apart by, and a test that catches it with power 0.9 does catch something:
    its table cell reads 1, not 'none (> 1)'; only a TV above 1 does."""
    from specdec.eval.certificate import tv_text

    assert tv_text(1.0) == "1"
    assert tv_text(1.0001) == "none (> 1)"


def test_a_group_of_tests_detects_no_tv_where_one_of_them_detects_none():
    """A group's detectable TV is its weakest member's: where one test's outcomes fell in one bin (None, it detects
    nothing) the group detects nothing either, not the largest TV of the others."""
    from specdec.eval.certificate import _largest

    assert _largest([0.02, None, 0.03]) is None
    assert _largest([0.02, 0.03]) == 0.03  # every test detects a TV: the largest, 0.03


def test_the_sampler_statistics_report_power_at_the_level_holm_tests_each_case_at(monkeypatch):
    """Holm over k cases rejects a case at alpha / k at worst, so the power and detectable TV a row reports are those
    of a chi-square at that level: three draft modes, three cases, 0.01 / 3 each. At alpha itself they overstated
    what the statistics detect."""
    import specdec.eval.certificate as certificate

    from specdec.tree import DraftMode

    levels, real = [], certificate.goodness_of_fit

    def fit(samples, law, tv, alpha):
        levels.append(alpha)
        return real(samples, law, tv, alpha)

    monkeypatch.setattr(certificate, "goodness_of_fit", fit)
    certificate.sampler_checks(list(DraftMode), SamplingConfig(True), CertificateSizes(stat_samples=200), set())
    assert levels == [pytest.approx(0.01 / 3)] * 3


@pytest.mark.parametrize("smallest_p, passed", [(0.003, False), (0.004, True)])
def test_the_sampler_row_holds_holm_at_the_certificates_alpha_and_reports_its_weakest_case(monkeypatch, smallest_p,
                                                                                          passed):
    """Three cases at alpha 0.01: Holm rejects the smallest p-value below 0.01 / 3 = 0.00333, so 0.003 fails the
    row and 0.004 passes it (the other two, 0.5, are never rejected). The row's power is its weakest case's, 0.5 of
    (0.95, 0.5, 0.99): a certificate vouches for the case it detects least."""
    from types import SimpleNamespace

    import specdec.eval.certificate as certificate

    from specdec.tree import DraftMode

    fits = iter([SimpleNamespace(p_value=p, power=power, detects_tv=0.1)
                 for p, power in ((smallest_p, 0.95), (0.5, 0.5), (0.5, 0.99))])
    monkeypatch.setattr(certificate, "goodness_of_fit", lambda *a: next(fits))
    checks, _ = certificate.sampler_checks(list(DraftMode), SamplingConfig(True), CertificateSizes(stat_samples=200),
                                           set())
    row = next(c for c in checks if c.name == "chi-square vs exact law (Holm)")
    assert (row.passed, row.power) == (passed, 0.5)


@pytest.mark.parametrize("z, passed", [(3.9, True), (-3.9, True), (4.1, False), (-5.0, False)])
def test_a_chain_tau_row_fails_at_four_standard_errors(monkeypatch, z, passed):
    """The chain row passes while the measured tau lies within 4 standard errors of (1 - a^5) / (1 - a): z = 3.9
    passes, z = 4.1 (either sign) fails it."""
    import specdec.eval.certificate as certificate

    from specdec.tree import DraftMode

    monkeypatch.setattr(certificate, "acceptance_rate_test", lambda case, n, seed, rule: (0.5, 0.5, 0.5))
    monkeypatch.setattr(certificate, "chain_tau_test", lambda chain, n, seed, rule: (2.0, 2.0, z, None))
    checks, _ = certificate.sampler_checks([DraftMode.INDEPENDENT], SamplingConfig(True),
                                           CertificateSizes(stat_samples=200), set())
    chain_rows = [c for c in checks if c.name.startswith("chain tau")]
    assert chain_rows and all(c.passed is passed for c in chain_rows)


def test_an_underpowered_sampler_level_warns_once_however_many_controls_run():
    """The low-power warning is about the configuration's own row: 200 draws per case fall short of TV 0.02 for it
    and for each control alike (the same draws and law), and the warning came once more per control run."""
    from specdec.eval.certificate import sampler_checks

    from specdec.tree import DraftMode

    _, warnings = sampler_checks([DraftMode.INDEPENDENT], SamplingConfig(True), CertificateSizes(stat_samples=200),
                                 {"always_accept", "bonus_uniform"})
    assert len([w for w in warnings if "raise --stat-samples" in w]) == 1, warnings


@pytest.mark.parametrize("field", ["alpha", "stat_tv", "e2e_tv"])
def test_certificate_sizes_refuse_a_level_or_tv_of_1(field):
    """alpha 1 rejects every check of a correct engine, and TV 1 is the largest distance there is (nothing is left to
    detect): each must lie strictly inside (0, 1)."""
    with pytest.raises(ValueError, match="must lie in"):
        CertificateSizes(**{field: 1.0})


def test_full_sizes_state_the_tvs_the_docs_promise():
    """``--full`` detects TV 0.01 in the sampler statistics and 0.025 end to end (docs/evaluation.md, the CLI help):
    the TVs its power is reported and warned against."""
    full = CertificateSizes.full()
    assert (full.stat_tv, full.e2e_tv) == (0.01, 0.025)


@pytest.mark.parametrize("field", ["stat_samples", "identity_prompts", "identity_tokens", "sample_sequences",
                                   "sample_tokens", "start_candidates", "pilot_sequences"])
def test_certificate_sizes_refuse_a_count_of_0(field):
    """Every count is at least 1 (a level of 0 draws or prompts tests nothing and would read as passed)."""
    with pytest.raises(ValueError, match="must be >= 1"):
        CertificateSizes(**{field: 0})
    assert getattr(CertificateSizes(**{field: 1}), field) == 1


def _sampled_result(chi2_p: float = 0.5, ks_p: float = 0.5, drafted: float = 0.3, power: float = 0.95) -> dict:
    return {"chi2_p": chi2_p, "ks_p": ks_p, "drafted": drafted, "power": power, "detects_tv": 0.2, "tau": 1.5,
            "rejected": 0.1, "distinct_outcomes": 7}


def test_the_sampled_row_fails_when_holm_over_its_two_tests_rejects_at_alpha():
    """Holm over two p-values rejects when the smaller is <= alpha / 2. With alpha 0.01: a KS p of 0.004 (<= 0.005)
    fails the row whatever the chi-square says, a chi-square p of 0.004 fails it whatever the KS says, and two p-values
    of 0.006 (> 0.005; the larger is then not tested) pass it."""
    from types import SimpleNamespace

    from specdec.eval.certificate import sampled_row

    sizes, choice = CertificateSizes(alpha=0.01), SimpleNamespace(detail="start", candidates=(0, 1))
    verdicts = {ps: sampled_row("row", None, _sampled_result(*ps), sizes, choice)[0].passed
                for ps in ((0.9, 0.004), (0.004, 0.9), (0.006, 0.006), (0.9, 0.9))}
    assert verdicts == {(0.9, 0.004): False, (0.004, 0.9): False, (0.006, 0.006): True, (0.9, 0.9): True}
    check = sampled_row("row", "always_accept", _sampled_result(0.9, 0.004), sizes, choice)[0]
    assert (check.passed, check.control, check.p_value) == (False, "always_accept", 0.004)


def test_the_sampled_row_warns_when_drafts_were_almost_never_accepted_or_power_is_low():
    """The exact rule's row warns below 2% of the window's tokens from accepted drafts and below power 0.9; a
    control's row never warns (its failing is the point)."""
    from types import SimpleNamespace

    from specdec.eval.certificate import sampled_row

    sizes, choice = CertificateSizes(), SimpleNamespace(detail="start", candidates=(0, 1, 2))

    def warned(control=None, **res):
        return sampled_row("row", control, _sampled_result(**res), sizes, choice)[1]

    assert warned(drafted=0.3) == []
    rarely, = warned(drafted=0.01)
    assert "almost never accepted (1.0% of the window's 8 tokens" in rarely and "best of 3 starts" in rarely
    weak, = warned(power=0.5)
    assert "power" in weak and "--sample-sequences" in weak
    assert len(warned(drafted=0.01, power=0.5)) == 2
    assert warned("always_accept", drafted=0.01, power=0.5) == []


def test_two_sample_chi2_pools_a_rare_outcome_with_the_least_likely_common_one():
    """200 draws against 20: an outcome's expected count in the smaller sample is its total x 20 / 220. w (12 + 0
    draws) expects 1.09 there, so it pools with the least likely common outcome, x (103 x 20 / 220 = 9.36 against
    y's 9.55): the table is y [95, 10] against x + w [105, 10], df 1, effective size 200 x 20 / 220 = 18.18."""
    from scipy import stats
    from specdec.eval.statistics import detectable_tv
    from specdec.eval.two_sample import two_sample_chi2

    a = ["x"] * 93 + ["y"] * 95 + ["w"] * 12
    b = ["x"] * 10 + ["y"] * 10
    test = two_sample_chi2(a, b, tv=0.1, alpha=0.05)
    assert test.p_value == pytest.approx(stats.chi2_contingency([[95, 105], [10, 10]])[1])
    assert test.detects_tv == pytest.approx(detectable_tv(200 * 20 / 220, 0.05, 1))


def test_two_sample_chi2_never_pools_its_last_common_bin():
    """x (200 draws) and w (4 draws, expecting 2 per sample): pooling x into the rare bin too would leave one bin
    that tests nothing; kept apart, a side that never draws w is compared (df 1)."""
    from specdec.eval.two_sample import two_sample_chi2

    test = two_sample_chi2(["x"] * 100, ["x"] * 96 + ["w"] * 4, tv=0.1, alpha=0.05)
    assert test.detects_tv is not None and test.p_value < 1.0


def test_two_sample_chi2_tests_a_pooled_bin_expecting_under_five_draws_exactly():
    """50 draws against 5,000 of a law with one common outcome: the rare bin (28 draws in all) expects 0.28 in the
    smaller sample, where the chi-square's tail is not the statistic's. Three rare draws of 50 at the larger
    sample's rate 0.005 happen with probability 0.002, but the chi-square read p 2e-5, a failure at level 1e-3 (a
    correct sampler failed 1.4% of tests at level 1% at these sizes); Fisher's exact test keeps the level."""
    test = two_sample_chi2(["x"] * 47 + ["r"] * 3, ["x"] * 4975 + ["r"] * 25, tv=0.1, alpha=1e-3)
    assert test.p_value == pytest.approx(sps.fisher_exact([[47, 3], [4975, 25]]).pvalue)
    assert test.p_value > 1e-3


def test_two_sample_chi2_keeps_bins_expecting_exactly_five_draws():
    """50 draws a side, x 40 + 40, z 5 + 5, v 5 + 5: z and v each expect (5 + 5) x 50 / 100 = 5 per side, enough to
    stay bins of their own: df 2 at the effective size 50 x 50 / 100 = 25."""
    from specdec.eval.statistics import detectable_tv
    from specdec.eval.two_sample import two_sample_chi2

    a = ["x"] * 40 + ["z"] * 5 + ["v"] * 5
    assert two_sample_chi2(a, list(a), tv=0.1, alpha=0.05).detects_tv == pytest.approx(detectable_tv(25, 0.05, 2))


def _engine_law_on(monkeypatch, laws, supports):
    """engine_law_checks with the exact laws and the runner's kept tokens given per prompt, and every draw token 0
    (only the choice of the prompt and the warnings matter here)."""
    prompts = [[i] for i in range(len(laws))]
    monkeypatch.setattr(engine_law, "first_token_law", lambda loaded, prompt, sampling: laws[prompt[0]])
    monkeypatch.setattr(engine_law, "runner_support", lambda loaded, prompt, sampling: supports[prompt[0]])
    monkeypatch.setattr(engine_law, "sample_in_chunks",
                        lambda run, prompts, seed: [SimpleNamespace(new_tokens=[[0]] * len(prompts))])
    return engine_law.engine_law_checks(None, SamplingConfig(True), CertificateSizes(sample_sequences=100), prompts, 0,
                                        "coupled", "coupled")


def test_the_engine_law_row_samples_the_least_certain_prompt_where_both_implementations_keep_the_same_tokens(
        monkeypatch):
    # prompt 1 has the least certain first token (0.5) among those whose kept tokens agree; prompt 3 (0.4) does not
    laws = [{0: 0.9, 1: 0.1}, {0: 0.5, 1: 0.5}, {0: 0.7, 1: 0.3}, {0: 0.4, 1: 0.3, 2: 0.3}]
    checks, warnings = _engine_law_on(monkeypatch, laws, [{0, 1}] * 4)
    assert [c.detail.startswith("identity prompt 1: 2 tokens in the support, the likeliest at 0.5") for c in checks] \
        == [True, True], checks[0].detail
    assert not any("keep different tokens" in w for w in warnings), warnings
    _, warnings = _engine_law_on(monkeypatch, laws, [{0}] * 4)  # nowhere do they agree: said
    assert any("keep different tokens" in w for w in warnings), warnings
