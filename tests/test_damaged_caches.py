"""Caches that cannot be used never fail a run: they cost a measurement, or a fresh start, and a warning.

- No home directory and no cache variable (a container under an arbitrary uid): generate() measures without a
  cache (said once, naming SPECDEC_CACHE_DIR); cache_root() itself is a one-line SpecdecError naming it.
- A verify-cost or row-policy file that parses but holds what no calibration writes is measured again, and a guard
  memory holding what no guard writes is a fresh start, each named in a warning.
- Processes sharing one cost cache (a server's workers) keep each other's batch sizes in the file.

Measurements are replaced by fixed ones: these tests check what is cached and read, not timings.
"""
from __future__ import annotations

import json
import logging
import math
import pwd

import pytest
import torch

from specdec import cost_model, remembered, verify_cost
from specdec.cost_model import CalibrationConfig, ensure_row_policy, load_cost_model
from specdec.errors import SpecdecError
from specdec.generate import generate
from specdec.models import row_policy
from specdec.models.embedded import cache_root
from specdec.models.llama import LlamaRunner
from specdec.score_bins import BINS
from specdec.testing import build_tiny_model
from specdec.tree import DraftTree
from specdec.tree_sizing import TreeSizer, _Kept

SMALL = CalibrationConfig(sizes=(1, 2, 4), context=16, repeats=1, row_repeats=1)
FLAT = cost_model.CostModel({}, {1: {1: 1.0, 65: 1.0}})


@pytest.fixture
def measured(monkeypatch):
    """A new process's cost model state; every measurement fixed and counted (CALIBRATIONS)."""
    for name in ("_MEMO", "_ROWS_DONE", "_PACKING"):
        monkeypatch.setattr(cost_model, name, {})
    monkeypatch.setattr(cost_model, "_WARNED", set())
    monkeypatch.setattr(cost_model, "CALIBRATIONS", {"verify": 0, "rows": 0})
    monkeypatch.setattr(verify_cost, "measure_verify_costs",
                        lambda runner, prompts, sizes, sampling, **kw: {n: 1e-3 * (1 + 0.1 * (n - 1)) for n in sizes})
    monkeypatch.setattr(row_policy, "measure_row_policy", lambda *args, **kw: {1: 2})
    saved = dict(row_policy._ACTIVE)
    yield cost_model.CALIBRATIONS
    row_policy._ACTIVE.clear()
    row_policy._ACTIVE.update(saved)


def test_no_home_directory_decodes_without_a_cache(measured, monkeypatch, caplog, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("HOME", "SPECDEC_CACHE_DIR", "SPECDEC_COST_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))  # no passwd entry
    remembered.use_folder(None)  # the guard's memory in the cost cache, which has no folder
    with pytest.raises(SpecdecError, match="set SPECDEC_CACHE_DIR"):
        cache_root()  # the embedded model's conversion has nowhere to go: one line
    model, prompt = build_tiny_model(), [[5, 6, 7, 8] * 3]
    with caplog.at_level(logging.WARNING, logger="specdec.cost_model"):
        plain = generate(model, prompt, max_new_tokens=8)
        assert generate(model, prompt, max_new_tokens=8, drafter="ngram") == plain
    said = [r.getMessage() for r in caplog.records if "no cache directory" in r.getMessage()]
    assert len(said) == 1 and "SPECDEC_CACHE_DIR" in said[0] and "SPECDEC_COST_DIR" in said[0]
    assert measured["rows"] == 1 and measured["verify"] == 1 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage", [
    lambda d: d.pop("curves"), lambda d: d["curves"]["1"].update({"2": None}), lambda d: d["curves"].update({"1": {}}),
    lambda d: d["curves"]["1"].update({"1": 0.0}), lambda d: d["curves"]["1"].update({"4": "fast"}),
    lambda d: d.update({"curves": [1, 2]}),
], ids=["no curves", "null time", "empty curve", "free step", "a string", "a list"])
def test_a_damaged_verify_cost_file_is_measured_again(measured, tmp_path, caplog, damage):
    runner = LlamaRunner(build_tiny_model())
    load_cost_model(runner, SMALL, cache_dir=tmp_path)
    (file,) = tmp_path.glob("verify-*.json")
    data = json.loads(file.read_text())
    damage(data)
    file.write_text(json.dumps(data))
    cost_model._MEMO.clear()  # a new process
    with caplog.at_level(logging.WARNING, logger="specdec.cost_model"):
        costs = load_cost_model(runner, SMALL, cache_dir=tmp_path)
    assert costs.relative(4) == pytest.approx(1.3) and measured["verify"] == 2
    assert [r.getMessage() for r in caplog.records if str(file) in r.getMessage()] == [
        f"cost model: damaged cache file {file} (its curves); measuring again"]
    assert json.loads(file.read_text())["curves"]["1"]["1"] == pytest.approx(1e-3)  # written whole again


@pytest.mark.parametrize("cols", [None, {"1": "x"}, {"1": 99}, {"one": 2}, [1, 2]])
def test_a_damaged_row_policy_file_is_measured_again(measured, tmp_path, caplog, cols):
    runner = LlamaRunner(build_tiny_model())
    ensure_row_policy(runner, SMALL, cache_dir=tmp_path)
    (file,) = tmp_path.glob("rows-*.json")
    file.write_text(json.dumps(json.loads(file.read_text()) | {"cols": cols}))
    cost_model._ROWS_DONE.clear()  # a new process
    with caplog.at_level(logging.WARNING, logger="specdec.cost_model"):
        ensure_row_policy(runner, SMALL, cache_dir=tmp_path)
    assert measured["rows"] == 2 and row_policy.active_cols(runner.dtype) == {1: 2}
    assert any(str(file) in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert json.loads(file.read_text())["cols"] == {"1": 2}


@pytest.mark.parametrize("field, value", [
    ("price", "x"), ("tokens", "x"), ("tokens", math.nan), ("score_bins", [[None, None]] * BINS),
    ("unscored", [[1, 2]]), ("verify_times", [[1, 1, []]]), ("last_shape", "abc"), ("catch_ups", [None]), (None, [1]),
])
def test_a_damaged_guard_memory_is_a_fresh_start(tmp_path, caplog, field, value):
    remembered.use_folder(tmp_path)
    key = ("damaged-guard",)
    sizer = TreeSizer(FLAT, memory=key)
    assert sizer.wants_draft(0)
    sizer.size_call([0], [DraftTree.chain([5, 6], scores=torch.tensor([0.9, 0.9]))], 1, 0.1)
    sizer.observe(0, [5, 7], [0])
    sizer.record_step(0.01, 2, 1)
    sizer.release(0)
    remembered.save()
    remembered.forget_all()  # a new process
    assert _Kept.recalled(key) is not None  # as written: read back whole
    remembered.forget_all()
    (file,) = tmp_path.glob("guard-*.json")
    data = json.loads(file.read_text())
    if field is None:
        data["value"] = value
    else:
        data["value"][field] = value
    file.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="specdec.remembered"):
        sizer = TreeSizer(FLAT, memory=key)
        assert _Kept.recalled(key) is None
        guard = sizer._guard(0)
    assert (guard.backoff, guard.price, guard.tokens) == (0, None, None) and sizer.unscored == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"remembered: damaged guard value in {file} ({'not an object' if field is None else 'its ' + field}); "
        "starting fresh"]


def test_a_cache_that_cannot_be_written_is_said_once_per_folder(tmp_path, monkeypatch, caplog):
    """A read-only cost cache: the guard's memory warned "could not write FILE" at the end of every generate()
    call (and the cost model once per file), lines landing among the streamed text."""
    def read_only(path, data):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(remembered, "write_json", read_only)
    monkeypatch.setattr(cost_model, "write_json", read_only)
    monkeypatch.setattr(remembered, "_UNWRITABLE", set())
    monkeypatch.setattr(cost_model, "_WARNED", set())
    remembered.use_folder(tmp_path)
    with caplog.at_level(logging.WARNING):
        for call in range(3):
            remembered.remember("guard", ("read-only", call), {"price": 1.0}, persist=True)
            remembered.save()
            cost_model.write_cache(tmp_path / f"verify-{call}.json", {})
    assert [r.getMessage() for r in caplog.records] == [
        f"remembered: cannot write into {tmp_path} (Read-only file system); what this process learns is not kept "
        "for the next",
        f"cost model: cannot write into {tmp_path} (Read-only file system); measurements are not cached"]


def test_workers_sharing_a_cost_cache_keep_each_others_batch_sizes(measured, tmp_path):
    runner = LlamaRunner(build_tiny_model())
    first = load_cost_model(runner, SMALL, cache_dir=tmp_path)
    cost_model._MEMO.clear()  # the second worker: another process
    second = load_cost_model(runner, SMALL, cache_dir=tmp_path)
    first.curve(4)
    second.curve(2)
    (file,) = tmp_path.glob("verify-*.json")
    assert sorted(json.loads(file.read_text())["curves"], key=int) == ["1", "2", "4"]
    cost_model._MEMO.clear()  # a third process
    before = measured["verify"]
    load_cost_model(runner, SMALL, cache_dir=tmp_path).curve(4)
    assert measured["verify"] == before
    second.curve(4)  # a long-running worker finds what another saved since it loaded, not measuring it again
    assert measured["verify"] == before and second.curves[4] == first.curves[4]


def test_every_field_of_a_guard_memory_has_its_check():
    """A field added to the guard's memory without a check would fail every recall of it (a KeyError), not a damaged
    file's only."""
    from specdec.tree_sizing import _KEPT_CHECKS, _KEPT_FIELDS

    assert set(_KEPT_CHECKS) == _KEPT_FIELDS
