"""The acceptance suite on a tiny model: cells, resume, rank merging, sampling and batches, predicted speedup,
reports, prompt files and bad CLI input."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import signal

import pytest
from specdec.eval.acceptance import (
    NO_OUTPUTS,
    Cell,
    SuiteConfig,
    cell_path,
    merge_cells,
    predicted_speedup,
    process_state,
    read_cell,
    run_cells,
    run_suite,
    summarise,
)
from specdec.eval.prompt_files import read_prompt_file
from specdec.eval.prompt_sets import retrieval_augmented
from specdec.eval.prompts import CATEGORIES, load_prompts
from specdec.eval.report import markdown, write_reports

from specdec.sampling import SamplingConfig
from specdec.sigterm import sigterm_as_interrupt
from specdec.verify_cost import measure_verify_costs

PROMPTS = {"rep": [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]], "mixed": [[9, 4, 7, 1], [3, 3, 3, 3]]}
COUNTS = ("prompts", "new_tokens", "steps", "forward_passes", "drafts", "draft_nodes", "depth_tried",
          "depth_accepted", "accepted_histogram")


@pytest.fixture(scope="module")
def loaded(eval_tiny_model):
    return eval_tiny_model


def _oracle(loaded, k=3):  # the target drafting for itself: every draft is accepted
    return ("draft-model", {"model": loaded, "num_draft_tokens": k})


def _check_prediction(row):
    assert row["predicted_speedup"] is not None and math.isfinite(row["predicted_speedup"])
    # c_verify(n) >= c_plain up to timing noise and c_draft > 0: the prediction cannot beat tau by much
    assert 0.02 < row["predicted_speedup"] < 2 * row["tau"], row
    assert math.isfinite(row["predicted_over_measured"]) and row["predicted_over_measured"] > 0
    assert row["cost_draft_s"] > 0 and row["cost_plain_s"] > 0 and row["cost_verify_s"] > 0
    assert row["verify_query_tokens"] == max(1, round(1 + row["mean_tree_nodes"]))


def test_suite_measures_every_cell_resumes_and_reports(tmp_path, loaded):
    cfg = SuiteConfig((("ngram", {}), _oracle(loaded)), tuple(PROMPTS), prompts_per_category=2, max_new_tokens=24,
                      hf_baseline=True, calibration_repeats=2)
    cells = run_suite(loaded, PROMPTS, cfg, tmp_path)
    assert set(cells) == {(d, c) for d in ("plain", "ngram", "draft-model", "hf-greedy") for c in PROMPTS}
    for (label, _), cell in cells.items():
        assert cell.new_tokens == 48 and cell.prompts == 2
        if label == "plain":
            assert cell.tau == 1.0 and cell.accepted_histogram == [48] and cell.acceptance_per_depth == []
            assert cell.drafts == 0 and not cell.calibration
        if label == "draft-model":
            assert cell.tau > 3.0 and all(a == 1.0 for a in cell.acceptance_per_depth)
            assert cell.mean_tree_nodes == 3.0 and cell.calibration[0]["query_tokens"] == 4
        if label != "hf-greedy":  # every step commits accepted + 1 tokens
            hist = cell.accepted_histogram
            assert sum(hist) == cell.steps and sum(k * c for k, c in enumerate(hist)) + cell.steps == cell.new_tokens
    rows = summarise(cells)
    by = {(r["drafter"], r["category"]): r for r in rows}
    for category in PROMPTS:
        plain = by[("plain", category)]
        assert plain["predicted_speedup"] is None and plain["acceptance_per_depth"] == []
        dm = by[("draft-model", category)]
        assert dm["speedup_vs_plain"] > 0 and dm["speedup_vs_hf"] > 0 and dm["decode_speedup_vs_plain"] > 0
        _check_prediction(dm)
    written = write_reports(rows, tmp_path, {"model": "tiny"})
    assert all(p.exists() and p.stat().st_size > 0 for p in written)
    md = (tmp_path / "report.md").read_text()
    assert "draft-model" in md and "accepted-length histogram" in md and "c_verify(n)" in md
    assert "| plain | 1.00 |" in md and "| 0:48 |" in md
    assert json.loads((tmp_path / "report.json").read_text())["rows"]
    # resume: a finished cell is kept as it is (not measured again: same bytes), a missing one is rerun;
    # tests/test_eval_resume.py checks that an edited or unsound cell is refused
    marker = cell_path(tmp_path, "ngram", "rep")
    finished = marker.read_bytes()
    cell_path(tmp_path, "plain", "mixed").unlink()
    again = run_suite(loaded, PROMPTS, cfg, tmp_path, resume=True)
    assert marker.read_bytes() == finished and again[("ngram", "rep")].steps == cells[("ngram", "rep")].steps
    assert again[("plain", "mixed")].new_tokens == 48
    # other settings must not be merged into the finished cells
    longer = dataclasses.replace(cfg, max_new_tokens=25)
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_suite(loaded, PROMPTS, longer, tmp_path, resume=True)
    other_prompts = {**PROMPTS, "rep": [[1, 2, 3], [5, 6, 5, 6, 5]]}
    with pytest.raises(ValueError, match="prompts_sha256"):
        run_suite(loaded, other_prompts, cfg, tmp_path, resume=True)
    assert marker.read_bytes() == finished  # nothing was overwritten


def test_rank_files_merge_to_the_single_process_numbers(tmp_path, loaded):
    """What `accelerate launch --num_processes 2` writes (a .rank<r> file per process) merges to one run's counts."""
    cfg = SuiteConfig((("ngram", {}), _oracle(loaded, 2)), tuple(PROMPTS), prompts_per_category=2, max_new_tokens=12,
                      hf_baseline=False, calibration_repeats=1)
    run_cells(loaded, PROMPTS, cfg, tmp_path / "one")
    single = merge_cells(tmp_path / "one", cfg.labels, list(PROMPTS), 1)
    for rank in (0, 1):  # split_between_processes gives each process a contiguous slice
        shard = {c: ps[rank : rank + 1] for c, ps in PROMPTS.items()}
        run_cells(loaded, shard, cfg, tmp_path / "two", rank=rank)
    assert cell_path(tmp_path / "two", "ngram", "rep", 1).exists()
    merged = merge_cells(tmp_path / "two", cfg.labels, list(PROMPTS), 2)
    assert set(merged) == set(single)
    for key, cell in single.items():
        for name in COUNTS:
            assert getattr(merged[key], name) == getattr(cell, name), (key, name)
        assert merged[key].tau == cell.tau and merged[key].acceptance_per_depth == cell.acceptance_per_depth
        assert len(merged[key].calibration) == (0 if key[0] == "plain" else 2)
    rows = summarise(merged)
    assert all(r["predicted_speedup"] is not None for r in rows if r["drafter"] != "plain")


def test_sampling_and_batches_through_run_suite(tmp_path, loaded, monkeypatch):
    cfg = SuiteConfig((_oracle(loaded), ("ngram", {})), ("rep",), prompts_per_category=3, max_new_tokens=16,
                      temperature=0.8, batch_size=2, hf_baseline=True, seed=1, calibration_repeats=2)
    prompts = {"rep": PROMPTS["rep"] + [[7, 8, 7, 8, 7, 8]]}  # batches of 2 and 1
    warmed = []  # on CUDA the target's graphs are sized for every call of the run before the first cell
    monkeypatch.setattr("specdec.eval.acceptance.warm_up_model_graphs", lambda *args: warmed.append(args[1:]))
    import specdec.eval.acceptance as suite

    calls, generate = [], suite.generate

    def recorded(*args, **kwargs):
        calls.append((kwargs["max_new_tokens"], kwargs.get("speculation"), kwargs.get("drafter") is None))
        return generate(*args, **kwargs)

    monkeypatch.setattr(suite, "generate", recorded)
    graphed = []  # and its verify costs are timed as generate() verifies: through graphs where "auto" uses them
    measure = suite.measure_verify_costs
    monkeypatch.setattr(suite, "auto_uses_graphs", lambda runner: "as auto decides")
    monkeypatch.setattr(suite, "measure_verify_costs",
                        lambda *a, graphs=False, **k: graphed.append(graphs) or measure(*a, **k))
    cells = run_suite(loaded, prompts, cfg, tmp_path)
    assert warmed == [([[8, 5], [6]], 16)]
    assert graphed and set(graphed) == {"as auto decides"}
    # the warm-up runs as the cells do (whole trees): a guarded warm-up left the first cell its first tree verify;
    # plain cells set no speculation (generate() would warn that it is ignored without a drafter)
    assert [c for c in calls if c[0] == 4] == [(4, "auto", True)] + [(4, "always", False)] * 2
    assert {c[1:] for c in calls} == {("auto", True), ("always", False)}
    assert set(cells) == {("plain", "rep"), ("draft-model", "rep"), ("ngram", "rep")}  # no HF baseline when sampling
    plain, oracle = cells[("plain", "rep")], cells[("draft-model", "rep")]
    assert plain.new_tokens == oracle.new_tokens == cells[("ngram", "rep")].new_tokens == 48
    assert plain.tau == 1.0 and plain.accepted_histogram == [48] and plain.acceptance_per_depth == []
    assert plain.forward_passes == 32  # 16 steps for the batch of two, 16 for the single prompt
    # sampled drafts from the target itself: min(1, target_probs / draft_probs) = 1 up to float noise
    assert oracle.tau > 2.5 and min(oracle.acceptance_per_depth) > 0.9
    assert oracle.forward_passes < oracle.steps <= 2 * oracle.forward_passes
    assert oracle.calibration[0]["batch"] == 2
    row = next(r for r in summarise(cells) if r["drafter"] == "draft-model")
    _check_prediction(row)


def test_verify_costs_are_measured_per_query_size(loaded):
    costs = measure_verify_costs(loaded.runner, PROMPTS["rep"], (1, 5, 5), SamplingConfig(), extra_context=8, repeats=2)
    assert set(costs) == {1, 5} and all(0 < c < 5 for c in costs.values())
    with pytest.raises(ValueError, match="repeats"):
        measure_verify_costs(loaded.runner, PROMPTS["rep"], (1,), SamplingConfig(), repeats=0)


def test_verify_cost_steps_commit_one_token_each(monkeypatch):
    """c(n) prices the verify of n tokens: a random-weight target, which repeats its last token, accepted a chain of
    root copies whole, so each calibration step committed n tokens; the chain is now rejected at its first node."""
    from specdec import engine as engine_module
    from specdec.models.loader import load_model

    loaded = load_model("synthetic:llama-3.2-1b@tiny", device="cpu")
    committed, commit = [], engine_module.Engine.commit

    def spy(self, live, acceptances):
        committed.extend(len(a.accepted_tokens) for a in acceptances)
        return commit(self, live, acceptances)

    monkeypatch.setattr(engine_module.Engine, "commit", spy)
    measure_verify_costs(loaded.runner, [[3, 14, 15, 92, 65, 35]], (1, 9, 33), SamplingConfig(), repeats=1)
    assert len(committed) == 6 and committed == [0] * 6


def test_old_cell_files_stay_readable(tmp_path):
    """Cells of an earlier run hold a `histogram` of committed tokens per step and no calibration."""
    old = {"drafter": "ngram", "category": "chat", "prompts": 1, "new_tokens": 10, "steps": 4, "seconds": 1.0,
           "draft_seconds": 0.1, "verify_seconds": 0.8, "depth_tried": [4, 2], "depth_accepted": [2, 2],
           "histogram": [0, 2, 0, 0, 2]}
    path = tmp_path / "cells" / "ngram__chat.json"
    path.parent.mkdir()
    path.write_text(json.dumps(old))
    cell = read_cell(path)
    assert cell.accepted_histogram == [2, 0, 0, 2] and cell.tau == 2.5
    assert predicted_speedup(cell) is None
    plain = Cell("plain", "chat", 1, 10, 10, 10, 2.0, accepted_histogram=[10])
    rows = summarise({("plain", "chat"): plain, ("ngram", "chat"): cell})
    assert rows[1]["predicted_speedup"] is None and rows[1]["speedup_vs_plain"] == 2.0
    assert rows[1]["decode_speedup_vs_plain"] is None and rows[1]["mean_tree_nodes"] is None
    assert "| 0:2 3:2 |" in markdown(rows, {})
    assert rows[1]["identical_to_plain"] is None  # no record of their tokens
    # a checked cell of the previous schema (no output digest): read for reports, refused by a resume
    sealed = {"schema": "specdec-acceptance-cell/2", "settings_sha256": "0" * 64, "rank": None,
              "cell": {k: v for k, v in dataclasses.asdict(plain).items() if k != "output_sha256"}, "sha256": "x"}
    path.write_text(json.dumps(sealed))
    assert read_cell(path).new_tokens == 10 and read_cell(path).output_sha256 == NO_OUTPUTS
    with pytest.raises(ValueError, match="schema"):
        read_cell(path, settings_sha256="0" * 64)


def test_suite_config_rejects_bad_values():
    with pytest.raises(ValueError, match="baseline"):
        SuiteConfig((("plain", {}),), ("chat",))
    with pytest.raises(ValueError, match="calibration_repeats"):
        SuiteConfig((("ngram", {}),), ("chat",), calibration_repeats=-1)
    with pytest.raises(ValueError, match="temperature"):
        SuiteConfig((("ngram", {}),), ("chat",), temperature=-0.5)
    with pytest.raises(ValueError, match="speculation"):
        SuiteConfig((("ngram", {}),), ("chat",), speculation="sometimes")
    for bad in ("prompts_per_category", "max_new_tokens", "batch_size"):  # 0 of any: a run of nothing (or range step 0)
        with pytest.raises(ValueError, match="batch_size must be >= 1"):
            SuiteConfig((("ngram", {}),), ("chat",), **{bad: 0})


def test_the_suite_runs_the_default_policy_when_asked_and_records_it(tmp_path, loaded, monkeypatch):
    """``speculation="auto"``: every call of a drafter's cells (its warm-up too) runs generate()'s default policy, and
    the run's settings say so (a resume under the other policy is refused); "always" (the default) keeps the digest
    of runs from before the choice existed."""
    import specdec.eval.acceptance as suite
    from specdec.eval.resume import run_settings

    seen = []
    generate = suite.generate
    monkeypatch.setattr(suite, "generate", lambda *a, **kw: seen.append(kw["speculation"]) or generate(*a, **kw))
    base = dict(prompts_per_category=1, max_new_tokens=6, hf_baseline=False, calibration_repeats=0)
    auto = SuiteConfig((("ngram", {}),), ("rep",), speculation="auto", **base)
    run_suite(loaded, {"rep": PROMPTS["rep"][:1]}, auto, tmp_path / "auto")
    assert seen and set(seen) == {"auto"}
    always = SuiteConfig((("ngram", {}),), ("rep",), **base)
    settings = {k: run_settings({}, [], c, 1, {}) for k, c in (("auto", auto), ("always", always))}
    assert settings["auto"]["speculation"] == "auto" and "speculation" not in settings["always"]


def test_one_drafter_twice_under_two_row_labels(tmp_path, loaded):
    """Two rows of one drafter with other options (two checkpoints side by side), each its own cell."""
    one, two = ("one", _oracle(loaded, 1)[1]), ("two", _oracle(loaded, 3)[1])
    cfg = SuiteConfig((one, two), ("rep",), prompts_per_category=1, max_new_tokens=12, hf_baseline=False,
                      calibration_repeats=0, renamed=(("one", "draft-model"), ("two", "draft-model")))
    cells = run_suite(loaded, {"rep": PROMPTS["rep"][:1]}, cfg, tmp_path)
    assert set(cells) == {("plain", "rep"), ("one", "rep"), ("two", "rep")}
    # the target drafting for itself: every node accepted, so a step commits num_draft_tokens + 1 tokens
    assert cells["one", "rep"].steps > cells["two", "rep"].steps
    with pytest.raises(ValueError, match="given twice"):
        SuiteConfig((one, one), ("rep",), renamed=(("one", "draft-model"),))
    with pytest.raises(ValueError, match="not among the drafters"):
        SuiteConfig((one,), ("rep",), renamed=(("three", "draft-model"),))


@pytest.mark.parametrize("argv, message", [
    (["--drafters", "ngram,nope"], "unknown drafter(s) nope; available: "),
    (["--drafters", "a=ngram,b=nope"], "unknown drafter(s) nope; available: "),
    (["--categories", "chat,poetry"], "unknown categories poetry; available: chat, code"),
    (["--prompts", "0"], "must be >= 1"),
])
def test_cli_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, argv, message):
    from specdec.cli import main

    assert main(["eval", "acceptance", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert "specdec eval acceptance: error:" in err and message in err
    assert not any(tmp_path.iterdir())  # nothing was run or written


@pytest.mark.parametrize("speculation", ["always", "auto"])
def test_cli_speculation_reaches_the_suite_config(tmp_path, capsys, monkeypatch, speculation):
    """The suite's config is built before the model loads (here none exists, so the run stops there)."""
    import importlib

    from specdec.cli import main

    module = importlib.import_module("specdec.eval.cli")
    real, seen = module._suite_config, []
    monkeypatch.setattr(module, "_suite_config", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    main(["eval", "acceptance", "--model", str(tmp_path / "no-model"), "--drafters", "ngram", "--speculation",
          speculation, "--no-plots", "--no-hf-baseline", "--out", str(tmp_path / "out")])
    capsys.readouterr()
    assert [c.speculation for c in seen] == [speculation]


def test_every_category_ships_20_prompts():
    for category in CATEGORIES:
        prompts = load_prompts(category, 20)
        assert len(prompts) == 20 and len(set(prompts)) == 20, category


def test_a_retrieval_prompt_holds_a_document_of_at_most_3000_characters():
    """pydoc's topics run to 50,000 characters ("compound"); the built-in retrieval prompts take those of 800 to 3000
    only, so no document in them is longer than 3000 (nor, stripped, than the 1000 a narrower window allows)."""
    def documents(prompts):
        return [p.split("Document:\n", 1)[1].split("\n\nQuestion: ", 1)[0] for p in prompts]

    assert all(len(d) <= 3000 for d in documents(retrieval_augmented(20)))
    narrow = documents(retrieval_augmented(20, min_chars=800, max_chars=1000))
    assert narrow and all(len(d) <= 1000 for d in narrow)


def test_prompt_file_and_unknown_category(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"text": "world"}\n')
    assert [c.turns for c in read_prompt_file(path)] == [("hello",), ("world",)]
    with pytest.raises(ValueError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown prompt category"):
        load_prompts("poetry")


def test_coupled_sampler_reaches_every_cell(tmp_path, loaded, monkeypatch):
    """``--sampler coupled``: every generate() call of the suite samples coupled, and a bad sampler is refused."""
    import specdec.eval.acceptance as acceptance

    seen = []
    real = acceptance.generate

    def spy(*args, **kwargs):
        seen.append((kwargs.get("sampler"), kwargs.get("do_sample"), kwargs.get("top_k")))
        return real(*args, **kwargs)

    monkeypatch.setattr(acceptance, "generate", spy)
    cfg = SuiteConfig((("ngram", {}),), ("rep",), prompts_per_category=1, max_new_tokens=8, temperature=0.8,
                      calibration_repeats=0, sampler="coupled")
    cells = run_suite(loaded, {"rep": PROMPTS["rep"][:1]}, cfg, tmp_path)
    assert set(cells) == {("plain", "rep"), ("ngram", "rep")} and seen
    assert set(seen) == {("coupled", True, 0)}  # the full distribution at 0.8, not generate()'s default top-k 50
    with pytest.raises(ValueError, match="sampler"):
        dataclasses.replace(cfg, sampler="gumbel")


def test_hf_baseline_runs_the_cells_batches_and_gives_their_tokens(tmp_path, loaded, monkeypatch):
    """At --batch-size 2 the vs-HF ratio compares like with like: transformers' generate() gets the same batches as
    specdec's cells (left-padded, masked), and its greedy tokens are those of one prompt at a time."""
    from specdec.eval.acceptance import hf_greedy_batch

    prompts = PROMPTS["rep"] + PROMPTS["mixed"][:1]  # three prompts of lengths 8, 5, 4
    alone = [hf_greedy_batch(loaded.model, [p], 10)[0] for p in prompts]
    assert hf_greedy_batch(loaded.model, prompts, 10) == alone and all(len(t) > 0 for t in alone)
    monkeypatch.setattr(loaded.model.generation_config, "eos_token_id", alone[1][0])  # the second prompt stops
    assert hf_greedy_batch(loaded.model, prompts, 10) == [alone[0], alone[1][:1], alone[2]]
    monkeypatch.undo()
    shapes, generate = [], loaded.model.generate
    monkeypatch.setattr(loaded.model, "generate", lambda ids, **kw: shapes.append(tuple(ids.shape)) or
                        generate(ids, **kw))
    cfg = SuiteConfig((("ngram", {}),), ("rep",), prompts_per_category=3, max_new_tokens=10, batch_size=2,
                      calibration_repeats=0)
    run_cells(loaded, {"rep": prompts}, cfg, tmp_path)
    assert shapes == [(1, 8), (2, 8), (1, 4)]  # a warm-up call, then the cells' batches
    assert read_cell(cell_path(tmp_path, "hf-greedy", "rep")).new_tokens == sum(map(len, alone))


def test_every_summary_field_from_hand_built_cells():
    """Each derived number of a row, on cells whose prefill, draft and verify times differ (inverted ratios, a
    prefill left in the decode time, a share or a mean over the wrong count passed every test); identical_to_plain
    is None when plain's tokens were not recorded, and the report prints NO for a row that differs."""
    from specdec.eval.acceptance import Cell, summarise
    from specdec.eval.report import markdown

    plain = Cell("plain", "c", prompts=2, new_tokens=100, steps=100, forward_passes=100, seconds=10.0,
                 prefill_seconds=2.0, output_sha256="aa")
    hf = Cell("hf-greedy", "c", prompts=2, new_tokens=100, seconds=4.0)
    ngram = Cell("ngram", "c", prompts=2, new_tokens=100, steps=50, forward_passes=50, seconds=5.0,
                 prefill_seconds=3.0, draft_seconds=1.0, verify_seconds=3.0, drafts=40, draft_nodes=200,
                 output_sha256="bb")
    row = {r["drafter"]: r for r in summarise({("plain", "c"): plain, ("ngram", "c"): ngram,
                                               ("hf-greedy", "c"): hf})}["ngram"]
    assert row["speedup_vs_plain"] == pytest.approx(2.0) and row["speedup_vs_hf"] == pytest.approx(0.8)
    assert row["decode_speedup_vs_plain"] == pytest.approx(4.0)  # (100 / 2 s) / (100 / 8 s)
    assert row["draft_share"] == pytest.approx(0.25) and row["mean_tree_nodes"] == pytest.approx(5.0)
    assert row["identical_to_plain"] is False
    line = next(x for x in markdown([row], {}).splitlines() if x.startswith("| ngram"))
    assert "| NO |" in line, line
    unknown = Cell("plain", "c", prompts=2, new_tokens=100, steps=100, seconds=10.0)  # tokens not recorded
    same = dataclasses.replace(ngram, output_sha256="aa")
    assert summarise({("plain", "c"): unknown, ("ngram", "c"): same})[-1]["identical_to_plain"] is None


def test_predicted_over_measured_is_the_prediction_divided_by_the_measured_speedup():
    """tau 2, c_plain 0.01 s, c_verify 0.02 s, c_draft 1 s / 50 forwards = 0.02 s: predicted 2 * 0.01 / 0.04 = 0.5;
    measured (100 / 5 s) / (100 / 10 s) = 2.0; so pred/meas = 0.25 (inverted it printed 4.00)."""
    plain = Cell("plain", "c", prompts=1, new_tokens=100, steps=100, forward_passes=100, seconds=10.0)
    ngram = Cell("ngram", "c", prompts=1, new_tokens=100, steps=50, forward_passes=50, seconds=5.0, draft_seconds=1.0,
                 drafts=50, draft_nodes=250,
                 calibration=[{"query_tokens": 6, "plain_seconds": 0.01, "verify_seconds": 0.02}])
    row = summarise({("plain", "c"): plain, ("ngram", "c"): ngram})[-1]
    assert row["predicted_speedup"] == pytest.approx(0.5) and row["speedup_vs_plain"] == pytest.approx(2.0)
    assert row["predicted_over_measured"] == pytest.approx(0.25)


def test_merging_cells_sums_their_counts_and_keeps_the_row_and_category():
    """Two rank files of one cell: 10 + 6 tokens over 5 + 3 steps (tau 16 / 8 = 2.0), depth counts added per depth;
    the merged cell still names its drafter and category (not "cc" from adding the names)."""
    merged = Cell("ngram", "c")
    merged.merge(Cell("ngram", "c", new_tokens=10, steps=5, depth_tried=[4, 2], depth_accepted=[3, 1]))
    merged.merge(Cell("ngram", "c", new_tokens=6, steps=3, depth_tried=[2], depth_accepted=[1]))
    assert (merged.drafter, merged.category) == ("ngram", "c")
    assert merged.tau == pytest.approx(2.0) and merged.depth_tried == [6, 2] and merged.depth_accepted == [4, 1]


def test_the_hf_baseline_row_has_no_drafter_columns():
    """transformers' baseline drafts nothing: its row has no draft share or tree size (it showed a 0% draft share)."""
    plain = Cell("plain", "c", prompts=1, new_tokens=10, steps=10, seconds=2.0)
    hf = Cell("hf-greedy", "c", prompts=1, new_tokens=10, seconds=1.0)
    rows = {r["drafter"]: r for r in summarise({("plain", "c"): plain, ("hf-greedy", "c"): hf})}
    assert rows["hf-greedy"]["speedup_vs_plain"] == pytest.approx(2.0)  # (10 / 1 s) / (10 / 2 s)
    for label in ("plain", "hf-greedy"):
        assert "draft_share" not in rows[label] and "mean_tree_nodes" not in rows[label]


def _stats(steps: int, step_nodes: tuple[int, ...] = ()):
    from specdec.output import SequenceStats

    return SequenceStats(3, steps, steps, 1.0, 1.0, float(steps), "length", (), step_lengths=(1,) * steps,
                         step_nodes=step_nodes)


def _output(stats):
    from types import SimpleNamespace

    return SimpleNamespace(stats=stats, prefill_seconds=0.0, draft_seconds=0.0, verify_seconds=0.0,
                           forward_passes=sum(s.steps for s in stats), new_tokens=[[1] * s.new_tokens for s in stats])


def test_steps_without_a_proposed_tree_count_as_plain_steps_in_the_size_histogram():
    """6 sequence steps, 3 proposed trees of 3 nodes, no per-step sizes from the engine: 3 steps of 0 nodes and 3 of
    3, so the histogram is [3, 0, 0, 3] (without the padding the plain steps went unpriced: [0, 0, 0, 3])."""
    cell = Cell("ngram", "c")
    cell.add(_output([_stats(6)]), 1.0, drafts=3, draft_nodes=9, step_nodes=[3, 3, 3])
    assert cell.step_nodes_histogram == [3, 0, 0, 3]


def test_the_engines_verified_step_sizes_win_over_the_proposed_tree_sizes():
    """Trees of 5 nodes proposed, cut to 2 by the engine's budget: the 2 steps verified 2 nodes each, so the
    histogram is [0, 0, 2], not [0, 0, 0, 0, 0, 2]."""
    cell = Cell("ngram", "c")
    cell.add(_output([_stats(2, step_nodes=(2, 2))]), 1.0, drafts=2, draft_nodes=10, step_nodes=[5, 5])
    assert cell.step_nodes_histogram == [0, 0, 2]


def test_the_calibration_batch_is_the_prompts_around_the_median_length():
    """Lengths 2, 4, ..., 14 and batches of 3: the middle three are 6, 8 and 10 (start (7 - 3) // 2 = 2)."""
    from specdec.eval.acceptance import _median_batch

    prompts = [[1] * n for n in (14, 2, 10, 6, 12, 4, 8)]
    assert [len(p) for p in _median_batch(prompts, 3)] == [6, 8, 10]


def test_a_calibration_records_the_mean_decoding_context(monkeypatch):
    """Prompts of 4 and 6 tokens and max_new_tokens 10: mean prompt 5 + half the answer 5 = 10 context tokens."""
    from types import SimpleNamespace

    import specdec.eval.acceptance as acceptance

    monkeypatch.setattr(acceptance, "auto_uses_graphs", lambda runner: False)
    monkeypatch.setattr(acceptance, "measure_verify_costs",
                        lambda runner, batch, sizes, *args, **kwargs: {n: 0.01 * n for n in sizes})
    cell = Cell("ngram", "c", drafts=1, draft_nodes=2, step_nodes_histogram=[0, 0, 1])
    config = SuiteConfig((("ngram", {}),), ("c",), max_new_tokens=10)
    runner = SimpleNamespace(shape=SimpleNamespace(max_positions=4096))
    acceptance._calibrate(SimpleNamespace(runner=runner), cell, [[1] * 4, [1] * 6], config)
    assert cell.calibration[0]["context_tokens"] == 10.0
    assert {c["context_tokens"] for c in cell.size_calibration} == {10.0}


def test_a_calibration_past_the_context_leaves_the_cell_unpriced_with_a_warning(caplog):
    """Timing a cell's verify steps grows one context by (--calibration-repeats + 1) rounds of its sizes: on a
    short-context model measure_verify_costs refused ("the model's context (64) is too short to calibrate [1, 7,
    ...]") after the cell was measured, ending the run. Runs of sizes are cut to the context; where one size's rounds
    alone do not fit, the cell has no predicted speedup and a warning says why and which repeats fit."""
    import specdec.eval.acceptance as acceptance

    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    loaded = load_model(build_tiny_model(vocab_size=16, max_position_embeddings=64))
    batch = [[1, 2, 3, 4]]
    for repeats, priced in ((5, False), (2, True)):  # sizes 1, 7, 10, 11, 17: 6 x 17 + 3 > 64 >= 3 x 17 + 3
        cell = Cell("ngram", "c", drafts=1, draft_nodes=6, step_nodes_histogram=[1] + [0] * 5 + [1, 0, 0, 1, 1, 0, 0,
                                                                                            0, 0, 0, 1])
        config = SuiteConfig((("ngram", {}),), ("c",), max_new_tokens=4, calibration_repeats=repeats)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specdec.eval.acceptance"):
            acceptance._calibrate(loaded, cell, batch, config)
        assert bool(cell.calibration) == priced
        assert ("ngram / c: no predicted speedup: timing its verify steps of 17 query tokens, 6 rounds on one context "
                "(--calibration-repeats 5 and a warm-up), needs 105 tokens, more than the model's context of 64 "
                "tokens; --calibration-repeats 2 fits" in caplog.text) != priced


def test_sigterm_ends_the_process_at_once_while_the_process_group_forms(monkeypatch):
    """The first process_state() forms the process group, a wait in C++ for every process where the Ctrl-C path's
    handler cannot run (a peer killed before it joined left the others to the launcher's SIGKILL, 30 s later):
    SIGTERM keeps its default action there, and the handler is back after."""
    import accelerate

    seen = []
    monkeypatch.setattr(accelerate, "PartialState", lambda **kw: seen.append(signal.getsignal(signal.SIGTERM)))
    with sigterm_as_interrupt():
        handler = signal.getsignal(signal.SIGTERM)
        process_state()
        assert signal.getsignal(signal.SIGTERM) is handler
    assert seen == [signal.SIG_DFL]
