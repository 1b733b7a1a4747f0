"""What generate() returns: the sequences as transformers returns them, and per-sequence stats.

    out = specdec.generate(model, ids, drafter="ngram", return_dict=True)
    out.sequences, out.new_tokens, out.stats[0].tau, out.stats[0].acceptance_per_depth

:func:`pack_output` turns the engine's finished :class:`~specdec.engine.SequenceState` list into
these, laid out as transformers' ``model.generate()`` lays them out (:class:`OutputLayout`): each input
row *as given* (left or right padding included) followed by its new tokens, so ``out[:, input_ids.shape[1]:]``
is exactly the new tokens; rows that stopped early are right-padded with ``pad_token_id``. A tensor came in:
a ``long`` tensor on its device; lists came in: lists (``out[i][len(input_ids[i]):]`` are the new tokens).
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from specdec.engine import Engine, SequenceState


def acceptance_rates(accepted: Sequence[int], tried: Sequence[int]) -> tuple[float, ...]:
    """P(a node at depth d + 1 accepted | its parent accepted) for the depths some step tried. A depth is tried only
    where the one above it accepted, so the tried depths are a prefix; the depths after it (a deep tree verified
    once, its parents never accepted) have no rate, rather than a 0 that reads as "tried and always rejected"."""
    n = next((d for d, t in enumerate(tried) if not t), len(tried))
    return tuple(a / t for a, t in zip(accepted[:n], tried[:n], strict=True))


@dataclass(frozen=True)
class SequenceStats:
    """One sequence's record of a call (``GenerateOutput.stats``): its lengths, steps, tau (new tokens per target
    forward), time, why it stopped (``finish_reason``: ``"eos"``, ``"stop"`` or ``"length"``) and, per draft depth,
    how often a node there was accepted once its parent was; each field's comment in specdec/output.py says more."""

    prompt_tokens: int
    new_tokens: int
    steps: int  # target forward passes after prefill
    tau: float  # new tokens per step (mean accepted length + 1)
    seconds: float  # wall time from the start of generate() to this sequence's end
    tokens_per_second: float
    finish_reason: str
    acceptance_per_depth: tuple[float, ...]  # P(node at depth d accepted | parent accepted), tried depths only
    depth_tried: tuple[int, ...] = ()  # per depth d+1: steps whose node at depth d had its parent accepted
    depth_accepted: tuple[int, ...] = ()  # per depth d+1: steps that accepted a node at depth d+1
    step_lengths: tuple[int, ...] = ()  # tokens committed by each step (accepted length + 1, cut at stops)
    step_nodes: tuple[int, ...] = ()  # draft nodes each step verified (after sizing; 0 = plain step)

    @classmethod
    def of(cls, s: SequenceState, start: float) -> "SequenceStats":
        seconds = (s.finished_at or time.perf_counter()) - start
        acc = acceptance_rates(s.depth_accepted, s.depth_tried)
        n = len(s.new_tokens)
        return cls(s.num_prompt_tokens, n, s.steps, s.tau, seconds, n / seconds if seconds else 0.0,
                   s.finish_reason or "", acc, tuple(s.depth_tried), tuple(s.depth_accepted), tuple(s.step_lengths),
                   tuple(s.step_nodes))


# transformers' generate-output fields specdec does not return, and what to read instead
_TRANSFORMERS_ONLY = {
    "scores": "pass output_logprobs=True (or output_scores=True) and read .logprobs, each new token's log-probability",
    "logits": "the raw logits are not kept; .logprobs holds each new token's log-probability (output_logprobs=True)",
    "attentions": "specdec returns no attention weights",
    "hidden_states": "specdec returns no hidden states",
    "past_key_values": "the KV cache is paged and freed after the call; nothing to continue from",
    "beam_indices": "specdec does not run beam search",
}


@dataclass(frozen=True)
class GenerateOutput:
    """What ``generate(..., return_dict=True)`` returns: ``sequences`` (each row as given, then its new tokens, as
    transformers returns them), ``new_tokens`` per row, a :class:`SequenceStats` per row, the call's timings and
    forward passes, and with ``output_logprobs=True`` the target's log-probability of each new token. Fields read
    as attributes or by name (``out["sequences"]``, ``"sequences" in out``, ``out.keys()``); transformers' fields
    specdec does not return are named so."""

    sequences: Any  # like transformers: each input row as given + its new tokens (tensor or lists)
    new_tokens: list[list[int]]
    stats: list[SequenceStats]
    seconds: float
    prefill_seconds: float
    forward_passes: int
    draft_seconds: float = 0.0  # time in drafter.propose and the draft audit (all steps)
    verify_seconds: float = 0.0  # time in verification, sampling and commit (all steps)
    # output_logprobs=True (or output_scores=True): per sequence, the target's log-probability of each new token
    # after the logits processors and the sampling transform (greedy: log_softmax of the processed logits;
    # specdec.logprobs), the same with or without a drafter; None when not asked for
    logprobs: list[list[float]] | None = None

    def __getattr__(self, name: str) -> Any:
        """Only reached for a missing attribute: transformers' output fields that specdec has not are named so."""
        if name in _TRANSFORMERS_ONLY:
            raise AttributeError(f"GenerateOutput has no {name!r} (transformers' field): {_TRANSFORMERS_ONLY[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getitem__(self, key: str) -> Any:
        """A field by name, ``out["sequences"]``, as transformers' generate outputs give it."""
        names = [f.name for f in fields(self)]
        if key not in names:  # an int index too: transformers' tuple order is not kept
            hint = f"; {_TRANSFORMERS_ONLY[key]}" if key in _TRANSFORMERS_ONLY else ""
            raise KeyError(f"GenerateOutput has no field {key!r}; its fields: {', '.join(names)}{hint}")
        return getattr(self, key)

    def keys(self) -> list[str]:
        """The fields that hold something (``logprobs`` only when asked for), as a transformers generate output
        lists its non-None fields: ``"scores" in out``, ``for name in out`` and ``dict(out)`` read these (without
        them Python would index the output by 0, 1, ...)."""
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    @property
    def total_new_tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    @property
    def tau(self) -> float:
        steps = sum(s.steps for s in self.stats)
        return sum(s.new_tokens for s in self.stats) / steps if steps else 0.0


@dataclass(frozen=True)
class OutputLayout:
    """How the result is laid out: row i is ``rows[i]`` (an input row as given, padding included; repeated
    for ``num_return_sequences``) followed by its new tokens."""

    rows: tuple[tuple[int, ...], ...]
    tensor: bool  # a tensor result (padded with pad_token_id) rather than lists
    pad_token_id: int = 0
    device: torch.device | None = None  # the tensor result's device (the input tensor's)

    def pack(self, new_tokens: list[list[int]]) -> Any:
        full = [list(row) + list(new) for row, new in zip(self.rows, new_tokens, strict=True)]
        if not self.tensor:
            return full
        sequences = torch.full((len(full), max(len(t) for t in full)), self.pad_token_id, dtype=torch.long)
        for i, t in enumerate(full):
            sequences[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        return sequences.to(self.device) if self.device is not None else sequences


def pack_output(engine: Engine, seqs: list[SequenceState], layout: OutputLayout, return_dict: bool,
                start: float, prefill_seconds: float) -> Any:
    """The sequences laid out by ``layout``; with ``return_dict`` a GenerateOutput around them."""
    sequences = layout.pack([s.new_tokens for s in seqs])
    if not return_dict:
        return sequences
    return GenerateOutput(sequences, [s.new_tokens for s in seqs], [SequenceStats.of(s, start) for s in seqs],
                          time.perf_counter() - start, prefill_seconds, engine.forward_passes,
                          engine.seconds["draft"], engine.seconds["verify"],
                          [list(s.logprobs) for s in seqs] if engine.output_logprobs else None)
