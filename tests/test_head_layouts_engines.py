"""EAGLE-3 head layouts against the rules of the engines that load them, encoded here (vLLM and SGLang are not
installed): the layer ids each engine reads from an export, the ascending order they capture streams in, the
norm_before_residual flag through specdec's own save and an SGLang export, a head over the target's LM head, and a
head narrower than its target."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, load_eagle, save_eagle
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.export_head import export_head

from specdec.cli import main
from specdec.errors import InputError
from specdec.testing import build_tiny_model
from tests.test_head_layouts import _inputs, specdec_logits


def vllm_aux_layers(cfg: dict) -> tuple[int, ...] | None:
    """vllm/v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`: the top-level list, else
    eagle_config's, taken as they are (the streams entering those layers: vLLM's llama.py appends
    hidden_states + residual before layer idx when idx is in the set)."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else None


def sglang_aux_layers(cfg: dict) -> tuple[int, ...] | None:
    """SGLang's model_runner.py reads only eagle_config["eagle_aux_hidden_state_layer_ids"]; its llama.py
    `set_eagle3_layers_to_capture` captures the streams entering id + 1."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(i + 1 for i in ids) if ids else None


def captured(ids, num_layers: int) -> tuple[int, ...]:
    """Both engines' Llama forward: `for idx, layer in enumerate(layers): if idx in aux: append(...)`, so the
    streams come in ascending layer order, each once, whatever the list's order."""
    return tuple(i for i in range(num_layers) if i in set(ids))


@pytest.fixture(scope="module")
def deep():
    return build_tiny_model(num_hidden_layers=8)  # default feature layers (2, 4, 5)


def _head(target, seed=0, **fields) -> EagleModel:
    torch.manual_seed(seed)
    head = EagleModel(EagleConfig.for_target(target.config, arch="eagle3", **fields))
    head.init_from_target(target)
    with torch.no_grad():  # away from the target's copy, so that differences show in the logits
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return head


def test_an_sglang_export_gives_vllm_and_sglang_the_streams_the_head_reads(tmp_path, deep):
    """The sglang layout wrote only eagle_config's ids in SGLang's count (outputs): vLLM read them as input streams,
    one layer early, (1, 3, 4) for a head of (2, 4, 5). A top-level list in vLLM's count now comes with them."""
    head = _head(deep, own_lm_head=True)
    save_eagle(head, tmp_path / "native")
    export_head(tmp_path / "native", "sglang", tmp_path / "sg", target="org/deep")
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert head.config.feature_layers == (2, 4, 5)
    assert captured(vllm_aux_layers(cfg), 8) == captured(sglang_aux_layers(cfg), 8) == (2, 4, 5)
    assert load_eagle(tmp_path / "sg", deep.config).config.feature_layers == (2, 4, 5)


def test_a_published_list_out_of_order_is_read_as_the_engines_capture_it(tmp_path, deep, caplog):
    """A published head naming its layers [5, 2, 4]: the engines feed fc [s2 | s4 | s5]; specdec fed it [s5 | s2 |
    s4], drafting other tokens. It now reads them ascending with one warning, and a layer named twice is refused."""
    head = _head(deep, own_lm_head=True)
    save_eagle(head, tmp_path / "native")
    export_head(tmp_path / "native", "speculators", tmp_path / "spec", target="org/deep")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = [5, 2, 4]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.head_layouts"):
        mine = load_eagle(tmp_path / "spec", deep.config)
    warned = [r.getMessage() for r in caplog.records if r.name == "specdec.drafters.head_layouts"]
    assert len(warned) == 1 and "[5, 2, 4]" in warned[0] and "ascending order, [2, 4, 5]" in warned[0]
    assert mine.config.feature_layers == captured(vllm_aux_layers(cfg), 8) == (2, 4, 5)
    assert torch.equal(mine.fc.weight, load_file(str(tmp_path / "spec" / "model.safetensors"))["fc.weight"])
    export_head(tmp_path / "spec", "sglang", tmp_path / "sg", target="org/deep")  # written ascending
    assert json.loads((tmp_path / "sg" / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 4]
    (tmp_path / "spec" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleCheckpointError, match=r"names target layer 4 twice .* capture each layer once") as err:
        load_eagle(tmp_path / "spec", deep.config)
    assert "\n" not in str(err.value)


def test_specdec_builds_heads_with_their_layers_ascending(deep):
    with pytest.raises(InputError, match=r"ascending order .* got \[5, 2, 4\]"):
        EagleConfig.for_target(deep.config, arch="eagle3", feature_layers=(5, 2, 4))
    with pytest.raises(InputError, match="ascending order"):
        EagleConfig.for_target(deep.config, arch="eagle3", feature_layers=(2, 2, 4))


def test_a_specdec_head_saved_with_its_layers_out_of_order_drafts_as_before(tmp_path, deep):
    """A head saved by specdec listing (5, 2, 4) had fc columns for that order; it loads ascending with fc's column
    blocks reordered alike, the same logits for the same streams, and exports ascending."""
    head = _head(deep, own_lm_head=True)
    save_eagle(head, tmp_path / "old")
    sd = load_file(str(tmp_path / "old" / "model.safetensors"))
    blocks = dict(zip((2, 4, 5), sd["fc.weight"].split(64, dim=1), strict=True))
    sd["fc.weight"] = torch.cat([blocks[5], blocks[2], blocks[4]], dim=1).contiguous()  # columns for [5, 2, 4]
    save_file(sd, str(tmp_path / "old" / "model.safetensors"))
    raw = json.loads((tmp_path / "old" / "config.json").read_text())
    raw["specdec_eagle"]["feature_layers"] = [5, 2, 4]
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    again = load_eagle(tmp_path / "old", deep.config)
    assert again.config.feature_layers == (2, 4, 5)
    assert torch.equal(again.fc.weight, head.fc.weight)
    embeds, aux, pos = _inputs(seed=2)  # aux: the streams of layers 2, 4, 5 in that order
    torch.testing.assert_close(specdec_logits(again, embeds, aux, pos)[0], specdec_logits(head, embeds, aux, pos)[0])
    export_head(tmp_path / "old", "speculators", tmp_path / "spec", target="org/deep")
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


def test_norm_before_residual_survives_save_and_load(tmp_path, deep):
    """save_eagle keeps the flag in its specdec_eagle block, which the reader passed over: the head came back
    without it (other logits)."""
    head = _head(deep, own_lm_head=True, norm_before_residual=True)
    save_eagle(head, tmp_path / "native")
    again = load_eagle(tmp_path / "native", deep.config)
    assert again.config.norm_before_residual is True
    embeds, aux, pos = _inputs(seed=3)
    torch.testing.assert_close(specdec_logits(again, embeds, aux, pos)[0], specdec_logits(head, embeds, aux, pos)[0])
    export_head(tmp_path / "native", "speculators", tmp_path / "spec", target="org/deep")
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["norm_before_residual"] is True


def test_an_sglang_export_of_a_norm_before_residual_head_is_refused(tmp_path, deep, capsys):
    """SGLang's llama_eagle3.py LlamaDecoderLayer takes residual = hidden_states and never reads the flag: the export
    drafted otherwise there. It is refused in one line naming the format that keeps it (vLLM reads it: its
    llama_eagle3.py picks _norm_before_residual from the config)."""
    save_eagle(_head(deep, own_lm_head=True, norm_before_residual=True), tmp_path / "native")
    out = tmp_path / "sg"
    assert main(["export-head", str(tmp_path / "native"), "--format", "sglang", "--output-dir", str(out),
                 "--target", "org/deep"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "norm_before_residual" in err[0] and "--format speculators" in err[0], err
    assert not out.exists()


def test_a_head_over_the_targets_lm_head_exports_without_one(tmp_path):
    """Such a head was refused ("serving engines do not share"): vLLM shares the target's lm_head with a draft
    checkpoint holding none (llm_base_proposer.py `_maybe_share_lm_head`, has_own_lm_head set by an lm_head weight),
    SGLang loads the target's when draft_vocab_size is null (llama_eagle3.py load_lm_head_from_target), speculators
    loads its verifier's into an lm_head the checkpoint lacks (its config needs draft_vocab_size an int)."""
    target = build_tiny_model()
    head = _head(target)  # full vocabulary, no LM head of its own
    assert head.lm_head is None
    save_eagle(head, tmp_path / "native")
    embeds, aux, pos = _inputs(seed=4)
    want = head.logits(_hidden(head, embeds, aux, pos), target.lm_head.weight)
    for fmt, vocab in (("speculators", target.config.vocab_size), ("sglang", None)):
        out, _ = export_head(tmp_path / "native", fmt, tmp_path / fmt, target="org/tiny")
        cfg = json.loads((out / "config.json").read_text())
        written = load_file(str(out / "model.safetensors"))
        assert not {"lm_head.weight", "d2t", "t2d"} & set(written), fmt
        assert cfg["draft_vocab_size"] == vocab, fmt
        assert cfg.get("transformer_layer_config", cfg)["tie_word_embeddings"] is False  # SGLang: else its embedding
        again = load_eagle(out, target.config)
        assert again.lm_head is None
        got = again.logits(_hidden(again, embeds, aux, pos), target.lm_head.weight)
        torch.testing.assert_close(got, want)


def _hidden(model: EagleModel, embeds, aux, positions):
    L = embeds.shape[0]
    mask = torch.ones(1, L, L, dtype=torch.bool).tril()
    out, _, _ = model(embeds[None], model.fuse(aux[None]), positions, mask)
    return out[0]


def test_a_head_narrower_than_its_target_is_refused_for_what_it_is(tmp_path):
    """vLLM and SGLang build fc over target_hidden_size-wide streams; specdec does not run such heads, and said it
    was made for another target."""
    target = build_tiny_model()  # hidden 64
    save_eagle(_head(build_tiny_model(hidden_size=32, intermediate_size=64), own_lm_head=True), tmp_path / "h")
    raw = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**raw, "target_hidden_size": 64}))
    with pytest.raises(EagleCheckpointError, match="target_hidden_size=64") as err:
        load_eagle(tmp_path / "h", target.config)
    assert "another target" not in str(err.value) and "specdec runs only" in str(err.value)


def test_speculators_reads_the_config_of_such_an_export(tmp_path):
    """speculators' Eagle3SpeculatorConfig takes draft_vocab_size as an int (null is refused), hence the vocabulary's
    size in the speculators layout; its model fills an lm_head the checkpoint lacks from the verifier's (a NaN
    sentinel, DraftVocabMixin._load_verifier_weights), which is not asserted here: under this project's transformers,
    past speculators' pin, from_pretrained leaves the missing tensor uninitialised rather than NaN."""
    speculators = pytest.importorskip("speculators.models.eagle3")
    target = build_tiny_model()
    save_eagle(_head(target), tmp_path / "native")
    export_head(tmp_path / "native", "speculators", tmp_path / "spec", target="org/tiny")
    config = speculators.Eagle3SpeculatorConfig.from_pretrained(str(tmp_path / "spec"))
    assert config.draft_vocab_size == config.target_vocab_size == target.config.vocab_size
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    with pytest.raises(ValueError, match="draft_vocab_size"):
        speculators.Eagle3SpeculatorConfig(**{**raw, "draft_vocab_size": None})
