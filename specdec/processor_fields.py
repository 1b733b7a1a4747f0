"""GenerationConfig's logits-processor fields (transformers' names), checked and normalised once.

    values = check_processing_fields(repetition_penalty=1.3, suppress_tokens=[5], ...)   # the values to store

Each bad value is a one-line InputError / InputTypeError naming the field. Off is stored one way: None, or the
neutral number (``repetition_penalty`` 1.0, ``no_repeat_ngram_size`` / ``min_new_tokens`` / ``min_length`` 0,
``remove_invalid_values`` False); an empty list is None, as transformers' processors do nothing with one. Token-id
lists become tuples (``sequence_bias``: ``((ids, bias), ...)`` in dict order, a later duplicate winning as
transformers' dict conversion does). Checks that need the vocabulary (ids below its size) are
:func:`check_vocabulary_ids`', called when the model is known (:mod:`specdec.logits_processing`).
"""
from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import check_bool, check_int, check_real, describe, is_int

PREFIX_ONLY_HELP = (
    "logits_processor needs logits_processor_prefix_only=True: speculative decoding calls each processor at every "
    "draft-tree node with that node's own prefix (many rows per step, in any grouping, also on tokens that are "
    "then rejected), which keeps the output exact only for a processor whose output rows depend on their "
    "input_ids and scores alone; one that keeps state across calls would change it. Pass "
    "logits_processor_prefix_only=True if yours is such a processor"
)

TokenIds = tuple[int, ...]


def check_processing_fields(repetition_penalty: Any = None, no_repeat_ngram_size: Any = None,
                            bad_words_ids: Any = None, min_new_tokens: Any = None, logits_processor: Any = None,
                            logits_processor_prefix_only: Any = False, min_length: Any = None,
                            sequence_bias: Any = None, forced_bos_token_id: Any = None,
                            forced_eos_token_id: Any = None, remove_invalid_values: Any = None,
                            exponential_decay_length_penalty: Any = None, suppress_tokens: Any = None,
                            begin_suppress_tokens: Any = None) -> dict[str, Any]:
    """The processor fields checked and normalised (None = off): field -> the value to store."""
    repetition_penalty = check_real("repetition_penalty", 1.0 if repetition_penalty is None else repetition_penalty)
    if not repetition_penalty > 0:
        raise InputError(f"repetition_penalty must be > 0 (1.0 = off), got {repetition_penalty}")
    check_bool("logits_processor_prefix_only", logits_processor_prefix_only)
    processors = _check_processors(logits_processor)
    if processors and not logits_processor_prefix_only:
        raise InputError(PREFIX_ONLY_HELP)
    return dict(
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=_count("no_repeat_ngram_size", no_repeat_ngram_size),
        bad_words_ids=_check_bad_words(bad_words_ids),
        min_new_tokens=_count("min_new_tokens", min_new_tokens),
        logits_processor=processors,
        min_length=_count("min_length", min_length),
        sequence_bias=_check_sequence_bias(sequence_bias),
        forced_bos_token_id=check_int("forced_bos_token_id", forced_bos_token_id, minimum=0, optional=True),
        forced_eos_token_id=_token_ids("forced_eos_token_id", forced_eos_token_id, single=True),
        remove_invalid_values=False if remove_invalid_values is None else check_bool("remove_invalid_values",
                                                                                     remove_invalid_values),
        exponential_decay_length_penalty=_check_decay(exponential_decay_length_penalty),
        suppress_tokens=_token_ids("suppress_tokens", suppress_tokens),
        begin_suppress_tokens=_token_ids("begin_suppress_tokens", begin_suppress_tokens),
    )


PROCESSOR_FIELDS = tuple(inspect.signature(check_processing_fields).parameters)  # the fields, named once


def check_vocabulary_ids(config: Any, vocab_size: int) -> None:
    """Every token id of ``config``'s processor fields lies in [0, vocab_size): one-line InputError naming the field
    (transformers ignores a suppressed id outside the vocabulary, or fails inside a processor)."""
    fields: dict[str, list[int]] = {
        "bad_words_ids": [t for word in config.bad_words_ids or () for t in word],
        "sequence_bias": [t for ids, _ in config.sequence_bias or () for t in ids],
        "forced_bos_token_id": [] if config.forced_bos_token_id is None else [config.forced_bos_token_id],
        "forced_eos_token_id": list(config.forced_eos_token_id or ()),
        "suppress_tokens": list(config.suppress_tokens or ()),
        "begin_suppress_tokens": list(config.begin_suppress_tokens or ()),
    }
    for name, ids in fields.items():
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InputError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    suppressed = set(config.suppress_tokens or ())
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = set(fields[name])
        if forced and forced <= suppressed:  # transformers' GenerationConfig.validate() refuses it too
            raise InputError(f"every token of {name} ({sorted(forced)}) is also in suppress_tokens: the forced step "
                             "would have no token left; remove it from one of them (min_new_tokens keeps an early "
                             "EOS away)")


def _count(name: str, value: Any) -> int:
    return check_int(name, 0 if value is None else value, minimum=0)


def _is_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and not isinstance(value, (str, bytes))


def _token_ids(name: str, value: Any, single: bool = False) -> TokenIds | None:
    """None, a list / tuple of token ids >= 0 (or one id where ``single``) -> a tuple; empty -> None."""
    if value is None:
        return None
    if single and is_int(value):
        value = [value]
    how = "a token id or a list of them" if single else "a list of token ids"
    if not _is_list(value):
        raise InputTypeError(f"{name} must be {how}, got {describe(value)}")
    if not all(is_int(t) and int(t) >= 0 for t in value):
        raise InputTypeError(f"{name} must hold token ids (ints >= 0), got {describe(value)}")
    return tuple(int(t) for t in value) or None


def _check_bad_words(value: Any) -> tuple[TokenIds, ...] | None:
    if value is None:
        return None
    how = "a non-empty list of non-empty token-id lists, e.g. [[12], [7, 8]]"
    if not _is_list(value) or not value:
        raise InputTypeError(f"bad_words_ids must be {how}, got {describe(value)}")
    out = []
    for i, word in enumerate(value):
        if not _is_list(word) or not word:
            raise InputTypeError(f"bad_words_ids[{i}] must be a non-empty list of token ids, got {describe(word)}")
        if not all(is_int(t) and int(t) >= 0 for t in word):
            raise InputTypeError(f"bad_words_ids[{i}] must hold token ids >= 0, got {describe(word)}")
        out.append(tuple(int(t) for t in word))
    return tuple(out)


def _check_sequence_bias(value: Any) -> tuple[tuple[TokenIds, float], ...] | None:
    """transformers' two forms, ``{(ids...): bias}`` and ``[[ids, bias], ...]`` -> ``((ids, bias), ...)``."""
    if value is None:
        return None
    how = "a dict {(token ids): bias} or a list [[token ids, bias], ...], e.g. {(12,): -5.0, (7, 8): 2.0}"
    if isinstance(value, Mapping):
        items = list(value.items())
    elif _is_list(value) and all(_is_list(item) and len(item) == 2 for item in value):
        items = [tuple(item) for item in value]
    else:
        raise InputTypeError(f"sequence_bias must be {how}, got {describe(value)}")
    out: dict[TokenIds, float] = {}
    for ids, bias in items:
        if not _is_list(ids) or not ids or not all(is_int(t) and int(t) >= 0 for t in ids):
            raise InputTypeError(f"sequence_bias keys must be non-empty lists of token ids >= 0, got {describe(ids)}")
        if isinstance(bias, bool) or not isinstance(bias, numbers.Real) or math.isnan(bias) or bias == math.inf:
            raise InputTypeError(f"sequence_bias values must be finite numbers or -inf (which bans), got "
                                 f"{describe(bias)} for {list(ids)}")
        out[tuple(int(t) for t in ids)] = float(bias)
    return tuple(out.items()) or None


def _check_decay(value: Any) -> tuple[int, float] | None:
    """``(start_index, decay_factor)``: new tokens before the penalty starts, and its base."""
    if value is None:
        return None
    if not _is_list(value) or len(value) != 2:
        raise InputTypeError(f"exponential_decay_length_penalty must be a pair (start_index, decay_factor), got "
                             f"{describe(value)}")
    start = check_int("exponential_decay_length_penalty start_index", value[0], minimum=0)
    return start, check_real("exponential_decay_length_penalty decay_factor", value[1])


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
