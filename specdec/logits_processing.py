"""Logits processors at every draft-tree node, each with that node's own prefix: speculation stays exact.

A processor whose output depends only on the sequence so far (its *prefix*) and on the scores keeps speculative
decoding exact when the engine applies it to the target's logits at every row of the verify forward with that
row's own prefix: the root's row with the committed sequence, node i's row with that plus the tokens of node i's
ancestors and node i. The greedy walk, the rejection sampler and coupled sampling then see at every node exactly
the scores plain decoding with the same processors sees, so the output is plain decoding's (greedy token for
token, the same law, the same coupled text). Plain decoding is the empty tree: the root's row only.

    processing = LogitsProcessing.from_config(config, eos_token_ids, vocab_size, prompt_width)  # None: none
    logits = processing.apply([(s.token_ids, s.num_prompt_tokens) for s in live], trees, logits)

The processors are transformers' own classes, in transformers 5's order (``_get_logits_processor``):
sequence_bias, repetition_penalty, no_repeat_ngram_size, bad_words_ids, min_length, min_new_tokens,
forced_bos_token_id, forced_eos_token_id, remove_invalid_values, exponential_decay_length_penalty,
suppress_tokens, begin_suppress_tokens, then the caller's ``logits_processor=`` (one of a built-in's class takes
its place). A row's ``input_ids`` is its prompt without padding, then the committed and drafted tokens, as if
decoded alone; rows of equal length are batched, so no row is ever padded. The processors that count from the
prompt (:class:`PerPrompt`) are built per prompt length, shifted to act after as many new tokens as in
transformers' left-padded batch, whose lengths count ``prompt_width`` (``input_ids.shape[-1]``): the same for
every row but for ``min_length`` (a row shorter than the width must generate more) and ``forced_bos_token_id``
(acts only where the width is 1). A caller's processor must be declared prefix-only
(``logits_processor_prefix_only=True``): it is called many times per step, on rows later rejected, in groups of
any size and order, so each output row must be a function of that row alone. Scores are processed in float32
(float64 stays float64).

The full-vocabulary model drafters process their own logits the same way (``TargetView.processing``) so their
drafts get accepted; Medusa, EAGLE and reduced-vocabulary drafters do not: that costs acceptance, never
exactness.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import describe
from specdec.host_copy import to_device
from specdec.processor_fields import check_vocabulary_ids
from specdec.tree import DraftTree


@dataclass(frozen=True)
class PerPrompt:
    """A transformers processor whose arguments count from the prompt's length: ``build(prompt_length, device)``
    makes it for rows of that prompt length; it changes a row's scores only after ``first`` to ``last`` new tokens
    (None: no end; ``last < first``: never), so rows outside that range skip it."""

    kind: type  # the transformers class built (a caller's processor of that class takes its place)
    build: Callable[[int, torch.device], Callable]
    first: int = 0
    last: int | None = None

    def acts(self, new_tokens: int) -> bool:
        return self.first <= new_tokens and (self.last is None or new_tokens <= self.last)


def _forget_other_vocabulary(processor: Any, vocab_size: int, device: torch.device | None) -> None:
    """A caller's transformers ``SequenceBiasLogitsProcessor`` (``NoBadWordsLogitsProcessor`` is one) reused from a
    call with another vocabulary size or device: it prepared its bias tensors for that call's logits at its first
    use and keeps them, so it would fail here with a raw shape or device error. It prepares them again, as a new
    one would (once per call, never per step)."""
    from transformers import SequenceBiasLogitsProcessor

    if not isinstance(processor, SequenceBiasLogitsProcessor) or not getattr(processor, "prepared_bias_variables",
                                                                              False):
        return
    bias = getattr(processor, "length_1_bias", None)
    if not isinstance(bias, torch.Tensor) or bias.shape[-1] != vocab_size or (
            device is not None and bias.device != torch.device(device)):
        processor.prepared_bias_variables = False


def _prepare_biases_in_float32(processor: Any, vocab_size: int, device: torch.device) -> None:
    """A transformers ``SequenceBiasLogitsProcessor`` (``NoBadWordsLogitsProcessor`` is one) makes its one-token
    biases at its first use with ``torch.tensor(biases)`` from Python floats: in torch's default dtype, which a
    caller's ``torch.set_default_dtype(torch.float64)`` makes float64, and its float32 bias table then refuses them.
    They are prepared here from float32 values, the ones a float32 default gives (torch's default dtype is one for
    the whole process, so it is not set aside for the call as autocast is: another thread may be reading it)."""
    from transformers import SequenceBiasLogitsProcessor

    if not isinstance(processor, SequenceBiasLogitsProcessor) or getattr(processor, "prepared_bias_variables", True):
        return
    biases = processor.sequence_bias
    processor.sequence_bias = {ids: np.float32(bias) for ids, bias in biases.items()}
    try:
        processor._prepare_bias_variables(torch.empty(0, vocab_size, dtype=torch.float32, device=device))
    finally:
        processor.sequence_bias = biases


def node_suffixes(tree: DraftTree) -> list[list[int]]:
    """Per verify row (0 = root, 1 + i = node i): the tokens after the committed sequence in that row's prefix,
    root to node (the root's row: none; node i: its ancestors' tokens, then its own)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    rows: list[list[int]] = [[]]
    for tok, parent in zip(tokens, parents, strict=True):
        rows.append(rows[parent + 1] + [tok])
    return rows


@dataclass(frozen=True)
class LogitsProcessing:
    """The processors of one generate() call, in transformers' order: callables, and :class:`PerPrompt` ones
    built per prompt length when rows are processed. ``max_new_tokens`` (None: no limit): a row after that many
    new tokens or more is left as it is. Plain decoding never processes one (its last row follows
    ``max_new_tokens - 1`` new tokens, as transformers' does); a model drafter drafting past the budget asks for
    them, and the engine cuts those nodes. So a processor that fails past the budget (a table as long as the
    longest sequence, a decay penalty that overflows there) fails with a drafter only where plain decoding does."""

    processors: tuple[Callable | PerPrompt, ...]
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.processors:
            raise InputError("LogitsProcessing needs at least one processor (use None for none)")
        if not all(callable(p) or isinstance(p, PerPrompt) for p in self.processors):
            raise InputTypeError("LogitsProcessing.processors must be callables (input_ids, scores) -> scores")

    @property
    def per_prompt(self) -> bool:
        """Whether a processor counts from the prompt (rows are then grouped by prompt length too)."""
        return any(isinstance(p, PerPrompt) for p in self.processors)

    @classmethod
    def from_config(cls, config: Any, eos_token_ids: Sequence[int], vocab_size: int,
                    prompt_width: int | None = None, device: torch.device | None = None) -> LogitsProcessing | None:
        """The processors ``config`` (a checked GenerationConfig, max_new_tokens resolved) asks for; None when
        there are none (the engine then runs no processing code at all). ``prompt_width``: transformers'
        ``input_ids.shape[-1]`` (the longest row of lists), which min_length, forced_bos_token_id and
        begin_suppress_tokens count; needed only with them. ``device``: the logits' (None: not known)."""
        from transformers import (
            ExponentialDecayLengthPenalty,
            ForcedBOSTokenLogitsProcessor,
            ForcedEOSTokenLogitsProcessor,
            InfNanRemoveLogitsProcessor,
            MinLengthLogitsProcessor,
            MinNewTokensLengthLogitsProcessor,
            NoBadWordsLogitsProcessor,
            NoRepeatNGramLogitsProcessor,
            RepetitionPenaltyLogitsProcessor,
            SequenceBiasLogitsProcessor,
            SuppressTokensAtBeginLogitsProcessor,
            SuppressTokensLogitsProcessor,
        )

        check_vocabulary_ids(config, vocab_size)
        eos = sorted({int(e) for e in eos_token_ids})
        new_max = config.max_new_tokens  # transformers' max_length is prompt_width + this
        needs_width = config.min_length > 0 or config.forced_bos_token_id is not None or (
            config.begin_suppress_tokens is not None)
        if needs_width and prompt_width is None:
            raise InputError("LogitsProcessing.from_config needs prompt_width with min_length, forced_bos_token_id "
                             "or begin_suppress_tokens")
        defaults: list[Callable | PerPrompt] = []  # transformers 5's _get_logits_processor, in its order
        if config.sequence_bias is not None:
            defaults.append(SequenceBiasLogitsProcessor([[list(ids), bias] for ids, bias in config.sequence_bias]))
        if config.repetition_penalty != 1.0:
            defaults.append(RepetitionPenaltyLogitsProcessor(float(config.repetition_penalty)))
        if config.no_repeat_ngram_size > 0:
            defaults.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
        if config.bad_words_ids is not None:
            defaults.append(NoBadWordsLogitsProcessor([list(w) for w in config.bad_words_ids], eos or None))
        if config.min_length > 0 and eos:  # EOS is masked while prompt_width + new tokens < min_length
            extra = config.min_length - prompt_width
            defaults.append(PerPrompt(MinLengthLogitsProcessor, lambda p, device: MinLengthLogitsProcessor(
                p + extra, eos, device=device), 0, extra - 1))
        if config.min_new_tokens > 0 and eos:
            n = config.min_new_tokens
            defaults.append(PerPrompt(MinNewTokensLengthLogitsProcessor, lambda p, device: (
                MinNewTokensLengthLogitsProcessor(p, n, eos, device=device)), 0, n - 1))
        if config.forced_bos_token_id is not None:  # transformers forces it where input_ids.shape[-1] is 1
            bos = config.forced_bos_token_id
            defaults.append(PerPrompt(ForcedBOSTokenLogitsProcessor, lambda p, device: (
                ForcedBOSTokenLogitsProcessor(bos)), 0, 0 if prompt_width == 1 else -1))
        if config.forced_eos_token_id is not None:  # at max_length - 1: the last new token
            forced = list(config.forced_eos_token_id)
            defaults.append(PerPrompt(ForcedEOSTokenLogitsProcessor, lambda p, device: ForcedEOSTokenLogitsProcessor(
                p + new_max, forced, device=device), new_max - 1, new_max - 1))
        if config.remove_invalid_values:
            defaults.append(InfNanRemoveLogitsProcessor())
        if config.exponential_decay_length_penalty is not None:
            if not eos:
                raise InputError("exponential_decay_length_penalty raises the EOS logits and there is no EOS id "
                                 "(transformers fails there too): pass eos_token_id, or unset it")
            decay = config.exponential_decay_length_penalty
            defaults.append(PerPrompt(ExponentialDecayLengthPenalty, lambda p, device: ExponentialDecayLengthPenalty(
                decay, eos, p), decay[0] + 1))
        if config.suppress_tokens is not None:
            defaults.append(SuppressTokensLogitsProcessor(config.suppress_tokens))
        if config.begin_suppress_tokens is not None:  # the first new token; the second after a forced BOS
            at = 1 if prompt_width <= 1 and config.forced_bos_token_id is not None else 0
            begin = config.begin_suppress_tokens
            defaults.append(PerPrompt(SuppressTokensAtBeginLogitsProcessor, lambda p, device: (
                SuppressTokensAtBeginLogitsProcessor(begin, p + at, device=device)), at, at))
        custom = list(config.logits_processor)
        for c in custom:
            _forget_other_vocabulary(c, vocab_size, device)
        # transformers 5's _merge_criteria_processor_list: a custom processor of a default's class takes its place
        kinds = [p.kind if isinstance(p, PerPrompt) else type(p) for p in defaults]
        merged = [next((c for c in custom if type(c) is kind), p) for kind, p in zip(kinds, defaults, strict=True)]
        merged += [c for c in custom if not any(c is m for m in merged)]
        if device is not None and torch.get_default_dtype() != torch.float32:  # a float32 default needs nothing
            for p in merged:
                _prepare_biases_in_float32(p, vocab_size, device)
        return cls(tuple(merged), new_max) if merged else None

    @torch.no_grad()  # as transformers' generate() runs them: a processor holding parameters builds no graph
    def process_rows(self, input_ids: torch.Tensor, scores: torch.Tensor, prompt_length: int) -> torch.Tensor:
        """input_ids [rows, L] (every row a prefix of L tokens whose prompt is ``prompt_length`` long), scores
        [rows, V] -> the processed scores [rows, V]: each processor in turn, as transformers' generate() calls it."""
        for i, p in enumerate(self.processors):
            if isinstance(p, PerPrompt):
                if not p.acts(input_ids.shape[-1] - prompt_length):
                    continue  # outside its range the processor would change nothing
                p = p.build(prompt_length, scores.device)
            try:
                out = p(input_ids, scores)
            except Exception as err:  # the caller's own exception, as transformers' generate() lets it through
                if hasattr(err, "add_note"):  # Python 3.11+: where and why, beside the processor's own message
                    err.add_note(f"specdec: logits processor {i} ({type(p).__name__}) failed on {input_ids.shape[0]} "
                                 f"rows of {input_ids.shape[-1]} token ids; speculative decoding calls it on groups "
                                 "of rows of any size, each row a prompt without its padding and then its tokens: a "
                                 "processor holding per-batch-row state is not prefix-only")
                raise
            if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
                raise InputTypeError(f"logits processor {i} ({type(p).__name__}) returned {describe(out)}, expected "
                                     f"scores of shape {tuple(scores.shape)}")
            scores = out
        return scores

    def process_prefixes(self, prefixes: Sequence[tuple[torch.Tensor, Sequence[int], int]], scores: torch.Tensor
                         ) -> torch.Tensor:
        """prefixes [R]: (committed token ids [n] int64 CPU tensor, the tokens after them, the prompt's length),
        scores [R, V] -> the processed scores [R, V] (float32, float64 stays float64; a new tensor): row r
        processed with prefix r (left as it is past ``max_new_tokens``). Rows of equal length (and, with a
        :class:`PerPrompt` processor, equal prompt length) go through the processors in one call, so no row is ever
        padded."""
        out = scores.to(torch.float64 if scores.dtype == torch.float64 else torch.float32, copy=True)
        by_prompt = self.per_prompt
        groups: dict[tuple[int, int], list[int]] = {}
        for r, (base, suffix, prompt_length) in enumerate(prefixes):
            length = len(base) + len(suffix)
            if self.max_new_tokens is not None and length - prompt_length >= self.max_new_tokens:
                continue  # past the token budget: plain decoding never processes this row
            groups.setdefault((prompt_length if by_prompt else 0, length), []).append(r)
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
