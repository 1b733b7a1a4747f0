"""The GPU page's table of latest results per GPU, built from docs/results (docs/gen_result_tables.py's
``latest_per_gpu`` part): one column per GPU kind, newest run first, each cell from that GPU's newest result of one
benchmark (``e2e``, ``acceptance``, ``speed``, ``goals``, ``kernels``), dated where it predates the GPU's latest run
(by date and run: an earlier run of the same day by its letter, "DATEb").

Its links are relative to docs/gpu/, the page that shows it. A cell with no result says "not measured".

Rows of a result are found by what they measured, never by words of a label that a writer may reword: by the
``row_keys`` benchmarks/gpu_results.py writes (e2e.json's method names, speed.json's model names), where a key
absent means the run did not measure it; in a result written without them, by the exact labels those files used
(``LABELS``), and there a row not found is an error, as is a goal row, a column or the divergence note the result
should hold: a renamed row fails the page's generation instead of showing "not measured".
"""
from __future__ import annotations

import re

RUN_FOLDER = re.compile(r"docs/gpu/([\w.-]+)/")
NONE = "not measured"
# the rows the table reads, as the producer keys them (benchmarks/gpu_results.py: E2E_METHODS, SHAPES)
HF_DYNAMIC, PLAIN_EAGER, PLAIN_GRAPHS, NGRAM_GRAPHS = ("hf_dynamic", "specdec_plain", "specdec_plain_graphs",
                                                      "specdec_ngram_graphs")
SHAPE_8B = "synthetic:llama-3.1-8b"
LABELS = {  # key -> the labels of its row in the committed results written without row_keys
    HF_DYNAMIC: ("transformers, dynamic cache", "transformers `generate()` (dynamic cache)"),
    PLAIN_EAGER: ("specdec plain, eager",),
    PLAIN_GRAPHS: ("specdec plain, CUDA graphs",),
    NGRAM_GRAPHS: ("specdec n-gram, CUDA graphs", "specdec + n-gram, CUDA graphs"),
    SHAPE_8B: ("Llama-3.1-8B",),
}


def _num(cell: str) -> float | None:
    """A cell's number ("1,476" -> 1476.0), None where it is marked (``*``: the result says why) or empty."""
    cell = str(cell).replace(",", "").rstrip("x")
    try:
        return float(cell)
    except ValueError:
        return None


def _row(result: dict, key: str) -> list | None:
    """The row that measured ``key`` (module doc): None where the result's ``row_keys`` lack it."""
    rows, keys = result.get("rows", []), result.get("row_keys")
    if keys is not None:
        if len(keys) != len(rows):
            raise ValueError(f"{result['file']}: {len(keys)} row_keys for {len(rows)} rows")
        return rows[keys.index(key)] if key in keys else None
    found = next((r for r in rows if r[0] in LABELS[key]), None)
    if found is None:
        raise ValueError(f"{result['file']}: no row_keys, and no row labelled {' or '.join(map(repr, LABELS[key]))} "
                         f"({key}): write it with benchmarks/gpu_results.py, or add its label to docs/gpu_latest.py")
    return found


def _goal_row(result: dict, words: str) -> list:
    """The goal whose label holds ``words``: every goals result lists every goal (benchmarks/gpu_goals.py)."""
    found = next((r for r in result.get("rows", []) if words in r[0]), None)
    if found is None:
        raise ValueError(f"{result['file']}: no goal holding {words!r}: a goal renamed in benchmarks/gpu_goals.py? "
                         "Update docs/gpu_latest.py's ROWS")
    return found


def _column(result: dict, name: str) -> int:
    if name not in result.get("columns", []):
        raise ValueError(f"{result['file']}: no column {name!r} (it has: {', '.join(result.get('columns', []))})")
    return result["columns"].index(name)


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}x" if len(values) > 1 else f"{values[0]:.2f}x"


def _run(result: dict) -> tuple[str, int]:
    """When a result was measured: its date, and its run of that day (docs/gen_benchmarks.py orders them so)."""
    return result["date"], result.get("run", 0)


def _stamp(result: dict, latest: dict | None) -> str:
    """Its date, with the day's run as benchmarks/gpu_results.py names the run's files (b for the second, c...);
    the first is said where the latest run is of the same day."""
    date, run = _run(result)
    if run >= 2:
        return date + (chr(ord("a") + run - 1) if run <= 26 else f", run {run}")
    return date + (", the day's first run" if latest and latest["date"] == date else "")


def _goal(result: dict, words: str) -> str:
    row = _goal_row(result, words)
    return f"{row[2]}: {row[3]}" if row[2] else NONE


def plain_embedded(r: dict) -> str:
    graphs, eager, hf = _row(r, PLAIN_GRAPHS), _row(r, PLAIN_EAGER), _row(r, HF_DYNAMIC)
    if not graphs:
        return NONE
    text = f"{graphs[-1]} tok/s" + (f" ({eager[-1]} eager)" if eager else "")
    return text + (f"; transformers (dynamic cache) {hf[-1]}" if hf else "")


def plain_8b(r: dict) -> str:
    row = _row(r, SHAPE_8B)
    if not row:
        return NONE
    cell = {name: row[_column(r, name)] for name in ("batch 1 tok/s", "step / weight-read floor", "c(65)")}
    return (f"{cell['batch 1 tok/s']} tok/s, {cell['step / weight-read floor']}x its weight-read floor; "
            f"c(65) {cell['c(65)']}")


def ngram_suite(r: dict) -> str:
    rows = [row for row in r["rows"] if row[0] != "overall"]
    ratios = [_num(row[_column(r, "over plain")]) for row in rows]
    return f"{_range([x for x in ratios if x is not None])} plain by category" if rows else NONE


def ngram_e2e(r: dict) -> str:
    plain, ngram = _row(r, PLAIN_GRAPHS), _row(r, NGRAM_GRAPHS)
    if not (plain and ngram):
        return NONE
    cats = r["columns"][1:-1]
    pairs = {c: (_num(p), _num(n)) for c, p, n in zip(cats, plain[1:-1], ngram[1:-1], strict=True)}
    ratios = [n / p for p, n in pairs.values() if p and n]
    left = [c for c, (p, n) in pairs.items() if not (p and n)]
    return (f"{_range(ratios)} plain by category" if ratios else NONE) + (
        f" ({', '.join(left)} left out: marked * in the result)" if left else "")


def identity(r: dict) -> str:
    """The note on the outputs that parted from transformers' ("No output diverged ...", "... divergences ...")."""
    found = next((n for n in r.get("notes", []) if "diverge" in n), None)
    if found is None:
        raise ValueError(f"{r['file']}: no note on divergences from transformers' greedy tokens")
    return found


def kernels(r: dict) -> str:
    if r.get("columns"):
        return r["title"]
    return (r.get("notes") or [r["title"]])[0].split(" Every point")[0]


ROWS = [  # label, benchmark, cell
    ("goals ([GPU speed](../gpu-speed.md#goals))", "goals",
     lambda r: (r.get("notes") or [NONE])[0].rstrip(".")),
    ("plain decoding, embedded model, bf16, batch 1, CUDA graphs", "e2e", plain_embedded),
    ("plain decoding, Llama-3.1-8B shape, bf16, batch 1, CUDA graphs", "speed", plain_8b),
    ("oracle chain at tau 3 with EAGLE's drafting, 8B shape", "goals", lambda r: _goal(r, "oracle chain")),
    ("n-gram, acceptance suite (every tree verified, guard off)", "acceptance", ngram_suite),
    ("n-gram, end to end (generate()'s defaults of the day), CUDA graphs", "e2e", ngram_e2e),
    ("greedy identity on CUDA (the device test cases)", "goals", lambda r: _goal(r, "greedy identity")),
    ("bf16 greedy identity vs transformers", "e2e", identity),
    ("kernels", "kernels", kernels),
]


def table(results: list[dict], labels: dict[str, str], order) -> tuple[list[str], list[list[str]]]:
    """Columns and rows from ``results`` (those of GPU classes count; ``labels``: machine class -> its name;
    ``order``: a result's sort key, the newest last, as the benchmarks page orders them)."""

    def _newest(some: list[dict]) -> dict:
        return max(some, key=order)

    by_gpu: dict[str, list[dict]] = {}
    for r in results:
        if r["machine_class"].startswith("gpu-") and r.get("kind", "benchmark") == "benchmark":
            by_gpu.setdefault(r["machine_class"], []).append(r)
    if not by_gpu:
        raise ValueError("no GPU result")
    gpus = sorted(by_gpu, key=lambda g: _newest(by_gpu[g])["date"], reverse=True)
    latest = {}
    for g in gpus:
        runs = [r for r in by_gpu[g] if RUN_FOLDER.search(r.get("conditions", ""))]
        run = _newest(runs) if runs else None
        latest[g] = run and (run, RUN_FOLDER.search(run["conditions"])[1])
    rows = [["latest run"] + [f"[{latest[g][0]['date']}]({latest[g][1]}/report.md)" if latest[g] else NONE
                              for g in gpus]]
    for label, benchmark, cell in ROWS:
        row = [label]
        for g in gpus:
            mine = [r for r in by_gpu[g] if r["benchmark"] == benchmark]
            if not mine:
                row.append(NONE)
                continue
            r = _newest(mine)
            text = cell(r).rstrip(".")
            dated = latest[g] is None or _run(r) != _run(latest[g][0])
            row.append(text + (f" ({_stamp(r, latest[g] and latest[g][0])})" if dated and text != NONE else ""))
        rows.append(row)
    return [""] + [labels[g].removeprefix("GPU, ") for g in gpus], rows
