"""Cost of one target forward vs the number of tokens in it (root + tree nodes), CPU.

    python benchmarks/bench_verify_cost.py [--context 600] [--reps 9]

Prints the median time of a verify forward of 1..16 tokens on the embedded model, and its
ratio to the 1-token decode forward measured in the same run, sizes interleaved round by round.
This ratio is what decides how large a draft tree pays off on a given machine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.cost_model import ensure_row_policy
from specdec.engine import Engine
from specdec.kv_cache import PagedKVCache
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.stopping import StopCriteria
from specdec.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sizes", default="1,2,3,4,5,6,8,12,16")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    runner = load_model("default").runner
    ensure_row_policy(runner)  # linear()'s measured CPU row policy, as every engine built by generate() runs
    s = runner.shape
    sizes = [int(x) for x in args.sizes.split(",")]
    # every timed forward commits one token: the context grows by reps + 1 per size (the 1-token base included)
    longest = args.context + (args.reps + 1) * (len(sizes) + 1) + max(sizes)
    cache = PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, longest // 16 + 2, 16, runner.dtype)
    engine = Engine(runner, cache, SamplingConfig(), StopCriteria(10_000))
    seq = engine.add([list(range(100, 100 + args.context))])[0]

    def time_ms(num_tokens: int) -> float:
        tree = DraftTree.chain(list(range(5, 4 + num_tokens)))
        batch = engine.verify_batch([seq], [tree])
        t0 = time.perf_counter()
        engine.verify(batch)
        elapsed = time.perf_counter() - t0
        cache.commit({seq.seq_id: [0]})
        seq.token_ids.append(7)  # the root moved on by one token
        return elapsed * 1000

    # rounds over every size, interleaved (the first a warm-up): a machine that slows down for a few seconds
    # then hits every size alike, where timing each size's repeats in a block moved whole rows. The 1-token base
    # is its own entry, so a "1 tokens" row is a second measurement of it: the run's noise floor
    grid = [1] + sizes
    times: list[list[float]] = [[] for _ in grid]
    for r in range(args.reps + 1):
        for i, n in enumerate(grid):
            ms = time_ms(n)
            if r:
                times[i].append(ms)
    base = statistics.median(times[0])
    print(f"context {args.context}: 1-token forward {base:.1f} ms (median of {args.reps}, sizes interleaved)")
    for n, samples in zip(sizes, times[1:]):
        ms = statistics.median(samples)
        print(f"  {n:3d} tokens: {ms:7.1f} ms  = {ms / base:4.2f}x a decode step")


if __name__ == "__main__":
    main()
