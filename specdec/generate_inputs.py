"""Checks and normalisation of :func:`specdec.generate.generate`'s arguments.

Every problem is a one-line :class:`~specdec.errors.InputTypeError` (wrong type) or
:class:`~specdec.errors.InputError` (right type, unusable value) naming the argument and what
was given. Whatever needs no model is checked before the model is loaded::

    input_ids, attention_mask = unpack_encoding(input_ids, attention_mask)   # a BatchEncoding / dict
    inputs = parse_input_ids(input_ids, attention_mask)   # .prompts (padding removed), .rows (as given)
    ...load the model...
    check_vocabulary("input_ids", inputs.prompts, vocab_size)
"""
from __future__ import annotations

import math
import numbers
import reprlib
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import InputError, InputTypeError

_repr = reprlib.Repr()
_repr.maxstring, _repr.maxother, _repr.maxlist, _repr.maxtuple, _repr.maxlevel = 40, 40, 6, 6, 3


def describe(value: Any) -> str:
    """A short one-line description of a value for error messages (type, and dtype / shape of arrays)."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor of shape {tuple(value.shape)}"
    if _is_ndarray(value):
        return f"a {value.ndim}-D numpy {value.dtype} array of shape {tuple(value.shape)}"
    text = _repr.repr(value).replace("\n", " ")
    kind = type(value)  # numpy's scalars named as numpy's: "bool np.True_" read as if a bool were refused
    return f"{'numpy.' if kind.__module__ == 'numpy' else ''}{kind.__name__} {text}"


def _is_ndarray(value: Any) -> bool:
    np = sys.modules.get("numpy")  # numpy arrays can only exist if numpy was imported
    return np is not None and isinstance(value, np.ndarray)


def check_readable(name: str, value: Any) -> None:
    """A tensor whose values ``tolist()`` cannot read (a meta tensor, made under ``torch.set_default_device("meta")``;
    a sparse or nested one) as a one-line ``InputTypeError``, not torch's NotImplementedError / RuntimeError."""
    if isinstance(value, torch.Tensor) and (value.is_meta or value.is_nested or value.layout != torch.strided):
        kind = "meta" if value.is_meta else "nested" if value.is_nested else f"sparse ({value.layout})"
        raise InputTypeError(f"{name} is a {kind} tensor, which holds no values to read: pass a dense tensor on a "
                             f"real device, a numpy array or lists")


def is_int(value: Any) -> bool:
    """A Python / numpy integer, or a 0-D integer tensor; never a bool."""
    if type(value) is int:  # the common case, per token: skips the ABC check below (bool is not int here)
        return True
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and _int_dtype(value.dtype)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_"


def is_finite_number(value: Any) -> bool:
    """A Python int or float, never a bool, that is finite (what a JSON number read back must be to be used)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _int_array_dtype(dtype: torch.dtype | str) -> bool:
    """An integer torch dtype, or a numpy dtype kind letter of (unsigned) integers."""
    return _int_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype in ("i", "u")


# ---- scalars --------------------------------------------------------------------------------
def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None,
              optional: bool = False) -> int | None:
    """``value`` as an int, refusing bools, floats, strings (``InputTypeError``) and values out of range."""
    if value is None and optional:
        return None
    if not is_int(value):
        kind = "an int or None" if optional else "an int"
        raise InputTypeError(f"{name} must be {kind}, got {describe(value)}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InputError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InputError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InputTypeError(f"{name} must be True or False, got {describe(value)}")
    return value


def check_real(name: str, value: Any) -> float:
    """A finite real number (int or float, not bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"{name} must be a number, got {describe(value)}")
    if not math.isfinite(value):
        raise InputError(f"{name} must be finite, got {value}")
    return float(value)


def is_put_end_streamer(streamer: Any) -> bool:
    """True for transformers' streamer protocol (``put(tensor)`` and ``end()``: ``TextStreamer``,
    ``TextIteratorStreamer``, ...), False for specdec's callable ``streamer(batch_index, tokens)`` or None;
    anything else is an InputTypeError. An object with both forms is taken as transformers' streamer."""
    if streamer is None:
        return False
    if callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None)):
        return True
    if callable(streamer):
        return False
    raise InputTypeError(f"streamer must be a callable (batch index, tokens), an object with put() and end() "
                         f"(transformers' streamers) or None, got {describe(streamer)}")


def check_options(name: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise InputTypeError(f"{name} must be a dict of option name -> value, got {describe(value)}")
    return dict(value)


# ---- input_ids / attention_mask -------------------------------------------------------------
def _rows(name: str, value: Any, element_ok: Callable[[Any], bool], array_ok: Callable[[Any], bool],
          expected: str, element: str) -> tuple[list[list[Any]], str]:
    """A 1-D / 2-D tensor or numpy array, a flat list (one row) or a list of rows (ragged) ->
    (rows, shape description). ``array_ok(dtype)`` checks a tensor's / array's dtype (a numpy dtype by its
    kind letter), ``element_ok`` a list item, described as ``element`` in errors."""
    if isinstance(value, torch.Tensor) or _is_ndarray(value):
        is_tensor = isinstance(value, torch.Tensor)
        check_readable(name, value)
        if not array_ok(value.dtype if is_tensor else value.dtype.kind) or value.ndim not in (1, 2):
            raise InputTypeError(f"{name} must be {expected}, got {describe(value)}")
        rows = value.tolist()
        rows = [rows] if value.ndim == 1 else rows
        return rows, str(tuple(value.shape))
    if isinstance(value, (list, tuple)):
        if value and all(element_ok(v) for v in value):
            rows = [list(value)]
        else:
            rows = []
            for i, row in enumerate(value):
                if isinstance(row, torch.Tensor) or _is_ndarray(row):
                    check_readable(f"{name}[{i}]", row)
                    if row.ndim != 1 or not array_ok(row.dtype if isinstance(row, torch.Tensor) else row.dtype.kind):
                        raise InputTypeError(f"{name}[{i}] must be a 1-D sequence of {element}s, got {describe(row)}")
                    rows.append(row.tolist())
                elif isinstance(row, (list, tuple)):
                    bad = next((j for j, v in enumerate(row) if not element_ok(v)), None)
                    if bad is not None:
                        raise InputTypeError(f"{name}[{i}][{bad}] must be {element}, got {describe(row[bad])}")
                    rows.append(list(row))
                else:
                    raise InputTypeError(f"{name} must be {expected}, but {name}[{i}] is {describe(row)}")
        return rows, f"{len(rows)} row(s) of lengths {[len(r) for r in rows]}"
    raise InputTypeError(f"{name} must be {expected}, got {describe(value)}")


_IDS = "integer token ids: a 1-D / 2-D integer tensor or numpy array, a list of ints or a list of int lists"
_MASK = "0 / 1 values: a tensor, numpy array or list(s) with the shape of input_ids"


def _is_real(v: Any) -> bool:
    """A Python / numpy number (bools too) or a 0-D real tensor: the type of a mask value."""
    if isinstance(v, torch.Tensor):
        return v.dim() == 0 and not v.dtype.is_complex
    return isinstance(v, numbers.Real)


# Keys of a tokenizer's output that generate() accepts and ignores, in a BatchEncoding / dict passed as input_ids
# or as keyword arguments (``**tokenizer(...)``): none is an input of the Llama-family models specdec runs
# (they have no token-type embedding), so none can change the result. transformers' generate() refuses them.
IGNORED_INPUT_KEYS = ("token_type_ids", "special_tokens_mask", "offset_mapping", "length", "assistant_masks")


def unpack_encoding(input_ids: Any, attention_mask: Any) -> tuple[Any, Any]:
    """``input_ids`` given as a mapping (a tokenizer's ``BatchEncoding``, ``apply_chat_template(...,
    return_dict=True)``'s result, a dict) -> (its ``input_ids``, its ``attention_mask``); other values pass
    through. Keys other than those two and :data:`IGNORED_INPUT_KEYS` are an InputError naming them."""
    if not isinstance(input_ids, Mapping):
        return input_ids, attention_mask
    keys = list(input_ids)
    if "input_ids" not in input_ids:
        raise InputError(f"input_ids is a mapping without an 'input_ids' key (keys: {keys[:8]})")
    unknown = [k for k in keys if k not in ("input_ids", "attention_mask", *IGNORED_INPUT_KEYS)]
    if unknown:
        raise InputError(f"input_ids is a mapping with keys specdec does not use: {unknown[:8]} (it reads input_ids "
                         f"and attention_mask, and ignores {', '.join(IGNORED_INPUT_KEYS)})")
    if "attention_mask" in input_ids and attention_mask is not None:
        raise InputError("attention_mask was given twice: in the input_ids mapping and as attention_mask=")
    return input_ids["input_ids"], input_ids.get("attention_mask", attention_mask)


@dataclass(frozen=True)
class Inputs:
    """``input_ids`` parsed: the prompts the engine decodes and the rows the result keeps, as transformers
    keeps them (the result is each row as given, padding included, then its new tokens)."""

    prompts: list[list[int]]  # one per row, positions with attention_mask 0 removed
    rows: list[list[int]]  # as given, padding included
    tensor_device: torch.device | None  # a tensor came in: the result is a tensor on this device; None: lists
    masked: bool = False  # an attention_mask came with them

    @property
    def length(self) -> int:
        """The input length that ``max_length`` counts: ``input_ids.shape[-1]`` (the longest row of lists)."""
        return max(len(r) for r in self.rows)

    def repeat(self, n: int) -> "Inputs":
        """Each row ``n`` times, consecutively (``num_return_sequences``)."""
        return Inputs([p for p in self.prompts for _ in range(n)], [r for r in self.rows for _ in range(n)],
                      self.tensor_device, self.masked)

    def infer_mask(self, pad_token_id: int | None, eos: Sequence[int]) -> "Inputs":
        """transformers' rule for a tensor without attention_mask: where the pad id occurs in it and is no EOS id,
        its positions are padding (dropped from the prompts); else every position is a token."""
        if (self.masked or self.tensor_device is None or pad_token_id is None or pad_token_id in eos
                or not any(pad_token_id in r for r in self.rows)):
            return self
        prompts = [[t for t in r if t != pad_token_id] for r in self.rows]
        for i, p in enumerate(prompts):
            if not p:
                raise InputError(f"prompt {i} is all padding (pad_token_id {pad_token_id}, no attention_mask): "
                                 "every prompt needs at least one token")
        return Inputs(prompts, self.rows, self.tensor_device, True)


def parse_input_ids(input_ids: Any, attention_mask: Any = None) -> Inputs:
    """The prompts as lists of Python ints, with ``attention_mask`` (same shape as ``input_ids``) applied:
    positions with mask 0 are dropped (left or right padding, also for lists); the rows as given. Token ids
    are not yet checked against a vocabulary (:func:`check_vocabulary`). A mapping goes through
    :func:`unpack_encoding` first."""
    if isinstance(input_ids, Mapping):
        raise InputTypeError("input_ids must be token ids, got a mapping: unpack_encoding() takes it apart")
    if isinstance(input_ids, str) or (isinstance(input_ids, (list, tuple)) and input_ids
                                      and all(isinstance(t, str) for t in input_ids)):
        raise InputTypeError(f"input_ids must be {_IDS}, got text {describe(input_ids)}: tokenize it first, as for "
                             "transformers' generate(), e.g. loaded = specdec.load_model(model); "
                             "specdec.generate(loaded, loaded.tokenizer(texts, return_tensors='pt', padding=True))")
    prompts, shape = _rows("input_ids", input_ids, is_int, _int_array_dtype, _IDS, "an int token id")
    prompts = [[int(t) for t in p] for p in prompts]  # 0-D tensors / numpy ints -> int
    if not prompts:
        raise InputError("input_ids holds no prompt")
    rows = prompts
    if attention_mask is not None:
        masks, mask_shape = _rows("attention_mask", attention_mask, _is_real,
                                  lambda d: True if isinstance(d, torch.dtype) and not d.is_complex else d in "biuf",
                                  _MASK, "a 0 / 1 value")
        if [len(m) for m in masks] != [len(p) for p in prompts]:
            raise InputError(f"attention_mask must have the shape of input_ids: input_ids is {shape}, "
                             f"attention_mask is {mask_shape}")
        masks = [[v.item() if isinstance(v, torch.Tensor) else v for v in m] for m in masks]
        for i, m in enumerate(masks):
            if any(v not in (0, 1) for v in m):
                raise InputError(f"attention_mask must hold only 0 and 1 (or bools), row {i} has "
                                 f"{sorted({v for v in m if v not in (0, 1)})[:5]}")
        prompts = [[t for t, keep in zip(p, m, strict=True) if keep] for p, m in zip(prompts, masks, strict=True)]
    for i, p in enumerate(prompts):
        if not p:
            why = " (its attention_mask row has no 1)" if attention_mask is not None else ""
            raise InputError(f"prompt {i} is empty{why}: every prompt needs at least one token")
    return Inputs(prompts, rows, input_ids.device if isinstance(input_ids, torch.Tensor) else None,
                  attention_mask is not None)


def check_encoded(text: str, ids: Sequence[int], what: str = "the prompt") -> list[int]:
    """``ids``, a tokenizer's encoding of the prompt ``text`` (``what`` names it), as a list; a one-line
    :class:`InputError` where a text encodes to no token (a vocabulary of no piece of it, and no chat template to add
    any): left to generate(), it was "prompt 0 is empty", a prompt the user never gave empty."""
    if text and not ids:
        raise InputError(f"the model's tokenizer encodes {what} {text[:40]!r}{'...' * (len(text) > 40)} to no token "
                         "(no chat template applied, and no piece of the text in its vocabulary): give a model "
                         "whose tokenizer encodes text")
    return list(ids)


def check_vocabulary(name: str, sequences: list[list[int]], vocab_size: int) -> None:
    for i, p in enumerate(sequences):
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"{name}: sequence {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")


# ---- eos_token_id / stop --------------------------------------------------------------------
_EOS = "integer token ids: an int, a list of ints or a 0-D / 1-D integer tensor or numpy array"


def parse_eos_ids(eos_token_id: Any, vocab_size: int) -> tuple[int, ...]:
    """EOS ids as transformers takes them, each checked against the vocabulary, in the order given (transformers pads
    with the first one when it has no pad id)."""
    if eos_token_id is None:
        return ()
    if is_int(eos_token_id):
        items = [eos_token_id]
    elif isinstance(eos_token_id, torch.Tensor) or _is_ndarray(eos_token_id):
        is_tensor = isinstance(eos_token_id, torch.Tensor)
        check_readable("eos_token_id", eos_token_id)
        if eos_token_id.ndim > 1 or not (_int_dtype(eos_token_id.dtype) if is_tensor
                                         else eos_token_id.dtype.kind in "iu"):
            raise InputTypeError(f"eos_token_id must be {_EOS}, got {describe(eos_token_id)}")
        items = eos_token_id.reshape(-1).tolist()
    elif isinstance(eos_token_id, (list, tuple, set, frozenset)) and all(is_int(x) for x in eos_token_id):
        items = list(eos_token_id)
    else:
        raise InputTypeError(f"eos_token_id must be {_EOS}, got {describe(eos_token_id)}")
    items = [int(x) for x in items]
    for x in items:
        if not 0 <= x < vocab_size:
            raise InputError(f"eos_token_id {x} is outside the vocabulary [0, {vocab_size})")
    return tuple(items)


_STOP = "a string, or a list of strings and / or token-id sequences"


def parse_stop(stop: Any) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """``stop`` -> (stop strings, token-id stop sequences). A bare int (``stop=5``, ``stop=[5]``) is refused:
    it could mean the token 5 or the sequence (5,); the caller says which."""
    if stop is None:
        return (), ()
    if isinstance(stop, str):
        stop = [stop]
    if is_int(stop):
        raise InputTypeError(f"stop must be {_STOP}, got {describe(stop)}; for the token id pass stop=[[{int(stop)}]] "
                             f"or eos_token_id={int(stop)}")
    if not isinstance(stop, (list, tuple, set, frozenset)):
        raise InputTypeError(f"stop must be {_STOP}, got {describe(stop)}")
    strings: list[str] = []
    seqs: list[tuple[int, ...]] = []
    for i, s in enumerate(stop):
        if isinstance(s, str):
            if not s:
                raise InputError(f"stop[{i}] is an empty string: it would stop at once")
            strings.append(s)
        elif is_int(s):
            raise InputTypeError(f"stop[{i}] is a bare token id ({int(s)}): ambiguous; pass stop=[[{int(s)}]] for a "
                                 f"one-token stop sequence, or eos_token_id={int(s)}")
        elif isinstance(s, (list, tuple)) and all(is_int(t) for t in s):
            if not s:
                raise InputError(f"stop[{i}] is an empty token sequence: it would stop at once")
            seqs.append(tuple(int(t) for t in s))
        elif (isinstance(s, torch.Tensor) and s.dim() == 1 and _int_dtype(s.dtype)) or (
                _is_ndarray(s) and s.ndim == 1 and s.dtype.kind in "iu"):
            if not len(s):
                raise InputError(f"stop[{i}] is an empty token sequence: it would stop at once")
            seqs.append(tuple(int(t) for t in s.tolist()))
        else:
            raise InputTypeError(f"stop[{i}] must be a string or a sequence of int token ids, got {describe(s)}")
    return tuple(strings), tuple(seqs)


# ---- KV cache size --------------------------------------------------------------------------
def check_cache_fits(shape: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                     explicit: bool) -> None:
    """Refuse a KV cache that cannot fit in the device's available memory, before allocating it.

    ``shape`` is the runner's ModelShape; ``explicit``: num_blocks was given (else generate() sized it)."""
    import specdec.kv_cache as kv_cache  # looked up at call time: tests replace available_memory_bytes

    need = kv_cache.cache_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, num_blocks, block_size, dtype)
    have = kv_cache.available_memory_bytes(device)
    if have is None or need <= have:
        return
    per_block = kv_cache.cache_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, 1, block_size, dtype)
    fits = have // per_block
    gib = 2**30
    what = (f"the KV cache of num_blocks={num_blocks} x block_size={block_size} needs {need / gib:.2f} GiB"
            if explicit else
            f"this request's KV cache ({num_blocks} blocks of {block_size} tokens, enough for every prompt + "
            f"max_new_tokens + the draft tree) needs {need / gib:.2f} GiB")
    hint = (f"pass num_blocks <= {fits}" if explicit else
            f"pass fewer or shorter prompts, a smaller max_new_tokens, or num_blocks <= {fits} (a pool the "
            "sequences outgrow raises CacheFullError)")
    if fits < 1:
        hint = f"not even one block of {block_size} tokens fits: pass a smaller block_size"
    error = InputError if explicit else kv_cache.CacheFullError
    raise error(f"{what}, but only {have / gib:.2f} GiB are available on {device}: {hint}")
