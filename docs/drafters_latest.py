"""The README's drafter table, built from docs/results (docs/gen_result_tables.py's ``drafters_per_machine`` part):
a row per drafter (DRAFTERS: its name and what proposes its tokens, prose kept here), a column per machine class
with a drafters result, each cell from the newest result that measured that drafter on that class.

A drafters result (benchmarks/bench_drafters_cpu.py) has a table whose first column is headed "vs plain ...", a
row per drafter labelled by its name, maybe with words in parentheses (``eagle (quick recipe)``; ``ngram+eagle`` is
the combined drafter), a column per prompt category and cells "ratio (tau) [interval]" (``1.29 (1.36) [1.10,
1.65]``, bold or not). A cell gives the range of the ratio over the categories but RAG, then RAG's ratio in brackets
(RAG copies most), after the label's words (``untrained: 0.96-1.04x (0.99x)``), and ends with a note number: the
notes under the table name each result file, its date and categories.

A category whose cell holds no ratio is named as such, never guessed; a drafter with no ratio at all says "not
measured", as does a class none of whose results has the drafter's row. A result without such a table (a summary in
notes) has no row. A row that names no drafter of DRAFTERS fails the generation: add the drafter here.
"""
from __future__ import annotations

import re

NONE = "not measured"
DRAFTERS = {  # name -> what proposes its tokens, in the table's order
    "ngram": "prompt lookup over prompt + output",
    "draft-model": "a smaller model, same vocabulary",
    "self-draft": "the target's first N layers",
    "medusa": "Medusa heads on the last hidden state",
    "eagle": "one decoder layer over the target's features",
    "combined": "several drafters, trees merged",
}
COMBINED = re.compile(r"^[\w-]+(?:\+[\w-]+)+$")  # ngram+eagle: the combined drafter over those children
LABEL = re.compile(r"^(?P<name>[\w+-]+)(?: \((?P<words>[^()]*)\))?$")
RATIO = re.compile(r"^(\d+(?:\.\d+)?)x?(?![\w.])")


def _ratio(cell) -> float | None:
    found = RATIO.match(str(cell).replace("*", "").strip())
    return float(found[1]) if found else None


def rows(result: dict) -> dict[str, list[tuple[str | None, dict[str, float | None]]]]:
    """drafter -> [(label's words, category -> ratio)] of one result: a list, as a run may measure two variants."""
    columns = result.get("columns") or []
    if not str(columns[0] if columns else "").lower().startswith("vs plain"):
        return {}
    found: dict[str, list] = {}
    for row in result.get("rows", []):
        label = str(row[0]).replace("*", "").strip()
        if label.split(" ")[0] == "plain":  # plain decoding's own rows: tok/s, a second plain run
            continue
        match = LABEL.match(label)
        name = match and ("combined" if COMBINED.match(match["name"]) else match["name"])
        if name not in DRAFTERS:
            raise ValueError(f"{result['file']}: row {row[0]!r} names no drafter of the README's table "
                             f"({', '.join(DRAFTERS)}): add it to docs/drafters_latest.py's DRAFTERS")
        if len(row) != len(columns):
            raise ValueError(f"{result['file']}: row {row[0]!r} has {len(row)} cells for {len(columns)} columns")
        words = match["words"] or (match["name"] if name != match["name"] else None)
        found.setdefault(name, []).append((words, {c: _ratio(v) for c, v in zip(columns[1:], row[1:], strict=True)}))
    return found


def cell(words: str | None, ratios: dict[str, float | None]) -> str:
    """``words: lo-hix (rag)``, from one row's ratios by category (module doc)."""
    rest = {c: x for c, x in ratios.items() if c != "rag"}
    read = [x for x in rest.values() if x is not None]
    rag = ratios.get("rag")
    if not read and rag is None:
        return NONE
    text = " ".join(filter(None, [
        read and (f"{min(read):.2f}-{max(read):.2f}x" if len(read) > 1 else f"{read[0]:.2f}x"),
        rag is not None and (f"({rag:.2f}x)" if read else f"RAG {rag:.2f}x")]))
    unread = [c for c, x in ratios.items() if x is None]
    return (f"{words}: " if words else "") + text + (f", no ratio for {', '.join(unread)}" if unread else "")


def table(results: list[dict], labels: dict[str, str], order, link: str) -> tuple[list[str], list[list[str]],
                                                                                  list[str]]:
    """Columns, rows and notes from ``results`` (``labels``: machine class -> its name, in the columns' order;
    ``order``: a result's sort key, the newest last; ``link``: the folder of the result files, as the page links)."""
    measured: dict[str, list[tuple[dict, dict]]] = {}
    for r in results:
        if r.get("kind", "benchmark") == "benchmark":
            measured.setdefault(r["machine_class"], []).append((r, rows(r)))
    classes = [c for c in labels if any(found for _, found in measured.get(c, []))]
    if not classes:
        raise ValueError("no drafters result has a 'vs plain' table")
    sources: list[dict] = []
    out = []
    for name, what in DRAFTERS.items():
        row = [f"`{name}`", what]
        for c in classes:
            mine = [(r, found[name]) for r, found in measured[c] if name in found]
            if not mine:
                row.append(NONE)
                continue
            r, variants = max(mine, key=lambda m: order(m[0]))
            text = "; ".join(cell(words, ratios) for words, ratios in variants)
            if text.replace(NONE, "").strip("; "):
                sources += [r] if r not in sources else []
                text += f" [{sources.index(r) + 1}]"
            row.append(text)
        out.append(row)
    notes = [f"- [{i}] {r['date']} ({', '.join(r['columns'][1:])}): [{r['file']}]({link}/{r['file']})"
             for i, r in enumerate(sources, 1)]
    return ["name", "what proposes", *(labels[c] for c in classes)], out, notes
