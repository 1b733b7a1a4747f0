"""Sampling configuration and the logits -> probabilities transform.

The same transform (transformers' sampling warpers in the order its ``generate`` applies them: temperature,
top-h, top-k, top-p, min-p, typical, epsilon, eta; :mod:`specdec.warpers`) is applied to the target's logits here
and by every drafter to its own logits, so that ``target_probs`` and ``draft_probs`` live in the same space. The
warpers decide which tokens to remove in float32, as transformers does, also when given float64 logits.
Greedy decoding (``do_sample=False``) is the temperature-0 limit: a one-hot at argmax.

A row with no law to choose from (NaN logits, +inf logits when sampling, every token masked to -inf) never
yields a token: :func:`sample` and :func:`choose_max` give it the id ``vocab``, outside the vocabulary, and the
engine turns that into an :class:`InvalidLogitsError` naming the step and the sequence after the host copy it
already makes (no extra device sync).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec import warpers
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.generate_inputs import describe


class InvalidLogitsError(SpecdecError, RuntimeError):
    """The target's logits at a step leave no token to choose: NaN or infinite values (a float16 overflow, a
    damaged checkpoint) or every token removed (a logits processor, a sampling warper over -inf logits). Raised by
    generate() after its prefill, ``new_tokens`` holds each sequence's tokens generated until then (in the output's
    order; else None), as :class:`~specdec.kv_cache.CacheFullError`'s."""

    def __init__(self, message: str, new_tokens: list[list[int]] | None = None) -> None:
        super().__init__(message)
        self.new_tokens = new_tokens


# transformers' sampling warpers after temperature, in the order it applies them, with the value that turns each off
WARPERS: dict[str, Any] = {"top_h": None, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
                           "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


@dataclass(frozen=True)
class SamplingConfig:
    """A call's sampling transform, as ``generate()`` resolved it from its arguments and the GenerationConfig:
    greedy, or temperature then transformers' warpers in transformers' order (each field's comment says when it is
    off). Drafters read it as ``TargetView.sampling`` to draft from the law the target samples."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0  # 1.0 = disabled
    min_p: float = 0.0  # 0 = disabled; keeps probabilities >= min_p * the largest one
    typical_p: float = 1.0  # 1.0 = disabled; the most locally typical tokens up to this mass
    epsilon_cutoff: float = 0.0  # 0 = disabled; keeps probabilities >= epsilon_cutoff
    eta_cutoff: float = 0.0  # 0 = disabled; keeps probabilities >= min(eta, sqrt(eta) * exp(-entropy))
    top_h: float | None = None  # None = disabled (top_h=1.0 still keeps 100 tokens at most, as in transformers)

    def __post_init__(self) -> None:
        # one-line InputError / InputTypeError naming the argument (specdec.errors); bools are not numbers here
        if not isinstance(self.do_sample, bool):
            raise InputTypeError(f"do_sample must be True or False, got {describe(self.do_sample)}")
        for name in ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"):
            value = getattr(self, name)
            if name == "top_h" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InputTypeError(f"{name} must be a number{' or None' if name == 'top_h' else ''}, "
                                     f"got {describe(value)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral):
            raise InputTypeError(f"top_k must be an int >= 0 (0 disables it), got {describe(self.top_k)}")
        if self.do_sample and not self.temperature > 0:
            raise InputError(
                f"temperature must be > 0 when sampling, got {self.temperature}; "
                "use do_sample=False for greedy decoding"
            )
        if not 0 <= self.temperature < math.inf:
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:  # 0 keeps only the most likely token, as transformers' TopPLogitsWarper
            raise InputError(f"top_p must lie in [0, 1], got {self.top_p}")
        # transformers' own ranges; where transformers skips a value silently (typical_p > 1, a cutoff outside
        # (0, 1)), specdec refuses it rather than ignore it
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p must lie in [0, 1] (0 disables it), got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise InputError(f"typical_p must lie in (0, 1] (1 disables it), got {self.typical_p}")
        for name in ("epsilon_cutoff", "eta_cutoff"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InputError(f"{name} must lie in [0, 1) (0 disables it), got {getattr(self, name)}")
        if self.top_h is not None and not 0.0 < self.top_h <= 1.0:
            raise InputError(f"top_h must lie in (0, 1] or be None (None disables it), got {self.top_h}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample

    def generate_kwargs(self) -> dict[str, Any]:
        """This setting as ``generate()`` keyword arguments: ``do_sample``, ``temperature`` and every warper."""
        return {"do_sample": self.do_sample, "temperature": self.temperature,
                **{name: getattr(self, name) for name in WARPERS}}

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> SamplingConfig:
        """The setting of ``generate()`` keyword arguments (the others ignored; unset ones off)."""
        return cls(**{k: v for k, v in kwargs.items() if k in ("do_sample", "temperature", *WARPERS)})


def sampling_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] temperature-scaled logits, -inf where transformers' warpers remove the
    token (float32, or float64 if given float64): softmax gives ``target_probs``; coupled sampling
    (:mod:`specdec.coupling`) adds Gumbel noise to them. Sampling only (greedy has no temperature).

    Which tokens the warpers remove is decided in float32, by transformers' operations
    (:mod:`specdec.warpers`), also for float64 logits: float32 logits carried in float64 are cut exactly where
    transformers cuts them; the kept values stay in the given precision."""
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(dtype) / sampling.temperature
    if not warpers.active(sampling, logits.shape[-1]):
        return scaled
    if dtype == torch.float32:
        warped = warpers.warp(scaled, sampling)
    else:
        cut = warpers.warp(logits.to(torch.float32) / sampling.temperature, sampling) == float("-inf")
        warped = scaled.masked_fill(cut, float("-inf"))
    if sampling.top_h is not None:
        # top-h can remove a NaN score (the other warpers never do: a comparison with NaN is false); it comes back,
        # so the row has no law and the sampler reports it, instead of drawing from what top-h left
        warped = torch.where(scaled.isnan(), scaled, warped)
    return warped


def logits_to_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] probabilities (float32, or float64 if given float64)."""
    if sampling.greedy:
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = torch.zeros_like(logits, dtype=dtype)
        return out.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return sampling_logits(logits, sampling).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None, uniforms: torch.Tensor | None = None
           ) -> torch.Tensor:
    """Draw one token per row of [..., vocab] probs (need not sum to 1) -> [...] int64, by inverting the float64
    cumulative sum at one uniform draw per row (``uniforms`` [...] float64 when drawn already, else from
    ``generator``).

    Why not ``torch.multinomial``: on the CPU it is many times slower per vocabulary-wide row, and the engine draws
    once per sequence per sampled step. This is exact up to float64 rounding (float32 multinomial misses tokens
    below ~3e-8 of the running sum), and a zero-probability token is never drawn: a zero adds nothing to the running
    sum, so the first index whose sum exceeds the point drawn (in ``[0, total)``) has a positive probability. A row
    whose sum is not finite and positive gets the id ``vocab``. No host sync."""
    flat = probs.reshape(-1, probs.shape[-1])
    u = (torch.rand(flat.shape[0], 1, generator=generator, dtype=torch.float64, device=flat.device)
         if uniforms is None else uniforms.reshape(-1, 1))
    return sample_each(flat, u).reshape(probs.shape[:-1])


def sample_each(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[R, vocab] probs, [R, k] float64 uniforms -> [R, k] int64: k independent draws per row, as :func:`sample`
    draws one (a row with no law: the id ``vocab``), from one cumulative sum per row."""
    running = probs.to(torch.float64).cumsum(-1)  # [R, V]
    total = running[:, -1:]  # [R, 1]
    point = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))  # [R, k] in [0, total)
    tokens = torch.searchsorted(running, point, right=True)  # [R, k]
    no_law = ~(torch.isfinite(total) & (total > 0))  # [R, 1]: NaN / inf probabilities, or none left
    return tokens.masked_fill_(no_law, probs.shape[-1])


def choose_max(logits: torch.Tensor) -> torch.Tensor:
    """[..., vocab] -> [...] int64 argmax, as greedy decoding takes it; a row holding a NaN, or only -inf, gets
    the id ``vocab`` (outside the vocabulary, see the module docstring). No host sync."""
    values, tokens = logits.max(-1)  # max propagates NaN, and NaN > -inf is False
    return torch.where(values > float("-inf"), tokens, logits.shape[-1])


def check_chosen(acceptances: Sequence[Any], vocab: int, where: Callable[[int], tuple[int, int, int]]) -> None:
    """Raise InvalidLogitsError if a step chose the id ``vocab`` (a row with no law, see the module docstring).
    ``acceptances``: one step's records (``next_token`` ints, already on the host); ``where(b)``: (sequence id, step
    number, new tokens before the step) of record b, asked only for the error message."""
    for b, acc in enumerate(acceptances):
        if acc.next_token >= vocab:
            seq_id, step, before = where(b)
            raise InvalidLogitsError(
                f"sequence {seq_id}, step {step}, new token {before + len(acc.accepted_tokens) + 1}: the target's "
                "logits leave no token to choose (NaN or infinite values, e.g. a float16 overflow or a damaged "
                "checkpoint, or every token removed by a logits processor or a sampling warper); stopping instead of "
                "emitting an id outside the vocabulary.")
