"""Device work of the GPU path, counted on any CPU through the Triton interpreter: what a step launches.

    python benchmarks/count_launches.py [--model synthetic:smollm2-135m@tiny] [--batch 1] [--eagle 6,1]

Counts for the model with separate and with fused (packed) projections, and for an EAGLE layer of its shape:

* **per decode forward** (one token, batch 1, on the Triton backend): aten ops that are not views, plus Triton
  kernel launches; per layer and for the rest of the forward (embedding, RoPE tables, final norm, ...). Inside a
  CUDA graph each is one kernel the GPU runs in turn;
* **per graphed plain step** (``cuda_graphs=True``, uncaptured here): the launches inside the bucket's forward
  (what a replay runs), and those the host issues one by one each step besides the replay (the inputs' copy, the
  LM head, the greedy choice, ...);
* **per EAGLE drafting call** (``--eagle DEPTH,TOP_K``, a random layer of the model's shape, float32, its
  projections packed as on CUDA): on the reference and the Triton backend, per call (catch-up, growth and rerank)
  and that over the depth; and per pending proposal of the graphed engine (``cuda_graphs=True``, uncaptured here),
  the launches inside the drafting's replayed graph and those the host issues one by one around it.

The CPU's row policy for small products (``specdec.models.row_policy``) is left off, as a GPU runs without it.

Counts, not times (by :class:`specdec.launches.Launches`): on a GPU each launch costs the host a few microseconds
and the GPU at least one kernel's start.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HelpWithDefaults, run_main  # noqa: E402

from specdec.launches import Launches  # noqa: E402
from specdec.models.llama import LlamaRunner  # noqa: E402


def forward_launches(runner, new_tokens: int = 1) -> collections.Counter:
    """One decode forward (batch 1, after an 8-token prefill) of ``runner`` (on the Triton backend): of one token,
    or with ``new_tokens`` > 1 a chain's verify (each token sees those before it)."""
    from specdec.attention import BatchBuilder
    from specdec.kv_cache import PagedKVCache

    s = runner.shape
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, 8, 16, runner.dtype, runner.device, runner.backend)
    cache.add(0)
    cache.reserve(0, 9)
    builder = BatchBuilder(cache, runner.device)
    builder.add(0, list(range(1, 9)), range(8), 8, 0)
    batch = builder.build()
    runner.forward(batch.token_ids, batch.positions, batch.plan, cache, None)
    cache.commit({0: range(8)})
    cache.reserve(0, new_tokens)
    builder = BatchBuilder(cache, runner.device)
    builder.add(0, list(range(5, 5 + new_tokens)), list(range(8, 8 + new_tokens)), 8 + new_tokens, 8)
    batch = builder.build()
    token_ids, positions, rows = batch.token_ids, batch.positions, torch.arange(new_tokens)  # uploaded first
    with Launches() as counter:
        runner.forward(token_ids, positions, batch.plan, cache, rows, with_logits=False)
    return counter.ops


def step_launches(loaded, batch: int, steps: int = 12) -> tuple[Launches, int]:
    """Plain decoding with CUDA graphs (uncaptured): launches inside and outside the replayed forward."""
    from specdec.cuda_graphs import GraphedForward
    from specdec.engine import Engine
    from specdec.generate import generate

    counter = Launches()
    real_run, real_step = GraphedForward._run, Engine.step
    count = [0]

    def run(self, *args):
        counter.inside += 1
        try:
            return real_run(self, *args)
        finally:
            counter.inside -= 1

    def step(self):
        count[0] += 1
        with counter:
            return real_step(self)

    GraphedForward._run, Engine.step = run, step
    try:
        prompts = [[5 + b, 6, 7, 8, 9, 10, 11, 12] for b in range(batch)]
        generate(loaded, prompts, max_new_tokens=steps, cuda_graphs=True)
    finally:
        GraphedForward._run, Engine.step = real_run, real_step
    return counter, count[0]


EAGLE_PROMPT = [(7 * i + 3) % 50 + 1 for i in range(40)]  # the one sequence the EAGLE counts draft for


def _eagle_drafter(loaded, depth: int, width: int, backend: str):
    """(the model on ``backend``, a random EAGLE layer for it (specdec.models.synthetic.eagle_head) drafting a fixed
    tree of ``depth`` levels and top-k ``width`` through its padded growth, as its CUDA graphs replay it)."""
    from specdec.drafters.eagle import EagleDrafter

    from specdec.models import synthetic
    from specdec.models.fused_projections import pack_layers

    target = dataclasses.replace(loaded, runner=LlamaRunner(loaded.model, backend=backend))
    eagle = synthetic.eagle_head(loaded.model.config, device="cpu", dtype=torch.float32)
    pack_layers(eagle.layers)  # as eagle_head lays it out on CUDA: one QKV and one gate/up product
    return target, EagleDrafter(model=eagle, depth=depth, top_k=width, max_nodes=depth * width, adapt_depth=False,
                                cuda_graphs=True)


def eagle_launches(loaded, depth: int, width: int, backend: str, calls: int = 8) -> tuple[collections.Counter, int]:
    """A random EAGLE layer (:func:`_eagle_drafter`) on ``backend``: launches over ``calls`` drafting calls after a
    sequence's first (its catch-up over the prompt), and the calls."""
    from specdec.generate import generate

    target, drafter = _eagle_drafter(loaded, depth, width, backend)
    counter, seen = collections.Counter(), [0]
    propose = drafter.propose

    def counted(seqs):
        seen[0] += 1
        if seen[0] == 1 or seen[0] > calls + 1:  # the first call catches up on the whole prompt
            return propose(seqs)
        with Launches() as launches:
            out = propose(seqs)
        counter.update(launches.ops)
        return out

    drafter.propose = counted
    generate(target, [EAGLE_PROMPT], max_new_tokens=4 * calls, drafter=drafter, speculation="always")
    return counter, min(seen[0] - 1, calls)


def pending_launches(loaded, depth: int, width: int, calls: int = 8) -> tuple[Launches, int]:
    """As :func:`eagle_launches` on the Triton backend, with the target's CUDA graphs on (uncaptured), so the engine
    takes the pending proposals a GPU takes (``propose_pending``): over ``calls`` calls after the first, the launches
    inside the drafting's graph (``EagleGraphs._run``, what a replay runs) and outside it, and the calls."""
    from specdec.drafters.eagle_graphs import EagleGraphs

    from specdec.generate import generate

    target, drafter = _eagle_drafter(loaded, depth, width, "triton")
    counter, seen, live = Launches(), [0], [None]
    propose, real_run = drafter.propose_pending, EagleGraphs._run

    def counted(seqs):
        seen[0] += 1
        if seen[0] == 1 or seen[0] > calls + 1:  # the first call catches up on the whole prompt
            return propose(seqs)
        live[0] = counter
        try:
            with counter:
                return propose(seqs)
        finally:
            live[0] = None

    def run(self, *args):
        if live[0] is None:
            return real_run(self, *args)
        live[0].inside += 1
        try:
            return real_run(self, *args)
        finally:
            live[0].inside -= 1

    drafter.propose_pending = counted
    EagleGraphs._run = run
    # the verify bucket's padded rows skip the attention (their output is whatever the memory held), so the
    # interpreter's numpy may overflow squaring them in the norm: rows no real token reads
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
            generate(target, [EAGLE_PROMPT], max_new_tokens=4 * calls, drafter=drafter, speculation="always",
                     cuda_graphs=True)
    finally:
        EagleGraphs._run = real_run
    return counter, min(seen[0] - 1, calls)


def eagle_tree(text: str) -> tuple[int, int] | None:
    """``--eagle``'s ``DEPTH,TOP_K`` -> two positive ints; '' -> None (no EAGLE rows)."""
    if not text.strip():
        return None
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected DEPTH,TOP_K (two positive integers) or '', got {text!r}")
    depth, top_k = (int(p) for p in parts)
    return depth, top_k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--model", default="synthetic:smollm2-135m@tiny")
    ap.add_argument("--batch", type=int, default=1, help="sequences of the graphed plain steps")
    ap.add_argument("--eagle", default="6,1", type=eagle_tree, metavar="DEPTH,TOP_K",
                    help="EAGLE's drafting calls counted for a tree of this depth and top-k ('' for none)")
    args = ap.parse_args(argv)
    if args.batch < 1:
        ap.error(f"--batch {args.batch}: at least 1")
    os.environ["SPECDEC_ATTENTION"] = "triton"
    # a CPU's row policy sends small products through padded, transposed ones (more launches); a GPU never does
    from specdec import engine_setup
    from specdec.models import row_policy

    row_policy.uninstall()
    engine_setup.ensure_row_policy = lambda runner: None
    from specdec.models.fused_projections import pack_projections
    from specdec.models.loader import load_model

    loaded = load_model(args.model, device="cpu")
    layers = len(loaded.model.model.layers)
    if layers < 2:
        ap.error("the model needs at least 2 layers (a layer's launches are the full forward's less a 1-layer one's)")
    for packed in (False, True):
        model = copy.deepcopy(loaded.model)
        if packed:
            pack_projections(model)
        runner = LlamaRunner(model, backend="triton")
        full, one = forward_launches(runner), forward_launches(runner.truncated(1))
        per_layer = {k: (full[k] - one[k]) / (layers - 1) for k in full if full[k] != one[k]}
        rest = {k: one[k] - per_layer.get(k, 0) for k in one if one[k] - per_layer.get(k, 0)}
        print(f"{'fused' if packed else 'separate'} projections, one decode forward of {layers} layers: "
              f"{sum(full.values())} launches; per layer {sum(per_layer.values()):g} "
              f"{dict(sorted(per_layer.items()))}; "
              f"the rest {sum(rest.values()):g} {dict(sorted(rest.items()))}")
    packed = copy.deepcopy(loaded.model)  # as specdec lays out the models it builds on CUDA
    pack_projections(packed)
    graphed = dataclasses.replace(loaded, model=packed, runner=LlamaRunner(packed, backend="triton"))
    counter, steps = step_launches(graphed, args.batch)
    for where, ops in (("inside the replayed forward", counter.inside_ops), ("outside the replay", counter.ops)):
        print(f"graphed plain step, batch {args.batch}, {where}: {sum(ops.values()) / steps:.1f} launches per step "
              f"over {steps} steps {dict(sorted(ops.items()))}")
    if args.eagle:
        depth, width = args.eagle
        for backend in ("reference", "triton"):
            ops, calls = eagle_launches(loaded, depth, width, backend)
            total = sum(ops.values()) / calls
            top = dict(sorted(((k, round(v / calls, 1)) for k, v in ops.most_common(12))))
            print(f"EAGLE drafting, depth {depth}, top-k {width}, {backend} backend: {total:.1f} launches per call "
                  f"({total / depth:.1f} per level of depth) over {calls} calls; the most: {top}")
        counter, calls = pending_launches(graphed, depth, width)
        for where, ops in (("inside the replayed drafting", counter.inside_ops), ("outside it", counter.ops)):
            print(f"EAGLE pending proposal, graphed, depth {depth}, top-k {width}, {where}: "
                  f"{sum(ops.values()) / calls:.1f} launches per call over {calls} calls "
                  f"{dict(sorted((k, round(v / calls, 1)) for k, v in ops.items()))}")
    return 0


if __name__ == "__main__":
    run_main(main)
