"""benchmarks/gpu_results.py: a GPU run's folder gives the docs' result files, named from the run itself."""
from __future__ import annotations

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
    (run / "e2e.json").write_text(json.dumps(e2e))
    speed = json.loads((run / "speed.json").read_text())
    speed["models"][2]["skipped"] = ["plain b8", "oracle chain tau 2.0 b8"]
    (run / "speed.json").write_text(json.dumps(speed))
    made = script.results(script.Run(run))
    assert sorted(made) == [f"2026-11-30-gpu-h200-{n}.json" for n in ("e2e", "goals", "speed")]
    goals = made["2026-11-30-gpu-h200-goals.json"]  # from the speed call's report alone
    assert [r[3] for r in goals["rows"]].count("not measured") == 5 and goals["notes"] == ["1 of the 10 goals met."]
    assert made["2026-11-30-gpu-h200-speed.json"]["command"].startswith(call + " --model default   # its speed step")
    assert made["2026-11-30-gpu-h200-e2e.json"]["notes"][0].endswith(
        "summarisation 0.97x); with graphs tau 1.50, a draft verified in 40% of steps.")
    assert made["2026-11-30-gpu-h200-speed.json"]["notes"][-1] == (
        "Every oracle row of every shape gave the plain run's text. Qwen3-1.7B: two rows (plain b8; oracle chain tau "
        "2.0 b8) left out for time.")
