"""EAGLE-3 heads against speculators' own model classes: a specdec export loads in ``Eagle3DraftModel`` with the
same draft logits (fp32, 1e-5), and a head built and saved by speculators' API loads in specdec and drafts the same
tokens. Skipped where speculators is not installed: its releases pin transformers <= 5.19 and torch <= 2.14.1, so
it is no declared dependency (``pip install --no-deps speculators openai loguru hs-connectors`` runs it beside
the project's pins); tests/test_head_layouts.py checks the same against an independent EAGLE-3 forward."""
from __future__ import annotations

import json

import pytest
import torch

speculators = pytest.importorskip("speculators.models.eagle3")

from specdec.drafters.eagle_checkpoint import load_eagle  # noqa: E402
from specdec.drafters.export_head import export_head  # noqa: E402

from specdec.models import row_policy  # noqa: E402
from specdec.testing import build_tiny_model  # noqa: E402
from tests.test_head_layouts import N, _inputs, specdec_logits, write_sglang_checkpoint  # noqa: E402


@pytest.fixture(autouse=True)
def _products_as_speculators_computes_them(monkeypatch):
    """specdec's layers multiply by F.linear here, as speculators' do: a CPU row policy installed in this process by
    an earlier test (a transposed or packed product for some row counts) rounds a logit past 1e-5 now and then."""
    monkeypatch.setattr(row_policy, "active_cols", lambda dtype=None: {})


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    model = build_tiny_model()
    path = tmp_path_factory.mktemp("target")
    model.save_pretrained(path)  # speculators reads the verifier's config (layer count) from its path
    return model, str(path)


def _their_logits(model, aux, ids, positions):
    """speculators' own forward for one step; its lm_head's output captured by a hook: [L, draft vocab]."""
    seen = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out))
    try:
        with torch.no_grad():
            drafted = model(aux[None], ids[None], torch.zeros_like(ids)[None], position_ids=positions[None],
                            ttt_steps=1)
    finally:
        handle.remove()
    return seen[0][0], drafted[0][0]


def test_a_specdec_export_loads_in_speculators_with_the_same_logits(tmp_path, target):
    hf, path = target
    write_sglang_checkpoint(tmp_path / "src")
    export_head(tmp_path / "src", "speculators", tmp_path / "out", target=path)
    theirs = speculators.Eagle3DraftModel.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():  # vLLM shares the target's embedding with the head; speculators' stays NaN until given
        theirs.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [0, 1, 2]
    assert theirs.config.speculators_config.verifier.architectures == ["LlamaForCausalLM"]  # read from the target
    mine = load_eagle(tmp_path / "out", hf.config)
    _, aux, pos = _inputs(seed=3)
    ids = torch.tensor([5, 17, 3, 88, 41, 41, 9])
    want, _ = _their_logits(theirs, aux, ids, pos)
    got, _ = specdec_logits(mine, hf.model.embed_tokens.weight[ids].detach(), aux, pos)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("before", [False, True])
def test_a_head_saved_by_speculators_loads_in_specdec_and_drafts_the_same_tokens(tmp_path, target, before):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    hf, path = target
    c = hf.config
    layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps)
    config = speculators.Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=N, norm_before_residual=before,
        eagle_aux_hidden_state_layer_ids=[0, 1, 2],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=path, architectures=[])))
    theirs = speculators.Eagle3DraftModel(config)
    g = torch.Generator().manual_seed(7)
    hot = torch.randperm(c.vocab_size, generator=g)[:N].sort().values
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if name.endswith("norm.weight") else 0.0))
        theirs.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
    theirs.load_vocab_mappings(torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, hot, True),
                               hot - torch.arange(N))
    theirs.save_pretrained(str(tmp_path / "theirs"))
    raw = json.loads((tmp_path / "theirs" / "config.json").read_text())
    assert raw["speculators_model_type"] == "eagle3"
    mine = load_eagle(tmp_path / "theirs", hf.config)
    assert mine.config.norm_before_residual is before and mine.draft_ids.tolist() == hot.tolist()
    _, aux, pos = _inputs(seed=5)
    ids = torch.tensor([1, 2, 3, 50, 60, 70, 95])
    want, drafted = _their_logits(theirs.eval(), aux, ids, pos)
    got, _ = specdec_logits(mine, hf.model.embed_tokens.weight[ids].detach(), aux, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), drafted)  # the same draft token at every position (draft vocabulary ids)
