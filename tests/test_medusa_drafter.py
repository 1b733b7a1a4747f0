"""Medusa drafter: the published checkpoint layout, tree construction, greedy identity, bad input."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from specdec.drafters.medusa import MedusaDrafter, validate_choices
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, load_medusa

import specdec
from specdec.testing import build_tiny_model

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5], [11] * 3 + [12, 13]]


def write_published_checkpoint(path, num_heads, num_layers, hidden, vocab, seed=0, lm_head=None, config_extra=None):
    """An independent writer of the FasterDecoding/Medusa layout: plain tensors, safetensors, json."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            state[f"{h}.{layer}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.2
            state[f"{h}.{layer}.linear.bias"] = torch.randn(hidden, generator=g) * 0.1
        w = lm_head.clone() if lm_head is not None else torch.randn(vocab, hidden, generator=g)
        state[f"{h}.{num_layers}.weight"] = w + 0.05 * torch.randn(vocab, hidden, generator=g)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "medusa_lm_head.safetensors"))
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "tiny"}
    config.update(config_extra or {})
    (path / "config.json").write_text(json.dumps(config))
    return state


def reference_heads(state, hidden, num_heads, num_layers):
    """[num_heads, vocab] logits computed straight from the tensors: x + silu(Wx + b), then the LM head."""
    out = []
    w = {k: v.double() for k, v in state.items()}
    for h in range(num_heads):
        x = hidden.double()
        for layer in range(num_layers):
            x = x + torch.nn.functional.silu(x @ w[f"{h}.{layer}.linear.weight"].T + w[f"{h}.{layer}.linear.bias"])
        out.append(x @ w[f"{h}.{num_layers}.weight"].T)
    return torch.stack(out)


class Recorder(MedusaDrafter):
    def propose(self, seqs):
        trees = super().propose(seqs)
        self.seen = getattr(self, "seen", []) + [(v.last_hidden, t) for v, t in zip(seqs, trees)]
        return trees


def test_independently_written_checkpoint_loads_and_drafts_its_top_k(tmp_path):
    model = build_tiny_model()
    state = write_published_checkpoint(tmp_path / "heads", 3, 2, 64, 96, lm_head=model.lm_head.weight.detach())
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    drafter = Recorder(path=str(tmp_path / "heads"), medusa_choices=choices)
    specdec.generate(model, [PROMPTS[0]], max_new_tokens=12, drafter=drafter)
    assert drafter.seen
    for hidden, tree in drafter.seen:
        top = reference_heads(state, hidden, 3, 2).topk(3, dim=-1).indices  # [heads, 3]
        expected = [int(top[len(p) - 1, p[-1]]) for p in validate_choices(choices, 3)]
        assert tree.tokens.tolist() == expected
        assert tree.parents.tolist() == [-1, -1, -1, 0, 0, 1, 3]


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen3-qknorm"])
@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_greedy_identity_with_random_and_lm_head_initialised_heads(variant, tree, tmp_path):
    model = build_tiny_model(variant)
    plain = specdec.generate(model, PROMPTS, max_new_tokens=256)
    options = dict(medusa_choices=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]) if tree == "static" else dict(
        tree="dynamic", max_nodes=16)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    random_heads = MedusaHeads(MedusaConfig(3, 1, hidden, vocab))
    for p in random_heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    lm_heads = MedusaHeads(MedusaConfig(3, 1, hidden, vocab))
    lm_heads.init_lm_heads_from(model.lm_head.weight)
    for heads in (random_heads, lm_heads):
        out = specdec.generate(model, PROMPTS, max_new_tokens=256, drafter=MedusaDrafter(heads=heads, **options),
                               return_dict=True)
        assert out.sequences == plain
    assert out.tau > 1.2  # the LM-head-initialised heads get drafts accepted: the accepted path is exercised
    for p, ref in zip(PROMPTS[:2], plain[:2]):
        assert specdec.generate(model, [p], max_new_tokens=256, drafter=MedusaDrafter(heads=lm_heads, **options))[0] == ref


def test_shared_lm_head_checkpoint_uses_the_target_lm_head(tmp_path):
    model = build_tiny_model()
    heads = MedusaHeads(MedusaConfig(2, 1, 64, 96, shared_lm_head=True))
    plain = specdec.generate(model, PROMPTS, max_new_tokens=64)
    out = specdec.generate(model, PROMPTS, max_new_tokens=64, drafter=MedusaDrafter(heads=heads, tree="dynamic"),
                           return_dict=True)
    assert out.sequences == plain and out.tau > 1.2


def test_generate_by_name_with_a_path(tmp_path):
    model = build_tiny_model()
    write_published_checkpoint(tmp_path / "h", 2, 1, 64, 96, lm_head=model.lm_head.weight.detach(),
                               config_extra={"medusa_choices": [[0], [0, 0]]})
    plain = specdec.generate(model, PROMPTS, max_new_tokens=32)
    assert specdec.generate(model, PROMPTS, max_new_tokens=32, drafter="medusa",
                            drafter_options={"path": str(tmp_path / "h")}) == plain


@pytest.mark.parametrize("problem, match", [
    ("hidden", "hidden_size=32.*64"), ("vocab", "vocab_size=50.*96"), ("no-config", "config.json is missing"),
    ("no-weights", "is missing"), ("pickle", "pickles are not loaded"), ("corrupt", "not a readable safetensors"),
    ("wrong-keys", "does not match"),
])
def test_bad_checkpoints_are_refused_clearly(problem, match, tmp_path):
    path = tmp_path / "h"
    hidden, vocab = (32 if problem == "hidden" else 64), (50 if problem == "vocab" else 96)
    write_published_checkpoint(path, 2, 1, hidden, vocab)
    if problem == "no-config":
        (path / "config.json").unlink()
    if problem in ("no-weights", "pickle"):
        (path / "medusa_lm_head.safetensors").unlink()
    if problem == "pickle":
        (path / "medusa_lm_head.pt").write_bytes(b"\x80\x04not really")
    if problem == "corrupt":
        (path / "medusa_lm_head.safetensors").write_bytes(b"garbage")
    if problem == "wrong-keys":
        (path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    with pytest.raises(MedusaCheckpointError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter="medusa",
                         drafter_options={"path": str(path)})


@pytest.mark.parametrize("choices, match", [
    ([[0], [1, 0]], "lacks its prefix"), ([[0], [0, 0], [0, 0, 0]], "deeper"), ([], "empty"), ([[-1]], ">= 0"),
])
def test_bad_medusa_choices(choices, match):
    with pytest.raises(ValueError, match=match):
        validate_choices(choices, num_heads=2)


def test_saver_round_trip_matches_the_independent_layout(tmp_path):
    from specdec.drafters.medusa_heads import save_medusa

    state = write_published_checkpoint(tmp_path / "a", 2, 2, 64, 96)
    heads = load_medusa(tmp_path / "a")
    save_medusa(heads, tmp_path / "b")
    again = load_medusa(tmp_path / "b", hidden_size=64, vocab_size=96)
    for k, v in state.items():
        torch.testing.assert_close(again.heads.state_dict()[k], v)


@pytest.mark.slow
def test_sampling_law_with_medusa_matches_plain():
    from specdec.eval.two_sample import two_sample_chi2

    model = build_tiny_model(vocab_size=4, seed=3)
    heads = MedusaHeads(MedusaConfig(2, 1, 64, 4))
    heads.init_lm_heads_from(model.lm_head.weight)
    prompt = [[1, 2, 3, 1, 2, 3, 1, 2]] * 6000

    def first(drafter, seed):
        out = specdec.generate(model, prompt, max_new_tokens=3, drafter=drafter, do_sample=True, seed=seed,
                               temperature=0.9, top_k=3, return_dict=True)
        return [tuple(t[:3]) for t in out.new_tokens]

    p, power = two_sample_chi2(first(None, 1), first(MedusaDrafter(heads=heads, tree="dynamic", max_nodes=6), 2))
    assert power >= 0.9 and p > 1e-3, (p, power)
