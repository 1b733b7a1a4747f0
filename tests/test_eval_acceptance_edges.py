"""`specdec eval acceptance` edge cases: a category named like another's turn cell and two row labels spelled alike in
cell file names are refused up front; merged rows of transformers' baseline say "unknown", not "differs"; a quoted
CSV field keeps its line breaks; a built-in `math` keeps its summary column; an earlier run's plots do not survive
beside a report they do not show; a resume checks every turn's cells before it measures anything; the report files
are swapped in whole."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from specdec.eval.acceptance import NO_OUTPUTS, Cell, SuiteConfig, cell_path, chain_outputs
from specdec.eval.conversations import chat_codec, run_conversations
from specdec.eval.prompt_files import Conversation, cell_turns, read_prompt_file
from specdec.eval.report import PLOT_FILES, markdown, plots
from specdec.eval.spec_bench import report_rows

from specdec.errors import InputError, SpecdecError
from specdec.testing import save_tiny_checkpoint
from tests.cli_runs import run_main

RUN = ["--drafters", "ngram", "--max-new-tokens", "2", "--calibration-repeats", "0", "--no-hf-baseline"]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_a_category_named_like_another_ones_turn_cell_is_refused_when_read(tmp_path):
    """`writing.turn2` beside a two-turn `writing`: both wrote cells/<row>__writing.turn2.json, one over the other."""
    records = [{"category": "writing", "turns": ["a poem", "now rhyme"]}, {"category": "writing.turn2", "turns": ["x"]}]
    for order in (records, records[::-1]):
        path = _jsonl(tmp_path / "clash.jsonl", order)
        with pytest.raises(InputError) as err:
            read_prompt_file(path)
        text = str(err.value)
        assert "\n" not in text and "turn 2 of category 'writing'" in text and "category 'writing.turn2'" in text
        assert f"{path}:1" in text and f"{path}:2" in text
    with pytest.raises(InputError, match="writing.turn2"):  # conversations made in code too
        cell_turns([Conversation("writing", ("a", "b")), Conversation("writing.turn2", ("c",))])
    fine = _jsonl(tmp_path / "fine.jsonl", [records[0], {"category": "writing.turn3", "turns": ["x"]}])
    assert list(cell_turns(read_prompt_file(fine))) == ["writing.turn1", "writing.turn2", "writing.turn3"]


def _cell(label, category, tokens, known=True, steps=4):
    cell = Cell(label, category, prompts=1, new_tokens=8, steps=steps, seconds=1.0, prefill_seconds=0.1)
    if known:
        cell.output_sha256 = chain_outputs(NO_OUTPUTS, [tokens])
    return cell


def test_merged_rows_of_the_hf_baseline_are_unknown_not_different():
    """Merging two unknown digests made a known one: the overall row of hf-greedy said NO where its categories
    said "-"; its tau was 0.0 in report.json where report.md showed "-"."""
    cells = {}
    for category, tokens in (("qa", [1, 2]), ("chat", [3, 4])):
        cells["plain", category] = _cell("plain", category, tokens, steps=8)
        cells["ngram", category] = _cell("ngram", category, tokens)
        cells["hf-greedy", category] = _cell("hf-greedy", category, tokens, known=False, steps=0)
    turns = {"qa": ("qa", 1), "chat": ("chat", 1)}
    rows = {(r["drafter"], r["category"]): r for r in report_rows(cells, turns, mt_bench=())}
    for category in ("qa", "chat", "overall"):
        assert rows["hf-greedy", category]["identical_to_plain"] is None
        assert rows["hf-greedy", category]["tau"] is None
        assert rows["ngram", category]["identical_to_plain"] is True and rows["ngram", category]["tau"] == 2.0
    cells["ngram", "chat"] = _cell("ngram", "chat", [3, 5])  # a differing category still shows in the merge
    rows = {(r["drafter"], r["category"]): r for r in report_rows(cells, turns, mt_bench=())}
    assert rows["ngram", "overall"]["identical_to_plain"] is False
    assert "| hf-greedy | - |" in markdown(list(rows.values()), {})


def test_a_quoted_csv_field_keeps_its_line_breaks(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('prompt,category\n"first line\nsecond line",qa\n"one, line",qa\n', encoding="utf-8")
    convs = read_prompt_file(path)
    assert [c.turns for c in convs] == [("first line\nsecond line",), ("one, line",)]
    assert convs[1].where == f"{path}:4"


def test_row_labels_with_one_cell_file_name_are_refused_before_anything_loads(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"'a/b' and 'a_b' would write the same cell files"):
        SuiteConfig((("a/b", {}), ("a_b", {})), ("qa",))
    code, captured = run_main(["eval", "acceptance", "--model", str(tmp_path / "no-model"), "--drafters",
                               "a/b=ngram,a_b=ngram", "--categories", "qa", "--prompts", "1",
                               "--out", str(tmp_path / "run")], capsys)
    err = captured.err.strip()
    assert code == 2 and "\n" not in err and "'a/b' and 'a_b'" in err  # not the missing model: nothing loaded


def test_row_labels_that_differ_only_in_dash_and_underscore_are_refused(tmp_path, capsys):
    """--drafter-option keys arrive with - turned into _: `a-b.max_nodes=1` went to row a_b, without a word."""
    code, captured = run_main(["eval", "acceptance", "--model", str(tmp_path / "no-model"), "--drafters",
                               "a-b=ngram,a_b=ngram", "--drafter-option", "a-b.max_nodes=1", "--categories", "qa",
                               "--out", str(tmp_path / "run")], capsys)
    err = captured.err.strip()
    assert code == 2 and "\n" not in err and "'a-b' and 'a_b' differ only in - and _" in err, err


def test_a_seed_at_temperature_0_is_left_out_so_a_resume_with_another_seed_goes_on(model, tmp_path, capsys):
    """At --temperature 0 the seed draws nothing, yet settings.json recorded it: `--resume` with another --seed
    (or none) was refused as other settings, for the same greedy run. It is left out, with a note."""
    out = tmp_path / "run"
    args = ["eval", "acceptance", "--model", model, "--categories", "qa", "--prompts", "1", *RUN, "--no-plots",
            "--out", str(out)]
    code, captured = run_main(args + ["--seed", "5"], capsys)
    assert code == 0 and captured.err.count("note: --seed 5 left out: at --temperature 0") == 1, captured.err
    code, captured = run_main(args + ["--seed", "7", "--resume"], capsys)
    assert code == 0, captured.err


def test_a_coupled_sampler_at_temperature_0_is_left_out_and_the_report_says_so(model, tmp_path, capsys):
    """At the default --temperature 0 (greedy) --sampler coupled did nothing: generate() warned on every call to pass
    a --do-sample this command has not, and the report recorded a coupled run."""
    out = tmp_path / "run"
    code, captured = run_main(["eval", "acceptance", "--model", model, "--categories", "qa", "--prompts", "1", *RUN,
                               "--sampler", "coupled", "--no-plots", "--out", str(out)], capsys)
    assert code == 0 and captured.err.count("--sampler coupled left out: at --temperature 0") == 1
    assert "do_sample" not in captured.err
    assert json.loads((out / "report.json").read_text())["meta"]["sampler"] == "standard"


def test_a_row_label_holding_the_cell_separator_is_refused():
    """Label `x` with category `y__z` and label `x__y` with category `z` both wrote cells/x__y__z.json."""
    with pytest.raises(ValueError, match=r"'x__y' hold '__'"):
        SuiteConfig((("x__y", {}),), ("qa",))
    SuiteConfig((("x_y", {}),), ("qa",))  # one underscore is a label like any other


def test_a_built_in_math_category_has_its_summary_column():
    """Every MT-bench name was left out of the summary at category level, the built-in `math` too."""
    cells = {(label, c): _cell(label, c, [1]) for label in ("plain", "ngram") for c in ("qa", "math")}
    rows = report_rows(cells, {"qa": ("qa", 1), "math": ("math", 1)}, mt_bench=())  # built-ins: no mt_bench group
    assert "| drafter | qa | math | overall |" in markdown(rows, {})


def test_a_summary_entry_is_the_speedup_then_tau():
    """The table's legend says "speedup / tau": a row 2x faster than plain at tau 3 reads "2.00x / 3.00"."""
    from specdec.eval.report import summary_tables

    row = {"drafter": "ngram", "category": "qa", "level": "category", "speedup_vs_plain": 2.0, "tau": 3.0}
    assert "| ngram | 2.00x / 3.00 |" in summary_tables([row])


def _report_row(**values) -> dict:
    row = {"drafter": "ngram", "category": "qa", "tau": 2.0, "tokens_per_s": 10.0, "speedup_vs_plain": 2.0,
           "identical_to_plain": True, "speedup_vs_hf": None, "acceptance_per_depth": [0.9, 0.6, 0.3],
           "accepted_histogram": [1, 1], "predicted_speedup": 1.5, "predicted_speedup_mean_size": 1.2,
           "predicted_over_measured": 0.75}
    return {**row, **values}


def test_the_predicted_column_shows_the_per_step_price_not_the_mean_size_one():
    """predicted_speedup 1.5 (each step at its own tree's cost), 1.2 at the mean size: the column shows 1.50x, the
    number its pred/meas 0.75 = 1.5 / 2.0 is of."""
    line = next(x for x in markdown([_report_row()], {}).splitlines() if x.startswith("| ngram"))
    assert "| 1.50x | 0.75 |" in line, line


def test_the_acceptance_plot_draws_every_depth_from_depth_1(tmp_path, monkeypatch):
    """Acceptance 0.9, 0.6, 0.3 at depths 1, 2, 3 is plotted as those three points, the first depth included."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    drawn = []
    real = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((list(args[0]), list(args[1])))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    plots([_report_row()], tmp_path)
    assert drawn == [([1, 2, 3], [0.9, 0.6, 0.3])]


def test_plots_without_a_drafted_token_have_no_legend_and_say_nothing(tmp_path):
    """A drafter that never drafted has no acceptance line, and a run of plain alone no bar: no legend then, where
    matplotlib warned "No artists with labels found" on the user's console; a drafted row keeps its legend."""
    pytest.importorskip("matplotlib")
    import warnings

    from matplotlib.axes import Axes

    made = []
    real = Axes.legend
    for rows in ([_report_row(acceptance_per_depth=[])], [_report_row(drafter="plain")], [_report_row()]):
        made.append(0)
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
            warnings.simplefilter("error")
            patch.setattr(Axes, "legend", lambda self, *a, **kw: made.append(made.pop() + 1) or real(self, *a, **kw))
            plots(rows, tmp_path)
    assert made == [1, 0, 2]  # never drafted: the bars' legend only; plain alone: none; drafted: both panels'


def test_a_plot_stopped_while_written_leaves_the_earlier_one_whole(tmp_path, monkeypatch):
    """savefig wrote straight to the plot's file: a Ctrl-C while it wrote left a PNG cut short beside the report."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    plots([_report_row()], tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in PLOT_FILES}

    def cut_short(self, fname, *args, **kwargs):  # the first bytes written, then Ctrl-C
        Path(fname).write_bytes(b"\x89PNG cut")
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(KeyboardInterrupt):
        plots([_report_row(tau=3.0)], tmp_path)
    assert {name: (tmp_path / name).read_bytes() for name in PLOT_FILES} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PLOT_FILES)  # no temporary file left


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def test_an_earlier_runs_plots_do_not_survive_beside_a_report_they_do_not_show(model, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", model, "--categories", "qa", "--prompts", "1", *RUN, "--out", str(out)]
    assert run_main(argv, capsys)[0] == 0
    assert all((out / name).exists() for name in PLOT_FILES)
    code, captured = run_main([*argv[:5], "chat", *argv[6:]], capsys)  # another run: the plots count as one's
    assert code == 2 and PLOT_FILES[0] in captured.err
    cell_path(out, "ngram", "qa").unlink()
    assert run_main([*argv, "--resume", "--no-plots"], capsys)[0] == 0  # a cell measured again: stale plots
    assert not any((out / name).exists() for name in PLOT_FILES)
    assert run_main(argv[:-2] + ["--out", str(out), "--overwrite"], capsys)[0] == 0
    assert run_main([*argv[:5], "chat", *argv[6:], "--overwrite", "--no-plots"], capsys)[0] == 0
    assert not any((out / name).exists() for name in PLOT_FILES)
    assert "## chat" in (out / "report.md").read_text()


def test_an_earlier_runs_conversations_count_as_its_files(tmp_path):
    """--overwrite left an earlier run's conversations.json beside the new run until its last turn rewrote it."""
    from specdec.eval.cli import ACCEPTANCE_FILES, check_earlier_run

    (tmp_path / "conversations.json").write_text("{}")
    with pytest.raises(ValueError, match="holds an earlier run \\(conversations.json\\)"):
        check_earlier_run(tmp_path, ACCEPTANCE_FILES, overwrite=False)
    assert check_earlier_run(tmp_path, ACCEPTANCE_FILES, overwrite=True) == [tmp_path / "conversations.json"]


def test_overwrite_removes_the_temporary_files_a_killed_run_left_and_nothing_else(tmp_path):
    """A run killed between an atomic write and its rename left NAME.PID.THREAD.tmp in --out and cells/, which
    --overwrite kept for good (the cells of a row the new run lacks were never written again). They go with the
    earlier run's files; a file of the user's stays."""
    from specdec.eval.cli import ACCEPTANCE_FILES, _clear_earlier_run, check_earlier_run

    cells = tmp_path / "cells"
    cells.mkdir()
    for name in ("report.json", "report.json.11.12.tmp", "notes.txt", "cells/ngram__qa.json",
                 "cells/ngram__qa.json.13.14.tmp", "cells/gone__chat.json.15.16.tmp", "cells/readme.md"):
        (tmp_path / name).write_text("{")
    _clear_earlier_run(check_earlier_run(tmp_path, ACCEPTANCE_FILES, overwrite=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cells", "notes.txt"]
    assert [p.name for p in cells.iterdir()] == ["readme.md"]


def test_a_resume_checks_every_turns_cells_before_it_measures(eval_tiny_model, tmp_path):
    """A damaged turn-3 cell was refused only after the turn-1 cells were measured again."""
    convs = [Conversation("writing", ("Write a poem.", "Shorter.", "Shorter still."))]
    config = SuiteConfig((("ngram", {}),), ("writing",), max_new_tokens=4, hf_baseline=False, calibration_repeats=0)
    out = tmp_path / "run"
    codec = chat_codec(eval_tiny_model)
    run_conversations(eval_tiny_model, convs, codec, config, out)
    for label in ("plain", "ngram"):
        cell_path(out, label, "writing.turn1").unlink()
    cell_path(out, "ngram", "writing.turn3").write_text("{")
    with pytest.raises(SpecdecError, match=r"ngram__writing\.turn3\.json"):
        run_conversations(eval_tiny_model, convs, codec, config, out, resume=True)
    assert not cell_path(out, "plain", "writing.turn1").exists()  # nothing measured before the refusal


def test_a_report_write_stopped_halfway_leaves_the_earlier_report(tmp_path, monkeypatch):
    """report.json and report.md are swapped in whole: a run stopped while writing them (SIGTERM) left half a file."""
    from specdec.eval.report import write_reports

    write_reports([], tmp_path, {"run": "earlier"}, with_plots=False)
    before = {name: (tmp_path / name).read_text() for name in ("report.json", "report.md")}

    def halfway(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", halfway)
    with pytest.raises(KeyboardInterrupt):
        write_reports([], tmp_path, {"run": "later"}, with_plots=False)
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_text() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "report.md"]


def test_a_run_of_one_category_has_no_overall_row():
    """One category: its row is already every cell, so no "overall" row (or summary column) repeats it; two
    categories get one, whose tokens are both categories' 8 + 8 = 16."""
    one = {(label, "qa"): _cell(label, "qa", [1]) for label in ("plain", "ngram")}
    rows = report_rows(one, {"qa": ("qa", 1)}, mt_bench=())
    assert [(r["drafter"], r["category"]) for r in rows] == [("plain", "qa"), ("ngram", "qa")]
    assert "| drafter | qa |" in markdown(rows, {})
    two = {**one, **{(label, "chat"): _cell(label, "chat", [1]) for label in ("plain", "ngram")}}
    overall = [r for r in report_rows(two, {"qa": ("qa", 1), "chat": ("chat", 1)}, mt_bench=())
               if r["category"] == "overall"]
    assert [r["new_tokens"] for r in overall] == [16, 16]


def test_the_overall_and_group_sections_say_their_level_in_the_heading():
    """A category's section is "## qa"; the merged ones say what they merge: "## mt_bench (group)", "## overall
    (overall)"."""
    cells = {(label, c): _cell(label, c, [1]) for label in ("plain", "ngram") for c in ("writing", "qa")}
    headings = [x for x in markdown(report_rows(cells, {"writing": ("writing", 1), "qa": ("qa", 1)}), {}).splitlines()
                if x.startswith("## ") and not x.startswith("## Summary") and not x.startswith("## MT-bench")]
    assert headings == ["## writing", "## qa", "## mt_bench (group)", "## overall (overall)"]


def test_the_plots_show_categories_groups_and_overall_not_single_turns(tmp_path, monkeypatch):
    """writing's two turns are in the Markdown only: the acceptance plot has one panel each for writing, qa, mt_bench
    and overall (four titles, not six)."""
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    titles = []
    real = Axes.set_title

    def spy(self, label, *args, **kwargs):
        titles.append(label)
        return real(self, label, *args, **kwargs)

    monkeypatch.setattr(Axes, "set_title", spy)
    turns = {"writing.turn1": ("writing", 1), "writing.turn2": ("writing", 2), "qa": ("qa", 1)}
    cells = {(label, n): _cell(label, n, [1]) for label in ("plain", "ngram") for n in turns}
    plots(report_rows(cells, turns), tmp_path)
    assert titles[:4] == ["writing", "qa", "mt_bench", "overall"] and titles[4].startswith("tau")


def test_the_vs_hf_column_shows_the_speedup_over_transformers_not_over_plain():
    """2x plain's tokens/s but 0.8x transformers' generate(): the row reads "| 2.00x | yes | 0.80x |"."""
    line = next(x for x in markdown([_report_row(speedup_vs_hf=0.8)], {}).splitlines() if x.startswith("| ngram"))
    assert [c.strip() for c in line.split("|")[4:7]] == ["2.00x", "yes", "0.80x"], line


def test_a_library_warning_during_the_run_names_the_commands_flags(tmp_path, capsys, caplog):
    """A drafter the cost model says cannot pay warned "(speculation='always' verifies its drafts anyway)": on the
    command line that is --speculation always."""
    target, draft = save_tiny_checkpoint(tmp_path / "target"), save_tiny_checkpoint(tmp_path / "draft", seed=1)
    with caplog.at_level(logging.WARNING, logger="specdec.speculation_policy"):
        code, _ = run_main(["eval", "acceptance", "--model", target, "--out", str(tmp_path / "out"), "--prompts", "1",
                            "--categories", "chat", "--no-hf-baseline", "--no-plots", "--calibration-repeats", "1",
                            "--drafters", "draft-model", "--drafter-option", f"model={draft}", "--max-new-tokens",
                            "2", "--speculation", "auto"], capsys)
    warning = next(r.getMessage() for r in caplog.records if r.name == "specdec.speculation_policy")
    assert code == 0 and "(--speculation always verifies its drafts anyway)" in warning, warning


def test_said_as_flags_names_only_the_commands_flags():
    """eval lossless has --temperature but no --max-new-tokens or --do-sample: those stay generate()'s names."""
    from specdec.cli import said_as_flags

    flags = ("--temperature", "--drafter")
    assert said_as_flags("temperature=0.5 and max_new_tokens=3; pass do_sample=True or drafter=...", flags) == (
        "--temperature 0.5 and max_new_tokens=3; pass do_sample=True or --drafter NAME")
    # a --drafter-option KEY of the same name is what the user typed: draft-model's seed=3 is not --seed 3
    assert said_as_flags("seed=3 and top_k=4 past max_nodes", None, {"seed", "top_k"}) == (
        "seed=3 and top_k=4 past max_nodes")

