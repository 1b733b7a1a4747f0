"""`specdec eval acceptance` runs each row's drafter as generate() would and knows it by its checkpoint: the counting
wrapper hands the engine every hook of the drafter (a cell under speculation auto is generate()'s run); a head
rewritten in place is refused on --resume, the same head spelled relative or absolute is not; a mistyped path= or a
head of another vocabulary is refused before --overwrite deletes the earlier run, and a refused run leaves nothing
in a fresh --out."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import specdec.eval.resume as resume
from specdec.drafters.base import Drafter
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads, save_medusa
from specdec.drafters.registry import get_drafter
from specdec.eval.acceptance import (
    NO_OUTPUTS,
    SuiteConfig,
    _CountingDrafter,
    chain_outputs,
    merge_cells,
    run_cells,
    run_suite,
)
from specdec.eval.resume import ResumeError, check_resumable, run_settings, settings_record

from specdec.atomic_write import write_json
from specdec.generate import generate
from specdec.testing import save_tiny_checkpoint
from tests.cli_runs import run_main

PROMPTS = {"rep": [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]]}
RUN = ["--categories", "qa", "--prompts", "1", "--max-new-tokens", "2", "--calibration-repeats", "0",
       "--no-hf-baseline", "--no-plots"]


def _public(cls) -> list[str]:
    return [name for name in dir(cls) if not name.startswith("_")]


def test_the_counting_wrapper_forwards_every_attribute_of_the_drafter_contract(monkeypatch):
    """Hooks it did not pass on (never_pays_by_shape, calibrated_scores, looks_back, ...) fell back to the base
    class's defaults, so a cell under speculation auto ran another policy than generate() with the same drafter."""
    monkeypatch.setattr(Drafter, "a_later_hook", lambda self: None, raising=False)  # one the base class gains later
    names = _public(Drafter)
    own = {}
    for name in names:  # an override of every public attribute, each telling itself apart
        base = getattr(Drafter, name)
        if isinstance(Drafter.__dict__.get(name), classmethod):
            own[name] = classmethod(lambda cls, *a, n=name, **k: ("inner", n))
        elif callable(base):
            own[name] = lambda self, *a, n=name, **k: ("inner", n)
        else:
            own[name] = ("inner", name)
    inner = type("Inner", (Drafter,), own)()
    wrapper = _CountingDrafter(inner)
    assert isinstance(wrapper, Drafter)
    for name in names:
        if name in ("propose", "propose_pending"):  # the wrapper's own: they count, then give the drafter's
            continue
        assert getattr(wrapper, name) == getattr(inner, name), name
    assert wrapper.a_later_hook() == ("inner", "a_later_hook")
    assert wrapper.propose([]) == ("inner", "propose")
    wrapper.target = "the target"  # what the engine sets on its drafter is the drafter's
    assert inner.target == "the target" and "target" not in vars(wrapper)


def test_a_cell_under_speculation_auto_is_what_generate_makes(eval_tiny_model, tmp_path):
    """The target drafting for itself never pays (never_pays_by_shape): generate() decodes plainly, but the suite's
    wrapper hid the hook and its cell drafted every step (tau 4.8 against generate()'s 1.0)."""
    loaded = eval_tiny_model
    options = {"model": loaded, "num_draft_tokens": 3}
    config = SuiteConfig((("draft-model", options),), tuple(PROMPTS), prompts_per_category=2, max_new_tokens=12,
                         temperature=0.8, hf_baseline=False, calibration_repeats=0, speculation="auto")
    run_cells(loaded, PROMPTS, config, tmp_path)
    cell = merge_cells(tmp_path, config.labels, list(PROMPTS), 1)["draft-model", "rep"]
    steps = new = 0
    digest = NO_OUTPUTS
    for prompt in PROMPTS["rep"]:
        out = generate(loaded, [prompt], max_new_tokens=12, drafter=get_drafter("draft-model", **options),
                       speculation="auto", return_dict=True, **config.generate_kwargs)
        steps, new = steps + out.stats[0].steps, new + out.stats[0].new_tokens
        digest = chain_outputs(digest, out.new_tokens)
    assert (cell.steps, cell.new_tokens, cell.output_sha256) == (steps, new, digest)
    assert cell.steps == cell.new_tokens and cell.drafts == 0  # generate() never asked it


def _head(folder: Path, content: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "weights.safetensors").write_bytes(content)
    return folder


def _settings(config: SuiteConfig) -> dict:
    return run_settings({"model": "m"}, PROMPTS, config, 1, {"device": "cpu"})


@pytest.mark.parametrize("whole_file_bytes", [resume.WHOLE_FILE_BYTES, 0], ids=["hashed whole", "sampled"])
def test_a_head_written_again_in_place_is_refused_on_resume(tmp_path, monkeypatch, whole_file_bytes):
    """Options were recorded by their string: a resume reused cells measured with the head the folder held before."""
    monkeypatch.setattr(resume, "WHOLE_FILE_BYTES", whole_file_bytes)
    monkeypatch.chdir(tmp_path)
    head = _head(tmp_path / "heads" / "e", b"\x01" * 5000)
    relative = SuiteConfig((("eagle", {"path": "heads/e"}),), ("rep",))
    out = tmp_path / "run"
    out.mkdir()
    write_json(out / "settings.json", settings_record(_settings(relative)))
    absolute = SuiteConfig((("eagle", {"path": str(head)}),), ("rep",))
    check_resumable(out, _settings(absolute), True)  # the same head, spelled absolute: resumed
    _head(head, b"\x02" * 5000)  # retrained and saved over the old one, same size
    with pytest.raises(ResumeError) as err:
        check_resumable(out, _settings(relative), True)
    text = str(err.value)
    assert "\n" not in text and f"eagle.path: {head.resolve()} was written again since" in text, text


def test_a_model_given_as_an_object_is_recorded_by_its_content(eval_tiny_model):
    from specdec.testing import build_tiny_model

    recorded = [_settings(SuiteConfig((("draft-model", {"model": m}),), ("rep",)))["drafters"][0][1]["model"]
                for m in (eval_tiny_model, eval_tiny_model.model, build_tiny_model(vocab_size=16, seed=4))]
    assert recorded[0]["fingerprint"] == recorded[1]["fingerprint"] != recorded[2]["fingerprint"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def _snapshot(out: Path) -> dict:
    return {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def other_vocabulary(model, tmp_path_factory):
    """Medusa heads as wide as the tiny model, for a vocabulary of another size."""
    config = json.loads((Path(model) / "config.json").read_text())
    folder = tmp_path_factory.mktemp("heads") / "medusa"
    save_medusa(MedusaHeads(MedusaConfig(2, 1, config["hidden_size"], config["vocab_size"] + 3)), folder)
    return folder


@pytest.mark.parametrize("head", ["missing", "other vocabulary"])
def test_a_bad_head_is_refused_before_overwrite_deletes_the_earlier_run(model, other_vocabulary, tmp_path, capsys,
                                                                         head):
    """--overwrite deleted the earlier run, then the head was read (at the warm-up) and refused."""
    out = tmp_path / "run"
    assert run_main(["eval", "acceptance", "--model", model, *RUN, "--out", str(out)], capsys)[0] == 0
    before = _snapshot(out)
    path = tmp_path / "no-such-head" if head == "missing" else other_vocabulary
    code, captured = run_main(["eval", "acceptance", "--model", model, "--drafters", "medusa", "--drafter-option",
                               f"path={path}", *RUN, "--out", str(out), "--overwrite"], capsys)
    err = captured.err.strip()
    assert code == 2 and "\n" not in err and str(path) in err, err
    assert _snapshot(out) == before


def test_a_refused_run_leaves_nothing_in_a_fresh_out(model, other_vocabulary, tmp_path, capsys):
    """settings.json was written before the warm-up refused the head: the corrected rerun found "an earlier run"."""
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", model, "--drafters", "medusa", *RUN, "--out", str(out)]
    code, captured = run_main([*argv, "--drafter-option", f"path={other_vocabulary}"], capsys)
    assert code == 2 and "vocab" in captured.err
    assert not out.exists() or not any(out.iterdir())
    assert run_main(["eval", "acceptance", "--model", model, *RUN, "--out", str(out)], capsys)[0] == 0


def test_the_report_names_each_rows_drafter_options_as_given(model, tmp_path, capsys):
    """The report named each row's drafter but none of its options: two rows of one drafter (labels) or a draft
    model read from a path could not be told apart in report.md, only in settings.json (as digests)."""
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", model, *RUN, "--drafters", "short=ngram,long=ngram,ngram",
            "--drafter-option", "short.max_ngram=2", "--drafter-option", "long.num_draft_tokens=6", "--out", str(out)]
    assert run_main(argv, capsys)[0] == 0
    meta = json.loads((out / "report.json").read_text())["meta"]
    given = {"short": {"max_ngram": 2}, "long": {"num_draft_tokens": 6}}
    assert meta["drafters"] == ["short", "long", "ngram"] and meta["drafter_options"] == given
    assert f"- drafter_options: {given}" in (out / "report.md").read_text()


def test_run_suite_refused_before_its_first_cell_leaves_no_settings(eval_tiny_model, tmp_path, monkeypatch):
    import specdec.eval.acceptance as suite

    config = SuiteConfig((("medusa", {"path": str(tmp_path / "no-such-head")}),), ("rep",), prompts_per_category=1,
                         max_new_tokens=4, hf_baseline=False, calibration_repeats=0)
    out = tmp_path / "run"
    out.mkdir()
    with pytest.raises(Exception, match="no-such-head"):
        run_suite(eval_tiny_model, {"rep": PROMPTS["rep"][:1]}, config, out)
    assert list(out.iterdir()) == []

    def broken(*args, **kwargs):  # any failure of the warm-up, after settings.json was written
        raise RuntimeError("the warm-up failed")

    ngram = SuiteConfig((("ngram", {}),), ("rep",), prompts_per_category=1, max_new_tokens=4, hf_baseline=False,
                        calibration_repeats=0)
    monkeypatch.setattr(suite, "generate", broken)
    with pytest.raises(RuntimeError, match="warm-up"):
        run_suite(eval_tiny_model, {"rep": PROMPTS["rep"][:1]}, ngram, out)
    assert list(out.iterdir()) == []


def _refusal(tmp_path, before: dict, now: dict) -> str:
    """check_resumable's message for a run whose settings.json records ``before`` resumed with ``now``."""
    out = tmp_path / "run"
    out.mkdir(parents=True)
    write_json(out / "settings.json", settings_record(before))
    with pytest.raises(ResumeError) as err:
        check_resumable(out, now, True)
    return str(err.value)


def test_a_row_only_one_side_has_is_named_with_the_side_that_has_it(tmp_path):
    """settings.json has ngram; this run has ngram and eagle: eagle is "only in this run", and the other way round
    "only in settings.json"."""
    ngram, both = {"drafters": [["ngram", {}]]}, {"drafters": [["ngram", {}], ["eagle", {}]]}
    assert "row eagle only in this run" in _refusal(tmp_path / "a", ngram, both)
    assert "row eagle only in settings.json" in _refusal(tmp_path / "b", both, ngram)


def test_another_checkpoint_is_named_by_both_paths_not_as_one_written_again(tmp_path):
    """A head at /heads/a then, /heads/b now: two paths, so not "written again since"; both shown with content."""
    def head(path, fingerprint):
        return {"drafters": [["eagle", {"path": {"checkpoint": path, "fingerprint": fingerprint}}]]}

    text = _refusal(tmp_path, head("/heads/a", "11"), head("/heads/b", "22"))
    assert "eagle.path: /heads/a (content 11) in settings.json, /heads/b (content 22) now" in text, text
    assert "written again" not in text


def test_another_model_fingerprint_says_that_it_covers_the_dtype(tmp_path):
    """A resume with another --dtype than the run's was refused as "model_fingerprint differs" alone, which reads as
    another checkpoint: the dtype is what the user changed, and the fingerprint is the only setting holding it."""
    before, now = ({"model": "tiny", "model_fingerprint": f} for f in ("11", "22"))
    text = _refusal(tmp_path, before, now)
    assert "model_fingerprint differs; the model's fingerprint covers its config, weights and dtype: another " \
           "checkpoint, or another --dtype than the run's" in text, text


def test_an_option_of_60_characters_is_shown_whole_a_longer_one_cut_to_60(tmp_path):
    """A 58-letter string is 60 characters as JSON (two quotes): shown whole. 59 letters (61 as JSON) are cut to 57
    characters and "...", 60 in all."""
    def option(value):
        return {"drafters": [["ngram", {"x": value}]]}

    text = _refusal(tmp_path / "a", option("a" * 58), option("b" * 58))
    assert f'ngram.x: "{"a" * 58}" in settings.json, "{"b" * 58}" now' in text, text
    text = _refusal(tmp_path / "b", option("a" * 59), option("b" * 59))
    assert f'ngram.x: "{"a" * 56}... in settings.json, "{"b" * 56}... now' in text, text


def test_settings_record_renamed_rows_only_where_a_row_was_renamed():
    """A run without renamed rows records no "renamed" entry (its digest is the one runs had before rows could be
    renamed); a row "fast" running ngram records [["fast", "ngram"]]."""
    plain = _settings(SuiteConfig((("ngram", {}),), ("rep",)))
    renamed = _settings(SuiteConfig((("fast", {}),), ("rep",), renamed=(("fast", "ngram"),)))
    assert "renamed" not in plain and renamed["renamed"] == [["fast", "ngram"]]


def test_an_empty_path_option_is_recorded_as_given_not_as_the_working_folder(tmp_path, monkeypatch):
    """path="" names no checkpoint (Path("") is ".", which exists): recorded as "", not as the folder's content."""
    monkeypatch.chdir(tmp_path)
    recorded = _settings(SuiteConfig((("eagle", {"path": ""}),), ("rep",)))["drafters"]
    assert recorded == [["eagle", {"path": ""}]]


def test_a_run_that_is_not_resumed_is_not_checked_against_the_earlier_settings(tmp_path):
    """Without --resume (--overwrite) the earlier run's settings.json is replaced, not compared: other drafters pass."""
    out = tmp_path / "run"
    out.mkdir()
    write_json(out / "settings.json", settings_record({"drafters": [["ngram", {}]]}))
    check_resumable(out, {"drafters": [["eagle", {}]]}, False)
