"""The bit-exact mode's Triton kernels (specdec/kernels/invariant_ops.py): every row's result is bitwise the same
alone or among 1-64 rows, and close to the PyTorch reference; a tiny model on the Triton backend is row-invariant.

Interpreter on CPU (TRITON_INTERPRET=1), natively when a GPU is present.
"""
from __future__ import annotations

import pytest
from specdec.kernels.testing import kernel_device

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from specdec.kernels import invariant_ops as kernels  # noqa: E402

from specdec.models import invariance_check as ic  # noqa: E402
from specdec.models.llama import LlamaRunner  # noqa: E402
from specdec.testing import build_tiny_model  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
ROW_COUNTS = [2, 17, 40, 64]


@pytest.fixture(autouse=True)
def _dot_by_rows():
    """In the interpreter, tl.dot row by row, as a GPU tile computes (kernels.testing.interpreter_dot_by_rows): numpy's
    matmul on some CPUs sums a tile's last rows in another order."""
    if DEVICE != "cpu":
        yield
        return
    from specdec.kernels.testing import interpreter_dot_by_rows

    with interpreter_dot_by_rows():
        yield


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_rows_do_not_depend_on_the_row_count(dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(72, 48, generator=gen).to(dtype).to(DEVICE)  # N, K not multiples of the tiles
    bias = torch.randn(72, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(64, 48, generator=gen).to(dtype).to(DEVICE)
    picked = [0, 1, 15, 16, 39, 63]  # first and last rows of tiles, and of forwards of each row count
    alone = {i: kernels.linear(x[i : i + 1], w, bias)[0] for i in picked}
    for m in ROW_COUNTS:
        out = kernels.linear(x[:m], w, bias)
        assert all(torch.equal(out[i], alone[i]) for i in picked if i < m), m
    alone = torch.stack(list(alone.values()))
    x = x[picked]
    want = F.linear(x.float(), w.float(), bias.float())  # the picked rows
    assert ((alone.float() - want).abs() / want.abs().clamp_min(1)).max() <= TOL[dtype]


# the interpreter's bfloat16 conversions do not round to nearest even as torch's do: bfloat16 on a GPU only
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []), ids=str)
def test_linear_rounds_the_product_before_adding_the_bias(dtype):
    """As a model's own linear layer does in half precision: the product rounded to the dtype, then the bias added
    and rounded again. Adding the bias to the float32 sum first changed a quarter of the float16 values by an ulp,
    and the row-invariance tests above, which compare the kernel with itself, passed."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(72, 48, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(72, generator=gen).to(dtype).to(DEVICE)
    x = torch.randn(16, 48, generator=gen).to(dtype).to(DEVICE)
    product = kernels.linear(x, w)  # the same sums, rounded to the dtype
    assert torch.equal(kernels.linear(x, w, bias), (product.float() + bias.float()).to(dtype))


def _attention_case(dtype, rows: int, gen: torch.Generator):
    heads, kv_heads, dim, slots = 4, 2, 16, 200
    q = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    k = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(slots, kv_heads, dim, generator=gen).to(dtype)
    lens = torch.randint(1, 70, (rows,), generator=gen)
    table = torch.stack([torch.randperm(slots, generator=gen)[:70] for _ in range(rows)])
    return q, k, v, table, lens


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_rows_do_not_depend_on_the_other_rows(dtype):
    gen = torch.Generator().manual_seed(1)
    q, k, v, table, lens = (t.to(DEVICE) for t in _attention_case(dtype, 10, gen))
    scale = 0.25
    together = kernels.attention(q, k, v, table, lens, scale)
    for i in (0, 9):
        alone = kernels.attention(q[i : i + 1], k, v, table[i : i + 1, : int(lens[i])], lens[i : i + 1], scale)
        assert torch.equal(together[i], alone[0]), i
        # the reference: the row's keys in order, float32 softmax attention
        ks, vs = k[table[i, : int(lens[i])]].float(), v[table[i, : int(lens[i])]].float()
        ks, vs = ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1)  # GQA: 4 query heads on 2 KV heads
        p = torch.softmax(torch.einsum("hd,khd->hk", q[i].float(), ks) * scale, -1)
        want = torch.einsum("hk,khd->hd", p, vs)
        assert (together[i].float() - want).abs().max() <= TOL[dtype] * 4


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_tiny_model_on_the_triton_backend_is_row_invariant(dtype):
    model = build_tiny_model(vocab_size=32, num_hidden_layers=1).to(dtype).to(DEVICE)
    runner = LlamaRunner(model, backend="triton").invariant_mode(True)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(32, (n,), generator=gen).tolist() for n in (5, 3)]
    trees = [ic.random_tree(n, 32, gen) for n in (4, 2)]
    batched, alone = ic.alone_logits(runner, prompts, trees)
    assert len(batched) == len(prompts)  # a row per sequence: zip would stop at a shorter list
    for b, a in zip(batched, alone, strict=True):
        assert torch.equal(b, a)
    reference = ic.batched_tree_logits(runner.invariant_mode(False), prompts, trees)  # the default kernels
    for b, r in zip(batched, reference, strict=True):
        assert (b - r).abs().max() <= 0.05 * r.abs().max()


def test_the_mode_on_the_interpreter_says_its_rows_rest_on_numpy(monkeypatch, caplog):
    """invariant=True on the interpreted kernels was accepted without a word, though numpy's matmul (the
    interpreter's tl.dot) may sum a tile's rows in different orders on this CPU; once a process, and never on a
    GPU or on the reference backend."""
    import logging

    from specdec.models import llama

    monkeypatch.setattr(llama, "_INTERPRETED_INVARIANCE_WARNED", False)
    model = build_tiny_model(vocab_size=32, num_hidden_layers=1).to(DEVICE)
    with caplog.at_level(logging.WARNING, logger="specdec.models.llama"):
        LlamaRunner(model, backend="reference").invariant_mode(True)
        LlamaRunner(model, backend="triton").invariant_mode(True)
        LlamaRunner(model, backend="triton", invariant=True)
    said = [r.getMessage() for r in caplog.records if r.name == "specdec.models.llama"]
    assert len(said) == (0 if DEVICE == "cuda" else 1), said
    assert DEVICE == "cuda" or "invariant=True on the Triton interpreter" in said[0]
