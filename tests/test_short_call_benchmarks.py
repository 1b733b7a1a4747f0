"""The short-call benchmarks end to end on a tiny model: bench_drafters_cpu.py --grid (one drafter x one length x
one column and a ragged batch, every cell against plain decoding in the same run, outputs checked, the result file
written) and profile_short_call.py (every phase timed, the engine left unwrapped afterwards, its result file
written and a column appended)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.script_loading import load_script


def _script(name: str):
    return load_script(name)


@pytest.fixture(scope="module")
def bench():
    yield _script("bench_drafters_cpu")
    for name in ("bench_drafters_cpu_under_test", "drafter_grid", "held_out_prompts", "common"):  # by bare names
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def profiler():
    yield _script("profile_short_call")
    for name in ("profile_short_call_under_test", "drafter_grid", "held_out_prompts", "common"):
        sys.modules.pop(name, None)


@pytest.fixture(autouse=True)
def _no_calibration(monkeypatch):
    """No row-policy or verify-cost measurement of the tiny shape (seconds each): a flat synthetic curve instead."""
    monkeypatch.setattr("specdec.engine_setup.ensure_row_policy", lambda runner: None)
    monkeypatch.setattr("specdec.cost_model.ensure_row_policy", lambda runner, config, cache_dir: None)
    monkeypatch.setattr("specdec.verify_cost.measure_verify_costs",
                        lambda runner, prompts, sizes, sampling, **kw: {n: 1e-3 * (1 + 0.01 * (n - 1)) for n in sizes})
    if "common" in sys.modules:  # --out needs a machine class; on an unnamed CPU (Intel without AVX-512) it has none
        monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: "cpu-avx512")


def test_grid_measures_every_cell_and_checks_outputs(bench, chat_ckpt, tmp_path):
    out = tmp_path / "grid.json"
    cells = bench.main(["--grid", "--model", str(chat_ckpt), "--drafters", "ngram", "--lengths", "6",
                        "--categories", "held-out,batch8", "--prompts", "2", "--cold", "--clock", "cpu",
                        "--out", str(out)])
    assert {(c["drafter"], c["column"]) for c in cells} == {
        (d, col) for d in ("plain", "plain (again)", "ngram") for col in ("held-out", "batch8")}
    for c in cells:
        assert c["identical_to_plain"] and c["mismatching_runs"] == 0, c
        assert c["runs"] == 2 and c["new_tokens"] == 6
        mean, low, high = c["paired_speedup"]
        assert 0 < low <= mean <= high
    assert all(c["paired_speedup"] == [1.0, 1.0, 1.0] for c in cells if c["drafter"] == "plain")
    result = json.loads(out.read_text())
    assert result["benchmark"] == "drafter-grid-ngram-held-out-batch8-6" and result["conditions"].startswith("Cold:")
    assert "CPU seconds" in result["conditions"]
    assert result["columns"] == ["drafter", "new tokens", "held-out", "batch8"]
    assert [r[0] for r in result["rows"]] == ["plain tok/s", "plain (again)", "ngram"]
    assert not any("DIFFERS" in entry for row in result["rows"] for entry in row)
    assert len(result["cells"]) == len(cells)


@pytest.mark.parametrize("flag", [None, "--machine-memory"])
def test_the_guard_memory_of_a_run_is_its_own_unless_asked(bench, chat_ckpt, tmp_path, flag):
    """By default a run neither starts from nor writes to the machine's guard memory (two runs start alike)."""
    from specdec import remembered

    machine = remembered._FOLDER  # this test's stand-in for the machine's memory (conftest)
    out = tmp_path / "grid.json"
    bench.main(["--grid", "--model", str(chat_ckpt), "--drafters", "ngram", "--lengths", "4", "--categories",
                "held-out", "--prompts", "1", "--out", str(out)] + ([flag] if flag else []))
    written = sorted(p.name for p in machine.glob("*.json")) if machine.is_dir() else []
    conditions = json.loads(out.read_text())["conditions"]
    if flag:
        assert written and conditions.startswith("The guard started from what earlier runs"), (written, conditions)
    else:
        assert not written and conditions.startswith("The guard's memory empty at the run's start"), written
        assert remembered._FOLDER != machine


def test_ragged_batches_cycle_through_the_columns(bench):
    grid = sys.modules["drafter_grid"]
    batches = grid.ragged_batches({"a": [[1], [2, 2]], "b": [[3, 3, 3]]}, batches=2, size=4)
    assert batches == [[[1], [3, 3, 3], [2, 2], [1]], [[3, 3, 3], [2, 2], [1], [3, 3, 3]]]
    assert grid.batch_sizes() == [2, 4, 8]  # what the warm-up runs: every batch size the cost model calibrates


def test_a_grid_drafter_that_is_no_row_is_refused(bench, chat_ckpt, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--grid", "--model", str(chat_ckpt), "--drafters", "eagle", "--lengths", "4"])
    assert "no row named 'eagle'" in capsys.readouterr().err


def test_profile_times_every_phase_and_unwraps_the_engine(profiler, chat_ckpt, capsys):
    from specdec.drafters.ngram import NGramDrafter

    from specdec.engine import Engine
    from specdec.tree_sizing import TreeSizer

    before = (Engine.verify, Engine.step, TreeSizer.wants_draft, NGramDrafter.propose)
    profiler.main(["--model", str(chat_ckpt), "--drafter", "ngram", "--category", "held-out", "--prompts", "2",
                   "--max-new-tokens", "5", "--cold"])
    out = capsys.readouterr().out
    rows = {line[:40].strip(): line[40:].split() for line in out.splitlines() if line.startswith(" ") or
            line.startswith("generate()")}
    assert float(rows["generate()"][0]) == 1.0 and float(rows["steps (Engine.step)"][0]) >= 1  # calls per call
    assert float(rows["guard decision (wants_draft)"][0]) >= 1 and "propose" in rows
    assert "ngram speed vs plain" in out and "outputs unlike plain 0.0/call" in out
    assert (Engine.verify, Engine.step, TreeSizer.wants_draft, NGramDrafter.propose) == before


def test_profile_writes_its_result_file_and_appends_a_column(profiler, chat_ckpt, tmp_path, capsys):
    """--out writes the run in the docs/results schema (CPU time per call); --append adds a run's column."""
    out = tmp_path / "prof.json"
    base = ["--model", str(chat_ckpt), "--drafter", "ngram", "--category", "held-out", "--prompts", "1",
            "--max-new-tokens", "4", "--out", str(out)]
    profiler.main(base)
    with pytest.raises(SystemExit):
        profiler.main(base)
    assert "exists; pass --overwrite" in capsys.readouterr().err
    profiler.main(base + ["--cold", "--append"])
    result = json.loads(out.read_text())
    assert result["benchmark"] == "short-call-profile" and result["date"] and "machine_class" in result
    assert result["columns"] == ["per call, CPU time", "ngram, held-out, 4, warm", "ngram, held-out, 4, cold"]
    assert len(result["command"]) == 2 and result["command"][1].endswith("--cold --append")
    rows = {r[0]: r[1:] for r in result["rows"]}
    assert len(rows) == 7 and all(len(cells) == 2 for cells in rows.values())
    call = rows["call: CPU ms, steps (plain's)"][0]
    assert call.endswith(")") and " steps (" in call
    assert all(c.endswith("x") and " / " in c for c in rows["call, ratio to plain (CPU / wall)"])
    assert len(result["notes"]) == 2 and result["notes"][1].startswith("ngram, held-out, 4, cold: ")


def test_a_profile_column_of_other_settings_or_a_file_not_a_profile_is_refused_before_the_calls(
        profiler, chat_ckpt, tmp_path, capsys, monkeypatch):
    """--append joined a run of other prompts or threads to a file stating the first run's, and found a file that was
    no profile (or not JSON, in a line naming no file) only after every call was made."""
    out = tmp_path / "prof.json"
    base = ["--model", str(chat_ckpt), "--drafter", "ngram", "--category", "held-out", "--prompts", "1",
            "--max-new-tokens", "4", "--out", str(out)]
    profiler.main(base)
    written = out.read_text()
    monkeypatch.setattr(profiler, "run_calls", lambda *a: pytest.fail("called before the file was checked"))
    threads = torch.get_num_threads()
    for extra, said in ((["--prompts", "2", "--append"], "prompts 1 there, 2 here"),
                        (["--threads", str(threads + 1), "--append"], f"threads {threads} there, {threads + 1} here")):
        try:
            with pytest.raises(SystemExit):
                profiler.main(base[:-4] + extra + base[-2:])
        finally:
            torch.set_num_threads(threads)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"error: {out}: another run's settings ({said}); a column of other settings needs a file" in err
        assert out.read_text() == written
    for text, said in (('{"a":', "not JSON ("), ('{"benchmark": "drafter-grid"}', "not a short-call profile")):
        out.write_text(text)
        with pytest.raises(SystemExit):
            profiler.main(base + ["--append"])
        assert f"error: {out}: {said}" in capsys.readouterr().err.strip().splitlines()[-1]
