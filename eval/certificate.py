"""The losslessness certificate behind ``specdec eval lossless``.

Three levels, each run for the exact acceptance rule AND for the deliberately broken
rules of :mod:`specdec.eval.negative_controls` (which must fail; a control that passes a
level it should fail voids the certificate); the end-to-end greedy identity also runs the
broken engines there (an off-by-one tree mask, a wrong KV compaction slot):

1. ``exact-law``: float64 enumeration on small synthetic cases, for the drafter's mode(s) and the chosen
   sampling transform (each warper made to bite: :mod:`specdec.eval.synthetic_sampling`): emitted law == target
   law to 1e-12; with sampled modes also the selections of sampled trees (sizing, the combined drafter).
2. ``sampler-statistics``: the real vectorised sampler, many draws per case: chi-square with pooled bins (Holm
   over cases, power at the requested TV reported), a TV upper bound, acceptance rate and chain tau vs their
   closed forms for the drafter's draft kinds (:func:`acceptance_cases`).
3. ``end-to-end`` on the model: greedy token identity vs plain decoding (with divergence diagnostics), also under
   the default speculation policy; plain sampling's first tokens vs the model's exact law (``engine_law``); and
   sampled output vs plain sampling from a greedy-answer prefix where a pilot saw drafts accepted (``end_to_end``,
   ``sampled_start``: two-sample chi-square on the first tokens, KS on a longer window's log-probability).
4. ``coupled`` (:mod:`specdec.eval.coupled_level`, only when asked): coupled sampling's law (on synthetic logits,
   and through the engine's plain generate() against the model's exact first-token law), and
   speculative coupled output == plain coupled output token for token, batched and single, with
   broken couplings (noise keyed to the step, to the batch row) as its controls.
5. ``bitwise`` (:mod:`specdec.eval.bitwise_level`, only when asked): in the bit-exact mode, row logits of a
   batched tree forward == one-row forwards, and speculative text and log-probabilities == plain decoding's bit
   for bit; controls: the default path, and a product that depends on the row count.

A DraftError (the draft audit convicting the drafter) fails the check it stops, and the run goes on.

    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True, 0.8), CertificateSizes())
    cert.passed, cert.to_json(), cert.to_markdown()
"""
from __future__ import annotations

import decimal
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from specdec.eval.exact_law import SyntheticCase, emitted_law, max_abs_error, step_law, target_law
from specdec.eval.negative_controls import BROKEN_RULES, ENGINE_FAULTS
from specdec.eval.selection_law import selection_cases
from specdec.eval.statistics import (
    acceptance_rate_test,
    analytic_acceptance,
    chain_tau_test,
    goodness_of_fit,
    holm,
    run_sampler,
    total_variation_bound,
)
from specdec.eval.synthetic_sampling import biting, for_vocab, idle_everywhere, idle_transforms

from specdec.errors import first_line
from specdec.rejection import EXACT
from specdec.sampling import SamplingConfig
from specdec.tree import DraftError, DraftMode, DraftTree

logger = logging.getLogger(__name__)

EXACT_TOL = 1e-12
SHAPES = ((1,), (2,), (1, 1), (2, 1), (3, 1), (1, 1, 1))


@dataclass(frozen=True)
class CertificateSizes:
    # TVs are what each level must detect with power 0.9 against the hardest alternative (chi2_power)
    stat_samples: int = 50_000  # draws per synthetic case (sampler statistics): TV 0.02 in every case
    stat_tv: float = 0.02
    identity_prompts: int = 8
    identity_tokens: int = 64
    # per side, end-to-end sampling: on a 2-core CPU a batch of 600 sequences of 9 tokens (the embedded model,
    # n-gram) costs 0.5-2 min per side, enough power for TV 0.2 (0.025 needs --full, a GPU)
    sample_sequences: int = 600
    sample_tokens: int = 2
    # tokens past the chi-square's whose log-probability the KS test reads too (the window): its reach over a
    # sequence, for drafters wrong only after a few tokens or after a rejection (end_to_end.py)
    sample_later: int = 6
    # tokens sampled past the window: 1 lets its last token's step verify a draft for it (end_to_end.py)
    sample_lookahead: int = 1
    e2e_tv: float = 0.2
    alpha: float = 0.01
    # where the sampled check starts (specdec.eval.sampled_start): a pilot of pilot_sequences speculative
    # continuations at each of start_candidates greedy-answer prefixes, about a tenth of the check's sampling
    start_candidates: int = 8
    pilot_sequences: int = 32

    def __post_init__(self) -> None:
        counts = (self.stat_samples, self.identity_prompts, self.identity_tokens, self.sample_sequences,
                  self.sample_tokens, self.start_candidates, self.pilot_sequences)
        if min(counts) < 1 or min(self.sample_later, self.sample_lookahead) < 0:
            raise ValueError("certificate sample sizes must be >= 1 (sample_later and the lookahead >= 0)")
        if not 0 < self.alpha < 1 or not 0 < self.stat_tv < 1 or not 0 < self.e2e_tv < 1:
            raise ValueError("alpha and the TV targets must lie in (0, 1)")

    @classmethod
    def full(cls) -> "CertificateSizes":
        """Sized to detect TV 0.01 in the sampler statistics and 0.025 end to end (hours on a CPU; meant for a
        GPU)."""
        return cls(stat_samples=250_000, stat_tv=0.01, identity_prompts=20, identity_tokens=256,
                   sample_sequences=40_000, sample_tokens=2, sample_later=6, e2e_tv=0.025, start_candidates=20,
                   pilot_sequences=200)


@dataclass
class Check:
    name: str
    level: str  # exact-law | sampler-statistics | end-to-end | coupled | bitwise
    passed: bool
    control: str | None = None  # the broken rule this check ran with (it must then FAIL)
    p_value: float | None = None
    bound: float | None = None  # max abs error (exact law) or TV upper bound
    samples: int | None = None
    power: float | None = None  # at the size's stated TV, against the hardest alternative
    detects_tv: float | None = None  # the smallest TV caught with power 0.9
    detail: str = ""

    @property
    def as_expected(self) -> bool:
        return self.passed if self.control is None else not self.passed


@dataclass
class Certificate:
    config: dict
    checks: list[Check] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def uncaught(self) -> list[Check]:
        """The checks a negative control passed: each should have caught it."""
        return [c for c in self.checks if c.control is not None and c.passed]

    @property
    def void(self) -> bool:
        """A negative control passed a check that should have caught it."""
        return bool(self.uncaught)

    @property
    def passed(self) -> bool:
        return not self.void and all(c.passed for c in self.checks if c.control is None)

    @property
    def underpowered(self) -> bool:
        """A check of the configuration itself had power below 0.9 at its TV: its pass says less than it seems."""
        return any(c.control is None and c.power is not None and c.power < 0.9 for c in self.checks)

    @property
    def verdict(self) -> str:
        if self.void:
            missed = dict.fromkeys(f"{c.control} by {c.level} {c.name}" for c in self.uncaught)
            return f"VOID (a negative control was not caught: {'; '.join(missed)})"
        if not self.passed:
            return "FAILED"
        return "PASSED, underpowered (see the warnings)" if self.underpowered else "PASSED"

    def to_json(self) -> dict:
        return {"passed": self.passed, "void": self.void, "underpowered": self.underpowered, "config": self.config,
                "seconds": self.seconds, "warnings": self.warnings,
                "checks": [asdict(c) | {"as_expected": c.as_expected} for c in self.checks]}

    def to_markdown(self) -> str:
        verdict = self.verdict
        levels = self.config.get("levels")  # what ran: the sizes listed below include those of levels that did not
        ran = f" (levels {', '.join(levels)})" if levels else ""
        lines = [f"# Losslessness certificate{ran}: {verdict}", ""]
        lines += [f"- {k}: `{v}`" for k, v in self.config.items()]
        lines += [f"- wall time: {self.seconds:.1f} s", ""]
        for w in self.warnings:
            lines.append(f"> warning: {w}")
        lines += ["", "| level | check | control | result | p-value | bound | samples | power | detects TV | detail |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in self.checks:
            result = ("pass" if c.passed else "fail") + ("" if c.as_expected else " (UNEXPECTED)")
            if "not applicable" in c.detail:
                result = "n/a"
            lines.append(f"| {c.level} | {c.name} | {c.control or '-'} | {result} | {_fmt(c.p_value)} | "
                         f"{_fmt(c.bound)} | {c.samples or '-'} | {power_text(c.power)} | {tv_text(c.detects_tv)} | "
                         f"{c.detail} |")
        return "\n".join(lines) + "\n"


def _fmt(x: float | None, rounding: str = decimal.ROUND_HALF_EVEN) -> str:
    """``x`` to 3 significant digits (``-`` for None), rounded as ``rounding`` says (a decimal rounding mode)."""
    if x is None:
        return "-"
    if not math.isfinite(x) or x == 0:
        return f"{x:.3g}"
    return f"{float(decimal.Context(prec=3, rounding=rounding).create_decimal(repr(x))):.3g}"


def power_text(power: float | None) -> str:
    """A power to 3 significant digits, rounded DOWN: one below a threshold never reads as the threshold (0.8997
    is 0.899, not 0.9)."""
    return _fmt(power, decimal.ROUND_FLOOR)


def tv_text(tv: float | None) -> str:
    """The TV a test detects, to 3 significant digits, rounded UP: it never reads as a smaller TV than it is. Above 1
    (no two laws are that far apart: too few samples to be sure of catching any) it reads "none (> 1)"."""
    return "none (> 1)" if tv is not None and tv > 1 else _fmt(tv, decimal.ROUND_CEILING)


def _largest(tvs: Iterable[float | None]) -> float | None:
    """The TV a group of tests detects, each: None (nothing) where one of them detects none."""
    tvs = list(tvs)
    return None if None in tvs else max(tvs)


def _detects(tv: float | None, stated: float) -> str:
    """What a check's samples detect instead of the ``stated`` TV, in a warning: a TV, or none where their outcomes
    all fell in one bin."""
    if tv is None:
        return f"detect no TV at all, not {stated} (their outcomes fell in one bin: nothing to test)"
    if tv > 1:  # no two laws are further apart than TV 1
        return f"detect no TV at all, not {stated} (too few samples: even TV 1 is caught with power < 0.9)"
    return f"detect TV {tv_text(tv)}, not {stated}"


def low_power_warning(what: str, power: float, detects: float | None, stated: float, advice: str) -> str:
    """The warning of a check of the configuration whose power at the ``stated`` TV is below 0.9: ``what`` (its
    samples, e.g. "sampler statistics: 300 draws per case") detect ``detects`` instead; ``advice`` says what to
    raise."""
    return f"{what} {_detects(detects, stated)} (power {power_text(power)} < 0.9 there); {advice}"


def more_draws(detects: float | None, flag: str) -> str:
    """A low-power warning's advice for a test against an exact law: raise ``flag``, unless the law has one outcome
    (``detects`` None: goodness_of_fit keeps two bins wherever the law has two outcomes), which no number of draws
    tests further than its support."""
    if detects is not None:
        return f"raise {flag}"
    return ("the sampling settings leave one token there (top-k 1, or a top-p its likeliest token fills): a draw "
            f"off it still fails the check, but no {flag.split()[0]} gives it power")


def drafter_modes(drafter: Any, options: dict, sampling: SamplingConfig) -> list[DraftMode]:
    """The draft modes a drafter can propose in this configuration (all three if unknown)."""
    if drafter in ("ngram", "medusa", "eagle", "mtp"):
        return [DraftMode.DETERMINISTIC]
    if drafter in ("draft-model", "self-draft"):
        mode = options.get("mode", "auto")
        if mode == "auto":
            mode = "deterministic" if sampling.greedy or options.get("tree") == "dynamic" else "independent"
        return [DraftMode(mode)]
    return [DraftMode.INDEPENDENT, DraftMode.WITHOUT_REPLACEMENT, DraftMode.DETERMINISTIC]


# ---- level 1 --------------------------------------------------------------------------------
def transforms_note(sampling: SamplingConfig, cases: list[SyntheticCase]) -> str:
    """What a level's detail says of how its cases ran the sampling setting."""
    note = ""
    ks = sorted({c.sampling.top_k for c in cases})
    if sampling.do_sample and ks != [sampling.top_k]:
        note += f"; top-k {sampling.top_k} run as {'/'.join(map(str, ks))} (below each vocab, so that it bites)"
    idle = idle_everywhere(cases)
    if idle:
        note += f"; {', '.join(sorted(idle))} removed no token in any case"
    return note


def exact_law_cases(modes: list[DraftMode], sampling: SamplingConfig) -> list[SyntheticCase]:
    """Vocabularies 4 and 6, every shape and mode; top-k below each vocabulary and a target sharp enough for top-p
    to remove tokens in one case at least (:mod:`specdec.eval.synthetic_sampling`)."""
    return biting([SyntheticCase(v, shape, m, for_vocab(sampling, v), seed=v + 10 * i)
                   for i, (v, shape, m) in enumerate(itertools.product((4, 6), SHAPES, modes))])


def exact_law_checks(modes: list[DraftMode], sampling: SamplingConfig) -> list[Check]:
    cases = exact_law_cases(modes, sampling)
    checks = []
    for name, rule in [("exact", EXACT)] + list(BROKEN_RULES.items()):
        worst = max(max_abs_error(emitted_law(c, rule, 2), target_law(c, 2)) for c in cases)
        control = None if rule is EXACT else name
        if control and worst <= EXACT_TOL:
            detail = "identical to the exact rule for these modes: not applicable"
            checks.append(Check("emitted law == target law", "exact-law", False, control, bound=worst,
                                samples=len(cases), detail=detail))
            continue
        checks.append(Check("emitted law == target law", "exact-law", worst <= EXACT_TOL, control, bound=worst,
                            samples=len(cases), detail=f"{len(cases)} cases, vocab 4-6, depth <= 3, width <= 3"
                                                       f"{transforms_note(sampling, cases)}"))
    if sampling.do_sample and any(m is not DraftMode.DETERMINISTIC for m in modes):
        checks += selection_checks()
    if sampling.do_sample:
        checks += fast_path_checks(sampling)
    return checks


def random_deterministic_trees(vocab: int, gen: torch.Generator) -> list[DraftTree]:
    """A batch of deterministic trees of 0..7 nodes with random parents, siblings often repeating a token."""
    trees = []
    for _ in range(6):
        n = int(torch.randint(0, 8, (1,), generator=gen))
        parents = [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)]
        tokens = torch.randint(0, min(vocab, 5), (n,), generator=gen).tolist()
        trees.append(DraftTree(tokens, parents) if n else DraftTree.empty())
    return trees


def fast_path_checks(sampling: SamplingConfig, trials: int = 400) -> list[Check]:
    """The exact-law level enumerates the acceptance rule; the sampler users run takes shortcuts for deterministic
    trees (n-gram, Medusa, EAGLE, MTP) and for steps with no draft. Given the same generator, those shortcuts
    must draw what the full walk over the rule draws, draft for draft (a 2% bias in an acceptance ratio changes
    some draws); the control runs the walk with a rule that accepts every candidate."""
    from specdec.rejection import _stochastic, rejection_sample

    vocab = 6
    sampling = for_vocab(sampling, vocab)

    def disagreements(rule) -> int:
        gen, bad = torch.Generator().manual_seed(11), 0
        for trial in range(trials):
            # three batches in four of deterministic trees, the fourth of plain steps
            trees = random_deterministic_trees(vocab, gen) if trial % 4 else [DraftTree.empty()] * 3
            logits = torch.randn(len(trees), max(t.num_nodes for t in trees) + 1, vocab, generator=gen) * 2
            fast = rejection_sample(trees, logits, sampling, torch.Generator().manual_seed(trial), rule)
            walk = _stochastic(trees, logits, sampling, torch.Generator().manual_seed(trial), EXACT)
            bad += [(a.next_token, a.accepted_nodes) for a in fast] != [(a.next_token, a.accepted_nodes)
                                                                         for a in walk]
        return bad

    checks = []
    for control, rule in ((None, EXACT), ("always_accept", BROKEN_RULES["always_accept"])):
        bad = disagreements(rule)
        checks.append(Check("sampler's fast paths == full walk", "exact-law", bad == 0, control, samples=trials,
                            detail=f"{bad} of {trials} seeded batches drew otherwise (deterministic trees, plain "
                                   f"steps; vocab 6)"))
    return checks


def selection_checks() -> list[Check]:
    """Choosing or pruning sampled trees (tree sizing, the combined drafter) keeps the first token's law, and the
    broken selections of :mod:`specdec.eval.negative_controls` do not (:mod:`specdec.eval.selection_law`)."""
    checks = []
    for controls in (False, True):
        for name, case in selection_cases(controls).items():
            error = case.max_error()
            checks.append(Check(f"selection of sampled trees: {case.name}", "exact-law", error <= EXACT_TOL,
                                name if controls else None, bound=error, detail="first token, vocab 4"))
    return checks


# ---- level 2 --------------------------------------------------------------------------------
def sampler_cases(modes: list[DraftMode], sampling: SamplingConfig) -> dict[str, SyntheticCase]:
    """One synthetic case per draft mode, vocabulary 6, for the chi-square against the exact law (every sampling
    transform biting in one at least: :mod:`specdec.eval.synthetic_sampling`)."""
    shapes = {DraftMode.INDEPENDENT: (2, 1), DraftMode.WITHOUT_REPLACEMENT: (3,), DraftMode.DETERMINISTIC: (2, 2)}
    cases = biting([SyntheticCase(6, shapes[m], m, for_vocab(sampling, 6), seed=31 + i) for i, m in enumerate(modes)])
    return {f"{c.mode.value}-{c.widths}": c for c in cases}


def sampler_checks(modes: list[DraftMode], sampling: SamplingConfig, sizes: CertificateSizes,
                   applicable: set[str], seed: int = 0) -> tuple[list[Check], list[str]]:
    """``seed`` (the CLI's --seed) moves every draw: another seed is an independent repeat (0: the draws of the
    committed certificates)."""
    draws = 1000 * seed
    stat_sampling = sampling if sampling.do_sample else SamplingConfig(True)
    cases = sampler_cases(modes, stat_sampling)
    laws = {name: dict(step_law(c, EXACT)(c.prefix)) for name, c in cases.items()}
    n, level_alpha = sizes.stat_samples, sizes.alpha / len(cases)
    checks, warnings = [], []
    for rule_name, rule in [("exact", EXACT)] + [(r, BROKEN_RULES[r]) for r in sorted(applicable)]:
        fits, bounds = {}, {}
        for name, case in cases.items():
            samples, _ = run_sampler(case, rule, n=n, seed=7 + draws)
            fits[name] = goodness_of_fit(samples, laws[name], sizes.stat_tv, level_alpha)
            bounds[name] = total_variation_bound(samples, laws[name])
        rejected = holm({k: f.p_value for k, f in fits.items()}, sizes.alpha)
        control = None if rule is EXACT else rule_name
        power, detects = min(f.power for f in fits.values()), _largest(f.detects_tv for f in fits.values())
        checks.append(Check("chi-square vs exact law (Holm)", "sampler-statistics", not rejected, control,
                            p_value=min(f.p_value for f in fits.values()), bound=max(bounds.values()), samples=n,
                            power=power, detects_tv=detects,
                            detail=", ".join(f"{k}: p={f.p_value:.3g}" for k, f in fits.items())))
        if control is None and power < 0.9:
            warnings.append(low_power_warning(f"sampler statistics: {n} draws per case", power, detects,
                                              sizes.stat_tv, more_draws(detects, "--stat-samples")))
    acceptance = acceptance_cases(modes, stat_sampling)
    for kind, (single, chain, formula) in acceptance.items():
        for rule_name, rule in [("exact", EXACT), ("always_accept", BROKEN_RULES["always_accept"])]:
            control = None if rule is EXACT else rule_name
            rate, expected, p = acceptance_rate_test(single, n, seed=1 + draws, rule=rule)
            checks.append(Check(f"acceptance rate == {formula}", "sampler-statistics", p > sizes.alpha, control,
                                p_value=p, samples=n,
                                detail=f"{kind}, {single.widths[0]} per node; measured {rate:.4f}, expected "
                                       f"{expected:.4f}"))
            mean, tau, z, _ = chain_tau_test(chain, n, seed=2 + draws, rule=rule)
            checks.append(Check("chain tau == (1 - a^(k+1)) / (1 - a), k=4", "sampler-statistics", abs(z) < 4,
                                control, samples=n,
                                detail=f"{kind}, a = {formula}; measured {mean:.4f}, expected {tau:.4f}, z={z:.2f}"))
    rows = [c for single, chain, _ in acceptance.values() for c in (single, chain)]
    for name, group in (("sampler statistics", list(cases.values())), ("acceptance rows", rows)):
        if idle := idle_everywhere(group):
            warnings.append(f"{name}: {', '.join(sorted(idle))} removed no token in any synthetic case")
    return checks, warnings


def acceptance_cases(modes: list[DraftMode], sampling: SamplingConfig
                     ) -> dict[str, tuple[SyntheticCase, SyntheticCase, str]]:
    """The draft kinds of ``modes`` that have a closed-form acceptance (:func:`statistics.analytic_acceptance`):
    kind -> (one level of children, a prefix-independent chain of 4, the formula). Sampled modes: one independent
    child (drawing without replacement is the same for one child; several sampled siblings have no closed form).
    Deterministic candidates: two of them, and a chain. Seeds are the first from 21 that give an acceptance in
    [0.2, 0.8] (a candidate outside the target's top-k would make the rows trivial); top-k and top-p bite as in the
    other levels (:mod:`specdec.eval.synthetic_sampling`)."""
    kinds = {}
    if any(m is not DraftMode.DETERMINISTIC for m in modes):
        kinds["independent draft"] = (DraftMode.INDEPENDENT, 1, "sum(min(target_probs, draft_probs))")
    if DraftMode.DETERMINISTIC in modes:
        kinds["deterministic candidates"] = (DraftMode.DETERMINISTIC, 2, "sum(target_probs[candidates])")
    sampling = for_vocab(sampling, 8)

    def informative(make: Callable[[int], SyntheticCase], first: int) -> SyntheticCase:
        cases = [make(seed) for seed in range(first, first + 40)]
        moderate = [c for c in cases if 0.2 <= analytic_acceptance(c, c.prefix) <= 0.8]
        # one where every transform bites, else one that biting() may have to sharpen (lowering its acceptance),
        # else none is moderate (top-k 1: a is 0 or 1) and the rows are weak but still true
        return next((c for c in moderate if not idle_transforms(c)), (moderate or cases)[0])

    cases = []
    for mode, width, _ in kinds.values():
        cases.append(informative(lambda seed, m=mode, w=width: SyntheticCase(8, (w,), m, sampling, seed=seed), 21))
        cases.append(informative(lambda seed, m=mode: SyntheticCase(8, (1,) * 4, m, sampling, seed=seed,
                                                                    prefix_independent=True, draft_sharpness=1.0), 22))
    cases = biting(cases)
    return {kind: (cases[2 * i], cases[2 * i + 1], formula) for i, (kind, (*_, formula)) in enumerate(kinds.items())}


# ---- level 3 --------------------------------------------------------------------------------
def drafter_stopped(name: str, level: str, control: str | None, err: DraftError, where: str = "") -> Check:
    """The row of a check that a DraftError stopped (the draft audit convicted the drafter, or it proposed a tree
    that cannot be verified): FAILED, with the error's first line as its detail, and the certificate goes on with
    its other checks. Under a negative control too, as a row of the configuration (``control`` only named in the
    detail): the drafter is at fault there, not the broken rule, so it fails the certificate instead of counting
    as a control caught."""
    context = ", ".join(x for x in (where, f"under the {control} control" if control else "") if x)
    return Check(name, level, False, detail=f"{context}: {first_line(err)}" if context else first_line(err))


def sampled_row(name: str, control: str | None, res: dict, sizes: CertificateSizes, choice: Any
                ) -> tuple[Check, list[str]]:
    """The end-to-end sampled row from :func:`specdec.eval.end_to_end.sampled_two_sample`'s result ``res``, and its
    warnings (the exact rule's only): a chi-square on the first tokens and a log-probability KS on the window test
    one hypothesis, so Holm keeps the row's family-wise false-failure rate at ``sizes.alpha``."""
    from specdec.eval.end_to_end import window

    k, w = sizes.sample_tokens, window(sizes)
    ok = not holm({"chi2": res["chi2_p"], "ks": res["ks_p"]}, sizes.alpha)
    check = Check(name, "end-to-end", ok, control, p_value=min(res["chi2_p"], res["ks_p"]),
                  samples=sizes.sample_sequences, power=res["power"], detects_tv=res["detects_tv"],
                  detail=f"chi-square p={res['chi2_p']:.3g}, log-prob KS p={res['ks_p']:.3g}, tau {res['tau']:.3f}, "
                         f"{res['drafted']:.1%} of the window's tokens accepted drafts, {res['rejected']:.1%} rejected "
                         f"drafts per window token, {res['distinct_outcomes']} distinct outcomes of the first {k}; "
                         f"{choice.detail}")
    warnings = []
    # what matters is whether accepted drafts fed the window's tokens, not the lookahead past them
    if control is None and res["drafted"] < 0.02:
        warnings.append(f"end-to-end sampling: drafts were almost never accepted ({res['drafted']:.1%} of the "
                        f"window's {w} tokens; tau {res['tau']:.3f} over the whole generation) at the best of "
                        f"{len(choice.candidates)} starts a pilot tried, so this check mostly exercises the "
                        "rejection path; the sampler statistics cover acceptance")
    if control is None and res["power"] < 0.9:
        warnings.append(low_power_warning(f"end-to-end sampling: {sizes.sample_sequences} sequences per side",
                                          res["power"], res["detects_tv"], sizes.e2e_tv,
                                          "raise --sample-sequences (or use --full)"))
    return check, warnings


def end_to_end_checks(loaded: Any, drafter: Any, options: dict, sampling: SamplingConfig,
                      sizes: CertificateSizes, make_prompts: Callable[[int], list[list[int]]],
                      seed: int = 0, progress: Callable[[str], None] = lambda msg: None) -> tuple[list, list]:
    """The end-to-end level; ``progress`` is told each of its checks as it starts (minutes in all on a CPU). A check
    that a DraftError stops is a failed row (:func:`drafter_stopped`)."""
    from specdec.eval.divergence import greedy_identity
    from specdec.eval.end_to_end import check_seeds, sampled_two_sample, window
    from specdec.eval.engine_law import engine_law_checks
    from specdec.eval.sampled_start import choose_start

    checks, warnings = [], []
    from specdec.generate import generate

    prompts = make_prompts(sizes.identity_prompts)
    progress(f"end to end: plain greedy decoding of {len(prompts)} prompts x {sizes.identity_tokens} tokens")
    plain = generate(loaded, prompts, max_new_tokens=sizes.identity_tokens)
    # (control name or None, acceptance rule, engine fault): the exact engine, a broken rule, broken engines
    runs = [(None, EXACT, None), ("always_accept", BROKEN_RULES["always_accept"], None)]
    runs += [(name, EXACT, fault) for name, fault in ENGINE_FAULTS.items()]
    greedy_steps = [()] * len(prompts)  # where the exact engine's greedy drafts were accepted: none unless it ran
    for control, rule, fault in runs:
        progress(f"end to end: greedy identity, {control or 'the exact engine'}")
        name = "greedy identity vs plain decoding (" + ("batched + single)" if fault is None else "batched)")
        try:
            results = [greedy_identity(loaded, prompts, drafter, options, sizes.identity_tokens, True, rule,
                                       plain=plain, fault=fault)]
            # the unbatched path is checked for the exact engine and the broken rule; an engine fault
            # only has to be caught once, so it runs batched (it costs a full greedy decode each)
            if fault is None:
                results.append(greedy_identity(loaded, prompts[:2], drafter, options, sizes.identity_tokens, False,
                                               rule, plain=plain[:2]))
        except DraftError as err:
            checks.append(drafter_stopped(name, "end-to-end", control, err))
            continue
        if control is None:
            greedy_steps = results[0].step_lengths
        divergences = [d for r in results for d in r.divergences]
        real = sum(r.real_mismatches for r in results)
        ties = len(divergences) - real
        tau = results[0].tau
        detail = f"tau {tau:.2f}; {real} real mismatches, {ties} numerical near-ties"
        if divergences:
            d = divergences[0]
            detail += f"; first: prompt {d.prompt} pos {d.position} gap {d.gap:.2e} ({d.kind})"
        if fault is not None and real == 0 and tau <= 1.0:
            detail += "; no draft was accepted, so the engine fault was barely exercised, if at all"
        checks.append(Check(name, "end-to-end", real == 0, control, samples=sum(r.tokens_compared for r in results),
                            detail=detail))
        if control is None and ties:
            warnings.append(f"greedy identity: {ties} divergences were numerical near-ties (both tokens within 1e-3 of "
                            "the top logit)")
        if control is None and tau <= 1.0:
            warnings.append("greedy identity: no draft was accepted, so the accepted-draft path (tree-node logits, "
                            "KV compaction) was never tested and the engine-fault controls can hardly be caught")
    progress("end to end: greedy identity, the default speculation policy")
    checks.append(default_policy_identity(loaded, prompts, drafter, options, sizes, plain))
    e2e_sampling = sampling if sampling.do_sample else SamplingConfig(True)
    # the rows below compare speculative with plain sampling of this engine: this one tests plain sampling itself
    progress(f"end to end: the first tokens of {sizes.sample_sequences} plain sampled sequences against the "
             "target's exact law")
    law_checks, law_warnings = engine_law_checks(loaded, e2e_sampling, sizes, prompts, seed, "standard",
                                                 "end-to-end")
    checks += law_checks
    warnings += law_warnings
    k, w = sizes.sample_tokens, window(sizes)
    name = (f"sampled {w} tokens (of {w + sizes.sample_lookahead}) in a greedy answer vs plain sampling (chi-square "
            f"on the first {k}, log-probability KS on all {w})")
    # the start: a greedy-answer prefix where a pilot, on seeds the check never uses, saw drafts both accepted and
    # rejected (where all are rejected the accepted-draft path goes untested; where all are accepted the target is
    # near-certain and a rule that accepts everything passes); the pilot's draws are independent of the check's, so
    # the choice keeps its p-values exact (specdec.eval.sampled_start)
    try:
        choice = choose_start(loaded, prompts, plain, greedy_steps, drafter, options, e2e_sampling, sizes, seed,
                              progress)
    except DraftError as err:  # the pilot samples as the check does: the check cannot run either
        checks.append(drafter_stopped(name, "end-to-end", None, err, "in the pilot choosing its start"))
        return checks, warnings
    for rule_name, rule in (("exact", EXACT), ("always_accept", BROKEN_RULES["always_accept"])):
        control = None if rule is EXACT else rule_name
        progress(f"end to end: {sizes.sample_sequences} sampled sequences per side, "
                 f"{control or 'the exact rule'}")
        try:
            res = sampled_two_sample(loaded, choice.ids, drafter, options, e2e_sampling, sizes, rule,
                                     seeds=check_seeds(seed), progress=progress,
                                     what=f"end to end: {control or 'the exact rule'}")
        except DraftError as err:
            checks.append(drafter_stopped(name, "end-to-end", control, err))
            continue
        check, row_warnings = sampled_row(name, control, res, sizes, choice)
        checks.append(check)
        warnings += row_warnings
    return checks, warnings


def default_policy_identity(loaded: Any, prompts: list[list[int]], drafter: Any, options: dict,
                            sizes: CertificateSizes, plain: list[list[int]]) -> Check:
    """Greedy identity on the path users run: generate()'s default speculation policy ("auto"), whose break-even
    guard and tree sizing choose from measured costs between plain and speculative steps and how much of a tree to
    verify. Those choices read only what was fixed before the step's tokens were drawn (the exact-law level's
    selection rows check the sizer on sampled trees); greedy output must not depend on them at all. The negative
    controls cannot run here: a broken rule or engine always verifies whole (specdec.engine_setup)."""
    from specdec.eval.divergence import greedy_identity

    from specdec.generation_config import GenerationConfig

    policy = GenerationConfig().speculation
    name = f"greedy identity vs plain decoding, default speculation={policy!r} (batched)"
    try:
        res = greedy_identity(loaded, prompts, drafter, options, sizes.identity_tokens, True, plain=plain,
                              speculation=policy)
    except DraftError as err:
        return drafter_stopped(name, "end-to-end", None, err)
    real = res.real_mismatches
    detail = (f"speculation={policy!r}; tau {res.tau:.2f}; {real} real mismatches, "
              f"{len(res.divergences) - real} numerical near-ties")
    if res.tau <= 1.0:
        detail += "; the policy drafted nothing that was accepted (plain steps only, or every draft rejected)"
    return Check(name, "end-to-end", real == 0, samples=res.tokens_compared, detail=detail)


def where_it_ran(loaded: Any) -> dict:
    """The model's device and dtype, for the certificate's config (none without a model: the synthetic levels run
    on the CPU, in float64)."""
    runner = getattr(loaded, "runner", None)
    if runner is None:
        return {}
    return {"device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch.")}


def level_or_stopped(run: Callable[[], tuple[list[Check], list[str]]], level: str, name: str
                     ) -> tuple[list[Check], list[str]]:
    """``run()``, a level's (checks, warnings); where a DraftError stops it, one failed row ``name`` instead
    (:func:`drafter_stopped`), and the certificate goes on with its other levels."""
    try:
        return run()
    except DraftError as err:
        return [drafter_stopped(name, level, None, err)], []


def run_certificate(loaded: Any, drafter: Any, options: dict, sampling: SamplingConfig, sizes: CertificateSizes,
                    make_prompts: Callable[[int], list[list[int]]], levels: tuple[str, ...] = ("exact", "stats", "e2e"),
                    progress: Callable[[str], None] = lambda msg: None, seed: int = 0) -> Certificate:
    start = time.perf_counter()
    modes = drafter_modes(drafter, options, sampling)
    cert = Certificate({"model": getattr(loaded, "name", str(loaded)), **where_it_ran(loaded), "drafter": str(drafter),
                        "options": options, "sampling": asdict(sampling), "modes": [m.value for m in modes],
                        "levels": list(levels), "sizes": asdict(sizes),
                        "seed": seed})  # the seed moves every draw: a repeat needs it
    if cert.config.get("dtype", "float32") != "float32" and {"e2e", "coupled"} & set(levels):
        cert.warnings.append(f"the model runs in {cert.config['dtype']}: the identity checks' near-tie margins are "
                             "float32's, so a divergence at half-precision rounding counts as a real mismatch (run "
                             "in float32, or check the bit-exact mode with --levels bitwise)")
    if "exact" in levels or "stats" in levels:
        progress("exact law")
        checks = exact_law_checks(modes, sampling)
        if "exact" in levels:
            cert.checks += checks
        # a broken rule identical to the exact one for these modes is no control for the statistics either
        applicable = {c.control for c in checks if c.control and "not applicable" not in c.detail} & set(BROKEN_RULES)
    if "stats" in levels:
        progress("sampler statistics")
        checks, warnings = sampler_checks(modes, sampling, sizes, applicable, seed)
        cert.checks += checks
        cert.warnings += warnings
    if "e2e" in levels:
        progress("end to end")
        checks, warnings = end_to_end_checks(loaded, drafter, options, sampling, sizes, make_prompts, seed, progress)
        cert.checks += checks
        cert.warnings += warnings
    if "coupled" in levels:
        from specdec.eval.coupled_level import coupled_checks

        progress("coupled sampling")
        checks, warnings = level_or_stopped(lambda: coupled_checks(loaded, drafter, options, sampling, sizes,
                                                                   make_prompts, seed),
                                            "coupled", "speculative coupled == plain coupled")
        cert.checks += checks
        cert.warnings += warnings
    if "bitwise" in levels:
        from specdec.eval.bitwise_level import bitwise_checks

        progress("bit-exact mode")
        checks, warnings = level_or_stopped(lambda: bitwise_checks(loaded, drafter, options, sampling, sizes,
                                                                   make_prompts, seed),
                                            "bitwise", "text and log-probabilities == plain, bit for bit")
        cert.checks += checks
        cert.warnings += warnings
    # a control that is identical to the exact rule in this mode cannot be caught: it is neither pass nor void
    cert.checks = [c for c in cert.checks if "not applicable" not in c.detail] + [
        Check(c.name, c.level, False, c.control, bound=c.bound, detail=c.detail)
        for c in cert.checks if "not applicable" in c.detail]
    cert.seconds = time.perf_counter() - start
    return cert
