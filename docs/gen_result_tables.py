"""Fill the result tables that docs pages quote from docs/results/*.json, so no page holds a hand copy.

A page marks a copy of one result file's table as a generated region::

    <!-- generated: results/2026-11-28-cpu-intel-avx512-bit-exact.json table -->
    (the table, written here)
    <!-- end generated -->

A result's further tables (its ``tables``, each with a ``name``) are marked ``table NAME``, e.g.
``<!-- generated: results/FILE.json table mt_bench_ngram -->``. A name with ``*`` takes the newest result that
matches it (``results/*-gpu-h200-goals.json table``), so committing a newer result updates the page.
``results/*-gpu-*.json latest_per_gpu`` is the GPU page's table of each GPU's latest results (docs/gpu_latest.py),
``results/*-drafters*.json drafters_per_machine`` the README's table of each drafter's newest speedups per machine
class (docs/drafters_latest.py). Besides the docs pages, README.md is filled too (its links start at docs/).

Run by hand after changing a result (``python docs/gen_result_tables.py``); ``--check`` exits 1 when a page's
region differs from what its result gives (tests/test_docs.py runs it). mkdocs also loads this file as a hook and
fills the regions at build time. The table is rendered as docs/gen_benchmarks.py renders it on the benchmarks page.
"""
from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import os
import posixpath
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
REGION = re.compile(r"<!-- generated: results/(?P<file>[\w.*-]+\.json) (?P<part>\w+)(?: (?P<name>\w+))? -->\n"
                    r"(?P<body>.*?)<!-- end generated -->", re.S)
START, END = "<!-- generated:", "<!-- end generated -->"


# docs/gen_benchmarks.py, the benchmarks page's generator: its results, table rendering and sibling loader (docs/ is
# no package, so this one file is loaded by its path; everything else through its loader)
_spec = importlib.util.spec_from_file_location("gen_benchmarks", DOCS / "gen_benchmarks.py")
_GEN = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_GEN)
_LATEST = _GEN.sibling("gpu_latest")
_DRAFTERS = _GEN.sibling("drafters_latest")
PARTS = ("table", "latest_per_gpu", "drafters_per_machine")


def render_part(result: dict | list[dict], part: str, name: str | None = None, link: str = "results") -> str:
    """What a region holds: ``table``, the result's columns and rows, or ``table NAME``, its further table NAME;
    ``latest_per_gpu``, the GPU page's table from a list of results; ``drafters_per_machine``, the README's drafter
    table and its notes, which link the result files in the folder ``link`` (as the page sees docs/results)."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r} (known: {', '.join(PARTS)})")
    if part == "drafters_per_machine":
        columns, rows, notes = _DRAFTERS.table(result if isinstance(result, list) else [result],
                                               _GEN.MACHINE_CLASSES, _GEN._order, link)
        return "\n" + "\n".join([*_GEN._table(columns, rows), "", *notes]) + "\n\n"
    if part == "latest_per_gpu":
        columns, rows = _LATEST.table(result if isinstance(result, list) else [result], _GEN.MACHINE_CLASSES,
                                     _GEN._order)
        return "\n" + "\n".join(_GEN._table(columns, rows)) + "\n\n"
    if isinstance(result, list):  # a name with *: the newest match
        result = max(result, key=_GEN._order)
    if name is not None:
        named = {t["name"]: t for t in result.get("tables", [])}
        if name not in named:
            raise ValueError(f"{result['file']} has no table {name!r} (it has: {', '.join(named) or 'none'})")
        result = named[name]
    elif not result.get("columns"):
        raise ValueError(f"{result['file']} has no table")
    return "\n" + "\n".join(_GEN._table(result["columns"], result["rows"])) + "\n\n"


def fill(text: str, results: dict[str, dict], where: str = "page", link: str = "results") -> str:
    """``text`` with every region rewritten from ``results`` (file name -> result); ``link``: docs/results as the
    page links to it."""
    if text.count(START) != text.count(END) or text.count(START) != len(REGION.findall(text)):
        raise ValueError(f"{where}: a generated region is malformed or has no end marker ({END})")

    def region(match: re.Match) -> str:
        name = match["file"]
        found = [results[f] for f in sorted(results) if fnmatch.fnmatchcase(f, name)] if "*" in name else \
            [results[name]] if name in results else []
        if not found:
            raise ValueError(f"{where}: no result file docs/results/{name}")
        try:
            body = render_part(found if "*" in name else found[0], match["part"], match["name"], link)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        marker = " ".join(filter(None, [f"results/{name}", match["part"], match["name"]]))
        return f"<!-- generated: {marker} -->\n{body}{END}"

    return REGION.sub(region, text)


def pages() -> list[Path]:
    """The pages with a generated region: docs/**/*.md and README.md."""
    found = [DOCS.parent / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in found if p.exists() and START in p.read_text()]


def _by_file() -> dict[str, dict]:
    return {r["file"]: r for r in _GEN.load_results()}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: a page's generated regions are always filled from the results."""
    link = posixpath.relpath("results", posixpath.dirname(page.file.src_uri) or ".")
    return fill(markdown, _by_file(), page.file.src_uri, link) if START in markdown else markdown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 when a page's region is out of date (writes nothing)")
    check = ap.parse_args(argv).check
    try:
        results = _by_file()
    except ValueError as err:  # a malformed result file: one line naming it
        print(f"docs/gen_result_tables.py: docs/results: {err}", file=sys.stderr)
        return 2
    stale = []
    for page in pages():
        text = page.read_text()
        link = os.path.relpath(DOCS / "results", page.parent).replace(os.sep, "/")
        try:
            new = fill(text, results, str(page.relative_to(DOCS.parent)), link)
        except ValueError as err:  # a region naming a result file or table that is gone, or a broken marker
            print(f"docs/gen_result_tables.py: {err}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(str(page.relative_to(DOCS.parent)))
            if not check:
                page.write_text(new)
    if stale and check:
        print(f"out of date: {', '.join(stale)}: run python docs/gen_result_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
