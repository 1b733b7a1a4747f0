"""EAGLE's catch-up (drafters/eagle_catch_up.py): the attention bias it passes the layer, and its outputs against the
layer run under the boolean mask it stands for."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from specdec.drafters.eagle_catch_up import CatchUpInputs, CatchUpRows, catch_up
from specdec.drafters.eagle_grow import BIAS_ALIGN
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from torch.nn import functional as F

from specdec.testing import build_tiny_model

B, L = 3, 5
COUNTS = [5, 2, 0]  # real rows per sequence: all, some (the rest padding), none (a padded sequence)


@pytest.mark.parametrize("P", [0, 9], ids=["no-cached-keys", "cached-keys"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_the_catch_up_reads_an_additive_bias_the_gpu_attention_takes_as_it_is(sdpa_masks, dtype, P):
    """The catch-up passes the attention an additive bias in the queries' dtype whose strides are multiples of
    BIAS_ALIGN (a boolean mask is converted, and a row stride off BIAS_ALIGN padded, by CUDA's memory-efficient
    attention: a few kernels inside the drafting's graph). It opens what the boolean mask did: a sequence's own
    cached keys and its rows up to each row's own; and the roots' features and new keys / values are bit for bit the
    layer's under that boolean mask. Sequence 1 has padded rows, sequence 2 none of its own (a padded sequence)."""
    model = build_tiny_model()
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config)).eval().to(dtype)
    c, gen = eagle.config, torch.Generator().manual_seed(1)
    counts = torch.tensor(COUNTS)
    rows = torch.arange(L)[None] < counts[:, None]
    x = CatchUpInputs(torch.randn(B, L, c.hidden_size, generator=gen).to(dtype),
                      torch.randint(0, c.vocab_size, (B, L), generator=gen) * rows,
                      (torch.arange(L)[None] + torch.tensor([[12], [3], [0]])) * rows, counts)
    real = torch.arange(P)[None] < torch.tensor([[9], [4], [0]])
    past_k, past_v = ((torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen).to(dtype) for _ in range(2))
                      if P else (None, None))
    embed = model.get_input_embeddings().weight.detach().to(dtype)
    seen = sdpa_masks
    with torch.inference_mode():
        h_root, new_k, new_v = catch_up(eagle, embed, x, past_k, past_v, real)
        ((q_dtype, mask),) = seen
        causal = torch.ones(L, L, dtype=torch.bool).tril().expand(B, L, L)
        boolean = torch.cat([real[:, None].expand(B, L, P), causal], dim=2)  # [B, L, P + L]
        out, k, v = eagle(F.embedding(x.tokens, embed), x.hidden, x.positions, boolean, past_k, past_v)
    assert mask.dtype == q_dtype == dtype and mask.stride(-1) == 1
    assert all(s % BIAS_ALIGN == 0 for s in mask.stride()[:-1]), mask.stride()
    assert mask.shape == (B, 1, L, P + L)
    assert torch.equal(mask[:, 0] == 0, boolean)
    assert set(mask.unique().tolist()) <= {0.0, float("-inf")}
    last = (counts - 1).clamp(min=0)
    assert torch.equal(h_root, out[torch.arange(B), last]) and torch.equal(new_k, k) and torch.equal(new_v, v)


@pytest.mark.parametrize("scaling", [None, "llama3", "yarn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_rope_tables_rows_are_the_layers_rope_bit_for_bit(dtype, scaling):
    """A CUDA-graph bucket's RoPE table (EagleModel.rope_table: rope() of positions 0 .. N - 1, made once) gives the
    rows rope() computes for any positions, bit for bit, plain and scaled (yarn scales cos / sin): a catch-up
    gathering its rows from it is the one computing them, features and keys / values."""
    params = {"llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
              "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}.get(scaling)
    model = build_tiny_model()
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, rope_scaling=params)).eval().to(dtype)
    table = eagle.rope_table(300, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    for shape in ((1, 1), (3, 5), (8, 7), (2, 33)):
        positions = torch.randint(0, 300, shape, generator=gen)
        for row, computed in zip(table[:, positions], eagle.rope(positions, dtype), strict=True):
            assert torch.equal(row.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               computed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    c, counts = eagle.config, torch.tensor(COUNTS)
    rows = torch.arange(L)[None] < counts[:, None]
    x = CatchUpInputs(torch.randn(B, L, c.hidden_size, generator=gen).to(dtype),
                      torch.randint(0, c.vocab_size, (B, L), generator=gen) * rows,
                      (torch.arange(L)[None] + torch.tensor([[250], [3], [0]])) * rows, counts)
    real = torch.arange(4)[None] < torch.tensor([[4], [2], [0]])
    past_k, past_v = (torch.randn(B, c.num_kv_heads, 4, c.head_dim, generator=gen).to(dtype) for _ in range(2))
    embed = model.get_input_embeddings().weight.detach().to(dtype)
    with torch.inference_mode():
        computed = catch_up(eagle, embed, x, past_k, past_v, real)
        gathered = catch_up(eagle, embed, dataclasses.replace(x, rope_table=table), past_k, past_v, real)
    assert all(torch.equal(a, b) for a, b in zip(computed, gathered, strict=True))


def test_the_drafters_catch_up_rows_pair_features_as_training_does():
    """Training pairs the feature at position j with the token at j + 1, read at position j + 1 (query j of
    train/eagle_loss.py), and the tree's root is the last committed token: rows shifted by one token or position,
    or a root one position on, passed every test and only lowered the acceptance of a trained layer."""
    from types import SimpleNamespace

    from specdec.drafters.eagle import EagleDrafter

    hidden = 8
    ids = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 6]]
    counts = [5, 2]  # a first call (every row before the root), and a later one (the last two committed)
    views = [SimpleNamespace(seq_id=b, token_ids=t, noise_key=b, new_hidden=torch.randn(k, hidden))
             for b, (t, k) in enumerate(zip(ids, counts, strict=True))]
    drafter = SimpleNamespace(model=SimpleNamespace(eagle3=False), _padded_hidden=EagleDrafter._padded_hidden,
                              target=SimpleNamespace(runner=SimpleNamespace(dtype=torch.float32, device="cpu")),
                              kv=SimpleNamespace(gather=lambda ids: (None, None), lengths=lambda ids: [0] * len(ids)))
    rows = EagleDrafter._catch_up_rows(drafter, views)
    assert rows.tokens == [[9, 2, 7, 1, 3], [8, 6, 0, 0, 0]]
    assert rows.positions == [[1, 2, 3, 4, 5], [2, 3, 0, 0, 0]]
    assert rows.counts == counts and torch.equal(rows.hidden[1, :2], views[1].new_hidden)
    assert list(EagleDrafter._cached(drafter, views).root_positions) == [5, 3]


def test_uploaded_catch_up_rows_keep_tokens_positions_and_counts_apart():
    rows = CatchUpRows(torch.zeros(2, 3, 4), [[9, 2, 7], [8, 6, 0]], [[1, 2, 3], [4, 5, 0]], [3, 2])
    # packed to width 4: tokens + 1 pad, positions + 1 pad, count
    assert rows.packed(4) == [[9, 2, 7, 0, 1, 2, 3, 0, 3], [8, 6, 0, 0, 4, 5, 0, 0, 2]]
    x = CatchUpInputs.upload(rows)
    assert x.tokens.tolist() == [[9, 2, 7], [8, 6, 0]]
    assert x.positions.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert x.counts.tolist() == [3, 2] and x.hidden is rows.hidden


def test_a_long_prompts_catch_up_runs_in_blocks_whose_bias_grows_linearly_with_the_context(sdpa_masks, monkeypatch):
    """A prompt's first catch-up ran all its rows in one forward, under a [B, rows, rows] bias: 1 GiB in fp32 at a
    16k-token prompt, for a drafter whose keys take ~1/1000 of that. The rows run CATCH_UP_ROWS at a time (a shorter
    prompt drops out of the blocks past its rows), each block over the keys of the ones before it, and the roots'
    features and the keys / values held are the one forward's."""
    import types
    from types import SimpleNamespace

    from specdec.drafters import eagle as eagle_module
    from specdec.drafters.eagle import CATCH_UP_ROWS, EagleDrafter
    from specdec.drafters.eagle_kv import EagleKV

    model = build_tiny_model(max_position_embeddings=4096)
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config)).eval()
    c, gen = eagle.config, torch.Generator().manual_seed(3)
    lengths = [2 * CATCH_UP_ROWS + 77, CATCH_UP_ROWS + 30]  # 3 blocks, then 2 (the last one shorter)
    views = [SimpleNamespace(seq_id=b, token_ids=torch.randint(1, c.vocab_size, (n,), generator=gen).tolist(),
                             noise_key=b, new_hidden=torch.randn(n - 1, c.hidden_size, generator=gen))
             for b, n in enumerate(lengths)]

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        runner = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"),
                                 embed=model.get_input_embeddings().weight.detach())
        drafter = SimpleNamespace(model=eagle, kv=EagleKV(c.num_kv_heads, c.head_dim, torch.float32, runner.device),
                                  target=SimpleNamespace(runner=runner), grower=SimpleNamespace(fused=None),
                                  _padded_hidden=EagleDrafter._padded_hidden)
        for name in ("_catch_up_rows", "_cached", "_catch_up_block"):
            if hasattr(EagleDrafter, name):
                setattr(drafter, name, types.MethodType(getattr(EagleDrafter, name), drafter))
        with torch.inference_mode():
            h_root = EagleDrafter._run_catch_up(drafter, views)
        assert drafter.kv.lengths([0, 1]) == [n - 1 for n in lengths]
        return h_root, *drafter.kv.gather([0, 1])

    blocks = run()
    biases = [mask for _, mask in sdpa_masks]
    assert len(biases) == 3 and all(mask.shape[-2] <= CATCH_UP_ROWS for mask in biases), \
        [tuple(m.shape) for m in biases]
    assert biases[-1].shape[0] == 1  # the shorter prompt is done after two blocks
    monkeypatch.setattr(eagle_module, "CATCH_UP_ROWS", 10**6)
    whole = run()
    assert sdpa_masks[-1][1].shape[-2] == lengths[0] - 1  # one forward, as before
    for a, b in zip(blocks, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
