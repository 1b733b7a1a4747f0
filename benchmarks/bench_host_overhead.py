"""Host-side work of the engine per sequence and step: what a step costs beyond the target's forward.

    python benchmarks/bench_host_overhead.py [--sequences 3000] [--tokens 3] [--repeats 3] [--prompt-tokens 8]
    python benchmarks/bench_host_overhead.py --batch1 [--tokens 400] [--repeats 3]
    python benchmarks/bench_host_overhead.py --batch1 --batch 32 [--tokens 64]   # the same rows, 32 sequences a step

A tiny model (vocabulary 4, two layers, one thread) whose forward is almost free, a batch of many short
sampled sequences (the shape of the sampling-law tests), and each step split into the engine's phases:
prefill (``add``), drafting, building the verify batch, the target forward, acceptance, commit. Prints the
seconds per phase, the microseconds per sequence-step, and the share of the step outside the forward, for
plain decoding, the n-gram drafter and random trees (``specdec.testing.RandomTreeDrafter``). On a real model
the forward dominates; these are the per-sequence costs that sit before every step of a large batch, on a GPU
as on a CPU. Best of ``--repeats`` runs per row (a noisy machine only ever adds time).

``--batch1``: one sequence, where a small model on a GPU waits for the host (docs/gpu-speed.md). The host's
microseconds per step outside the target's forward, in thread CPU time (a busy machine's waits are not counted),
and the aten ops a step launches there (``specdec.launches``), for plain decoding (greedy and sampled), n-gram
and EAGLE (a random layer, a chain of 6; ``speculation="always"``), on the eager path and on the GPU's (CUDA-graph
buckets, uncaptured, the Triton backend in its interpreter: plain steps queued ahead, EAGLE's pending proposals).
The forward is a near-free stand-in (its time and launches left out, as are Triton kernels the interpreter runs
outside it): the next token a fixed function of the token and its position, a repetitive text the n-gram drafter
predicts in part. On the GPU's path EAGLE's drafting call, one graph replay there, is left out the same way: each
bucket's call runs once and later calls reuse its outputs (the same trees). ``--batch N`` runs those rows with N
sequences a step (distinct prompts), where a GPU's speculative step waits for the host's per-sequence work; each
row whose steps run :meth:`Engine.step` (every eager row, the graphed drafters': not the queued plain steps) is then
also split by the engine's phases (the median host us of each, in a step's order).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # --batch1's graphed path, before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HelpWithDefaults, check_positive, run_main  # noqa: E402
from specdec.eval.negative_controls import generate_with_control  # noqa: E402

from specdec.engine import Engine  # noqa: E402
from specdec.rejection import EXACT  # noqa: E402
from specdec.testing import RandomTreeDrafter, build_tiny_model  # noqa: E402

PHASES = ("add", "propose", "verify_batch", "verify", "accept", "commit")


def wrap_phases(names: tuple[str, ...], clock, record) -> None:
    """Wrap the engine's methods ``names`` so that each call passes its name and the ``clock()`` seconds it took to
    ``record`` (this process only; a static method stays static)."""
    for name in names:
        static = isinstance(inspect.getattr_static(Engine, name), staticmethod)
        method = getattr(Engine, name)

        @functools.wraps(method)
        def wrapper(*args, _method=method, _name=name, **kwargs):
            t0 = clock()
            try:
                return _method(*args, **kwargs)
            finally:
                record(_name, clock() - t0)

        setattr(Engine, name, staticmethod(wrapper) if static else wrapper)


def timed_engine(seconds: dict[str, float]) -> None:
    """Each call of an engine phase (PHASES) adds its wall time to ``seconds``."""
    wrap_phases(PHASES, time.perf_counter, lambda name, s: seconds.__setitem__(name, seconds[name] + s))


STEP_PHASES = ("propose", "verify_batch", "verify", "read", "accept", "keep_new_hidden", "commit")


def phase_clock(excluded_seconds) -> dict[str, list[float]]:
    """Each call of a step phase (STEP_PHASES) appends its host thread time, less what ``excluded_seconds()``
    counted inside it (the stand-in forward, interpreted kernels), to the returned lists."""
    spent: dict[str, list[float]] = {name: [] for name in STEP_PHASES}
    wrap_phases(STEP_PHASES, lambda: time.thread_time() - excluded_seconds(), lambda name, s: spent[name].append(s))
    return spent


def batch1(tokens: int, repeats: int, batch: int = 1) -> None:
    """The ``--batch1`` rows (module doc), ``batch`` sequences a step."""
    from specdec import cost_model, engine_setup
    from specdec.generate import generate
    from specdec.launches import Launches
    from specdec.models import row_policy
    from specdec.models.llama import ForwardOutput, LlamaRunner
    from specdec.models.loader import load_model

    os.environ["SPECDEC_ATTENTION"] = "triton"  # the graphed path's caches (the eager runner keeps its reference)
    row_policy.uninstall()  # products as a GPU runs them (count_launches.py): the CPU's row policy off
    engine_setup.ensure_row_policy = cost_model.ensure_row_policy = lambda *args, **kwargs: None
    vocab = 96
    model = load_model(build_tiny_model(vocab_size=vocab, max_position_embeddings=tokens + 64), device="cpu")
    cycle = torch.tensor([t // 8 * 8 + (t + 1) % 8 for t in range(vocab)])  # cycles of 8 tokens, left every 29th

    @torch.inference_mode()
    def stand_in(runner, token_ids, positions, plan, cache, logits_rows, with_logits=True, feature_layers=()):
        nxt = torch.where(positions % 29 == 0, (token_ids * 5 + positions) % vocab, cycle[token_ids])
        hidden = runner.lm_head[nxt] * 4.0
        hidden = hidden if logits_rows is None else hidden[logits_rows]
        return ForwardOutput(runner.logits(hidden) if with_logits else None, hidden, None)

    import triton.runtime.interpreter as interpreter
    clock, inside, spent = [0.0, 0.0, 0], [0], [None]  # step s, excluded s, steps; inside the forward; counter

    def excluded(run):  # the stand-in forward, or a Triton kernel the interpreter runs: left out of the host time
        def wrapper(*args, **kwargs):
            if inside[0]:
                return run(*args, **kwargs)
            inside[0] += 1
            if spent[0] is not None:
                spent[0].inside += 1
            t0 = time.thread_time()
            try:
                return run(*args, **kwargs)
            finally:
                clock[1] += time.thread_time() - t0
                inside[0] -= 1
                if spent[0] is not None:
                    spent[0].inside -= 1
        return wrapper

    def step(self, _step=Engine.step):
        t0 = time.thread_time()
        try:
            if spent[0] is None:
                return _step(self)
            with spent[0]:
                return _step(self)
        finally:
            clock[0] += time.thread_time() - t0
            clock[2] += 1

    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_graphs import EagleGraphs

    from specdec.models import synthetic

    replayed: dict = {}  # (bucket, form) -> its outputs: a replay's stand-in
    real_run = EagleGraphs._run

    def replay(self, bucket, form):
        key = (id(bucket), form)
        if key not in replayed:
            replayed[key] = real_run(self, bucket, form)
        return replayed[key]

    LlamaRunner.forward, Engine.step = excluded(stand_in), step
    interpreter.InterpretedFunction.run = excluded(interpreter.InterpretedFunction.run)
    EagleGraphs._run = excluded(replay)
    paths = {path: LlamaRunner(model.model, backend=backend) for path, backend in (("eager", "reference"),
                                                                                  ("graphed", "triton"))}
    eagle = synthetic.eagle_head(model.model.config, device="cpu", dtype=torch.float32)
    rows = {"plain": {}, "sampled": dict(do_sample=True, seed=1, temperature=0.9, top_k=0),
            "ngram": dict(drafter="ngram", speculation="always"),
            "eagle": dict(drafter=lambda path: EagleDrafter(model=eagle, depth=6, top_k=1, max_nodes=6,
                                                            adapt_depth=False, cuda_graphs=path == "graphed"),
                          speculation="always")}
    prompt = [[5 + b % 7, 6, 7, 8, 9, 10 + b // 7 % 5, 11, 12] * 2 for b in range(batch)]  # distinct from 2 on
    print(f"batch {batch}, {tokens} new tokens after a {len(prompt[0])}-token prompt, tiny model, stand-in forward, "
          f"1 thread, best of {repeats}")
    print(f"{'path':<9}{'decoding':<10}{'steps':>6}{'host us/step':>14}{'ops/step':>10}   ops outside the forward")
    phases = phase_clock(lambda: clock[1]) if batch > 1 else None
    split = []  # (path, decoding, median us per phase) of the speculative rows
    for path, runner in paths.items():
        loaded = dataclasses.replace(model, runner=runner)
        for name, kwargs in rows.items():
            drafter = kwargs.get("drafter")
            if callable(drafter):
                kwargs = dict(kwargs, drafter=drafter(path))
            call = functools.partial(generate, loaded, prompt, max_new_tokens=tokens, cuda_graphs=path == "graphed",
                                     **kwargs)
            call()  # warm-up: the policy's costs, Triton's compiles
            best = None
            for each in (phases or {}).values():
                each.clear()
            for _ in range(repeats):
                clock[:] = [0.0, 0.0, 0]
                call()
                per = (clock[0] - clock[1]) / clock[2] * 1e6
                best = per if best is None else min(best, per)
            if phases and phases["propose"]:
                split.append((path, name, {k: 1e6 * statistics.median(v) for k, v in phases.items() if v}))
            spent[0], clock[2] = Launches(), 0
            call()
            ops, steps, spent[0] = spent[0].ops, clock[2], None
            print(f"{path:<9}{name:<10}{steps:6d}{best:14.1f}{sum(ops.values()) / steps:10.2f}   "
                  + ", ".join(f"{k} {v / steps:.2f}" for k, v in sorted(ops.items())))
    if split:
        print(f"\nEngine.step by phase (queued plain steps have none), median host us per step ({repeats} runs)")
        print(f"{'path':<9}{'decoding':<10}" + "".join(f"{p:>16}" for p in STEP_PHASES))
        for path, name, row in split:
            print(f"{path:<9}{name:<10}" + "".join(f"{row.get(p, 0.0):16.1f}" for p in STEP_PHASES))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--sequences", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=None,
                    help="new tokens per sequence (sampled, temperature 0.9; default 3, with --batch1 400)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=8,
                    help="prompt length: per-step work that grows with the context shows at a few hundred")
    ap.add_argument("--batch1", action="store_true", help="one sequence: host us per step outside the forward")
    ap.add_argument("--batch", type=int, default=1, help="with --batch1: sequences per step (module doc)")
    args = ap.parse_args()
    if args.batch < 1 or (args.batch > 1 and not args.batch1):
        ap.error(f"--batch must be >= 1 and goes with --batch1, got {args.batch}")
    check_positive(ap, args, "sequences", "tokens", "repeats", "prompt_tokens")
    torch.set_num_threads(1)
    if args.batch1:
        default = 400 if args.batch == 1 else 64
        return batch1(default if args.tokens is None else args.tokens, args.repeats, args.batch)
    if args.tokens is None:
        args.tokens = 3
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
        def call(batch, make=make):
            drafter = make()  # plain decoding takes no speculation setting (generate() would warn it is ignored)
            generate_with_control(model, batch, EXACT, max_new_tokens=args.tokens, drafter=drafter, do_sample=True,
                                  seed=1, temperature=0.9, top_k=3, **({} if drafter is None else
                                                                         {"speculation": "always"}))

        call(prompts[:8])  # untimed warm-up: the first row paid the process's one-time set-up (18x its time)
        best = None
        for _ in range(args.repeats):
            for p in PHASES:
                seconds[p] = 0.0
            t0 = time.perf_counter()
            call(prompts)
            total = time.perf_counter() - t0
            if best is None or total < best[0]:
                best = (total, dict(seconds))
        total, phases = best
        per = total / (args.sequences * args.tokens) * 1e6
        outside = 1 - phases["verify"] / total
        print(f"{name:<14}{total:9.2f}{per:13.0f}{outside:16.0%}   " + " ".join(
            f"{phases[p]:12.2f}" for p in PHASES))


if __name__ == "__main__":
    run_main(main)
