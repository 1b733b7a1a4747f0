"""``specdec eval acceptance --resume`` trusts nothing it reads: a finished run on a tiny model is copied and its
cells / settings.json damaged one way each; the resume must refuse before measuring anything, with a one-line
``SpecdecError`` that names the file, and leave the files as they were."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest
from specdec.eval.acceptance import SuiteConfig, cell_path, merge_cells, run_cells, run_suite

from specdec.errors import SpecdecError
from specdec.testing import save_tiny_checkpoint

PROMPTS = {"rep": [[1, 2, 3, 1, 2, 3, 1, 2]], "mix": [[9, 4, 7, 1, 3]]}


def _sha256(obj) -> str:  # the documented checksum: SHA-256 of canonical JSON
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _reseal(data: dict) -> None:
    """What someone editing a cell and recomputing its checksum would write."""
    data["sha256"] = _sha256({k: v for k, v in data.items() if k != "sha256"})


@pytest.fixture(scope="module")
def loaded(eval_tiny_model):
    return eval_tiny_model


@pytest.fixture(scope="module")
def config():
    return SuiteConfig((("ngram", {}),), tuple(PROMPTS), prompts_per_category=1, max_new_tokens=6, hf_baseline=False,
                       calibration_repeats=1)


@pytest.fixture(scope="module")
def finished(tmp_path_factory, loaded, config):
    """A finished run (cells plain / ngram x rep / mix), measured once for the module; tests damage copies."""
    out = tmp_path_factory.mktemp("finished")
    run_suite(loaded, PROMPTS, config, out)
    return out


@pytest.fixture
def run(tmp_path, finished):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


def _snapshot(out):
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def _refused(loaded, config, out, *names, match=None):
    """Resume must raise one one-line SpecdecError (a ValueError) naming every file in ``names`` and change nothing."""
    before = _snapshot(out)
    with pytest.raises(SpecdecError, match=match) as err:
        run_suite(loaded, PROMPTS, config, out, resume=True)
    message = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in message
    for name in names:
        assert str(out / name) in message, message
    assert _snapshot(out) == before  # nothing measured, nothing rewritten
    return message


def test_a_sound_run_resumes_without_measuring_anything_again(loaded, config, run):
    before = _snapshot(run)
    cells = run_suite(loaded, PROMPTS, config, run, resume=True)
    assert _snapshot(run) == before and cells[("ngram", "rep")].new_tokens == 6
    cell = json.loads(cell_path(run, "ngram", "rep").read_text())
    assert set(cell) == {"schema", "settings_sha256", "rank", "cell", "sha256"} and cell["cell"]["calibration"]
    settings = json.loads((run / "settings.json").read_text())
    assert settings["sha256"] == _sha256(settings["settings"]) == cell["settings_sha256"]


def _edit(key, value):
    def change(data):
        data[key] = value
    return change


def _edit_cell(key, value, reseal=True):
    def change(data):
        if value is _DELETE:
            del data["cell"][key]
        else:
            data["cell"][key] = value
        if reseal:
            _reseal(data)
    return change


def _resealed(change):
    def both(data):
        change(data)
        _reseal(data)
    return both


_DELETE = object()
CELL_DAMAGE = {  # id: (how the file ngram__rep.json is damaged, what the error says)
    "not-json": ("text", "{not json", "not valid JSON"),
    "truncated": ("truncate", None, "not valid JSON"),
    "binary": ("bytes", b"\xff\xfe\x00garbage", "not UTF-8"),
    "a-list": ("text", "[1, 2]", "expected a JSON object, got list"),
    "older-specdec": ("replace", lambda d: d["cell"], "written by an older specdec"),
    "wrong-schema": ("json", _resealed(_edit("schema", "specdec-acceptance-cell/99")), "schema 'specdec-acceptance"),
    "missing-key": ("json", lambda d: d.pop("rank"), r"missing field\(s\) rank"),
    "extra-key": ("json", _edit("note", "mine"), r"unexpected field\(s\) note"),
    "edited": ("json", _edit_cell("steps", 12345, reseal=False), "sha256 does not match"),
    "edited-checksum-gone": ("json", _edit("sha256", "0" * 64), "sha256 does not match"),
    "other-settings": ("json", _resealed(_edit("settings_sha256", "0" * 64)), "other settings than this run's"),
    "int-as-string": ("json", _edit_cell("steps", "12"), "'steps' must be an integer"),
    "int-as-bool": ("json", _edit_cell("prompts", True), "'prompts' must be an integer"),
    "negative-seconds": ("json", _edit_cell("seconds", -1.0), "'seconds' must be a finite number"),
    "infinite-seconds": ("json", _edit_cell("seconds", float("inf")), "'seconds' must be a finite number"),
    "empty-output-digest": ("json", _edit_cell("output_sha256", ""), "'output_sha256' must be a non-empty string"),
    "histogram-of-floats": ("json", _edit_cell("accepted_histogram", [1.5]), "'accepted_histogram' must be a list"),
    "calibration-entry": ("json", _edit_cell("calibration", [{"query_tokens": 2}]), "'calibration' must be"),
    "missing-field": ("json", _edit_cell("seconds", _DELETE), r"missing cell field\(s\) seconds"),
    "extra-field": ("json", _edit_cell("tau", 3.0), r"unexpected cell field\(s\) tau"),
    "cell-not-object": ("json", _resealed(_edit("cell", [])), "'cell' must be a JSON object"),
    "other-cell": ("json", _edit_cell("category", "mix"), "holds the cell of ngram / mix"),
    "other-rank": ("json", _resealed(_edit("rank", 1)), r"ngram / rep \(rank 1\), not of ngram / rep \(copied"),
}


@pytest.mark.parametrize("damage", CELL_DAMAGE, ids=list(CELL_DAMAGE))
def test_a_damaged_cell_is_refused_naming_its_file(loaded, config, run, damage):
    how, change, match = CELL_DAMAGE[damage]
    path = cell_path(run, "ngram", "rep")
    if how == "text":
        path.write_text(change)
    elif how == "bytes":
        path.write_bytes(change)
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    else:
        data = json.loads(path.read_text())
        replaced = change(data)  # "json": changes data in place; "replace": returns what the file holds instead
        path.write_text(json.dumps(replaced if how == "replace" else data))
    message = _refused(loaded, config, run, "cells/ngram__rep.json", match=match)
    assert "cannot resume" in message and "delete it" in message and "--overwrite instead of --resume" in message


def test_a_cell_copied_over_another_is_refused(loaded, config, run):
    shutil.copyfile(cell_path(run, "ngram", "rep"), cell_path(run, "ngram", "mix"))
    _refused(loaded, config, run, "cells/ngram__mix.json", match="holds the cell of ngram / rep")


def test_every_bad_cell_is_named_in_one_line(loaded, config, run):
    cell_path(run, "plain", "rep").write_text("")
    cell_path(run, "ngram", "mix").write_text("{}")
    cell_path(run, "ngram", "rep").unlink()  # missing: would be measured, but not before the others are fixed
    message = _refused(loaded, config, run, "cells/plain__rep.json", "cells/ngram__mix.json",
                       match="2 finished cell file")
    assert "delete them" in message and "ngram__rep" not in message


def test_cells_left_by_a_run_with_other_settings_are_refused(loaded, config, run, tmp_path):
    """A non-resumed run with other settings rewrites settings.json, then dies before rewriting the cells: resuming
    it must not reuse the first run's cells, although settings.json now matches."""
    longer = dataclasses.replace(config, max_new_tokens=7)
    other = tmp_path / "other"
    run_suite(loaded, PROMPTS, longer, other)
    shutil.copyfile(other / "settings.json", run / "settings.json")
    shutil.copyfile(cell_path(other, "ngram", "rep"), cell_path(run, "ngram", "rep"))  # the one cell it finished
    message = _refused(loaded, longer, run, "cells/plain__rep.json", "cells/plain__mix.json",
                       "cells/ngram__mix.json", match="3 finished cell file")
    assert "ngram__rep" not in message  # measured under these settings: would be reused


SETTINGS_DAMAGE = {  # id: (how settings.json is changed, what the error says)
    "not-json": (lambda text: text[:-5], "not valid JSON"),
    "a-string": (lambda text: '"settings"', "expected a JSON object, got str"),
    "older-specdec": (lambda text: json.dumps(json.loads(text)["settings"]), "written by an older specdec"),
    "wrong-schema": (lambda text: json.dumps({**json.loads(text), "schema": 3}), "schema 3, expected"),
    "missing-key": (lambda text: json.dumps({k: v for k, v in json.loads(text).items() if k != "sha256"}),
                    r"missing field\(s\) sha256"),
    "edited": (lambda text: text.replace('"max_new_tokens": 6', '"max_new_tokens": 7'), "sha256 does not match"),
    "not-an-object": (lambda text: json.dumps({**json.loads(text), "settings": [], "sha256": _sha256([])}),
                      "'settings' must be a JSON object"),
}


@pytest.mark.parametrize("damage", SETTINGS_DAMAGE, ids=list(SETTINGS_DAMAGE))
def test_a_damaged_settings_json_is_refused_naming_it(loaded, config, run, damage):
    change, match = SETTINGS_DAMAGE[damage]
    path = run / "settings.json"
    text = path.read_text()
    path.write_text(change(text))
    assert path.read_text() != text
    message = _refused(loaded, config, run, "settings.json", match=match)
    assert "--overwrite instead of --resume" in message and "delete it to resume anyway" in message
    cells = _snapshot(run / "cells")
    path.unlink()  # as the message says: safe, every cell is checked against its own settings digest
    run_suite(loaded, PROMPTS, config, run, resume=True)
    assert _snapshot(run / "cells") == cells and json.loads(path.read_text())["schema"]


def test_a_resume_under_other_threads_is_refused_naming_them(loaded, config, run):
    """Speed depends on torch's threads: a run measured under one thread resumed under two would set the new cells'
    tokens/s against the old plain cell's. Refused in one line naming the difference, also without settings.json
    (every cell's settings digest holds the conditions)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        message = _refused(loaded, config, run, "settings.json", match="other speed conditions")
        assert f"threads: {threads} in settings.json, {threads + 1} now" in message and "--overwrite" in message
        (run / "settings.json").unlink()
        _refused(loaded, config, run, "cells/plain__rep.json", "cells/ngram__mix.json",
                 match="4 finished cell file.*other settings than this run's")
    finally:
        torch.set_num_threads(threads)


def test_a_resume_under_other_settings_names_their_values(loaded, config, run):
    """A resume under other settings named them only ("num_processes differ"), and offered another directory or
    --overwrite: the values recorded say how to resume (a launch of as many processes, the same --seed), digests and
    lists are named."""
    other = dataclasses.replace(config, max_new_tokens=7, seed=3, categories=("rep",))
    message = _refused(loaded, other, run, "settings.json", match="measured with other settings")
    assert "max_new_tokens: 6 in settings.json, 7 now; seed: 0 in settings.json, 3 now; categories differs" in message
    assert "resume with those" in message and "--overwrite instead of --resume" in message


def test_a_run_of_a_specdec_that_did_not_record_the_machine_is_refused(loaded, config, run):
    path = run / "settings.json"
    data = json.loads(path.read_text())
    del data["settings"]["machine"]
    data.update(schema="specdec-acceptance-settings/2", sha256=_sha256(data["settings"]))
    path.write_text(json.dumps(data))
    message = _refused(loaded, config, run, "settings.json", match="older specdec, which did not record the device")
    assert "--overwrite" in message


def test_rank_files_are_checked_for_their_rank(loaded, config, tmp_path):
    """Each process's cell file records its rank: rank 0's file copied over rank 1's is refused, on resume and when
    the run's cells are merged."""
    settings = {"stand-in": "the run's settings"}
    for rank in (0, 1):
        run_cells(loaded, PROMPTS, config, tmp_path, rank=rank, settings=settings)
    merge_cells(tmp_path, config.labels, list(PROMPTS), 2, settings)  # sound
    shutil.copyfile(cell_path(tmp_path, "plain", "mix", 0), cell_path(tmp_path, "plain", "mix", 1))
    bad = str(cell_path(tmp_path, "plain", "mix", 1))
    with pytest.raises(SpecdecError, match=r"holds the cell of plain / mix \(rank 0\)") as err:
        run_cells(loaded, PROMPTS, config, tmp_path, rank=1, resume=True, settings=settings)
    assert bad in str(err.value)
    with pytest.raises(SpecdecError, match=r"\(rank 0\), not of plain / mix \(rank 1\)"):
        merge_cells(tmp_path, config.labels, list(PROMPTS), 2, settings)


def test_cli_resume_over_an_edited_cell_exits_2_naming_it(tmp_path, capsys):
    from specdec.cli import main

    model = save_tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", str(model), "--drafters", "ngram", "--categories", "chat", "--prompts",
            "1", "--max-new-tokens", "4", "--calibration-repeats", "0", "--no-hf-baseline", "--no-plots",
            "--out", str(out)]
    assert main(argv) == 0
    path = cell_path(out, "ngram", "chat")
    data = json.loads(path.read_text())
    data["cell"]["new_tokens"] += 1
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec eval acceptance: error: cannot resume"), err
    assert str(path) in err[0] and "sha256 does not match" in err[0]
