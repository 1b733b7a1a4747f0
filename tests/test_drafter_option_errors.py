"""Drafter option mistakes raise a SpecdecError (InputError / InputTypeError) of one line naming the option, when
the drafter is built, before any model or checkpoint is read: the n-gram, draft-model, self-draft and Medusa
options, and the registry's own refusals."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from specdec.drafters.combined import CombinedDrafter
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, load_eagle
from specdec.drafters.medusa import MedusaDrafter
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
from specdec.drafters.registry import check_options, get_drafter

import specdec
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.testing import build_tiny_model, save_tiny_checkpoint

BAD = [
    ("ngram", dict(max_nodes=0), "max_nodes must be >= 1"),
    ("ngram", dict(max_ngram=2.5), "max_ngram must be an int"),
    ("ngram", dict(config=5), "config must be an NGramConfig"),
    ("ngram", dict(long_match_ngram=8, max_ngram=6), "long_match_ngram=8 exceeds max_ngram=6"),
    ("self-draft", dict(tree="Dynamic"), "tree must be 'static' or 'dynamic'"),
    ("self-draft", dict(mode="greedy"), "mode must be one of"),
    ("self-draft", dict(cuda_graphs="yes"), "cuda_graphs must be"),
    ("self-draft", dict(widths=[2] * 5), "widths must be at most num_draft_tokens long"),
    ("self-draft", dict(widths=[40]), r"widths \[40\] with num_draft_tokens=2 give 80 nodes \(depths past the widths "
                                      r"continue as chains\); at most 64"),
    ("self-draft", dict(tree="dynamic", widths=[2, 2]), r"widths \[2, 2\] shape a static tree"),
    ("self-draft", dict(max_nodes=8), "max_nodes=8 shapes a dynamic tree"),  # a static tree ignored them
    # a depth keeps at most max_nodes nodes: a wider beam drafted as beam=max_nodes
    ("self-draft", dict(tree="dynamic", beam=32), r"^self-draft: beam=32 exceeds max_nodes=16, and no depth"),
    ("draft-model", dict(model="x", tree="dynamic", beam=5, max_nodes=4), r"beam=5 exceeds max_nodes=4.*lower beam"),
    ("draft-model", dict(model="x", beam=2, max_nodes=8), r"max_nodes=8, beam=2 shape a dynamic tree.*drop them"),
    ("self-draft", dict(num_layers=0), "num_layers must be >= 1"),
    # refused when it was attached: after the target had loaded and its costs had been measured
    ("self-draft", dict(cuda_graphs=True), r"^self-draft: cuda_graphs=True is for a draft model; self-draft drafts "
                                           r"in the target's cache, eagerly$"),
    # seed only seeds sampled children: with none drawn it was accepted and did nothing
    ("self-draft", dict(mode="deterministic", seed=5), r"^self-draft: seed=5 seeds sampled drafts, but "
                                                       r"mode='deterministic' draws none"),
    ("draft-model", dict(model="x", tree="dynamic", seed=0), r"^draft-model: seed=0 seeds sampled drafts, but a "
                                                             r"dynamic tree draws none .*drop seed"),
    ("self-draft", dict(num_layers=True), "num_layers must be an int, got bool True"),
    ("self-draft", dict(draft_vocab=""), "draft_vocab .* got the empty string"),
    # a list's repeats and negative ids: refused once the target had loaded
    ("self-draft", dict(draft_vocab=[1, 1, 2]), r"^self-draft: draft_vocab lists a token id more than once \(3 ids, "
                                                r"2 distinct\)$"),
    ("self-draft", dict(draft_vocab=[3, -1]), r"^self-draft: draft_vocab holds token id -1; token ids are >= 0$"),
    ("draft-model", dict(model=""), "model= is the empty string"),
    ("draft-model", dict(model="x", tokenizer=""), "tokenizer= is the empty string"),
    ("draft-model", dict(model="x", widths=[20]), "num_draft_tokens=4 give 80 nodes"),
    ("medusa", dict(path=""), "path= is the empty string"),
    ("medusa", dict(path="x", top_k=0), "top_k must be >= 1"),
    ("medusa", dict(path="x", max_nodes=65), "max_nodes must be <= 64"),
    ("medusa", dict(path="x", tree="typical"), "tree must be"),
    ("medusa", dict(heads="x"), "heads= must be a MedusaHeads"),
    # medusa_choices: checked here, not after the target and the checkpoint have loaded
    ("medusa", dict(path="x", medusa_choices=[]), "medusa_choices is empty"),
    ("medusa", dict(path="x", medusa_choices=[["a"]]), "integer ranks"),
    ("medusa", dict(path="x", medusa_choices=[["0"]]), "integer ranks"),  # text was taken as the rank
    ("medusa", dict(path="x", medusa_choices=[[0.5]]), "integer ranks"),
    ("medusa", dict(path="x", medusa_choices=[[True]]), "integer ranks"),
    ("medusa", dict(path="x", medusa_choices=[[-1]]), ">= 0"),
    ("medusa", dict(path="x", medusa_choices=[[0, 0]]), r"lacks its prefix \[0\]"),
    ("medusa", dict(path="x", medusa_choices=[[0], [1], [0]]), r"lists path \[0\] more than once"),
    ("medusa", dict(path="x", medusa_choices="[[0], [1, 0]]"), "lacks its prefix"),
    ("nope", {}, "unknown drafter 'nope'"),
    (None, dict(max_nodes=3), r"drafter options \(max_nodes\) can only be given with a drafter name, got None"),
]


@pytest.mark.parametrize("name, options, match", BAD)
def test_bad_drafter_options_are_one_line_specdec_errors(name, options, match, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # draft_vocab="" read the config.json of the current directory
    (tmp_path / "config.json").write_text(json.dumps({"draft_vocab": [1, 2, 3]}))
    with pytest.raises(SpecdecError, match=match) as err:
        get_drafter(name, **options)
    assert isinstance(err.value, (InputError, InputTypeError)) and "\n" not in str(err.value)


@pytest.mark.parametrize("name, meant", [
    ("NGram", "'ngram'"), ("n-gram", "'ngram'"), ("draft_model", "'draft-model'"), ("self_draft", "'self-draft'"),
    ("eagle3", "'eagle'"), ("none", "leave the drafter out, drafter=None, to decode plainly"),
])
def test_a_misspelt_drafter_name_is_refused_with_the_name_meant(name, meant):
    """Names are lower case with hyphens: "NGram", "draft_model" were refused with the list alone, no name meant."""
    with pytest.raises(InputError, match=rf"^unknown drafter '{name}' \(.*{re.escape(meant)}.*\); available: "):
        get_drafter(name)


def test_a_misspelt_drafter_option_is_refused_with_the_option_meant():
    """max_node= was refused with the list of options alone, in Python and on the command line."""
    with pytest.raises(InputTypeError, match=r"^drafter 'ngram' has no option 'max_node' \(did you mean "
                       r"'max_nodes'\?\); its options: "):
        get_drafter("ngram", max_node=3)
    with pytest.raises(InputTypeError, match=r"^drafter 'ngram' has no --drafter-option 'max_node' \(did you mean "
                       r"'max_nodes'\?\); its KEY=VALUE keys: "):
        check_options("ngram", {"max_node": "3"}, command_line=True)


def test_medusa_top_k_beyond_the_draft_vocabulary_is_refused_as_eagle_does():
    """It was cut to the vocabulary without a word; the default top_k (8) is still cut to a smaller vocabulary."""
    model = build_tiny_model()
    small = MedusaHeads(MedusaConfig(2, 1, 64, 96, draft_vocab=[1, 2, 3]))
    for tree in ("dynamic", "static"):
        with pytest.raises(InputError, match="medusa: top_k=4 exceeds the draft vocabulary of 3 tokens"):
            specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=MedusaDrafter(heads=small, tree=tree,
                                                                                         top_k=4))
    drafter = MedusaDrafter(heads=small, tree="dynamic")
    specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=drafter)
    assert drafter.k_per_head == 3


def test_eagle_default_top_k_is_cut_to_a_smaller_draft_vocabulary_as_medusa_does():
    """An EAGLE head of a 3-token draft vocabulary was refused ("top_k=8 exceeds the draft vocabulary of 3 tokens")
    though the caller gave no top_k: the checkpoint's default is now cut to fit; a given top_k still must fit."""
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    model = build_tiny_model()
    head = EagleModel(EagleConfig.for_target(model.config, draft_vocab=[1, 2, 3]))
    drafter = EagleDrafter(model=head)
    specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=drafter)
    assert drafter.top_k == 3
    with pytest.raises(InputError, match="eagle: top_k=4 exceeds the draft vocabulary of 3 tokens"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=2, drafter=EagleDrafter(model=head, top_k=4))


def test_medusa_heads_config_mistakes_are_specdec_errors():
    with pytest.raises(InputError, match="MedusaConfig.num_heads must be a positive integer, got 0"):
        MedusaConfig(0, 1, 64, 96)
    with pytest.raises(InputError, match=r"path \[0, 0, 0\] .* at most num_heads=2 long"):
        MedusaConfig(2, 1, 64, 96, medusa_choices=((0,), (0, 0), (0, 0, 0)))


@pytest.mark.parametrize("name", ["eagle", "medusa", "mtp"])
def test_an_empty_path_is_refused_before_the_current_directory_is_read(name):
    """``Path("")`` is ".": eagle read the current directory as its checkpoint and failed there; mtp took "" for
    the target's own checkpoint. Each refuses the empty string by name, as medusa did."""
    with pytest.raises(InputError, match=f"^{name}: path= is the empty string"):
        get_drafter(name, path="")


@pytest.mark.parametrize("name", ["eagle", "medusa", "mtp"])
@pytest.mark.parametrize("file", ["model.safetensors", "model.gguf"])
def test_a_path_naming_a_file_is_refused_naming_its_folder(name, file, tmp_path):
    """path= naming the head's weights file (not its folder) was refused, once the target had loaded, as "EAGLE
    checkpoint directory not found" (eagle), "model.safetensors: medusa_lm_head.safetensors is missing" (medusa) or
    "holds no safetensors weights" (mtp). It is refused when the drafter is made, naming the folder to give."""
    (tmp_path / file).write_bytes(b"weights")
    folder = f" (the one holding it: {tmp_path})" if file.endswith(".safetensors") else ""
    with pytest.raises(InputError) as err:
        get_drafter(name, path=str(tmp_path / file))
    assert str(err.value) == f"{name}: path={tmp_path / file} is a file; give the checkpoint directory{folder}"


@pytest.mark.parametrize("name", ["eagle", "medusa", "mtp"])
def test_a_head_path_under_home_is_expanded_as_the_targets_is(name, tmp_path, monkeypatch):
    """``--model ~/m`` found the model, ``path=~/heads`` looked for a folder literally named "~"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert get_drafter(name, path="~/heads").path == str(tmp_path / "heads")


def test_a_draft_tokenizer_under_home_is_expanded(tmp_path, monkeypatch):
    """draft-model's ``tokenizer=~/tok`` (the CLI's --drafter-option) looked for a folder literally named "~"."""
    from specdec.drafters.draft_model import _tokenizer

    from specdec.testing import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert _tokenizer("~/tok").convert_ids_to_tokens(1) == "a"


@pytest.mark.parametrize("name,options", [("self-draft", dict(widths=[40])), ("self-draft", dict(tree="nope")),
                                          ("self-draft", dict(num_layers=0)), ("self-draft", dict(draft_vocab=0)),
                                          ("draft-model", dict(model="x", mode="nope"))])
def test_shared_option_checks_name_the_drafter(name, options):
    """DraftConfig and the draft-vocabulary check serve two drafters and named neither ("tree must be ..."); inside
    a combined drafter or a grid the user could not tell whose option was wrong."""
    with pytest.raises(SpecdecError, match=f"^{name}: "):
        get_drafter(name, **options)


def test_an_eagle_config_reads_draft_vocab_none_as_the_full_vocabulary():
    """self-draft reads draft_vocab=None as the full vocabulary; EagleConfig failed on it with a bare TypeError
    ("'NoneType' object is not iterable"). A value that is no list of ids is refused in one line."""
    from specdec.drafters.eagle_model import EagleConfig

    config = build_tiny_model().config
    assert EagleConfig.for_target(config, draft_vocab=None).draft_vocab == ()
    with pytest.raises(InputTypeError, match="draft_vocab must be a list of token ids"):
        EagleConfig.for_target(config, draft_vocab=5)


@pytest.mark.parametrize("name, python_only", [("ngram", "config"), ("eagle", "model"), ("medusa", "heads"),
                                               ("combined", "verify_cost")])
def test_unknown_option_lists_name_what_the_caller_can_pass_where_it_is(name, python_only, capsys):
    """On the command line the list of a drafter's options holds its --drafter-option keys, not the options only
    Python can give (a config object, a module, a callable), and such an option is refused as Python only; in
    Python the list names every keyword the drafter takes."""
    from specdec.cli import main

    rc = main(["generate", "hi", "--model", "synthetic:tiny", "--drafter", name, "--drafter-option", "bogus=1",
               "--drafter-option", f"{python_only}=1"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert f"has no --drafter-option 'bogus', '{python_only}' (Python only); its KEY=VALUE keys: " in line, line
    assert python_only not in line.rpartition("keys: ")[2].split(", "), line
    with pytest.raises(InputTypeError, match=rf"drafter '{name}' has no option 'bogus'; its options: .*{python_only}"):
        specdec.generate("synthetic:tiny", [[1, 2, 3]], drafter=name, drafter_options={"bogus": 1})


def test_a_combined_drafters_child_options_are_refused_naming_the_child_as_the_caller_passes_them(capsys):
    """A child given as {"name": ..., **options}: on the command line its unknown and Python-only options are refused
    before anything loads, naming the child and the keys the command line can give it; in Python the message names
    the child and every keyword it takes."""
    from specdec.cli import main

    children = json.dumps(["ngram", {"name": "ngram", "bogus": 1, "config": 2}])
    rc = main(["generate", "hi", "--model", "synthetic:tiny", "--drafter", "combined",
               "--drafter-option", f"drafters={children}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert ("combined drafter's drafters[1]: drafter 'ngram' has no option 'bogus', 'config' (Python only); "
            "its command-line keys: ") in line, line
    assert "config" not in line.rpartition("keys: ")[2].split(", "), line
    with pytest.raises(InputTypeError, match=r"^combined drafter's drafters\[1\]: drafter 'ngram' has no option "
                                             r"'bogus'; its options: config, "):
        specdec.generate("synthetic:tiny", [[1, 2, 3]], drafter="combined",
                         drafter_options={"drafters": ["ngram", {"name": "ngram", "bogus": 1}]})


# (drafters, where the mistake is, what is refused there, whether the check before building sees it)
NESTED = "combined drafter's drafters"
BAD_CHILDREN = [
    (["nope"], "[0]", "unknown drafter 'nope'; available: ", True),
    (["ngram", "nope"], "[1]", "unknown drafter 'nope'", True),
    ([{"name": "nope"}], "[0]", "unknown drafter 'nope'", True),
    (["ngram", {"name": "nope", "max_nodes": 3}], "[1]", "unknown drafter 'nope'", True),
    (["ngram", {"max_nodes": 3}], "[1]", "a child given as a dict needs a 'name' string, got {'max_nodes': 3}", True),
    (["ngram", {"name": 5}], "[1]", "a child given as a dict needs a 'name' string, got {'name': 5}", True),
    (["ngram", 5], "[1]", "a child must be a drafter name, a dict with 'name', or a drafter, got int", True),
    (["ngram", None], "[1]", "a child must be a drafter name, .* got NoneType", True),
    (["ngram", ["ngram"]], "[1]", "a child must be a drafter name, .* got list", True),
    (["ngram", {"name": "ngram", "bogus": 1}], "[1]", "drafter 'ngram' has no option 'bogus'", True),
    (["ngram", {"name": "ngram", "max_nodes": 0}], "[1]", "ngram drafter: max_nodes must be >= 1, got 0", False),
    ([{"name": "combined", "drafters": ["ngram", {"name": "nope"}]}], "[0].drafters[1]", "unknown drafter 'nope'",
     True),
    (["ngram", {"name": "combined", "drafters": [5]}], "[1].drafters[0]", "a child must be a drafter name", True),
    ([{"name": "combined", "drafters": [{"name": "ngram", "bogus": 1}]}], "[0].drafters[0]",
     "drafter 'ngram' has no option 'bogus'", True),
    ([{"name": "combined", "drafters": [{"name": "combined", "drafters": ["nope"]}]}], "[0].drafters[0].drafters[0]",
     "unknown drafter 'nope'", True),
    ([{"name": "combined", "drafters": []}], "[0]",
     r"combined drafter: drafters must be a non-empty list of children, got \[\]", True),
    ([{"name": "combined", "mode": "average"}], "[0]", "combined drafter: mode must be one of", False),
]


@pytest.mark.parametrize("drafters, where, refusal, checked", BAD_CHILDREN)
def test_every_malformed_combined_child_is_refused_naming_its_place(drafters, where, refusal, checked, capsys):
    """An unknown name, a dict without a 'name' string, a child of no known form, a child's unknown or bad option,
    each also inside a nested combined drafter: refused in one line that starts with the child's place
    (``combined drafter's drafters[1]: ...``), in Python and on the command line. The unknown name in a dict, the
    forms and the nested children were refused without naming the child, a form only once the drafter was built."""
    from specdec.cli import main

    match = "^" + re.escape(NESTED + where + ": ") + refusal
    for build in (lambda: CombinedDrafter(drafters), lambda: get_drafter("combined", drafters=drafters)):
        with pytest.raises(SpecdecError, match=match) as err:
            build()
        assert isinstance(err.value, (InputError, InputTypeError)) and "\n" not in str(err.value)
    if checked:  # before anything is built: on the command line, before the model loads
        with pytest.raises(SpecdecError, match=match):
            check_options("combined", {"drafters": drafters}, command_line=True)
    else:  # an option's value: checked where the child is built
        check_options("combined", {"drafters": drafters}, command_line=True)
    rc = main(["generate", "hi", "--model", "synthetic:tiny", "--drafter", "combined",
               "--drafter-option", f"drafters={json.dumps(drafters)}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert re.search(match, line.partition("error: ")[2]), line


def test_a_combined_child_given_in_python_is_refused_naming_its_place():
    """As drafter_options of generate (the unknown name in a dict was refused without its place), and a drafter
    class where an instance belongs (only Python can pass one)."""
    with pytest.raises(InputError, match=r"^combined drafter's drafters\[1\]: unknown drafter 'nope'"):
        specdec.generate("synthetic:tiny", [[1, 2, 3]], drafter="combined",
                         drafter_options={"drafters": ["ngram", {"name": "nope"}]})
    with pytest.raises(InputTypeError, match=r"^combined drafter's drafters\[1\]: a child must be an instance, got the "
                                             r"class CombinedDrafter: pass CombinedDrafter\(...\)"):
        get_drafter("combined", drafters=["ngram", CombinedDrafter])


def test_a_head_given_to_the_other_drafter_names_the_drafter_it_is_for(tmp_path):
    """`--drafter eagle --drafter-option path=HEADS` (Medusa heads) said only 'model.safetensors is missing', and
    `--drafter medusa` on an EAGLE head suggested convert-medusa, which then refused it: each names the other
    drafter."""
    from specdec.drafters.medusa_heads import MedusaCheckpointError, load_medusa
    from transformers import LlamaConfig

    eagle, medusa = tmp_path / "eagle-head", tmp_path / "medusa-heads"
    eagle.mkdir(), medusa.mkdir()
    (eagle / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64}))
    (eagle / "model.safetensors").write_bytes(b"")
    (medusa / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (medusa / "medusa_lm_head.safetensors").write_bytes(b"")
    with pytest.raises(MedusaCheckpointError, match=re.escape(
            f"{eagle}: medusa_lm_head.safetensors is missing ({eagle} holds an EAGLE head: --drafter eagle "
            f"--drafter-option path={eagle})")):
        load_medusa(eagle)
    with pytest.raises(EagleCheckpointError, match=re.escape(
            f"{medusa}: model.safetensors is missing ({medusa} holds Medusa heads: --drafter medusa "
            f"--drafter-option path={medusa})")):
        load_eagle(medusa, LlamaConfig(hidden_size=64))


def test_an_eagle_path_holding_no_draft_layer_says_what_it_holds(tmp_path):
    """`--drafter eagle` on a vLLM Medusa export said "config.json lacks 'num_attention_heads'" and on a model's own
    directory "the weights do not match config.json (Error(s) in loading state_dict for EagleModel:)": neither named
    the problem, which export-head names (no fc.* tensors, and what the directory holds instead)."""
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 2, "hidden_size": 64}))
    save_file({"blocks.0.layers.0.weight": torch.zeros(64, 64), "lm_heads.0.weight": torch.zeros(96, 64)},
              str(served / "model.safetensors"))
    model = save_tiny_checkpoint(tmp_path / "model", tokenizer=False)
    target = build_tiny_model().config
    with pytest.raises(EagleCheckpointError, match=re.escape(
            f"{served}: model.safetensors holds no EAGLE draft layer (no fc.* tensors): {served} holds vLLM's Medusa "
            "serving layout (as `specdec export-head --format vllm` writes it), which specdec does not read back: "
            "pass the directory it was exported from to --drafter medusa")):
        load_eagle(served, target)
    with pytest.raises(EagleCheckpointError, match=re.escape(
            f"{model}: model.safetensors holds no EAGLE draft layer (no fc.* tensors): it looks like a llama model's "
            "weights, not a draft head")):
        load_eagle(model, target)
