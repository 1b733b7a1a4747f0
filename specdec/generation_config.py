"""``GenerationConfig``: what to generate, in transformers' words, frozen and checked once.

    config = GenerationConfig(max_new_tokens=64, do_sample=True, temperature=0.7, seed=0)
    config = config.update(top_p=0.9)                    # a new config; unknown names are an InputTypeError
    config.fields_set            # {"max_new_tokens", "do_sample", "temperature", "seed", "top_p"}
    specdec.generate(model, ids, generation_config=config, max_new_tokens=32)   # kwargs win

Every field is checked in ``__post_init__`` (one-line ``InputError`` / ``InputTypeError``
naming it). Checks that need the model (token ids inside the vocabulary, prompt + max_new_tokens
within the context) happen when the model is known, in :func:`specdec.generate.prepare`.

``fields_set`` are the names given when the config was built (or ``update()``-d): only those override
the model's own ``generation_config`` in generate() (:mod:`specdec.transformers_config`), as only the
fields a transformers ``GenerationConfig`` sets do; a field left at its default gives way to the model's.
``dataclasses.replace`` counts every field as set: use ``update()``.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, fields
from typing import Any

from specdec.coupling import SAMPLERS
from specdec.errors import InputError, InputTypeError, closest
from specdec.generate_inputs import check_bool, check_int, describe, parse_stop
from specdec.processor_fields import PROCESSOR_FIELDS, check_processing_fields
from specdec.sampling import SamplingConfig

SPECULATION_MODES = ("auto", "always")


# arguments of from_pretrained / load_model, not of generation: generate() takes a model loaded with them
LOAD_ARGUMENTS = {"dtype": "dtype", "torch_dtype": "dtype", "device": "device", "device_map": "device",
                  "trust_remote_code": "trust_remote_code"}


def unknown_arguments(unknown: list[str], known: set[str], call_arguments: Collection[str] = ()) -> str:
    """The one-line error for misspelt generation arguments: the likely meant ones first (among ``known`` and
    ``call_arguments``, generate()'s own keyword arguments such as ``drafter_options``) or, for a loading
    argument such as ``dtype=``, where it goes; then every known name (not after loading arguments alone)."""
    plural = "s" if len(unknown) > 1 else ""
    load = [name for name in unknown if name in LOAD_ARGUMENTS]
    candidates = known | set(call_arguments)
    meant = [m for name in unknown if name not in LOAD_ARGUMENTS if (m := closest(name, candidates))]
    hint = f" (did you mean {', '.join(meant)}?)" if meant else ""
    if load:
        given = ", ".join(f"{arg}=..." for arg in dict.fromkeys(LOAD_ARGUMENTS[name] for name in load))
        hint += (f" ({', '.join(load)}: an argument of loading, not of generation; load the model once with "
                 f"specdec.load_model(model, {given}) and pass what it returns to generate())")
    if len(load) == len(unknown):  # each one's place is said: the list of generation arguments would bury it
        return f"unknown generation argument{plural} {', '.join(unknown)}{hint}"
    return f"unknown generation argument{plural} {', '.join(unknown)}{hint}; known: {', '.join(sorted(known))}"


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate, in transformers' field names: length, sampling, stopping, logits processors, the KV cache
    and how speculation runs. Frozen; every field is checked when it is built (a one-line InputError /
    InputTypeError naming it, a misspelt name too). Only the fields given (``fields_set``) override the model's
    own generation_config in generate(); ``update()`` gives a changed copy. Field by field: the comments in
    ``specdec/generation_config.py`` and docs/python-api.md."""

    max_new_tokens: int = 128  # the default only when neither max_new_tokens nor max_length is set anywhere
    # prompt + new tokens, as transformers counts it (the prompt is input_ids.shape[-1], padding included; the
    # longest row for lists); max_new_tokens wins where both are set. generate() turns it into max_new_tokens
    max_length: int | None = None
    num_return_sequences: int = 1  # copies of each prompt, consecutive in the output; needs do_sample=True
    do_sample: bool = False  # False: greedy decoding (the target's own argmax tokens)
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled; generate() samples with transformers' 50 when no layer sets it
    top_p: float = 1.0  # 1.0 = disabled
    seed: int | None = None  # seeds sampling and sampled drafts; None = torch's global RNG
    eos_token_id: Any = None  # int, list of ints, 0-D / 1-D integer tensor; None = the model's own
    stop: Any = None  # a string, or a list of strings (need the tokenizer) and / or token-id sequences
    pad_token_id: int | None = None  # fills a tensor result; None = the model's, else the first EOS id, else 0
    block_size: int = 16  # KV cache block size in tokens
    # KV cache size; None = enough for every prompt + max_new_tokens + a draft tree. Below that, draft trees are cut
    # to the free blocks (exact); below plain decoding's need, a warning, and CacheFullError may end the call
    num_blocks: int | None = None
    audit_drafts: bool = True  # statistical audit of sampled drafts (specdec.audit)
    # "auto": verify the part of each draft tree that the measured cost model expects to pay and decode plainly
    # when none does (specdec.tree_sizing); "always": verify every proposed tree whole (measuring a drafter).
    # Seeded standard sampling (seed= or generator=) verifies every tree whole: no decision may read this machine's
    # measured costs, so one seed gives one text whatever the cost cache holds (sampler="coupled" sizes them)
    speculation: str = "auto"
    # "standard": exact rejection sampling; "coupled": Gumbel-max noise keyed by (seed, prompt, position), so the
    # same seed gives the same text with or without a drafter, alone or batched (specdec.coupling)
    sampler: str = "standard"
    # logits processors, transformers' names, applied at every draft-tree node with that node's own prefix so the
    # output stays exactly plain decoding's with them (specdec.logits_processing); None is read as off
    repetition_penalty: float = 1.0  # 1.0 = off
    no_repeat_ngram_size: int = 0  # 0 = off
    bad_words_ids: Any = None  # list of token-id lists that may not be generated
    min_new_tokens: int = 0  # EOS cannot come before this many new tokens
    logits_processor: Any = None  # a LogitsProcessorList / list of (input_ids, scores) -> scores callables
    logits_processor_prefix_only: bool = False  # required with logits_processor: the caller vouches it is prefix-only
    # GenerateOutput.logprobs: each new token's log-probability after the processors and the sampling transform
    # (greedy: log_softmax of the processed logits; specdec.logprobs); needs return_dict
    output_logprobs: bool = False
    output_scores: bool = False  # transformers' name, read as output_logprobs (only with return_dict; no .scores)
    # the bit-exact mode: every row of the target's forward computed as a one-row forward at its position would
    # be, whatever else shares it (tree nodes, other sequences), so speculative output is byte-identical to plain
    # decoding's in every dtype (specdec.models.invariant_ops; docs/bit-exact.md)
    invariant: bool = False
    # more of transformers' logits processors (specdec.logits_processing; placed last so that positional
    # arguments keep their meaning). min_length: EOS cannot come before the prompt, counted as input_ids.shape[-1]
    # as max_length counts it, plus the new tokens reach it; 0 = off; min_new_tokens, where set, replaces it
    min_length: int = 0
    sequence_bias: Any = None  # {(token ids): bias} or [[token ids, bias], ...]: added where the ids would complete
    forced_bos_token_id: int | None = None  # the first new token where input_ids.shape[-1] is 1 (transformers' rule)
    forced_eos_token_id: Any = None  # token id(s) forced as the last new token (at max_new_tokens)
    remove_invalid_values: bool = False  # NaN -> 0 and +-inf -> the dtype's max / min, after the processors above
    exponential_decay_length_penalty: Any = None  # (start_index, decay_factor): EOS logits grow after start new tokens
    suppress_tokens: Any = None  # token ids that are never generated
    begin_suppress_tokens: Any = None  # token ids that are not generated as the first new token
    # transformers' other sampling warpers, in transformers' order with temperature, top_k and top_p (specdec.warpers;
    # placed last too)
    min_p: float = 0.0  # 0 = disabled
    typical_p: float = 1.0  # 1.0 = disabled
    epsilon_cutoff: float = 0.0  # 0 = disabled
    eta_cutoff: float = 0.0  # 0 = disabled
    top_h: float | None = None  # None = disabled; applied before top_k, as transformers does

    def __new__(cls, *args: Any, **kwargs: Any) -> "GenerationConfig":
        # record which fields the caller gave (positionally or by name) before the dataclass __init__ fills in
        # the defaults: they are the ones that override the model's generation_config (see fields_set)
        # a misspelt name or a surplus argument is the caller's one-line InputTypeError here, not the
        # dataclass __init__'s TypeError
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise InputTypeError(f"GenerationConfig: {unknown_arguments(unknown, set(names))}")
        if len(args) > len(names):
            raise InputTypeError(f"GenerationConfig takes at most {len(names)} positional arguments, got "
                                 f"{len(args)}; pass the fields by name")
        twice = [name for name in names[: len(args)] if name in kwargs]
        if twice:
            raise InputTypeError(f"GenerationConfig got {', '.join(twice)} both by position and by name")
        self = super().__new__(cls)
        given = names[: len(args)] + list(kwargs)
        object.__setattr__(self, "_fields_set", frozenset(given))
        return self

    @property
    def fields_set(self) -> frozenset[str]:
        """The fields given when this config was built or updated (the others hold their defaults)."""
        return self._fields_set

    def __post_init__(self) -> None:
        ints = {  # numpy / 0-D tensor ints are stored as Python ints
            "max_new_tokens": check_int("max_new_tokens", self.max_new_tokens, minimum=1),
            "max_length": check_int("max_length", self.max_length, minimum=1, optional=True),
            "num_return_sequences": check_int("num_return_sequences", self.num_return_sequences, minimum=1),
            "block_size": check_int("block_size", self.block_size, minimum=1),
            "num_blocks": check_int("num_blocks", self.num_blocks, minimum=1, optional=True),
            "seed": check_int("seed", self.seed, minimum=-(2**63), maximum=2**64 - 1, optional=True),
            "pad_token_id": check_int("pad_token_id", self.pad_token_id, minimum=-(2**63), maximum=2**63 - 1,
                                      optional=True),
        }
        for name, value in ints.items():
            object.__setattr__(self, name, value)
        check_bool("audit_drafts", self.audit_drafts)
        if self.speculation not in SPECULATION_MODES:
            raise InputError(f"speculation must be one of {', '.join(map(repr, SPECULATION_MODES))}, "
                             f"got {describe(self.speculation)}")
        if self.sampler not in SAMPLERS:
            raise InputError(f"sampler must be one of {', '.join(map(repr, SAMPLERS))}, got {describe(self.sampler)}")
        self.sampling  # noqa: B018 -- do_sample, temperature and the warpers checked by SamplingConfig
        parse_stop(self.stop)
        for name, value in check_processing_fields(**{n: getattr(self, n) for n in PROCESSOR_FIELDS}).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "invariant", check_bool("invariant", self.invariant))
        for name in ("output_logprobs", "output_scores"):  # None = False, as transformers reads it
            value = getattr(self, name)
            object.__setattr__(self, name, False if value is None else check_bool(name, value))

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig.from_kwargs({f.name: getattr(self, f.name) for f in fields(self)})

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return parse_stop(self.stop)[0]

    @property
    def stop_sequences(self) -> tuple[tuple[int, ...], ...]:
        return parse_stop(self.stop)[1]

    def update(self, **changes: Any) -> "GenerationConfig":
        """A copy with ``changes`` applied (added to ``fields_set``); a name that is not a field is an
        InputTypeError naming it."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InputTypeError(unknown_arguments(unknown, known))
        given = {name: getattr(self, name) for name in self.fields_set}
        return type(self)(**{**given, **changes})
