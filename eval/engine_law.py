"""The engine's own sampling on the model against the target's exact law (a row of the e2e and coupled levels).

The other sampled rows compare the engine with itself (speculative against plain, batched against single) or test
the acceptance rule on made-up logits, so an engine whose sampling is wrong in plain and speculative decoding alike
(a warper dropped, a wrong row's logits, noise or draws shared across sequences) passes them. Here the first new
tokens of ``sizes.sample_sequences`` plain ``generate()`` sequences (copies of one prompt), drawn by the sampler the
level certifies (``"standard"``: the rejection sampler's plain steps; ``"coupled"``: Gumbel-max noise), are tested
against :func:`first_token_law`: the transformers model's logits (an implementation independent of the engine's
runner) after the same temperature and warpers, in float64. Chi-square with rare bins pooled at ``sizes.alpha``,
power at ``sizes.e2e_tv``. Each sampler has a negative control that must fail: the engine giving every sequence of
a step one draw (``draw_reused``) or one noise key (``noise_reused``).

    checks, warnings = engine_law_checks(loaded, SamplingConfig(True, 0.8, 50), sizes, prompts, seed=0,
                                         sampler="standard", level="end-to-end")
"""
from __future__ import annotations

from typing import Any

import torch
from specdec.eval.certificate import CertificateSizes, Check, low_power_warning, more_draws
from specdec.eval.end_to_end import sample_in_chunks
from specdec.eval.negative_controls import LAW_FAULTS, generate_with_control
from specdec.eval.statistics import goodness_of_fit

from specdec.models import invariance_check
from specdec.models.loader import eval_mode
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import DraftTree

# each row's name (the CLI's advice for a void certificate reads them: --sample-sequences) and its control
ENGINE_LAW_CHECKS = {
    "standard": "plain sampling generate() on the model == the target's first-token distribution",
    "coupled": "plain coupled generate() on the model == the target's first-token distribution",
}
CONTROLS = {"standard": "draw_reused", "coupled": "noise_reused"}


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
                      seed: int, sampler: str, level: str) -> tuple[list[Check], list[str]]:
    """The row and its control (module doc) for ``sampler``, as ``level``'s checks. The prompt is the one whose
    first token is least certain, among those where the transformers model and the runner keep the same tokens (a
    warper's boundary not within rounding of a logit): chosen from the exact laws alone, never from draws, so the
    p-value stays exact."""
    laws = [first_token_law(loaded, p, sampling) for p in prompts]
    agree = [set(law) == runner_support(loaded, p, sampling) for p, law in zip(prompts, laws, strict=True)]
    best = max(range(len(prompts)), key=lambda i: (agree[i], 1.0 - max(laws[i].values())))
    prompt, law = prompts[best], laws[best]
    n, name = sizes.sample_sequences, ENGINE_LAW_CHECKS[sampler]
    kw = dict(sampling.generate_kwargs(), do_sample=True, sampler=sampler, max_new_tokens=1, return_dict=True)
    what = "coupled" if sampler == "coupled" else "standard sampling"
    checks, warnings = [], []
    for fault in (None, LAW_FAULTS[CONTROLS[sampler]]):
        outs = sample_in_chunks(lambda chunk, chunk_seed, f=fault: generate_with_control(
            loaded, chunk, fault=f, seed=chunk_seed, **kw), [prompt] * n, seed)
        tokens = [t[0] for o in outs for t in o.new_tokens if t]
        fit = goodness_of_fit(tokens, law, sizes.e2e_tv, sizes.alpha)
        outside = sum(t not in law for t in tokens)
        checks.append(Check(name, level, fit.p_value > sizes.alpha, fault and fault.name,
                            p_value=fit.p_value, samples=len(tokens), power=fit.power, detects_tv=fit.detects_tv,
                            detail=f"identity prompt {best}: {len(law)} tokens in the support, the likeliest "
                                   f"at {max(law.values()):.3g}; {len(set(tokens))} distinct first tokens drawn, "
                                   f"{outside} outside the support"))
    if not agree[best]:
        warnings.append(f"{what} law through the engine: at every identity prompt the transformers model and the "
                        "engine's runner keep different tokens (a warper's boundary within rounding of a logit), so "
                        "a token drawn at that boundary may fail the check")
    if checks[0].power < 0.9:
        warnings.append(low_power_warning(f"{what} law through the engine: {n} sequences", checks[0].power,
                                          checks[0].detects_tv, sizes.e2e_tv,
                                          more_draws(checks[0].detects_tv, "--sample-sequences (or use --full)")))
    return checks, warnings
