"""The certificate's sampling setting as its synthetic cases run it, so that every transform really transforms.

The exact-law and sampler-statistics levels use vocabularies of 4-8 tokens. There a top-k of 50 (the committed
certificates' setting) removes nothing, and :func:`specdec.sampling.sampling_logits` skips it outright, so those
levels would claim top-k without running it. Likewise a top-p close to 1 (0.999 at temperature 1.5) removes no
token of any case. So:

- :func:`for_vocab`: top-k is run as ``min(top_k, vocab - 2)``, which removes two tokens or more of every case (the
  value of k enters only through ``sampling_logits``, shared by the sampler and the exact law, so a smaller k
  exercises the same code; the end-to-end level runs k itself on the model's vocabulary);
- :func:`biting`: where a transform leaves the target of every case of a level unchanged at its prefix (top-p
  near 1), the level's first case is replaced by a copy with a sharper target, sharpened until it bites;
- :func:`idle_transforms`: the active transforms that change nothing of a case's target at its prefix, each taken
  after the ones applied before it (a top-k that top-p alone would have cut to is idle, as is one >= the vocab).

    cases = biting([SyntheticCase(6, (2, 1), mode, for_vocab(sampling, 6)) for mode in modes])
"""
from __future__ import annotations

import dataclasses

import torch
from specdec.eval.exact_law import SyntheticCase

from specdec.sampling import WARPERS, SamplingConfig, logits_to_probs

# a transform and the setting that turns it off, in the order sampling_logits applies them
TRANSFORMS = {"temperature": 1.0, **WARPERS}
SHARPEN_LIMIT = 8  # doublings of a case's target sharpness tried before giving up (2 ** 8 * 2: logits of +-1000)


def for_vocab(sampling: SamplingConfig, vocab: int) -> SamplingConfig:
    """``sampling`` with top-k at most ``vocab - 2`` (at least 1): it then removes tokens of a ``vocab``-token case."""
    if sampling.greedy or not sampling.top_k or sampling.top_k <= vocab - 2:
        return sampling
    return dataclasses.replace(sampling, top_k=max(1, vocab - 2))


def idle_transforms(case: SyntheticCase) -> set[str]:
    """The transforms of ``case.sampling`` that are on but change nothing at its prefix: each is applied in turn
    (temperature, then the warpers, as :func:`specdec.sampling.sampling_logits` does) and is idle where the target's
    probabilities after it equal those before it. None when decoding greedily (the argmax ignores them)."""
    sampling = case.sampling
    if sampling.greedy:
        return set()
    logits, idle = case.target_logits(case.prefix), set()
    stage = SamplingConfig(True, **TRANSFORMS)  # every transform off
    before = logits_to_probs(logits, stage)
    for name in TRANSFORMS:  # in the order they are applied
        stage = dataclasses.replace(stage, **{name: getattr(sampling, name)})
        after = logits_to_probs(logits, stage)
        if getattr(sampling, name) != TRANSFORMS[name] and torch.equal(before, after):
            idle.add(name)
        before = after
    return idle


def idle_everywhere(cases: list[SyntheticCase]) -> set[str]:
    """The transforms idle in every one of ``cases``."""
    return set.intersection(*(idle_transforms(c) for c in cases)) if cases else set()


def biting(cases: list[SyntheticCase]) -> list[SyntheticCase]:
    """``cases``, the first replaced by a copy with a sharper target when a transform is idle in all of them (and a
    sharper target makes it bite); the same list otherwise."""
    idle = idle_everywhere(cases)
    if not idle:
        return cases
    case = cases[0]
    for _ in range(SHARPEN_LIMIT):
        case = dataclasses.replace(case, target_sharpness=2 * case.target_sharpness)
        if not idle & idle_transforms(case):
            return [case] + cases[1:]
    return cases
