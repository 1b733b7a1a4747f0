"""The draft layer's RoPE (drafters/eagle_rope.py): a layer made for a target rotates as the target does, scaling
included, and a type whose angles change with the sequence's length is refused in one line."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.eagle_rope import config_entries, read_rope
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils import logging as transformers_logging

from specdec.errors import InputError
from specdec.testing import build_tiny_model


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "llama3-rope", "llama-linear-rope", "llama-yarn-rope"])
def test_a_layer_made_for_a_target_rotates_as_the_targets_own_rotary_embedding(variant):
    """EagleConfig.for_target takes the target's RoPE type and parameters (it took rope_theta alone), so the layer's
    cos / sin are transformers' own for the target's config, bit for bit, yarn's attention factor included; a
    layer saved for the target keeps them (config_from_checkpoint)."""
    target = build_tiny_model(variant).config
    layer = EagleModel(EagleConfig.for_target(target))
    positions = torch.arange(0, 500, 3)[None]
    cos, sin = layer.rope(positions, torch.float32)
    want_cos, want_sin = LlamaRotaryEmbedding(target)(torch.zeros(1, 1, 16), positions)
    assert torch.equal(cos[0], want_cos[0]) and torch.equal(sin[0], want_sin[0])
    assert (layer.config.rope_scaling == ()) == (variant == "llama-gqa-tied")


def test_rope_parameters_are_normalised_and_lengthwise_types_refused():
    base = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=96)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64, "rope_theta": 500000.0}
    c = EagleConfig(**base, rope_scaling=llama3)
    assert dict(c.rope_scaling) == {k: v for k, v in llama3.items() if k != "rope_theta"}
    assert c == EagleConfig(**base, rope_scaling=tuple(reversed(c.rope_scaling)))  # one form: hashable, comparable
    assert hash(c) == hash(EagleConfig(**base, rope_scaling=dict(c.rope_scaling)))
    for plain in (None, {}, {"rope_type": "default", "rope_theta": 500000.0}, {"type": "default"}):
        assert EagleConfig(**base, rope_scaling=plain).rope_scaling == ()
    assert dict(EagleConfig(**base, rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling) == {
        "rope_type": "linear", "factor": 2.0}  # transformers 4's legacy key
    for kind in ("dynamic", "longrope"):
        with pytest.raises(InputError, match=f"{kind!r} changes with sequence length"):
            EagleConfig(**base, rope_scaling={"rope_type": kind, "factor": 2.0})


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_a_head_config_shorter_than_its_original_context_rotates_right_without_transformers_warning(kind, caplog):
    """Published heads' configs often give a context below the scaling's original one (SpecForge's Llama 3.1 heads:
    2048 against 8192), which transformers warns about, once per frequency computation, though with a factor given
    it changes no frequency: the layer's frequencies are transformers' own for that config, and no warning."""
    from transformers import LlamaConfig

    rope = {"rope_type": kind, "factor": 8.0, "original_max_position_embeddings": 8192}
    if kind == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    config = EagleConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                         vocab_size=96, rope_theta=500000.0, max_position_embeddings=2048, rope_scaling=rope)
    positions = torch.arange(0, 3000, 7)[None]
    transformers_logging.enable_propagation()  # transformers' records reach pytest's handler
    try:
        with caplog.at_level("WARNING"):
            cos, sin = EagleModel(config).rope(positions, torch.float32)
    finally:
        transformers_logging.disable_propagation()
    assert not [r for r in caplog.records if "original_max_position_embeddings" in r.getMessage()]
    theirs = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_theta=500000.0,
                                              max_position_embeddings=2048, rope_scaling=dict(rope)))
    want_cos, want_sin = theirs(torch.zeros(1, 1, 16), positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_a_head_configs_rope_theta_at_the_top_wins_over_the_one_in_its_parameters():
    raw = {"rope_theta": 500000.0, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    assert read_rope(raw, "head")[0] == 500000.0
    inside = {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0}}
    assert read_rope(inside, "head")[0] == 20000.0  # no top-level one: the parameters' own
    assert read_rope({}, "head") == (10000.0, {})


def test_a_head_configs_lengthwise_rope_type_is_dropped_with_a_warning(caplog):
    raw = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}
    with caplog.at_level("WARNING"):
        assert read_rope(raw, "head") == (500000.0, {})  # rotates by rope_theta alone
    assert "'dynamic' changes with sequence length" in caplog.text


def test_a_written_scaled_config_gives_rope_theta_inside_rope_parameters_too():
    config = EagleConfig(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                         vocab_size=96, rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    entries = config_entries(config)
    assert entries["rope_theta"] == 500000.0
    assert entries["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    # transformers 5 reads rope_theta from rope_parameters
    assert entries["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}
