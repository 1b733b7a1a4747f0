"""Synthetic targets: published shapes (counted, not built), tiny versions built and run through specdec."""
from __future__ import annotations

import pytest
import torch

from specdec.errors import InputError
from specdec.models import synthetic
from specdec.models.loader import load_model


@pytest.mark.parametrize("name, billions", [("llama-3.2-1b", 1.236), ("llama-3.1-8b", 8.030), ("qwen3-1.7b", 1.721),
                                            ("qwen3-0.6b", 0.596), ("smollm2-135m", 0.1345)])
def test_published_shapes_have_the_published_parameter_counts(name, billions):
    assert synthetic.SHAPES[name].num_params / 1e9 == pytest.approx(billions, abs=0.001)


def test_shape_config_keeps_the_features_the_runner_reads():
    c = synthetic.SHAPES["llama-3.1-8b"].hf_config()
    assert (c.num_key_value_heads, c.head_dim, c.tie_word_embeddings) == (8, 128, False)
    assert c.rope_parameters["rope_type"] == "llama3" and c.rope_parameters["rope_theta"] == 500000.0
    tiny = synthetic.parse("synthetic:qwen3-1.7b@tiny")
    assert tiny.num_heads // tiny.num_kv_heads == 2 and tiny.tie_word_embeddings and tiny.model_type == "qwen3"


def test_tiny_build_is_deterministic_and_matches_the_shape():
    a = synthetic.build("qwen3-1.7b@tiny", device="cpu", seed=3)
    b = synthetic.build("qwen3-1.7b@tiny", device="cpu", seed=3)
    c = synthetic.build("qwen3-1.7b@tiny", device="cpu", seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert sum(p.numel() for p in a.parameters()) == synthetic.parse("qwen3-1.7b@tiny").num_params
    assert hasattr(a.model.layers[0].self_attn, "q_norm") and a.lm_head.weight is a.model.embed_tokens.weight
    half = synthetic.build("llama-3.1-8b@tiny", device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_full_size_builds_on_the_device_in_its_dtype_never_on_the_host():
    model = synthetic.build("llama-3.1-8b", device="meta", dtype=torch.bfloat16)  # no memory: the 8B shape itself
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}
    assert sum(p.numel() for p in model.parameters()) == synthetic.SHAPES["llama-3.1-8b"].num_params


@pytest.mark.parametrize("name", sorted(synthetic.SHAPES))
def test_every_tiny_shape_builds_with_its_counted_parameters(name):
    model = synthetic.build(f"{name}@tiny", device="cpu")
    assert sum(p.numel() for p in model.parameters()) == synthetic.parse(f"synthetic:{name}@tiny").num_params


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-1.7b"])  # untied, and tied with q/k norms
def test_greedy_choices_lead_by_a_wide_margin_in_bfloat16(name):
    """A speculative run must not part from plain decoding by rounding (the oracle drafter proposes the plain run's
    text): the greedy token leads every other logit by dozens of bf16 ulps at each step (with plain random weights,
    a few, at times one), and it is the prompt's last token, repeated."""
    model = synthetic.build(f"{name}@tiny", device="cpu", dtype=torch.bfloat16)
    ids, gaps = torch.tensor([[5, 17, 99, 3, 42]]), []
    with torch.inference_mode():
        for _ in range(6):
            logits = model(ids).logits[0, -1].float()
            top = logits.topk(2).values
            gaps.append(((top[0] - top[1]) / 2.0 ** (torch.floor(torch.log2(top[0].abs())) - 7)).item())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], 1)
    assert ids[0, 5:].tolist() == [42] * 6 and min(gaps) >= 32, gaps


def test_build_leaves_the_callers_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    synthetic.build("llama-3.2-1b@tiny", device="cpu")
    assert torch.equal(torch.rand(3), want)


def test_by_name_in_generate_equals_transformers_greedy(monkeypatch):
    from specdec.generate import generate

    monkeypatch.setattr("specdec.engine_setup.ensure_row_policy", lambda runner: None)  # no calibration per shape

    loaded = load_model("synthetic:llama-3.1-8b@tiny", device="cpu")
    assert loaded.tokenizer is None and loaded.name == "synthetic:llama-3.1-8b@tiny"
    prompt = [5, 17, 99, 3, 42]
    ours = generate(loaded, [prompt], max_new_tokens=12)[0][len(prompt):]
    with torch.inference_mode():
        x = torch.tensor([prompt])
        theirs = loaded.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                                       pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def test_unknown_names_and_oversized_builds_are_one_line_errors(monkeypatch):
    with pytest.raises(InputError, match="unknown synthetic model"):
        synthetic.parse("synthetic:llama-9b")
    monkeypatch.setattr(synthetic.os, "sysconf", lambda name: 1024)  # 1 MiB of free host memory
    with pytest.raises(InputError, match="GiB free"):
        synthetic.build("llama-3.1-8b", device="cpu")


def test_matching_draft_model_and_eagle_head():
    assert synthetic.draft_spec("synthetic:llama-3.1-8b") == "synthetic:llama-3.2-1b"
    assert synthetic.draft_spec("synthetic:qwen3-1.7b@tiny") == "synthetic:qwen3-0.6b@tiny"
    assert synthetic.draft_spec("synthetic:llama-3.2-1b") is None
    target = synthetic.build("qwen3-1.7b@tiny", device="cpu")
    head = synthetic.eagle_head(target.config, device="cpu")
    assert head.config.hidden_size == 64 and head.lm_head is None  # tiny: the target's full LM head
    reduced = synthetic.eagle_head(target.config, device="cpu", draft_vocab=16)
    assert reduced.lm_head.weight.shape == (16, 64) and reduced.draft_ids.tolist() == list(range(16))


_LLAMA3 = {"rope_type": "llama3", "high_freq_factor": 4.0, "low_freq_factor": 1.0,
           "original_max_position_embeddings": 8192}
# Each model's published config.json on the Hugging Face hub (meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B,
# Qwen/Qwen3-1.7B, Qwen/Qwen3-0.6B, HuggingFaceTB/SmolLM2-135M): hidden_size, num_hidden_layers, num_attention_heads,
# num_key_value_heads, head_dim, intermediate_size, vocab_size, rms_norm_eps, tie_word_embeddings,
# max_position_embeddings, then the RoPE parameters (rope_theta, rope_scaling)
PUBLISHED = {
    "llama-3.2-1b": ((2048, 16, 32, 8, 64, 8192, 128256, 1e-5, True, 131072),
                     {"rope_theta": 500000.0, "factor": 32.0, **_LLAMA3}),
    "llama-3.1-8b": ((4096, 32, 32, 8, 128, 14336, 128256, 1e-5, False, 131072),
                     {"rope_theta": 500000.0, "factor": 8.0, **_LLAMA3}),
    "qwen3-1.7b": ((2048, 28, 16, 8, 128, 6144, 151936, 1e-6, True, 40960),
                   {"rope_theta": 1000000.0, "rope_type": "default"}),
    "qwen3-0.6b": ((1024, 28, 16, 8, 128, 3072, 151936, 1e-6, True, 40960),
                   {"rope_theta": 1000000.0, "rope_type": "default"}),
    "smollm2-135m": ((576, 30, 9, 3, 64, 1536, 49152, 1e-5, True, 8192),
                     {"rope_theta": 100000.0, "rope_type": "default"}),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_shape_has_its_models_published_config_values(name):
    """The parameter count alone let a shape trade heads for head width, or carry another RoPE base, scaling,
    norm epsilon or context length: another model's attention at the same size."""
    c = synthetic.SHAPES[name].hf_config()
    shape, rope = PUBLISHED[name]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.intermediate_size, c.vocab_size, c.rms_norm_eps, c.tie_word_embeddings,
            c.max_position_embeddings) == shape
    assert c.rope_parameters == rope
