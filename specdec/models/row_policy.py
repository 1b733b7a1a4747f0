"""How ``linear()`` multiplies a few rows on CPU, chosen by measuring this machine (not a table tuned elsewhere).

On CPU, BLAS libraries take different paths for small row counts: ``F.linear`` on 2-32 rows may hit a slow
small-GEMM path where ``weight @ x^T`` reads the weight at GEMV speed, a single row may run on one thread
where two rows use both, and on some machines 2-4 rows cost more than 8. So for every row count
m <= ``SMALL_M_MAX`` the policy records how to compute it: ``cols[m] = c`` means "the transposed product
with c >= m columns (the c - m extra columns copy row 0 and are dropped)"; a row count missing from
``cols`` goes through ``F.linear``. Every choice returns ``F.linear``'s values for the rows given.

    policy = measure_row_policy(weights, scales)   # a few seconds: products over what a forward streams
    install(torch.get_num_threads(), policy)       # linear() reads it from now on

The products must be timed the way a forward runs them: every weight read once per forward, streamed from
memory. Timed over one layer's matrices, which fit in the last-level cache, single-threaded GEMV looked as fast
as anything; streamed, it reads at half the speed of the two-column transposed product (2-core EPYC:
30 layers' products at 1 row took 36 ms through ``F.linear``, 16 ms as 2 transposed columns). The policy
tuned on cached weights made plain decoding 1.8x slower than the streamed one.

Policies are per torch thread count (``active_cols()`` reads the current one); with none installed for
the current count, ``linear()`` is ``F.linear``. :func:`specdec.cost_model.ensure_row_policy` measures
once per machine / weight shapes / dtype / thread count and caches the result on disk.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

SMALL_M_MAX = 32
_MIN_GAIN = 0.05  # a layout other than F.linear (or padding) must win by 5%: no chasing of timing noise

_ACTIVE: dict[int, dict[int, int]] = {}  # torch thread count -> {rows: columns of the transposed product}


def install(threads: int, cols: dict[int, int]) -> None:
    """Use ``cols`` (rows -> transposed columns) whenever torch runs on ``threads`` threads."""
    bad = {m: c for m, c in cols.items() if not 1 <= m <= c <= SMALL_M_MAX}
    if bad:
        raise ValueError(f"row policy: need 1 <= rows <= columns <= {SMALL_M_MAX}, got {bad}")
    _ACTIVE[int(threads)] = {int(m): int(c) for m, c in cols.items()}


def uninstall(threads: int | None = None) -> None:
    """Forget the policy of ``threads`` (None: every policy); linear() falls back to F.linear."""
    if threads is None:
        _ACTIVE.clear()
    else:
        _ACTIVE.pop(int(threads), None)


def active_cols() -> dict[int, int]:
    """The policy of the current torch thread count ({} when none is installed)."""
    return _ACTIVE.get(torch.get_num_threads(), {})


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, cols: int) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T as ``weight @ x^T`` with ``cols`` >= m columns, row-major [m, out]."""
    m = x.shape[0]
    xt = (x if cols == m else torch.cat([x, x[:1].expand(cols - m, -1)])).t()
    # back to row-major: a transposed result would reach attention with a strided head dim, which sends
    # scaled_dot_product_attention down its slow math path (~3x slower per layer)
    return torch.mm(weight, xt).t()[:m].contiguous()


def _weighted_pass(products, scales: Sequence[float]) -> float:
    """Seconds of one pass over every product, each product's time multiplied by its scale."""
    total = 0.0
    for run, scale in zip(products, scales):
        t0 = time.perf_counter()
        run()
        total += scale * (time.perf_counter() - t0)
    return total


@torch.inference_mode()
def measure_row_policy(weights: Sequence[torch.Tensor], max_rows: int = SMALL_M_MAX, repeats: int = 5,
                       scales: Sequence[float] | None = None) -> dict[int, int]:
    """Time ``F.linear`` and the transposed product for 1..max_rows rows over ``weights``, and return the
    fastest way to compute each row count, padding allowed (m rows computed as c >= m when c is faster).

    ``weights`` should be what a forward streams (more bytes than the last-level cache holds: see the module
    doc); ``scales[i]`` weighs matrix i's time (a sample of every k-th layer stands for k layers), default 1.
    CPU tensors only."""
    if not weights or any(w.device.type != "cpu" or w.dim() != 2 for w in weights):
        raise ValueError("measure_row_policy needs 2-D CPU weight matrices")
    scales = [1.0] * len(weights) if scales is None else [float(s) for s in scales]
    if len(scales) != len(weights) or any(s <= 0 for s in scales):
        raise ValueError("measure_row_policy: one positive scale per weight matrix")
    max_rows = min(int(max_rows), SMALL_M_MAX)
    gen = torch.Generator().manual_seed(0)
    plain: dict[int, float] = {}
    transposed: dict[int, float] = {}
    for m in range(1, max_rows + 1):
        xs = [torch.randn(m, w.shape[1], generator=gen).to(w.dtype) for w in weights]
        by_linear = [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights)]
        by_transposed = [lambda x=x, w=w, m=m: transposed_linear(x, w, m) for x, w in zip(xs, weights)]
        if m == 1:  # one warm-up pass of each (first-call allocations); streamed weights need no more
            _weighted_pass(by_linear, scales), _weighted_pass(by_transposed, scales)
        times = [(_weighted_pass(by_linear, scales), _weighted_pass(by_transposed, scales)) for _ in range(repeats)]
        plain[m] = statistics.median(t for t, _ in times)  # interleaved: a slow moment costs both layouts
        transposed[m] = statistics.median(t for _, t in times)
    cols: dict[int, int] = {}
    for m in range(1, max_rows + 1):
        best_cost, best = plain[m], None  # F.linear on exactly m rows is the default
        for c in range(m, max_rows + 1):  # the transposed product with c columns
            if transposed[c] < best_cost * (1 - _MIN_GAIN):
                best_cost, best = transposed[c], c
        if best is not None:
            cols[m] = best
    return cols
