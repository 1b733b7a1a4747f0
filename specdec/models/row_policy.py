"""How ``linear()`` multiplies a few rows on CPU, chosen by measuring this machine (not a table tuned elsewhere).

On CPU, BLAS libraries take different paths for small row counts: ``F.linear`` on 2-32 rows may hit a slow
small-GEMM path where ``weight @ x^T`` reads the weight at GEMV speed, a single row may run on one thread
where two rows use both, and on some machines 2-4 rows cost more than 8. MKL also re-packs the weight on every
call, while a product over weights packed once in oneDNN's blocked layout (``packed_linear``) can cost nearly
the same for 1 to 16 rows. So for every row count m <= ``SMALL_M_MAX`` the policy records how to compute it:
``cols[m] = c`` means "the transposed product with c >= m columns (the c - m extra columns copy row 0 and are
dropped)",
``cols[m] = PACKED`` the product over packed weights; a row count missing from ``cols`` goes through
``F.linear``. Every choice returns ``F.linear``'s values for the rows given, up to float rounding (each
library sums in its own order, as F.linear itself does for different row counts).

    policy = measure_row_policy(weights, scales)   # a few seconds: products over what a forward streams
    install(torch.get_num_threads(), policy, dtype)  # linear() reads it from now on

Packed weights are copies (the model's weight bytes once more, made on a weight's first packed product and
dropped with the weight; a weight changed in place or given other memory is packed again, one written through
``.data`` at the next call: :func:`forget_edited`), so ``measure_row_policy`` offers them only when asked to
(``allow_packed``: the caller checks that the memory is there) and where oneDNN is available.

The products must be timed the way a forward runs them: every weight read once per forward, streamed from
memory. Timed over one layer's matrices, which fit in the last-level cache, single-threaded GEMV looked as fast
as anything, while streamed it can read at half the speed of the two-column transposed product
(measurements: docs/speculation-policy.md and docs/results/).

Policies are per torch thread count and weight dtype (``active_cols(dtype)`` reads the current count's); with none
installed, ``linear()`` is ``F.linear``. :func:`specdec.cost_model.ensure_row_policy` measures
once per machine / weight shapes / dtype / thread count and caches the result on disk.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

logger = logging.getLogger(__name__)

SMALL_M_MAX = 32
PACKED = 0  # a policy's value for "the product over oneDNN-packed weights" (packed_linear)
PACK_ROWS = 8  # the row count oneDNN is told to lay packed weights out for; 8 and 16 timed the same for 1-16 rows
_MIN_GAIN = 0.05  # a layout other than F.linear (or padding) must win by 5%: no chasing of timing noise
_DROP = 1.5  # a layout this much slower than the fastest in a row count's first round is timed once there

# (torch thread count, weight dtype) -> {rows: columns of the transposed product, or PACKED}: a policy measured for
# one dtype never reaches another's weights (oneDNN packs bf16 weights on CPUs where it cannot pack fp16 ones)
_ACTIVE: dict[tuple[int, torch.dtype], dict[int, int]] = {}
# id(weight) -> (weak reference to it, its version counter, data address and weak reference to its storage when
# packed, the packed copy, its probe); an entry leaves with its weight (weakref.finalize). A version that moved (an
# optimizer step, a load) packs the weight again, and so does new storage (``param.data = ...``, which keeps the
# version): the storage packed from must still live at the same address, since a freed one's address is soon
# another tensor's. The probe (PROBE values spread over rows and columns, and where they were read) catches what
# neither shows: a write through ``.data`` or into an inference tensor (forget_edited, at each call)
_PACKED: dict[int, tuple[weakref.ref, tuple | object, int, StorageWeakRef, torch.Tensor, tuple]] = {}
PROBE = 256
_EDITED = object()  # an entry's version once forget_edited saw its weight changed: no version equals it
_PARTS: dict[int, tuple[weakref.ref, ...]] = {}  # id(a view over several parameters) -> those parameters


def install(threads: int, cols: dict[int, int], dtype: torch.dtype = torch.float32) -> None:
    """Use ``cols`` (rows -> transposed columns, or PACKED) for ``dtype`` weights whenever torch runs on ``threads``
    threads."""
    bad = {m: c for m, c in cols.items() if not (1 <= m <= c <= SMALL_M_MAX or (c == PACKED and 1 <= m <= SMALL_M_MAX))}
    if bad:
        raise ValueError(f"row policy: need 1 <= rows <= columns <= {SMALL_M_MAX} (or PACKED = {PACKED}), got {bad}")
    if PACKED in cols.values() and not packing_available():
        raise ValueError("row policy: packed products need PyTorch's oneDNN (mkldnn) backend, which is unavailable")
    _ACTIVE[int(threads), dtype] = {int(m): int(c) for m, c in cols.items()}


def uninstall(threads: int | None = None) -> None:
    """Forget the policies of ``threads`` (None: every policy); linear() falls back to F.linear."""
    for key in [k for k in _ACTIVE if threads is None or k[0] == int(threads)]:
        del _ACTIVE[key]


def active_cols(dtype: torch.dtype = torch.float32) -> dict[int, int]:
    """The policy of the current torch thread count for ``dtype`` weights ({} when none is installed)."""
    return _ACTIVE.get((torch.get_num_threads(), dtype), {})


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, cols: int) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T as ``weight @ x^T`` with ``cols`` >= m columns, row-major [m, out]."""
    m = x.shape[0]
    xt = (x if cols == m else torch.cat([x, x[:1].expand(cols - m, -1)])).t()
    # back to row-major: a transposed result would reach attention with a strided head dim, which sends
    # scaled_dot_product_attention down its slow math path (~3x slower per layer)
    return torch.mm(weight, xt).t()[:m].contiguous()


def packing_available() -> bool:
    """Whether this PyTorch has oneDNN's packed linear (x86 / ARM builds with mkldnn)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` [out, in] in oneDNN's blocked layout, for :func:`packed_linear`'s kernel."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def _version(weight: torch.Tensor) -> tuple[int | None, ...]:
    """The version counters a packed copy of ``weight`` is valid under: its own and, for a view over several
    parameters (:func:`reads_parts`: a fused q/k/v block shares only q's counter), each part's."""
    parts = _PARTS.get(id(weight), ())
    return tuple(_counter(t) for t in (weight, *(ref() for ref in parts)) if t is not None)


def _counter(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot change outside inference mode)
        return None


def reads_parts(view: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Record that ``view`` reads the memory of ``parts`` (other tensors, each with its own version counter): an
    in-place edit of any part makes the packed copy of ``view`` stale. A k or v projection edited under no_grad
    moves neither the fused block's version nor its address: without this record, verify steps would multiply the
    old weights."""
    _PARTS[id(view)] = tuple(weakref.ref(p) for p in parts)
    weakref.finalize(view, _PARTS.pop, id(view), None)


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """The packed copy of ``weight``, made on first use and kept while the weight lives, unchanged, in the same
    memory."""
    key, version = id(weight), _version(weight)
    entry = _PACKED.get(key)
    if (entry is not None and entry[0]() is weight and entry[1] == version and entry[2] == weight.data_ptr()
            and not entry[3].expired()):
        return entry[4]
    if entry is None or entry[0]() is not weight:
        weakref.finalize(weight, _PACKED.pop, key, None)
    packed = pack_weight(weight)
    _PACKED[key] = (weakref.ref(weight), version, weight.data_ptr(), StorageWeakRef(weight.untyped_storage()), packed,
                    _probe(weight))
    return packed


def _probe(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row-major indices, values) of PROBE elements of ``weight`` [out, in], every step-th with a step prime to
    ``in`` (so that they fall in many columns as well as rows)."""
    out, cols = weight.shape
    step = max(1, out * cols // PROBE)
    while math.gcd(step, cols) != 1:
        step += 1
    flat = torch.arange(0, out * cols, step, device=weight.device)[:PROBE]
    with torch.no_grad():
        return flat, torch.take(weight, flat)


def forget_edited(weights: Iterable[torch.Tensor]) -> None:
    """Forget the packed copies of those ``weights`` whose probed values changed since they were packed: a write
    autograd does not count (``weight.data.copy_(...)``, a LoRA merge through ``.data``, an inference tensor edited in
    inference mode) moves neither version nor address. Called once per generate() call over the target's weights (two
    small ops a weight); an edit of a few elements that misses every probed one goes unseen."""
    with torch.no_grad():
        for weight in weights:
            entry = _PACKED.get(id(weight))
            if (entry is not None and entry[0]() is weight
                    and not torch.equal(torch.take(weight, entry[5][0]), entry[5][1])):
                _PACKED[id(weight)] = (entry[0], _EDITED, *entry[2:])  # packed again at its next product


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T (+ bias) over the packed copy of ``weight`` (``packed``: a given copy).
    No autograd: ``linear()`` sends products that need gradients to F.linear."""
    packed = packed_weight(weight) if packed is None else packed
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def _weighted_pass(products, scales: Sequence[float]) -> float:
    """Seconds of one pass over every product, each product's time multiplied by its scale."""
    total = 0.0
    for run, scale in zip(products, scales, strict=True):
        t0 = time.perf_counter()
        run()
        total += scale * (time.perf_counter() - t0)
    return total


@torch.inference_mode()
def measure_row_policy(weights: Sequence[torch.Tensor], max_rows: int = SMALL_M_MAX, repeats: int = 5,
                       scales: Sequence[float] | None = None, allow_packed: bool = False,
                       progress: Callable[[], object] | None = None) -> dict[int, int]:
    """Time ``F.linear``, the transposed product and (``allow_packed`` and oneDNN present) the packed product
    for 1..max_rows rows over ``weights``, and return the fastest way to compute each row count, padding allowed
    for the transposed product (m rows computed as c >= m when c is faster). Each layout's time is the median of
    ``repeats`` passes, except a layout far behind the fastest in its row count's first pass, timed only once.

    ``weights`` should be what a forward streams (more bytes than the last-level cache holds: see the module
    doc); ``scales[i]`` weighs matrix i's time (a sample of every k-th layer stands for k layers), default 1.
    CPU tensors only. ``progress``: called after each row count is timed (``max_rows`` calls)."""
    if not weights or any(w.device.type != "cpu" or w.dim() != 2 for w in weights):
        raise ValueError("measure_row_policy needs 2-D CPU weight matrices")
    scales = [1.0] * len(weights) if scales is None else [float(s) for s in scales]
    if len(scales) != len(weights) or any(s <= 0 for s in scales):
        raise ValueError("measure_row_policy: one positive scale per weight matrix")
    max_rows = min(int(max_rows), SMALL_M_MAX)
    gen = torch.Generator().manual_seed(0)
    packs = _packs(weights) if allow_packed else None  # local copies, freed on return
    plain: dict[int, float] = {}
    transposed: dict[int, float] = {}
    packed: dict[int, float] = {}
    for m in range(1, max_rows + 1):
        xs = [torch.randn(m, w.shape[1], generator=gen).to(w.dtype) for w in weights]
        passes = [[lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
                  [lambda x=x, w=w, m=m: transposed_linear(x, w, m) for x, w in zip(xs, weights, strict=True)]]
        if packs is not None:
            passes.append([lambda x=x, w=w, p=p: packed_linear(x, w, packed=p)
                           for x, w, p in zip(xs, weights, packs, strict=True)])
        if m == 1:  # one warm-up pass of each (first-call allocations); streamed weights need no more
            for products in passes:
                _weighted_pass(products, scales)
        # interleaved: a slow moment costs every layout. A layout that took over _DROP x the fastest's time in the
        # first round is not timed again at this row count (its one time stands: F.linear at most row counts here,
        # ~40% of a first run's measuring): noise would have had to add a third of its time for it to win
        times = [[_weighted_pass(products, scales)] for products in passes]
        fastest = min(t[0] for t in times)
        kept = [(products, t) for products, t in zip(passes, times, strict=True) if t[0] <= _DROP * fastest]
        for _ in range(repeats - 1):
            for products, t in kept:
                t.append(_weighted_pass(products, scales))
        plain[m] = statistics.median(times[0])
        transposed[m] = statistics.median(times[1])
        if packs is not None:
            packed[m] = statistics.median(times[2])
        if progress is not None:
            progress()
    cols: dict[int, int] = {}
    for m in range(1, max_rows + 1):
        best_cost, best = plain[m], None  # F.linear on exactly m rows is the default
        for c in range(m, max_rows + 1):  # the transposed product with c columns
            if transposed[c] < best_cost * (1 - _MIN_GAIN):
                best_cost, best = transposed[c], c
        if m in packed and packed[m] < best_cost * (1 - _MIN_GAIN):
            best_cost, best = packed[m], PACKED
        if best is not None:
            cols[m] = best
    return cols


def _packs(weights: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
    """Packed copies of ``weights`` for timing, or None where this PyTorch or dtype cannot pack."""
    if not packing_available():
        return None
    try:
        packs = [pack_weight(w) for w in weights]
        packed_linear(torch.zeros(1, weights[0].shape[1], dtype=weights[0].dtype), weights[0], packed=packs[0])
        return packs
    except RuntimeError as err:  # e.g. a dtype oneDNN does not pack on this CPU
        logger.info("row policy: packed products unavailable (%s)", err)
        return None
