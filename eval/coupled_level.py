"""The certificate's coupled-sampling level (``specdec eval lossless --levels coupled``).

Coupled sampling (:mod:`specdec.coupling`) promises two things, checked here:

1. **law**: plain coupled sampling draws the target's law. On small synthetic logit vectors under the
   certificate's sampling setting, ``stat_samples`` coupled draws over fresh sequence keys and
   over fresh positions of one key are tested against ``target_probs`` (chi-square, rare bins pooled,
   Holm over the cases, power at ``stat_tv`` reported). Control ``noise_reused`` (one noise row for every
   draw) must fail. Then through the engine on the model (:mod:`specdec.eval.engine_law`): the first tokens of
   plain coupled ``generate()`` against the exact law of the target's own logits; the identity rows below compare
   the engine with itself, so only this row sees an engine whose coupled sampling is wrong in plain and
   speculative decoding alike. Control ``noise_reused``: one noise key for every sequence.
2. **identity**: speculative coupled output equals plain coupled output token for token, batched and one
   prompt at a time, on the model with the drafter; a divergence whose perturbed-logit gap is below
   ``COUPLED_NEAR_TIE`` (1e-5) is reported as a numerical near-tie. Controls ``noise_keyed_to_step`` (plain
   vs speculative, both with the broken noise) and ``noise_keyed_to_batch_row`` (batched vs single, both
   broken) must fail.

    checks, warnings = coupled_checks(loaded, "ngram", {}, SamplingConfig(True, 0.8), sizes, make_prompts, seed=0)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from specdec.eval.certificate import CertificateSizes, Check, low_power_warning, more_draws
from specdec.eval.divergence import greedy_identity
from specdec.eval.engine_law import engine_law_checks
from specdec.eval.negative_controls import COUPLING_FAULTS, generate_with_control
from specdec.eval.statistics import goodness_of_fit, holm
from specdec.eval.synthetic_sampling import for_vocab

from specdec.coupling import Coupling, coupled_tokens
from specdec.sampling import SamplingConfig, logits_to_probs

LEVEL = "coupled"
LAW_VOCAB = 16
LAW_CASES = 3
LAW_FLATTENINGS = 8  # halvings of a case's logits at most, where the warpers leave it one token


def law_checks(sampling: SamplingConfig, sizes: CertificateSizes, seed: int) -> list[Check]:
    """The law rows, on LAW_VOCAB-token cases: top-k runs as at most LAW_VOCAB - 2 (:func:`for_vocab`), so a
    top-k of 16 or more (the certificates' 50) still removes tokens there instead of checking nothing."""
    requested, sampling = sampling, for_vocab(sampling, LAW_VOCAB)
    run_as = f"; top-k {requested.top_k} run as {sampling.top_k}" if sampling != requested else ""
    gen = torch.Generator().manual_seed(1234)
    n, cases = sizes.stat_samples, []
    for case in range(LAW_CASES):
        logits = torch.randn(LAW_VOCAB, generator=gen, dtype=torch.float64) * (1.0 + case)
        flattened = 0
        while True:  # a warper that leaves one token (top-p 0.9 on the sharpest case) leaves nothing to test
            law = {i: float(p) for i, p in enumerate(logits_to_probs(logits, sampling)) if p > 0}
            if len(law) > 1 or flattened == LAW_FLATTENINGS:
                break
            logits, flattened = logits / 2, flattened + 1
        flat = f"; logits halved {flattened} time(s) so that the warpers leave 2 tokens or more" if flattened else ""
        for vary in ("keys", "positions"):
            keys = torch.arange(n) * 7919 + case if vary == "keys" else torch.full((n,), case)
            positions = torch.full((n, 1), 3) if vary == "keys" else torch.arange(n)[:, None]
            noise = Coupling(seed).gumbel(keys, positions, LAW_VOCAB)[:, 0]  # [n, vocab]
            cases.append((f"case {case}, fresh {vary}", logits, law, noise, flat))
    level_alpha = sizes.alpha / len(cases)
    checks, pvalues = [], {}
    for name, logits, law, noise, flat in cases:
        tokens = coupled_tokens(logits.expand(n, -1), sampling, noise).tolist()
        fit = goodness_of_fit(tokens, law, sizes.stat_tv, level_alpha)
        pvalues[name] = fit.p_value
        checks.append(Check(f"plain coupled sampling == target law ({name})", LEVEL, True, None, p_value=fit.p_value,
                            samples=n, power=fit.power, detects_tv=fit.detects_tv,
                            detail=f"{len(law)} of {LAW_VOCAB} tokens in the support{run_as}{flat}"))
    rejected = holm(pvalues, sizes.alpha)  # names whose null is rejected, family-wise at alpha
    for c, (name, *_rest) in zip(checks, cases, strict=True):
        c.passed = name not in rejected
    name, logits, law, noise, _ = cases[0]
    reused = coupled_tokens(logits.expand(n, -1), sampling, noise[:1].expand(n, -1)).tolist()
    fit = goodness_of_fit(reused, law, sizes.stat_tv, level_alpha)
    checks.append(Check(f"plain coupled sampling == target law ({name})", LEVEL, fit.p_value > level_alpha,
                        "noise_reused", p_value=fit.p_value, samples=n, power=fit.power, detects_tv=fit.detects_tv))
    return checks


def identity_checks(loaded: Any, drafter: Any, options: dict, sampling: SamplingConfig, sizes: CertificateSizes,
                    prompts: list[list[int]], seed: int) -> tuple[list[Check], list[str]]:
    from specdec.generate import generate

    kw = dict(sampling.generate_kwargs(), do_sample=True, seed=seed, sampler="coupled")
    tokens = sizes.identity_tokens
    plain = generate(loaded, prompts, max_new_tokens=tokens, **kw)
    checks, warnings = [], []
    results = [greedy_identity(loaded, prompts, drafter, options, tokens, True, plain=plain, sampling=kw),
               greedy_identity(loaded, prompts[:2], drafter, options, tokens, False, plain=plain[:2], sampling=kw)]
    divergences = [d for r in results for d in r.divergences]
    real = sum(r.real_mismatches for r in results)
    detail = f"tau {results[0].tau:.2f}; {real} real mismatches, {len(divergences) - real} near-ties (gap < 1e-5)"
    if divergences:
        d = divergences[0]
        detail += f"; first: prompt {d.prompt} pos {d.position} gap {d.gap:.2e} ({d.kind})"
    checks.append(Check("speculative coupled == plain coupled (batched + single)", LEVEL, real == 0, None,
                        samples=sum(r.tokens_compared for r in results), detail=detail))
    if len(divergences) > real:
        warnings.append(f"coupled identity: {len(divergences) - real} divergences were numerical near-ties")
    if results[0].tau <= 1.0:
        warnings.append("coupled identity: no draft was accepted, so the accepted-draft path was never tested")
    # controls: both sides broken the same way, so only the broken coupling itself can tell them apart
    step = COUPLING_FAULTS["noise_keyed_to_step"]
    broken_plain = generate_with_control(loaded, prompts, fault=step, max_new_tokens=tokens, **kw)
    broken = greedy_identity(loaded, prompts, drafter, options, tokens, True, plain=broken_plain, sampling=kw,
                             fault=step)
    checks.append(Check("speculative coupled == plain coupled (batched)", LEVEL, broken.real_mismatches == 0,
                        step.name, samples=broken.tokens_compared, detail=f"tau {broken.tau:.2f}"))
    row = COUPLING_FAULTS["noise_keyed_to_batch_row"]
    batched = generate_with_control(loaded, prompts, fault=row, max_new_tokens=tokens, **kw)
    single = [generate_with_control(loaded, [p], fault=row, max_new_tokens=tokens, **kw)[0] for p in prompts]
    same = sum(a == b for a, b in zip(batched, single, strict=True))
    checks.append(Check("plain coupled batched == single", LEVEL, same == len(prompts), row.name,
                        samples=len(prompts), detail=f"{same}/{len(prompts)} prompts identical"))
    return checks, warnings


def coupled_checks(loaded: Any, drafter: Any, options: dict, sampling: SamplingConfig, sizes: CertificateSizes,
                   make_prompts: Callable[[int], list[list[int]]], seed: int = 0) -> tuple[list[Check], list[str]]:
    """Both parts; a greedy ``sampling`` is checked at temperature 1 (coupling only matters when sampling)."""
    sampling = sampling if sampling.do_sample else SamplingConfig(True)
    checks, warnings = law_checks(sampling, sizes, seed), []
    own = [c for c in checks if c.control is None]
    if min(c.power for c in own) < 0.9:
        detects = [c.detects_tv for c in own]
        detects = None if None in detects else max(detects)
        warnings.append(low_power_warning(f"coupled law: {sizes.stat_samples} draws per case",
                                          min(c.power for c in own), detects, sizes.stat_tv,
                                          more_draws(detects, "--stat-samples")))
    prompts = make_prompts(sizes.identity_prompts)
    for part in (identity_checks(loaded, drafter, options, sampling, sizes, prompts, seed),
                 engine_law_checks(loaded, sampling, sizes, prompts, seed, "coupled", LEVEL)):
        checks += part[0]
        warnings += part[1]
    return checks, warnings
