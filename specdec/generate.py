"""``specdec.generate``: the Python entry point.

    out = specdec.generate("default", [[1, 2, 3], [4, 5]], max_new_tokens=64, drafter="ngram")

``model`` is anything :func:`specdec.models.loader.load_model` accepts. ``input_ids`` is a
tensor ``[batch, len]`` (optionally with ``attention_mask`` for left/right padding) or a
list of token-id lists of different lengths. Returns prompt + new tokens per sequence, as
transformers does: a tensor padded with ``pad_token_id`` if a tensor came in, else lists.
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
from specdec.kv_cache import CacheConfig, PagedKVCache
from specdec.models.loader import LoadedModel, load_model
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


def _prompts(input_ids: Any, attention_mask: Any, vocab_size: int) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids[None]
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask).reshape(ids.shape).bool()
            prompts = [row[m].tolist() for row, m in zip(ids, mask)]
        else:
            prompts = ids.tolist()
    elif isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(t, int) for t in input_ids):
        prompts = [list(input_ids)]
    elif isinstance(input_ids, (list, tuple)):
        prompts = [list(p) for p in input_ids]
    else:
        raise TypeError("input_ids must be a tensor or a list of token-id lists")
    if not prompts:
        raise ValueError("input_ids holds no prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return prompts


def _eos_ids(eos_token_id: Any, loaded: LoadedModel, vocab_size: int) -> frozenset[int]:
    """EOS ids as transformers takes them: an int, a list of ints, or a 0-D / 1-D integer tensor; each one
    checked against the vocabulary (a set of 0-D tensors never matched an int token: EOS was ignored)."""
    if eos_token_id is None:
        gen_cfg = getattr(loaded.model, "generation_config", None)
        eos_token_id = getattr(gen_cfg, "eos_token_id", None) or getattr(loaded.model.config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    kinds = "integer token ids: an int, a list of ints or a 0-D / 1-D integer tensor"
    if isinstance(eos_token_id, torch.Tensor):
        if eos_token_id.dim() > 1 or eos_token_id.is_floating_point() or eos_token_id.dtype == torch.bool:
            raise TypeError(f"eos_token_id must be {kinds}, got {eos_token_id!r}")
        items = eos_token_id.reshape(-1).tolist()
    elif isinstance(eos_token_id, (str, bytes)) or not isinstance(eos_token_id, Sequence):
        items = [eos_token_id]
    else:
        items = [int(x) if isinstance(x, torch.Tensor) and x.dim() == 0 and not x.is_floating_point() else x
                 for x in eos_token_id]
    for x in items:
        if isinstance(x, bool) or not isinstance(x, int) and not hasattr(x, "__index__"):
            raise TypeError(f"eos_token_id must be {kinds}, got {eos_token_id!r}")
        if not 0 <= int(x) < vocab_size:
            raise ValueError(f"eos_token_id {int(x)} is outside the vocabulary [0, {vocab_size})")
    return frozenset(int(x) for x in items)


def _stop_criteria(stop: Any, max_new_tokens: int, eos: frozenset[int], tokenizer: Any) -> StopCriteria:
    stop = [] if stop is None else ([stop] if isinstance(stop, str) else list(stop))
    strings = tuple(s for s in stop if isinstance(s, str))
    seqs = tuple(tuple(s) for s in stop if not isinstance(s, str))
    return StopCriteria(max_new_tokens, eos, seqs, strings, tokenizer)


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
        raise ValueError("cuda_graphs: this GraphedForward was built for another model")
    if engine_fault is not None or cache_cfg.num_blocks is not None:
        raise ValueError("cuda_graphs=GraphedForward(...) brings its own KV cache: num_blocks and engine_fault "
                         "cannot be combined with it")
    cache = graphed.cache
    if cache.block_size != cache_cfg.block_size:
        raise ValueError(f"block_size={cache_cfg.block_size}, but the GraphedForward's cache uses "
                         f"{cache.block_size}")
    graphed.release_sequences()  # left over only if an earlier call raised mid-generation
    if blocks_needed > cache.num_free_blocks:
        raise ValueError(f"this request may need {blocks_needed} KV blocks of {cache.block_size} tokens; the "
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
    loaded = load_model(model, tokenizer=tokenizer)
    runner = loaded.runner
    shape = runner.shape
    sampling = SamplingConfig(do_sample, temperature, top_k, top_p)
    if seed is not None and generator is not None:
        raise ValueError("pass seed= or generator=, not both: the generator's own state would silently win")
    if generator is not None and generator.device.type != runner.device.type:
        raise ValueError(f"generator is on {generator.device} but the model is on {runner.device}: "
                         "sampling runs on the model's device, so create it with torch.Generator(device=...) there")
    prompts = _prompts(input_ids, attention_mask, shape.vocab_size)
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > shape.max_positions:
        raise ValueError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{shape.max_positions} tokens; shorten the prompt or lower max_new_tokens"
        )
    eos = _eos_ids(eos_token_id, loaded, shape.vocab_size)
    stop_criteria = _stop_criteria(stop, max_new_tokens, eos, loaded.tokenizer)
    if drafter_options and drafter is None:
        raise ValueError("drafter_options were given without a drafter: they would be ignored (pass drafter=...)")
    drafter_obj = get_drafter(drafter, **(drafter_options or {}))
    cache_cfg = CacheConfig(block_size, num_blocks)
    tree_budget = MAX_TREE_NODES if drafter_obj is not None else 0
    # worst case of this request: no sequence can run out
    per_seq = [-(-(len(p) + max_new_tokens + tree_budget + 1) // block_size) for p in prompts]
    engine_cls = Engine
    if engine_fault is not None:
        logger.warning("engine fault %r injected: the output is deliberately WRONG (negative control)",
                       engine_fault.name)
        engine_cls = engine_fault.engine_cls
    if not isinstance(cuda_graphs, (bool, GraphedForward)):
        raise TypeError(f"cuda_graphs must be a bool or a GraphedForward, got {type(cuda_graphs).__name__}")
    if isinstance(cuda_graphs, GraphedForward):  # its own cache and graphs, reused call after call
        graphed = cuda_graphs
        cache = _graphed_cache(graphed, runner, cache_cfg, sum(per_seq), engine_fault)
    else:
        blocks = sum(per_seq) if cache_cfg.num_blocks is None else cache_cfg.num_blocks
        blocks += int(bool(cuda_graphs))  # the graphs' scratch slot holds one block
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
