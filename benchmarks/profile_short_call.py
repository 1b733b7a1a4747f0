"""Where a short generate() call's time goes, by engine phase: a drafter against plain decoding, same process.

    python benchmarks/profile_short_call.py                                  # self-draft, chat, 64 new tokens
    python benchmarks/profile_short_call.py --drafter ngram --category qa
    python benchmarks/profile_short_call.py --prompts 8 --max-new-tokens 32 --threads 1
    python benchmarks/profile_short_call.py --threads 1 --out prof.json                 # a docs/results file
    python benchmarks/profile_short_call.py --threads 1 --cold --out prof.json --append  # ... with a second column

Plain and the drafter alternate per prompt (greedy, after one warm-up call each), with timers wrapped around the
engine's phases: the call's set-up (prepare, build_engine and inside it the cost model, the row policy, the KV cache
and the speculation policy; the engine with the drafter's attach), the prefill, and per step the guard's decision
(wants_draft), the drafter's propose (its first call per sequence counted apart: the catch-up), tree sizing and the
guard's judgement (size_call), the verify forward, acceptance, commit and the policy's learning (observe,
record_step). Times are inclusive (a phase holds the phases inside it), per call, wall (perf_counter) and CPU
(process_time: on a shared machine the CPU time of a phase is steadier than its wall time). Prints each phase's
seconds per call and share of the drafter's call, plain's figure beside it, the counts (steps, drafter calls,
probes that verified nothing), and the call's ratio to plain. ``--out`` writes the run as a docs/results file: a
column of CPU times per call (the steadier clock on a shared machine); ``--append`` adds a run's column to one.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    add_guard_memory,
    add_overwrite,
    chat_ids,
    check_machine_class,
    check_new_files,
    cpu_name,
    forget_guard,
    guard_memory,
    machine_class,
    run_main,
    start_guard_memory,
)
from drafter_grid import HELD_OUT, category_prompts  # noqa: E402
from specdec.drafters import base as drafter_base  # noqa: E402
from specdec.eval.prompts import CATEGORIES  # noqa: E402

from specdec import engine as engine_mod  # noqa: E402
from specdec import engine_setup, speculation_policy, tree_sizing  # noqa: E402
from specdec.atomic_write import write_json  # noqa: E402
from specdec.errors import InputError  # noqa: E402
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--drafter", default="self-draft")
    ap.add_argument("--category", default="chat", help="a category of the acceptance suite, or held-out")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--model", default="default")
    add_guard_memory(ap)
    ap.add_argument("--out", type=Path, help="write the run to this JSON file, in the docs/results/ schema")
    ap.add_argument("--append", action="store_true", help="--out: add this run's column to the file written before")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    for flag, n in (("--prompts", args.prompts), ("--max-new-tokens", args.max_new_tokens)):
        if n < 1:
            ap.error(f"{flag} must be at least 1, got {n}")
    if args.category not in (*CATEGORIES, HELD_OUT):
        ap.error(f"--category: unknown {args.category!r}; choose from {', '.join((*CATEGORIES, HELD_OUT))}")
    try:
        drafter_cls = drafter_class(args.drafter)  # before the model loads: an unknown drafter is one line
    except InputError as err:
        ap.error(f"--drafter: {err}")
    if args.append and not (args.out and args.out.is_file()):
        ap.error("--append needs --out naming a file this script wrote")
    if not args.append:
        check_new_files(ap, args.overwrite, args.out)
        if args.out:
            check_machine_class(ap, "--out")
    if args.threads:
        torch.set_num_threads(args.threads)
    start_guard_memory(args)
    loaded = load_model(args.model)
    if args.append:  # before the calls: a file the column cannot join is refused, not found out after the run
        problem = appendable(args.out, header(args, loaded))
        if problem:
            ap.error(problem)
    timers = Timers()
    undo = timers.install(drafter_cls)
    torch.set_grad_enabled(False)
    try:
        counts = run_calls(args, loaded, timers)
    finally:
        uninstall(undo)
        torch.set_grad_enabled(True)
    report(args, timers, counts)
    if args.out:
        command = "python benchmarks/profile_short_call.py " + shlex.join(sys.argv[1:] if argv is None else argv)
        try:
            write_result(args.out, args, timers, counts, loaded, command)
        except ValueError as err:
            ap.error(str(err))


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


GUARD = ("guard decision (wants_draft)", "sizing + judgement (size_call)", "guard learning (TreeSizer.observe)",
         "verify timing (record_step)")
VERIFY = "    verify forward (Engine.verify)"
MEMORIES = ("warm, empty at the run's start and carried from call to call; cold, forgotten before every call; "
            "machine memory, what earlier runs on this machine left.")
TITLE = "Where a short call's time goes: the engine's phases per call, the drafter against plain decoding"


def result_column(args, timers: Timers, counts) -> tuple[str, list[list[str]], str]:
    """This run as a results column: its label, (row label, cell) pairs in CPU time per call, and its noise note."""
    plain, mine = timers.runs["plain"], timers.runs[args.drafter]
    calls = counts[args.drafter]["calls"]
    cpu = {k: 1e3 * v / calls for k, v in mine["cpu"].items()}
    pcpu = {k: 1e3 * v / calls for k, v in plain["cpu"].items()}
    per = {k: v / calls for k, v in mine["calls"].items()}
    steps, psteps = counts[args.drafter]["steps"] / calls, counts["plain"]["steps"] / calls
    total = cpu["generate()"]

    def share(ms: float) -> str:
        return f"{100 * ms / total:.2f}%"

    guard = sum(cpu.get(k, 0.0) for k in GUARD)
    probed, probes = cpu.get(PROBED, 0.0), per.get(PROBED, 0)
    label = f"{args.drafter}, {args.category}, {args.max_new_tokens}, " + \
        {"run": "warm", "cold": "cold", "machine": "machine memory"}[guard_memory(args)]
    rows = [
        ["call: CPU ms, steps (plain's)", f"{total:.0f} ms, {steps:.1f} steps ({pcpu['generate()']:.0f} ms, "
                                          f"{psteps:.1f})"],
        ["set-up (build_engine; plain's)", f"{cpu['  build_engine']:.1f} ms ({pcpu['  build_engine']:.1f}), "
                                           f"{share(cpu['  build_engine'])}"],
        ["drafter calls (propose)", f"{per.get('      propose', 0):.1f} calls, {cpu.get('      propose', 0):.1f} ms, "
                                    f"{share(cpu.get('      propose', 0))}"],
        ["guard bookkeeping (wants_draft, size_call, observe, record_step)", f"{guard:.1f} ms, {share(guard)}"],
        ["steps with draft nodes: their verify forward", f"{probes:.1f} steps, {probed:.1f} ms, {share(probed)}"],
        ["plain's decode step (verify forward)", f"{pcpu[VERIFY] / psteps:.1f} ms"],
        ["call, ratio to plain (CPU / wall)", f"{pcpu['generate()'] / total:.3f}x / "
                                              f"{plain['wall']['generate()'] / mine['wall']['generate()']:.3f}x"],
    ]
    one_row = (cpu[VERIFY] - probed) / max(steps - probes, 1e-9) / (pcpu[VERIFY] / psteps) - 1
    note = (f"{label}: outside the steps with draft nodes, a 1-row verify forward of the drafter's calls differed "
            f"from plain's by {100 * one_row:+.1f}% (the machine's noise: the same work).")
    return label, rows, note


def header(args, loaded) -> dict:
    """The fields of this run's docs/results file that every column of it shares: the machine and the settings,
    also as ``settings`` (which ``--append`` compares: the text of the others may be edited by hand)."""
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    return {
        "date": datetime.date.today().isoformat(),
        "machine_class": machine_class(),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} torch thread(s)",
        "benchmark": "short-call-profile",
        "title": TITLE,
        "conditions": f"Model {args.model}, {dtype}, greedy, {args.prompts} call(s) per row after one warm-up call "
                      "each, plain and the drafter alternating per prompt. A column is drafter, category, new "
                      "tokens and where the guard's memory started: " + MEMORIES + " Every figure is CPU time "
                      "(process_time) per call, inclusive; a share is of the drafter's call.",
        "settings": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "model": args.model, "dtype": dtype,
                     "prompts": args.prompts},
    }


def appendable(path: Path, mine: dict) -> str | None:
    """Why this run's column (its ``header``) cannot join the profile at ``path``, or None: the file states its
    machine and settings once for every column, so a column of other threads, model or prompts would be misread."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path}: not JSON ({err}); --append adds to a file this script wrote"
    if not isinstance(data, dict) or data.get("benchmark") != "short-call-profile":
        return f"{path}: not a short-call profile; --append adds to one"
    theirs = data.get("settings") or {}  # none in a file written before the field was
    differ = [f"{key} {theirs[key]} there, {value} here" for key, value in mine["settings"].items()
              if key in theirs and theirs[key] != value]
    if differ:
        return f"{path}: another run's settings ({'; '.join(differ)}); a column of other settings needs a file"
    return None


def write_result(path: Path, args, timers: Timers, counts, loaded, command: str) -> None:
    """The run as a docs/results file, or (``--append``) as one more column of the file at ``path``."""
    label, rows, note = result_column(args, timers, counts)
    if args.append:
        data = json.loads(path.read_text())
        if [r[0] for r in data["rows"]] != [r[0] for r in rows]:
            raise ValueError(f"{path}: not a short-call profile with these rows; --append adds to one")
        data["columns"].append(label)
        data["rows"] = [old + new[1:] for old, new in zip(data["rows"], rows, strict=True)]
        data["command"] = [data["command"]] if isinstance(data["command"], str) else data["command"]
        data["command"].append(command)
        data["notes"].append(note)
    else:
        data = {**header(args, loaded), "command": [command], "columns": ["per call, CPU time", label], "rows": rows,
                "notes": [note]}
    write_json(path, data, indent=1)


if __name__ == "__main__":
    run_main(main)
