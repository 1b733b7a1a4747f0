"""The certificate's coupled-sampling level (``specdec eval lossless --levels coupled``).

Coupled sampling (:mod:`specdec.coupling`) promises two things, checked here:

1. **law**: plain coupled sampling draws the target's law. On small synthetic logit vectors under the
   certificate's sampling setting, ``stat_samples`` coupled draws over fresh sequence keys and
   over fresh positions of one key are tested against ``target_probs`` (chi-square, rare bins pooled,
   Holm over the cases, power at ``stat_tv`` reported). Control ``noise_reused`` (one noise row for every
   draw) must fail. Then through the engine on the model (:func:`engine_law_checks`): the first tokens of
   ``sample_sequences`` plain coupled ``generate()`` sequences against the exact law of the target's own
   logits (the transformers model's forward) after the same temperature and warpers, power at ``e2e_tv``; the
   identity rows below compare the engine with itself, so only this row sees an engine whose coupled sampling
   is wrong in plain and speculative decoding alike. Control ``noise_reused``: the engine with one noise key
   for every sequence.
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
from specdec.eval.certificate import CertificateSizes, Check, low_power_warning
from specdec.eval.divergence import greedy_identity
from specdec.eval.end_to_end import sample_in_chunks
from specdec.eval.negative_controls import COUPLING_FAULTS, generate_with_control
from specdec.eval.statistics import goodness_of_fit, holm
from specdec.eval.synthetic_sampling import for_vocab

from specdec.coupling import Coupling, coupled_tokens
from specdec.engine import Engine, SequenceState
from specdec.engine_setup import EngineFault
from specdec.models import invariance_check
from specdec.models.loader import eval_mode
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import DraftTree

LEVEL = "coupled"
LAW_VOCAB = 16
LAW_CASES = 3
# the law row that samples through the engine (its name, for the advice of a void certificate: --sample-sequences)
ENGINE_LAW_CHECK = "plain coupled generate() on the model == the target's first-token distribution"


class ReusedNoiseEngine(Engine):
    """Coupled sampling with one noise key for every sequence (negative control): copies of a prompt all draw the
    same text, so the first tokens of many sequences no longer follow the target's law."""

    @staticmethod
    def noise_keys(live: list[SequenceState]) -> list[int]:
        return [0] * len(live)


NOISE_REUSED = EngineFault("noise_reused", engine_cls=ReusedNoiseEngine)


def law_checks(sampling: SamplingConfig, sizes: CertificateSizes, seed: int) -> list[Check]:
    """The law rows, on LAW_VOCAB-token cases: top-k runs as at most LAW_VOCAB - 2 (:func:`for_vocab`), so a
    top-k of 16 or more (the certificates' 50) still removes tokens there instead of checking nothing."""
    requested, sampling = sampling, for_vocab(sampling, LAW_VOCAB)
    run_as = f"; top-k {requested.top_k} run as {sampling.top_k}" if sampling != requested else ""
    gen = torch.Generator().manual_seed(1234)
    n, cases = sizes.stat_samples, []
    for case in range(LAW_CASES):
        logits = torch.randn(LAW_VOCAB, generator=gen, dtype=torch.float64) * (1.0 + case)
        law = {i: float(p) for i, p in enumerate(logits_to_probs(logits, sampling)) if p > 0}
        for vary in ("keys", "positions"):
            keys = torch.arange(n) * 7919 + case if vary == "keys" else torch.full((n,), case)
            positions = torch.full((n, 1), 3) if vary == "keys" else torch.arange(n)[:, None]
            noise = Coupling(seed).gumbel(keys, positions, LAW_VOCAB)[:, 0]  # [n, vocab]
            cases.append((f"case {case}, fresh {vary}", logits, law, noise))
    level_alpha = sizes.alpha / len(cases)
    checks, pvalues = [], {}
    for name, logits, law, noise in cases:
        tokens = coupled_tokens(logits.expand(n, -1), sampling, noise).tolist()
        fit = goodness_of_fit(tokens, law, sizes.stat_tv, level_alpha)
        pvalues[name] = fit.p_value
        checks.append(Check(f"plain coupled sampling == target law ({name})", LEVEL, True, None, p_value=fit.p_value,
                            samples=n, power=fit.power, detects_tv=fit.detects_tv,
                            detail=f"{len(law)} of {LAW_VOCAB} tokens in the support{run_as}"))
    rejected = holm(pvalues, sizes.alpha)  # names whose null is rejected, family-wise at alpha
    for c, (name, *_rest) in zip(checks, cases, strict=True):
        c.passed = name not in rejected
    name, logits, law, noise = cases[0]
    reused = coupled_tokens(logits.expand(n, -1), sampling, noise[:1].expand(n, -1)).tolist()
    fit = goodness_of_fit(reused, law, sizes.stat_tv, level_alpha)
    checks.append(Check(f"plain coupled sampling == target law ({name})", LEVEL, fit.p_value > level_alpha,
                        "noise_reused", p_value=fit.p_value, samples=n, power=fit.power, detects_tv=fit.detects_tv))
    return checks


def first_token_law(loaded: Any, prompt: list[int], sampling: SamplingConfig) -> dict[int, float]:
    """The exact law of the first new token: the transformers model's logits at the prompt's last position (an
    implementation independent of the engine's runner) after ``sampling``'s temperature and warpers, in float64."""
    model = loaded.model
    with torch.inference_mode(), eval_mode(model):
        logits = model(torch.tensor([list(prompt)], device=model.device)).logits[0, -1]
    probs = logits_to_probs(logits.double().cpu(), sampling)
    return {i: p for i, p in enumerate(probs.tolist()) if p > 0}


def runner_support(loaded: Any, prompt: list[int], sampling: SamplingConfig) -> set[int]:
    """The tokens ``sampling`` keeps at the prompt's last position by the logits of the engine's own runner (one
    row, as plain decoding computes them)."""
    logits = invariance_check.decoded_logits(loaded.runner, list(prompt), DraftTree.empty())[0]
    return set(torch.nonzero(logits_to_probs(logits.double().cpu(), sampling)).flatten().tolist())


def engine_law_checks(loaded: Any, sampling: SamplingConfig, sizes: CertificateSizes, prompts: list[list[int]],
                      seed: int) -> tuple[list[Check], list[str]]:
    """The first tokens of ``sizes.sample_sequences`` plain coupled generate() sequences (copies of one prompt: each
    copy has its own noise key) against :func:`first_token_law`; chi-square with rare bins pooled at
    ``sizes.alpha``, power at ``sizes.e2e_tv``. The prompt is the one whose first token is least certain, among
    those where the transformers model and the runner keep the same tokens (a warper's boundary not within
    rounding of a logit): chosen from the exact laws alone, never from draws, so the p-value stays exact."""
    laws = [first_token_law(loaded, p, sampling) for p in prompts]
    agree = [set(law) == runner_support(loaded, p, sampling) for p, law in zip(prompts, laws, strict=True)]
    best = max(range(len(prompts)), key=lambda i: (agree[i], 1.0 - max(laws[i].values())))
    prompt, law = prompts[best], laws[best]
    n = sizes.sample_sequences
    kw = dict(sampling.generate_kwargs(), do_sample=True, sampler="coupled", max_new_tokens=1, return_dict=True)
    checks, warnings = [], []
    for fault in (None, NOISE_REUSED):
        outs = sample_in_chunks(lambda chunk, chunk_seed, f=fault: generate_with_control(
            loaded, chunk, fault=f, seed=chunk_seed, **kw), [prompt] * n, seed)
        tokens = [t[0] for o in outs for t in o.new_tokens if t]
        fit = goodness_of_fit(tokens, law, sizes.e2e_tv, sizes.alpha)
        outside = sum(t not in law for t in tokens)
        checks.append(Check(ENGINE_LAW_CHECK, LEVEL, fit.p_value > sizes.alpha, fault and fault.name,
                            p_value=fit.p_value, samples=len(tokens), power=fit.power, detects_tv=fit.detects_tv,
                            detail=f"identity prompt {best + 1}: {len(law)} tokens in the support, the likeliest "
                                   f"at {max(law.values()):.3g}; {len(set(tokens))} distinct first tokens drawn, "
                                   f"{outside} outside the support"))
    if not agree[best]:
        warnings.append("coupled law through the engine: at every identity prompt the transformers model and the "
                        "engine's runner keep different tokens (a warper's boundary within rounding of a logit), so "
                        "a token drawn at that boundary may fail the check")
    if checks[0].power < 0.9:
        warnings.append(low_power_warning(f"coupled law through the engine: {n} sequences", checks[0].power,
                                          checks[0].detects_tv, sizes.e2e_tv,
                                          "raise --sample-sequences (or use --full)"))
    return checks, warnings


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
        warnings.append(low_power_warning(f"coupled law: {sizes.stat_samples} draws per case",
                                          min(c.power for c in own), None if None in detects else max(detects),
                                          sizes.stat_tv, "raise --stat-samples"))
    prompts = make_prompts(sizes.identity_prompts)
    for part in (identity_checks(loaded, drafter, options, sampling, sizes, prompts, seed),
                 engine_law_checks(loaded, sampling, sizes, prompts, seed)):
        checks += part[0]
        warnings += part[1]
    return checks, warnings
