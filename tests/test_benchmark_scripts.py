"""The CPU benchmark scripts' own logic, no model loaded: result files never silently replaced, one-line errors,
warm-ups outside the timed calls, identity against plain decoding's tokens, what the result files say."""
from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import specdec.drafters.draft_model  # noqa: F401 -- imported (binding the real load_model) before a test fakes it
import specdec.eval.bitwise_level  # noqa: F401
import torch

import specdec.generate  # noqa: F401
from tests.script_loading import load_script

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
BARE = ("common", "drafter_grid", "held_out_prompts", "step_profile")  # what the scripts import by bare names


def _script(name: str):
    return load_script(name, "_scripts_under_test")


@pytest.fixture(autouse=True)
def _forget_bare_modules():
    yield
    torch.set_grad_enabled(True)  # the mains switch it off
    for name in [n for n in sys.modules if n.endswith("_scripts_under_test")] + list(BARE):
        sys.modules.pop(name, None)


def _measured(*args, **kwargs):
    raise AssertionError("measured before the arguments were checked")


def _run(module, argv: list[str], monkeypatch):
    """``module.main`` with ``argv`` (as sys.argv too, for the mains that read it)."""
    monkeypatch.setattr(sys, "argv", ["script", *argv])
    return module.main(argv) if inspect.signature(module.main).parameters else module.main()


# script, its arguments that write the result file (str.format'ed with {out}), what measures first in it
WRITERS = [
    ("bench_ngram_cpu", ["--json", "{out}"], "load_model"),
    ("bench_eagle_cpu", ["--eagle-path", "e", "--json", "{out}"], "load_model"),
    ("bench_medusa_vocab_cpu", ["--json", "{out}"], "load_model"),
    ("bench_drafters_cpu", ["--json", "{out}"], "load_model"),
    ("bench_drafters_cpu", ["--grid", "--out", "{out}"], "load_model"),
    ("bench_policy_host", ["--json", "{out}"], "measure"),
    ("bench_invariant_cpu", ["--out", "{out}"], "specdec.models.loader.load_model"),
    ("bench_speed_gpu", ["--rehearse", "--out", "{dir}"], "copy_bandwidth"),
    ("bench_coupled_cpu", ["--out", "{dir}", "--part", "tau"], "load_model"),
]


@pytest.mark.parametrize("name,argv,first", WRITERS, ids=[f"{w[0]} {w[1][-2]}" for w in WRITERS])
def test_an_existing_result_file_is_refused_before_anything_is_measured(name, argv, first, tmp_path, monkeypatch,
                                                                         capsys):
    module = _script(name)
    if "." in first:
        monkeypatch.setattr(first, _measured)
    else:
        monkeypatch.setattr(module, first, _measured)
    for existing in ("x.json", "speed.json", "coupled-tau.json"):
        (tmp_path / existing).write_text("{}")
    args = [a.format(out=tmp_path / "x.json", dir=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        _run(module, args, monkeypatch)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("exists; pass --overwrite to replace it"), err
    with pytest.raises(AssertionError, match="measured"):  # --overwrite: on to the measurement
        _run(module, args + ["--overwrite"], monkeypatch)


@pytest.mark.parametrize("name,argv", [
    ("bench_verify_cost", ["--sizes", "0,2"]), ("bench_verify_cost", ["--sizes", "a"]),
    ("bench_policy_host", ["--rounds", "0"]), ("bench_medusa_vocab_cpu", ["--speculation", "bogus"]),
])
def test_bad_arguments_are_one_line_errors(name, argv, monkeypatch, capsys):
    module = _script(name)
    for first in ("load_model", "measure"):
        if hasattr(module, first):
            monkeypatch.setattr(module, first, _measured)
    with pytest.raises(SystemExit) as exit_:
        _run(module, argv, monkeypatch)
    assert exit_.value.code == 2 and "error: " in capsys.readouterr().err


def _fake_loaded():
    tokenizer = SimpleNamespace(apply_chat_template=lambda messages, **kw: [len(messages[0]["content"]) % 50, 7])
    return SimpleNamespace(tokenizer=tokenizer, name="fake", model=SimpleNamespace(dtype=torch.float32))


def test_eagle_rows_are_checked_against_plain_decoding_and_counted_per_prompt(tmp_path, monkeypatch):
    """The order rotates per prompt and repeat: a row that runs first is no reference; a prompt that differs in
    every repeat counts once."""
    bench = _script("bench_eagle_cpu")
    monkeypatch.setattr(bench, "load_model", lambda name: _fake_loaded())

    def run(loaded, ids, max_new_tokens, drafter=None, **kw):
        tokens = [1, 2, 4] if drafter == "ngram" else [1, 2, 3]  # n-gram alone differs from plain
        stats = SimpleNamespace(steps=2, depth_tried=[1], depth_accepted=[1])
        return 1.0, SimpleNamespace(stats=[stats], new_tokens=[tokens])

    monkeypatch.setattr(bench, "time_specdec", run)
    out = tmp_path / "eagle.json"
    _run(bench, ["--eagle-path", "e", "--categories", "chat", "--prompts", "3", "--repeats", "2", "--json", str(out)],
         monkeypatch)
    rows = json.loads(out.read_text())["categories"]["chat"]
    assert {k: r["prompts_differing_from_plain"] for k, r in rows.items()} == {
        "plain": 0, "plain (again)": 0, "ngram": 3, "eagle": 0, "ngram+eagle": 0}


def test_invariant_benchmark_warms_each_mode_up_untimed_and_names_this_machine(tmp_path, monkeypatch):
    """A mode's first call pays one-time setup: the warm-up's, not a timed prompt's. The calls run on a scripted
    clock, which only the setup moves (slept, and the rest timed on the wall, a loaded worker's stall failed it)."""
    import specdec.eval.bitwise_level as bitwise_level

    import specdec.models.loader

    bench = _script("bench_invariant_cpu")
    first, now = set(), [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def setup(key):
        if key not in first:
            first.add(key)
            now[0] += 0.3

    def plain_outputs(loaded, prompts, tokens, invariant, sampling):
        setup(("plain", invariant))
        return [([1, 2, 3], None) for _ in prompts]

    def generate(loaded, prompts, max_new_tokens, drafter=None, invariant=False, **kw):
        setup((drafter, invariant))

    identity = SimpleNamespace(tokens_compared=3, tau=1.0, divergences=[])
    monkeypatch.setattr(specdec.models.loader, "load_model", lambda *a, **kw: _fake_loaded())
    monkeypatch.setattr(bitwise_level, "plain_outputs", plain_outputs)
    monkeypatch.setattr(bitwise_level, "bitwise_identity", lambda *a, **kw: identity)
    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", generate)  # the module, not
    # specdec.generate, the function specdec exports
    out = tmp_path / "inv.json"
    assert _run(bench, ["--prompts", "2", "--tokens", "3", "--drafters", "ngram", "--default-drafters", "ngram",
                        "--alone", "1", "--out", str(out)], monkeypatch) == 0
    result = json.loads(out.read_text())
    assert all(s == 0 for row in result["speed_seconds"].values() for s in row.values()), result["speed_seconds"]
    assert "plain_seconds" not in result and "torch thread" in result["machine"]
    assert result["machine"] != "2-core Xeon (AVX-512, no bf16 instructions)"


def test_draft_share_is_of_wall_seconds_whatever_the_clock():
    """--clock cpu times a call in CPU seconds; the engine times propose in wall seconds."""
    bench = _script("bench_drafters_cpu")
    totals = bench.Totals()
    out = SimpleNamespace(new_tokens=[[1, 2]], draft_seconds=0.5, verify_seconds=1.5, seconds=2.0,
                          stats=[SimpleNamespace(steps=2, step_nodes=[])])
    totals.add(0.1, out, None, False)  # 0.1 CPU seconds of a 2-second call
    assert totals.draft_share == pytest.approx(0.25)


def test_grid_result_counts_the_prompts_each_column_ran():
    """Columns run what their categories hold (held-out: 12 prompts), not always --prompts."""
    _script("bench_drafters_cpu")
    grid = sys.modules["drafter_grid"]
    text = grid.counts_text({"chat": 22, "held-out": 12, "batch8": 30}, 2)
    assert "chat 22" in text and "held-out 12" in text and "batch8: 30 ragged batches" in text
    assert "30 prompts" not in text and "60 blocks" not in text
    assert grid.counts_text({"chat": 3, "batch8": 3}, 2) == (
        "3 prompts per column; batch8: 3 ragged batches of 8; 2 repeat(s): each interval rests on 6 blocks.")


def test_each_drafter_grid_setting_is_its_own_benchmark():
    """Grids of one day that differ in drafters, columns or lengths are different benchmarks (the benchmarks page
    refuses two results of one benchmark that tie for latest); the keys are those of the committed grids."""
    _script("bench_drafters_cpu")
    grid = sys.modules["drafter_grid"]
    every = ["ngram", "draft-model", "self-draft", "medusa-untrained", "medusa", "eagle", "combined", "ngram+eagle"]
    columns = ["chat", "code", "summarisation", "qa", "math", "translation", "rag", "held-out", "batch8"]
    key = grid.benchmark_key
    assert key(["plain", "plain (again)"] + every, every, columns, [16, 32, 64, 128]) == "drafter-grid"
    assert key(every, every, columns, [16, 32]) == "drafter-grid-16-32"
    assert key(every, every, columns, [64, 128]) == "drafter-grid-64-128"
    assert key(["plain", "medusa"], every, columns, [16, 32, 64, 128]) == "drafter-grid-medusa"
    assert key(["ngram", "self-draft"], every, ["chat", "qa", "batch8"], [16, 64]) == (
        "drafter-grid-ngram-self-draft-chat-qa-batch8-16-64")
    committed = {json.loads(p.read_text())["benchmark"] for p in RESULTS.glob("*-drafter-grid-*.json")
                 if json.loads(p.read_text()).get("kind") != "history"}
    assert committed == {"drafter-grid-16-32", "drafter-grid-64-128", "drafter-grid-medusa"}
