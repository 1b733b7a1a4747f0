"""Cost of one engine verify step vs the number of query tokens: ``c(n)``, timed on this machine.

The cost model (:mod:`specdec.cost_model`) calibrates with :func:`measure_verify_costs`; the acceptance suite
(``specdec.eval.acceptance``) times a plain step (n = 1) and a step as large as each cell's mean draft tree with it,
on a batch like the cell's, and builds its predicted speedup from these costs.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from specdec.cuda_graphs import GraphConfig, GraphedForward
from specdec.drafters.base import Drafter
from specdec.engine import Engine
from specdec.kv_cache import CacheConfig, PagedKVCache, blocks_for
from specdec.models.llama import LlamaRunner
from specdec.sampling import SamplingConfig
from specdec.stopping import StopCriteria
from specdec.tree import DraftTree


def calibration_need(query_tokens: Sequence[int], repeats: int) -> int:
    """The positions a calibration of ``query_tokens`` with ``repeats`` timed rounds needs at least: its rounds and
    a warm-up grow each sequence by n tokens a step at most, plus the step's room and one token of context."""
    return (repeats + 1) * sum(set(query_tokens)) + 3


def repeats_that_fit(max_positions: int, query_tokens: Sequence[int]) -> int:
    """The most timed rounds of ``query_tokens`` that a model of ``max_positions`` holds (0: not one)."""
    return max((max_positions - 3) // sum(set(query_tokens)) - 1, 0)


class _ChainDrafter(Drafter):
    """Calibration drafter: a chain of ``nodes`` nodes per sequence, each the id after the root's (modulo the
    vocabulary): a token the target is not expected to choose there, so the chain is rejected at its first node and
    each step commits one token, as a plain step does (copies of the root, which a random-weight target repeats,
    would be accepted whole: c(n) would price committing n tokens)."""

    name = "calibration-chain"

    def __init__(self, vocab_size: int) -> None:
        self.nodes, self.vocab_size = 0, vocab_size

    def propose(self, seqs):
        return [DraftTree([(s.token_ids[-1] + 1) % self.vocab_size] * self.nodes, list(range(-1, self.nodes - 1)))
                for s in seqs]


def measure_verify_costs(runner: LlamaRunner, prompts: Sequence[Sequence[int]], query_tokens: Sequence[int],
                         sampling: SamplingConfig, extra_context: int = 0, repeats: int = 5,
                         seed: int = 0, graphs: bool = False,
                         progress: Callable[[], object] | None = None) -> dict[int, float]:
    """Median seconds of one engine verify step with ``n`` query tokens per sequence, for each n.

    One batch of ``len(prompts)`` sequences, each extended by ``extra_context`` tokens (its
    own tokens repeated), is prefilled; then ``repeats + 1`` rounds each run one step per n
    (interleaved, so drift of a shared machine hits every n alike) with a chain draft of
    n - 1 nodes, rejected at its first node (:class:`_ChainDrafter`: each step commits one token). The first
    round is a warm-up. The time is the engine's own verify timer: target forward + rejection sampling + KV
    commit. ``graphs``: through fixed-shape buckets replayed as CUDA
    graphs (:mod:`specdec.cuda_graphs`; CUDA with the Triton backend), as ``generate()`` runs on a GPU.
    ``progress``: called after each step (``(repeats + 1) * len(query_tokens)`` calls).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sizes = sorted(set(int(n) for n in query_tokens))
    if not prompts or not sizes or sizes[0] < 1:
        raise ValueError("measure_verify_costs needs prompts and query sizes >= 1")
    shape = runner.shape
    growth = (repeats + 1) * sum(sizes)  # a step commits at most n tokens
    room = shape.max_positions - calibration_need(sizes, repeats) + 1  # the context each sequence keeps
    if room < 1:
        raise ValueError(f"the model's context ({shape.max_positions}) is too short to calibrate {sizes}")
    contexts = []
    for p in prompts:
        want = len(p) + max(extra_context, 0)
        ctx = [p[i % len(p)] for i in range(want)][-room:]
        contexts.append(ctx)
    block = CacheConfig().block_size
    blocks = sum(blocks_for(len(c) + growth + 2, block) for c in contexts) + int(graphs)  # + the graphs' scratch
    cache = PagedKVCache(shape.num_layers, shape.num_kv_heads, shape.head_dim, blocks, block, runner.dtype,
                         runner.device, runner.backend)
    drafter = _ChainDrafter(shape.vocab_size)
    generator = torch.Generator(device=runner.device).manual_seed(seed)  # sampling runs on the model's device
    graphed = GraphedForward(runner, cache, GraphConfig(capture=cache.kv.is_cuda)) if graphs else None
    engine = Engine(runner, cache, sampling=sampling, stop=StopCriteria(10**9), drafter=drafter, generator=generator,
                    graphed=graphed)
    engine.add(contexts)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes:
            drafter.nodes = n - 1
            before = engine.seconds["verify"]
            engine.step()
            if r:
                times[n].append(engine.seconds["verify"] - before)
            if progress is not None:
                progress()
    return {n: statistics.median(ts) for n, ts in times.items()}
