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
    fused = runner.fused_projections()
    assert fused and all(p.qkv is not None and p.gate_up is not None for p in fused)
    assert (fused[0].qkv.bias is not None) == (variant == "llama-mqa-bias")
    assert LlamaRunner(model).fused_projections() is None  # as built: separate tensors
    assert runner.invariant_mode().fused_projections() is None  # the bit-exact mode multiplies each weight alone

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
    assert runner.fused_projections() is not None
    model.double()  # every parameter gets storage of its own
    assert runner.fused_projections() is None
    assert LayerProjections.of(model.model.layers[0]).qkv is None


def test_a_checkpoint_loaded_on_the_cpu_multiplies_fused_blocks_and_its_row_policy_times_them(tmp_path):
    """specdec lays out the targets it loads on every device: on a CPU a fused block over oneDNN-packed weights
    streams faster than its parts (the models it loaded there used to stay as built). The row policy times what the
    forward multiplies, and measurements keyed to the unfused layout are not reused for the fused one."""
    from specdec import cost_model
    from specdec.models.loader import load_model
    from specdec.testing import save_tiny_checkpoint

    loaded = load_model(save_tiny_checkpoint(tmp_path / "tiny", "llama-mqa-bias"))
    assert loaded.runner.device.type == "cpu"
    fused = loaded.runner.fused_projections()
    assert fused and all(p.qkv is not None and p.gate_up is not None for p in fused)
    c = loaded.model.config
    timed, _ = cost_model.streamed_weights(loaded.runner)  # what the row policy times: every layer here, LM head
    head_dim = c.hidden_size // c.num_attention_heads
    per_layer = [(c.num_attention_heads + 2 * c.num_key_value_heads) * head_dim, c.hidden_size,
                 2 * c.intermediate_size, c.hidden_size]
    assert [w.shape[0] for w in timed] == per_layer * c.num_hidden_layers + [c.vocab_size]
    assert timed[0].data_ptr() == fused[0].qkv.weight.data_ptr()  # the block itself
    unfused = LlamaRunner(build_tiny_model("llama-mqa-bias", vocab_size=c.vocab_size))
    assert len(cost_model.streamed_weights(unfused)[0]) == 7 * c.num_hidden_layers + 1
    assert cost_model.machine_key(loaded.runner) != cost_model.machine_key(unfused)


def test_runners_over_one_layer_share_its_blocks_and_their_packed_copy(monkeypatch):
    """A second runner over the same layers (another LoadedModel of one model, self-draft's truncated runner) gets
    the same block views, so the CPU's packed copy of each block (row_policy, keyed by the weight) is made once,
    not once per runner (a moved layer's new blocks: the test above)."""
    from specdec.models import row_policy

    model = build_tiny_model()
    pack_projections(model)
    first = LlamaRunner(model)
    blocks = first.fused_projections()
    assert LlamaRunner(model).fused_projections()[0] is blocks[0]
    assert first.truncated(1).fused_projections() == blocks[:1] and first.truncated(1).fused_projections()[0] \
        is blocks[0]
    if not row_policy.packing_available():
        pytest.skip("this PyTorch has no oneDNN packed linear")
    packs = []
    real_pack = row_policy.pack_weight
    monkeypatch.setattr(row_policy, "pack_weight", lambda w: packs.append(w.shape) or real_pack(w))
    x = torch.randn(1, model.config.hidden_size)
    for runner in (first, LlamaRunner(model), first.truncated(1)):
        weight = runner.fused_projections()[0].qkv.weight
        assert torch.allclose(row_policy.packed_linear(x, weight), x @ weight.T, atol=1e-5)
    assert len(packs) == 1


def test_packing_leaves_a_layer_whose_parts_differ_in_dtype_as_it_is():
    """Packing keeps every parameter's dtype: a k_proj kept in float64 beside float32 q / v is not concatenated into
    one float64 block (which would turn q and v into float64), and its layer's QKV stays unpacked."""
    model = build_tiny_model()
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight.data = attn.k_proj.weight.data.double()
    q = attn.q_proj.weight.detach().clone()
    assert pack_projections(model) == 2 * 2 - 1  # 2 layers x (QKV, gate/up), less layer 0's QKV
    assert (attn.q_proj.weight.dtype, attn.k_proj.weight.dtype, attn.v_proj.weight.dtype) == \
        (torch.float32, torch.float64, torch.float32)
    assert torch.equal(attn.q_proj.weight, q)
