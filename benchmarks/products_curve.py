"""The target's linear products alone, timed over n rows: the share of the verify-cost curve c(n) they make, and how
far one row's products are from reading their weights once.

    ms = products_ms(runner, sizes, repeats)     # {n: ms of one forward's products over n rows}
    with blas_library("cublaslt"): ...           # the same under another cuBLAS backend (CUDA only)

The products are those a forward of n query tokens runs, in its order and with its weights: per layer the QKV
product (fused where the runner fuses it, else three), the output projection, gate-up (fused, else two) and down,
then the LM head over every row (a verify scores every node), each through the runner's own ``_linear``, over random
inputs of the widths they read. On CUDA each n is one CUDA graph of the whole chain, as a graphed verify replays its
products, timed between events (median of ``repeats`` replays, the sizes interleaved round by round); on the CPU
timed eagerly. Attention, norms and element-wise kernels are left out on purpose: ``c(n) - p(n)`` is theirs.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch


def products(runner) -> list[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(input, weight, bias) of every product of one forward, in order; input: "hidden" (the hidden size),
    "heads" (the attention output's width) or "inner" (the MLP's inner width)."""
    fused = runner.fused_projections()
    out = []
    for i, layer in enumerate(runner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = fused[i].qkv if fused else None
        gate_up = fused[i].gate_up if fused else None
        parts = [(qkv.weight, qkv.bias)] if qkv is not None else [(m.weight, m.bias) for m in
                                                                  (attn.q_proj, attn.k_proj, attn.v_proj)]
        out += [("hidden", w, b) for w, b in parts] + [("heads", attn.o_proj.weight, attn.o_proj.bias)]
        parts = [(gate_up.weight, gate_up.bias)] if gate_up is not None else [(m.weight, m.bias) for m in
                                                                              (mlp.gate_proj, mlp.up_proj)]
        out += [("hidden", w, b) for w, b in parts] + [("inner", mlp.down_proj.weight, mlp.down_proj.bias)]
    return out + [("hidden", runner.lm_head, None)]


def product_bytes(runner) -> int:
    """Bytes of the products' weights (and biases): what one row's products must read."""
    return sum(t.numel() * t.element_size() for _, w, b in products(runner) for t in (w, b) if t is not None)


def _inputs(runner, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    s, w = runner.shape, runner.layers[0].mlp.down_proj.weight
    widths = dict(hidden=s.hidden_size, heads=s.num_heads * s.head_dim, inner=w.shape[1])
    return {k: torch.randn(n, d, generator=gen).to(device=w.device, dtype=w.dtype) for k, d in widths.items()}


def products_ms(runner, sizes: list[int], repeats: int = 10) -> dict[int, float]:
    """Milliseconds of one forward's products over n rows, per n in ``sizes`` (module doc)."""
    chain = products(runner)
    cuda = runner.device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    inputs = {n: _inputs(runner, n, gen) for n in sizes}

    def run(n: int) -> None:
        x = inputs[n]
        for kind, w, b in chain:
            runner._linear(x[kind], w, b)

    with torch.inference_mode():
        calls = {}
        for n in sizes:
            run(n)  # warm-up: the library's first call for this shape (a plan, a workspace) is not timed
            if cuda:
                torch.cuda.synchronize(runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run(n)
                graph.replay()
                calls[n] = graph.replay
            else:
                calls[n] = lambda n=n: run(n)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):
            for n in sizes:
                times[n].append(_timed(calls[n], runner.device))
    return {n: 1e3 * statistics.median(t) for n, t in times.items()}


def _timed(call, device: torch.device) -> float:
    if device.type != "cuda":
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@contextlib.contextmanager
def blas_library(name: str):
    """torch's preferred cuBLAS backend set to ``name`` ("cublas", "cublaslt") inside, restored after. Raises
    RuntimeError where this torch cannot choose one."""
    choose = getattr(torch.backends.cuda, "preferred_blas_library", None)
    if choose is None:
        raise RuntimeError("this torch has no torch.backends.cuda.preferred_blas_library")
    keep = choose()
    choose(name)
    try:
        yield
    finally:
        choose(keep)
