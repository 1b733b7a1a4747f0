"""The acceptance suite on a tiny model: cells, resume, merging, reports, prompt files."""
from __future__ import annotations

import json

import pytest
from specdec.eval.acceptance import SuiteConfig, cell_path, run_suite, summarise
from specdec.eval.prompt_sets import load_jsonl
from specdec.eval.prompts import CATEGORIES, load_prompts
from specdec.eval.report import write_reports

from specdec.models.loader import load_model
from specdec.testing import build_tiny_model

PROMPTS = {"rep": [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]], "mixed": [[9, 4, 7, 1], [3, 3, 3, 3]]}


def test_suite_measures_every_cell_resumes_and_reports(tmp_path):
    loaded = load_model(build_tiny_model(vocab_size=16, seed=3))
    cfg = SuiteConfig((("ngram", {}), ("draft-model", {"model": loaded, "num_draft_tokens": 3})), tuple(PROMPTS),
                      prompts_per_category=2, max_new_tokens=24, hf_baseline=True)
    cells = run_suite(loaded, PROMPTS, cfg, tmp_path)
    assert set(cells) == {(d, c) for d in ("plain", "ngram", "draft-model", "hf-greedy") for c in PROMPTS}
    for (label, _), cell in cells.items():
        assert cell.new_tokens == 48 and cell.prompts == 2
        if label == "plain":
            assert cell.tau == 1.0 and cell.histogram == [0, 48]
        if label == "draft-model":  # the target drafting for itself: every draft accepted
            assert cell.tau > 3.0 and all(a == 1.0 for a in cell.acceptance_per_depth)
            assert sum(n * c for n, c in enumerate(cell.histogram)) == cell.new_tokens
    rows = summarise(cells)
    dm = next(r for r in rows if r["drafter"] == "draft-model")
    assert dm["speedup_vs_plain"] > 0 and dm["predicted_speedup"] > 0 and dm["speedup_vs_hf"] > 0
    written = write_reports(rows, tmp_path, {"model": "tiny"})
    assert all(p.exists() and p.stat().st_size > 0 for p in written)
    assert "draft-model" in (tmp_path / "report.md").read_text()
    assert json.loads((tmp_path / "report.json").read_text())["rows"]
    # resume: a finished cell is kept as it is, a missing one is rerun
    marker = cell_path(tmp_path, "ngram", "rep")
    data = json.loads(marker.read_text())
    data["steps"] = 12345
    marker.write_text(json.dumps(data))
    cell_path(tmp_path, "plain", "mixed").unlink()
    again = run_suite(loaded, PROMPTS, cfg, tmp_path, resume=True)
    assert again[("ngram", "rep")].steps == 12345
    assert again[("plain", "mixed")].new_tokens == 48


def test_every_category_ships_20_prompts():
    for category in CATEGORIES:
        prompts = load_prompts(category, 20)
        assert len(prompts) == 20 and len(set(prompts)) == 20, category


@pytest.mark.parametrize("content, match", [
    ("", "holds no prompts"), ("{not json}\n", "not valid JSON"), ('{"text": ""}\n', "non-empty"),
    ('["a list"]\n', "non-empty"),
])
def test_bad_prompt_files(tmp_path, content, match):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_jsonl(path)


def test_prompt_file_and_unknown_category(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"text": "world"}\n')
    assert load_jsonl(path) == ["hello", "world"]
    with pytest.raises(FileNotFoundError):
        load_jsonl(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown prompt category"):
        load_prompts("poetry")
