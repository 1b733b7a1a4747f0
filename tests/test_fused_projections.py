"""Fused QKV / gate-up projections: packing keeps the model's parameters and values, the runner multiplies once
per block where the weights lie side by side (and only there), and decoding gives the unfused tokens."""
from __future__ import annotations

import copy

import pytest
import torch

from specdec.generate import generate
from specdec.models import llama
from specdec.models.fused_projections import LayerProjections, fuse, pack_projections
from specdec.models.llama import LlamaRunner
from specdec.testing import RandomTreeDrafter, build_tiny_model, ragged_prompts


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "llama-mqa-bias", "qwen3-qknorm"])
def test_packed_model_decodes_the_unfused_tokens_with_one_product_per_block(variant, monkeypatch):
    model = build_tiny_model(variant)
    packed = copy.deepcopy(model)
    params = list(packed.parameters())
    assert pack_projections(packed) == 2 * len(packed.model.layers)
    assert pack_projections(packed) == 0  # already side by side
    assert [id(p) for p in packed.parameters()] == [id(p) for p in params]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), packed.parameters(), strict=True))
    runner = LlamaRunner(packed)
    fused = runner._fused_projections()
    assert fused and all(p.qkv is not None and p.gate_up is not None for p in fused)
    assert (fused[0].qkv.bias is not None) == (variant == "llama-mqa-bias")
    assert LlamaRunner(model)._fused_projections() is None  # as built: separate tensors
    assert runner.invariant_mode()._fused_projections() is None  # the bit-exact mode multiplies each weight alone

    products = set()  # (weight address, output width) of every product in the packed model's forward
    real_linear = llama.linear
    monkeypatch.setattr(llama, "linear", lambda x, w, b=None: products.add((w.data_ptr(), w.shape[0]))
                        or real_linear(x, w, b))
    prompts = ragged_prompts(3, seed=1)
    plain = generate(model, prompts, max_new_tokens=12)
    products.clear()
    assert generate(packed, prompts, max_new_tokens=12) == plain
    c = packed.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim
    for layer in packed.model.layers:  # one product over each whole block, none over its parts
        attn, mlp = layer.self_attn, layer.mlp
        assert (attn.q_proj.weight.data_ptr(), qkv) in products
        assert (mlp.gate_proj.weight.data_ptr(), 2 * c.intermediate_size) in products
        assert (attn.q_proj.weight.data_ptr(), attn.q_proj.weight.shape[0]) not in products
        assert (mlp.up_proj.weight.data_ptr(), c.intermediate_size) not in products
    assert generate(packed, prompts, max_new_tokens=12, drafter=RandomTreeDrafter(c.vocab_size, seed=3),
                    speculation="always") == plain


def test_only_consecutive_rows_of_one_storage_fuse_and_moved_weights_are_found_again():
    a = torch.arange(24.0).view(6, 4)
    assert torch.equal(fuse([a[:2], a[2:3], a[3:]], [None] * 3).weight, a)
    assert fuse([a[:2], a[3:]], [None, None]) is None  # a gap
    assert fuse([a[2:4], a[:2]], [None, None]) is None  # out of order
    assert fuse([a[:2], a[2:].clone()], [None, None]) is None  # two storages
    assert fuse([a[:3], a[3:]], [torch.zeros(3), None]) is None  # one bias only
    model = build_tiny_model()
    pack_projections(model)
    runner = LlamaRunner(model)
    assert runner._fused_projections() is not None
    model.double()  # every parameter gets storage of its own
    assert runner._fused_projections() is None
    assert LayerProjections.of(model.model.layers[0]).qkv is None
