"""generate() called with torch's global state as a caller's program leaves it (specdec.ambient): autocast and a
default device are set aside for the call, grad mode builds no graph, and a config edited after the model was built
is read as transformers' forward reads it (the norms' epsilon from the modules) or refused (another shape)."""
from __future__ import annotations

import logging

import pytest
import torch

import specdec
from specdec import ambient
from specdec.models.llama import UnsupportedModelError
from specdec.testing import RandomTreeDrafter, build_tiny_model, ragged_prompts

PROMPTS = ragged_prompts(3, seed=2)


def _outputs(model, **kw):
    """Plain decoding and two drafters' (every draft verified), greedy."""
    return [specdec.generate(model, PROMPTS, drafter=d, max_new_tokens=12, speculation="always", **kw)
            for d in (None, "ngram", RandomTreeDrafter(96))]


def test_autocast_is_set_aside_and_said_once(monkeypatch, caplog):
    model = build_tiny_model()
    clean = _outputs(model)
    monkeypatch.setattr(ambient, "_WARNED_AUTOCAST", set())
    with caplog.at_level(logging.WARNING, logger="specdec.ambient"), torch.autocast("cpu", dtype=torch.bfloat16):
        under = _outputs(model)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    assert under == clean and all(out == clean[0] for out in clean)
    said = [r for r in caplog.records if "autocast" in r.getMessage()]
    assert len(said) == 1 and "model's own dtype" in said[0].getMessage()
    from specdec.eval.negative_controls import generate_with_control  # the certificate's generate(), likewise

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert generate_with_control(model, PROMPTS, max_new_tokens=12) == clean[0]


def test_a_default_device_is_set_aside():
    model = build_tiny_model()
    clean = _outputs(model)
    torch.set_default_device("meta")  # as "cuda" would, it puts every tensor made without a device elsewhere
    try:
        under = _outputs(model)
        assert torch.get_default_device().type == "meta"
    finally:
        torch.set_default_device(None)
    assert under == clean


def test_grad_mode_train_mode_and_default_dtype_change_nothing_and_build_no_graph():
    model = build_tiny_model()
    clean = _outputs(model) + [specdec.generate(model, PROMPTS, drafter="ngram", max_new_tokens=12, do_sample=True,
                                                seed=1, sampler="coupled")]
    model.train()
    assert all(p.requires_grad for p in model.parameters())
    saved = []
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                           lambda t: t):
            under = _outputs(model) + [specdec.generate(model, PROMPTS, drafter="ngram", max_new_tokens=12,
                                                        do_sample=True, seed=1, sampler="coupled")]
            assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert under == clean
    assert not saved  # nothing was kept for a backward pass: no autograd graph
    assert model.training  # left in the mode it was passed in


def test_one_token_biases_and_bad_words_under_a_float64_default_dtype():
    """transformers' sequence-bias processors make their one-token biases in the default dtype at their first call:
    a float64 default met their float32 table (and failed), for the call's own and a caller's processor alike."""
    from transformers import SequenceBiasLogitsProcessor

    model = build_tiny_model()
    plain = specdec.generate(model, PROMPTS, max_new_tokens=12)
    banned = plain[0][len(PROMPTS[0])]  # the first token generated: banned and biased, the text changes
    settings = [dict(bad_words_ids=[[banned], [3, 4]]), dict(sequence_bias={(banned,): -50.0, (3, 4): 2.0}),
                dict(logits_processor=[SequenceBiasLogitsProcessor([[[banned], -50.0]])],
                     logits_processor_prefix_only=True)]
    clean = [_outputs(model, **kw) for kw in settings]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        settings[2]["logits_processor"] = [SequenceBiasLogitsProcessor([[[banned], -50.0]])]  # a fresh, unprepared one
        under = [_outputs(model, **kw) for kw in settings]
    finally:
        torch.set_default_dtype(previous)
    assert under == clean
    for outs in clean:
        assert all(out == outs[0] for out in outs) and outs[0] != plain and banned not in outs[0][0][len(PROMPTS[0]):]


def _drafter(name):
    """A drafter by case name, over the 4-layer tiny model: every built-in, and the model drafters in every mode."""
    if name == "eagle":
        from specdec.drafters.eagle import EagleDrafter
        from specdec.drafters.eagle_model import EagleConfig, EagleModel

        eagle = EagleModel(EagleConfig.for_target(build_tiny_model(num_hidden_layers=4).config))
        return EagleDrafter(model=eagle), None
    if name == "medusa":
        from specdec.drafters.medusa import MedusaDrafter
        from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

        return MedusaDrafter(heads=MedusaHeads(MedusaConfig(3, 1, 64, 96))), None
    if name in ("ngram", "random-tree"):
        return (name if name == "ngram" else RandomTreeDrafter(96)), None
    kind, mode = name.split(":")
    options = dict(mode=mode, widths=(2,), num_draft_tokens=3)
    options.update(model=build_tiny_model(seed=7)) if kind == "draft-model" else options.update(num_layers=2)
    if kind == "combined":
        return "combined", dict(drafters=["ngram", {"name": "self-draft", **options}])
    return kind, options


@pytest.mark.parametrize("name", ["ngram", "random-tree", "eagle", "medusa", "combined:independent"] + [
    f"{kind}:{mode}" for kind in ("draft-model", "self-draft")
    for mode in ("auto", "deterministic", "independent", "without_replacement")])
@pytest.mark.parametrize("sampling", [dict(), dict(do_sample=True, seed=5)], ids=["greedy", "seeded"])
def test_greedy_and_seeded_calls_leave_the_global_generator_as_they_found_it(name, sampling):
    """A greedy call drafting with sampled children (mode independent or without_replacement) drew them from torch's
    global generator: a caller's torch.manual_seed(0); generate(...); torch.rand(1) changed with the call."""
    model = build_tiny_model(num_hidden_layers=4)
    drafter, options = _drafter(name)
    expected = torch.rand(8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    out = specdec.generate(model, PROMPTS, max_new_tokens=12, drafter=drafter, drafter_options=options,
                           speculation="always", return_dict=True, **sampling)
    assert torch.equal(torch.rand(8), expected)
    assert any(n > 0 for stats in out.stats for n in stats.step_nodes)  # it drafted


def test_the_norms_epsilon_is_the_modules_not_an_edited_configs():
    """transformers' RMSNorm keeps the epsilon it was built with; an edit of config.rms_norm_eps changes nothing
    in its forward, so nothing in specdec's."""
    model = build_tiny_model()
    before = specdec.generate(model, PROMPTS, max_new_tokens=12)
    model.config.rms_norm_eps = 0.5
    assert specdec.generate(model, PROMPTS, max_new_tokens=12) == before
    with torch.no_grad():
        own = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0].tolist() for p in PROMPTS]
    assert own == before


def test_the_attention_scale_is_the_modules_also_when_edited_between_calls():
    """transformers' attention multiplies the scores by each layer's ``self_attn.scaling``; specdec took
    head_dim ** -0.5 whatever it was (other tokens, silently). Layers edited to disagree are refused."""
    model = build_tiny_model()
    specdec.generate(model, PROMPTS, max_new_tokens=2)  # a runner built before the edit
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.6
    with torch.no_grad():
        own = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0].tolist() for p in PROMPTS]
    assert specdec.generate(model, PROMPTS, max_new_tokens=12) == own
    model.model.layers[0].self_attn.scaling = 0.3
    with pytest.raises(UnsupportedModelError, match="scale their scores differently"):
        specdec.generate(model, PROMPTS, max_new_tokens=2)


@pytest.mark.parametrize("field, value, named", [("num_hidden_layers", 1, "model.model.layers[:n]"),
                                                  ("head_dim", 8, "num_attention_heads x head_dim gives 32"),
                                                  ("vocab_size", 50, "vocab_size gives 50, the model has 96")])
def test_a_config_edited_to_another_shape_than_the_modules_is_refused(field, value, named):
    model = build_tiny_model()
    setattr(model.config, field, value)
    with pytest.raises(UnsupportedModelError, match="config does not describe its modules") as err:
        specdec.generate(model, PROMPTS, max_new_tokens=4)
    assert named in str(err.value) and "\n" not in str(err.value)
