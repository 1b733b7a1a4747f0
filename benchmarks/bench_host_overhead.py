"""Host-side work of the engine per sequence and step: what a step costs beyond the target's forward.

    python benchmarks/bench_host_overhead.py [--sequences 3000] [--tokens 3] [--repeats 3] [--prompt-tokens 8]

A tiny model (vocabulary 4, two layers, one thread) whose forward is almost free, a batch of many short
sampled sequences (the shape of the sampling-law tests), and each step split into the engine's phases:
prefill (``add``), drafting, building the verify batch, the target forward, acceptance, commit. Prints the
seconds per phase, the microseconds per sequence-step, and the share of the step outside the forward, for
plain decoding, the n-gram drafter and random trees (``specdec.testing.RandomTreeDrafter``). On a real model
the forward dominates; these are the per-sequence costs that sit before every step of a large batch, on a GPU
as on a CPU. Best of ``--repeats`` runs per row (a noisy machine only ever adds time).
"""
from __future__ import annotations

import argparse
import functools
import time

import torch
from specdec.eval.negative_controls import generate_with_control

from specdec.engine import Engine
from specdec.rejection import EXACT
from specdec.testing import RandomTreeDrafter, build_tiny_model

PHASES = ("add", "propose", "verify_batch", "verify", "accept", "commit")


def timed_engine(seconds: dict[str, float]) -> None:
    """Wrap the engine's phases so that each call adds its wall time to ``seconds`` (this process only)."""
    for name in PHASES:
        method = getattr(Engine, name)

        @functools.wraps(method)
        def wrapper(*args, _method=method, _name=name, **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                seconds[_name] += time.perf_counter() - t0

        setattr(Engine, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=3, help="new tokens per sequence (sampled, temperature 0.9)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=8,
                    help="prompt length: per-step work that grows with the context shows at a few hundred")
    args = ap.parse_args()
    torch.set_num_threads(1)
    seconds = dict.fromkeys(PHASES, 0.0)
    timed_engine(seconds)
    model = build_tiny_model(vocab_size=4, seed=3)
    prompts = [[1 + k % 3 for k in range(args.prompt_tokens)]] * args.sequences
    drafters = {"plain": lambda: None, "ngram": lambda: "ngram",
                "random trees": lambda: RandomTreeDrafter(4, max_nodes=10, mode="independent", seed=5)}
    print(f"{args.sequences} sequences x {args.tokens} sampled tokens after {args.prompt_tokens}-token prompts, tiny "
          f"model, 1 thread, best of {args.repeats}")
    print(f"{'drafter':<14}{'total s':>9}{'us/seq-step':>13}{'outside forward':>17}   " + " ".join(
        f"{p:>12}" for p in PHASES))
    for name, make in drafters.items():
        best = None
        for _ in range(args.repeats):
            for p in PHASES:
                seconds[p] = 0.0
            t0 = time.perf_counter()
            generate_with_control(model, prompts, EXACT, max_new_tokens=args.tokens, drafter=make(), do_sample=True,
                                  seed=1, temperature=0.9, top_k=3, speculation="always")
            total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, dict(seconds))
        total, phases = best
        per = total / (args.sequences * args.tokens) * 1e6
        outside = 1 - phases["verify"] / total
        print(f"{name:<14}{total:9.2f}{per:13.0f}{outside:16.0%}   " + " ".join(
            f"{phases[p]:12.2f}" for p in PHASES))


if __name__ == "__main__":
    main()
