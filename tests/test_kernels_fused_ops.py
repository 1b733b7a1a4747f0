"""Fused norm / RoPE / SiLU kernels vs the PyTorch reference ops of specdec/models/llama.py.

Interpreter on CPU (TRITON_INTERPRET=1), natively when a GPU is present.
"""
from __future__ import annotations

import pytest
from specdec.kernels.testing import kernel_device

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")

import torch  # noqa: E402
from specdec.kernels.dispatch import REFERENCE  # noqa: E402
from specdec.kernels.fused_ops import add_rms_norm, rope_, silu_mul  # noqa: E402

from specdec.models import llama  # noqa: E402

# fp32: summation order only; half precision: the kernels round where the reference rounds, so at most
# one unit in the last place (the norm's fp32 statistics may differ in the last bit and flip a rounding)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}
# bf16 only on a GPU: the interpreter's fp32 -> bf16 cast truncates (half the values of a random
# tensor come out one unit below torch's round-to-nearest-even); its fp16 cast rounds like torch
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)).max().item()
    assert err <= TOL[dtype], f"{dtype}: relative error {err:.3g}"
    if dtype != torch.float32:  # same rounding steps: nearly every value is bit-identical (~1e-4 differ
        # by a last-bit flip of the fp32 intermediate); skipping one rounding step changes ~25% of them
        differ = (got != want).float().mean().item()
        assert differ <= 0.01, f"{dtype}: {differ:.1%} of the values differ from the reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 100])
def test_add_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    h = (torch.randn(7, hidden, generator=gen) * 3).to(DEVICE, dtype)
    delta = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(DEVICE, dtype)
    want_h, want = llama.add_rms_norm(h, delta, weight, 1e-5, REFERENCE)
    got_h, got = add_rms_norm(h.clone(), delta, weight, 1e-5)
    close(got_h, want_h, dtype)
    close(got, want, dtype)
    _, no_delta = add_rms_norm(h.clone(), None, weight, 1e-5)  # the first layer's norm: no residual yet
    close(no_delta, llama.rms_norm(h, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(9, 64), (3, 64), (4, 128), (5, 24)])
def test_rope_in_place(dtype, heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    x = torch.randn(6, heads, head_dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 5, 17, 300, 4095])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype)[:, None, :], emb.sin().to(DEVICE, dtype)[:, None, :]
    want = llama.apply_rope(x, cos, sin, REFERENCE)
    got = x.clone()
    assert rope_(got, cos, sin) is got
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 24), (32, 8, 128)])
def test_rope_write_is_rope_then_the_kv_store(dtype, q_heads, kv_heads, head_dim):
    """One launch over a fused QKV product's rows (q, k, v side by side): q and k rotated in place and the rotated k
    and v in the cache's slots, bitwise what rope_ and then write_kv give; other slots and layers untouched."""
    from specdec.kernels.fused_ops import rope_write_
    from specdec.kernels.kv_write import write_kv

    gen = torch.Generator().manual_seed(q_heads * head_dim + kv_heads)
    T, width = 5, q_heads + 2 * kv_heads
    out = torch.randn(T, width * head_dim, generator=gen).to(DEVICE, dtype)  # the product's rows
    positions = torch.tensor([3, 4, 9, 100, 2047]).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype)[:, None, :], emb.sin().to(DEVICE, dtype)[:, None, :]
    kv = torch.randn(2, 2, 20, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([7, 0, 19, 3, 12], device=DEVICE)

    def split(rows):
        qk = rows[:, : (q_heads + kv_heads) * head_dim].view(T, q_heads + kv_heads, head_dim)
        return qk, rows[:, (q_heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim)

    want_rows, want_kv = out.clone(), kv.clone()
    qk, v = split(want_rows)
    rope_(qk, cos, sin)
    write_kv(want_kv, 1, slots, qk[:, q_heads:], v)
    got_rows, got_kv = out.clone(), kv.clone()
    qk, v = split(got_rows)
    assert rope_write_(qk, v, cos, sin, got_kv, 1, slots, q_heads) is qk
    assert torch.equal(got_rows, want_rows) and torch.equal(got_kv, want_kv)
    with pytest.raises(ValueError, match="k heads"):
        rope_write_(qk, v[:, :1], cos, sin, got_kv, 1, slots, q_heads)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 16)])
def test_rope_write_norms_each_head_first_as_qwen3(dtype, q_heads, kv_heads, head_dim):
    """With ``norms``, the same launch RMS-norms each q head with the q weight and each k head with the k weight
    (Qwen3's q_norm / k_norm) before the rotation: the reference's rms_norm, then RoPE, then the KV store."""
    from specdec.kernels.fused_ops import rope_write_
    from specdec.kernels.kv_write import write_kv

    gen = torch.Generator().manual_seed(q_heads + head_dim)
    T, width = 4, q_heads + 2 * kv_heads
    rows = (torch.randn(T, width * head_dim, generator=gen) * 3).to(DEVICE, dtype)
    q_w = (1 + torch.randn(head_dim, generator=gen) / 4).to(DEVICE, dtype)
    k_w = (1 + torch.randn(head_dim, generator=gen) / 4).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 77, 1000]).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype)[:, None, :], emb.sin().to(DEVICE, dtype)[:, None, :]
    kv = torch.randn(2, 2, 8, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([5, 0, 7, 2], device=DEVICE)
    qk_width = (q_heads + kv_heads) * head_dim

    ref = rows.clone()
    q = llama.rms_norm(ref[:, : q_heads * head_dim].view(T, q_heads, head_dim), q_w, 1e-6)
    k = llama.rms_norm(ref[:, q_heads * head_dim : qk_width].view(T, kv_heads, head_dim), k_w, 1e-5)
    q, k = llama.apply_rope(q, cos, sin, REFERENCE), llama.apply_rope(k, cos, sin, REFERENCE)
    v = ref[:, qk_width:].view(T, kv_heads, head_dim)
    want_kv = kv.clone()
    write_kv(want_kv, 1, slots, k, v)

    got_kv = kv.clone()
    qk = rows[:, :qk_width].view(T, q_heads + kv_heads, head_dim)
    rope_write_(qk, rows[:, qk_width:].view(T, kv_heads, head_dim), cos, sin, got_kv, 1, slots, q_heads,
                (q_w, k_w, 1e-6, 1e-5))
    close(qk, torch.cat([q, k], 1), dtype)
    close(got_kv, want_kv, dtype)
    assert torch.equal(got_kv[0], kv[0])  # other layers untouched
    with pytest.raises(ValueError, match="weights must be"):
        rope_write_(qk, rows[:, qk_width:].view(T, kv_heads, head_dim), cos, sin, got_kv, 1, slots, q_heads,
                    (q_w[:-1], k_w, 1e-6, 1e-5))


def test_rope_write_norms_k_heads_with_their_own_eps_and_stores_an_unpacked_v():
    """Small activations, where the eps decides the norm: the k heads are normed with k's eps (1e-2), not q's
    (1e-6); and a v whose heads are not packed (a [heads, tokens, dim] tensor seen as [tokens, heads, dim]) is
    stored as its values, not read as if packed. Either mistake passed the tests above."""
    from specdec.kernels.fused_ops import rope_write_
    from specdec.kernels.kv_write import write_kv

    gen = torch.Generator().manual_seed(5)
    T, q_heads, kv_heads, head_dim = 3, 2, 2, 8
    qk_rows = (torch.randn(T, q_heads + kv_heads, head_dim, generator=gen) * 1e-3).to(DEVICE)
    v = torch.randn(kv_heads, T, head_dim, generator=gen).to(DEVICE).transpose(0, 1)  # head stride T * head_dim
    ones = torch.ones(head_dim, device=DEVICE)
    positions = torch.tensor([0, 1, 2]).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    emb = torch.cat([positions[:, None] * inv_freq[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(DEVICE)[:, None, :], emb.sin().to(DEVICE)[:, None, :]
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    q = llama.rms_norm(qk_rows[:, :q_heads], ones, 1e-6)
    k = llama.rms_norm(qk_rows[:, q_heads:], ones, 1e-2)
    q, k = llama.apply_rope(q, cos, sin, REFERENCE), llama.apply_rope(k, cos, sin, REFERENCE)
    want_kv = torch.zeros(1, 2, 6, kv_heads, head_dim, device=DEVICE)
    write_kv(want_kv, 0, slots, k, v.contiguous())
    got_kv, qk = torch.zeros_like(want_kv), qk_rows.clone()
    rope_write_(qk, v, cos, sin, got_kv, 0, slots, q_heads, (ones, ones, 1e-6, 1e-2))
    close(qk, torch.cat([q, k], 1), torch.float32)
    close(got_kv, want_kv, torch.float32)
    assert torch.equal(got_kv[0, 1, slots], v)


def test_a_qwen3_model_on_the_triton_backend_gives_the_reference_logprobs(monkeypatch):
    """A packed Qwen3 layer (q_norm / k_norm) norms, rotates and stores q / k in the one fused launch on the Triton
    backend: its decoding's log-probabilities are the reference backend's, in float32."""
    from specdec.generate import generate
    from specdec.models.fused_projections import pack_projections
    from specdec.testing import build_tiny_model, ragged_prompts

    model = build_tiny_model("qwen3-qknorm", 64).to(DEVICE)
    assert pack_projections(model) > 0
    calls = []
    real = llama.rms_norm
    monkeypatch.setattr(llama, "rms_norm", lambda *a: calls.append(a[0].dim()) or real(*a))
    out = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("SPECDEC_ATTENTION", backend)  # read when the runners and caches are built
        calls.clear()
        out[backend] = generate(model, ragged_prompts(2, 64, seed=4), max_new_tokens=6, return_dict=True,
                                output_logprobs=True, cuda_graphs=False)
        out[backend + " per-head norms"] = sum(d == 3 for d in calls)  # rms_norm over [T, heads, head_dim]
    assert out["reference per-head norms"] > 0 and out["triton per-head norms"] == 0
    assert out["triton"].new_tokens == out["reference"].new_tokens
    got, want = (torch.tensor(sum(out[b].logprobs, [])) for b in ("triton", "reference"))
    assert torch.allclose(got, want, atol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
@pytest.mark.parametrize("arch,fields", [("eagle1", {}), ("eagle1", dict(norms=False)),
                                         ("eagle3", dict(norm_before_residual=True)), ("eagle3", {}), ("mtp", {})])
def test_an_eagle_layer_on_the_fused_ops_gives_the_pytorch_forward(arch, fields, packed, gpu_products):
    """EAGLE's drafting layer (EAGLE-1, -3 and MTP) with the target's fused ops, as the drafter runs it on the
    Triton backend: its norms (each with its residual add), RoPE and SiLU-mul each one launch, and with its weights
    packed as on CUDA one QKV and one gate/up product, q and k rotated in one launch: the features, keys, values and
    draft logits of the PyTorch forward (float32, a past of cached keys and a tree mask), with RoPE tables given or
    computed, and with the past in a buffer the call writes its keys and values into (``into``). No input is
    written, an expanded one (as the growth's first level passes its roots' features) included."""
    import specdec.kernels.fused_ops as fused
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    from specdec.errors import InputError
    from specdec.launches import Launches
    from specdec.models.fused_projections import pack_layers
    from specdec.testing import build_tiny_model

    target = build_tiny_model("llama-gqa-tied", 64)
    torch.manual_seed(0)
    model = EagleModel(EagleConfig.for_target(target.config, arch=arch, **fields)).to(DEVICE).eval()
    for p in model.parameters():  # norms away from 1: a wrong weight shows
        torch.nn.init.normal_(p, 0.5 if p.dim() == 1 else 0.0, 0.2)
    if packed:  # as specdec lays out the EAGLE layers it loads or builds on CUDA
        assert pack_layers(model.layers) == 2
    proj = model.projections()
    assert (proj.qkv is not None, proj.gate_up is not None) == (packed, packed)
    c, gen = model.config, torch.Generator().manual_seed(1)
    B, L, P = 2, 3, 5
    embeds = torch.randn(B, L, c.hidden_size, generator=gen).to(DEVICE)
    features = model.fuse(torch.randn(B, L, c.hidden_size * (c.num_features if arch == "eagle3" else 1),
                                      generator=gen).to(DEVICE))
    positions = torch.tensor([[5, 6, 7], [2, 3, 4]], device=DEVICE)
    mask = torch.ones(B, L, P + L, dtype=torch.bool, device=DEVICE).tril(P)
    past_k = torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen).to(DEVICE)
    past_v = torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen).to(DEVICE)
    args = (embeds, features, positions, mask, past_k, past_v)
    head = target.get_output_embeddings().weight.detach().to(DEVICE)
    inputs = [t.clone() for t in args]
    with torch.inference_mode():
        want = model(*args)
        want = (*want, model.logits(want[0], head))
        with Launches() as launches:
            got = model(*args, fused, model.rope(positions, torch.float32))
            got = (*got, model.logits(got[0], head, fused))
    for name, a, b in zip(("features", "keys", "values", "logits"), got, want, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (name, (a - b).abs().max().item())
    assert all(torch.equal(a, b) for a, b in zip(args, inputs, strict=True))  # nothing written into caller's tensors
    expanded = (embeds, features[:, :1].expand(B, L, -1), *args[2:])
    with torch.inference_mode():
        want_expanded, got_expanded = model(*expanded), model(*expanded, fused)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got_expanded, want_expanded, strict=True))
    assert torch.equal(features, inputs[1])
    # no PyTorch norm, rotation, SiLU or residual add left; with packed weights, one product for q, k and v, one for
    # gate and up, and one RoPE launch
    assert not {"rsqrt", "neg", "silu", "add"} & set(launches.ops), launches.ops
    products = (arch != "eagle3") + 2 + (2 if packed else 5) + 1  # fc (EAGLE-3's ran before), o, down; q/k/v,
    # gate/up; the LM head
    assert launches.ops["linear"] == products, launches.ops
    assert launches.ops["triton:_rope_kernel"] == (1 if packed else 2), launches.ops
    # into= (the growth's buffer of keys / values): the same results, this call's keys and values written after the
    # past, the columns after them neither written nor read (NaN there would reach the features)
    bufs = [torch.full((B, c.num_kv_heads, P + L + 2, c.head_dim), float("nan"), device=DEVICE) for _ in range(2)]
    for buf, past in zip(bufs, (past_k, past_v), strict=True):
        buf[:, :, :P] = past
    with torch.inference_mode():
        into = model(*args[:4], fused=fused, rope=model.rope(positions, torch.float32), into=(*bufs, P))
    assert all(torch.equal(a, b) for a, b in zip(into, got[:3], strict=True))
    assert torch.equal(bufs[0][:, :, P : P + L], got[1]) and torch.equal(bufs[1][:, :, P : P + L], got[2])
    assert bufs[0][:, :, P + L :].isnan().all() and bufs[1][:, :, P + L :].isnan().all()
    # buffers of query heads (as the growth keeps them): each key written once per head of its group
    groups = c.num_heads // c.num_kv_heads
    bufs = [torch.full((B, c.num_heads, P + L + 2, c.head_dim), float("nan"), device=DEVICE) for _ in range(2)]
    for buf, past in zip(bufs, (past_k, past_v), strict=True):
        buf[:, :, :P] = past.repeat_interleave(groups, dim=1)
    with torch.inference_mode():
        into = model(*args[:4], fused=fused, rope=model.rope(positions, torch.float32), into=(*bufs, P))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(into, got[:3], strict=True))
    for buf, new in zip(bufs, into[1:], strict=True):
        assert torch.equal(buf[:, :, P : P + L], new.repeat_interleave(groups, dim=1))
        assert buf[:, :, P + L :].isnan().all()
    with pytest.raises(InputError, match="no gradients"):  # the kernels have no backward: never in training
        model(*args, fused)
    if packed:  # a weight given new storage ends its block's product, found again; a cast drops the products found
        attn = model.layers[0].self_attn
        attn.k_proj.weight.data = torch.randn_like(attn.k_proj.weight)
        assert model.projections().qkv is None and model.projections().gate_up is not None
        model.to(torch.float64)
        assert "_projections" not in model.__dict__


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 1536, 3000])
def test_silu_mul(dtype, width):
    gen = torch.Generator().manual_seed(width)
    gate = (torch.randn(5, width, generator=gen) * 4).to(DEVICE, dtype)
    up = torch.randn(5, width, generator=gen).to(DEVICE, dtype)
    close(silu_mul(gate, up), llama.silu_mul(gate, up, REFERENCE), dtype)


def test_a_broken_rounding_is_caught():
    """The tolerance is tight enough to see a kernel that skips the reference's intermediate rounding."""
    gen = torch.Generator().manual_seed(0)
    gate = (torch.randn(64, 512, generator=gen) * 4).to(DEVICE, HALF)
    up = (torch.randn(64, 512, generator=gen) * 4).to(DEVICE, HALF)
    unrounded = (torch.nn.functional.silu(gate.float()) * up.float()).to(HALF)
    with pytest.raises(AssertionError):
        close(unrounded, llama.silu_mul(gate, up, REFERENCE), HALF)
    close(silu_mul(gate, up), llama.silu_mul(gate, up, REFERENCE), HALF)


def test_bad_shapes_are_named():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, torch.zeros(4, 9, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        add_rms_norm(x, None, torch.ones(9, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_(torch.zeros(2, 3, 5, device=DEVICE), torch.zeros(2, 1, 5, device=DEVICE), torch.zeros(2, 1, 5,
                                                                                                     device=DEVICE))
    with pytest.raises(ValueError, match="differ"):
        silu_mul(x, torch.zeros(4, 7, device=DEVICE))


def test_rows_per_program_is_one_on_a_gpu_and_a_block_in_the_interpreter():
    from specdec.kernels.launch_rows import INTERPRETER_ROWS, MAX_BLOCK_NUMEL, block_rows, rows_per_program

    assert [rows_per_program(torch.device("cuda"), n) for n in (1, 7, 300)] == [1, 1, 1]
    assert [rows_per_program(torch.device("cpu"), n) for n in (1, 2, 7, 64, 300)] == [1, 2, 8, 64, INTERPRETER_ROWS]
    # wide rows: fewer rows a block, ROWS x the row's elements within Triton's largest tensor; one row at least
    cpu = torch.device("cpu")
    assert [block_rows(cpu, 300, n) for n in (1024, 4096, 8192, MAX_BLOCK_NUMEL, 2 * MAX_BLOCK_NUMEL)] == [
        INTERPRETER_ROWS, INTERPRETER_ROWS, MAX_BLOCK_NUMEL // 8192, 1, 1]
    assert block_rows(cpu, 7, 8192) == 8 and block_rows(torch.device("cuda"), 300, 8192) == 1


def test_wide_rows_past_a_block_of_rows_match_the_reference():
    """129 token rows (a prefill) of rows too wide for a full interpreter block: a hidden size of 5120 for the norm,
    64 q + 8 kv heads of 128 for RoPE (with the KV store, and alone); each as the PyTorch reference (float32)."""
    from specdec.kernels.fused_ops import rope_write_

    gen = torch.Generator().manual_seed(5)
    T, hidden, q_heads, kv_heads, D = 129, 5120, 64, 8, 128
    h = torch.randn(T, hidden, generator=gen).to(DEVICE)
    delta = torch.randn(T, hidden, generator=gen).to(DEVICE)
    weight = (1 + torch.randn(hidden, generator=gen) / 4).to(DEVICE)
    want_h, want = llama.add_rms_norm(h, delta, weight, 1e-5, REFERENCE)
    got_h, got = add_rms_norm(h.clone(), delta, weight, 1e-5)
    close(got_h, want_h, torch.float32)
    close(got, want, torch.float32)

    qk = torch.randn(T, q_heads + kv_heads, D, generator=gen).to(DEVICE)
    v = torch.randn(T, kv_heads, D, generator=gen).to(DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([torch.arange(T).float()[:, None] * inv_freq[None]] * 2, dim=-1)
    cos, sin = emb.cos().to(DEVICE)[:, None, :], emb.sin().to(DEVICE)[:, None, :]
    slots = torch.randperm(T + 3, generator=gen)[:T].to(DEVICE)
    kv = torch.zeros(1, 2, T + 3, kv_heads, D, device=DEVICE)
    want_qk = llama.apply_rope(qk, cos, sin, REFERENCE)
    want_kv = kv.clone()
    want_kv[0, 0, slots], want_kv[0, 1, slots] = want_qk[:, q_heads:], v
    got_qk = rope_write_(qk.clone(), v, cos, sin, kv, 0, slots, q_heads)
    close(got_qk, want_qk, torch.float32)
    close(kv, want_kv, torch.float32)
    close(rope_(qk.clone(), cos, sin), want_qk, torch.float32)


@pytest.mark.skipif(DEVICE == "cuda", reason="blocks of rows are the interpreter's; a GPU launches a row a program")
@pytest.mark.parametrize("rows", [1, 2])
def test_a_block_of_rows_gives_each_row_the_bits_of_its_own_program(rows, monkeypatch):
    """Every row-wise kernel, 7 token rows: launched as the interpreter does (one program) and as a GPU does (a row
    a program; ``rows=2``: a last block half past the end) store the same bits, in the cache's slots too."""
    from specdec.kernels import launch_rows
    from specdec.kernels.fused_ops import rope_write_
    from specdec.kernels.kv_write import write_kv

    gen = torch.Generator().manual_seed(rows)
    T, q_heads, kv_heads, D, hidden = 7, 4, 2, 16, 100

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, HALF)

    h, delta, weight, gate, up = randn(T, hidden), randn(T, hidden), randn(hidden), randn(T, 300), randn(T, 300)
    qk, v, cos, sin = randn(T, q_heads + kv_heads, D), randn(T, kv_heads, D), randn(T, 1, D), randn(T, 1, D)
    norms = (randn(D), randn(D), 1e-6, 1e-5)
    slots = torch.randperm(32, generator=gen)[:T].to(DEVICE)

    def run() -> list[torch.Tensor]:
        kv = [torch.zeros(2, 2, 32, kv_heads, D, device=DEVICE, dtype=HALF) for _ in range(3)]
        write_kv(kv[0], 1, slots, qk[:, :kv_heads], v)
        return [*add_rms_norm(h.clone(), delta, weight, 1e-5), add_rms_norm(h.clone(), None, weight, 1e-5)[1],
                rope_(qk.clone(), cos, sin), rope_write_(qk.clone(), v, cos, sin, kv[1], 1, slots, q_heads),
                rope_write_(qk.clone(), v, cos, sin, kv[2], 1, slots, q_heads, norms), silu_mul(gate, up), *kv]

    assert launch_rows.rows_per_program(qk.device, T) == 8  # the interpreter's block: the 7 rows in one program
    block = run()
    monkeypatch.setattr(launch_rows, "rows_per_program", lambda device, n: rows)
    for i, (got, want) in enumerate(zip(run(), block, strict=True)):
        assert torch.equal(got, want), f"output {i}: a block of rows gave other bits than {rows} row(s) a program"
    assert all(t.abs().sum() > 0 for t in block[-3:])  # every kernel that writes the cache wrote it
