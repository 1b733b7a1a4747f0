"""``specdec.generate``: the Python entry point, as three steps in one call frame (:func:`generate_with`).

    out = specdec.generate("default", [[1, 2, 3], [4, 5]], max_new_tokens=64, drafter="ngram")

    request = prepare(model, input_ids, drafter="ngram", max_new_tokens=64)  # checked inputs + model + config
    engine = build_engine(request)                                           # specdec.engine_setup
    out = run(engine, request)                                               # the step loop + the output

Called as transformers' ``model.generate()`` is called, and returns what it returns:

    enc = tokenizer(texts, padding=True, return_tensors="pt")      # padding_side="left" or "right"
    out = specdec.generate(model, **enc, max_new_tokens=64)        # or specdec.generate(model, enc, ...)
    new = out[:, enc["input_ids"].shape[1]:]                       # exactly the new tokens

``model`` is anything :func:`specdec.models.loader.load_model` accepts. ``input_ids`` is a tensor / numpy array,
a list of ints, ragged lists of ints, or a mapping holding them with its ``attention_mask`` (padding dropped,
left or right, for every form; tokenizer keys in :data:`~specdec.generate_inputs.IGNORED_INPUT_KEYS` ignored).
Settings come from keyword arguments > ``generation_config=`` > the model's generation_config > defaults
(:mod:`specdec.transformers_config`); unsupported transformers fields are refused by name. The output is each
input row as given followed by its new tokens (:class:`~specdec.output.OutputLayout`), or with
``return_dict=True`` a :class:`~specdec.output.GenerateOutput` with per-sequence stats. Arguments are checked
(:mod:`specdec.generate_inputs`) before the model is loaded where they can be: a wrong one is a one-line
``InputError`` / ``InputTypeError``.

Streamers: ``streamer=fn`` gets ``fn(batch_index, tokens)`` as tokens are committed; an object with ``put()`` /
``end()`` is driven as transformers drives it (the prompt row, then each token as a ``[1]`` tensor, then
``end()``, also on failure), for one sequence. Every field and option: docs/python-api.md.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from tqdm.auto import tqdm

from specdec.ambient import neutral_torch_state
from specdec.call_claims import drafter_claimed
from specdec.cuda_graphs import AUTO, GraphedForward
from specdec.drafters.base import Drafter
from specdec.drafters.registry import get_drafter
from specdec.engine import Engine
from specdec.engine_setup import build_engine
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.generate_inputs import (
    IGNORED_INPUT_KEYS,
    check_bool,
    check_options,
    check_vocabulary,
    describe,
    is_put_end_streamer,
    parse_eos_ids,
    parse_input_ids,
    unpack_encoding,
)
from specdec.generation_config import GenerationConfig
from specdec.kv_cache import CacheFullError
from specdec.models.loader import LoadedModel, load_model
from specdec.models.runnable import check_weights_present
from specdec.output import GenerateOutput, OutputLayout, SequenceStats, pack_output
from specdec.sampling import WARPERS, InvalidLogitsError
from specdec.stopping import StopCriteria
from specdec.transformers_config import config_layer, kwargs_layer, model_layer, resolve

logger = logging.getLogger(__name__)
__all__ = ["GenerateOutput", "GenerateRequest", "SequenceStats", "Streamer", "TokenStreamer", "generate", "prepare",
           "run"]


@runtime_checkable
class TokenStreamer(Protocol):
    """transformers' streamer protocol (``transformers.TextStreamer``, ``TextIteratorStreamer``)."""

    def put(self, value: torch.Tensor) -> None: ...

    def end(self) -> None: ...


Streamer = Callable[[int, list[int]], None] | TokenStreamer  # callable: (batch index, tokens emitted this step)


@dataclass(frozen=True)
class GenerateRequest:
    """One generate() call, checked: everything the engine and the output need."""

    loaded: LoadedModel
    prompts: list[list[int]]  # token ids, padding removed; each repeated num_return_sequences times
    config: GenerationConfig  # resolved: every layer merged, max_length turned into max_new_tokens
    stop: StopCriteria  # EOS ids resolved (the model's own when not given), stop strings / sequences
    drafter: Drafter | None
    generator: torch.Generator | None  # on the model's device; None: seeded from config.seed, or global RNG
    cuda_graphs: bool | str | GraphedForward  # True, False, "auto" or a GraphedForward
    streamer: Streamer | None
    progress: bool
    return_dict: bool
    layout: OutputLayout  # the result: each input row as given + its new tokens, tensor or lists
    # input_ids.shape[-1] (the longest row of lists): what max_length, min_length and transformers' other
    # length-dependent processors count (specdec.logits_processing)
    prompt_width: int


def generate(
    model: Any,
    input_ids: Any = None,
    *,
    drafter: Any = None,
    drafter_options: dict | None = None,
    attention_mask: Any = None,
    generation_config: Any = None,
    generator: torch.Generator | None = None,
    streamer: Streamer | None = None,
    return_dict: bool | None = None,
    tokenizer: Any = None,
    progress: bool = False,
    cuda_graphs: bool | str | GraphedForward = AUTO,
    **config_fields: Any,
):
    """Generate up to ``max_new_tokens`` new tokens for each row of ``input_ids`` with ``model``, speculatively when a
    ``drafter`` is given, losslessly: whatever the drafter proposes, greedy output is plain greedy decoding's tokens
    and sampled output has plain sampling's distribution, up to the last bits of the target's logits (a near-tie may
    part in bf16; ``invariant=True`` makes them bitwise plain decoding's, docs/bit-exact.md).
    Returns each input row as given followed by its new tokens (a tensor for a tensor, lists for lists), or with
    ``return_dict=True`` a :class:`~specdec.output.GenerateOutput` with per-sequence stats. Settings: keyword
    arguments > ``generation_config=`` > the model's generation_config > :class:`GenerationConfig`'s defaults. A
    wrong argument is a one-line :class:`~specdec.errors.InputError` / ``InputTypeError``; a model that is not there
    a :class:`~specdec.errors.ModelNotFoundError`.

    ``cuda_graphs="auto"`` (the default) runs verify steps through fixed-shape buckets replayed as CUDA
    graphs on a CUDA device with the Triton backend, through one graph cache per loaded model that later calls
    reuse (:func:`specdec.cuda_graphs.model_graphs`), and eagerly elsewhere; ``True`` captures them anew in this
    call (also in the Triton interpreter on CPU, uncaptured), ``False`` never; pass a :class:`GraphedForward`
    (``GraphedForward.with_cache``) to keep a KV cache and graphs of your own from call to call.

    ``seed`` (or ``generator``) also seeds sampled drafts: the drafter reads ``seed`` (or one draw of
    ``generator``) as ``TargetView.seed`` in ``attach``, unless its own ``seed`` option is set, so the output
    does not depend on torch's global RNG.

    ``inputs=`` (transformers' name) is taken for ``input_ids``.

    ``return_dict``: None = ``return_dict_in_generate`` if a layer sets it, else False. Ignored inputs
    (``token_type_ids`` and the other :data:`~specdec.generate_inputs.IGNORED_INPUT_KEYS`) may come as keyword
    arguments, as ``**tokenizer(...)`` passes them.

    The caller's autocast and default device are set aside for the call (:mod:`specdec.ambient`)."""
    return generate_with(build_engine, model, input_ids, drafter=drafter, drafter_options=drafter_options,
                         attention_mask=attention_mask, generation_config=generation_config, generator=generator,
                         streamer=streamer, return_dict=return_dict, tokenizer=tokenizer, progress=progress,
                         cuda_graphs=cuda_graphs, **config_fields)


def generate_with(build: Callable[[GenerateRequest], Engine], model: Any, input_ids: Any = None,
                  **arguments: Any) -> Any:
    """generate(model, input_ids, **arguments) with its engine built by ``build`` (generate()'s is
    :func:`~specdec.engine_setup.build_engine`; the certificate's negative controls build a broken one): the one call
    frame of both. The caller's torch state set aside (:mod:`specdec.ambient`), the model's GPU current
    (:func:`on_device`), the drafter held by this call alone (:mod:`specdec.call_claims`); a put() / end() streamer
    is ended also when the call is refused before it streams."""
    streamer = arguments.get("streamer")
    put_end = is_put_end_streamer(streamer)  # a streamer of no known kind: its one-line error, before anything
    with neutral_torch_state():
        with _ended_if_refused(streamer, put_end):
            request = prepare(model, input_ids, **arguments)
        with on_device(request.loaded.runner.device), contextlib.ExitStack() as held:
            with _ended_if_refused(streamer, put_end):
                held.enter_context(drafter_claimed(request.drafter))  # one call at a time per drafter object
                engine = build(request)
            return run(engine, request)  # which ends the streamer itself, also on failure


@contextlib.contextmanager
def _ended_if_refused(streamer: Any, put_end: bool) -> Iterator[None]:
    """A call refused before it streamed still ends a put() / end() streamer (``put_end``): a thread iterating a
    TextIteratorStreamer would wait for ever."""
    try:
        yield
    except BaseException:
        if put_end:
            streamer.end()
        raise


def on_device(device: torch.device):
    """The model's GPU as the current one while it generates (elsewhere nothing): Triton launches its kernels, and
    torch its streams, events and graph captures, on the current device, so a model on ``cuda:1`` would get kernels
    on ``cuda:0``."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def prepare(model: Any, input_ids: Any = None, *, drafter: Any = None, drafter_options: dict | None = None,
            attention_mask: Any = None, generation_config: Any = None, generator: torch.Generator | None = None,
            streamer: Streamer | None = None, return_dict: bool | None = None, tokenizer: Any = None,
            progress: bool = False, cuda_graphs: bool | str | GraphedForward = AUTO,
            **config_fields: Any) -> GenerateRequest:
    """generate()'s arguments, checked (what needs no model first), the model loaded, the drafter built."""
    config_fields = {k: v for k, v in config_fields.items() if k not in IGNORED_INPUT_KEYS}
    input_ids = _input_ids(input_ids, config_fields.pop("inputs", None))
    layers = [config_layer(generation_config, call_arguments=CALL_ARGUMENTS),  # lowest precedence first
              kwargs_layer(config_fields, CALL_ARGUMENTS)]
    if return_dict is not None:
        check_bool("return_dict", return_dict)
    early = resolve(layers, return_dict=return_dict).config  # what was passed, checked before the model loads
    put_end = is_put_end_streamer(streamer)
    check_bool("progress", progress)
    options = check_options("drafter_options", drafter_options)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator or None, got {describe(generator)}")
    if early.seed is not None and generator is not None:
        raise InputError("pass seed= or generator=, not both: the generator's own state would silently win")
    if not (isinstance(cuda_graphs, (bool, GraphedForward)) or cuda_graphs == AUTO):
        raise InputTypeError(f"cuda_graphs must be a bool, \"auto\" or a GraphedForward, got {describe(cuda_graphs)}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):  # read by stop strings
        raise InputTypeError(f"tokenizer must be a tokenizer (with decode()) or None, got {describe(tokenizer)}")
    inputs = parse_input_ids(*unpack_encoding(input_ids, attention_mask))
    if options and drafter is None:
        raise InputError("drafter_options were given without a drafter: they would be ignored (pass drafter=...)")
    _check_streamer_batch(put_end, len(inputs.rows) * early.num_return_sequences)
    drafter_obj = _make_drafter(drafter, options)

    loaded = load_model(model, tokenizer=tokenizer)
    runner = loaded.runner
    shape = runner.shape
    resolved = resolve([model_layer(loaded.model), *layers], prompt_length=inputs.length, return_dict=return_dict)
    config = resolved.config
    _warn_unused_sampling(config, early)
    _warn_unused_speculation(drafter_obj, early)
    _warn_ignored_scores(early, resolved.return_dict)
    _warn_unreachable_minimum(config, inputs.length)
    if config.num_return_sequences > 1 and not config.do_sample:
        raise InputError(f"num_return_sequences={config.num_return_sequences} needs do_sample=True: greedy decoding "
                         "gives identical copies, and transformers refuses it too")
    _check_streamer_batch(put_end, len(inputs.rows) * config.num_return_sequences)
    if generator is not None and generator.device.type != runner.device.type:
        raise InputError(f"generator is on {generator.device} but the model is on {runner.device}: "
                         "sampling runs on the model's device, so create it with torch.Generator(device=...) there")
    check_weights_present(loaded.model)  # not on the meta device, not offloaded, on one device
    eos_token_id = config.eos_token_id  # kwargs > generation_config= > the model's generation_config
    if eos_token_id is None and getattr(loaded.model, "generation_config", None) is None:
        # transformers reads EOS from the generation config only; a model without one has its config's
        eos_token_id = getattr(loaded.model.config, "eos_token_id", None)
    eos = parse_eos_ids(eos_token_id, shape.vocab_size)
    pad_token_id = _pad_token_id(config.pad_token_id, early.pad_token_id is not None, shape.vocab_size)
    inputs = inputs.infer_mask(pad_token_id, eos)  # a padded tensor without attention_mask, as transformers
    check_vocabulary("input_ids", inputs.prompts, shape.vocab_size)
    lengths = [len(p) for p in inputs.prompts]
    longest = max(lengths)
    # in a batch, the longest prompt by its row of input_ids (as the errors above name prompts) and how many don't fit
    too_long = sum(n + config.max_new_tokens > shape.max_positions for n in lengths)
    name, detail = ("prompt", "") if len(lengths) == 1 else (f"prompt {lengths.index(longest)}", ", the longest" + (
        f"; {too_long} of the {len(lengths)} prompts do not fit" if too_long > 1 else ""))
    # only now: the errors above name a prompt by its row of input_ids, not by its row among the copies
    inputs = inputs.repeat(config.num_return_sequences)
    check_vocabulary("stop", [list(s) for s in config.stop_sequences], shape.vocab_size)
    if resolved.length_from:  # max_length set the count: that is what the caller lowers
        how, lower = f", set by max_length from {resolved.length_from}", "max_length (or pass max_new_tokens)"
    else:
        how, lower = "" if "max_new_tokens" in config.fields_set else ", specdec's default: none was set", \
            "max_new_tokens"
    shape.check_fits(longest, config.max_new_tokens, how, lower, name, detail)  # names the sliding window too
    stop = StopCriteria(config.max_new_tokens, frozenset(eos), config.stop_sequences, config.stop_strings,
                        loaded.tokenizer)
    pad_token_id = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)  # as transformers
    layout = OutputLayout(tuple(tuple(r) for r in inputs.rows), inputs.tensor_device is not None, pad_token_id,
                          inputs.tensor_device)
    return GenerateRequest(loaded, inputs.prompts, config, stop, drafter_obj, generator, cuda_graphs, streamer,
                           progress, resolved.return_dict, layout, inputs.length)


# generate()'s own keyword arguments (drafter=, return_dict=, ...): a misspelt one is named among them too
CALL_ARGUMENTS = tuple(p.name for p in inspect.signature(prepare).parameters.values() if p.kind is p.KEYWORD_ONLY)
# sampling options and their neutral values: given with greedy decoding they change nothing (transformers warns too)
_SAMPLING_ONLY = {"temperature": 1.0, **WARPERS, "sampler": "standard"}


def _warn_unused_sampling(config: GenerationConfig, given: GenerationConfig) -> None:
    """Warn when the caller (keyword arguments or generation_config=) set sampling options that greedy decoding
    ignores; the model's own generation_config is not the caller's doing."""
    if config.do_sample:
        return
    unused = _set_off_neutral(given, _SAMPLING_ONLY)
    if unused:
        logger.warning("do_sample is False (greedy decoding), so these sampling options are ignored: %s; pass "
                       "do_sample=True to sample", ", ".join(unused))


# speculation options and their neutral values: given without a drafter they change nothing
_SPECULATION_ONLY = {"speculation": "auto", "audit_drafts": True}


def _warn_unused_speculation(drafter: Drafter | None, given: GenerationConfig) -> None:
    """Warn when the caller set speculation options and no drafter (drafter_options without one are refused)."""
    unused = _set_off_neutral(given, _SPECULATION_ONLY)
    if drafter is None and unused:
        logger.warning("no drafter, so these speculation options are ignored: %s; pass drafter=... to "
                       "speculate", ", ".join(unused))


def _warn_ignored_scores(given: GenerationConfig, return_dict: bool) -> None:
    """Warn, as transformers does, when the caller set output_scores=True without return_dict: nothing comes back
    for it (output_logprobs=True without return_dict is refused, :func:`specdec.engine_setup._wants_logprobs`)."""
    if given.output_scores and not return_dict:
        logger.warning("output_scores=True is ignored without return_dict=True (or return_dict_in_generate=True), "
                       "as in transformers: the log-probabilities come back in GenerateOutput.logprobs")


def _set_off_neutral(given: GenerationConfig, neutrals: dict[str, Any]) -> list[str]:
    """``name=value`` of each field of ``neutrals`` the caller set to a value other than its neutral one."""
    return [f"{name}={getattr(given, name)!r}" for name, neutral in neutrals.items()
            if name in given.fields_set and getattr(given, name) != neutral]


def _warn_unreachable_minimum(config: GenerationConfig, prompt_width: int) -> None:
    """Warn, as transformers does, when min_new_tokens / min_length ask for more tokens than max_new_tokens allows:
    EOS stays masked to the end, so every sequence runs to max_new_tokens (or to a stop string or sequence)."""
    if config.min_new_tokens > config.max_new_tokens:
        asked = f"min_new_tokens={config.min_new_tokens}"
    elif config.min_length > prompt_width + config.max_new_tokens:
        asked = f"min_length={config.min_length} (the prompt's {prompt_width} tokens included)"
    else:
        return
    stops = " unless a stop string or stop sequence ends it" if config.stop_strings or config.stop_sequences else ""
    logger.warning("%s is more than max_new_tokens=%d allows, so EOS is never allowed: every sequence runs to "
                   "max_new_tokens%s", asked, config.max_new_tokens, stops)


def _input_ids(input_ids: Any, inputs: Any) -> Any:
    """``input_ids``, or transformers' ``inputs=`` for it: one of them, not both."""
    if input_ids is not None and inputs is not None:
        raise InputError("pass input_ids or inputs= (transformers' name for it), not both")
    if input_ids is None and inputs is None:
        raise InputTypeError(f"input_ids must be token ids or a tokenizer's encoding (transformers' inputs= is read "
                             f"as input_ids), got {describe(input_ids)}")
    return input_ids if input_ids is not None else inputs


def _pad_token_id(pad_token_id: int | None, from_caller: bool, vocab_size: int) -> int | None:
    """The pad id if it is a token of the vocabulary; a caller's id outside it is an InputError (as EOS ids are),
    the model's own is replaced by the default with a warning (an old config's -1 must not stop generation)."""
    if pad_token_id is None or 0 <= pad_token_id < vocab_size:
        return pad_token_id
    if from_caller:
        raise InputError(f"pad_token_id {pad_token_id} is outside the vocabulary [0, {vocab_size})")
    logger.warning("the model's pad_token_id %d is outside the vocabulary [0, %d): padding with the first EOS id "
                   "(else 0) instead", pad_token_id, vocab_size)
    return None


def _check_streamer_batch(put_end: bool, sequences: int) -> None:
    if put_end and sequences > 1:
        raise InputError(f"a streamer with put() / end() (transformers' protocol) streams one sequence in specdec "
                         f"(transformers' TextStreamer takes one too), but this call generates {sequences} (batch x "
                         "num_return_sequences); pass a callable streamer(batch_index, tokens) instead")


def run(engine: Engine, request: GenerateRequest) -> Any:
    """Prefill, then Engine.step() until every sequence has stopped; stream, show progress, pack. A CacheFullError
    after the prefill carries the tokens generated until then (its new_tokens)."""
    start = time.perf_counter()
    streamer = request.streamer
    put_end = is_put_end_streamer(streamer)
    seqs, ended = [], False
    try:
        if put_end:  # the prompt first, as transformers does (TextStreamer(skip_prompt=True) drops it)
            streamer.put(torch.tensor([request.layout.rows[0]], dtype=torch.long))
        seqs = engine.add(request.prompts)
        if engine.runner.device.type == "cuda":  # the prefill is queued: its time, not the first step's, once it ran
            torch.cuda.synchronize(engine.runner.device)
        prefill_seconds = time.perf_counter() - start
        total = request.config.max_new_tokens * len(seqs)
        with tqdm(total=total, unit="tok", desc="generate", disable=not request.progress) as bar:
            while engine.live:
                emitted = engine.step()
                for seq_id, toks in emitted.items():
                    if not toks or streamer is None:
                        continue
                    if put_end:  # one token per put(), as transformers' plain decoding sends them
                        for tok in toks:
                            streamer.put(torch.tensor([tok], dtype=torch.long))
                    else:
                        streamer(seq_id, toks)
                if request.progress:  # redrawn at tqdm's pace (mininterval), not each step (a line a step in a file)
                    done = sum(s.num_new_tokens for s in seqs)
                    bar.set_postfix(tau=f"{done / max(sum(s.steps for s in seqs), 1):.2f}", refresh=False)
                    bar.update(done - bar.n)
        engine.finish()
        ended = True
    except (CacheFullError, InvalidLogitsError) as err:  # the other rows' work is kept
        if not seqs:  # the prefill's: nothing was generated
            raise
        new_tokens = [s.new_tokens for s in seqs]
        raise type(err)(f"{err} The {sum(map(len, new_tokens))} tokens generated so far are in this error's "
                        "new_tokens.", new_tokens) from err
    finally:
        try:
            engine.close(failed=not ended)
        finally:  # a reader iterating the streamer waits for end() whatever close() met
            if put_end:
                streamer.end()
    return pack_output(engine, seqs, request.layout, request.return_dict, start, prefill_seconds)


def _make_drafter(drafter: Any, options: dict) -> Drafter | None:
    """get_drafter, its builtin errors (unknown name, wrong type, options a drafter does not take or refuses)
    turned into one-line InputError / InputTypeError: they are all about the caller's arguments."""
    try:
        return get_drafter(drafter, **options)
    except SpecdecError:
        raise
    except (TypeError, ValueError) as err:
        message = " ".join(str(err).split())
        if isinstance(err, TypeError) and options and isinstance(drafter, str):
            message = f"drafter {drafter!r} does not accept drafter_options {sorted(options)}: {message}"
        raise (InputTypeError if isinstance(err, TypeError) else InputError)(message) from err
