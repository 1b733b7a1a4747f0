"""Options that did nothing, or values that broke every draft, are refused in one line naming them: Medusa's
max_nodes / top_k beside given or saved medusa_choices, Medusa heads holding NaN / inf weights, a --drafter-option
key given twice (specdec generate, specdec eval acceptance), a row prefix that names no row, and a --temperature of
nan / inf in eval acceptance (before the model loads)."""
from __future__ import annotations

import math

import pytest
import torch
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa, save_medusa
from specdec.eval.acceptance import SuiteConfig

import specdec
from specdec.errors import InputError
from specdec.testing import build_tiny_model

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0]]


def _heads(**config) -> MedusaHeads:
    torch.manual_seed(0)
    return MedusaHeads(MedusaConfig(2, 1, 64, 96, **config))


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("options, match", [
    (dict(max_nodes=4), r"max_nodes=4 shapes a dynamic tree or the default static tree, not the given "
                        r"medusa_choices \(6 paths\): drop it, or drop medusa_choices"),
    (dict(top_k=2), r"top_k=2 shapes a dynamic tree .*: drop it"),
    (dict(max_nodes=16, top_k=8), r"max_nodes=16, top_k=8 shape a dynamic tree .*: drop them"),
])
def test_medusa_tree_options_beside_given_choices_are_refused_when_built(options, match):
    with pytest.raises(InputError, match=match) as err:
        MedusaDrafter(heads=_heads(), medusa_choices=CHOICES, **options)
    _one_line(err)
    with pytest.raises(InputError, match=match):  # as JSON text (the CLI's form) too
        MedusaDrafter(heads=_heads(), medusa_choices=str(CHOICES), **options)


@pytest.mark.parametrize("options, match", [
    (dict(max_nodes=3), r"max_nodes=3 shapes a dynamic tree or the default static tree, not the static tree of 6 "
                        r"nodes saved in the heads' checkpoint \(medusa_choices\), which is used: use tree='dynamic', "
                        r"or drop it"),
    (dict(max_nodes=3, top_k=1), r"max_nodes=3, top_k=1 shape .* 6 nodes saved .*: use tree='dynamic', or drop them"),
])
def test_medusa_tree_options_beside_saved_choices_are_refused_on_load(options, match, tmp_path):
    model = build_tiny_model()
    saved = _heads(medusa_choices=tuple(map(tuple, CHOICES)))
    with pytest.raises(InputError, match=match) as err:
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=MedusaDrafter(heads=saved, **options),
                         speculation="always")
    _one_line(err)
    save_medusa(saved, tmp_path / "h")  # a checkpoint's saved tree, as --drafter-option path=DIR reads it
    with pytest.raises(InputError, match=match):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter="medusa",
                         drafter_options={"path": str(tmp_path / "h"), **options})
    # what the refusal suggests runs, and without the options the saved tree is used
    dynamic = MedusaDrafter(heads=saved, tree="dynamic", **options)
    specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=dynamic, speculation="always")
    plain = MedusaDrafter(heads=saved)
    specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=plain, speculation="always")
    assert plain.paths == tuple(map(tuple, CHOICES))


def test_medusa_default_tree_unchanged_when_no_option_is_given():
    """max_nodes left out is still 16 nodes; a given one still sizes the default static and the dynamic tree."""
    model = build_tiny_model()
    default, small = MedusaDrafter(heads=_heads()), MedusaDrafter(heads=_heads(), max_nodes=5, top_k=2)
    for drafter in (default, small):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=drafter, speculation="always")
    assert default.config.max_nodes is None and default.config.nodes == 16 and len(default.paths) == 16
    assert len(small.paths) == 5 and max(max(p) for p in small.paths) <= 1


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_medusa_heads_with_non_finite_weights_are_refused_on_load(tmp_path, bad):
    heads = _heads()
    with torch.no_grad():
        heads.heads[1][0].linear.weight[3, 5] = bad
    save_medusa(heads, tmp_path / "h")
    match = (r"medusa_lm_head.safetensors: weights hold NaN or infinite values \(1.0.linear.weight\); the checkpoint "
             r"is damaged or its training diverged")
    with pytest.raises(MedusaCheckpointError, match=match) as err:
        load_medusa(tmp_path / "h")
    _one_line(err)
    with pytest.raises(MedusaCheckpointError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=2, drafter="medusa",
                         drafter_options={"path": str(tmp_path / "h")})
    save_medusa(_heads(), tmp_path / "fine")  # finite heads still load
    load_medusa(tmp_path / "fine")


def _last_error_line(argv, capsys) -> str:
    from specdec.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("pairs, message", [
    (["max_nodes=0", "max_nodes=8"], "--drafter-option max_nodes given twice (0 and 8); give it once"),
    (["max_nodes=0", "max-nodes=8"], "--drafter-option max-nodes given twice (0 and 8); give it once"),
])
def test_generate_refuses_a_drafter_option_given_twice(pairs, message, capsys):
    argv = ["generate", "hi", "--model", "synthetic:tiny", "--drafter", "ngram", "--max-new-tokens", "2"]
    for pair in pairs:
        argv += ["--drafter-option", pair]
    assert message in _last_error_line(argv, capsys)


def _opts(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--drafter-option", pair)]


@pytest.mark.parametrize("drafters, args, message", [
    ("ngram", _opts("ngram.max_nodes=0", "max_nodes=4"),
     "--drafter-option max_nodes: option max_nodes of ngram given twice (0 and 4); give it once"),
    ("ngram", _opts("max_nodes=4", "ngram.max_nodes=0"),
     "--drafter-option ngram.max_nodes: option max_nodes of ngram given twice (4 and 0); give it once"),
    ("ngram", _opts("ngram.max_nodes=0", "ngram.max_nodes=4"),
     "--drafter-option ngram.max_nodes given twice (0 and 4)"),
    ("ngram,self-draft", _opts("self_draft.num_layers=1", "self-draft.num_layers=2"),
     "--drafter-option self-draft.num_layers given twice (1 and 2)"),
    ("ngram,self-draft", _opts("slf-draft.num_layers=1"),
     "--drafter-option slf-draft.num_layers: 'slf-draft' is not one of the drafters (ngram, self-draft)"),
    ("ngram", _opts("eagle.depth=3"),  # it was passed to ngram as an option named "eagle.depth"
     "--drafter-option eagle.depth: 'eagle' is not one of the drafters (ngram)"),
    ("ngram,self-draft", _opts("num_layers=1"),
     "--drafter-option num_layers: with several drafters, prefix the drafter name (e.g. ngram.num_layers=...)"),
    ("ngram", ["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan"),
    ("ngram", ["--temperature", "inf"], "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
    ("ngram", ["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
])
def test_eval_acceptance_refuses_before_the_model_loads(drafters, args, message, tmp_path, capsys, monkeypatch):
    import specdec.models.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loader, "load_model", no_load)
    argv = ["eval", "acceptance", "--out", str(tmp_path / "out"), "--no-plots", "--drafters", drafters, *args]
    assert message in _last_error_line(argv, capsys)
    assert not (tmp_path / "out").exists()


def test_eval_rows_still_take_prefixed_and_only_row_options():
    from specdec.eval.cli import _options_per_row

    rows = _options_per_row(["self-draft.num_layers=1", "ngram.max_nodes=4", "ngram.max_ngram=3"],
                            ["ngram", "self-draft"])
    assert rows == {"ngram": {"max_nodes": 4, "max_ngram": 3}, "self-draft": {"num_layers": 1}}
    assert _options_per_row(["max_nodes=4", "ngram.max_ngram=3"], ["ngram"]) == {"ngram": {"max_nodes": 4,
                                                                                           "max_ngram": 3}}


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -0.5])
def test_suite_config_refuses_a_temperature_that_is_not_finite_and_non_negative(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SuiteConfig((("ngram", {}),), ("chat",), temperature=temperature)
