"""``specdec.generate``: the Python entry point, as three steps.

    out = specdec.generate("default", [[1, 2, 3], [4, 5]], max_new_tokens=64, drafter="ngram")

    request = prepare(model, input_ids, drafter="ngram", max_new_tokens=64)  # checked inputs + model + config
    engine = build_engine(request)                                           # specdec.engine_setup
    out = run(engine, request)                                               # the step loop + the output

``model`` is anything :func:`specdec.models.loader.load_model` accepts. ``input_ids`` is a 1-D / 2-D
integer tensor or numpy array ``[batch, len]``, a list of ints (one prompt) or a list of token-id lists of
different lengths; ``attention_mask`` (0 / 1, the shape of ``input_ids``) drops padding, left or right.
What to generate is a :class:`~specdec.generation_config.GenerationConfig` (``generation_config=``),
updated by keyword arguments of the same names (``max_new_tokens``, ``do_sample``, ``temperature``,
``top_k``, ``top_p``, ``seed``, ``eos_token_id``, ``stop``, ``pad_token_id``, ``block_size``,
``num_blocks``, ``audit_drafts``, ``speculation``: "auto" sizes draft trees by the measured cost model
and decodes plainly when drafting does not pay, "always" verifies every proposed tree whole).
Returns prompt + new tokens per sequence, as transformers does: a
tensor padded with ``pad_token_id`` if a tensor came in, else lists; ``return_dict=True`` gives a
:class:`~specdec.output.GenerateOutput` with per-sequence stats. Arguments are checked
(:mod:`specdec.generate_inputs`) before the model is loaded where they can be: a wrong one is a
one-line ``InputError`` / ``InputTypeError``.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from specdec.cuda_graphs import GraphedForward
from specdec.drafters.base import Drafter
from specdec.drafters.registry import get_drafter
from specdec.engine import Engine
from specdec.engine_setup import build_engine
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.generate_inputs import (
    check_bool,
    check_callable,
    check_options,
    check_vocabulary,
    describe,
    parse_eos,
    parse_input_ids,
)
from specdec.generation_config import GenerationConfig
from specdec.models.loader import LoadedModel, load_model
from specdec.output import GenerateOutput, SequenceStats, pack_output
from specdec.stopping import StopCriteria

__all__ = ["GenerateOutput", "GenerateRequest", "SequenceStats", "Streamer", "generate", "prepare", "run"]

Streamer = Callable[[int, list[int]], None]  # (batch index, tokens emitted this step)


@dataclass(frozen=True)
class GenerateRequest:
    """One generate() call, checked: everything the engine and the output need."""

    loaded: LoadedModel
    prompts: list[list[int]]  # token ids, padding removed
    config: GenerationConfig
    stop: StopCriteria  # EOS ids resolved (the model's own when not given), stop strings / sequences
    drafter: Drafter | None
    generator: torch.Generator | None  # on the model's device; None: seeded from config.seed, or global RNG
    cuda_graphs: bool | GraphedForward
    streamer: Streamer | None
    progress: bool
    return_dict: bool
    pad_token_id: int | None  # for a tensor result; None: the result is lists (list input)


def generate(
    model: Any,
    input_ids: Any,
    *,
    drafter: Any = None,
    drafter_options: dict | None = None,
    attention_mask: Any = None,
    generation_config: GenerationConfig | None = None,
    generator: torch.Generator | None = None,
    streamer: Streamer | None = None,
    return_dict: bool = False,
    tokenizer: Any = None,
    progress: bool = False,
    cuda_graphs: bool | GraphedForward = False,
    **config_fields: Any,
):
    """``cuda_graphs=True`` runs verify steps through fixed-shape buckets replayed as CUDA graphs
    (:mod:`specdec.cuda_graphs`; GPU with the Triton backend), captured anew in each call; pass a
    :class:`GraphedForward` (``GraphedForward.with_cache``) instead to keep its KV cache and graphs
    from call to call.

    ``seed`` (or ``generator``) also seeds sampled drafts: the drafter's ``seed_from_generate`` gets
    ``seed`` (or one draw of ``generator``) before it is attached, unless its own ``seed`` option is set,
    so the output does not depend on torch's global RNG."""
    request = prepare(model, input_ids, drafter=drafter, drafter_options=drafter_options,
                      attention_mask=attention_mask, generation_config=generation_config, generator=generator,
                      streamer=streamer, return_dict=return_dict, tokenizer=tokenizer, progress=progress,
                      cuda_graphs=cuda_graphs, **config_fields)
    return run(build_engine(request), request)


def prepare(model: Any, input_ids: Any, *, drafter: Any = None, drafter_options: dict | None = None,
            attention_mask: Any = None, generation_config: GenerationConfig | None = None,
            generator: torch.Generator | None = None, streamer: Streamer | None = None, return_dict: bool = False,
            tokenizer: Any = None, progress: bool = False, cuda_graphs: bool | GraphedForward = False,
            **config_fields: Any) -> GenerateRequest:
    """generate()'s arguments, checked (what needs no model first), the model loaded, the drafter built."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise InputTypeError(f"generation_config must be a specdec GenerationConfig, got {describe(generation_config)}")
    config = (generation_config or GenerationConfig()).update(**config_fields)
    check_callable("streamer", streamer)
    check_bool("return_dict", return_dict)
    check_bool("progress", progress)
    options = check_options("drafter_options", drafter_options)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator or None, got {describe(generator)}")
    if config.seed is not None and generator is not None:
        raise InputError("pass seed= or generator=, not both: the generator's own state would silently win")
    if not isinstance(cuda_graphs, (bool, GraphedForward)):
        raise InputTypeError(f"cuda_graphs must be a bool or a GraphedForward, got {describe(cuda_graphs)}")
    prompts = parse_input_ids(input_ids, attention_mask)
    if options and drafter is None:
        raise InputError("drafter_options were given without a drafter: they would be ignored (pass drafter=...)")
    drafter_obj = _make_drafter(drafter, options)

    loaded = load_model(model, tokenizer=tokenizer)
    runner = loaded.runner
    shape = runner.shape
    if generator is not None and generator.device.type != runner.device.type:
        raise InputError(f"generator is on {generator.device} but the model is on {runner.device}: "
                         "sampling runs on the model's device, so create it with torch.Generator(device=...) there")
    check_vocabulary("input_ids", prompts, shape.vocab_size)
    check_vocabulary("stop", [list(s) for s in config.stop_sequences], shape.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + config.max_new_tokens > shape.max_positions:
        raise InputError(
            f"prompt ({longest} tokens) + max_new_tokens ({config.max_new_tokens}) exceeds the model's context of "
            f"{shape.max_positions} tokens; shorten the prompt or lower max_new_tokens"
        )
    eos_token_id = config.eos_token_id
    gen_cfg = getattr(loaded.model, "generation_config", None)
    if eos_token_id is None:  # the model's own, as transformers does
        eos_token_id = getattr(gen_cfg, "eos_token_id", None) or getattr(loaded.model.config, "eos_token_id", None)
    eos = parse_eos(eos_token_id, shape.vocab_size)
    stop = StopCriteria(config.max_new_tokens, eos, config.stop_sequences, config.stop_strings, loaded.tokenizer)
    pad_token_id = None
    if isinstance(input_ids, torch.Tensor):  # a tensor result, padded as transformers pads it
        pad_token_id = config.pad_token_id
        if pad_token_id is None:
            pad_token_id = getattr(gen_cfg, "pad_token_id", None)
            pad_token_id = pad_token_id if pad_token_id is not None else min(eos, default=0)
    return GenerateRequest(loaded, prompts, config, stop, drafter_obj, generator, cuda_graphs, streamer, progress,
                           return_dict, pad_token_id)


def run(engine: Engine, request: GenerateRequest) -> Any:
    """Prefill, then Engine.step() until every sequence has stopped; stream, show progress, pack."""
    start = time.perf_counter()
    seqs = engine.add(request.prompts)
    prefill_seconds = time.perf_counter() - start
    total = request.config.max_new_tokens * len(seqs)
    with tqdm(total=total, unit="tok", desc="generate", disable=not request.progress) as bar:
        while engine.live:
            emitted = engine.step()
            if request.streamer is not None:
                for seq_id, toks in emitted.items():
                    if toks:
                        request.streamer(seq_id, toks)
            if request.progress:
                done = sum(len(s.new_tokens) for s in seqs)
                bar.update(done - bar.n)
                bar.set_postfix(tau=f"{done / max(sum(s.steps for s in seqs), 1):.2f}")
    return pack_output(engine, seqs, request.pad_token_id, request.return_dict, start, prefill_seconds)


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
