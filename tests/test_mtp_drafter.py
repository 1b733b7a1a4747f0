"""The mtp drafter on tiny random checkpoints that carry an MTP layer, written here by an independent script in
MiMo's (``model.mtp_layers.0.*``) and DeepSeek's (``model.layers.{L}.enorm / hnorm / eh_proj``) layouts: the
layer's logits equal an independent forward, greedy output is the target's, the sampled law is exact with broken
rules caught; a checkpoint without MTP weights is refused in one line. No real MTP checkpoint was available."""
from __future__ import annotations

import json
import logging
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from specdec.drafters.eagle_checkpoint import EagleCheckpointError
from specdec.drafters.eagle_graphs import EagleGraphConfig
from specdec.drafters.mtp import MtpDrafter, read_mtp_layer
from specdec.drafters.registry import get_drafter
from specdec.eval.certificate import CertificateSizes, run_certificate

from specdec.errors import InputError
from specdec.generate import generate
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model, ragged_prompts

H, HEADS, KV, INTER = 64, 4, 2, 128


def mtp_tensors(seed: int, target, layout: str) -> dict[str, torch.Tensor]:
    """An MTP layer in MiMo's names (without the model.mtp_layers.0. prefix), from random tensors: the target's
    last layer (so its drafts agree with the target now and then) with random projections and norms. input_proj's
    columns are in the layout's order: MiMo's reads cat(hidden, embedding), DeepSeek's eh_proj cat(embedding,
    hidden) (MiMo's modeling_mimo.py and vLLM's mimo_mtp.py / deepseek_mtp.py)."""
    g = torch.Generator().manual_seed(seed)
    last = {k: v.detach().clone() for k, v in target.model.layers[-1].state_dict().items()}
    halves = [torch.eye(H), torch.zeros(H, H)] if layout == "mimo" else [torch.zeros(H, H), torch.eye(H)]
    eye = torch.cat(halves, dim=1)  # input_proj passes the hidden half through
    return {"token_layernorm.weight": torch.ones(H), "hidden_layernorm.weight": torch.ones(H) + 0.05 * torch.randn(
        H, generator=g), "input_proj.weight": eye + 0.02 * torch.randn(H, 2 * H, generator=g),
        "final_layernorm.weight": target.model.norm.weight.detach().clone(),
        **{k: (v * 0.1 if k.endswith(("o_proj.weight", "down_proj.weight")) else v) for k, v in last.items()}}


def write_target_with_mtp(path, layout: str, seed: int = 0, vocab_size: int = 96):
    target = build_tiny_model(vocab_size=vocab_size, seed=seed)
    target.save_pretrained(path)
    mtp = mtp_tensors(seed, target, layout)
    weights = load_file(str(path / "model.safetensors"))
    if layout == "mimo":
        weights.update({f"model.mtp_layers.0.{k}": v for k, v in mtp.items()})
    else:
        rename = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "eh_proj",
                  "final_layernorm": "shared_head.norm"}
        L = target.config.num_hidden_layers
        for k, v in mtp.items():
            stem = k.rsplit(".", 1)[0]
            weights[f"model.layers.{L}.{rename.get(stem, stem)}.weight" if stem in rename
                    else f"model.layers.{L}.{k}"] = v
        weights[f"model.layers.{L}.embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return target, mtp


def reference_mtp_logits(mtp, target, ids: torch.Tensor, hidden: torch.Tensor, positions, layout, eps=1e-6):
    """One causal block through the MTP layer, from its published design: logits [L, V]."""
    rms = lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))  # noqa: E731
    hd = H // HEADS
    e = rms(target.model.embed_tokens.weight[ids].detach(), mtp["token_layernorm.weight"])
    h = rms(hidden, mtp["hidden_layernorm.weight"])
    x = torch.cat([h, e] if layout == "mimo" else [e, h], -1)  # MiMo: hidden first; DeepSeek: embedding first
    x = x @ mtp["input_proj.weight"].T
    a = rms(x, mtp["input_layernorm.weight"])
    L = a.shape[0]
    q = (a @ mtp["self_attn.q_proj.weight"].T).view(L, HEADS, hd).transpose(0, 1)
    k = (a @ mtp["self_attn.k_proj.weight"].T).view(L, KV, hd).transpose(0, 1)
    v = (a @ mtp["self_attn.v_proj.weight"].T).view(L, KV, hd).transpose(0, 1)
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    ang = positions.float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: t * cos + torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    s = (q @ k.transpose(1, 2) / math.sqrt(hd)).masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -math.inf)
    h = x + (s.softmax(-1) @ v).transpose(0, 1).reshape(L, -1) @ mtp["self_attn.o_proj.weight"].T
    m = rms(h, mtp["post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(m @ mtp["mlp.gate_proj.weight"].T) * (m @ mtp["mlp.up_proj.weight"].T)) \
        @ mtp["mlp.down_proj.weight"].T
    return rms(h, mtp["final_layernorm.weight"]) @ target.lm_head.weight.detach().T


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
def test_the_layer_read_from_the_target_checkpoint_gives_the_reference_logits(tmp_path, layout):
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    target, mtp = write_target_with_mtp(tmp_path, layout)
    state, name = read_mtp_layer(tmp_path, target.config.num_hidden_layers)
    assert name == {"mimo": "MiMo", "deepseek": "DeepSeek"}[layout]
    model = EagleModel.from_state(EagleConfig.for_target(target.config, arch="mtp"), state)
    ids = torch.tensor([4, 9, 16, 25, 36, 49])
    hidden = torch.randn(len(ids), H, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(1, 1 + len(ids))
    out, _, _ = model(target.model.embed_tokens.weight[ids].detach()[None], model.fuse(hidden[None]), pos,
                      torch.ones(1, len(ids), len(ids), dtype=torch.bool).tril())
    got = model.logits(out[0], target.lm_head.weight.detach())
    torch.testing.assert_close(got, reference_mtp_logits(mtp, target, ids, hidden, pos, layout), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
def test_layer_n_is_read_from_its_own_keys_not_from_the_first_layers(tmp_path, layout):
    """Two MTP layers after a 2-layer decoder, told apart by their values: layer 1 is MiMo's model.mtp_layers.1.*,
    DeepSeek's model.layers.{2 + 1}.* (after the decoder's 2 layers)."""
    weights = {}
    for index, value in ((0, 0.0), (1, 1.0)):
        prefix = f"model.mtp_layers.{index}." if layout == "mimo" else f"model.layers.{2 + index}."
        proj = "input_proj" if layout == "mimo" else "eh_proj"
        weights[f"{prefix}{proj}.weight"] = torch.full((2, 4), value)
        weights[f"{prefix}self_attn.q_proj.weight"] = torch.full((2, 2), value)
    save_file(weights, str(tmp_path / "model.safetensors"))
    for index, value in ((0, 0.0), (1, 1.0)):
        state, _ = read_mtp_layer(tmp_path, 2, index)
        assert sorted(state) == ["fc.weight", "layers.0.self_attn.q_proj.weight"]
        assert state["fc.weight"].eq(value).all() and state["layers.0.self_attn.q_proj.weight"].eq(value).all()
    with pytest.raises(EagleCheckpointError, match="has no MTP layer 2: its checkpoint holds MTP layer 0, 1; give "
                       "layer= one of them$"):
        read_mtp_layer(tmp_path, 2, 2)


def test_a_layer_past_the_targets_mtp_layers_names_those_it_holds(tmp_path):
    """layer=1 of a target holding one MTP layer was refused as if it had none: "the mtp drafter needs a model
    trained with multi-token-prediction layers ... choose another drafter"."""
    write_target_with_mtp(tmp_path, "deepseek")
    with pytest.raises(EagleCheckpointError, match=f"^mtp: the target model '{tmp_path.name}' has no MTP layer 1: "
                       "its checkpoint holds MTP layer 0; give layer= one of them$"):
        generate(load_model(str(tmp_path)), [[1, 2, 3]], max_new_tokens=2, drafter=MtpDrafter(layer=1))


def test_a_path_that_does_not_exist_says_so(tmp_path):
    """A missing path= folder was refused as "holds no safetensors weights to read MTP layers from"."""
    write_target_with_mtp(tmp_path / "t", "mimo")
    with pytest.raises(EagleCheckpointError) as err:
        generate(load_model(str(tmp_path / "t")), [[1, 2, 3]], max_new_tokens=2,
                 drafter=MtpDrafter(path=str(tmp_path / "missing")))
    assert str(err.value) == (f"mtp: {tmp_path / 'missing'} does not exist: give the checkpoint directory whose "
                              "safetensors hold the MTP layers")


def test_greedy_output_is_the_targets_and_the_layer_drafts_usefully(tmp_path):
    write_target_with_mtp(tmp_path, "mimo")
    loaded = load_model(str(tmp_path))
    prompts = ragged_prompts(3, seed=4)
    plain = generate(loaded, prompts, max_new_tokens=16)
    out = generate(loaded, prompts, max_new_tokens=16, drafter="mtp", drafter_options={"depth": 3},
                   speculation="always", return_dict=True)
    assert out.sequences == plain
    assert sum(s.steps for s in out.stats) < sum(s.new_tokens for s in out.stats)


@pytest.mark.slow  # the end-to-end level samples: ~40 s on 2 cores
def test_exact_law_passes_and_broken_rules_fail(tmp_path):
    target, _ = write_target_with_mtp(tmp_path, "deepseek", seed=3, vocab_size=12)
    loaded = load_model(target)
    sizes = CertificateSizes(stat_samples=2000, identity_prompts=3, identity_tokens=12, sample_sequences=400,
                             sample_tokens=2, e2e_tv=0.15)
    prompts = lambda n: [[1, 2, 3, 1, 2, 3], [5, 6, 7, 5], [9, 4, 9, 4, 9]][:n]  # noqa: E731
    cert = run_certificate(loaded, "mtp", {"path": str(tmp_path), "depth": 2, "top_k": 2, "max_nodes": 3},
                           SamplingConfig(True, 0.9, 6), sizes, prompts, levels=("exact", "e2e"))
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    assert [c for c in cert.checks if c.control] and all(not c.passed for c in cert.checks if c.control)


def test_the_draft_graphs_log_under_the_mtp_name(tmp_path, caplog):
    """mtp drafts through EAGLE's CUDA-graph machinery, whose logs named "eagle": a failed capture (simulated, on
    CPU the graphs run eagerly) is logged under the drafter the user chose."""
    write_target_with_mtp(tmp_path, "mimo")
    drafter = MtpDrafter(depth=2, cuda_graphs=True)
    generate(load_model(str(tmp_path)), [[1, 2, 3]], max_new_tokens=3, drafter=drafter, speculation="always")
    graphs = drafter.graphs
    graphs.config = EagleGraphConfig(capture=True)
    graphs._capture = lambda bucket, form: (_ for _ in ()).throw(RuntimeError("no capture here"))
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.eagle_graphs"):
        assert graphs._call(SimpleNamespace(graphs={}, outputs={}), (2, False)) is None  # (depth, fields)
    assert [r.getMessage() for r in caplog.records if r.name == "specdec.drafters.eagle_graphs"] == [
        "mtp: CUDA-graph capture failed (RuntimeError: no capture here); drafting eagerly"]


def test_a_target_without_mtp_layers_is_refused_naming_the_model_and_what_it_needs(tmp_path):
    """It named the folder it read (for the embedded model, a converted cache path the user never typed) and not
    what kind of model the drafter needs."""
    build_tiny_model().save_pretrained(tmp_path / "plain-llama")
    with pytest.raises(EagleCheckpointError, match=r"^mtp: the target model 'plain-llama' has no MTP layer 0 .*"
                       r"needs a model trained with multi-token-prediction layers .*choose another drafter") as err:
        generate(load_model(str(tmp_path / "plain-llama")), [[1, 2, 3]], max_new_tokens=2, drafter=MtpDrafter())
    assert "\n" not in str(err.value)
    other = tmp_path / "other"  # a path= checkpoint without them: named by the path given, as before
    build_tiny_model().save_pretrained(other)
    with pytest.raises(EagleCheckpointError, match=f"^mtp: {other} has no MTP layer 0 "):
        generate(load_model(str(tmp_path / "plain-llama")), [[1, 2, 3]], max_new_tokens=2,
                 drafter=MtpDrafter(path=str(other)))


def test_a_drafter_reused_on_another_target_reads_that_targets_layer(tmp_path):
    """The layer read for the first target was kept on the drafter and drafted for the next one, even one without
    an MTP layer (which a fresh drafter refuses)."""
    write_target_with_mtp(tmp_path / "with-mtp", "mimo")
    build_tiny_model(seed=5).save_pretrained(tmp_path / "plain-llama")
    drafter = MtpDrafter(depth=2)
    generate(load_model(str(tmp_path / "with-mtp")), [[1, 2, 3]], max_new_tokens=4, drafter=drafter)
    first = drafter.model
    generate(load_model(str(tmp_path / "with-mtp")), [[1, 2, 3]], max_new_tokens=4, drafter=drafter)
    assert drafter.model is first  # the same target: read once
    with pytest.raises(EagleCheckpointError, match="^mtp: the target model 'plain-llama' has no MTP layer 0 "):
        generate(load_model(str(tmp_path / "plain-llama")), [[1, 2, 3]], max_new_tokens=4, drafter=drafter)


@pytest.mark.parametrize("options, match", [
    ({"top_k": 0}, "mtp: top_k must be a positive integer, got 0"),
    ({"max_nodes": 65}, "mtp: max_nodes must be <= 64, got 65"),
    ({"adapt_depth": "no"}, "mtp: adapt_depth must be True or False"),
    ({"top_k": 8, "max_nodes": 4}, "mtp: top_k=8 exceeds max_nodes=4"),
])
def test_option_mistakes_name_the_mtp_drafter(options, match):
    with pytest.raises(InputError, match=match):
        get_drafter("mtp", **options)


def test_top_k_beyond_the_vocabulary_names_the_mtp_drafter_before_the_cost_measurement(tmp_path, monkeypatch):
    """Refused when the layer loads for the target; it was refused at attach, after speculation="auto" had measured
    the verify costs."""
    def no_measurement(*args, **kwargs):
        raise AssertionError("the verify costs were measured before top_k was refused")

    monkeypatch.setattr("specdec.engine_setup.load_cost_model", no_measurement)
    write_target_with_mtp(tmp_path, "mimo")
    with pytest.raises(InputError, match="^mtp: top_k=97 exceeds the draft vocabulary of 96 tokens"):
        generate(load_model(str(tmp_path)), [[1, 2, 3]], max_new_tokens=2, drafter=MtpDrafter(top_k=97),
                 speculation="auto")


def test_a_target_not_loaded_from_a_directory_asks_for_path():
    with pytest.raises(InputError, match="^mtp: the target was not loaded from a directory.*give path="):
        generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=2, drafter="mtp")


@pytest.mark.parametrize("field, value", [("vocab_size", 80), ("num_hidden_layers", 3)])
def test_a_path_to_another_models_checkpoint_is_refused_naming_both_sides(tmp_path, field, value):
    """A layer of another model with the target's hidden size loads and drafts (uselessly): its config says so."""
    target, _ = write_target_with_mtp(tmp_path / "target", "mimo")
    write_target_with_mtp(tmp_path / "other", "mimo", seed=1, vocab_size=80 if field == "vocab_size" else 96)
    config = json.loads((tmp_path / "other" / "config.json").read_text())
    (tmp_path / "other" / "config.json").write_text(json.dumps({**config, field: value}))
    match = f"the checkpoint has {field}={value} but the target model has {field}={getattr(target.config, field)}"
    with pytest.raises(EagleCheckpointError, match=match):
        generate(load_model(str(tmp_path / "target")), [[1, 2, 3]], max_new_tokens=2,
                 drafter=MtpDrafter(path=str(tmp_path / "other")))
    (tmp_path / "bare").mkdir()  # the weights without a config: nothing tells whose layer it is
    shutil.copy(tmp_path / "target" / "model.safetensors", tmp_path / "bare")
    with pytest.raises(EagleCheckpointError, match="bare has no config.json"):
        generate(load_model(str(tmp_path / "target")), [[1, 2, 3]], max_new_tokens=2,
                 drafter=MtpDrafter(path=str(tmp_path / "bare")))
    out = generate(load_model(str(tmp_path / "target")), [[1, 2, 3]], max_new_tokens=2,  # its own copy is fine
                   drafter=MtpDrafter(path=str(tmp_path / "target")))
    assert len(out[0]) == 5


def test_model_is_no_option_of_the_mtp_drafter_in_python_or_on_the_command_line():
    """The command line called model= a Python-only option of mtp, and Python refused it through the registry, yet
    MtpDrafter(model=...) ran as an unnamed eagle drafter."""
    from specdec.drafters.registry import check_options

    from specdec.errors import InputTypeError

    with pytest.raises(InputTypeError, match="^mtp: it reads its layer from a checkpoint .* takes no model="):
        MtpDrafter(model=object())
    with pytest.raises(InputTypeError, match="has no --drafter-option 'model';"):  # not "(Python only)"
        check_options("mtp", {"model": "x"}, command_line=True)
