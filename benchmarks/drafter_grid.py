"""The drafter grid of bench_drafters_cpu.py --grid: its columns' inputs, its tables and its result file.

Columns: the seven categories of ``specdec eval acceptance``, ``held-out`` (held_out_prompts.py) and ``batch8``:
ragged batches of 8 prompts drawn in turn from the other chosen columns (or from every category when only batch8 is
chosen), as many batches as prompts per category. A cell is one drafter at one length on one column; its entry is
the paired ratio of tokens/s to plain decoding in the same blocks with its 90% interval, tau when above 1.00, and a
flag when any output differs from plain's. The result file follows docs/gen_benchmarks.py's schema (a table of
rows x columns) and keeps every cell's numbers under ``cells``.
"""
from __future__ import annotations

import datetime
import shlex
from pathlib import Path

from common import cpu_name, machine_class
from held_out_prompts import load_held_out
from specdec.eval.prompts import CATEGORIES, load_prompts

from specdec.atomic_write import write_json

HELD_OUT, BATCH = "held-out", "batch8"
LENGTHS = (16, 32, 64, 128)  # --lengths' default
BATCH_SIZE = 8
FLOOR = 0.97  # a drafter whose paired interval lies wholly below this ratio is slower than plain decoding
SHORT = {"summarisation": "summ", "translation": "transl"}


def batch_sizes() -> list[int]:
    """The batch sizes above 1 that a ragged batch of BATCH_SIZE passes through, as the cost model rounds them up to
    powers of two: 2, 4, 8."""
    return [2**k for k in range(1, (BATCH_SIZE - 1).bit_length() + 1)]


def expand_categories(text: str, error) -> list[str]:
    """``all`` -> the seven categories; unknown names -> error(message)."""
    names = []
    for name in (n.strip() for n in text.split(",")):
        names += list(CATEGORIES) if name == "all" else [name]
    unknown = [n for n in names if n not in (*CATEGORIES, HELD_OUT, BATCH)]
    if unknown:
        error(f"--categories: unknown {', '.join(map(repr, unknown))}; known: all, {', '.join(CATEGORIES)}, "
              f"{HELD_OUT}, {BATCH}")
    return list(dict.fromkeys(names))


def category_prompts(category: str, n: int) -> list[str]:
    return load_held_out(n) if category == HELD_OUT else load_prompts(category, n)


def ragged_batches(columns: dict[str, list[list[int]]], batches: int, size: int = BATCH_SIZE) -> list[list[list[int]]]:
    """``batches`` batches of ``size`` prompts: the prompts of every column in turn (first prompts first), cycled."""
    pool = [c[i] for i in range(max(map(len, columns.values()))) for c in columns.values() if i < len(c)]
    return [[pool[(b * size + i) % len(pool)] for i in range(size)] for b in range(batches)]


def grid_inputs(tokenizer, categories: list[str], prompts: int, chat_ids) -> dict[str, list]:
    """Column -> its inputs: a prompt's token ids each, or (batch8) a ragged batch of them each."""
    singles = [c for c in categories if c != BATCH]
    columns = {c: [chat_ids(tokenizer, text) for text in category_prompts(c, prompts)] for c in singles}
    if BATCH in categories:
        sources = columns or {c: [chat_ids(tokenizer, text) for text in category_prompts(c, prompts)]
                              for c in CATEGORIES}
        columns[BATCH] = ragged_batches(sources, prompts)
    return columns


def is_slower(cell: dict) -> bool:
    """The cell's paired interval lies wholly below FLOOR (one block: no interval, never slower)."""
    return cell["paired_speedup"][2] < FLOOR and cell["runs"] > 1


def drafted(cells: list[dict]) -> list[dict]:
    """The cells of drafters (plain decoding's own rows left out)."""
    return [c for c in cells if c["drafter"] not in ("plain", "plain (again)")]


def cell_text(cell: dict) -> str:
    mean, low, high = cell["paired_speedup"]
    text = f"{mean:.2f}" + (f" ({cell['tau']:.2f})" if cell["tau"] >= 1.005 else "") + f" [{low:.2f}, {high:.2f}]"
    if is_slower(cell):
        text += " SLOWER"
    return text + ("" if cell["identical_to_plain"] else f" DIFFERS x{cell['mismatching_runs']}")


def grid_rows(cells: list[dict], length: int, drafters: list[str], columns: list[str]) -> list[list[str]]:
    at = {(c["drafter"], c["column"]): c for c in cells if c["new_tokens"] == length}
    rows = [["plain tok/s", str(length)] + [f"{at['plain', col]['tokens_per_s']:.1f}" for col in columns]]
    return rows + [[d, str(length)] + [cell_text(at[d, col]) for col in columns] for d in drafters if d != "plain"]


def grid_table(cells: list[dict], length: int, drafters: list[str], columns: list[str]) -> str:
    """One length's table: a row per drafter, a column per category, "ratio (tau) [90% interval]"."""
    rows = grid_rows(cells, length, drafters, columns)
    head = ["drafter", "new"] + [SHORT.get(c, c) for c in columns]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    lines = ["", f"{length} new tokens: paired ratio to plain (tau) [90% interval]"]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in [head] + rows]
    return "\n".join(lines)


def summary(cells: list[dict]) -> str:
    mine = drafted(cells)
    slower = [c for c in mine if is_slower(c)]
    straddle = [c for c in mine if c["paired_speedup"][1] < FLOOR <= c["paired_speedup"][2]]
    differ = [c for c in mine if not c["identical_to_plain"]]

    def names(group: list[dict]) -> str:
        return "; ".join(f"{c['drafter']} @{c['new_tokens']} {c['column']}" for c in group) or "none"

    single = " (one block per cell: no intervals)" if all(c["runs"] == 1 for c in mine) else ""
    return (f"\n{len(mine)} drafter cells{single}. Interval wholly below {FLOOR}: {names(slower)}\n"
            f"Interval straddling {FLOOR}: {names(straddle)}\nOutputs differing from plain: {names(differ)}")


def counts_text(counts: dict[str, int], repeats: int) -> str:
    """The inputs each column ran and the blocks each interval rests on, in words."""
    singles = {SHORT.get(c, c): n for c, n in counts.items() if c != BATCH}
    if len(set(singles.values())) == 1:
        parts = [f"{next(iter(singles.values()))} prompts per column"]
    else:
        parts = ["prompts per column: " + ", ".join(f"{c} {n}" for c, n in singles.items())] if singles else []
    if BATCH in counts:
        parts.append(f"batch8: {counts[BATCH]} ragged batches of {BATCH_SIZE}")
    sizes = set(counts.values())
    blocks = str(sizes.pop() * repeats) if len(sizes) == 1 else f"its column's count x {repeats}"
    return f"{'; '.join(parts)}; {repeats} repeat(s): each interval rests on {blocks} blocks."


def benchmark_key(drafters: list[str], every_drafter: list[str], columns: list[str], lengths: list[int]) -> str:
    """The result's ``benchmark``: ``drafter-grid``, then what sets this grid apart from the full one (the drafters
    when not every one the run could measure, the columns when not all, the lengths when not LENGTHS), e.g.
    ``drafter-grid-64-128`` or ``drafter-grid-medusa``: two grids of one day must be two benchmarks, as
    docs/gen_benchmarks.py shows one result per benchmark and refuses two that tie for latest."""
    drafters = [d for d in drafters if d not in ("plain", "plain (again)")]
    parts = ["drafter-grid"]
    if set(drafters) != set(every_drafter):
        parts += drafters
    if set(columns) != {*CATEGORIES, HELD_OUT, BATCH}:
        parts += [SHORT.get(c, c) for c in columns]
    if set(lengths) != set(LENGTHS):
        parts += [str(n) for n in lengths]
    return "-".join(parts)


# where the guard's memory started (common.guard_memory) -> what the result file's conditions say
MEMORY_CONDITIONS = {
    "cold": "Cold: the guard's memory forgotten before every call, each call as a new process's first. ",
    "run": "The guard's memory empty at the run's start, carried from call to call. ",
    "machine": "The guard started from what earlier runs on this machine left in its memory. ",
}


def write_result(path: str, cells: list[dict], drafters: list[str], columns: list[str], lengths: list[int],
                 argv: list[str], model: str, counts: dict[str, int], repeats: int, every_drafter: list[str],
                 memory: str = "run", clock: str = "wall") -> None:
    """The grid in docs/results/'s schema: rows (drafter, length) x columns, and every cell's numbers; ``counts``:
    the inputs each column ran (prompts, or batch8's batches); ``every_drafter``: the grid's drafters this run could
    have measured (benchmark_key)."""
    import torch

    rows = [row for length in lengths for row in grid_rows(cells, length, drafters, columns)]
    slower = sum(map(is_slower, drafted(cells)))
    differ = sum(not c["identical_to_plain"] for c in cells)
    write_json(Path(path), indent=1, data={
        "date": datetime.date.today().isoformat(),
        "machine_class": machine_class(),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} torch threads; {model}, greedy, speculation auto",
        "benchmark": benchmark_key(drafters, every_drafter, columns, lengths),
        "title": "Every drafter x new-token length x category, paired against plain decoding",
        "command": "python benchmarks/bench_drafters_cpu.py " + shlex.join(argv[1:]),
        "conditions": MEMORY_CONDITIONS[memory]
                      + ("Times are the process's CPU seconds, not wall seconds (draft_share: of wall seconds). "
                         if clock == "cpu" else "")
                      + f"{counts_text(counts, repeats)} Cells: paired ratio to plain (tau, when above 1.00) [90% "
                        f"interval]; SLOWER: interval wholly below {FLOOR}; DIFFERS: some output is not plain "
                        "decoding's.",
        "columns": ["drafter", "new tokens"] + [SHORT.get(c, c) for c in columns],
        "rows": rows,
        "notes": [f"{slower} cell(s) with the interval wholly below {FLOOR}; {differ} with an output other than "
                  "plain's."],
        "cells": cells,
    })
