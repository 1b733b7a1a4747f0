"""``specdec.generate``: the Python entry point.

    out = specdec.generate("default", [[1, 2, 3], [4, 5]], max_new_tokens=64, drafter="ngram")

``model`` is anything :func:`specdec.models.loader.load_model` accepts. ``input_ids`` is a 1-D / 2-D
integer tensor or numpy array ``[batch, len]``, a list of ints (one prompt) or a list of token-id lists of
different lengths; ``attention_mask`` (0 / 1, the shape of ``input_ids``) drops padding, left or right.
Returns prompt + new tokens per sequence, as transformers does: a tensor padded with ``pad_token_id``
if a tensor came in, else lists. Arguments are checked (:mod:`specdec.generate_inputs`) before the
model is loaded where they can be: a wrong one is a one-line ``InputError`` / ``InputTypeError``.
``return_dict=True`` gives a :class:`GenerateOutput` with per-sequence stats.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.audit import DraftAudit
from specdec.cuda_graphs import GraphConfig, GraphedForward
from specdec.drafters.registry import get_drafter
from specdec.engine import Engine, SequenceState
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.generate_inputs import (
    check_bool,
    check_cache_fits,
    check_callable,
    check_int,
    check_options,
    check_vocabulary,
    describe,
    parse_eos,
    parse_input_ids,
    parse_stop,
)
from specdec.kv_cache import CacheConfig, PagedKVCache
from specdec.models.loader import load_model
from specdec.rejection import EXACT, AcceptanceRule
from specdec.sampling import SamplingConfig
from specdec.stopping import StopCriteria
from specdec.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

Streamer = Callable[[int, list[int]], None]  # (batch index, tokens emitted this step)


@dataclass(frozen=True)
class EngineFault:
    """Negative controls only (see :mod:`specdec.eval.negative_controls`): deliberately broken
    :class:`Engine` / :class:`PagedKVCache` subclasses that ``generate(engine_fault=...)`` builds
    instead of the real ones, so the certificate can check that it catches them. Its output is
    wrong by design; never pass one to get real output."""

    name: str
    engine_cls: type[Engine] = Engine
    cache_cls: type[PagedKVCache] = PagedKVCache


@dataclass(frozen=True)
class SequenceStats:
    prompt_tokens: int
    new_tokens: int
    steps: int  # target forward passes after prefill
    tau: float  # new tokens per step (mean accepted length + 1)
    seconds: float  # wall time from the start of generate() to this sequence's end
    tokens_per_second: float
    finish_reason: str
    acceptance_per_depth: tuple[float, ...]  # P(node at depth d accepted | parent accepted)
    depth_tried: tuple[int, ...] = ()  # per depth d+1: steps whose node at depth d had its parent accepted
    depth_accepted: tuple[int, ...] = ()  # per depth d+1: steps that accepted a node at depth d+1
    step_lengths: tuple[int, ...] = ()  # tokens committed by each step (accepted length + 1, cut at stops)


@dataclass(frozen=True)
class GenerateOutput:
    sequences: Any  # like transformers: prompt + new tokens (tensor or list of lists)
    new_tokens: list[list[int]]
    stats: list[SequenceStats]
    seconds: float
    prefill_seconds: float
    forward_passes: int
    draft_seconds: float = 0.0  # time in drafter.propose (all steps)
    verify_seconds: float = 0.0  # time in verification, sampling and commit (all steps)

    @property
    def total_new_tokens(self) -> int:
        return sum(len(t) for t in self.new_tokens)

    @property
    def tau(self) -> float:
        steps = sum(s.steps for s in self.stats)
        return sum(s.new_tokens for s in self.stats) / steps if steps else 0.0


def _make_drafter(drafter: Any, options: dict) -> Any:
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


def _stats(s: SequenceState, start: float) -> SequenceStats:
    seconds = (s.finished_at or time.perf_counter()) - start
    acc = tuple(a / t if t else 0.0 for a, t in zip(s.depth_accepted, s.depth_tried))
    n = len(s.new_tokens)
    return SequenceStats(s.num_prompt, n, s.steps, s.tau, seconds, n / seconds if seconds else 0.0,
                         s.finish_reason or "", acc, tuple(s.depth_tried), tuple(s.depth_accepted),
                         tuple(s.step_lengths))


def _graphed_cache(graphed: GraphedForward, runner, cache_cfg: CacheConfig, blocks_needed: int,
                   engine_fault) -> PagedKVCache:
    """The KV cache of a reused :class:`GraphedForward`, emptied of any earlier call's sequences."""
    if graphed.runner.hf_model is not runner.hf_model:
        raise InputError("cuda_graphs: this GraphedForward was built for another model")
    if engine_fault is not None or cache_cfg.num_blocks is not None:
        raise InputError("cuda_graphs=GraphedForward(...) brings its own KV cache: num_blocks and engine_fault "
                         "cannot be combined with it")
    cache = graphed.cache
    if cache.block_size != cache_cfg.block_size:
        raise InputError(f"block_size={cache_cfg.block_size}, but the GraphedForward's cache uses "
                         f"{cache.block_size}")
    graphed.release_sequences()  # left over only if an earlier call raised mid-generation
    if blocks_needed > cache.num_free_blocks:
        raise InputError(f"this request may need {blocks_needed} KV blocks of {cache.block_size} tokens; the "
                         f"GraphedForward's cache has {cache.num_free_blocks}: build it with a larger max_tokens")
    return cache


def generate(
    model: Any,
    input_ids: Any,
    *,
    drafter: Any = None,
    drafter_options: dict | None = None,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: Any = None,
    eos_token_id: int | Sequence[int] | None = None,
    stop: Any = None,
    pad_token_id: int | None = None,
    streamer: Streamer | None = None,
    return_dict: bool = False,
    block_size: int = 16,
    num_blocks: int | None = None,
    tokenizer: Any = None,
    progress: bool = False,
    audit_drafts: bool = True,
    acceptance_rule: AcceptanceRule = EXACT,
    engine_fault: EngineFault | None = None,
    cuda_graphs: bool | GraphedForward = False,
):
    """``acceptance_rule`` and ``engine_fault`` exist for the certificate's negative controls
    (:mod:`specdec.eval.negative_controls`); leave them at their defaults for real output.
    ``cuda_graphs=True`` runs verify steps through fixed-shape buckets replayed as CUDA graphs
    (:mod:`specdec.cuda_graphs`; GPU with the Triton backend; not yet measured on a GPU), captured
    anew in each call; pass a :class:`GraphedForward` (``GraphedForward.with_cache``) instead to
    keep its KV cache and graphs from call to call.

    ``seed`` (or ``generator``) also seeds sampled drafts: a drafter with a
    ``seed_from_generate(seed)`` method (the model drafters) gets ``seed`` (or one draw of
    ``generator``) before it is attached, unless its own ``seed`` option is set, so the output
    does not depend on torch's global RNG."""
    # everything that needs no model first: a wrong argument must not wait for a model load
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, minimum=1)
    block_size = check_int("block_size", block_size, minimum=1)
    num_blocks = check_int("num_blocks", num_blocks, minimum=1, optional=True)
    seed = check_int("seed", seed, minimum=-(2**63), maximum=2**64 - 1, optional=True)
    pad_token_id = check_int("pad_token_id", pad_token_id, minimum=-(2**63), maximum=2**63 - 1, optional=True)
    check_callable("streamer", streamer)
    for name, flag in (("return_dict", return_dict), ("progress", progress), ("audit_drafts", audit_drafts)):
        check_bool(name, flag)
    if not isinstance(acceptance_rule, AcceptanceRule):
        raise InputTypeError(f"acceptance_rule must be an AcceptanceRule, got {describe(acceptance_rule)}")
    if engine_fault is not None and not isinstance(engine_fault, EngineFault):
        raise InputTypeError(f"engine_fault must be an EngineFault or None, got {describe(engine_fault)}")
    options = check_options("drafter_options", drafter_options)
    sampling = SamplingConfig(check_bool("do_sample", do_sample), temperature, top_k, top_p)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise InputTypeError(f"generator must be a torch.Generator or None, got {describe(generator)}")
    if seed is not None and generator is not None:
        raise InputError("pass seed= or generator=, not both: the generator's own state would silently win")
    if not isinstance(cuda_graphs, (bool, GraphedForward)):
        raise InputTypeError(f"cuda_graphs must be a bool or a GraphedForward, got {describe(cuda_graphs)}")
    prompts = parse_input_ids(input_ids, attention_mask)
    stop_strings, stop_sequences = parse_stop(stop)
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
    check_vocabulary("stop", [list(s) for s in stop_sequences], shape.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > shape.max_positions:
        raise InputError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{shape.max_positions} tokens; shorten the prompt or lower max_new_tokens"
        )
    if eos_token_id is None:  # the model's own, as transformers does
        gen_cfg = getattr(loaded.model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None) or getattr(loaded.model.config, "eos_token_id", None)
    eos = parse_eos(eos_token_id, shape.vocab_size)
    stop_criteria = StopCriteria(max_new_tokens, eos, stop_sequences, stop_strings, loaded.tokenizer)
    cache_cfg = CacheConfig(block_size, num_blocks)
    tree_budget = MAX_TREE_NODES if drafter_obj is not None else 0
    # worst case of this request: no sequence can run out
    per_seq = [-(-(len(p) + max_new_tokens + tree_budget + 1) // block_size) for p in prompts]
    engine_cls = Engine
    if engine_fault is not None:
        logger.warning("engine fault %r injected: the output is deliberately WRONG (negative control)",
                       engine_fault.name)
        engine_cls = engine_fault.engine_cls
    if isinstance(cuda_graphs, GraphedForward):  # its own cache and graphs, reused call after call
        graphed = cuda_graphs
        cache = _graphed_cache(graphed, runner, cache_cfg, sum(per_seq), engine_fault)
    else:
        blocks = sum(per_seq) if cache_cfg.num_blocks is None else cache_cfg.num_blocks
        blocks += int(bool(cuda_graphs))  # the graphs' scratch slot holds one block
        check_cache_fits(shape, blocks, block_size, runner.dtype, runner.device, explicit=num_blocks is not None)
        cache_cls = PagedKVCache if engine_fault is None else engine_fault.cache_cls
        cache = cache_cls(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, blocks, block_size, runner.dtype, runner.device,
            runner.backend,  # one backend per engine: the runner's, chosen when it was built
        )
        graphed = GraphedForward(runner, cache, GraphConfig(capture=cache.kv.is_cuda)) if cuda_graphs else None
    if callable(getattr(drafter_obj, "seed_from_generate", None)):  # before Engine() attaches it
        drafter_seed = seed
        if generator is not None and sampling.do_sample:
            drafter_seed = int(torch.randint(2**62, (), generator=generator, device=generator.device))
        drafter_obj.seed_from_generate(drafter_seed)
    if generator is None and seed is not None:
        generator = torch.Generator(device=runner.device).manual_seed(seed)  # sampling runs on the logits' device
    audit = DraftAudit() if audit_drafts and drafter_obj is not None and sampling.do_sample else None
    if acceptance_rule.lossy or acceptance_rule is not EXACT:
        logger.warning("acceptance rule %r is not the exact one: the output is NOT the target's distribution",
                       acceptance_rule.name)
    engine = engine_cls(runner, cache, sampling, stop_criteria, drafter_obj, generator, audit, acceptance_rule,
                        graphed)

    start = time.perf_counter()
    seqs = engine.add(prompts)
    prefill_seconds = time.perf_counter() - start
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_new_tokens * len(prompts), unit="tok", desc="generate")
    while engine.live:
        emitted = engine.step()
        if streamer is not None:
            for seq_id, toks in emitted.items():
                if toks:
                    streamer(seq_id, toks)
        if bar is not None:
            done = sum(len(s.new_tokens) for s in seqs)
            bar.update(done - bar.n)
            steps = sum(s.steps for s in seqs)
            bar.set_postfix(tau=f"{done / max(steps, 1):.2f}")
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start

    new_tokens = [s.new_tokens for s in seqs]
    full = [s.tokens for s in seqs]
    if isinstance(input_ids, torch.Tensor):
        if pad_token_id is None:
            pad_token_id = getattr(loaded.model.generation_config, "pad_token_id", None)
            pad_token_id = pad_token_id if pad_token_id is not None else min(stop_criteria.eos_token_ids, default=0)
        width = max(len(t) for t in full)
        sequences = torch.full((len(full), width), pad_token_id, dtype=torch.long)
        for i, t in enumerate(full):
            sequences[i, : len(t)] = torch.tensor(t)
    else:
        sequences = full
    if not return_dict:
        return sequences
    stats = [_stats(s, start) for s in seqs]
    return GenerateOutput(sequences, new_tokens, stats, seconds, prefill_seconds, engine.forward_passes,
                          engine.seconds["draft"], engine.seconds["verify"])
