"""Logits processors at every draft-tree node, each with that node's own prefix: speculation stays exact.

A processor whose output depends only on the sequence so far (its *prefix*) and on the scores keeps speculative
decoding exact when the engine applies it to the target's logits at every row of the verify forward with that
row's own prefix: the root's row with the committed sequence, node i's row with that plus the tokens of node i's
ancestors and node i. The greedy walk, the rejection sampler and coupled sampling then see at every node exactly
the scores plain decoding with the same processors sees, so the output is plain decoding's (greedy token for
token, the same law, the same coupled text). Plain decoding is the empty tree: the root's row only.

    processing = LogitsProcessing.from_config(config, eos_token_ids, vocab_size)   # None: nothing to apply
    logits = processing.apply([(s.token_ids, s.num_prompt_tokens) for s in live], trees, logits)

The processors are transformers' own classes, in the order transformers' ``generate()`` builds them:
``repetition_penalty``, ``no_repeat_ngram_size``, ``bad_words_ids``, ``min_new_tokens`` (built per prompt
length), then the caller's ``logits_processor=`` (a caller's processor of a built-in's class takes its place).
Other transformers processors stay refused (:mod:`specdec.transformers_config`).

A caller's processor must be declared prefix-only (``logits_processor_prefix_only=True``): it is called many
times per step, on rows later rejected, in groups of any size and order, so it must map ``(input_ids [rows, L],
scores [rows, V]) -> [rows, V]`` with each row a function of that row alone. A row's ``input_ids`` is its prompt
without padding followed by the committed and drafted tokens, as if decoded alone; rows of equal length are
batched, so no row is ever padded. Scores are processed in float32 (float64 stays float64).

The full-vocabulary model drafters process their own logits the same way (``TargetView.processing``) so their
drafts get accepted; Medusa, EAGLE and reduced-vocabulary drafters do not: that costs acceptance, never
exactness.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import check_bool, check_int, check_real, describe, is_int
from specdec.host_copy import to_device
from specdec.tree import DraftTree

PREFIX_ONLY_HELP = (
    "logits_processor needs logits_processor_prefix_only=True: speculative decoding calls each processor at every "
    "draft-tree node with that node's own prefix (many rows per step, in any grouping, also on tokens that are "
    "then rejected), which keeps the output exact only for a processor whose output rows depend on their "
    "input_ids and scores alone; one that keeps state across calls would change it. Pass "
    "logits_processor_prefix_only=True if yours is such a processor"
)


class _MinNewTokens:
    """Placeholder for ``MinNewTokensLengthLogitsProcessor``, built per prompt length when rows are processed."""


_MIN_NEW_TOKENS = _MinNewTokens()


def check_processing_fields(repetition_penalty: Any, no_repeat_ngram_size: Any, bad_words_ids: Any,
                            min_new_tokens: Any, logits_processor: Any, logits_processor_prefix_only: Any
                            ) -> dict[str, Any]:
    """GenerationConfig's processor fields checked and normalised (None = off; one-line InputError /
    InputTypeError naming the field): the values to store."""
    repetition_penalty = check_real("repetition_penalty", 1.0 if repetition_penalty is None else repetition_penalty)
    if not repetition_penalty > 0:
        raise InputError(f"repetition_penalty must be > 0 (1.0 = off), got {repetition_penalty}")
    ngram = check_int("no_repeat_ngram_size", 0 if no_repeat_ngram_size is None else no_repeat_ngram_size, minimum=0)
    min_new = check_int("min_new_tokens", 0 if min_new_tokens is None else min_new_tokens, minimum=0)
    check_bool("logits_processor_prefix_only", logits_processor_prefix_only)
    processors = _check_processors(logits_processor)
    if processors and not logits_processor_prefix_only:
        raise InputError(PREFIX_ONLY_HELP)
    return dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=ngram,
                bad_words_ids=_check_bad_words(bad_words_ids), min_new_tokens=min_new, logits_processor=processors)


def _check_bad_words(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    how = "a non-empty list of non-empty token-id lists, e.g. [[12], [7, 8]]"
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
        raise InputTypeError(f"bad_words_ids must be {how}, got {describe(value)}")
    out = []
    for i, word in enumerate(value):
        if isinstance(word, (str, bytes)) or not isinstance(word, (list, tuple)) or not word:
            raise InputTypeError(f"bad_words_ids[{i}] must be a non-empty list of token ids, got {describe(word)}")
        if not all(is_int(t) and int(t) >= 0 for t in word):
            raise InputTypeError(f"bad_words_ids[{i}] must hold token ids >= 0, got {describe(word)}")
        out.append(tuple(int(t) for t in word))
    return tuple(out)


def _check_processors(value: Any) -> tuple[Callable, ...]:
    """None, one processor, or a list / tuple / LogitsProcessorList of them -> a tuple of callables."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for i, p in enumerate(items):
        if not callable(p):
            raise InputTypeError(f"logits_processor[{i}] must be a callable (input_ids, scores) -> scores, "
                                 f"got {describe(p)}")
    return tuple(items)


def node_suffixes(tree: DraftTree) -> list[list[int]]:
    """Per verify row (0 = root, 1 + i = node i): the tokens after the committed sequence in that row's prefix,
    root to node (the root's row: none; node i: its ancestors' tokens, then its own)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    rows: list[list[int]] = [[]]
    for tok, parent in zip(tokens, parents):
        rows.append(rows[parent + 1] + [tok])
    return rows


@dataclass(frozen=True)
class LogitsProcessing:
    """The processors of one generate() call, in transformers' order (``_MIN_NEW_TOKENS`` marks where
    ``MinNewTokensLengthLogitsProcessor`` goes: it is built per prompt length)."""

    processors: tuple[Callable, ...]
    min_new_tokens: int = 0
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.processors:
            raise InputError("LogitsProcessing needs at least one processor (use None for none)")
        if not all(callable(p) or p is _MIN_NEW_TOKENS for p in self.processors):
            raise InputTypeError("LogitsProcessing.processors must be callables (input_ids, scores) -> scores")
        check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.has_min_new_tokens != (self.min_new_tokens > 0 and bool(self.eos_token_ids)):
            raise InputError("LogitsProcessing: the min_new_tokens placeholder needs min_new_tokens > 0 and EOS ids")

    @property
    def has_min_new_tokens(self) -> bool:
        return any(p is _MIN_NEW_TOKENS for p in self.processors)

    @classmethod
    def from_config(cls, config: Any, eos_token_ids: Sequence[int], vocab_size: int) -> LogitsProcessing | None:
        """The processors ``config`` (a checked GenerationConfig) asks for; None when there are none (the
        engine then runs no processing code at all)."""
        from transformers import (
            MinNewTokensLengthLogitsProcessor,
            NoBadWordsLogitsProcessor,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
        )

        eos = tuple(sorted(int(e) for e in eos_token_ids))
        defaults: list[tuple[type, Callable]] = []  # (class a caller's processor replaces it by, processor)
        if config.repetition_penalty != 1.0:
            defaults.append((RepetitionPenaltyLogitsProcessor, RepetitionPenaltyLogitsProcessor(
                float(config.repetition_penalty))))
        if config.no_repeat_ngram_size > 0:
            defaults.append((NoRepeatNGramLogitsProcessor, NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size)))
        if config.bad_words_ids is not None:
            bad = [t for word in config.bad_words_ids for t in word if t >= vocab_size]
            if bad:
                raise InputError(f"bad_words_ids has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
            words = [list(w) for w in config.bad_words_ids]
            defaults.append((NoBadWordsLogitsProcessor, NoBadWordsLogitsProcessor(words, list(eos) or None)))
        if config.min_new_tokens > 0 and eos:
            defaults.append((MinNewTokensLengthLogitsProcessor, _MIN_NEW_TOKENS))
        custom = list(config.logits_processor)
        # transformers 5's _merge_criteria_processor_list: a custom processor of a default's class takes its place
        merged = [next((c for c in custom if type(c) is kind), p) for kind, p in defaults]
        merged += [c for c in custom if not any(c is m for m in merged)]
        if not merged:
            return None
        min_new = any(p is _MIN_NEW_TOKENS for p in merged)
        return cls(tuple(merged), config.min_new_tokens if min_new else 0, eos if min_new else ())

    def process_rows(self, input_ids: torch.Tensor, scores: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """input_ids [rows, L] (every row a prefix of L tokens whose prompt is ``prompt_length`` long), scores
        [rows, V] -> the processed scores [rows, V]: each processor in turn, as transformers' generate() calls it."""
        for i, p in enumerate(self.processors):
            if p is _MIN_NEW_TOKENS:
                if input_ids.shape[-1] - prompt_length >= self.min_new_tokens:
                    continue  # past the minimum: the processor would change nothing
                from transformers import MinNewTokensLengthLogitsProcessor

                p = MinNewTokensLengthLogitsProcessor(prompt_length, self.min_new_tokens, list(self.eos_token_ids),
                                                      device=scores.device)
            out = p(input_ids, scores)
            if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
                raise InputTypeError(f"logits processor {i} ({type(p).__name__}) returned {describe(out)}, expected "
                                     f"scores of shape {tuple(scores.shape)}")
            scores = out
        return scores

    def process_prefixes(self, prefixes: Sequence[tuple[torch.Tensor, Sequence[int], int]], scores: torch.Tensor
                         ) -> torch.Tensor:
        """prefixes [R]: (committed token ids [n] int64 CPU tensor, the tokens after them, the prompt's length),
        scores [R, V] -> the processed scores [R, V] (float32, float64 stays float64; a new tensor): row r
        processed with prefix r. Rows of equal length (and, with min_new_tokens, equal prompt length) go through
        the processors in one call, so no row is ever padded."""
        out = scores.to(torch.float64 if scores.dtype == torch.float64 else torch.float32, copy=True)
        by_prompt = self.has_min_new_tokens  # MinNewTokensLengthLogitsProcessor counts from the prompt's length
        groups: dict[tuple[int, int], list[int]] = {}
        for r, (base, suffix, prompt_length) in enumerate(prefixes):
            groups.setdefault((prompt_length if by_prompt else 0, len(base) + len(suffix)), []).append(r)
        for (prompt_length, _), rows in groups.items():
            ids = torch.stack([torch.cat([prefixes[r][0], torch.tensor(list(prefixes[r][1]), dtype=torch.long)])
                               for r in rows])
            ids, index = to_device(ids, torch.long, scores.device), to_device(rows, torch.long, scores.device)
            out[index] = self.process_rows(ids, out[index], prompt_length).to(out.dtype)
        return out

    def apply(self, sequences: Sequence[tuple[Sequence[int], int]], trees: Sequence[DraftTree],
              logits: torch.Tensor) -> torch.Tensor:
        """sequences [B] (committed token ids, root last; prompt length), trees [B], logits [B, max_nodes + 1, V]
        -> processed float32 logits of the same shape (float64 stays float64): row r of sequence b processed with
        that row's prefix. Padding rows (past a tree's nodes) are left as they are: no walk reads them."""
        prefixes, b_idx, r_idx = [], [], []
        for b, ((token_ids, prompt_length), tree) in enumerate(zip(sequences, trees, strict=True)):
            base = torch.tensor(list(token_ids), dtype=torch.long)
            for row, suffix in enumerate(node_suffixes(tree)):
                prefixes.append((base, suffix, prompt_length))
                b_idx.append(b)
                r_idx.append(row)
        out = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32, copy=True)
        b_idx, r_idx = to_device([b_idx, r_idx], torch.long, logits.device)  # no blocking copy
        out[b_idx, r_idx] = self.process_prefixes(prefixes, out[b_idx, r_idx])
        return out
