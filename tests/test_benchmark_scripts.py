"""The CPU benchmark scripts' own logic, no model loaded: result files never silently replaced, one-line errors,
warm-ups outside the timed calls, identity against plain decoding's tokens, what the result files say."""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import math
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import specdec.drafters.draft_model  # noqa: F401 -- imported (binding the real load_model) before a test fakes it
import specdec.eval.bitwise_level  # noqa: F401
import torch
from specdec.drafters.eagle_checkpoint import EagleCheckpointError

import specdec.generate  # noqa: F401
from specdec import engine_setup
from specdec.models import row_policy
from specdec.sigterm import Terminated
from tests.script_loading import BENCHMARKS, load_file, load_script

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
BARE = ("common", "drafter_grid", "held_out_prompts", "step_profile")  # what the scripts import by bare names


def _script(name: str):
    return load_script(name, "_scripts_under_test")


@pytest.fixture(autouse=True)
def _forget_bare_modules(monkeypatch):
    # what scripts set for their process (count_launches: the Triton interpreter and backend) kept to the test
    for key in ("TRITON_INTERPRET", "SPECDEC_ATTENTION"):
        monkeypatch.setitem(os.environ, key, os.environ.get(key, ""))  # put back (or removed) after the test
        if not os.environ[key]:
            monkeypatch.delitem(os.environ, key)
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
    if "common" in sys.modules:  # --out needs a machine class (on an unnamed CPU: refused)
        monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: "cpu-avx512")
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
    # a folder where the file goes: --overwrite cannot help, and the write failed after the whole run
    folder = [a.format(out=tmp_path / "folder", dir=tmp_path / "folder") for a in argv]
    for existing in ("folder", "folder/speed.json", "folder/coupled-tau.json"):
        (tmp_path / existing).mkdir()
    with pytest.raises(SystemExit) as exit_:
        _run(module, folder + ["--overwrite"], monkeypatch)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("is a folder; give the result file's name")


@pytest.mark.parametrize("name,argv", [
    ("bench_verify_cost", ["--sizes", "0,2"]), ("bench_verify_cost", ["--sizes", "a"]),
    ("bench_policy_host", ["--rounds", "0"]), ("bench_medusa_vocab_cpu", ["--speculation", "bogus"]),
    ("bench_medusa_vocab_cpu", ["--prompts", "0"]), ("bench_medusa_vocab_cpu", ["--max-nodes", "0"]),
    # each refused before a model loads (they used to run into a traceback after some measuring)
    ("bench_eagle_cpu", ["--eagle-path", "e", "--repeats", "0"]),
    ("bench_eagle_cpu", ["--eagle-path", "e", "--repeats", "-2"]),
    ("bench_eagle_cpu", ["--eagle-path", "e", "--prompts", "0"]),
    ("bench_eagle_cpu", ["--eagle-path", "e", "--categories", "chat,bogus"]),
    ("bench_eagle_cpu", ["--eagle-path", "e", "--medusa-path", "heads/"]),  # NAME=DIR: a Medusa path of ''
    ("bench_eagle_cpu", ["--eagle-path", "e", "--temperature", "-1"]),
    ("bench_plain_cpu", ["--categories", "chat,bogus"]), ("bench_ngram_cpu", ["--categories", "bogus"]),
    # tracebacks: JSON's, the drafter's after the model loaded, transformers', and a ZeroDivisionError at the end
    ("bench_ngram_cpu", ["--drafter-options", "{bad"]), ("bench_ngram_cpu", ["--drafter-options", "[1]"]),
    ("bench_ngram_cpu", ["--drafter-options", '{"bogus": 1}']),
    ("bench_ngram_cpu", ["--drafter-options", '{"max_ngram": -1}']),
    ("bench_ngram_cpu", ["--lookup-tokens", "0"]), ("bench_ngram_cpu", ["--max-new-tokens", "1"]),
    ("bench_invariant_cpu", ["--drafters", "ngram,bogus"]), ("bench_invariant_cpu", ["--default-drafters", "bogus"]),
    ("bench_invariant_cpu", ["--alone", "0"]), ("bench_invariant_cpu", ["--batch", "0"]),
    ("bench_invariant_cpu", ["--threads", "0"]), ("bench_invariant_cpu", ["--prompts", "0"]),
    ("bench_coupled_cpu", ["--drafters", "bogus"]), ("bench_coupled_cpu", ["--prompts", "0"]),
    ("bench_coupled_cpu", ["--identity-prompts", "0"]), ("bench_coupled_cpu", ["--categories", "bogus"]),
    ("bench_coupled_cpu", ["--temperatures", "0.8,x"]), ("bench_coupled_cpu", ["--temperatures", "0"]),
    ("bench_host_overhead", ["--repeats", "0"]), ("bench_host_overhead", ["--batch1", "--repeats", "0"]),
    ("bench_host_overhead", ["--tokens", "0"]), ("bench_host_overhead", ["--batch1", "--tokens", "0"]),
    ("bench_drafters_cpu", ["--max-new-tokens", "0"]),
    # a traceback after every forward had been counted
    ("count_launches", ["--eagle", "6"]), ("count_launches", ["--eagle", "0,1"]), ("count_launches", ["--batch", "0"]),
    # an option of the other mode, which it would ignore
    ("bench_drafters_cpu", ["--out", "x.json"]), ("bench_drafters_cpu", ["--lengths", "16"]),
    ("bench_drafters_cpu", ["--grid", "--json", "x.json"]), ("bench_drafters_cpu", ["--grid", "--max-new-tokens", "8"]),
])
def test_bad_arguments_are_one_line_errors(name, argv, monkeypatch, capsys):
    module = _script(name)
    for first in ("load_model", "measure", "generate_with_control", "batch1"):
        if hasattr(module, first):
            monkeypatch.setattr(module, first, _measured)
    monkeypatch.setattr("specdec.models.loader.load_model", _measured)  # the one bench_invariant_cpu imports
    with pytest.raises(SystemExit) as exit_:
        _run(module, argv, monkeypatch)
    assert exit_.value.code == 2 and "error: " in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_verify_cost_context_the_model_cannot_hold_is_refused_not_shortened(monkeypatch, capsys):
    """measure_verify_costs keeps the last positions that fit, so ``--context 9000`` on an 8192-position model timed
    a shorter context and printed "context 9000"; past the vocabulary's size it was an IndexError traceback."""
    module = _script("bench_verify_cost")
    shape = SimpleNamespace(max_positions=64)
    monkeypatch.setattr(module, "load_model", lambda name: SimpleNamespace(runner=SimpleNamespace(shape=shape)))
    monkeypatch.setattr(module, "ensure_row_policy", _measured)
    with pytest.raises(SystemExit) as exit_:
        _run(module, ["--context", "48", "--reps", "2", "--sizes", "1,4"], monkeypatch)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "error: --context 48: the model holds 64 positions, and --reps 2 over --sizes 1,4 add 17: at most 47")
    with pytest.raises(AssertionError, match="measured"):  # what fits is measured
        _run(module, ["--context", "47", "--reps", "2", "--sizes", "1,4"], monkeypatch)


def test_drafters_options_of_each_mode_default_alike_and_grid_out_needs_a_machine_class(tmp_path, capsys,
                                                                                          monkeypatch):
    """The defaults trip no refusal; --grid --out on a CPU docs/gen_benchmarks.py names no class for is refused (its
    file would say machine_class null, which the benchmarks page refuses)."""
    bench = _script("bench_drafters_cpu")
    args = bench.parse_args([])[1]
    assert (args.max_new_tokens, args.out, args.json) == (96, None, None)
    assert bench.parse_args(["--grid"])[1].lengths == [16, 32, 64, 128]
    monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: None)  # as on an Intel CPU without AVX-512
    bench.parse_args(["--grid"])  # the tables alone: fine
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--grid", "--out", str(tmp_path / "grid.json")])
    assert exit_.value.code == 2 and "machine class" in capsys.readouterr().err
    assert not (tmp_path / "grid.json").exists()


def test_a_short_call_profile_out_needs_a_machine_class(tmp_path, capsys, monkeypatch):
    """profile_short_call.py --out on an unnamed CPU is refused before a model loads (it wrote machine_class null)."""
    profiler = _script("profile_short_call")
    monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: None)
    monkeypatch.setattr(profiler, "load_model", _measured)
    with pytest.raises(SystemExit) as exit_:
        profiler.main(["--out", str(tmp_path / "prof.json")])
    assert exit_.value.code == 2 and "machine class" in capsys.readouterr().err
    assert not (tmp_path / "prof.json").exists()


@pytest.mark.parametrize("argv,said", [
    (["--drafter", "bogus"], "--drafter: unknown drafter 'bogus'"),
    (["--category", "bogus"], "--category: unknown 'bogus'"),
    (["--prompts", "0"], "--prompts must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
])
def test_a_short_call_profile_refuses_what_it_cannot_run_before_a_model_loads(argv, said, capsys, monkeypatch):
    profiler = _script("profile_short_call")
    monkeypatch.setattr(profiler, "load_model", _measured)
    with pytest.raises(SystemExit) as exit_:
        profiler.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and said in err and "Traceback" not in err


@pytest.mark.parametrize("name,argv", [
    ("bench_drafters_cpu", ["--categories", "chat", "--machine-memory"]),
    ("bench_coupled_cpu", ["--part", "tau", "--out", "{dir}"]),
    ("count_launches", ["--eagle", ""]),
])
def test_a_model_that_is_not_there_is_a_one_line_error(name, argv, tmp_path, monkeypatch, capsys):
    # count_launches turns the CPU's row policy off and the Triton backend on for its process: kept to this test
    monkeypatch.setattr(engine_setup, "ensure_row_policy", engine_setup.ensure_row_policy)
    monkeypatch.setattr(row_policy, "uninstall", lambda: None)
    module = _script(name)
    argv = [a.format(dir=tmp_path) for a in argv] + ["--model", str(tmp_path / "no-model")]
    with pytest.raises(SystemExit) as exit_:
        _script("common").run_main(lambda: _run(module, argv, monkeypatch))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and err[-1].startswith("script: error: unknown model") and len(err) == 1


def test_an_eagle_checkpoint_that_is_not_there_is_a_one_line_error(monkeypatch, capsys):
    """bench_eagle_cpu.py ended in an EagleCheckpointError traceback (bench_drafters_cpu.py said it in one line)."""
    module = _script("bench_eagle_cpu")

    def specdec_call(loaded, ids, max_new_tokens, drafter=None, drafter_options=None, **kw):
        if drafter == "eagle":
            raise EagleCheckpointError(f"EAGLE checkpoint directory not found: {drafter_options['path']}")
        return _fake_specdec(loaded, ids, max_new_tokens)

    monkeypatch.setattr(module, "load_model", lambda name: _fake_loaded())
    monkeypatch.setattr(module, "time_specdec", specdec_call)
    with pytest.raises(SystemExit) as exit_:
        _script("common").run_main(
            lambda: _run(module, ["--eagle-path", "no-layer", "--categories", "chat", "--prompts", "1"], monkeypatch))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["script: error: EAGLE checkpoint directory not found: no-layer"] and exit_.value.code == 2
    assert torch.is_grad_enabled()  # switched back on, as after a finished run


def test_host_overhead_rows_are_timed_after_a_warm_up_and_plain_takes_no_speculation_setting(monkeypatch, capsys):
    """With --repeats 1 the first row (plain) was timed on the process's first call: 3720 us per sequence-step against
    208 once warm, slower than the drafters' rows; and plain's calls passed speculation="always", which generate()
    warned in the table's output that it ignored."""
    module = _script("bench_host_overhead")
    calls = []
    monkeypatch.setattr(module, "timed_engine", lambda seconds: None)  # no wrapping of the engine's methods here
    monkeypatch.setattr(module, "build_tiny_model", lambda **kw: "model")
    monkeypatch.setattr(module, "generate_with_control",
                        lambda model, prompts, exact, drafter=None, **kw: calls.append((len(prompts), drafter, kw)))
    _run(module, ["--sequences", "20", "--repeats", "1"], monkeypatch)
    assert [n for n, _, _ in calls] == [8, 20] * 3  # each row: an untimed warm-up, then the timed call
    assert [("speculation" in kw) == (drafter is not None) for _, drafter, kw in calls] == [True] * 6
    assert "plain" in capsys.readouterr().out


def _fake_specdec(loaded, ids, max_new_tokens, drafter=None, **kw):
    stats = SimpleNamespace(steps=2, depth_tried=[1], depth_accepted=[1], step_nodes=[1, 1])
    return 1.0, SimpleNamespace(stats=[stats], new_tokens=[[1, 2, 3]], prefill_seconds=0.1, seconds=1.0,
                                draft_seconds=0.1, verify_seconds=0.5)


POLICY_ROW = dict(batch=1, nodes=8, scored=False, size_ms=0.1, observe_ms=0.1, release_ms=0.1, kept_nodes=8.0,
                  padded_ms=0.1, kept_padded=8.0)
# script, its arguments (a small run), its measuring functions faked
JSON_WRITERS = [
    ("bench_eagle_cpu", ["--eagle-path", "e", "--categories", "chat", "--prompts", "1"],
     dict(time_specdec=_fake_specdec)),
    ("bench_ngram_cpu", ["--categories", "chat", "--prompts", "1"],
     dict(time_specdec=_fake_specdec, time_hf_generate=lambda m, ids, n, **kw: (1.0 if n > 1 else 0.1, [1, 2, 3]))),
    ("bench_drafters_cpu", ["--categories", "chat", "--prompts", "1", "--drafters", "ngram", "--machine-memory"],
     dict(time_specdec=_fake_specdec, load_cost_model=lambda runner: None)),
    ("bench_policy_host", ["--rounds", "1"], dict(measure=lambda *args: POLICY_ROW)),
    ("bench_medusa_vocab_cpu", ["--prompts", "1"],
     dict(time_specdec=_fake_specdec, builtin_prompt_tokens=lambda tok, n: [1, 2], MedusaDrafter=lambda **kw: None,
          untrained_heads=lambda loaded, ids=(): SimpleNamespace(config=SimpleNamespace(draft_size=len(ids) or 9)))),
]


@pytest.mark.parametrize("name,argv,fakes", JSON_WRITERS, ids=[w[0] for w in JSON_WRITERS])
def test_a_json_file_in_a_folder_not_there_yet_is_written(name, argv, fakes, tmp_path, monkeypatch):
    """The folder is made (it used to be a FileNotFoundError after every measurement, nothing written)."""
    module = _script(name)
    monkeypatch.setattr(module, "load_model", lambda *a, **kw: SimpleNamespace(**vars(_fake_loaded()), runner=None),
                        raising=False)
    for attr, fake in fakes.items():
        monkeypatch.setattr(module, attr, fake)
    out = tmp_path / "new" / "x.json"
    _run(module, argv + ["--json", str(out)], monkeypatch)
    assert json.loads(out.read_text())
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.json"]  # no temporary file left


def _writes_cut_short_from(call: int, monkeypatch) -> None:
    """From the ``call``-th Path.write_text on, each writes half its text and fails, as on a full disk."""
    calls, write = [0], Path.write_text

    def cut(self, text, *args, **kwargs):
        calls[0] += 1
        if calls[0] < call:
            return write(self, text, *args, **kwargs)
        write(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", cut)


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


def _fake_invariant(monkeypatch, setup=lambda key: None) -> None:
    """bench_invariant_cpu's model and measuring faked; ``setup(key)``: each call's, key (drafter, invariant)."""
    import specdec.eval.bitwise_level as bitwise_level

    import specdec.models.loader

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


def test_invariant_benchmark_warms_each_mode_up_untimed_and_names_this_machine(tmp_path, monkeypatch):
    """A mode's first call pays one-time setup: the warm-up's, not a timed prompt's. The calls run on a scripted
    clock, which only the setup moves (slept, and the rest timed on the wall, a loaded worker's stall failed it)."""
    bench = _script("bench_invariant_cpu")
    first, now = set(), [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def setup(key):
        if key not in first:
            first.add(key)
            now[0] += 0.3

    _fake_invariant(monkeypatch, setup)
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


def test_a_ratio_line_gives_the_rows_tokens_per_second_over_the_baselines():
    """100 tokens in 5 s against the baseline's 100 in 10 s: 20 over 10 tok/s, ratio 2.00x."""
    common = _script("common")
    assert common.ratio_line("ngram", 100, 10.0, 100, 5.0).endswith("ratio  2.00x")


def test_a_benchmarks_help_gives_each_options_default(monkeypatch, capsys):
    """``--help`` of bench_plain_cpu.py (and most others) gave no default: ``--max-new-tokens MAX_NEW_TOKENS`` alone,
    so a user could not tell what a bare run measures. A flag, or an option without a default, shows none."""
    module = _script("bench_plain_cpu")
    with pytest.raises(SystemExit):
        _run(module, ["--help"], monkeypatch)
    options = " ".join(capsys.readouterr().out.split("options:")[1].split())
    assert "--prompts PROMPTS prompts per category (default: 6)" in options
    assert "--max-new-tokens MAX_NEW_TOKENS default: 64" in options
    ap = argparse.ArgumentParser(formatter_class=sys.modules["common"].HelpWithDefaults)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--json", help="also write it here")
    ap.add_argument("--always", action="store_true", help="no guard")
    ap.add_argument("--speculation", default="auto", help="auto: the guard (default); always: none")
    text = " ".join(ap.format_help().split())
    assert "0 = greedy (default: 0.0)" in text  # 0 == False, but shown
    assert "always: none (default" not in text  # a help that names its default already
    assert "also write it here (default" not in text and "no guard (default" not in text
    for name in INTERRUPTIBLE:  # every measuring script's parser shows them
        assert "formatter_class=HelpWithDefaults" in (BENCHMARKS / f"{name}.py").read_text(), name


def test_every_benchmark_writes_its_result_files_whole():
    """bench_e2e_gpu, bench_kernels_gpu, bench_distill_gpu and bench_speed_gpu wrote their JSON with open(..., "w") or
    Path.write_text: a half-written file where a run stopped mid-write (speed.json is rewritten after every model),
    and no folder made for a --json path in a new one. Every script writes through specdec.atomic_write."""
    carried = {"gpu_carry.py"}  # its .md5 travels to the device machine beside the GGUF: no result (and logs stream)
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.name not in carried:
            assert not re.search(r'open\([^)]*,\s*"w"|\.write_text\(|json\.dump\(', path.read_text()), path.name


INTERRUPTIBLE = ("audit_power", "bench_coupled_cpu", "bench_drafters_cpu", "bench_e2e_gpu", "bench_eagle_cpu",
                 "bench_host_overhead", "bench_invariant_cpu", "bench_medusa_vocab_cpu", "bench_ngram_cpu",
                 "bench_plain_cpu", "bench_policy_host", "bench_speed_gpu", "bench_verify_cost", "count_launches",
                 "profile_short_call", "self_draft_acceptance")


@pytest.mark.parametrize("name", INTERRUPTIBLE)
def test_each_measuring_script_runs_its_main_through_run_main(name):
    """Ctrl-C (or ``timeout``'s SIGTERM) mid-run ended every benchmark in a traceback wall from deep in the model's
    forward: run as a script, each main goes through common.run_main."""
    assert (BENCHMARKS / f"{name}.py").read_text().endswith('\nif __name__ == "__main__":\n    run_main(main)\n')


@pytest.mark.parametrize("stop, code, said", [(KeyboardInterrupt, 130, "interrupted"),
                                              (Terminated, 143, "terminated (SIGTERM)")])
def test_a_benchmark_stopped_by_ctrl_c_or_sigterm_says_so_in_one_line(stop, code, said, monkeypatch, capsys):
    common = _script("common")
    monkeypatch.setattr(sys, "argv", ["benchmarks/bench_plain_cpu.py"])

    def main():
        print("measured so far")
        raise stop

    with pytest.raises(SystemExit) as exit_:
        common.run_main(main)
    out, err = capsys.readouterr()
    assert exit_.value.code == code and out == "measured so far\n" and err == f"bench_plain_cpu.py: {said}\n"
    for returned in (None, 2):  # else main's own status
        with pytest.raises(SystemExit) as exit_:
            common.run_main(lambda returned=returned: returned)
        assert exit_.value.code == returned


def test_specdecs_refusal_ends_a_benchmark_in_one_line_and_other_errors_keep_their_traceback(monkeypatch, capsys):
    """Each script caught SpecdecError around its own lines (the model's load, or its whole measurement: six wraps,
    some scripts none) and said it through argparse; run_main says it for every script, after what was printed."""
    from specdec.errors import InputError

    common = _script("common")
    monkeypatch.setattr(sys, "argv", ["benchmarks/self_draft_acceptance.py"])

    def main():
        print("measured so far")
        raise InputError("the model has 30 layers, not 40\n(a second line)")

    with pytest.raises(SystemExit) as exit_:
        common.run_main(main)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "measured so far\n"
    assert err == "self_draft_acceptance.py: error: the model has 30 layers, not 40\n"
    with pytest.raises(ZeroDivisionError):
        common.run_main(lambda: 1 / 0)
    assert not [p.name for p in BENCHMARKS.glob("*.py") if "except SpecdecError" in p.read_text()
                and p.name != "common.py"]


def test_a_benchmark_runs_without_transformers_progress_bars():
    """Every model a script loaded drew transformers' "Loading weights" bar among its measurements; the specdec
    commands hide it (shown with -v), and so does run_main, which sets it back as it was afterwards."""
    from transformers.utils import logging as hf_logging

    common = _script("common")
    shown = []
    hf_logging.enable_progress_bar()
    with pytest.raises(SystemExit):
        common.run_main(lambda: shown.append(hf_logging.is_progress_bar_enabled()))
    assert shown == [False] and hf_logging.is_progress_bar_enabled()


@pytest.mark.parametrize("cold, machine, said", [(True, False, "cold"), (False, True, "machine"),
                                                 (False, False, "run")])
def test_guard_memory_names_where_the_runs_memory_started(cold, machine, said):
    common = _script("common")
    assert common.guard_memory(SimpleNamespace(cold=cold, machine_memory=machine)) == said


@pytest.mark.parametrize("machine, forgotten", [(False, 1), (True, 0)])
def test_only_machine_memory_keeps_what_earlier_runs_taught_the_guard(machine, forgotten, monkeypatch):
    """The run's own memory starts empty (forgotten once); --machine-memory starts from the disk's."""
    common = _script("common")
    calls = []
    monkeypatch.setattr(common, "forget_guard", lambda: calls.append(1))
    common.start_guard_memory(SimpleNamespace(cold=False, machine_memory=machine))
    assert len(calls) == forgotten


@pytest.mark.parametrize("flags, machine", [("sse avx2 avx512f", "cpu-avx512"), ("sse avx2", "cpu-no-avx512")])
def test_an_amd_cpus_machine_class_says_whether_it_has_avx512(flags, machine, monkeypatch):
    common = _script("common")
    monkeypatch.setattr(common.cpu_info, "cpuinfo_values", lambda name: ["AuthenticAMD"] if name == "vendor_id" else [])
    monkeypatch.setattr(common.cpu_info, "cpu_flags", lambda: frozenset(flags.split()))
    assert common.machine_class() == machine


def test_grid_result_counts_the_prompts_each_column_ran():
    """Columns run what their categories hold (held-out: 12 prompts), not always --prompts."""
    _script("bench_drafters_cpu")
    grid = sys.modules["drafter_grid"]
    text = grid.counts_text({"chat": 22, "held-out": 12, "batch8": 30}, 2)
    assert "chat 22" in text and "held-out 12" in text and "batch8: 30 ragged batches" in text
    assert "30 prompts" not in text and "60 blocks" not in text
    assert grid.counts_text({"chat": 3, "batch8": 3}, 2) == (
        "3 prompts per column; batch8: 3 ragged batches of 8; 2 repeat(s): each interval rests on 6 blocks.")


def _cell(mean, low, high, tau=1.0, runs=3, identical=True):
    return dict(drafter="ngram", column="chat", new_tokens=16, paired_speedup=[mean, low, high], tau=tau, runs=runs,
                identical_to_plain=identical, mismatching_runs=0 if identical else 1)


def test_a_grid_cell_is_slower_only_where_its_whole_interval_lies_below_the_floor():
    """FLOOR 0.97: an interval reaching it is not wholly below; one block has no interval; tau shows from 1.01."""
    _script("bench_drafters_cpu")
    grid = sys.modules["drafter_grid"]
    assert grid.cell_text(_cell(0.90, 0.85, 0.96)) == "0.90 [0.85, 0.96] SLOWER"
    assert grid.cell_text(_cell(0.92, 0.87, 0.97)) == "0.92 [0.87, 0.97]"  # high == FLOOR: straddles it
    assert grid.cell_text(_cell(0.90, 0.85, 0.96, runs=1)) == "0.90 [0.85, 0.96]"
    assert grid.cell_text(_cell(1.20, 1.10, 1.30, tau=1.0)) == "1.20 [1.10, 1.30]"  # tau 1.00: nothing drafted
    assert grid.cell_text(_cell(1.20, 1.10, 1.30, tau=1.5)) == "1.20 (1.50) [1.10, 1.30]"
    # mean 0.98 over the floor, interval [0.95, 1.00] across it: straddling, not slower
    summary = grid.summary([_cell(0.98, 0.95, 1.00), dict(_cell(0.9, 0.8, 0.96), column="code")])
    assert "Interval wholly below 0.97: ngram @16 code\nInterval straddling 0.97: ngram @16 chat\n" in summary


def test_the_grid_result_counts_every_cell_whose_output_differs(tmp_path, monkeypatch):
    _script("bench_drafters_cpu")
    grid = sys.modules["drafter_grid"]
    monkeypatch.setattr(grid, "machine_class", lambda: "cpu-avx512")
    plain = dict(_cell(1.0, 1.0, 1.0), drafter="plain", tokens_per_s=100.0)
    cells = [plain, _cell(0.90, 0.85, 0.96), dict(_cell(1.2, 1.1, 1.3, identical=False), drafter="eagle")]
    grid.write_result(str(tmp_path / "grid.json"), cells, ["plain", "ngram", "eagle"], ["chat"], [16],
                      ["bench_drafters_cpu.py", "--grid"], "m", {"chat": 3}, 1, ["ngram", "eagle"])
    result = json.loads((tmp_path / "grid.json").read_text())
    # the n-gram cell lies below 0.97 (high 0.96, 3 runs); the EAGLE cell differs from plain
    assert result["notes"] == ["1 cell(s) with the interval wholly below 0.97; 1 with an output other than plain's."]
    assert result["rows"] == [["plain tok/s", "16", "100.0"], ["ngram", "16", "0.90 [0.85, 0.96] SLOWER"],
                              ["eagle", "16", "1.20 [1.10, 1.30] DIFFERS x1"]]


def test_a_ragged_batch_starts_where_the_last_one_ended():
    """Pool a0 b0 c0 d0 e0 (five prompts) in batches of 4: the second batch starts at the fifth, 4 % 5 = 4."""
    _script("bench_drafters_cpu")
    grid = sys.modules["drafter_grid"]
    columns = {c: [[i]] for i, c in enumerate("abcde")}
    assert grid.ragged_batches(columns, batches=2, size=4) == [[[0], [1], [2], [3]], [[4], [0], [1], [2]]]


def test_held_out_prompts_refuse_none():
    _script("bench_drafters_cpu")
    held_out = sys.modules["held_out_prompts"]
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        held_out.load_held_out(0)
    assert held_out.load_held_out(2) == list(held_out.HELD_OUT[:2])


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


def test_invariant_and_coupled_files_keep_what_was_measured_when_a_write_or_a_row_fails(tmp_path, monkeypatch):
    """bench_invariant_cpu rewrites its file after every cell: a write cut short keeps the file before it (it used
    to be left half written). bench_coupled_cpu writes after every row: a later drafter's error keeps the rows
    before it (it used to write only at the end)."""
    bench = _script("bench_invariant_cpu")
    _fake_invariant(monkeypatch)
    out = tmp_path / "inv.json"
    _writes_cut_short_from(2, monkeypatch)  # the plain phase's file written, the first cell's cut short
    with pytest.raises(OSError):
        _run(bench, ["--prompts", "2", "--tokens", "3", "--drafters", "ngram", "--alone", "1", "--out", str(out)],
             monkeypatch)
    assert json.loads(out.read_text())["cells"] == [] and [p.name for p in tmp_path.iterdir()] == ["inv.json"]
    monkeypatch.undo()

    coupled = _script("bench_coupled_cpu")
    monkeypatch.setattr(coupled, "load_model", lambda name: _fake_loaded())
    monkeypatch.setattr(coupled, "drafters", lambda loaded: {n: lambda n=n: (n, None) for n in ("ngram", "self-draft")})
    monkeypatch.setattr(coupled, "chat_ids", lambda tokenizer, text: [1, 2])

    def generate(loaded, prompts, max_new_tokens, drafter=None, **kw):
        if drafter == "self-draft":
            raise RuntimeError("a later drafter failed")
        return SimpleNamespace(total_new_tokens=3, stats=[SimpleNamespace(steps=2)])

    monkeypatch.setattr(coupled, "generate", generate)
    with pytest.raises(RuntimeError, match="later drafter"):
        _run(coupled, ["--part", "tau", "--drafters", "ngram,self-draft", "--categories", "chat", "--prompts", "1",
                       "--temperatures", "0.8", "--out", str(tmp_path / "c")], monkeypatch)
    rows = json.loads((tmp_path / "c" / "coupled-tau.json").read_text())["tau"]["rows"]
    assert [(r["drafter"], r["standard"]) for r in rows] == [("ngram", 1.5)]


def test_gpu_check_report_is_replaced_whole_after_every_step(tmp_path, monkeypatch):
    """A write of report.json cut short (a kill, a full disk) leaves the report of the steps before, not half a
    file (--rehearse: no GPU needed)."""
    check = load_script("gpu_check")
    for step in ("step_acceptance", "step_speed"):
        monkeypatch.setattr(check, step, lambda *args, **kw: dict(status="passed", seconds=1.0))
    _writes_cut_short_from(3, monkeypatch)  # the first step's report.json and report.md written, then cut short
    with pytest.raises(OSError):
        check.main(["--steps", "acceptance,speed", "--rehearse", "--out", str(tmp_path)])
    assert list(json.loads((tmp_path / "report.json").read_text())["steps"]) == ["acceptance"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_audit_power_counts_the_nodes_until_a_liar_is_stopped_and_writes_the_same_file_twice(tmp_path, monkeypatch):
    """docs/sampling.md's table of draft nodes until the audit's error was a simulation no file kept:
    benchmarks/audit_power.py reruns it seeded, so a second run writes the same result, a blatant liar is stopped
    within a few nodes and a subtle one not within a short budget."""
    script = _script("audit_power")
    monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: "cpu-avx512")  # any CPU runs it
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        assert script.main(["--seeds", "2", "--vocab", "401", "--max-nodes", "300", "--out", str(path)]) == 0
    result = json.loads(first.read_text())
    assert json.loads(second.read_text())["rows"] == result["rows"]
    assert result["benchmark"] == "audit-power" and result["machine_class"]
    rows = {row[0]: row for row in result["rows"]}
    assert len(rows) == len(script.ROWS) and all(len(row) == len(result["columns"]) for row in rows.values())
    assert float(rows["one fixed token / the uniform law"][1]) == pytest.approx(math.log(401), rel=1e-3)
    fixed = rows["one fixed token / the uniform law"][3]
    assert all(int(n) < 30 for n in fixed.split("-"))
    assert rows["top-p 0.99 / no top-p"][3] == "not within 300"


def test_coupled_tau_is_written_as_a_results_file_the_docs_read(tmp_path, monkeypatch):
    """The speculation policy page quoted a tau table of standard against coupled sampling that no file kept:
    bench_coupled_cpu.py --result writes the tau part as a docs/results file, a cell per drafter and category."""
    coupled = _script("bench_coupled_cpu")
    monkeypatch.setattr(coupled, "load_model", lambda name: _fake_loaded())
    monkeypatch.setattr(coupled, "drafters", lambda loaded: {n: lambda n=n: (n, None) for n in ("ngram", "self-draft")})
    monkeypatch.setattr(coupled, "chat_ids", lambda tokenizer, text: [1, 2])
    monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: "cpu-avx512")

    def generate(loaded, prompts, max_new_tokens, drafter=None, sampler=None, **kw):
        steps = {("ngram", "standard"): 2, ("ngram", "coupled"): 3}.get((drafter, sampler), 4)
        return SimpleNamespace(total_new_tokens=6, stats=[SimpleNamespace(steps=steps)])

    monkeypatch.setattr(coupled, "generate", generate)
    result = tmp_path / "tau.json"
    _run(coupled, ["--part", "tau", "--drafters", "ngram,self-draft", "--categories", "chat,code", "--prompts", "1",
                   "--temperatures", "0.8", "--out", str(tmp_path / "c"), "--result", str(result)], monkeypatch)
    data = json.loads(result.read_text())
    assert data["benchmark"] == "coupled-tau" and data["columns"] == ["drafter", "temperature", "chat", "code"]
    assert data["rows"] == [["ngram", "0.8", "3.00 / 2.00", "3.00 / 2.00"],
                            ["self-draft", "0.8", "1.50 / 1.50", "1.50 / 1.50"]]
    assert load_file(RESULTS.parent / "gen_benchmarks.py")._malformed(data) is None  # one the benchmarks page takes
    with pytest.raises(SystemExit):  # the file is of the tau part alone
        _run(coupled, ["--part", "both", "--result", str(tmp_path / "x.json")], monkeypatch)


def test_self_draft_acceptance_sums_depth_one_over_the_prompts_into_a_results_file(tmp_path, monkeypatch, capsys):
    """docs/drafters/self-draft.md quoted an untrained early exit's acceptance per layer count from a sweep no file
    kept: self_draft_acceptance.py counts it (accepted over verified draft tokens at depth 1, every draft verified)
    and writes a docs/results file; a layer count that is no number is refused in one line before a model loads."""
    script = _script("self_draft_acceptance")
    monkeypatch.setattr(script, "load_model", lambda name: SimpleNamespace(
        **vars(_fake_loaded()), runner=SimpleNamespace(shape=SimpleNamespace(num_layers=30))))
    monkeypatch.setattr(script, "chat_ids", lambda tokenizer, text: [1, 2])
    monkeypatch.setattr(sys.modules["common"], "machine_class", lambda: "cpu-avx512")
    calls = []

    def generate(loaded, prompts, max_new_tokens, drafter=None, drafter_options=None, speculation=None, **kw):
        calls.append((drafter, drafter_options["num_layers"], speculation))
        n = drafter_options["num_layers"]
        return SimpleNamespace(stats=[SimpleNamespace(depth_accepted=[n], depth_tried=[40, 3])])

    monkeypatch.setattr(script, "generate", generate)
    out = tmp_path / "acc.json"
    assert script.main(["--layers", "4,10", "--prompts", "2", "--out", str(out)]) == 0
    assert calls == [("self-draft", 4, "always")] * 2 + [("self-draft", 10, "always")] * 2
    data = json.loads(out.read_text())
    assert data["rows"] == [["4", "10%", "8 / 80"], ["10", "25%", "20 / 80"]]
    assert load_file(RESULTS.parent / "gen_benchmarks.py")._malformed(data) is None
    with pytest.raises(SystemExit):
        script.main(["--layers", "4,x"])
    assert "--layers: comma-separated layer counts, got '4,x'" in capsys.readouterr().err
