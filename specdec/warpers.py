"""transformers' sampling warpers, op for op: which tokens each one removes from a row of scores.

    removed = removed_by_warpers(scores, sampling)   # [..., V] float32 scores (after temperature) -> [..., V] bool

transformers' ``generate(do_sample=True)`` applies, after the logits processors and in this order: temperature,
``top_h``, ``top_k``, ``top_p``, ``min_p``, ``typical_p``, ``epsilon_cutoff``, ``eta_cutoff``
(``GenerationMixin._get_logits_processor``). Each warper here runs the same torch operations as transformers' class
of that name (``TopHLogitsWarper``, ``TopKLogitsWarper``, ... in ``transformers.generation.logits_process``) on the
float32 scores the previous one left, so the set of tokens kept is transformers' bit for bit; tests compare them
with the installed transformers' classes. ``min_tokens_to_keep`` is 1, transformers' value without beam search.

Two departures, neither changing a kept set: nothing here reads the device (eta's cutoff is built with
``full_like`` where transformers copies a host tensor; the distributions skip argument validation, which would),
and a warper whose setting changes nothing (``min_p=0``, ``top_k >= V``) is not run.

A row with a NaN keeps it where a warper would remove it (see :func:`removed_by_warpers`): the sampler then finds
no law in that row and the engine reports it, instead of drawing from what the warpers left.
"""
from __future__ import annotations

from typing import Any

import torch

TOP_H_CANDIDATES = 100  # transformers' TopHLogitsWarper.top_n: tokens top-h considers at most


def active(sampling: Any, vocab: int) -> bool:
    """Whether any warper after temperature can remove a token of a ``vocab``-token row."""
    return (sampling.top_h is not None or 0 < sampling.top_k < vocab or sampling.top_p < 1.0 or sampling.min_p > 0
            or sampling.typical_p < 1.0 or sampling.epsilon_cutoff > 0 or sampling.eta_cutoff > 0)


def removed_by_warpers(scores: torch.Tensor, sampling: Any) -> torch.Tensor:
    """[..., V] float32 scores (the logits divided by the temperature, as transformers divides them) -> [..., V]
    bool: the tokens transformers' warpers (``sampling``: a SamplingConfig) set to -inf, each applied to what the
    previous ones left. Entries already -inf count as removed; NaN entries never do."""
    shape = scores.shape
    x = scores.reshape(-1, shape[-1])
    vocab = x.shape[-1]
    if sampling.top_h is not None:
        x = _top_h(x, sampling.top_h)
    if 0 < sampling.top_k < vocab:
        x = _top_k(x, sampling.top_k)
    if sampling.top_p < 1.0:
        x = _top_p(x, sampling.top_p)
    if sampling.min_p > 0:
        x = _min_p(x, sampling.min_p)
    if sampling.typical_p < 1.0:
        x = _typical(x, sampling.typical_p)
    if sampling.epsilon_cutoff > 0:
        x = _epsilon(x, sampling.epsilon_cutoff)
    if sampling.eta_cutoff > 0:
        x = _eta(x, sampling.eta_cutoff)
    return ((x == float("-inf")) & ~scores.reshape(-1, vocab).isnan()).reshape(shape)


def _categorical(logits: torch.Tensor) -> torch.distributions.Categorical:
    return torch.distributions.Categorical(logits=logits, validate_args=False)  # validation would read the device


def _top_h(scores: torch.Tensor, top_h: float) -> torch.Tensor:
    """TopHLogitsWarper: of the ``TOP_H_CANDIDATES`` most likely tokens, the longest most-likely-first prefix whose
    cumulative entropy terms stay within ``top_h`` times their distribution's entropy (the first always)."""
    top_logits, top_idx = torch.topk(scores, min(TOP_H_CANDIDATES, scores.shape[-1]), dim=-1, largest=True,
                                     sorted=True)
    dist = _categorical(top_logits)
    probs = dist.probs
    log_probs = torch.log(probs)
    tau = (dist.entropy() * top_h).unsqueeze(-1)
    cumulative_entropy = torch.cumsum(-probs * log_probs, dim=-1)
    selection = cumulative_entropy <= tau
    selection[:, 0] = True
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top_idx, selection)
    return scores.masked_fill(~keep, float("-inf"))


def _top_k(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """TopKLogitsWarper: below the k-th largest score removed (ties with it kept)."""
    kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
    return scores.masked_fill(scores < kth, float("-inf"))


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """TopPLogitsWarper: the least likely tokens whose probabilities sum to at most ``1 - top_p`` removed (by an
    ascending sort's running sum), the most likely kept."""
    sorted_logits, sorted_indices = torch.sort(scores, descending=False)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_remove = cumulative_probs <= (1 - float(top_p))
    sorted_remove[..., -1:] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, float("-inf"))


def _min_p(scores: torch.Tensor, min_p: float) -> torch.Tensor:
    """MinPLogitsWarper: probabilities below ``min_p`` times the largest one removed, the most likely kept."""
    probs = torch.softmax(scores, dim=-1)
    top_probs = probs.amax(dim=-1, keepdim=True)
    remove = probs < min_p * top_probs
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    return scores.masked_fill(remove, float("-inf"))


def _typical(scores: torch.Tensor, mass: float) -> torch.Tensor:
    """TypicalLogitsWarper: tokens by |-log p - entropy| ascending; those past the point where their probabilities
    reach ``mass`` removed (the most typical kept)."""
    mass = float(mass)
    normalized = torch.nn.functional.log_softmax(scores, dim=-1)
    p = torch.exp(normalized)
    ent = -(normalized * p).nansum(-1, keepdim=True)
    shifted_scores = torch.abs((-normalized) - ent)
    sorted_scores, sorted_indices = torch.sort(shifted_scores, descending=False)
    sorted_logits = scores.gather(-1, sorted_indices)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    last_ind = (cumulative_probs < mass).sum(dim=1)
    last_ind.clamp_(max=sorted_scores.shape[-1] - 1)
    sorted_remove = sorted_scores > sorted_scores.gather(1, last_ind.view(-1, 1))
    sorted_remove[..., :1] = 0
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return scores.masked_fill(remove, float("-inf"))


def _below(scores: torch.Tensor, probabilities: torch.Tensor, cutoff: torch.Tensor | float) -> torch.Tensor:
    """Epsilon / eta: probabilities below the cutoff removed, except the largest scores."""
    remove = probabilities < cutoff
    remove = remove & (scores < torch.topk(scores, 1)[0][..., -1, None])
    return scores.masked_fill(remove, float("-inf"))


def _epsilon(scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    """EpsilonLogitsWarper: probabilities below ``epsilon`` removed, the most likely kept."""
    return _below(scores, scores.softmax(dim=-1), float(epsilon))


def _eta(scores: torch.Tensor, epsilon: float) -> torch.Tensor:
    """EtaLogitsWarper: probabilities below ``min(epsilon, sqrt(epsilon) * exp(-entropy))`` removed, the most likely
    kept (transformers' float32 ``torch.tensor(epsilon)``, here one per row: the same values, no host copy)."""
    probabilities = scores.softmax(dim=-1)
    entropy = _categorical(scores).entropy()
    eps = torch.full_like(entropy, float(epsilon))
    eta = torch.min(eps, torch.sqrt(eps) * torch.exp(-entropy))[..., None]
    return _below(scores, probabilities, eta)
