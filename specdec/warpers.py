"""transformers' sampling warpers: which tokens they remove from a row of scores.

    warped = warp(scores, sampling)   # [..., V] float32 scores (after temperature) -> the same, -inf where removed

transformers' ``generate(do_sample=True)`` applies, after the logits processors and in this order: temperature,
``top_h``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``
(``GenerationMixin._get_logits_processor``). Here the same order runs transformers' own warper classes on the
float32 scores, ``min_tokens_to_keep`` 1 (transformers' value without beam search), so the kept set is
transformers'; tests compare it with the list transformers builds.

Two warpers are computed here instead, as the same operations without a device synchronisation (a step may
synchronise once on CUDA): transformers' ``EtaLogitsWarper`` and ``TopHLogitsWarper`` build a validated
``Categorical`` (validation reads the device), and top-h writes through a boolean index. A warper whose setting
changes nothing (``min_p=0``, ``top_k >= V``) is not run.

Warpers only set scores to -inf: a kept token keeps its score. Only top-h can remove a NaN score
(:func:`specdec.sampling.sampling_logits` puts it back, so the sampler finds no law in such a row).
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

TOP_H_CANDIDATES = 100  # transformers' TopHLogitsWarper.top_n: tokens top-h considers at most

Warper = Callable[[torch.Tensor], torch.Tensor]  # [rows, V] float32 scores -> the same, removed tokens -inf


def active(sampling: Any, vocab: int) -> bool:
    """Whether any warper after temperature can remove a token of a ``vocab``-token row."""
    return bool(_steps(sampling, vocab))


def warp(scores: torch.Tensor, sampling: Any) -> torch.Tensor:
    """[..., V] float32 scores (the logits divided by the temperature, as transformers divides them) -> [..., V]:
    the scores transformers' warpers (``sampling``: a SamplingConfig) leave, each applied to what the previous ones
    left; removed tokens -inf."""
    shape = scores.shape
    x = scores.reshape(-1, shape[-1])
    for step in _steps(sampling, shape[-1]):
        x = step(x)
    return x.reshape(shape)


def _steps(sampling: Any, vocab: int) -> tuple[Warper, ...]:
    """The warpers ``sampling`` runs on ``vocab``-token rows (none for a setting that changes nothing)."""
    return _chain(sampling.top_h, sampling.top_k if 0 < sampling.top_k < vocab else 0, sampling.top_p,
                  sampling.min_p, sampling.typical_p, sampling.epsilon_cutoff, sampling.eta_cutoff)


@functools.lru_cache(maxsize=64)
def _chain(top_h: float | None, top_k: int, top_p: float, min_p: float, typical_p: float, epsilon: float,
           eta: float) -> tuple[Warper, ...]:
    """The warpers a setting runs, in transformers' order (built once per setting)."""
    from transformers import (
        EpsilonLogitsWarper,
        MinPLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    def theirs(warper) -> Warper:
        return lambda scores: warper(None, scores)  # warpers read the scores only

    chain: list[Warper] = []
    if top_h is not None:
        chain.append(functools.partial(_top_h, top_h=float(top_h)))
    if top_k > 0:
        chain.append(theirs(TopKLogitsWarper(int(top_k))))
    if top_p < 1.0:
        chain.append(theirs(TopPLogitsWarper(float(top_p))))
    if min_p > 0:
        chain.append(theirs(MinPLogitsWarper(float(min_p))))
    if typical_p < 1.0:
        chain.append(theirs(TypicalLogitsWarper(float(typical_p))))
    if epsilon > 0:
        chain.append(theirs(EpsilonLogitsWarper(float(epsilon))))
    if eta > 0:
        chain.append(functools.partial(_eta, epsilon=float(eta)))
    return tuple(chain)


def _categorical(scores: torch.Tensor) -> torch.distributions.Categorical:
    """Each row's softmax as transformers' warpers build it, unvalidated (validation reads the device)."""
    return torch.distributions.Categorical(logits=scores, validate_args=False)


def _top_h(scores: torch.Tensor, top_h: float) -> torch.Tensor:
    """transformers' TopHLogitsWarper: among the ``TOP_H_CANDIDATES`` likeliest tokens (renormalised), keep them in
    order while their running sum of ``-p log p`` stays within ``top_h`` times that distribution's entropy; the
    likeliest is always kept. (Its probabilities are the Categorical's, not a softmax: at top_h=1 the last term
    meets the budget exactly, and only the same numbers cut at the same token.)"""
    cand_scores, cand_ids = torch.topk(scores, min(TOP_H_CANDIDATES, scores.shape[-1]), dim=-1, sorted=True)
    dist = _categorical(cand_scores)
    budget = dist.entropy().unsqueeze(-1) * top_h
    within = torch.cumsum(-dist.probs * torch.log(dist.probs), dim=-1) <= budget
    within[:, 0] = True
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, cand_ids, within)
    return scores.masked_fill(~keep, float("-inf"))


def _eta(scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    """transformers' EtaLogitsWarper: remove probabilities below ``min(epsilon, sqrt(epsilon) * exp(-entropy))``,
    but never the top score (its float32 ``epsilon`` here as one value per row: the same numbers, no host tensor)."""
    eps = torch.full(scores.shape[:-1], epsilon, dtype=scores.dtype, device=scores.device)
    cutoff = torch.minimum(eps, eps.sqrt() * torch.exp(-_categorical(scores).entropy())).unsqueeze(-1)
    below = scores.softmax(dim=-1) < cutoff
    top = torch.topk(scores, 1).values
    return scores.masked_fill(below & (scores < top), float("-inf"))
