"""`specdec eval` refuses before its work what it used to find after it, and says what to do in words that work:
an --out nothing can be written into, a prompt longer than the model's context, a drafter missing its path=, a
sample size (named by its flag); its certificate.json is strict JSON; the resume advice and the line after Ctrl-C
lead to a run that works."""
from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys

import pytest

from tests.cli_runs import run_main as _main

RUN = ["--drafters", "ngram", "--max-new-tokens", "2", "--calibration-repeats", "0", "--no-hf-baseline",
       "--no-plots"]
SMALL = ["--levels", "e2e", "--identity-prompts", "1", "--identity-tokens", "4", "--sample-sequences", "20"]


def _one_line(captured) -> str:
    err = captured.err.strip()
    assert "\n" not in err, err
    return err


def _patch_where_defined(monkeypatch, module_name: str, name: str, fake) -> None:
    """``module_name.name`` replaced by ``fake`` for one test, once every eval and drafter module is imported: one
    first imported while the patch held would bind the fake by name (``from ... import generate``) for every test
    after this one."""
    import specdec.drafters
    import specdec.eval

    import specdec.generate  # noqa: F401

    for package in (specdec.eval, specdec.drafters):
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
    monkeypatch.setattr(importlib.import_module(module_name), name, fake)


@pytest.fixture
def no_load(monkeypatch):
    """The model must not load: what is refused is refused before."""
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    _patch_where_defined(monkeypatch, "specdec.models.loader", "load_model", load_model)


def test_an_out_that_cannot_be_written_into_is_refused_before_any_work(ckpt, tmp_path, capsys, no_load, read_only):
    """An existing --out that cannot be written was found only when the results were written: eval lossless after
    its whole certificate, eval replay record after the recording."""
    out = read_only(tmp_path / "ro")
    for argv in (["eval", "lossless", *SMALL, "--out", str(out)],
                 ["eval", "acceptance", "--categories", "chat", "--prompts", "1", *RUN, "--out", str(out)]):
        code, captured = _main([*argv, "--model", ckpt], capsys)
        assert code == 2 and f"--out {out}: cannot write into it ({out} is not writable)" in _one_line(captured)
    code, captured = _main(["eval", "replay", "record", "--model", ckpt, "--out", str(out / "rec.json")], capsys)
    assert code == 2 and f"cannot write into its folder {out} ({out} is not writable)" in _one_line(captured)
    assert list(out.iterdir()) == []


def test_a_resume_whose_cells_folder_cannot_be_written_into_is_refused_before_any_work(ckpt, tmp_path, capsys,
                                                                                         no_load, read_only):
    """In a shared --out, another user's run: --out writable, its cells folder not. The resume loaded the model and
    measured a cell before failing to write it."""
    out = tmp_path / "run"
    cells = read_only(out / "cells")
    code, captured = _main(["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN,
                            "--out", str(out), "--resume"], capsys)
    assert code == 2 and _one_line(captured).endswith(
        f"--out {out}: --resume cannot add cells: {cells} is not writable (another user's run?); ask its owner to "
        f"let you write it (chmod -R g+w {out}), or copy the run to a folder of your own (cp -r {out} NEW) and "
        "resume with --out NEW")


@pytest.mark.skipif(sys.platform == "win32", reason="the sticky bit is POSIX's")
def test_another_users_run_in_a_sticky_out_is_refused_before_any_file_goes(ckpt, tmp_path, capsys, no_load,
                                                                             monkeypatch, another_users_sticky):
    """An --out with the sticky bit (as /tmp), writable by all, holding another user's run: only the checks of its
    cells folder knew the sticky bit, so --overwrite of their certificate or reports loaded the model and stopped at
    the first file it deleted ("Operation not permitted"), and --resume at its first write (settings.json replaced).
    Each is refused in one line before the model loads, and the earlier run stays whole; a file of the run this user
    owns, or another user's file that no run writes, is no obstacle."""
    from specdec.eval.cli import ACCEPTANCE_FILES, check_cells_writable, check_earlier_run

    out = tmp_path / "shared"
    out.mkdir()
    for name in ("certificate.json", "certificate.md", "settings.json", "conversations.json"):
        (out / name).write_text("{}")
    owner = another_users_sticky(out)  # this user owns neither the folder nor its files
    before = sorted(p.name for p in out.iterdir())
    cases = ((["eval", "lossless", *SMALL, "--overwrite"], f"this user may not delete what {out} holds"),
             (["eval", "acceptance", "--categories", "chat", "--prompts", "1", *RUN, "--overwrite"],
              f"this user may not delete what {out} holds"),
             (["eval", "acceptance", "--categories", "chat", "--prompts", "1", *RUN, "--resume"],
              f"--out {out}: --resume cannot replace the earlier run's settings.json and reports: --out has the "
              f"sticky bit (as /tmp) and they are another user's"))
    for argv, said in cases:
        code, captured = _main([*argv, "--model", ckpt, "--out", str(out)], capsys)
        assert code == 2 and said in _one_line(captured), captured.err
    assert sorted(p.name for p in out.iterdir()) == before
    for name in before:  # another user's file beside this user's run, which no run writes
        os.rename(out / name, out / f"{name}.notes")
    check_earlier_run(out, ACCEPTANCE_FILES, overwrite=True)
    check_cells_writable(out)
    monkeypatch.setattr(os, "geteuid", lambda: owner)  # this user's own run
    for name in before:
        os.rename(out / f"{name}.notes", out / name)
    assert len(check_earlier_run(out, ACCEPTANCE_FILES, overwrite=True)) == 2
    check_cells_writable(out)


def test_a_certificate_whose_samples_fall_in_one_bin_is_strict_json(ckpt, tmp_path, capsys):
    """Nearly greedy sampling draws one outcome: its chi-square has one bin and detects no TV, which
    certificate.json wrote as `Infinity` (no JSON parser but Python's reads it) and the warning as "TV inf"."""
    out = tmp_path / "cert"
    code, captured = _main(["eval", "lossless", "--model", ckpt, *SMALL, "--temperature", "0.01", "--out", str(out)],
                           capsys)
    assert code in (0, 1), captured.err

    def refuse(constant):
        raise AssertionError(f"certificate.json holds {constant}")

    cert = json.loads((out / "certificate.json").read_text(), parse_constant=refuse)
    sampled = [c for c in cert["checks"] if c["name"].startswith("sampled") and c["control"] is None]
    assert sampled and sampled[0]["detects_tv"] is None
    assert "detect no TV at all, not 0.2 (their outcomes fell in one bin" in captured.err
    assert " inf" not in captured.err and " inf" not in (out / "certificate.md").read_text()


def test_a_number_that_is_not_finite_is_never_written_into_certificate_json(ckpt, tmp_path, capsys, monkeypatch):
    from specdec.eval.certificate import Certificate, Check

    def run_certificate(*args, **kwargs):
        return Certificate({}, [Check("a check", "end-to-end", True, p_value=float("nan"))])

    monkeypatch.setattr("specdec.eval.certificate.run_certificate", run_certificate)
    with pytest.raises(RuntimeError, match="not finite"):
        _main(["eval", "lossless", "--model", ckpt, *SMALL, "--out", str(tmp_path / "c")], capsys)
    assert not (tmp_path / "c" / "certificate.json").exists()


def test_a_chi_square_of_one_bin_detects_no_tv():
    from specdec.eval.statistics import goodness_of_fit
    from specdec.eval.two_sample import two_sample_chi2

    assert goodness_of_fit(["a"] * 50, {"a": 1.0}, 0.02, 0.01).detects_tv is None
    assert two_sample_chi2(["a"] * 50, ["a"] * 50).detects_tv is None
    assert goodness_of_fit(["a", "b"] * 50, {"a": 0.5, "b": 0.5}, 0.02, 0.01).detects_tv > 0


@pytest.mark.parametrize("flags, says", [
    (["--identity-prompts", "0"], "--identity-prompts must be >= 1, got 0"),
    (["--sample-sequences", "-1"], "--sample-sequences must be >= 1, got -1"),
    (["--stat-samples", "0"], "--stat-samples must be >= 1, got 0"),
    (["--identity-tokens", "0"], "--identity-tokens must be >= 1, got 0"),
    (["--identity-prompts", "99"], "--identity-prompts 99: there are 24 built-in chat prompts"),
    # a count past any index ended the run in an OverflowError traceback after the model had loaded
    (["--stat-samples", str(10 ** 20)], f"--stat-samples {10 ** 20}: more than a run can count"),
    (["--sample-sequences", str(10 ** 20)], f"--sample-sequences {10 ** 20}: more than a run can count"),
    (["--drafter", "medusa"], "medusa: give exactly one of path="),
    (["--drafter", "medusa", "--drafter-option", "medusa.path=x", "--drafter-option", "medusa.top_k=0"],
     "medusa: top_k must be >= 1, got 0"),
    (["--drafter", "ngram", "--drafter-option", "eagle.depth=3"],
     "--drafter-option eagle.depth: 'eagle' is not one of the drafters (ngram)"),
], ids=["identity-prompts", "sample-sequences", "stat-samples", "identity-tokens", "too-many-prompts",
        "stat-samples-past-any-index", "sample-sequences-past-any-index", "medusa", "prefixed-option",
        "another-drafters-option"])
def test_eval_lossless_refuses_before_loading_the_model(flags, says, tmp_path, capsys, no_load):
    """The sizes said "certificate sample sizes must be >= 1", naming no flag; medusa without path= was refused
    only after plain decoding had run. A prefixed option (medusa.top_k, as --help shows) was refused as medusa's
    unknown option 'medusa.top_k', as was another drafter's."""
    code, captured = _main(["eval", "lossless", "--levels", "e2e", *flags, "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and says in _one_line(captured)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("command, flags, says", [
    (["acceptance", *RUN], ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["acceptance", *RUN], ["--batch-size", "-2"], "--batch-size must be >= 1, got -2"),
    (["acceptance", *RUN], ["--calibration-repeats", "-1"], "--calibration-repeats must be >= 0, got -1"),
    (["replay", "record"], ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["replay", "record"], ["--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["replay", "record"], ["--cost-repeats", "0"], "--cost-repeats must be >= 1, got 0"),
    (["replay", "record"], ["--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
], ids=["max-new-tokens", "batch-size", "calibration-repeats", "record-max-new-tokens", "record-top-k",
        "record-cost-repeats", "record-temperature"])
def test_eval_counts_are_refused_by_their_flags_name(command, flags, says, tmp_path, capsys, no_load):
    """eval acceptance said "prompts per category, max_new_tokens and batch_size must be >= 1", naming neither the
    flag nor its value; replay record named its settings as the API spells them (max_new_tokens, top_k)."""
    code, captured = _main(["eval", *command, *flags, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and _one_line(captured).endswith(f": error: {says}")
    assert not (tmp_path / "o").exists()


def test_replay_record_refuses_cost_repeats_it_would_not_use(tmp_path, capsys, no_load):
    """--cost-repeats sizes --costs measure only: with the default --costs cost-model it was accepted and unused."""
    code, captured = _main(["eval", "replay", "record", "--cost-repeats", "7", "--out", str(tmp_path / "r.json")],
                           capsys)
    assert code == 2 and _one_line(captured).endswith(
        "error: --cost-repeats 7 times the verify steps of --costs measure; --costs cost-model times none here: give "
        "--costs measure, or leave --cost-repeats out")
    assert not (tmp_path / "r.json").exists()


def test_replay_record_says_a_greedy_run_has_no_seed(ckpt, tmp_path, capsys):
    """--seed at --temperature 0 was taken without a word and written into the record, as if the run were seeded
    (eval acceptance says so and records none)."""
    out = tmp_path / "r.json"
    code, captured = _main(["eval", "replay", "record", "--model", ckpt, "--prompts", "1", "--max-new-tokens", "2",
                            "--seed", "5", "--out", str(out)], capsys)
    assert code == 0, captured.err
    assert "note: --seed 5 left out: at --temperature 0 (greedy) no token is sampled" in captured.err
    assert json.loads(out.read_text())["seed"] == 0


def test_identity_tokens_past_the_context_are_refused_before_any_check_runs(ckpt, tmp_path, capsys, monkeypatch):
    def run_certificate(*args, **kwargs):
        raise AssertionError("the certificate ran")

    monkeypatch.setattr("specdec.eval.certificate.run_certificate", run_certificate)
    code, captured = _main(["eval", "lossless", "--model", ckpt, "--levels", "e2e", "--identity-prompts", "1",
                            "--identity-tokens", "1000", "--out", str(tmp_path / "c")], capsys)
    line = _one_line(captured)
    assert code == 2 and "identity prompt 0: its " in line
    assert "+ --identity-tokens 1000 exceed the model's context of 512 tokens; lower --identity-tokens to" in line


def test_identity_prompts_without_room_for_the_sampled_tokens_are_refused_before_any_check_runs(tmp_path, capsys,
                                                                                                  monkeypatch):
    """The e2e level samples 9 tokens after a start in an identity prompt's answer: a prompt that fits with
    --identity-tokens but not with those ended the certificate, after its greedy checks, in generate()'s refusal."""
    from specdec.testing import save_tiny_checkpoint

    def run_certificate(*args, **kwargs):
        raise AssertionError("the certificate ran")

    monkeypatch.setattr("specdec.eval.certificate.run_certificate", run_certificate)
    model = save_tiny_checkpoint(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    code, captured = _main(["eval", "lossless", "--model", model, "--levels", "e2e", "--identity-prompts", "1",
                            "--identity-tokens", "4", "--out", str(tmp_path / "c")], capsys)
    line = _one_line(captured)
    assert code == 2 and line.endswith("the end-to-end sampled check (level e2e) samples 9 tokens after an identity "
                                       "prompt: the shortest (57 tokens) leaves no room for them in the model's "
                                       "context of 64 tokens"), line


def test_eval_acceptance_refuses_a_drafter_missing_its_path_before_loading(tmp_path, capsys, no_load):
    code, captured = _main(["eval", "acceptance", "--drafters", "ngram,medusa", "--categories", "chat",
                            "--prompts", "1", "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and "medusa: give exactly one of path=" in _one_line(captured)


def test_eval_acceptance_without_matplotlib_says_so_before_the_run(tmp_path, capsys, no_load, monkeypatch):
    """Its plots come after every cell: without matplotlib the whole suite ran, then ended in a traceback."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed
    code, captured = _main(["eval", "acceptance", "--drafters", "ngram", "--categories", "chat", "--prompts", "1",
                            "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and _one_line(captured).endswith(
        "the Python package 'matplotlib' is missing; install it with pip install 'specdec[eval]'"), captured
    assert not (tmp_path / "a").exists()


def test_eval_acceptance_without_accelerate_says_so_before_the_model_loads(tmp_path, capsys, no_load, monkeypatch):
    """accelerate shards its cells: without it the model and the drafters loaded and --out was made, then the run
    ended on the import."""
    import sys

    monkeypatch.setitem(sys.modules, "accelerate", None)  # not installed
    code, captured = _main(["eval", "acceptance", "--drafters", "ngram", "--categories", "chat", "--prompts", "1",
                            "--no-plots", "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and _one_line(captured).endswith(
        "the Python package 'accelerate' is missing; install it with pip install 'specdec[eval]'"), captured
    assert not (tmp_path / "a").exists()


def test_a_prompt_past_the_context_is_refused_before_any_cell_naming_it(ckpt, tmp_path, capsys, monkeypatch):
    """It failed when its cell ran, after the earlier cells were measured, naming no prompt; a resume stopped at
    the same place."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a short one"}) + "\n" + json.dumps({"prompt": "word " * 600}) + "\n")
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", ckpt, "--prompts-file", str(prompts), *RUN, "--out", str(out)]

    def run_suite(*args, **kwargs):
        raise AssertionError("a cell was measured")

    monkeypatch.setattr("specdec.eval.conversations.run_suite", run_suite)
    for extra in ([], ["--resume"]):
        code, captured = _main([*argv, *extra], capsys)
        line = _one_line(captured)
        assert code == 2 and f"{prompts}:2: its " in line, line
        assert "tokens + --max-new-tokens 2 exceed the model's context of 512 tokens" in line
    assert not (out / "cells").exists()


def test_replay_record_refuses_a_prompt_past_the_context_before_recording_naming_it(ckpt, tmp_path, capsys,
                                                                                   monkeypatch):
    """It was refused only when its turn came, after every earlier prompt was decoded, naming no prompt."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a short one"}) + "\n" + json.dumps({"prompt": "word " * 600}) + "\n")
    out = tmp_path / "run.json"

    def generate(*args, **kwargs):
        raise AssertionError("a prompt was decoded")

    _patch_where_defined(monkeypatch, "specdec.generate", "generate", generate)
    code, captured = _main(["eval", "replay", "record", "--model", ckpt, "--prompts-file", str(prompts),
                            "--max-new-tokens", "2", "--out", str(out)], capsys)
    line = _one_line(captured)
    assert code == 2 and f"{prompts}:2: its " in line and "exceed the model's context of 512 tokens" in line, line
    assert not out.exists()


@pytest.mark.parametrize("module_name, name", [("specdec.generate", "generate"),
                                               ("specdec.models.loader", "load_model")])
def test_replay_record_terminated_says_so(ckpt, tmp_path, capsys, monkeypatch, module_name, name):
    """SIGTERM (``timeout``, a scheduler) while the prompts were decoded, or while the model loaded (a first run
    converts the embedded model), ended the record unannounced, where Ctrl-C said "interrupted"; it takes Ctrl-C's
    path from the start: one line, exit 143, no record written."""
    import os
    import signal

    real = getattr(importlib.import_module(module_name), name)

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    class Unhandled(Exception):
        pass

    def before(signum, frame):
        raise Unhandled("SIGTERM reached the handler installed before the run")

    _patch_where_defined(monkeypatch, module_name, name, terminated)
    out = tmp_path / "run.json"
    previous = signal.signal(signal.SIGTERM, before)
    try:
        code, captured = _main(["eval", "replay", "record", "--model", ckpt, "--max-new-tokens", "2", "--prompts",
                                "1", "--out", str(out)], capsys)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 143 and captured.err.strip().splitlines()[-1] == (
        "specdec eval replay record: terminated (SIGTERM)"), captured.err
    assert not out.exists()


def test_a_built_in_prompt_past_the_context_says_how_to_leave_it_out(ckpt):
    from specdec.eval.conversations import check_prompts_fit
    from specdec.eval.prompt_files import Conversation

    from specdec.errors import InputError
    from specdec.models.loader import load_model

    loaded = load_model(ckpt)
    conversations = [Conversation("code", (t,), where="built-in code") for t in ("a", "b", "c")]
    with pytest.raises(InputError, match=r"^built-in code prompt 3: its 510 tokens \+ --max-new-tokens 8 exceed the "
                                         r"model's context of 512 tokens; lower --max-new-tokens to 2 or less, or "
                                         r"--prompts 2 leaves it out$"):
        check_prompts_fit(loaded, conversations, {0: [1] * 10, 2: [1] * 510}, 1, 8)
    with pytest.raises(InputError, match=r"^built-in code prompt 1: its 600 tokens .* tokens; leave code out of "
                                         r"--categories$"):
        check_prompts_fit(loaded, conversations, {0: [1] * 600}, 1, 8)
    check_prompts_fit(loaded, conversations, {0: [1] * 504}, 1, 8)  # 504 + 8 = 512: fills the context exactly
    with pytest.raises(InputError, match=r"its 505 tokens .* lower --max-new-tokens to 7 or less, or leave code"):
        check_prompts_fit(loaded, conversations, {0: [1] * 505}, 1, 8)  # 512 - 505 = 7 new tokens still fit
    with pytest.raises(InputError, match=r"its 512 tokens .* 512 tokens; leave code out"):  # no room to lower into
        check_prompts_fit(loaded, conversations, {0: [1] * 512}, 1, 8)


def test_a_later_turn_past_the_context_advises_a_count_its_earlier_answers_shrink_with(ckpt):
    """Turn 2's prompt holds the answer to turn 1, which a lower --max-new-tokens shortens too: the advice was
    512 - 490 = 22, where 340 tokens besides a 150-token answer leave room for two answers of 86."""
    from specdec.eval.conversations import check_prompts_fit
    from specdec.eval.prompt_files import Conversation

    from specdec.errors import InputError
    from specdec.models.loader import load_model

    loaded = load_model(ckpt)
    conversations = [Conversation("writing", ("a", "b"), where="chat.jsonl:1")]
    with pytest.raises(InputError, match=r"^chat.jsonl:1 turn 2: its 490 tokens \+ --max-new-tokens 150 exceed the "
                                         r"model's context of 512 tokens; lower --max-new-tokens to 86 or less \(the "
                                         r"answers of its earlier turns shorten with it\), or leave it out of the "
                                         r"file$"):
        check_prompts_fit(loaded, conversations, {0: [1] * 490}, 2, 150, {0: 150})
    check_prompts_fit(loaded, conversations, {0: [1] * (340 + 86)}, 2, 86, {0: 86})  # as advised: it fits


def test_the_resume_advice_for_other_settings_works_as_said(ckpt, tmp_path, capsys):
    """It said "run without --resume to measure every cell anew", which is refused: the run holds an earlier one."""
    argv = ["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN,
            "--out", str(tmp_path / "run")]
    assert _main(argv, capsys)[0] == 0
    code, captured = _main([*argv, "--max-new-tokens", "3", "--resume"], capsys)
    line = _one_line(captured)
    assert code == 2 and line.endswith("or measure every cell anew (--overwrite instead of --resume)"), line
    assert _main([*argv, "--max-new-tokens", "3", "--overwrite"], capsys)[0] == 0


def test_an_interrupted_run_says_that_resume_continues_it(ckpt, tmp_path, capsys, monkeypatch):
    """Ctrl-C said only "interrupted"; train-medusa / train-eagle say what --resume continues from."""
    import specdec.eval.acceptance as acceptance

    write = acceptance._write_cell

    def write_then_interrupt(*args, **kwargs):
        write(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(acceptance, "_write_cell", write_then_interrupt)
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN, "--out", str(out)]
    code, captured = _main(argv, capsys)
    line = captured.err.strip().splitlines()[-1]
    assert code == 130 and line == (f"specdec eval acceptance: interrupted; 1 finished cell(s) kept in {out / 'cells'} "
                                    "(continue with --resume)"), captured.err
    monkeypatch.setattr(acceptance, "_write_cell", write)
    assert _main([*argv, "--resume"], capsys)[0] == 0
    assert (out / "report.json").exists()


def test_a_run_terminated_while_writing_its_report_says_so(ckpt, tmp_path, capsys, monkeypatch):
    """SIGTERM after the last cell, while the report and its plots were written, ended the run with no line (the
    signal's default: the process died), its cells unnamed; it says what --resume continues from, as during them."""
    import os
    import signal

    import specdec.eval.report as report

    class Unhandled(Exception):
        pass

    def before(signum, frame):
        raise Unhandled("SIGTERM reached the handler installed before the run")

    write = report.write_reports

    def terminate_then_write(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return write(*args, **kwargs)

    monkeypatch.setattr(report, "write_reports", terminate_then_write)
    previous = signal.signal(signal.SIGTERM, before)
    try:
        out = tmp_path / "run"
        argv = ["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN,
                "--out", str(out)]
        code, captured = _main(argv, capsys)
    finally:
        signal.signal(signal.SIGTERM, previous)
    line = captured.err.strip().splitlines()[-1]
    assert code == 143 and line == (f"specdec eval acceptance: terminated (SIGTERM); 2 finished cell(s) kept in "
                                    f"{out / 'cells'} (continue with --resume)"), captured.err
    monkeypatch.setattr(report, "write_reports", write)
    assert _main([*argv, "--resume"], capsys)[0] == 0 and (out / "report.json").exists()


def test_a_resume_that_finds_no_earlier_run_says_so(ckpt, tmp_path, capsys):
    """--resume with an --out that holds no run (a mistyped path) measured every cell anew without a word, the run
    meant to be continued left as it was; it says so. A resume that finds the run says nothing of the kind."""
    argv = ["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN, "--resume"]
    out = tmp_path / "typo"
    code, captured = _main([*argv, "--out", str(out)], capsys)
    assert code == 0 and (f"note: --resume: {out} holds no earlier run (no settings.json, no cells), so every cell "
                          "is measured; is it the --out of the run to continue?") in captured.err.splitlines()
    code, captured = _main([*argv, "--out", str(out)], capsys)
    assert code == 0 and "holds no earlier run" not in captured.err


def test_a_run_interrupted_before_its_first_cell_says_a_rerun_starts_again(ckpt, tmp_path, capsys, monkeypatch):
    """It said "no cell was finished yet (continue with --resume)", though the run left nothing to continue, and the
    resume then measured every cell as a new run."""
    import specdec.eval.acceptance as acceptance

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(acceptance, "_write_cell", interrupt)
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN, "--out", str(out)]
    code, captured = _main(argv, capsys)
    assert code == 130 and captured.err.strip().splitlines()[-1] == (
        "specdec eval acceptance: interrupted; no cell was finished yet, so a rerun starts again"), captured.err
    monkeypatch.undo()
    assert _main(argv, capsys)[0] == 0  # the rerun, as said: nothing there refuses it


def test_a_terminated_run_says_so_and_that_resume_continues_it(ckpt, tmp_path, capsys, monkeypatch):
    """SIGTERM (a scheduler's, ``timeout``'s) ended the run unannounced, the finished cells unnamed; train-* say what
    --resume continues from after either signal. The handler before the run is back after it."""
    import os
    import signal

    import specdec.eval.acceptance as acceptance

    class Unhandled(Exception):
        pass

    def before(signum, frame):
        raise Unhandled("SIGTERM reached the handler installed before the run")

    write = acceptance._write_cell

    def write_then_terminate(*args, **kwargs):
        write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(acceptance, "_write_cell", write_then_terminate)
    previous = signal.signal(signal.SIGTERM, before)
    try:
        out = tmp_path / "run"
        argv = ["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN,
                "--out", str(out)]
        code, captured = _main(argv, capsys)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    line = captured.err.strip().splitlines()[-1]
    assert code == 143 and line == (f"specdec eval acceptance: terminated (SIGTERM); 1 finished cell(s) kept in "
                                    f"{out / 'cells'} (continue with --resume)"), captured.err


@pytest.mark.parametrize("level", ["e2e", "coupled", "bitwise"])
def test_a_draft_model_made_for_another_model_is_refused_before_the_earlier_certificate_goes(tmp_path, capsys,
                                                                                            monkeypatch, level):
    """eval lossless read the drafter's draft model or checkpoint only when a level first ran it: --overwrite had
    cleared the earlier certificate and the levels before it had run when another vocabulary was refused. Now it is
    read and checked for the model first, as eval acceptance does."""
    from specdec.testing import build_tiny_model, save_tiny_checkpoint

    def run_certificate(*args, **kwargs):
        raise AssertionError("the certificate ran")

    monkeypatch.setattr("specdec.eval.certificate.run_certificate", run_certificate)
    target = save_tiny_checkpoint(tmp_path / "target")
    build_tiny_model(vocab_size=64).save_pretrained(tmp_path / "draft")
    out = tmp_path / "c"
    out.mkdir()
    for name in ("certificate.json", "certificate.md"):
        (out / name).write_text("{}" if name.endswith("json") else "# an earlier verdict\n")
    argv = ["eval", "lossless", "--model", target, "--drafter", "draft-model", "--drafter-option",
            f"model={tmp_path / 'draft'}", "--levels", level, "--identity-prompts", "1", "--identity-tokens", "4",
            "--sample-sequences", "20", "--out", str(out), "--overwrite"]
    code, captured = _main(argv, capsys)
    assert code == 2 and "draft-model: the draft model's vocabulary has 64 ids, the target's 69, and the draft " \
                         "model's tokenizer is unknown" in _one_line(captured)
    assert (out / "certificate.md").read_text() == "# an earlier verdict\n"


@pytest.mark.parametrize("refused", ["model", "draft-model"])
def test_a_refused_certificate_leaves_no_out_folder_behind(ckpt, tmp_path, capsys, refused):
    """eval lossless made --out before it loaded the model and the drafter's draft model: a mistyped --model or a
    draft model of another vocabulary was refused in one line, and an empty --out stayed behind (eval acceptance
    leaves none). Both are read before --out is made now."""
    from specdec.testing import build_tiny_model

    build_tiny_model(vocab_size=64).save_pretrained(tmp_path / "draft")
    model = str(tmp_path / "no-such-model") if refused == "model" else ckpt
    argv = ["eval", "lossless", "--model", model, "--drafter", "draft-model", "--drafter-option",
            f"model={tmp_path / 'draft'}", *SMALL, "--out", str(tmp_path / "c")]
    code, captured = _main(argv, capsys)
    assert code == 2 and ("unknown model" if refused == "model" else "vocabulary has 64 ids") in _one_line(captured)
    assert not (tmp_path / "c").exists()


def test_a_tokenizer_that_encodes_the_prompts_to_nothing_is_refused_before_any_check_runs(tmp_path, capsys,
                                                                                           monkeypatch):
    """A GGUF whose vocabulary holds no piece of text (no chat template either) encoded the built-in prompts to no
    token: eval lossless failed after its exact level, and eval acceptance, with "prompt 0 is empty", a prompt the
    user never gave. Both now name the prompt and what the tokenizer lacks."""
    from tests.test_gguf_llama import write_llama_gguf

    def run_certificate(*args, **kwargs):
        raise AssertionError("the certificate ran")

    monkeypatch.setattr("specdec.eval.certificate.run_certificate", run_certificate)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf")  # tokens t0 .. t47: no text encodes to any of them
    code, captured = _main(["eval", "lossless", "--model", str(path), *SMALL, "--out", str(tmp_path / "c")], capsys)
    assert code == 2 and "the model's tokenizer encodes the prompt '" in _one_line(captured)
    assert _one_line(captured).endswith("to no token (no chat template applied, and no piece of the text in its "
                                        "vocabulary): give a model whose tokenizer encodes text")
    code, captured = _main(["eval", "acceptance", "--model", str(path), *RUN, "--categories", "chat", "--prompts",
                            "1", "--out", str(tmp_path / "a")], capsys)
    assert code == 2 and "the model's tokenizer encodes the prompt '" in _one_line(captured)


def test_sigterm_while_the_model_loads_stops_eval_acceptance_with_one_line(ckpt, tmp_path, monkeypatch, capsys):
    """SIGTERM (`timeout`, a scheduler) before the first cell, while the model or the drafters load, ended the run
    with no line (the signal's default: the process died), where Ctrl-C there says "interrupted". It takes Ctrl-C's
    path from the start now: one line, exit 143, nothing written."""
    import os
    import signal

    import specdec.drafters.draft_model  # noqa: F401 (these bind load_model when first imported: not to the fake)

    import specdec.generate  # noqa: F401

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr("specdec.models.loader.load_model", terminated)
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # where the old code leaves SIGTERM alone, the test goes on
    try:
        code, captured = _main(["eval", "acceptance", "--model", ckpt, "--categories", "chat", "--prompts", "1", *RUN,
                                "--out", str(tmp_path / "run")], capsys)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (code, _one_line(captured)) == (143, "specdec eval acceptance: terminated (SIGTERM)")
    assert not (tmp_path / "run").exists()
