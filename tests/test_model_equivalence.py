"""The engine's own Llama-family forward equals transformers' forward on the same weights."""
from __future__ import annotations

import pytest
import torch

from specdec.attention import AttentionPlan
from specdec.kv_cache import PagedKVCache
from specdec.models.llama import LlamaRunner, UnsupportedModelError
from specdec.testing import TINY_VARIANTS, build_tiny_model, seq_attention_from_mask


def run_engine_forward(runner: LlamaRunner, cache: PagedKVCache, seq_id: int, tokens, mask=None, positions=None):
    """One forward of `tokens` appended to seq_id (causal by default); returns logits [n, vocab]."""
    n = len(tokens)
    cached = cache.lengths[seq_id]
    cache.reserve(seq_id, n)
    key_slots = cache.slots(seq_id, 0, cached + n)
    plan = AttentionPlan((seq_attention_from_mask(0, key_slots, cached, mask),))
    if positions is None:
        positions = torch.arange(cached, cached + n)
    out = runner.forward(torch.tensor(tokens), positions, plan, cache, torch.arange(n))
    return out.logits


def new_cache(runner, num_blocks=64, block_size=4):
    s = runner.shape
    return PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, num_blocks, block_size, runner.dtype)


def _random_norms(model, seed: int = 2) -> None:
    """Every norm weight away from 1 (a tiny model's are all ones, where a forward that ignores them passes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_transformers(variant):
    model = build_tiny_model(variant)
    _random_norms(model)
    runner = LlamaRunner(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits[0].float()
    cache = new_cache(runner)
    cache.add(0)
    # prompt in three pieces: causal prefill, then a 1-token decode, then a causal chunk on a cached prefix
    head = run_engine_forward(runner, cache, 0, ids[0, :20].tolist())
    cache.commit({0: range(20)})
    one = run_engine_forward(runner, cache, 0, ids[0, 20:21].tolist())
    cache.commit({0: [0]})
    rest = run_engine_forward(runner, cache, 0, ids[0, 21:].tolist())
    got = torch.cat([head, one, rest])
    err = (got - ref).abs().max().item()
    print(f"{variant}: max abs logit diff vs transformers = {err:.3e}")  # shown with pytest -s
    assert err < 1e-4, f"{variant}: max abs logit diff {err}"


def test_logits_match_transformers_past_position_256_and_rope_tables_of_a_bfloat16_model():
    """Positions past 256 (where bfloat16 positions would round), and the RoPE table of bfloat16 weights beside the
    float32 inv_freq that from_pretrained(dtype=torch.bfloat16) leaves: transformers' (inv_freq rounded to the
    weights' dtype moved logits by ~0.02). The bfloat16 tables are compared, not logits: a fused projection may
    round otherwise than transformers' separate ones on another machine."""
    model = build_tiny_model("llama-gqa-tied")
    ids = torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(1))
    runner = LlamaRunner(model)
    with torch.no_grad():
        ref = model(ids).logits[0]
    cache = new_cache(runner, num_blocks=128)
    cache.add(0)
    err = (run_engine_forward(runner, cache, 0, ids[0].tolist()) - ref).abs().amax(-1)
    assert err.max() < 1e-4, (err[:256].max(), err[256:].max())
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    positions = torch.arange(300)
    with torch.no_grad():
        want = model.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), positions[None])
    got = LlamaRunner(model).rope(positions)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a[:, 0], b[0])


def test_a_feature_layer_past_the_last_is_the_residual_stream_before_the_final_norm():
    """Feature id num_layers (EAGLE-3's default for a target of six layers or fewer) is the stream entering the
    final norm, not the normed hidden state."""
    model = build_tiny_model("llama-gqa-tied")
    _random_norms(model)
    runner = LlamaRunner(model)
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    cache = new_cache(runner)
    cache.add(0)
    cache.reserve(0, 9)
    plan = AttentionPlan((seq_attention_from_mask(0, cache.slots(0, 0, 9), 0, None),))
    got = runner.forward(ids[0], torch.arange(9), plan, cache, torch.arange(9), feature_layers=(layers,))
    stream = out.hidden_states[layers][0]  # transformers' last hidden state is the normed one
    assert not torch.allclose(stream, model.model.norm(stream))
    torch.testing.assert_close(model.model.norm(got.features), out.hidden_states[-1][0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got.features, out.hidden_states[-1][0], atol=1e-3)


def test_tree_nodes_see_only_their_ancestors():
    """Logits of each tree node equal a plain forward of its root-to-node path."""
    model = build_tiny_model("llama-gqa-tied")
    runner = LlamaRunner(model)
    prefix = list(range(5, 18))
    tree_tokens = [7, 9, 3, 11, 4]  # root -> 0 -> {1 -> 3, 2}, root -> 4
    parents = [-1, 0, 0, 1, -1]
    cache = new_cache(runner)
    cache.add(0)
    run_engine_forward(runner, cache, 0, prefix[:-1])
    cache.commit({0: range(len(prefix) - 1)})
    n = len(tree_tokens) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:, 0] = True
    depth = [0] * n
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1] if p >= 0 else mask[0]
        mask[i + 1, i + 1] = True
        depth[i + 1] = depth[p + 1] + 1
    root_pos = len(prefix) - 1
    got = run_engine_forward(runner, cache, 0, [prefix[-1]] + tree_tokens, mask, torch.tensor(depth) + root_pos)
    for node in range(-1, len(tree_tokens)):
        path, j = [], node
        while j >= 0:
            path.append(tree_tokens[j])
            j = parents[j]
        seq = prefix + path[::-1]
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0, -1]
        err = (got[node + 1] - ref).abs().max().item()
        assert err < 1e-4, f"node {node}: {err}"


def test_wrong_mask_is_detected():
    """Negative control: a node that also sees its sibling must not match."""
    model = build_tiny_model("llama-gqa-tied")
    runner = LlamaRunner(model)
    prefix = list(range(5, 12))
    cache = new_cache(runner)
    cache.add(0)
    run_engine_forward(runner, cache, 0, prefix[:-1])
    cache.commit({0: range(len(prefix) - 1)})
    mask = torch.ones(3, 3, dtype=torch.bool).tril()  # node 1 sees sibling node 0: wrong for siblings
    pos = torch.tensor([0, 1, 1]) + len(prefix) - 1
    got = run_engine_forward(runner, cache, 0, [prefix[-1], 20, 21], mask, pos)
    with torch.no_grad():
        ref = model(torch.tensor([prefix + [21]])).logits[0, -1]
    assert (got[2] - ref).abs().max().item() > 1e-3


def test_unsupported_architecture_is_named():
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(UnsupportedModelError, match="llama"):
        LlamaRunner(transformers.GPT2LMHeadModel(cfg))
    # a Llama whose MLP activation is not SiLU: computed as SiLU, its logits moved by ~0.15
    with pytest.raises(UnsupportedModelError, match="gelu"):
        LlamaRunner(build_tiny_model(hidden_act="gelu"))


def test_runner_shares_weights():
    model = build_tiny_model("llama-mha-untied")
    runner = LlamaRunner(model)
    assert runner.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert runner.lm_head.data_ptr() == model.lm_head.weight.data_ptr()


def test_runner_follows_a_model_moved_after_it_was_built():
    """model.to(device) replaces buffers: a rotary inv_freq copied when the runner was built stayed on the old
    device, and every forward copied it over (a host-to-device copy inside CUDA-graph capture)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = build_tiny_model()
    runner = LlamaRunner(model)
    model.to("meta")  # a device other than the one the runner was built on, also without a GPU

    class CrossDeviceCopies(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and "device" in kwargs and args[0].device != kwargs["device"]:
                self.seen.append((args[0].device, kwargs["device"]))
            return func(*args, **kwargs)

    with CrossDeviceCopies() as mode:
        cos, sin = runner.rope(torch.arange(5, device="meta"))
    assert cos.device.type == sin.device.type == "meta"
    assert mode.seen == []


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_linear_policy_equals_f_linear_for_every_row_count(threads):
    """linear() picks a GEMM layout (and pads rows) by row count and thread count; every choice
    returns F.linear's result for exactly the rows it was given."""
    from specdec.models.llama import linear

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in range(1, 40):
            x = torch.randn(m, 40, generator=gen)
            for b in (None, bias):
                got = linear(x, weight, b)
                assert got.shape == (m, 48) and got.is_contiguous()
                torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)
