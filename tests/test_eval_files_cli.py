"""`specdec eval acceptance` and `specdec eval replay record` with the user's files: a prompts file runs whole and
alone, its non-UTF-8 text is named, `--out .` is refused, a resume over cells of another model of the same name is
refused, and a replay record never replaces an existing file (its own prompts file least of all) unasked."""
from __future__ import annotations

import json
import os
import sys

import pytest

from specdec.testing import save_tiny_checkpoint
from tests.cli_runs import run_main as _main

RUN = ["--drafters", "ngram", "--max-new-tokens", "2", "--calibration-repeats", "0", "--no-hf-baseline",
       "--no-plots"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two different tiny models in folders of the same name."""
    root = tmp_path_factory.mktemp("models")
    return save_tiny_checkpoint(root / "a" / "tiny", seed=0), save_tiny_checkpoint(root / "b" / "tiny", seed=1)


def _prompts(path, n=3):
    path.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(n)))
    return path


def test_a_prompts_file_runs_whole_and_alone_unless_asked(models, tmp_path, capsys):
    file = _prompts(tmp_path / "mine.jsonl", 3)
    code, _ = _main(["eval", "acceptance", "--model", models[0], "--prompts-file", str(file), *RUN,
                     "--out", str(tmp_path / "whole")], capsys)
    assert code == 0
    rows = json.loads((tmp_path / "whole" / "report.json").read_text())["rows"]
    assert {r["category"] for r in rows} == {"custom"}  # no built-in category added
    assert all(r["prompts"] == 3 for r in rows)  # not capped
    code, _ = _main(["eval", "acceptance", "--model", models[0], "--prompts-file", str(file), "--prompts", "1",
                     "--categories", "qa", *RUN, "--out", str(tmp_path / "asked")], capsys)
    assert code == 0
    rows = json.loads((tmp_path / "asked" / "report.json").read_text())["rows"]
    assert {(r["category"], r["prompts"]) for r in rows if r["level"] != "overall"} == {("qa", 1), ("custom", 1)}


def test_a_category_with_fewer_prompts_than_asked_says_so_and_the_report_records_what_ran(models, tmp_path, capsys):
    """--prompts above a category's size ran fewer, silently, and the report's header said every category ran N."""
    from specdec.eval.cli import select_conversations
    from specdec.eval.prompts import load_prompts

    qa = len(load_prompts("qa", 1000))
    select_conversations("qa", qa + 1, None, None)
    assert capsys.readouterr().err == (f"note: qa has {qa} prompts, fewer than the {qa + 1} per category asked for; "
                                       "all of them run\n")
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", models[0], "--prompts-file", str(_prompts(tmp_path / "p.jsonl", 2)),
            "--prompts", "5", *RUN, "--out", str(out)]
    for extra in ([], ["--resume"]):  # the settings a resume checks are unchanged
        code, captured = _main([*argv, *extra], capsys)
        assert code == 0 and "note: custom has 2 prompts, fewer than the 5 per category asked for" in captured.err
        # a resumed run's seconds are its own, not the kept cells' (the report said nothing of the resume)
        assert json.loads((out / "report.json").read_text())["meta"].get("resumed") is (True if extra else None)
    meta = json.loads((out / "report.json").read_text())["meta"]
    assert meta["prompts_per_category"] == 5 and meta["categories_with_fewer_prompts"] == {"custom": 2}
    assert "- categories_with_fewer_prompts: {'custom': 2}" in (out / "report.md").read_text()


def test_the_report_records_the_dtype_the_model_ran_in(models, tmp_path, capsys):
    """A report of --dtype bfloat16 named the device but not the dtype: its speeds read as float32's."""
    out = tmp_path / "run"
    code, _ = _main(["eval", "acceptance", "--model", models[0], "--categories", "chat", "--prompts", "1", *RUN,
                     "--dtype", "bfloat16", "--out", str(out)], capsys)
    assert code == 0
    assert json.loads((out / "report.json").read_text())["meta"]["dtype"] == "bfloat16"
    assert "- dtype: bfloat16" in (out / "report.md").read_text()


@pytest.mark.parametrize("name", ["overall", "mt_bench"])
def test_a_category_named_like_a_merged_row_is_refused_when_read(models, tmp_path, capsys, name):
    """A category named `overall` replaced the report's overall row over every category (`mt_bench` the group of
    MT-bench's categories), silently."""
    file = tmp_path / "p.jsonl"
    file.write_text(json.dumps({"category": "chat", "prompt": "a"}) + "\n" + json.dumps({"category": name,
                                                                                         "prompt": "b"}) + "\n")
    for command in (["acceptance", *RUN], ["replay", "record", "--max-new-tokens", "2"]):
        out = tmp_path / "out"
        code, captured = _main(["eval", *command, "--model", models[0], "--prompts-file", str(file), "--out",
                                str(out)], capsys)
        assert code == 2 and not out.exists()
        assert captured.err.strip().endswith(f"error: {file}:2: category '{name}' is the name of the report's row "
                                             "merged over categories; rename it"), captured.err


def test_resume_refuses_cells_of_another_model_with_the_same_name(models, tmp_path, capsys):
    argv = ["eval", "acceptance", "--categories", "chat", "--prompts", "1", *RUN, "--out", str(tmp_path / "run")]
    assert _main([*argv, "--model", models[0]], capsys)[0] == 0
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "run" / "cells").iterdir())
    code, captured = _main([*argv, "--model", models[1], "--resume"], capsys)
    assert code == 2
    err = captured.err.strip()
    assert "cannot resume" in err and "model_fingerprint" in err and "\n" not in err
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "run" / "cells").iterdir()) == before
    assert _main([*argv, "--model", models[0], "--resume"], capsys)[0] == 0  # the same model resumes


def test_out_dot_is_refused_before_anything_runs(models, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("the user's file")
    code, captured = _main(["eval", "acceptance", "--model", models[0], "--categories", "chat", "--prompts", "1",
                            *RUN, "--out", "."], capsys)
    assert code == 2 and "--out .: the working directory" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_a_prompts_file_that_is_not_utf8_is_named(models, tmp_path, capsys):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    code, captured = _main(["eval", "acceptance", "--model", models[0], "--prompts-file", str(bad), *RUN,
                            "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and f"prompt file {bad}: not UTF-8 text" in captured.err
    assert not (tmp_path / "run").exists()


def test_replay_record_never_replaces_a_file_unasked(models, tmp_path, capsys):
    prompts = _prompts(tmp_path / "p.jsonl", 1)
    original = prompts.read_bytes()
    record = ["eval", "replay", "record", "--model", models[0], "--max-new-tokens", "2", "--prompts-file",
              str(prompts)]
    for extra in ([], ["--overwrite"]):  # its own prompts file: never
        code, captured = _main([*record, "--out", str(prompts), *extra], capsys)
        assert code == 2 and "is the run's input" in captured.err
        assert prompts.read_bytes() == original
    (tmp_path / "file").write_text("")
    for bad, says in ((["--out", str(tmp_path / "file" / "run.json")], "cannot create its folder"),
                      (["--out", str(tmp_path / "x.json"), "--prompts", "0"], "--prompts must be >= 1")):
        code, captured = _main([*record, *bad], capsys)  # before recording, not after
        assert code == 2 and says in captured.err and "recorded" not in captured.out
    existing = tmp_path / "run.json"
    existing.write_text("someone's results")
    code, captured = _main([*record, "--out", str(existing)], capsys)
    assert code == 2 and "--overwrite" in captured.err and existing.read_text() == "someone's results"
    code, captured = _main([*record, "--out", str(existing), "--overwrite"], capsys)  # no record: --overwrite or not
    assert code == 2 and "is not a replay record" in captured.err and existing.read_text() == "someone's results"
    existing = tmp_path / "run2.json"
    assert _main([*record, "--out", str(existing)], capsys)[0] == 0
    code, captured = _main([*record, "--out", str(existing), "--overwrite"], capsys)  # an earlier record: replaced
    assert code == 0 and " 1 prompt x 2 tokens" in captured.err and " of 1 prompt, " in captured.out  # not "1 prompts"
    first = json.loads(existing.read_text())
    assert first["model_source"] and first["model_fingerprint"]
    other = tmp_path / "other.json"
    assert _main([*record[:4], models[1], *record[5:], "--out", str(other)], capsys)[0] == 0
    second = json.loads(other.read_text())
    assert second["model"] == first["model"] and second["model_fingerprint"] != first["model_fingerprint"]


def test_an_earlier_run_in_out_is_replaced_only_with_overwrite(models, tmp_path, capsys):
    """A second run into the same --out was silently reported over the first (and its cells of other rows were
    reported with the new ones); a certificate's --out was checked only after its minutes of work."""
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", models[0], "--categories", "chat", "--prompts", "1", *RUN, "--out",
            str(out)]
    assert _main(argv, capsys)[0] == 0
    report = (out / "report.json").read_bytes()
    code, captured = _main([*argv[:-2], "--categories", "qa", "--out", str(out)], capsys)
    err = captured.err.strip()
    assert code == 2 and "\n" not in err
    assert "holds an earlier run (report.json, report.md, settings.json, conversations.json, cells)" in err
    assert "--resume" in err and "--overwrite" in err and (out / "report.json").read_bytes() == report
    assert _main([*argv, "--resume", "--overwrite"], capsys)[0] == 2
    # --overwrite with a model or a prompts file that fails replaces nothing: the earlier run stays whole
    for bad in (["--model", str(tmp_path / "nowhere")], ["--prompts-file", str(tmp_path / "none.jsonl")]):
        code, _ = _main([*argv, *bad, "--overwrite"], capsys)
        assert code == 2 and (out / "report.json").read_bytes() == report and (out / "cells").is_dir()
    (out / "cells" / "ngram__chat.json").rename(out / "cells" / "ngram__old.json")  # a row this run will not have
    (out / "cells" / "notes.txt").write_text("the user's")
    code, _ = _main([*argv[:-2], "--categories", "qa", "--out", str(out), "--overwrite"], capsys)
    assert code == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert {r["category"] for r in rows if r["level"] != "overall"} == {"qa"}
    assert sorted(p.name for p in (out / "cells").iterdir()) == ["ngram__qa.json", "notes.txt", "plain__qa.json"]
    cert = tmp_path / "cert"
    cert.mkdir()
    (cert / "certificate.json").write_text("{}")
    code, captured = _main(["eval", "lossless", "--model", "nowhere", "--out", str(cert)], capsys)
    assert code == 2 and "holds an earlier run (certificate.json)" in captured.err  # before loading the model
    (tmp_path / "file").write_text("")  # an --out that cannot be made fails before the run, naming --out
    code, captured = _main(["eval", "lossless", "--model", models[0], "--out", str(tmp_path / "file" / "cert")],
                           capsys)
    assert code == 2 and "--out" in captured.err and "cannot create it" in captured.err


def test_an_out_holding_another_commands_report_is_refused_even_with_overwrite(models, tmp_path, capsys):
    """A training run's folder (heads, report.json, report.md) given as --out was said to hold "an earlier run", and
    --overwrite replaced the training's report with the suite's."""
    out = tmp_path / "heads"
    out.mkdir()
    (out / "report.json").write_text(json.dumps({"kind": "medusa", "eval": {"tau": 1.5}}))
    argv = ["eval", "acceptance", "--model", models[0], "--categories", "chat", "--prompts", "1", *RUN, "--out",
            str(out)]
    for extra in ([], ["--overwrite"], ["--resume"]):
        code, captured = _main([*argv, *extra], capsys)
        assert code == 2 and captured.err.strip() == (
            f"specdec eval acceptance: error: --out {out} holds a report.json that no acceptance run wrote "
            "(train-medusa and train-eagle write one beside their heads); name another directory"), captured.err
    assert json.loads((out / "report.json").read_text())["kind"] == "medusa"


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="POSIX modes, which root is not refused by")
def test_another_users_run_in_out_is_refused_before_any_file_goes(models, tmp_path, capsys):
    """Another user's run in a shared --out: --resume failed at its first write with "[Errno 13] Permission denied"
    naming a temporary file, and --overwrite in a group-writable --out deleted that run's reports, then failed on its
    cells. Both are refused in one line before the model loads, and the earlier run stays whole."""
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", models[0], "--categories", "chat", "--prompts", "1", *RUN, "--out",
            str(out)]
    assert _main(argv, capsys)[0] == 0
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    for folder, extra, said in ((out, "--resume", f"--out {out}: cannot write into it ({out} is not writable)"),
                                (out / "cells", "--overwrite", f"this user may not delete what {out / 'cells'} holds")):
        os.chmod(folder, 0o555)
        try:
            code, captured = _main([*argv, extra], capsys)
        finally:
            os.chmod(folder, 0o755)
        err = captured.err.strip()
        assert code == 2 and "\n" not in err and said in err, err
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_replay_record_keeps_a_conversations_system_messages(chat_ckpt, tmp_path, capsys):
    """A recorded prompt is the conversation's first turn as eval acceptance measures it: system messages first."""
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "be a pirate"}, {"role": "user", "content": "say hi"}]
    prompts = tmp_path / "sys.jsonl"
    prompts.write_text(json.dumps({"messages": messages}) + "\n")
    out = tmp_path / "run.json"
    code, captured = _main(["eval", "replay", "record", "--model", chat_ckpt, "--max-new-tokens", "2",
                            "--prompts-file", str(prompts), "--out", str(out)], capsys)
    assert code == 0, captured.err
    tok = AutoTokenizer.from_pretrained(chat_ckpt)
    expected = list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    assert json.loads(out.read_text())["sequences"][0]["prompt_ids"] == expected


def test_replay_record_takes_eval_acceptances_spelling_of_categories(models, tmp_path, capsys):
    """Its flag was --category only, while its messages (and eval acceptance) say --categories."""
    for flag in ("--categories", "--category"):
        code, captured = _main(["eval", "replay", "record", "--model", models[0], flag, "nosuch", "--out",
                                str(tmp_path / "run.json")], capsys)
        assert code == 2 and "unknown categories nosuch" in captured.err, captured.err
