"""The documentation stays whole: the benchmarks page and the result tables other pages quote are what the
committed results give, every page is in the navigation, the API reference lists every registered drafter, each
drafter's page names its options and their defaults, CI runs the README's test command, module docstrings stay
short and undated. (`mkdocs build --strict` in .ci/run is the full check; these take well under a second.)"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
from pathlib import Path

import pytest
from specdec.drafters.registry import BUILTIN, drafter_class, option_names

from tests.script_loading import load_file

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _gen_benchmarks():
    return load_file(DOCS / "gen_benchmarks.py")


def test_benchmarks_page_is_generated_from_the_results():
    gen = _gen_benchmarks()
    results = gen.load_results()
    assert results, "no results under docs/results"
    assert (DOCS / "benchmarks.md").read_text() == gen.render(results), "run: python docs/gen_benchmarks.py"


def test_result_tables_on_other_pages_are_generated_from_the_results():
    gen = load_file(DOCS / "gen_result_tables.py")
    assert gen.pages(), "no page has a generated region"
    assert gen.main(["--check"]) == 0, "run: python docs/gen_result_tables.py"


def test_a_stale_or_broken_result_region_is_caught(tmp_path, monkeypatch):
    gen = load_file(DOCS / "gen_result_tables.py")
    results = {"r.json": dict(file="r.json", columns=["a", "b"], rows=[["x", "1.5"]])}
    region = "<!-- generated: results/r.json table -->\n{}<!-- end generated -->"
    page = "Text.\n\n" + region.format("\n| a | b |\n|---|---|\n| x | 1.4 |\n\n") + "\n\nMore."
    filled = gen.fill(page, results)
    assert "| x | 1.5 |" in filled and "1.4" not in filled and filled.endswith("-->\n\nMore.")
    assert gen.fill(filled, results) == filled
    for broken, why in [(page.replace("r.json", "s.json"), "no result file"),
                        (page.replace(" table -->", " notes -->"), "unknown part"),
                        (page.replace("<!-- end generated -->", ""), "malformed"),
                        (page + "\n<!-- end generated -->\n", "malformed")]:  # a stray end: one region, two ends
        with pytest.raises(ValueError, match=why):
            gen.fill(broken, results)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text(page)
    monkeypatch.setattr(gen, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(gen, "_by_file", lambda: results)
    assert gen.main(["--check"]) == 1 and (tmp_path / "docs" / "p.md").read_text() == page
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0


def test_a_results_further_table_fills_its_named_region_and_shows_on_the_benchmarks_page():
    gen = load_file(DOCS / "gen_result_tables.py")
    extra = dict(name="per_turn", columns=["turn", "x"], rows=[["1", "2.5"]])
    result = dict(date="2026-01-01", machine_class="cpu-avx512", title="T", machine="m", benchmark="b", command="c",
                  file="r.json", columns=["a"], rows=[["main"]], tables=[extra])
    page = "<!-- generated: results/r.json table per_turn -->\nstale\n<!-- end generated -->"
    filled = gen.fill(page, {"r.json": result})
    assert filled == "<!-- generated: results/r.json table per_turn -->\n\n| turn | x |\n|---|---|\n| 1 | 2.5 |\n\n" \
        "<!-- end generated -->"
    with pytest.raises(ValueError, match="has no table 'per_tun' \\(it has: per_turn\\)"):
        gen.fill(page.replace("per_turn", "per_tun"), {"r.json": result})
    lines = _gen_benchmarks()._result(result, "####")
    assert "| main |" in lines and "| 1 | 2.5 |" in lines


def test_a_starred_region_takes_the_newest_result_and_the_gpu_table_each_gpus_latest():
    """A newer run's files update the page: ``*`` picks the newest match, and the GPU page's table takes each GPU's
    newest result of each kind, dates a cell older than that GPU's latest run and says what none measured."""
    gen = load_file(DOCS / "gen_result_tables.py")

    def result(file, date, cls, benchmark, **kw):
        return dict(file=file, date=date, machine_class=cls, benchmark=benchmark, title=file, **kw)

    e2e = dict(columns=["tok/s", "chat", "all"], conditions="Report: docs/gpu/KIND-DATE/.",
               row_keys=["specdec_plain_graphs", "specdec_ngram_graphs"], notes=["No output diverged."])
    results = {r["file"]: r for r in [
        result("2026-01-01-gpu-h200-goals.json", "2026-01-01", "gpu-h200", "goals", columns=["g"], rows=[["old"]],
               notes=["1 of the 2 goals met."]),
        result("2026-02-01-gpu-h200-goals.json", "2026-02-01", "gpu-h200", "goals", columns=["g", "t", "m", "v"],
               rows=[["new oracle chain", "t", "", "not measured"], ["new greedy identity", "t", "", "not measured"]],
               notes=["2 of the 2 goals met."]),
        result("2026-02-01-gpu-h200-e2e.json", "2026-02-01", "gpu-h200", "e2e", **dict(
            e2e, rows=[["specdec plain, CUDA graphs", "500.0", "510.0"], ["specdec n-gram, CUDA graphs", "600.0",
                                                                            "600.0"]],
            conditions="Report: docs/gpu/h200-2026-02-01/.")),
        result("2026-01-15-gpu-h100-e2e.json", "2026-01-15", "gpu-h100", "e2e", **dict(
            e2e, rows=[["specdec plain, CUDA graphs", "300.0", "300.0"], ["specdec n-gram, CUDA graphs", "150.0*",
                                                                            "150.0*"]],
            conditions="Report: docs/gpu/h100-2026-01-15/.")),
        result("2026-01-20-gpu-h100-kernels.json", "2026-01-20", "gpu-h100", "kernels", notes=["Fast. Every point"]),
        result("2026-03-01-cpu-avx512-eagle-gpu-layer.json", "2026-03-01", "cpu-avx512", "eagle"),
    ]}
    goals = gen.fill("<!-- generated: results/*-gpu-h200-goals.json table -->\n<!-- end generated -->", results)
    assert "| new oracle chain |" in goals and "old" not in goals
    page = gen.fill("<!-- generated: results/*-gpu-*.json latest_per_gpu -->\n<!-- end generated -->", results)
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in page.splitlines() if line[:2] == "| "]
    rows = {c[0]: c[1:] for c in cells}
    assert rows[""] == ["NVIDIA H200", "NVIDIA H100"]  # newest run first; the CPU result is no GPU's
    assert rows["latest run"] == ["[2026-02-01](h200-2026-02-01/report.md)", "[2026-01-15](h100-2026-01-15/report.md)"]
    assert rows["goals ([GPU speed](../gpu-speed.md#goals))"] == ["2 of the 2 goals met", "not measured"]
    assert rows["plain decoding, embedded model, bf16, batch 1, CUDA graphs"] == ["510.0 tok/s", "300.0 tok/s"]
    assert rows["n-gram, end to end (generate()'s defaults of the day), CUDA graphs"] == [
        "1.20x plain by category", "not measured (chat left out: marked * in the result)"]
    assert rows["kernels"] == ["not measured", "Fast (2026-01-20)"]


def _drafters(file: str, date: str, cls: str = "cpu-avx512", **kw) -> dict:
    return dict(file=file, date=date, machine_class=cls, benchmark="drafters", title=file,
                columns=["vs plain", "chat", "qa", "rag"]) | kw


DRAFTERS_REGION = "<!-- generated: results/*-drafters*.json drafters_per_machine -->\n<!-- end generated -->"


def test_the_readme_drafter_table_takes_each_drafters_newest_result_per_machine_class():
    """Each cell comes from the newest result of its class that has the drafter's row: a newer run of n-gram alone
    leaves EAGLE's cell on the older run; a summary without a "vs plain" table, or a history result, counts for none.
    A cell whose ratio cannot be read is named, never guessed."""
    gen = load_file(DOCS / "gen_result_tables.py")
    old = _drafters("2026-01-01-cpu-avx512-drafters.json", "2026-01-01", rows=[
        ["plain tok/s", "30.0", "31.0", "25.0"], ["ngram", "1.10 (1.2)", "1.20 (1.3)", "2.00 (3.0)"],
        ["eagle (quick recipe)", "1.05 (1.1) [1.00, 1.10]", "0.95 [0.90, 1.00]", "1.01"],
        ["ngram+eagle", "1.15", "1.25", "1.90"]])
    new = _drafters("2026-02-01-cpu-avx512-drafters-ngram.json", "2026-02-01", run=1, rows=[
        ["plain (again)", "1.00 [0.98, 1.02]", "1.01", "0.99"],
        ["**ngram**", "1.30 (1.4) [1.20, 1.40]", "n/a", "**2.50 (3.6)** [2.30, 2.70]"]])
    intel = _drafters("2026-01-15-cpu-intel-avx512-drafters.json", "2026-01-15", "cpu-intel-avx512",
                      columns=["vs plain", "chat", "code"], rows=[["ngram", "1.40x", "1.60x"], ["self-draft", "-", ""]])
    ignored = [_drafters("2026-03-01-cpu-avx512-drafters.json", "2026-03-01", columns=None, notes=["ngram 9.9x"]),
               _drafters("2026-03-02-cpu-avx512-drafters-history.json", "2026-03-02", kind="history",
                         rows=[["ngram", "9.90", "9.90", "9.90"]]),
               _drafters("2026-03-03-cpu-no-avx512-drafters.json", "2026-03-03", "cpu-no-avx512",
                         columns=["tok/s", "chat"], rows=[["ngram", "9.9"]])]
    results = {r["file"]: r for r in [old, new, intel, *ignored]}
    readme = gen.fill(DRAFTERS_REGION, results, "README.md", "docs/results")
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in readme.splitlines() if line[:2] == "| "]
    rows = {c[0]: c[2:] for c in cells}
    assert rows["name"] == ["CPU, 2 cores with AVX-512 (AMD EPYC)", "CPU, 2 cores with AVX-512 (Intel Xeon)"]
    assert rows["`ngram`"] == ["1.30x (2.50x), no ratio for qa [1]", "1.40-1.60x [2]"]
    assert rows["`eagle`"] == ["quick recipe: 0.95-1.05x (1.01x) [3]", "not measured"]
    assert rows["`combined`"] == ["ngram+eagle: 1.15-1.25x (1.90x) [3]", "not measured"]
    assert rows["`self-draft`"] == ["not measured", "not measured"]  # a row with no ratio names no source
    assert "- [1] 2026-02-01 (chat, qa, rag): [2026-02-01-cpu-avx512-drafters-ngram.json]" \
        "(docs/results/2026-02-01-cpu-avx512-drafters-ngram.json)" in readme.splitlines()
    assert "9.9" not in readme and "[4]" not in readme
    with pytest.raises(ValueError, match=r"row 'mtp' names no drafter of the README's table"):
        gen.fill(DRAFTERS_REGION, {"r-drafters.json": _drafters("r-drafters.json", "2026-01-01",
                                                                   rows=[["mtp", "1.1", "1.2", "1.3"]])})


def test_the_readme_is_regenerated_when_a_newer_drafters_result_is_committed(tmp_path, monkeypatch):
    """README.md is one of the generated pages, its links start at docs/; --check fails once a newer result lands."""
    gen = load_file(DOCS / "gen_result_tables.py")
    assert REPO / "README.md" in gen.pages()
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"# x\n\n{DRAFTERS_REGION}\n")
    results = {"2026-01-01-cpu-avx512-drafters.json": _drafters(
        "2026-01-01-cpu-avx512-drafters.json", "2026-01-01", rows=[["ngram", "1.10", "1.20", "2.00"]])}
    monkeypatch.setattr(gen, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(gen, "_by_file", lambda: results)
    assert gen.pages() == [tmp_path / "README.md"]
    assert gen.main(["--check"]) == 1 and gen.main([]) == 0 and gen.main(["--check"]) == 0
    assert "1.10-1.20x (2.00x) [1]" in (tmp_path / "README.md").read_text()
    assert "(docs/results/2026-01-01-cpu-avx512-drafters.json)" in (tmp_path / "README.md").read_text()
    results["2026-02-01-cpu-avx512-drafters.json"] = _drafters(
        "2026-02-01-cpu-avx512-drafters.json", "2026-02-01", rows=[["ngram", "1.30", "1.40", "2.20"]])
    assert gen.main(["--check"]) == 1 and gen.main([]) == 0
    assert "1.30-1.40x (2.20x) [1]" in (tmp_path / "README.md").read_text()


def _gpu_table(*results: dict) -> dict[str, list[str]]:
    """The GPU page's table from ``results`` (file names given), as label -> cells."""
    gen = load_file(DOCS / "gen_result_tables.py")
    page = gen.render_part(list(results), "latest_per_gpu")
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in page.splitlines() if line[:2] == "| "]
    return {c[0]: c[1:] for c in cells}


def _gpu_e2e(**kw) -> dict:
    return dict(file="2026-02-01-gpu-h200-e2e.json", date="2026-02-01", machine_class="gpu-h200", benchmark="e2e",
                title="e2e", conditions="Report: docs/gpu/h200-2026-02-01/.", columns=["tok/s", "chat", "all"],
                notes=["Every one of the 2 divergences from transformers' greedy tokens is a near-tie."]) | kw


PLAIN = "plain decoding, embedded model, bf16, batch 1, CUDA graphs"
NGRAM = "n-gram, end to end (generate()'s defaults of the day), CUDA graphs"


def test_the_gpu_table_finds_rows_by_the_key_the_writer_gave_them_not_by_their_labels():
    """Rows were found by words of their labels ("plain", "CUDA graphs"): a reworded label showed "not measured".
    They are found by row_keys; a key a result lacks is a row its run did not measure. The note of a run whose
    outputs all matched transformers' ("No output diverged") is no "divergence" and showed "not measured" too."""
    rows = _gpu_table(_gpu_e2e(rows=[["eager, no drafter", "50.0", "51.0"], ["graphs, no drafter", "500.0", "510.0"],
                                     ["graphs, prompt lookup", "600.0", "612.0"]],
                               row_keys=["specdec_plain", "specdec_plain_graphs", "specdec_ngram_graphs"],
                               notes=["No output diverged from transformers' greedy tokens."]))
    assert rows[PLAIN] == ["510.0 tok/s (51.0 eager)"]  # no hf_dynamic key: transformers was not run
    assert rows[NGRAM] == ["1.20x plain by category"]
    assert rows["bf16 greedy identity vs transformers"] == ["No output diverged from transformers' greedy tokens"]
    assert _gpu_table(_gpu_e2e(rows=[["x", "1.0", "1.0"]], row_keys=["specdec_plain"]))[PLAIN] == ["not measured"]


def test_a_cell_from_an_earlier_run_of_the_latest_runs_day_is_dated_with_its_run():
    """Only dates were compared: a cell from the day's second run showed undated beside the day's third."""
    goals = dict(file="2026-02-01c-gpu-h200-goals.json", date="2026-02-01", run=3, machine_class="gpu-h200",
                 benchmark="goals", title="goals", conditions="Report: docs/gpu/h200-2026-02-01c/report.md.",
                 columns=["goal", "target", "measured", "verdict"], notes=["0 of the 2 goals met."],
                 rows=[["oracle chain", "t", "", "not measured"], ["greedy identity", "t", "", "not measured"]])
    e2e = _gpu_e2e(file="2026-02-01b-gpu-h200-e2e.json", run=2, rows=[["p", "500.0", "510.0"]],
                   row_keys=["specdec_plain_graphs"], conditions="Report: docs/gpu/h200-2026-02-01b/.")
    rows = _gpu_table(goals, e2e)
    assert rows["latest run"] == ["[2026-02-01](h200-2026-02-01c/report.md)"]
    assert rows[PLAIN] == ["510.0 tok/s (2026-02-01b)"]
    first = {k: v for k, v in e2e.items() if k != "run"} | {"file": "2026-02-01-gpu-h200-e2e.json"}
    assert _gpu_table(goals, first)[PLAIN] == ["510.0 tok/s (2026-02-01, the day's first run)"]
    assert _gpu_table(dict(goals, run=2), e2e)[PLAIN] == ["510.0 tok/s"]  # the latest run's own: undated


@pytest.mark.parametrize("result, refusal", [
    # written without row_keys (the committed files before them): a row not labelled as those files labelled it
    (_gpu_e2e(rows=[["specdec plain (CUDA graphs)", "500.0", "510.0"]]),
     r"2026-02-01-gpu-h200-e2e.json: no row_keys, and no row labelled 'specdec plain, CUDA graphs'"),
    (_gpu_e2e(rows=[["specdec plain, CUDA graphs", "500.0", "510.0"]], row_keys=[]), "0 row_keys for 1 rows"),
    (_gpu_e2e(rows=[["a", "1", "1"]], row_keys=["specdec_plain_graphs"], notes=[]), "no note on divergences"),
    (dict(file="2026-02-01-gpu-h200-goals.json", date="2026-02-01", machine_class="gpu-h200", benchmark="goals",
          title="goals", columns=["goal", "target", "measured", "verdict"], notes=["1 of the 1 goals met."],
          rows=[["greedy identity on CUDA", "every case passes", "40 passed, 0 failed", "met"]]),
     "2026-02-01-gpu-h200-goals.json: no goal holding 'oracle chain'"),
    (dict(file="2026-02-01-gpu-h200-speed.json", date="2026-02-01", machine_class="gpu-h200", benchmark="speed",
          title="speed", columns=["shape", "tok/s at batch 1"], rows=[["Llama-3.1-8B", "190.0"]],
          row_keys=["synthetic:llama-3.1-8b"]), "no column 'batch 1 tok/s'"),
])
def test_a_row_the_gpu_table_cannot_find_fails_the_page_instead_of_showing_not_measured(result, refusal):
    with pytest.raises(ValueError, match=refusal):
        _gpu_table(result)


def test_benchmarks_page_shows_the_latest_result_per_machine_class(tmp_path):
    gen = _gen_benchmarks()
    for name, date, title in [("a", "2026-01-01", "OLD RUN"), ("b", "2026-02-01", "NEW RUN")]:
        (tmp_path / f"{name}.json").write_text(
            f'{{"date": "{date}", "machine_class": "cpu-avx512", "title": "{title}", "machine": "m", '
            '"benchmark": "drafters", "command": "python x.py"}')
    page = gen.render(gen.load_results(tmp_path))
    latest, history = page.split("## History")
    assert "NEW RUN" in latest and "OLD RUN" not in latest
    assert "NEW RUN" in history and "OLD RUN" in history


def test_check_names_the_result_files_the_page_shows_otherwise(tmp_path, monkeypatch, capsys):
    """--check said only that docs/benchmarks.md was out of date, not which result file (one a user edited, added
    or removed) it shows otherwise; exit status 1 either way, and 0 with the page as the results give it."""
    gen = _gen_benchmarks()
    for name, date in (("a", "2026-01-01"), ("b", "2026-02-01"), ("c", "2026-03-01")):
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(
            date=date, machine_class="cpu-avx512", title=name.upper(), machine="m", benchmark=name,
            command="python x.py", columns=["x"], rows=[["1"]])))
    page = tmp_path / "benchmarks.md"
    page.write_text(before := gen.render(gen.load_results(tmp_path)))
    real = gen.load_results
    monkeypatch.setattr(gen, "load_results", lambda: real(tmp_path))
    monkeypatch.setattr(gen, "PAGE", page)
    assert gen.main(["--check"]) == 0 and capsys.readouterr().err == ""
    (tmp_path / "b.json").write_text((tmp_path / "b.json").read_text().replace('"1"', '"2"'))
    (tmp_path / "c.json").unlink()
    assert gen.main(["--check"]) == 1
    assert capsys.readouterr().err == ("docs/benchmarks.md is out of date (it shows otherwise than docs/results gives "
                                       "b.json; it shows c.json, no longer in docs/results): run python "
                                       "docs/gen_benchmarks.py\n")
    assert page.read_text() == before  # --check writes nothing


def test_two_results_that_tie_for_latest_are_refused(tmp_path):
    """Same class, benchmark and date, no run: the page could show only one of them as the latest."""
    gen = _gen_benchmarks()
    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(
            f'{{"date": "2026-01-01", "machine_class": "cpu-avx512", "title": "{name}", "machine": "m", '
            '"benchmark": "drafters", "command": "python x.py"}')
    with pytest.raises(ValueError, match="a.json and b.json"):
        gen.render(gen.load_results(tmp_path))
    (tmp_path / "b.json").write_text((tmp_path / "b.json").read_text().replace('"drafters"', '"drafters", "run": 2'))
    latest = gen.render(gen.load_results(tmp_path)).split("## History")[0]
    assert "#### b" in latest and "#### a" not in latest  # a run orders them


_RESULT = ('"machine_class": "cpu-avx512", "title": "T", "machine": "m", "benchmark": "drafters", '
           '"command": "python x.py"')


@pytest.mark.parametrize("fields, refusal", [
    # the latest result is the greatest date as a string: an unpadded older date sorted after the newest
    ('"date": "2026-12-4"', "date '2026-12-4' is not an ISO date"),
    ('"date": 20261204', "date 20261204 is not an ISO date"),
    ('"date": "2026-02-30"', "no day of the calendar"),
    ('"date": "2026-12-04", "run": "b"', "run 'b' is not an integer"),
    ('"date": "2026-12-04", "run": true', "run True is not an integer"),  # a bool is an int to Python
    ('"date": "2026-12-04", "columns": ["a", "b", "c"], "rows": [["1"]]', "row 0 has 1 cells for 3 columns"),
    ('"date": "2026-12-04", "columns": ["a", "b"]', "needs both columns and rows"),
    ('"date": "2026-12-04", "tables": [{"name": "t", "columns": ["a"], "rows": [["1", "2"]]}]',
     r"tables\[0\] row 0 has 2 cells for 1 columns"),
    ('"date": "2026-12-04", "notes": ["a",],', "not valid JSON"),
    # a traceback when the page was rendered, or (a kind mistyped) a result left out of the latest runs unsaid
    ('"date": "2026-12-04", "command": 5', "command 5 is neither a string nor a list of strings"),
    ('"date": "2026-12-04", "command": ["python x.py", 3]', "neither a string nor a list of strings"),
    ('"date": "2026-12-04", "notes": 5', "notes 5 is neither a string nor a list of strings"),
    ('"date": "2026-12-04", "kind": "histroy"', "kind 'histroy' is not one of benchmark, history"),
])
def test_a_malformed_result_file_is_refused_in_one_line_naming_it(tmp_path, fields, refusal):
    """A malformed file rendered as it was (a short row, a table without rows), crashed with a traceback that named
    no file, or was ordered wrongly (an unpadded date became a class's latest result)."""
    gen = _gen_benchmarks()
    (tmp_path / "2026-12-04-zz.json").write_text(f"{{{_RESULT}, {fields}}}")
    with pytest.raises(ValueError, match=refusal) as refused:
        gen.load_results(tmp_path)
    assert str(refused.value).startswith("2026-12-04-zz.json: ") and "\n" not in str(refused.value)


def test_the_generators_refuse_a_malformed_result_or_a_lost_one_in_one_line(tmp_path, monkeypatch, capsys):
    """Run as scripts, both generators ended in a traceback on a malformed result file, and gen_result_tables.py on
    a region whose result file was removed: now one line naming the file, exit status 2, nothing written."""
    bench, tables = _gen_benchmarks(), load_file(DOCS / "gen_result_tables.py")
    (tmp_path / "2026-12-04-zz.json").write_text(f"{{{_RESULT}, \"date\": \"2026-12-4\"}}")
    for gen, module in ((bench, bench), (tables, tables._GEN)):
        real = module.load_results
        monkeypatch.setattr(module, "load_results", lambda real=real: real(tmp_path))
        for argv in (["--check"], []):
            assert gen.main(argv) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "2026-12-04-zz.json: date '2026-12-4' is not an ISO date" in err
    (tmp_path / "docs").mkdir()
    page = "<!-- generated: results/gone.json table -->\nold\n<!-- end generated -->\n"
    (tmp_path / "docs" / "p.md").write_text(page)
    monkeypatch.setattr(tables, "DOCS", tmp_path / "docs")
    monkeypatch.setattr(tables, "_by_file", lambda: {})
    assert tables.main([]) == 2 and (tmp_path / "docs" / "p.md").read_text() == page
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "docs/p.md: no result file docs/results/gone.json" in err


def test_the_benchmarks_check_fails_on_a_stale_page_and_writes_nothing(tmp_path, monkeypatch):
    gen = _gen_benchmarks()
    page = tmp_path / "benchmarks.md"
    monkeypatch.setattr(gen, "PAGE", page)
    fresh = gen.render(gen.load_results())
    for stale in (fresh.replace("## History", "## Old history"), fresh + "\n"):
        page.write_text(stale)
        assert gen.main(["--check"]) == 1 and page.read_text() == stale
    page.write_text(fresh)
    assert gen.main(["--check"]) == 0


def test_a_cell_holding_a_pipe_or_a_newline_stays_one_cell():
    # "|" would split the cell in two and a newline would end the row: escaped, and a space
    assert _gen_benchmarks()._table(["a", "b"], [["x|y", "one\ntwo"]]) == [
        "| a | b |", "|---|---|", "| x\\|y | one two |"]


def test_a_results_note_renders_whole_given_as_one_string_or_a_list():
    gen = _gen_benchmarks()
    base = dict(date="2026-01-01", machine_class="cpu-avx512", title="T", machine="m", benchmark="b", command="c",
                file="r.json")
    for notes in ("one note, whole.", ["one note, whole."]):
        lines = gen._result(dict(base, notes=notes), "####")
        assert "- one note, whole." in lines and "- o" not in lines  # never a bullet per character


def test_a_results_command_is_a_bash_block_only_where_a_reader_can_run_it():
    """A description, or a script that is not in the repo, is a line of text saying so, never a block to copy; the
    runnable commands around it stay blocks, in order."""
    gen = _gen_benchmarks()
    base = dict(date="2026-01-01", machine_class="cpu-avx512", title="T", machine="m", benchmark="b", file="r.json")
    lines = gen._result(dict(base, command=["python benchmarks/bench_ngram_cpu.py --prompts 3",
                                            "python eagle_batch.py 3 <layer> *all*: generate() at batch 8",
                                            "specdec eval replay bound --record run.json"]), "####")
    text = "How it was measured: python eagle_batch.py 3 &lt;layer> \\*all\\*: generate() at batch 8 " \
        "(`eagle_batch.py` is not in the repo)"
    assert lines[lines.index("```bash"):] == ["```bash", "python benchmarks/bench_ngram_cpu.py --prompts 3", "```", "",
                                              text, "", "```bash", "specdec eval replay bound --record run.json",
                                              "```", ""]
    lines = gen._result(dict(base, command="the cost model's calibration, context 128"), "####")
    assert gen._commands(["python benchmarks/no_a.py && python benchmarks/no_b.py"])[0].endswith(
        "(`benchmarks/no_a.py`, `benchmarks/no_b.py` are not in the repo)")
    assert "```bash" not in lines and "How it was measured: the cost model's calibration, context 128" in lines


def _nav_pages() -> set[str]:
    text = (REPO / "mkdocs.yml").read_text()
    nav = text.split("\nnav:", 1)[1]
    return set(re.findall(r"([\w./-]+\.md)\s*$", nav, flags=re.M))


def test_every_page_is_in_the_navigation():
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    nav = _nav_pages()
    assert nav <= pages, f"navigation names missing pages: {sorted(nav - pages)}"
    assert pages <= nav, f"pages not reachable from the navigation: {sorted(pages - nav)}"


def test_api_reference_lists_generate_config_contract_and_every_registered_drafter():
    api = (DOCS / "reference" / "api.md").read_text()
    # the reference reads drafters/ statically as the package `drafters` (installed as specdec.drafters)
    documented = {line.split(":::", 1)[1].strip() for line in api.splitlines() if line.startswith(":::")}
    for target in BUILTIN.values():
        module, _, cls = target.partition(":")
        assert f"{module.removeprefix('specdec.')}.{cls}" in documented, f"{cls} is not in the API reference"
    assert {"specdec.generate.generate", "specdec.generation_config.GenerationConfig", "drafters.base"} <= documented


def _option_defaults(cls: type) -> dict:
    """Each option ``cls(**options)`` takes and the default the code gives it (constructor, then options_config)."""
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    defaults = {p.name: p.default for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    for f in dataclasses.fields(getattr(cls, "options_config", None) or ()):
        defaults.setdefault(f.name, f.default)
    return defaults


def _documented_default(text: str):
    """A table's default cell as a value: `"auto"`, `()`, 0.05, `False`; the text itself when it is none."""
    text = text.strip().strip("`")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_a_drafters_page_documents_each_option_it_takes_with_the_codes_default(name):
    """Every option a drafter takes is on its page (its options table, or its Options section where there is none),
    a Python-only one said to be so; every option in the table is taken; a default stated for an option the code
    gives a value to is that value. ngram's and combined's config= and combined's verify_cost= were on no page."""
    cls = drafter_class(name)
    page = (DOCS / "drafters" / f"{name}.md").read_text()
    section = page.split("## Options", 1)[-1].split("\n## ", 1)[0]  # the whole page where it has no such section
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    defaults = _option_defaults(cls)
    assert option_names(cls) == set(defaults)
    if rows:
        named = {option: row for row in rows for option in re.findall(r"`(\w+)`", row[0])}
        assert set(named) <= set(defaults), f"{name}.md names options the drafter refuses: {set(named) - set(defaults)}"
    else:  # options in prose: `num_layers`, `cuda_graphs=True`
        named = {option: [section] for option in re.findall(r"`(\w+)[`=]", section)}
    assert set(defaults) <= set(named), f"{name}.md leaves out options: {sorted(set(defaults) - set(named))}"
    for option in getattr(cls, "python_only_options", ()):
        assert "Python only" in named[option][-1], f"{name}.md: {option} is not said to be Python only"
    for row in rows:
        options, stated = re.findall(r"`(\w+)`", row[0]), row[1].split(", ")
        if len(stated) != len(options):  # "the checkpoint's; 5, 8, 16 for ...": no value per option
            continue
        for option, text in zip(options, stated, strict=True):
            code = defaults[option]
            if code is not None and code is not inspect.Parameter.empty and code is not dataclasses.MISSING:
                value = _documented_default(text)
                assert value == (list(code) if isinstance(code, tuple) and isinstance(value, list) else code), \
                    f"{name}.md gives {option} the default {text}, the code {code!r}"


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO / "README.md").read_text()
    assert f"```bash\n{ci}\n```" in readme, "the README's test command and .ci/run differ"
    started = (REPO / "docs" / "getting-started.md").read_text()
    assert f"```bash\n{ci}\n```" in started, "Getting started's test command and .ci/run differ"
    assert "mkdocs build --strict" in ci and ".[dev,docs]" in ci


def test_readme_is_short_and_undated():
    """Undated as written: the dates of a generated region (its notes name the result files) move with the results."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert re.sub(r"<!-- generated:.*?<!-- end generated -->", "", readme, flags=re.S).count("2026-") <= 2
    issue = re.compile(r"issue ?[0-9]+", re.I)
    offenders = [str(p.relative_to(REPO)) for p in [REPO / "README.md", *DOCS.rglob("*.md")]
                 if issue.search(p.read_text())]
    assert not offenders, f"issue numbers (a tracker readers cannot see) in {offenders}"


@pytest.mark.parametrize("package", ["specdec", "drafters", "kernels", "train", "eval"])
def test_module_docstrings_are_short_and_undated(package):
    long, dated = [], []
    for path in sorted((REPO / package).rglob("*.py")):
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text), clean=False) or ""
        if doc.count("\n") + 1 > 30:
            long.append(path.name)
        if "2026-1" in text:
            dated.append(path.name)
    assert not long, f"module docstrings over 30 lines (measurements and history go to docs/): {long}"
    assert not dated, f"dates in code (measurements go to docs/results): {dated}"


_ITEM = re.compile(r"^ *([*+-]|\d+[.)]) ")


def list_pitfalls(text: str) -> list[tuple[int, str]]:
    """(line, why) for each list Python-Markdown (what mkdocs renders with) would not render as written: a nested
    item indented by fewer than four spaces becomes a sibling of its parent, and a list right after a paragraph or a
    code block, with no blank line between, becomes text of it."""
    found, fenced, block, in_list = [], False, None, False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced, block = not fenced, "fence"
            continue
        if fenced:
            continue
        if not line.strip():
            block = None
            continue
        item = _ITEM.match(line)
        if item and in_list and re.match(r"^ {1,3}\S", line):
            found.append((n, "a nested item needs four spaces"))
        if item and block in ("fence", "paragraph"):
            found.append((n, "a list needs a blank line before it"))
            block = "flagged"
        if block is None:  # a block's first line says what it is
            in_list = bool(item) or (in_list and line.startswith(" "))
            block = "list" if in_list else "other" if line.lstrip().startswith(("|", "#", "<", ">", "!!!")) else (
                "paragraph")
        elif block == "fence":
            block = "paragraph"
    return found


MEASURED = re.compile(r"\b\d+(?:\.\d+)?x\b|tok/s|\b\d+(?:\.\d+)? ?ms\b|\b\d+(?:\.\d+)?%")
# Tables that may hold such numbers outside a generated region, by page and header line (say why):
HAND_TABLES = {
    ("gpu-speed.md", "| goal | target | from |"),  # the goals' targets, not measurements
}


def _hand_tables(text: str) -> list[str]:
    """Header lines of the markdown tables outside generated regions and code blocks whose rows hold
    measured-looking numbers (1.23x, tok/s, ms, %)."""
    text = re.sub(r"<!-- generated:.*?<!-- end generated -->|```.*?```", "", text, flags=re.S)
    found, table = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table and any(MEASURED.search(row) for row in table[2:]):
            found.append(table[0])
        table = []
    return found


def test_measured_numbers_in_docs_tables_come_from_results():
    """A table of measurements is a generated region (docs/gen_result_tables.py), not a hand copy, in the docs and
    the README. Run reports (docs/gpu/RUN/, docs/eval/) and the benchmarks page are written by their scripts."""
    assert _hand_tables((REPO / "README.md").read_text()) == [], "README.md: a hand-copied table of measurements"
    pages = [p for p in sorted(DOCS.rglob("*.md")) if p.relative_to(DOCS).parts[0] not in ("eval", "results")
             and not (p.relative_to(DOCS).parts[0] == "gpu" and len(p.relative_to(DOCS).parts) > 2)
             and p.name != "benchmarks.md"]
    copies = [f"{page.relative_to(DOCS)}: {header}" for page in pages
              for header in _hand_tables(page.read_text()) if (str(page.relative_to(DOCS)), header) not in HAND_TABLES]
    assert not copies, "hand-copied measurements; generate them from docs/results (or allow-list them):\n" + \
        "\n".join(copies)
    assert _hand_tables("| a | b |\n|---|---|\n| plain | 1.5x |\n") == ["| a | b |"]


def test_lists_render_as_written():
    assert [why for _, why in list_pitfalls("Text\n- item")] == ["a list needs a blank line before it"]
    assert [why for _, why in list_pitfalls("```\ncode\n```\n- item")] == ["a list needs a blank line before it"]
    assert [why for _, why in list_pitfalls("- a\n  - b")] == ["a nested item needs four spaces"]
    assert list_pitfalls("- a\n    - b\n- c\n\nText\n\n- d\ncontinued\n- e\n\n```\n- not a list\n```\n\n1. one") == []
    offenders = [f"{p.relative_to(REPO)}:{n}: {why}" for p in sorted(DOCS.rglob("*.md"))
                 for n, why in list_pitfalls(p.read_text())]
    assert offenders == []


_SEPARATOR = re.compile(r"^\|(?: *:?-{3,}:? *\|)+ *$")


def table_pitfalls(text: str) -> list[tuple[int, str]]:
    """(line, why) for each table Python-Markdown would not render as one: its separator row (``| --- |``) must
    come right after a header row with as many cells; without one the whole table is a paragraph of pipes."""
    found, fenced, previous = [], False, ""
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and _SEPARATOR.match(line.strip()):
            if not previous.startswith("|"):
                found.append((n, "a table needs a header row above its | --- | row"))
            elif previous.strip().strip("|").count("|") != line.strip().strip("|").count("|"):
                found.append((n, "the header row and the | --- | row have different numbers of cells"))
        previous = line.strip()
    return found


def test_tables_render_as_written():
    assert [why for _, why in table_pitfalls("Text\n\n| --- | --- |\n| a | b |")] == [
        "a table needs a header row above its | --- | row"]
    assert [why for _, why in table_pitfalls("| a |\n| --- | --- |\n| a | b |")] == [
        "the header row and the | --- | row have different numbers of cells"]
    assert table_pitfalls("| a | b |\n|---|:---:|\n| 1 | 2 |\n\n```\n| --- |\n```") == []
    offenders = [f"{p.relative_to(REPO)}:{n}: {why}" for p in [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
                 for n, why in table_pitfalls(p.read_text())]
    assert offenders == []


def test_the_gpu_check_report_renders_its_lists():
    """The report a GPU run commits: its failures, end-to-end divergences and test counts as lists, after code
    blocks."""
    check = load_file(REPO / "benchmarks" / "gpu_check.py")
    tests = {"status": "failed", "kernels_and_graphs": dict(passed=3, failed=1, skipped=0, seconds=9.0,
                                                            failures=["tests/test_x.py::test_y"], log_tail="E boom")}
    e2e = {"status": "failed", "error": "Traceback ...", "errors": ["a drafter failed"], "table": "| tok/s |",
           "divergences": {"specdec_plain": [dict(prompt=0, position=76, got=1, want=2, gap=-0.125,
                                                  kind="near-tie")]}}
    text = check.markdown({"date": "2026-11-29", "steps": {"tests": tests, "e2e": e2e}})
    assert "- specdec_plain, prompt 0: diverges at token 76" in text and "- tests/test_x.py::test_y" in text
    assert list_pitfalls(text) == [], text
