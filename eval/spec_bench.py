"""Spec-Bench's grouping of the acceptance suite's cells: per turn, per category, ``mt_bench`` and overall.

    rows = report_rows(cells, cell_turns(conversations))    # summarise() rows, each with a "level"

Levels: ``turn`` (one turn of a multi-turn category: a measured cell), ``category`` (a category's cells merged over
its turns, or its one cell), ``group`` (``mt_bench``: MT-bench's eight categories merged, as Spec-Bench's table
shows them) and ``overall`` (every cell merged). Merged cells sum tokens, steps and seconds, so a merged speedup is
total tokens per second over plain's, and tau is committed tokens per target forward over all of them (Spec-Bench
averages per-question speeds instead; ``docs/benchmark-files.md`` compares the two).
"""
from __future__ import annotations

from collections.abc import Collection

from specdec.eval.acceptance import Cell, summarise
from specdec.eval.prompt_files import MT_BENCH_GROUP, OVERALL  # names no prompt file's category takes

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def _merged(cells: dict[tuple[str, str], Cell], label: str, name: str, parts: list[str]) -> Cell:
    merged = Cell(label, name)
    for part in parts:
        merged.merge(cells[label, part])
    return merged


def grouped_cells(cells: dict[tuple[str, str], Cell], turns: dict[str, tuple[str, int]],
                  mt_bench: Collection[str] = MT_BENCH
                  ) -> tuple[dict[tuple[str, str], Cell], dict[str, str], dict[str, list[str]]]:
    """Cells per category, group and overall (``turns``: cell name -> (category, turn)); returns them, each name's
    level (in report order: every category's turns then the category, mt_bench, overall) and each group's
    categories. ``mt_bench``: the categories that may form the group (a built-in ``math`` is not MT-bench's)."""
    labels = list(dict.fromkeys(label for label, _ in cells))
    by_category: dict[str, list[str]] = {}
    for name, (category, _) in turns.items():
        by_category.setdefault(category, []).append(name)
    out: dict[tuple[str, str], Cell] = {}
    levels: dict[str, str] = {}
    members: dict[str, list[str]] = {}  # group -> its categories
    for category, names in by_category.items():
        for label in labels:
            if len(names) > 1:
                for name in names:
                    out[label, name] = cells[label, name]
            out[label, category] = cells[label, category] if names == [category] else \
                _merged(cells, label, category, names)
        levels.update({name: "turn" for name in names if len(names) > 1})
        levels[category] = "category"
    groups = []
    mt = [name for c in MT_BENCH if c in by_category and c in mt_bench for name in by_category[c]]
    if mt and MT_BENCH_GROUP not in by_category:
        groups.append((MT_BENCH_GROUP, "group", mt))
    if len(by_category) > 1 and OVERALL not in by_category:
        groups.append((OVERALL, "overall", list(turns)))
    for name, level, parts in groups:
        levels[name] = level
        members[name] = list(dict.fromkeys(turns[part][0] for part in parts))
        for label in labels:
            out[label, name] = _merged(cells, label, name, parts)
    return out, levels, members


def report_rows(cells: dict[tuple[str, str], Cell], turns: dict[str, tuple[str, int]],
                mt_bench: Collection[str] = MT_BENCH) -> list[dict]:
    """:func:`summarise` rows of every turn, category, group and overall, each with its ``level``."""
    grouped, levels, members = grouped_cells(cells, turns, mt_bench)
    rows = summarise(grouped)
    for row in rows:
        row["level"] = levels[row["category"]]
        if row["category"] in members:
            row["categories"] = members[row["category"]]
    order = {name: i for i, name in enumerate(levels)}
    return sorted(rows, key=lambda r: order[r["category"]])  # stable: the drafters keep their order
