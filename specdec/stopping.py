"""When a sequence stops: max_new_tokens, EOS ids, stop token sequences, stop strings.

A speculative step commits several tokens at once; :meth:`StopCriteria.scan` walks them one
by one so nothing past a stop is ever emitted (the stopping token itself is kept, as in
transformers).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StopCriteria:
    max_new_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token-id sequences
    stop_strings: tuple[str, ...] = ()  # matched on decoded text, needs `tokenizer`
    tokenizer: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if any(len(s) == 0 for s in self.stop_sequences) or any(s == "" for s in self.stop_strings):
            raise ValueError("stop sequences and stop strings must be non-empty")
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass token-id stop sequences instead")

    def scan(self, generated: Sequence[int], committed: Sequence[int]) -> tuple[int, str | None]:
        """How many of `committed` (appended after `generated`) to emit, and why it stopped.

        Returns (count, reason) with reason in {None, "eos", "stop", "length"}.
        """
        history = list(generated)
        max_seq = max((len(s) for s in self.stop_sequences), default=0)
        max_chars = max((len(s) for s in self.stop_strings), default=0)
        for i, tok in enumerate(committed):
            history.append(tok)
            if tok in self.eos_token_ids:
                return i + 1, "eos"
            if max_seq and any(tuple(history[-len(s) :]) == s for s in self.stop_sequences):
                return i + 1, "stop"
            if max_chars:
                # a token decodes to >= 1 char (or a byte fragment): this window covers any match
                tail = self.tokenizer.decode(history[-(max_chars + 2) :], skip_special_tokens=False)
                if any(s in tail for s in self.stop_strings):
                    return i + 1, "stop"
            if len(history) >= self.max_new_tokens:
                return i + 1, "length"
        return len(committed), None
