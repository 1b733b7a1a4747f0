"""What to generate, from the three places transformers takes it from, in transformers' precedence.

    layers = [model_layer(loaded.model), config_layer(generation_config), kwargs_layer(kwargs)]  # lowest first
    config = resolve(layers, prompt_length=inputs.length)          # a specdec GenerationConfig, max_length resolved

    keyword arguments  >  generation_config=  >  the model's generation_config (generation_config.json)  >  defaults

A layer contributes only the fields it *sets* (a transformers config's non-None fields, a specdec config's
``fields_set``, the keyword arguments given). A config's None never overrides; a keyword argument's None does, as
in transformers 5 (:data:`NONE_KWARG`): ``eos_token_id=None`` is no EOS, ``stop_strings`` / ``bad_words_ids`` /
``pad_token_id`` None are none, sampling fields None are off. Every transformers field is one of:

* read: the fields of specdec's GenerationConfig under transformers' names; ``stop_strings`` as ``stop``,
  ``return_dict_in_generate`` as ``return_dict``, ``output_scores`` as ``output_logprobs``, the prefix-only
  logits processors (:mod:`specdec.logits_processing`);
* ignored, because it cannot change the tokens (:data:`IGNORED`: ``bos_token_id``, cache and compile settings,
  assisted-generation tuning, ...);
* refused when set to anything but a neutral value (:data:`REFUSED`: beam search, but length_penalty /
  early_stopping under num_beams 1, contrastive search, encoder_* processors, stopping_criteria, ...): a
  one-line InputError naming the field and its source. A field this file does not know is refused the same way;
  custom keys of a generation_config.json are logged and ignored; an unknown keyword: InputTypeError.

Sampling: where no layer sets ``top_k``, top-k is transformers' 50, as transformers' generate() fills it in.

Lengths: ``max_length`` (and ``min_length``) count the prompt as ``input_ids.shape[-1]`` (the longest row of a list
input); ``max_new_tokens`` (``min_new_tokens``) wins where both are set, whatever layer each comes from; neither
set anywhere: 128 new tokens. The keyword ``max_new_tokens=None`` clears the lower layers' value, as in
transformers 5: ``max_length`` decides, else specdec's 128 (transformers' default: 20 new tokens).
"""
from __future__ import annotations

import functools
import logging
import numbers
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from specdec.errors import InputError, InputTypeError
from specdec.generate_inputs import describe
from specdec.generation_config import GenerationConfig, unknown_arguments
from specdec.sampling import WARPERS

logger = logging.getLogger(__name__)

KWARGS = "keyword argument"  # the source named in messages about generate()'s keyword arguments
MODEL_SOURCE = "the model's generation_config"
TRANSFORMERS_TOP_K = 50  # transformers' top_k when sampling and no layer sets it

ALIASES = {"stop_strings": "stop"}  # transformers' name -> specdec's GenerationConfig field
RETURN_DICT = "return_dict_in_generate"  # -> generate()'s return_dict

# name -> why it cannot change the output
_RUNTIME = "how transformers runs the model (specdec has its own paged KV cache and kernels)"
_ASSISTED = "tunes transformers' assisted generation (specdec's drafters and tree sizing decide)"
IGNORED: dict[str, str] = {
    "bos_token_id": "used only to start generation without a prompt",
    "decoder_start_token_id": "encoder-decoder models only",
    "transformers_version": "metadata",
    "renormalize_logits": "a log_softmax after the last processor: the same probabilities and argmax",
    "synced_gpus": "keeps several GPUs of one transformers run in step",
    **dict.fromkeys(("use_cache", "cache_implementation", "cache_config", "max_cache_len", "compile_config",
                     "disable_compile", "prefill_chunk_size", "continuous_batching_config"), _RUNTIME),
    **dict.fromkeys(("is_assistant", "num_assistant_tokens", "num_assistant_tokens_schedule",
                     "assistant_confidence_threshold", "assistant_lookbehind", "target_lookbehind",
                     "max_matching_ngram_size"), _ASSISTED),
}

# name -> (values that change nothing besides None, what the field does)
_ENCODER = ("an encoder-decoder processor (on a decoder-only model transformers reads the left-padded prompt as "
            "the encoder input, pads included)")
_BEAM = "beam search (specdec decodes greedily or samples)"
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_beams": ((1,), _BEAM), "num_beam_groups": ((1,), _BEAM), "diversity_penalty": ((0.0,), _BEAM),
    "length_penalty": ((1.0,), _BEAM), "early_stopping": ((False,), _BEAM), "constraints": ((), _BEAM),
    "force_words_ids": ((), _BEAM),
    "penalty_alpha": ((), "contrastive search"), "low_memory": ((False,), "contrastive search"),
    "dola_layers": ((), "DoLa decoding"),
    "encoder_repetition_penalty": ((1.0,), _ENCODER), "encoder_no_repeat_ngram_size": ((0,), _ENCODER),
    "guidance_scale": ((1, 1.0), "classifier-free guidance"), "watermarking_config": ((), "watermarking"),
    "token_healing": ((False,), "token healing"), "max_time": ((), "a time limit (the output would depend on speed)"),
    **dict.fromkeys(("output_attentions", "output_hidden_states", "output_logits"),
                    ((False,), "extra outputs (specdec returns sequences and GenerateOutput's stats)")),
    "prompt_lookup_num_tokens": ((), "transformers' prompt lookup (use drafter='ngram')"),
    "assistant_early_exit": ((), "transformers' early-exit assistant (use drafter='self-draft')"),
    "use_mtp": ((False,), "multi-token prediction heads"),
    "speculation_type": ((), "transformers' speculation types"),
    "assistant_ensemble_weight": ((), "lossy ensemble verification"),
    # transformers' generate() arguments that are no config fields
    "stopping_criteria": ((), "custom stopping criteria (use stop= or eos_token_id=)"),
    "prefix_allowed_tokens_fn": ((), "a constraint on the next token (use bad_words_ids= or a prefix-only "
                                     "logits_processor=)"),
    **dict.fromkeys(("assistant_model", "assistant_tokenizer"), ((), "transformers' assisted generation (use "
                                                                     "drafter=)")),
    **dict.fromkeys(("negative_prompt_ids", "negative_prompt_attention_mask"), ((), "classifier-free guidance")),
    "custom_generate": ((), "a custom decoding loop"),
    # model inputs transformers' generate() passes to the model's forward: None is what it does without them
    "past_key_values": ((), "a transformers cache to continue from (specdec prefills the prompt into its own "
                            "paged KV cache)"),
    "inputs_embeds": ((), "prompt embeddings in place of token ids"),
    "decoder_input_ids": ((), "encoder-decoder models only"),
    **dict.fromkeys(("position_ids", "cache_position"), ((), "positions of the caller's (specdec numbers them from "
                                                             "the attention mask, as transformers does without)")),
}
BEAM_ONLY = frozenset({"length_penalty", "early_stopping"})  # change nothing where num_beams is 1


@dataclass(frozen=True)
class ConfigLayer:
    """One place settings come from: the specdec fields it sets, and where it came from (for messages)."""

    source: str  # "keyword argument", "generation_config=", "the model's generation_config"
    values: Mapping[str, Any] = field(default_factory=dict)  # specdec GenerationConfig field -> value, set only
    refused: Mapping[str, Any] = field(default_factory=dict)  # REFUSED (or unknown transformers) field -> value
    return_dict: bool | None = None  # return_dict_in_generate, if it set it


def _specdec_fields() -> set[str]:
    return {f.name for f in fields(GenerationConfig)}


# a keyword argument's None, which overrides the lower layers as in transformers 5: the value it stands for, or
# UNSET (the field falls back to max_length / specdec's default). Fields not named keep None (pad_token_id, stop,
# bad_words_ids, seed, and the processors' None = off); num_return_sequences=None is refused, as transformers fails
UNSET = object()
NONE_KWARG: dict[str, Any] = {"max_new_tokens": UNSET, "max_length": UNSET, "eos_token_id": (), "do_sample": False,
                              "temperature": 1.0, **{name: off for name, off in WARPERS.items() if off is not None}}


def _known_names() -> set[str]:
    return _specdec_fields() | set(ALIASES) | {RETURN_DICT} | set(IGNORED) | set(REFUSED)


@functools.lru_cache(maxsize=1)
def _transformers_fields() -> frozenset[str]:
    import transformers

    return frozenset(k for k in vars(transformers.GenerationConfig()) if not k.startswith("_"))


def _is_transformers_config(value: Any) -> bool:
    cls = type(value)  # without importing transformers when it is not in play
    return any(c.__name__ == "GenerationConfig" and c.__module__.startswith("transformers.") for c in cls.__mro__)


def _is_neutral(name: str, value: Any) -> bool:
    """None, False, empty, or a value of ``name`` that changes nothing (num_beams=1, min_p=0, ...)."""
    if value is None or value is False or (isinstance(value, (list, tuple, dict, set, frozenset)) and not value):
        return True
    neutral = REFUSED.get(name, ((), ""))[0]
    return not isinstance(value, bool) and isinstance(value, numbers.Number) and any(
        not isinstance(v, bool) and value == v for v in neutral)


def _read(source: str, items: Mapping[str, Any], kwargs: bool = False, call_arguments: Collection[str] = ()) \
        -> ConfigLayer:
    """``items`` (name -> value; None = unset) as a layer; names nobody knows (custom entries of a
    transformers config) are logged and ignored, as transformers ignores them, with a warning where the name is one
    of ``call_arguments`` (generate()'s own, such as ``drafter``, which a config cannot set). ``kwargs`` (keyword
    arguments): None is kept, so that it overrides a lower layer's value (:data:`NONE_KWARG`), or so that
    GenerationConfig refuses it for a specdec field that cannot be None (``block_size=None``)."""
    known = _specdec_fields()
    values: dict[str, Any] = {}
    refused: dict[str, Any] = {}
    return_dict = None
    for name, value in items.items():
        if value is None and not kwargs:
            continue
        if name in known or name in ALIASES:
            target = ALIASES.get(name, name)
            if target in values:
                raise InputError(f"{source} sets both {target} and its transformers alias "
                                 f"{next(a for a, t in ALIASES.items() if t == target)}: pass one")
            values[target] = value
        elif name == RETURN_DICT:
            value = False if value is None else value  # a keyword's None: off, as transformers reads it
            if not isinstance(value, bool):
                raise InputTypeError(f"{RETURN_DICT} must be True or False, got {describe(value)}")
            return_dict = value
        elif name in IGNORED:
            logger.debug("%s: %s=%r ignored: %s", source, name, value, IGNORED[name])
        elif name in REFUSED or name in _transformers_fields():
            refused[name] = value  # checked once the layers are merged: a higher layer may set it back
        elif name in call_arguments:  # GenerationConfig(drafter="ngram"): it would decode plainly without a word
            logger.warning("%s holds %s=%s, an argument of generate() itself, which a generation config does not "
                           "set: ignored; pass generate(..., %s=...)", source, name, _short(value), name)
        else:
            logger.info("%s: %s=%r is no transformers generation field: ignored, as transformers ignores it",
                        source, name, value)
    return ConfigLayer(source, values, refused, return_dict)


def _short(value: Any) -> str:
    """A value for a one-line message: its repr's first line (a module's repr spans many), at most 60 characters."""
    text = repr(value)
    first = text.splitlines()[0] if text else text
    return first if len(first) <= 60 and first == text else first[:57].rstrip("( ") + "..."


def kwargs_layer(kwargs: Mapping[str, Any], call_arguments: Collection[str] = ()) -> ConfigLayer:
    """generate()'s keyword arguments (the highest layer); an unknown name is an InputTypeError (a typo), which
    names the argument likely meant, also among ``call_arguments`` (generate()'s own: ``drafter_option=`` meant
    ``drafter_options=``)."""
    unknown = sorted(set(kwargs) - _known_names())
    if unknown:
        raise InputTypeError(unknown_arguments(unknown, _known_names(), call_arguments))
    return _read(KWARGS, kwargs, kwargs=True)


def config_layer(config: Any, source: str = "generation_config=", call_arguments: Collection[str] = ()) -> ConfigLayer:
    """A specdec or transformers GenerationConfig (None: an empty layer); ``call_arguments``: see :func:`_read`."""
    if config is None:
        return ConfigLayer(source)
    if isinstance(config, GenerationConfig):
        return ConfigLayer(source, {n: getattr(config, n) for n in sorted(config.fields_set)
                                    if getattr(config, n) is not None})
    if _is_transformers_config(config):
        items = {k: v for k, v in config.to_dict().items() if not k.startswith("_")}
        return _read(source, items, call_arguments=call_arguments)
    raise InputTypeError(f"generation_config must be a specdec or transformers GenerationConfig, got "
                         f"{describe(config)}")


def model_layer(model: Any) -> ConfigLayer:
    """The loaded model's own ``generation_config`` (generation_config.json), if it has one."""
    return config_layer(getattr(model, "generation_config", None), MODEL_SOURCE)


@dataclass(frozen=True)
class Resolved:
    config: GenerationConfig  # max_length turned into max_new_tokens (when the prompt length was known)
    return_dict: bool
    length_from: str | None  # where max_length came from when it set max_new_tokens (for messages); else None


def resolve(layers: Sequence[ConfigLayer], prompt_length: int | None = None,
            return_dict: bool | None = None) -> Resolved:
    """The layers (lowest precedence first) merged into one checked GenerationConfig. ``prompt_length`` None:
    a check before the model is known (max_length is checked, not yet turned into max_new_tokens).
    ``return_dict``: generate()'s own argument, above every layer; None = return_dict_in_generate, else False."""
    merged: dict[str, Any] = {}
    refused: dict[str, tuple[Any, str]] = {}
    origin: dict[str, ConfigLayer] = {}
    layer_return_dict = None
    for layer in layers:
        for name, value in layer.values.items():
            merged[name], origin[name] = value, layer
        refused.update({name: (value, layer.source) for name, value in layer.refused.items()})
        layer_return_dict = layer.return_dict if layer.return_dict is not None else layer_return_dict
    one_beam = _is_neutral("num_beams", refused.get("num_beams", (None,))[0])
    for name, (value, source) in refused.items():
        if name in BEAM_ONLY and one_beam:
            logger.debug("%s: %s=%r ignored: beam search only, and num_beams is 1", source, name, value)
        elif not _is_neutral(name, value):
            what = REFUSED.get(name, ((), "a transformers setting specdec does not know"))[1]
            neutral = (REFUSED.get(name, ((), ""))[0] or (None,))[0]
            hint = "unset it" if source == KWARGS else f"unset it, or pass {name}={neutral!r} to generate()"
            raise InputError(f"{source} sets {name}={_short(value)}: {what}; specdec refuses it rather than "
                             f"ignore it ({hint})")
    for name, value in list(merged.items()):
        if value is None and name in NONE_KWARG:  # only a keyword argument brings a None
            if NONE_KWARG[name] is UNSET:
                del merged[name]
            else:
                merged[name] = NONE_KWARG[name]
    if merged.get("min_new_tokens") is not None:  # transformers: min_length = min_new_tokens + the prompt's length
        merged.pop("min_length", None)
    if merged.get("do_sample") is True and "top_k" not in merged:
        merged["top_k"] = TRANSFORMERS_TOP_K
    length_from = None
    if prompt_length is not None and "max_length" in merged:
        max_length = merged.pop("max_length")
        if "max_new_tokens" in merged and origin["max_length"].source != MODEL_SOURCE:  # the caller's, overruled
            logger.warning("max_new_tokens=%s (from %s) and max_length=%s (from %s) are both set: max_new_tokens "
                           "takes precedence, as in transformers", merged["max_new_tokens"],
                           origin["max_new_tokens"].source, max_length, origin["max_length"].source)
        if "max_new_tokens" not in merged:
            length_from = origin["max_length"].source
            if max_length <= prompt_length:
                raise InputError(f"max_length={max_length} (from {length_from}) leaves no room for new tokens: the "
                                 f"input is already {prompt_length} tokens long (input_ids.shape[-1]); raise it or "
                                 "pass max_new_tokens")
            merged["max_new_tokens"] = max_length - prompt_length
    return_dict = return_dict if return_dict is not None else bool(layer_return_dict)
    return Resolved(GenerationConfig(**merged), return_dict, length_from)
