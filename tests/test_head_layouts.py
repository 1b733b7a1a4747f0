"""EAGLE-3 heads in the layouts of EAGLE / SGLang, speculators and vLLM, and Medusa in vLLM's: a checkpoint written
here by an independent script loads and gives the logits of an independent EAGLE-3 forward written from the
published reference (fp32, 1e-5); export then re-import is the identity; heads for another target are refused.

speculators itself is not installed: it pins transformers <= 5.19 (the project runs 5.24) and torch <= 2.14.1;
its published EAGLE-3 layer is what ``reference_logits`` re-implements (first layer: residual = hidden, or
hidden_norm(hidden) with norm_before_residual; q/k/v over cat(input_layernorm(embed), hidden_norm(hidden));
logits = lm_head(norm(h)); the pre-norm h feeds the next step)."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, load_eagle, save_eagle
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.export_head import export_head
from specdec.drafters.head_layouts import write_eagle3
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads, save_medusa

from specdec.cli import main
from specdec.generate import generate
from specdec.testing import build_tiny_model

H, HEADS, KV, INTER, V, N = 64, 4, 2, 128, 96, 40


def write_sglang_checkpoint(path, seed=0, norm_before_residual=False, layers=(0, 1, 2), rope=None):
    """EAGLE / SGLang key layout, written from random tensors without specdec (``rope``: its config's
    ``rope_scaling``, as SpecForge writes the target's)."""
    g = torch.Generator().manual_seed(seed)
    hd = H // HEADS
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    hot = torch.randperm(V, generator=g)[:N].sort().values
    sd = {"fc.weight": r(H, 3 * H), "norm.weight": 1 + r(H), "lm_head.weight": r(N, H),
          "midlayer.input_layernorm.weight": 1 + r(H), "midlayer.hidden_norm.weight": 1 + r(H),
          "midlayer.post_attention_layernorm.weight": 1 + r(H),
          "midlayer.self_attn.q_proj.weight": r(HEADS * hd, 2 * H),
          "midlayer.self_attn.k_proj.weight": r(KV * hd, 2 * H),
          "midlayer.self_attn.v_proj.weight": r(KV * hd, 2 * H), "midlayer.self_attn.o_proj.weight": r(H, HEADS * hd),
          "midlayer.mlp.gate_proj.weight": r(INTER, H), "midlayer.mlp.up_proj.weight": r(INTER, H),
          "midlayer.mlp.down_proj.weight": r(H, INTER), "embed_tokens.weight": r(V, H),
          "d2t": hot - torch.arange(N), "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, hot, True)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV,
              "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": N, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "hidden_act": "silu", "norm_before_residual": norm_before_residual,
              "max_position_embeddings": 32768,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [f - 1 for f in layers]}}  # SGLang: outputs
    if rope is not None:
        config["rope_scaling"] = rope
    (path / "config.json").write_text(json.dumps(config))
    return sd


def reference_logits(sd, prefix, embeds, aux, positions, norm_before_residual=False, eps=1e-6, theta=10000.0,
                     rope=None):
    """One teacher-forced EAGLE-3 step over a causal block: [L, H] embeddings, [L, 3H] target features -> [L, N]
    draft logits and the [L, H] pre-norm outputs (``rope``: a scaled RoPE's parameters, rotated as transformers'
    Llama rotary embedding does for a config of 32768 positions)."""
    w = lambda name: sd[prefix + name]  # noqa: E731
    rms = lambda x, g: g * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    hd = H // HEADS
    hidden = aux @ sd["fc.weight"].T
    normed = rms(hidden, w("hidden_norm.weight"))
    residual = normed if norm_before_residual else hidden
    x = torch.cat([rms(embeds, w("input_layernorm.weight")), normed], dim=-1)
    L = x.shape[0]
    q = (x @ w("self_attn.q_proj.weight").T).view(L, HEADS, hd).transpose(0, 1)
    k = (x @ w("self_attn.k_proj.weight").T).view(L, KV, hd).transpose(0, 1)
    v = (x @ w("self_attn.v_proj.weight").T).view(L, KV, hd).transpose(0, 1)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    if rope is not None:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H, num_attention_heads=HEADS, rope_theta=theta,
                                                  max_position_embeddings=32768, rope_scaling=dict(rope)))
        cos, sin = (t[0] for t in rotary(embeds[None], positions[None]))
    rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, HEADS * hd)
    h = residual + o @ w("self_attn.o_proj.weight").T
    m = rms(h, w("post_attention_layernorm.weight"))
    h = h + (torch.nn.functional.silu(m @ w("mlp.gate_proj.weight").T) * (m @ w("mlp.up_proj.weight").T)) \
        @ w("mlp.down_proj.weight").T
    return rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T, h


def specdec_logits(model: EagleModel, embeds, aux, positions):
    L = embeds.shape[0]
    mask = torch.ones(1, L, L, dtype=torch.bool).tril()
    out, _, _ = model(embeds[None], model.fuse(aux[None]), positions, mask)
    return model.logits(out[0], None), out[0]


def _inputs(seed=1, L=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, generator=g), torch.randn(L, 3 * H, generator=g) * 2, torch.arange(3, 3 + L)


@pytest.fixture(scope="module")
def target():
    return build_tiny_model()  # hidden 64, 4 heads / 2 KV heads, vocab 96, 2 layers


@pytest.mark.parametrize("before", [False, True])
def test_an_independently_written_sglang_head_loads_with_the_reference_logits(tmp_path, target, before):
    sd = write_sglang_checkpoint(tmp_path / "h", norm_before_residual=before)
    model = load_eagle(tmp_path / "h", target.config)
    assert model.config.arch == "eagle3" and model.config.feature_layers == (0, 1, 2)
    assert model.config.norm_before_residual is before
    assert model.draft_ids.tolist() == (sd["d2t"] + torch.arange(N)).tolist()  # target id = draft id + d2t
    embeds, aux, pos = _inputs()
    want, want_h = reference_logits(sd, "midlayer.", embeds, aux, pos, before)
    got, got_h = specdec_logits(model, embeds, aux, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)


def test_export_then_import_is_the_identity_and_configs_name_the_target(tmp_path, target):
    sd = write_sglang_checkpoint(tmp_path / "src")
    model = load_eagle(tmp_path / "src", target.config)
    embeds, aux, pos = _inputs(seed=4)
    want, _ = reference_logits(sd, "midlayer.", embeds, aux, pos)
    for fmt, prefix in (("speculators", "layers.0."), ("sglang", "midlayer.")):
        out, _ = export_head(tmp_path / "src", fmt, tmp_path / fmt, target="org/tiny-target")
        raw = json.loads((out / "config.json").read_text())
        written = load_file(str(out / "model.safetensors"))
        # the written file itself, read by the reference with its own key names, gives the same logits
        torch.testing.assert_close(reference_logits(written, prefix, embeds, aux, pos)[0], want, rtol=1e-5,
                                   atol=1e-5)
        again = load_eagle(out, target.config)
        assert again.config.draft_vocab == model.config.draft_vocab
        # the target's context travels with the head (serving engines size the draft's positions by it)
        layer = raw.get("transformer_layer_config", raw)
        assert layer["max_position_embeddings"] == again.config.max_position_embeddings == 32768
        for key, value in model.state_dict().items():
            assert torch.equal(again.state_dict()[key], value), (fmt, key)
        if fmt == "speculators":
            assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
            assert raw["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and raw["draft_vocab_size"] == N
            assert raw["transformer_layer_config"]["num_hidden_layers"] == 1
        else:
            assert raw["target_model"] == "org/tiny-target" and raw["architectures"] == ["LlamaForCausalLMEagle3"]
            # SGLang captures the stream entering layer id + 1: specdec's streams (0, 1, 2) are ids -1, 0, 1
            assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
        assert set(written) >= {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
        assert written["t2d"].sum() == N and torch.equal(written["d2t"], sd["d2t"])


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def test_a_head_with_scaled_rope_rotates_as_its_config_says_through_export_and_import(tmp_path, target, caplog):
    """A published EAGLE-3 head of a Llama 3.x target carries the target's llama3 RoPE scaling (SpecForge's configs
    do), and serving engines rotate its layer by it. specdec rotated by rope_theta alone (a warning): other angles
    for most frequency pairs. It now loads with the reference's logits under the scaled rotation, and both export
    layouts write the scaling where transformers' config (4 or 5) reads it, so a reload rotates the same."""
    sd = write_sglang_checkpoint(tmp_path / "src", rope=LLAMA3_ROPE)
    embeds, aux, pos = _inputs(seed=5, L=9)
    pos = pos * 37  # positions far enough apart that the scaled frequencies turn other angles
    want, _ = reference_logits(sd, "midlayer.", embeds, aux, pos, rope=LLAMA3_ROPE)
    plain, _ = reference_logits(sd, "midlayer.", embeds, aux, pos)
    assert not torch.allclose(want, plain, rtol=1e-3, atol=1e-3)  # the scaling matters at these positions
    with caplog.at_level("WARNING"):
        model = load_eagle(tmp_path / "src", target.config)
    assert not [r for r in caplog.records if "RoPE" in r.getMessage()]
    assert dict(model.config.rope_scaling) == LLAMA3_ROPE
    torch.testing.assert_close(specdec_logits(model, embeds, aux, pos)[0], want, rtol=1e-5, atol=1e-5)
    from transformers import LlamaConfig

    for fmt in ("speculators", "sglang"):
        out, _ = export_head(tmp_path / "src", fmt, tmp_path / fmt, target="org/tiny-target")
        raw = json.loads((out / "config.json").read_text())
        layer = raw.get("transformer_layer_config", raw)
        assert layer["rope_scaling"] == LLAMA3_ROPE, fmt  # transformers 4's key
        assert LlamaConfig(**layer).rope_parameters == {**LLAMA3_ROPE, "rope_theta": 10000.0}, fmt
        again = load_eagle(out, target.config)
        torch.testing.assert_close(specdec_logits(again, embeds, aux, pos)[0], want, rtol=1e-5, atol=1e-5)
    save_eagle(model, tmp_path / "specdec")
    assert load_eagle(tmp_path / "specdec", target.config).config.rope_scaling == model.config.rope_scaling


def test_a_head_whose_rope_changes_with_length_loads_plain_with_a_warning(tmp_path, target, caplog):
    sd = write_sglang_checkpoint(tmp_path / "h", rope={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0})
    with caplog.at_level("WARNING"):
        model = load_eagle(tmp_path / "h", target.config)
    assert any("'dynamic' changes with sequence length" in r.getMessage() for r in caplog.records)
    assert model.config.rope_scaling == () and model.config.rope_theta == 10000.0  # the config's own rope_theta
    embeds, aux, pos = _inputs(seed=6)
    torch.testing.assert_close(specdec_logits(model, embeds, aux, pos)[0],
                               reference_logits(sd, "midlayer.", embeds, aux, pos)[0], rtol=1e-5, atol=1e-5)


def test_a_head_made_for_a_target_exports_the_targets_context(tmp_path):
    """A head shaped for a target records its context, save and load keep it, and both layouts write it (they
    wrote 4096 whatever the target's)."""
    target = build_tiny_model(max_position_embeddings=32768)
    config = EagleConfig.for_target(target.config, arch="eagle3", own_lm_head=True)
    save_eagle(EagleModel(config), tmp_path / "head")
    assert load_eagle(tmp_path / "head", target.config).config.max_position_embeddings == 32768
    for fmt in ("speculators", "sglang"):
        out, _ = export_head(tmp_path / "head", fmt, tmp_path / fmt, target="org/tiny-target")
        raw = json.loads((out / "config.json").read_text())
        assert raw.get("transformer_layer_config", raw)["max_position_embeddings"] == 32768


def test_a_specdec_head_with_an_unsorted_vocabulary_exports_sorted_and_drafts_the_same(tmp_path, target):
    torch.manual_seed(0)
    vocab = (57, 3, 89, 12, 40, 41, 0, 95)  # frequency order, not ascending: d2t offsets go negative
    head = EagleModel(EagleConfig.for_target(target.config, arch="eagle3", draft_vocab=vocab, depth=3, top_k=2,
                                             max_nodes=5, base_model_name_or_path="org/tiny-target"))
    head.init_from_target(target)
    save_eagle(head, tmp_path / "native")
    assert main(["export-head", str(tmp_path / "native"), "--format", "speculators", "--output-dir",
                 str(tmp_path / "spec")]) == 0
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    again = load_eagle(tmp_path / "spec", target.config)
    assert again.draft_ids.tolist() == sorted(vocab)
    embeds, aux, pos = _inputs(seed=2)
    a, _ = specdec_logits(head, embeds, aux, pos)
    b, _ = specdec_logits(again, embeds, aux, pos)
    order = torch.tensor(vocab).argsort()
    torch.testing.assert_close(b, a[:, order], rtol=1e-5, atol=1e-5)
    prompts = [[4, 5, 6, 7, 4, 5], [9, 1]]
    run = lambda m: generate(target, prompts, max_new_tokens=10, drafter="eagle",  # noqa: E731
                             drafter_options={"model": m}, speculation="always")
    assert run(again) == run(head) == generate(target, prompts, max_new_tokens=10)


def test_export_then_import_keeps_the_draft_tree_training_chose(tmp_path, target):
    """train-eagle saves its chosen tree (depth, top_k, max_nodes) in config.json; the exported configs carried only
    speculators' speculative_tokens (sglang: nothing), so an exported head loaded back with the defaults (5 / 8 /
    16). Both layouts now carry the tree, through export after export."""
    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(target.config, arch="eagle3", draft_vocab=(3, 9, 40, 41), depth=1,
                                             top_k=2, max_nodes=2))
    head.init_from_target(target)
    save_eagle(head, tmp_path / "native")
    source = tmp_path / "native"
    for step, fmt in enumerate(("speculators", "sglang", "speculators")):  # a re-export reads the one before
        out, _ = export_head(source, fmt, tmp_path / f"{step}-{fmt}", target="org/tiny-target")
        c = load_eagle(out, target.config).config
        assert (c.depth, c.top_k, c.max_nodes) == (1, 2, 2), fmt
        raw = json.loads((out / "config.json").read_text())
        if fmt == "speculators":  # what speculators' own readers take as the number of drafted tokens
            assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 1
        source = out


def test_heads_for_another_target_and_inconsistent_maps_are_refused(tmp_path, target):
    write_sglang_checkpoint(tmp_path / "h", layers=(0, 1, 5))
    with pytest.raises(EagleCheckpointError, match=r"reads target layers \[0, 1, 5\] but the target model has 2"):
        load_eagle(tmp_path / "h", target.config)
    write_sglang_checkpoint(tmp_path / "v")
    with pytest.raises(EagleCheckpointError, match="vocab_size=96 but the target model has vocab_size=80"):
        load_eagle(tmp_path / "v", build_tiny_model(vocab_size=80).config)
    with pytest.raises(EagleCheckpointError, match="hidden_size=64 but the target model has hidden_size=32"):
        load_eagle(tmp_path / "v", build_tiny_model(hidden_size=32, intermediate_size=64).config)
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    sd["t2d"] = torch.roll(sd["t2d"], 1)
    save_file(sd, str(tmp_path / "v" / "model.safetensors"))
    with pytest.raises(EagleCheckpointError, match="the two maps disagree"):
        load_eagle(tmp_path / "v", target.config)
    (tmp_path / "v" / "model.safetensors").rename(tmp_path / "v" / "pytorch_model.bin")
    with pytest.raises(EagleCheckpointError, match="pickle"):
        load_eagle(tmp_path / "v", target.config)


def test_weights_that_do_not_fit_the_config_are_named(tmp_path, target):
    """A head whose tensors did not fit its config was refused as "the weights do not match config.json (Error(s) in
    loading state_dict for EagleModel:)", torch's first line, naming no tensor: the missing, the unexpected and the
    misshapen ones are named, by load_eagle and export-head alike."""
    sd = write_sglang_checkpoint(tmp_path / "h")
    del sd["midlayer.mlp.up_proj.weight"]
    sd["midlayer.self_attn.q_proj.bias"] = torch.zeros(H)
    sd["fc.weight"] = torch.zeros(H, 2 * H)
    save_file(sd, str(tmp_path / "h" / "model.safetensors"))
    why = ("tensors the config expects are missing: layers.0.mlp.up_proj.weight; tensors the config does not make: "
           "layers.0.self_attn.q_proj.bias; fc.weight is [64, 128] where the config makes [64, 192]")
    with pytest.raises(EagleCheckpointError, match=re.escape(f"the weights do not match config.json ({why})")):
        load_eagle(tmp_path / "h", target.config)
    with pytest.raises(EagleCheckpointError, match=re.escape(f"the weights do not match config.json ({why})")):
        export_head(tmp_path / "h", "speculators", tmp_path / "out", target="unchecked-target")


def test_a_qwen3_draft_layer_is_refused_for_what_it_is(tmp_path, target, capsys):
    """speculators builds EAGLE-3 heads of a Qwen3 decoder layer (draft_arch qwen3: q_norm / k_norm over the heads'
    queries and keys, which vLLM runs as Eagle3Qwen3ForCausalLM); specdec's layer has no such norms, and such a head
    was refused as weights that do not match config.json, as if damaged."""
    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(target.config, arch="eagle3", draft_vocab=tuple(range(0, V, 2))))
    src = tmp_path / "q"
    write_eagle3(head, src, "speculators", "some/qwen3-target")
    raw = json.loads((src / "config.json").read_text())
    raw["transformer_layer_config"]["model_type"] = "qwen3"
    (src / "config.json").write_text(json.dumps(raw))
    sd = load_file(str(src / "model.safetensors"))
    hd = head.config.head_dim
    sd["layers.0.self_attn.q_norm.weight"], sd["layers.0.self_attn.k_norm.weight"] = torch.ones(hd), torch.ones(hd)
    save_file(sd, str(src / "model.safetensors"))
    why = ("the draft layer norms its queries and keys (layers.0.self_attn.k_norm.weight, "
           "layers.0.self_attn.q_norm.weight), a Qwen3 decoder layer")
    with pytest.raises(EagleCheckpointError, match=re.escape(why)):
        load_eagle(src, target.config)
    assert main(["export-head", str(src), "--format", "sglang", "--output-dir",
                 str(tmp_path / "out")]) != 0
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["norm_output", "norm_before_fc", "fc_norm", "use_aux_norm"])
def test_eagle31_variants_are_refused_in_every_layout(tmp_path, target, flag):
    """EAGLE 3.1's variants (norm_output: post-norm feedback, no tensor of its own; norm_before_fc / fc_norm: norms
    before fc; use_aux_norm: SGLang's older name of fc_norm) were refused in the speculators layout only, and a
    Llama-style config setting them, whose flags vLLM and SGLang read too (norm_before_fc also in eagle_config),
    loaded as plain EAGLE-3 and drafted with another feedback or features, unsaid."""
    write_sglang_checkpoint(tmp_path / "s")
    export_head(tmp_path / "s", "speculators", tmp_path / "v", target="unchecked-target")
    why = f"the head sets {flag}=true, an EAGLE-3 variant (EAGLE 3.1's) specdec does not run"
    for head, place in (("s", None), ("s", "eagle_config"), ("v", None)):
        raw = json.loads((tmp_path / head / "config.json").read_text())
        plain = json.loads(json.dumps(raw))
        (raw[place] if place else raw)[flag] = True
        (tmp_path / head / "config.json").write_text(json.dumps(raw))
        with pytest.raises(EagleCheckpointError, match=re.escape(f"{tmp_path / head}: {why}")):
            load_eagle(tmp_path / head, target.config)
        (tmp_path / head / "config.json").write_text(json.dumps(plain))
        load_eagle(tmp_path / head, target.config)  # the same head without the flag loads


def test_sglang_layer_ids_name_layer_outputs(tmp_path):
    """SGLang's eagle_config ids are layer outputs (its default capture, the streams entering 2, L // 2 and L - 3,
    is ids 1, L // 2 - 1, L - 4); speculators' / vLLM's top-level ids are the streams entering those layers."""
    deep = build_tiny_model(num_hidden_layers=8)
    write_sglang_checkpoint(tmp_path / "s")
    raw = json.loads((tmp_path / "s" / "config.json").read_text())
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]
    (tmp_path / "s" / "config.json").write_text(json.dumps(raw))
    assert load_eagle(tmp_path / "s", deep.config).config.feature_layers == (2, 4, 5)
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # a top-level list (vLLM's meaning) comes first
    (tmp_path / "s" / "config.json").write_text(json.dumps(raw))
    assert load_eagle(tmp_path / "s", deep.config).config.feature_layers == (1, 3, 4)


def test_speculators_config_without_layer_ids_takes_the_published_default(tmp_path, target):
    write_sglang_checkpoint(tmp_path / "s")
    export_head(tmp_path / "s", "speculators", tmp_path / "spec", target="t")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    del raw["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(raw))
    deep = build_tiny_model(num_hidden_layers=8)
    assert load_eagle(tmp_path / "spec", deep.config).config.feature_layers == (2, 4, 5)
    with pytest.raises(EagleCheckpointError, match="does not name the target layers"):
        export_head(tmp_path / "spec", "sglang", tmp_path / "again", target="t")


def test_eagle1_export_is_refused_in_one_line(tmp_path, target, capsys):
    head = EagleModel(EagleConfig.for_target(target.config))
    save_eagle(head, tmp_path / "e1")
    assert main(["export-head", str(tmp_path / "e1"), "--format", "sglang", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "EAGLE-1 head" in err[0]


def test_a_directory_without_a_draft_head_is_named_as_such(tmp_path, target, capsys):
    """export-head on a model's directory called it an EAGLE-1 head (anything not EAGLE-3 was): it holds no head
    at all, and the line says what a head directory holds."""
    target.save_pretrained(tmp_path / "model")
    (tmp_path / "empty").mkdir()
    capsys.readouterr()  # transformers' progress bar while saving
    for source in ("model", "empty"):
        argv = ["export-head", str(tmp_path / source), "--format", "sglang", "--output-dir", str(tmp_path / "o")]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{tmp_path / source} holds no draft head" in err[0] and "EAGLE-1" not in err[0]
        assert "expected a head directory: Medusa heads (medusa_lm_head.safetensors) or an EAGLE-3 head" in err[0]
        assert ("it looks like a llama model" in err[0]) == (source == "model")


def test_medusa_heads_export_to_vllms_layout_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(3, 2, H, V, base_model_name_or_path="org/tiny-target"))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    (tmp_path / "m").mkdir()
    save_medusa(heads, tmp_path / "m")
    assert main(["export-head", str(tmp_path / "m"), "--format", "vllm", "--output-dir", str(tmp_path / "v")]) == 0
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert raw["model_type"] == "medusa" and raw["num_heads"] == 3 and raw["num_hidden_layers"] == 2
    assert raw["medusa_fc_bias"] is True and raw["base_model_name_or_path"] == "org/tiny-target"
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert set(sd) == {f"blocks.{h}.layers.{i}.{p}" for h in range(3) for i in range(2) for p in ("weight", "bias")} \
        | {f"lm_heads.{h}.weight" for h in range(3)}
    x = torch.randn(5, H)
    want = heads(x)  # [heads, rows, vocab]
    for h in range(3):  # vLLM's ResidualBlock: x = x + silu(layer(x)) per layer, then lm_heads[h]
        y = x
        for i in range(2):
            y = y + torch.nn.functional.silu(y @ sd[f"blocks.{h}.layers.{i}.weight"].T
                                             + sd[f"blocks.{h}.layers.{i}.bias"])
        torch.testing.assert_close(y @ sd[f"lm_heads.{h}.weight"].T, want[h], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_medusa_heads_export_in_their_own_dtype(tmp_path, dtype):
    """Heads stored in half precision (as convert-medusa keeps published fp16 heads) were written in float32 for
    vLLM, twice their size; they keep their dtype, bit for bit, as EAGLE-3 heads do."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(2, 1, H, V, base_model_name_or_path="org/tiny-target")).to(dtype)
    (tmp_path / "m").mkdir()
    save_medusa(heads, tmp_path / "m")
    export_head(tmp_path / "m", "vllm", tmp_path / "v")
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert {t.dtype for t in sd.values()} == {dtype}
    assert torch.equal(sd["lm_heads.1.weight"], heads.heads[1][1].weight.detach())


def test_medusa_heads_of_a_reduced_vocabulary_export_with_vllms_token_map(tmp_path):
    """vLLM's Medusa scatters row j of each head's logits to token token_map[j] (-inf elsewhere) when
    truncated_vocab_size < vocab_size; such heads were refused as having no place there."""
    torch.manual_seed(0)
    vocab = (57, 3, 89, 12, 40)  # frequency order, as --draft-vocab keeps it
    heads = MedusaHeads(MedusaConfig(2, 1, H, V, base_model_name_or_path="t", draft_vocab=vocab))
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    (tmp_path / "m").mkdir()
    save_medusa(heads, tmp_path / "m")
    export_head(tmp_path / "m", "vllm", tmp_path / "v")
    raw = json.loads((tmp_path / "v" / "config.json").read_text())
    assert (raw["vocab_size"], raw["truncated_vocab_size"]) == (V, len(vocab))
    sd = load_file(str(tmp_path / "v" / "model.safetensors"))
    assert sd["token_map"].dtype == torch.int64 and sd["token_map"].tolist() == list(vocab)
    x = torch.randn(4, H)
    want = heads(x)  # [heads, rows, N]: column j scores token vocab[j]
    for h in range(2):
        y = x + torch.nn.functional.silu(x @ sd[f"blocks.{h}.layers.0.weight"].T + sd[f"blocks.{h}.layers.0.bias"])
        scattered = torch.full((4, V), float("-inf"))
        scattered[:, sd["token_map"]] = y @ sd[f"lm_heads.{h}.weight"].T
        torch.testing.assert_close(scattered[:, list(vocab)], want[h], rtol=1e-5, atol=1e-5)
        assert scattered.argmax(-1).tolist() == [vocab[j] for j in want[h].argmax(-1).tolist()]


def test_export_replaces_nothing_unasked(tmp_path, capsys):
    """export-head wrote its config.json over whatever --output-dir held (a trained Medusa head there no longer
    loaded); now a non-empty directory needs --overwrite, which replaces an earlier export only."""
    write_sglang_checkpoint(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"medusa_num_heads": 4}')
    argv = ["export-head", str(tmp_path / "src"), "--format", "speculators", "--output-dir", str(out),
            "--target", "t"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is not empty (config.json); pass --overwrite" in err and err.count("\n") == 1
    assert (out / "config.json").read_text() == '{"medusa_num_heads": 4}'
    (out / "config.json").unlink()
    assert main(argv) == 0 and main([*argv, "--overwrite"]) == 0  # an empty directory, then an earlier export
    (out / "notes.txt").write_text("the user's")
    assert main([*argv, "--overwrite"]) == 2
    assert "holds more than an earlier export (notes.txt)" in capsys.readouterr().err
    assert main(["export-head", str(tmp_path / "nowhere"), "--format", "sglang", "--output-dir", str(out)]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def test_a_head_known_only_by_its_hidden_norm_loads_as_eagle3(tmp_path, target):
    """vLLM's checkpoints may name no EAGLE-3 architecture and keep the layer as model.layers.0.*: only EAGLE-3's
    hidden_norm tells it from an EAGLE-1 head, and it loads with the reference's logits."""
    sd = write_sglang_checkpoint(tmp_path / "h")
    renamed = {("model.layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    save_file(renamed, str(tmp_path / "h" / "model.safetensors"))
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    del raw["architectures"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(raw))
    model = load_eagle(tmp_path / "h", target.config)
    assert model.config.arch == "eagle3" and model.config.feature_layers == (0, 1, 2)
    embeds, aux, pos = _inputs(seed=7)
    torch.testing.assert_close(specdec_logits(model, embeds, aux, pos)[0],
                               reference_logits(sd, "midlayer.", embeds, aux, pos)[0], rtol=1e-5, atol=1e-5)


def test_both_layouts_write_the_heads_own_rms_norm_eps(tmp_path):
    """The engines build the layer's RMSNorms with the config's rms_norm_eps; a Llama 3 target's heads use 1e-5,
    not the 1e-6 every other test here happens to use."""
    target = build_tiny_model(rms_norm_eps=1e-5)
    save_eagle(EagleModel(EagleConfig.for_target(target.config, arch="eagle3", own_lm_head=True)), tmp_path / "head")
    for fmt in ("speculators", "sglang"):
        out, _ = export_head(tmp_path / "head", fmt, tmp_path / fmt, target="org/tiny-target")
        raw = json.loads((out / "config.json").read_text())
        assert raw.get("transformer_layer_config", raw)["rms_norm_eps"] == 1e-5, fmt
        assert load_eagle(out, target.config).config.rms_norm_eps == 1e-5, fmt
