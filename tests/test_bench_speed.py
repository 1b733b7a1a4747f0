"""The GPU speed command's CPU rehearsal: every row of the report is measured and written, tiny shape, few tokens."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_speed_under_test", REPO / "benchmarks" / "bench_speed_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _no_row_calibration(monkeypatch):
    monkeypatch.setattr("specdec.engine_setup.ensure_row_policy", lambda runner: None)  # no calibration per shape


ARGS = ["--rehearse", "--models", "synthetic:qwen3-1.7b@tiny", "--batches", "1,2", "--taus", "3", "--sizes", "1,2,64",
        "--new-tokens", "6", "--prompt-len", "5"]


def test_rehearsal_measures_and_reports_every_row(bench, tmp_path):
    assert bench.main(ARGS + ["--out", str(tmp_path), "--budget", "900"]) == 0
    model = json.loads((tmp_path / "speed.json").read_text())["models"][0]
    assert model["errors"] == [] and model["skipped"] == []
    assert sorted(model["plain"]) == ["1", "2"] and model["weight_bytes"] > 0
    assert sorted(model["verify_cost"]["ratio"], key=int) == ["1", "2", "64"]
    rows = {(r["shape"], r["batch"], r["eagle"]) for r in model["oracle"]}
    assert rows == {("chain", 1, True), ("tree", 1, True), ("chain", 2, True), ("chain", 2, False), ("tree", 2, False)}
    assert all(r["identical_to_plain"] == f"{r['batch']}/{r['batch']}" for r in model["oracle"])  # greedy exactness
    assert model["hf_static"]["new_tokens"] == 6
    text = (tmp_path / "speed.md").read_text()
    assert "## synthetic:qwen3-1.7b@tiny" in text and "speedup vs plain" in text and "REHEARSAL" in text


def test_what_does_not_fit_the_budget_is_skipped_and_reported(bench, tmp_path):
    assert bench.main(ARGS + ["--out", str(tmp_path), "--budget", "0.001", "--no-hf"]) == 0
    model = json.loads((tmp_path / "speed.json").read_text())["models"][0]
    assert model["plain"] == {} and model["oracle"] == [] and model["errors"] == []
    assert "plain b1" in model["skipped"] and "oracle tree tau 3.0 b2" in model["skipped"]
    assert "oracle chain tau 3.0 b1 +eagle" in model["skipped"]
    assert "skipped (out of time)" in (tmp_path / "speed.md").read_text()


def test_weight_read_floor_counts_what_a_decode_step_reads(bench):
    from specdec.models import synthetic

    for name in ("llama-3.1-8b@tiny", "qwen3-1.7b@tiny"):  # untied: the input embedding is only gathered; tied: read
        shape = synthetic.parse(name)
        unread = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
        assert bench.weight_bytes(synthetic.build(name, device="cpu")) == 4 * (shape.num_params - unread)
