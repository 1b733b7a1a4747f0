"""The GPU session's scripts work the first time: a device call brings back every file gpu_check writes, a step the
deadline leaves no time for is skipped, an H100's device name names its machine class, and the helpers' command
lines refuse what they cannot do in one line (their subprocesses faked: no GPU)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.script_loading import load_file, load_script

REPO = Path(__file__).resolve().parents[1]
MAX_FILES = 8  # what a device call brings back from $OUT


@pytest.fixture
def check(monkeypatch):
    module = load_script("gpu_check")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(module, "step_env", lambda out: dict(status="passed"))
    return module


def _fake_commands(monkeypatch, check) -> list[list[str]]:
    """subprocess.run in gpu_check as every command succeeding, each writing the files the real one writes."""
    from specdec.eval.prompts import CATEGORIES

    ran = []

    def fake_run(cmd, cwd=None, stdout=None, stderr=None, timeout=None, env=None):
        ran.append(cmd)
        for arg in cmd:
            if arg.startswith("--junitxml="):
                Path(arg.split("=", 1)[1]).write_text('<testsuites><testsuite><testcase classname="t" name="x"/>'
                                                      "</testsuite></testsuites>")
        if "--json" in cmd:
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(dict(divergences={})))
        if "acceptance" in cmd:
            suite = Path(cmd[cmd.index("--out") + 1])
            suite.mkdir(parents=True, exist_ok=True)
            rows = [dict(drafter="ngram", category=c, tau=1.5, speedup_vs_plain=1.1, decode_speedup_vs_plain=1.2,
                         tokens_per_s=100.0, identical_to_plain=True) for c in CATEGORIES]
            (suite / "report.json").write_text(json.dumps(dict(meta=dict(device="cuda:0"), rows=rows)))
        if any(a.endswith("bench_speed_gpu.py") for a in cmd):
            out = Path(cmd[cmd.index("--out") + 1])
            (out / "speed.json").write_text(json.dumps(dict(models=[])))
            (out / "speed.md").write_text("# speed\n")
        stdout.write("ok\n")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(check.subprocess, "run", fake_run)
    return ran


@pytest.mark.parametrize("steps", ["env,speed", "acceptance,identity,e2e,graphs,policy"])
def test_each_device_call_writes_no_more_files_than_come_back(check, monkeypatch, tmp_path, steps):
    _fake_commands(monkeypatch, check)
    out = tmp_path / "check"
    assert check.main(["--steps", steps, "--prompts", "1", "--quick-e2e", "--model", "/tmp/smol.gguf",
                       "--out", str(out)]) == 0
    written = [p for p in out.rglob("*")]
    assert all(p.is_file() for p in written) and len(written) <= MAX_FILES, sorted(p.name for p in written)
    if "identity" in steps:  # the junit files' counts are in the report, though the files are not
        report = json.loads((out / "report.json").read_text())
        assert report["steps"]["identity"]["greedy_cuda"]["passed"] == 1
        assert "greedy_cuda: 1 passed, 0 failed" in (out / "report.md").read_text()


def test_a_step_the_deadline_leaves_too_little_is_skipped_not_started(check, monkeypatch, tmp_path):
    ran = _fake_commands(monkeypatch, check)
    out = tmp_path / "check"
    deadline = check.DEADLINE_MARGIN_S + check.STEP_MIN_S["graphs"] - 5
    assert check.main(["--steps", "graphs,identity", "--deadline-s", str(deadline), "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert ran == [] and {name: s["status"] for name, s in report["steps"].items()} == dict(graphs="skipped",
                                                                                         identity="skipped")
    assert "--deadline-s" in report["steps"]["graphs"]["why"]
    assert check.main(["--steps", "graphs", "--deadline-s", "300", "--out", str(out)]) == 0 and len(ran) == 1


def test_a_failed_policy_step_says_why_in_the_report(check):
    policy = dict(status="failed", rc=1, seconds=3.0, meta=None, rows=[], log_tail="CUDA out of memory here")
    text = check.markdown(dict(date="today", rehearse=False, steps=dict(policy=policy)))
    assert "### policy" in text and "CUDA out of memory here" in text.split("### policy")[1]


def test_an_h100_run_is_named_by_its_model_not_its_memory(tmp_path):
    results = load_script("gpu_results")
    assert results.gpu_class("NVIDIA H200") == "gpu-h200"
    assert results.gpu_class("NVIDIA H100 80GB HBM3") == "gpu-h100"
    for name in ("NVIDIA GeForce RTX 4090", "NVIDIA A100-SXM4-80GB"):  # no model token / no machine class
        with pytest.raises(results.RunError, match=re.escape(name)):
            results.gpu_class(name)
    run = tmp_path / "h100-2026-12-04c"
    shutil.copytree(REPO / "docs" / "gpu" / "h200-2026-12-04c", run)
    for path in run.iterdir():
        path.write_text(path.read_text().replace("NVIDIA H200", "NVIDIA H100 80GB HBM3"))
    assert results.main([str(run), "--out", str(tmp_path / "out")]) == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names and all(n.startswith("2026-12-04c-gpu-h100-") for n in names), names


@pytest.mark.parametrize("name,page", [("gen_benchmarks", "PAGE"), ("gen_result_tables", None)])
def test_the_docs_generators_refuse_an_unknown_argument(name, page, tmp_path, monkeypatch, capsys):
    gen = load_file(REPO / "docs" / f"{name}.py", f"{name}_args_under_test")
    if page:
        monkeypatch.setattr(gen, page, tmp_path / "page.md")
    else:
        monkeypatch.setattr(gen, "pages", lambda: [])
    with pytest.raises(SystemExit) as exit_:
        gen.main(["--chek"])
    assert exit_.value.code == 2 and "unrecognized arguments: --chek" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        gen.main(["--help"])
    assert exit_.value.code == 0 and "--check" in capsys.readouterr().out
    assert not (tmp_path / "page.md").exists()


def test_a_step_that_raises_is_reported_failed_and_the_steps_after_it_still_run(check, monkeypatch, tmp_path):
    """A step's exception is its failure in the report, with what broke; the steps run in the order given, the
    others still run, and the exit status says one failed."""
    ran = _fake_commands(monkeypatch, check)

    def broken(*args, **kwargs):
        raise RuntimeError("no GPU memory left")

    monkeypatch.setattr(check, "step_e2e", broken)
    out = tmp_path / "check"
    assert check.main(["--steps", "graphs,e2e,env", "--out", str(out)]) == 1
    report = json.loads((out / "report.json").read_text())
    assert {name: s["status"] for name, s in report["steps"].items()} == dict(graphs="passed", e2e="failed",
                                                                             env="passed")
    assert list(report["steps"]) == ["graphs", "e2e", "env"] and len(ran) == 1
    assert report["steps"]["e2e"]["error"] == "RuntimeError: no GPU memory left"
    assert "RuntimeError: no GPU memory left" in (out / "report.md").read_text().split("### e2e")[1]
