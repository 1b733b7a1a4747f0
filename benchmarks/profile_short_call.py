"""Where a short generate() call's time goes, by engine phase: a drafter against plain decoding, same process.

    python benchmarks/profile_short_call.py                                  # self-draft, chat, 64 new tokens
    python benchmarks/profile_short_call.py --drafter ngram --category qa
    python benchmarks/profile_short_call.py --prompts 8 --max-new-tokens 32 --threads 1

Plain and the drafter alternate per prompt (greedy, after one warm-up call each), with timers wrapped around the
engine's phases: the call's set-up (prepare, build_engine and inside it the cost model, the row policy, the KV cache
and the speculation policy; the engine with the drafter's attach), the prefill, and per step the guard's decision
(wants_draft), the drafter's propose (its first call per sequence counted apart: the catch-up), tree sizing and the
guard's judgement (size_call), the verify forward, acceptance, commit and the policy's learning (observe,
record_step). Times are inclusive (a phase holds the phases inside it), per call, wall (perf_counter) and CPU
(process_time: on a shared machine the CPU time of a phase is steadier than its wall time). Prints each phase's
seconds per call and share of the drafter's call, plain's figure beside it, the counts (steps, drafter calls,
probes that verified nothing), and the call's ratio to plain.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_guard_memory, chat_ids, forget_guard, start_guard_memory  # noqa: E402
from drafter_grid import category_prompts  # noqa: E402
from specdec.drafters import base as drafter_base  # noqa: E402

from specdec import engine as engine_mod  # noqa: E402
from specdec import engine_setup, speculation_policy, tree_sizing  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402

generate = importlib.import_module("specdec.generate")  # the module (specdec.generate is also the function)

PROBED = "      of it: steps with draft nodes"
DRAFTER = None  # owner of a phase that is a method of the drafter's own class
# (label, owner, attribute), in the order printed; a label's indentation shows which phase holds it
PHASES = [
    ("generate()", generate, "generate"),
    ("  prepare", generate, "prepare"),
    ("  build_engine", generate, "build_engine"),
    ("    row policy (ensure_row_policy)", engine_setup, "ensure_row_policy"),
    ("    KV cache (_kv_cache)", engine_setup, "_kv_cache"),
    ("    policy (_policy: load_cost_model)", engine_setup, "_policy"),
    ("    Engine() (attach, never_pays)", engine_mod.Engine, "__init__"),
    ("      drafter attach", DRAFTER, "attach"),
    ("  prefill (Engine.add)", engine_mod.Engine, "add"),
    ("  steps (Engine.step)", engine_mod.Engine, "step"),
    ("    drafting (Engine.propose)", engine_mod.Engine, "propose"),
    ("      guard decision (wants_draft)", tree_sizing.TreeSizer, "wants_draft"),
    ("      propose", DRAFTER, "propose"),
    ("      sizing + judgement (size_call)", tree_sizing.TreeSizer, "size_call"),
    ("    verify forward (Engine.verify)", engine_mod.Engine, "verify"),
    (PROBED, engine_mod.Engine, "verify"),  # the same, only the steps that verify draft nodes
    ("    acceptance (Engine.accept)", engine_mod.Engine, "accept"),
    ("    commit (Engine.commit)", engine_mod.Engine, "commit"),
    ("    policy learning (observe)", speculation_policy.SpeculationPolicy, "observe"),
    ("      guard learning (TreeSizer.observe)", tree_sizing.TreeSizer, "observe"),
    ("      verify timing (record_step)", tree_sizing.TreeSizer, "record_step"),
    ("  output (pack_output)", generate, "pack_output"),
]


class Timers:
    """Inclusive wall and CPU seconds and call counts per label, added to the run at hand's (``use``)."""

    def __init__(self) -> None:
        self.runs: dict[str, dict[str, defaultdict]] = {}
        self.now: dict[str, defaultdict] = self.fresh()

    @staticmethod
    def fresh() -> dict[str, defaultdict]:
        return {"wall": defaultdict(float), "cpu": defaultdict(float), "calls": defaultdict(int)}

    def use(self, key: str | None) -> None:
        """Add to ``key``'s totals from now on (None: to a throw-away, the warm-up)."""
        self.now = self.fresh() if key is None else self.runs.setdefault(key, self.fresh())

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            now, w, c = self.now, time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                now["wall"][label] += time.perf_counter() - w
                now["cpu"][label] += time.process_time() - c
                now["calls"][label] += 1

        return timed

    def install(self, drafter_cls: type) -> list[tuple]:
        """Wrap every phase; returns (owner, attribute, original) to restore, in reverse order."""
        undo = []
        for label, owner, attr in PHASES:
            owner = drafter_cls if owner is DRAFTER else owner
            fn = owner.__dict__.get(attr, getattr(owner, attr))
            undo.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, self.wrap_drafted(label, fn) if label == PROBED else self.wrap(label, fn))
        return undo[::-1]


    def wrap_drafted(self, label: str, verify):
        """Engine.verify timed under ``label`` only when its batch holds more rows than sequences (draft nodes)."""
        timed = self.wrap(label, verify)

        def maybe(engine, batch):
            drafted = batch.token_ids.numel() > len(batch.plan.seqs)
            return (timed if drafted else verify)(engine, batch)

        return maybe


def uninstall(undo: list[tuple]) -> None:
    for owner, attr, original in undo:
        if original is None:  # inherited: drop the wrapper, the base class's method shows again
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)


def drafter_class(name: str) -> type:
    from specdec.drafters.registry import get_drafter

    drafter = get_drafter(name)
    return type(drafter.obj if isinstance(drafter, drafter_base._ObjectDrafter) else drafter)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="self-draft")
    ap.add_argument("--category", default="chat", help="a category of the acceptance suite, or held-out")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--model", default="default")
    add_guard_memory(ap)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start_guard_memory(args)
    loaded = load_model(args.model)
    timers = Timers()
    undo = timers.install(drafter_class(args.drafter))
    torch.set_grad_enabled(False)
    try:
        counts = run_calls(args, loaded, timers)
    finally:
        uninstall(undo)
        torch.set_grad_enabled(True)
    report(args, timers, counts)


def run_calls(args, loaded, timers: Timers) -> dict:
    """Plain and the drafter alternating per prompt after a warm-up call each; counts per row."""
    prompts = [chat_ids(loaded.tokenizer, t) for t in category_prompts(args.category, args.prompts)]
    counts = {k: defaultdict(int) for k in ("plain", args.drafter)}
    for i, ids in enumerate([chat_ids(loaded.tokenizer, "Hello!")] + prompts):  # the first: warm-up
        outs = {}
        for key in (["plain", args.drafter] if i % 2 else [args.drafter, "plain"]):
            timers.use(key if i else None)
            if args.cold:
                forget_guard()
            outs[key] = generate.generate(loaded, [ids], max_new_tokens=args.max_new_tokens, return_dict=True,
                                          drafter=None if key == "plain" else args.drafter)
        for key, out in outs.items():
            if i:
                s = out.stats[0]
                n = counts[key]
                n["calls"] += 1
                n["tokens"] += s.new_tokens
                n["steps"] += s.steps
                n["drafted steps"] += sum(k > 0 for k in s.step_nodes)
                n["nodes verified"] += sum(s.step_nodes)
                n["outputs unlike plain"] += out.new_tokens != outs["plain"].new_tokens
    return counts


def report(args, timers: Timers, counts) -> None:
    plain, mine = timers.runs["plain"], timers.runs[args.drafter]
    calls = counts[args.drafter]["calls"]
    total = mine["wall"]["generate()"]
    print(f"\n{args.drafter} vs plain, {args.category}, {args.max_new_tokens} new tokens, {calls} calls each"
          f"{' (cold: the guard forgets before each call)' if args.cold else ''}"
          f"{' (the guard starting from what this machine remembered)' if args.machine_memory else ''}, "
          f"{torch.get_num_threads()} thread(s); per call, inclusive; share: of the drafter's call (wall)")
    print(f"{'phase':<40} {'calls':>6} {'wall ms':>9} {'cpu ms':>9} {'share':>7}   {'plain: calls':>12} {'wall ms':>9}"
          f" {'cpu ms':>9}")
    for label, _, _ in PHASES:
        if not mine["calls"].get(label) and not plain["calls"].get(label):
            continue
        print(f"{label:<40} {mine['calls'][label] / calls:6.1f} {1e3 * mine['wall'][label] / calls:9.2f}"
              f" {1e3 * mine['cpu'][label] / calls:9.2f} {100 * mine['wall'][label] / total:6.1f}%"
              f"   {plain['calls'][label] / calls:12.1f} {1e3 * plain['wall'][label] / calls:9.2f}"
              f" {1e3 * plain['cpu'][label] / calls:9.2f}")
    print(f"\n{args.drafter} speed vs plain: {plain['wall']['generate()'] / total:.3f}x wall, "
          f"{plain['cpu']['generate()'] / mine['cpu']['generate()']:.3f}x cpu (same calls, interleaved)")
    for key, n in counts.items():
        print(f"{key}: " + ", ".join(f"{k} {v / calls:.1f}/call" for k, v in n.items() if k != "calls"))


if __name__ == "__main__":
    main()
