"""benchmarks/gpu_results.py: a GPU run's folder gives the docs' result files, named from the run itself."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tests.script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "docs" / "gpu" / "h200-2026-11-30"


@pytest.fixture(scope="module")
def script():
    return load_script("gpu_results")


def test_the_committed_h200_run_gives_its_committed_result_files(script, tmp_path):
    assert script.main([str(RUN), "--out", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"2026-11-30-gpu-h200-{n}.json" for n in ("acceptance", "e2e", "goals", "speed")]
    for name in names:
        assert (tmp_path / name).read_text() == (REPO / "docs" / "results" / name).read_text(), name


def test_a_run_without_its_commit_or_with_results_written_is_refused(script, tmp_path, capsys):
    run = tmp_path / "h200-run"
    shutil.copytree(RUN, run)
    report = run / "report.md"
    report.write_text(report.read_text().replace("Code at d7ca25f.", ""))
    with pytest.raises(SystemExit):
        script.main([str(run), "--out", str(tmp_path / "out")])
    assert "report.md says no 'Code at <commit>': pass --commit" in capsys.readouterr().err
    assert script.main([str(run), "--out", str(tmp_path / "out"), "--commit", "abc1234"]) == 0
    speed = json.loads((tmp_path / "out" / "2026-11-30-gpu-h200-speed.json").read_text())
    assert speed["commit"] == "abc1234" and speed["conditions"].endswith(f"Every row: {run}/speed_report.md.")
    with pytest.raises(SystemExit):
        script.main([str(run), "--out", str(tmp_path / "out"), "--commit", "abc1234"])
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_a_days_second_run_is_named_and_ordered_after_its_first(script, tmp_path):
    run = tmp_path / "h200-2026-11-30b"
    shutil.copytree(RUN, run)
    assert script.main([str(run), "--out", str(tmp_path / "out")]) == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [f"2026-11-30b-gpu-h200-{n}.json" for n in ("acceptance", "e2e", "goals", "speed")]
    again = json.loads((tmp_path / "out" / names[-1]).read_text())
    first = json.loads((REPO / "docs" / "results" / "2026-11-30-gpu-h200-speed.json").read_text())
    assert again["run"] == 2 and "run" not in first
    gen = importlib.util.spec_from_file_location("gen_benchmarks_order", REPO / "docs" / "gen_benchmarks.py")
    module = importlib.util.module_from_spec(gen)
    gen.loader.exec_module(module)
    first["file"], again["file"] = "2026-11-30-gpu-h200-speed.json", names[-1]
    assert sorted([again, first], key=module._order) == [first, again]


def test_what_a_later_run_records_is_said(script, tmp_path):
    """The e2e step's speculation record gives n-gram's tau with graphs; a run of other rows skipped names them;
    a JSON the folder lacks gives no result; a call quoted as gpu_carry.py prints it is found; goals no call
    measured stay "not measured"."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("speed_report.md", "speed.json", "e2e.json"):
        shutil.copy(RUN / name, run / name)
    call = "python3 benchmarks/gpu_check.py --deadline-s 410 --steps env,speed"
    (run / "report.md").write_text((RUN / "report.md").read_text().replace(f"`{call}", f"`PYTHONUNBUFFERED=1 {call}"))
    e2e = json.loads((run / "e2e.json").read_text())
    e2e["speculation"] = {"specdec_ngram_graphs": dict(steps=100, tokens=150, drafted_steps=40, nodes=90)}
    for row in [e2e["tokens_per_s"], *e2e["per_category"].values()]:  # --compare-reference's row, and one unknown
        row.update(specdec_plain_ref=50.0, specdec_new_method=60.0)
    (run / "e2e.json").write_text(json.dumps(e2e))
    speed = json.loads((run / "speed.json").read_text())
    speed["models"][2]["skipped"] = ["plain b8", "oracle chain tau 2.0 b8"]
    (run / "speed.json").write_text(json.dumps(speed))
    made = script.results(script.Run(run))
    assert sorted(made) == [f"2026-11-30-gpu-h200-{n}.json" for n in ("e2e", "goals", "speed")]
    goals = made["2026-11-30-gpu-h200-goals.json"]  # from the speed call's report alone
    assert [r[3] for r in goals["rows"]].count("not measured") == 5 and goals["notes"] == ["1 of the 10 goals met."]
    assert made["2026-11-30-gpu-h200-speed.json"]["command"].startswith(call + " --model default   # its speed step")
    e2e_rows = {r[0]: r[-1] for r in made["2026-11-30-gpu-h200-e2e.json"]["rows"]}
    assert e2e_rows["specdec plain, reference attention"] == "50.0" and e2e_rows["specdec_new_method"] == "60.0"
    assert made["2026-11-30-gpu-h200-e2e.json"]["notes"][0].endswith(
        "summarisation 0.97x); with graphs tau 1.50, a draft verified in 40% of steps.")
    assert made["2026-11-30-gpu-h200-speed.json"]["notes"][-1] == (
        "Every oracle row of every shape gave the plain run's text. Qwen3-1.7B: two rows (plain b8; oracle chain tau "
        "2.0 b8) left out for time.")


def _gpu_table(made: dict[str, dict]) -> dict[str, list[str]]:
    """The GPU page's latest-results table (docs/gpu_latest.py) from ``made`` alone, as label -> cells."""
    spec = importlib.util.spec_from_file_location("gen_result_tables", REPO / "docs" / "gen_result_tables.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    page = gen.render_part([dict(r, file=name) for name, r in made.items()], "latest_per_gpu")
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in page.splitlines() if line[:2] == "| "]
    return {c[0]: c[1:] for c in cells}


def test_the_gpu_table_reads_a_run_whatever_labels_this_script_gives_its_rows(script, tmp_path, monkeypatch):
    """The table found the end-to-end and 8B rows by words of their labels, so rewording a label here showed "not
    measured" on the GPU page; it reads the row_keys written here. A run whose outputs all matched transformers'
    says so in the table (its note, "No output diverged", was read as none measured)."""
    table = _gpu_table(script.results(script.Run(RUN)))
    assert "not measured" not in table["plain decoding, embedded model, bf16, batch 1, CUDA graphs"][0]
    monkeypatch.setattr(script, "E2E_METHODS", tuple((k, f"method {k}") for k, _ in script.E2E_METHODS))
    monkeypatch.setattr(script, "SHAPES", {k: f"shape {v}" for k, v in script.SHAPES.items()})
    assert _gpu_table(script.results(script.Run(RUN))) == table
    run = tmp_path / "h200-2026-11-30"
    shutil.copytree(RUN, run)
    e2e = json.loads((run / "e2e.json").read_text())
    (run / "e2e.json").write_text(json.dumps(dict(e2e, divergences={k: [] for k in e2e["divergences"]})))
    clean = _gpu_table(script.results(script.Run(run)))["bf16 greedy identity vs transformers"]
    assert clean[0].startswith("No output diverged from transformers' greedy tokens"), clean  # dated: not in docs/


def test_a_failed_measurement_and_a_model_that_did_not_load_are_said(script, tmp_path):
    """A model that failed to load was dropped from the table without a word, and a failed item left its cells
    empty as a skip for time does: each model's errors are a note. Items the result shows nothing of (a profile)
    stay in the run's report."""
    run = tmp_path / "h200-2026-11-30"
    shutil.copytree(RUN, run)
    speed = json.loads((run / "speed.json").read_text())
    by = {m["model"]: m for m in speed["models"]}
    del by["synthetic:llama-3.2-1b"]["plain"]["8"]
    by["synthetic:llama-3.2-1b"]["errors"] += ["plain b8: RuntimeError: CUDA out of memory",
                                               "profile b1: AttributeError: no attribute"]
    by["synthetic:qwen3-1.7b"]["errors"] += ["verify cost: RuntimeError: boom"]
    speed["models"].append(dict(model="synthetic:qwen3-0.6b", plain={}, oracle=[], verify_cost=None, hf_static=None,
                                skipped=[], errors=["load: RuntimeError: CUDA out of memory"]))
    (run / "speed.json").write_text(json.dumps(speed))
    made = script.results(script.Run(run))["2026-11-30-gpu-h200-speed.json"]
    committed = json.loads((REPO / "docs" / "results" / "2026-11-30-gpu-h200-speed.json").read_text())
    assert made["notes"][:-3] == committed["notes"]
    assert made["notes"][-3:] == [
        "Qwen3-1.7B: one measurement failed, not left out for time: verify cost: RuntimeError: boom.",
        "Llama-3.2-1B: one measurement failed, not left out for time: plain b8: RuntimeError: CUDA out of memory.",
        "Qwen3-0.6B did not load (RuntimeError: CUDA out of memory), so it has no row."]
    assert "synthetic:qwen3-0.6b" not in made["row_keys"]


def test_a_run_across_midnight_is_named_by_the_day_it_started(script, tmp_path):
    """The speed call's JSON is dated before midnight, the check call's acceptance after: the run is the first day's."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    speed = json.loads((run / "speed.json").read_text())
    (run / "speed.json").write_text(json.dumps(dict(speed, date="2026-11-29 23:58:10")))  # acceptance: 2026-11-30
    made = script.results(script.Run(run))
    assert sorted(made) == [f"2026-11-29-gpu-h200-{n}.json" for n in ("acceptance", "e2e", "goals", "speed")]
    assert {r["date"] for r in made.values()} == {"2026-11-29"}


def test_a_divergence_that_is_no_near_tie_is_not_called_one(script, tmp_path):
    """One divergence of three classified as other than a near-tie: the note counts it, never "every one"."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    e2e = json.loads((run / "e2e.json").read_text())
    e2e["divergences"] = {"specdec_plain": [dict(kind="near-tie", gap=0.125), dict(kind="near-tie", gap=0.0)],
                          "specdec_ngram": [dict(kind="bug", gap=3.5)]}
    (run / "e2e.json").write_text(json.dumps(e2e))
    notes = script.e2e_result(script.Run(run))["notes"]
    assert notes[-1] == ("2 of the 3 divergences from transformers' greedy tokens are near-ties, 1 not: see the "
                         "run's report.")
    assert not any("Every one" in n or "none a bug" in n for n in notes)


def test_a_check_call_that_ran_e2e_without_acceptance_is_the_e2e_results_command(script, tmp_path):
    """The check call is found by its steps: e2e alone (no acceptance step) is a check call too."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("speed_report.md", "e2e.json", "speed.json"):
        shutil.copy(RUN / name, run / name)
    call = "python3 benchmarks/gpu_check.py --deadline-s 300 --steps e2e,graphs --quick-e2e"
    (run / "report.md").write_text(f"Code at d7ca25f.\n\n1. `{call}`\n")
    assert script.e2e_result(script.Run(run))["command"] == call


def test_an_oracle_row_whose_text_parted_from_plain_is_named(script, tmp_path):
    """identical_to_plain is "k/batch": "31/32" is a row where one sequence's text differed, never "the same"."""
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    speed = json.loads((run / "speed.json").read_text())
    row = speed["models"][0]["oracle"][2]
    assert (speed["models"][0]["model"], row["shape"], row["batch"]) == ("synthetic:llama-3.1-8b", "chain", 32)
    row["identical_to_plain"] = "31/32"
    (run / "speed.json").write_text(json.dumps(speed))
    notes = script.speed_result(script.Run(run))["notes"]
    assert notes[-1] == ("one oracle row gave other text than the plain run's: Llama-3.1-8B chain batch 32 (31/32 the "
                         "same). Qwen3-1.7B: five batch-8 oracle rows left out for time.")


def test_skipped_oracle_rows_of_two_batches_are_named_not_counted_as_one_batchs(script):
    one = ["oracle chain tau 2.0 b8", "oracle tree tau 2.0 b8"]
    assert script._skipped(dict(skipped=one)) == "two batch-8 oracle rows"
    two = ["oracle chain tau 2.0 b8", "oracle tree tau 2.0 b32"]
    assert script._skipped(dict(skipped=two)) == "two rows (oracle chain tau 2.0 b8; oracle tree tau 2.0 b32)"
