"""Cost model: what a verify step of n query tokens costs on this machine, measured and cached.

    costs = load_cost_model(runner)            # cached, or a short calibration, once per machine
    costs.relative(n, batch=1)                 # c(n) / c(1): a verify step of n tokens per sequence in decode steps
    costs.decode_seconds(batch=1)              # c(1) in seconds (at the calibration's context)

A step of speculative decoding costs ``draft + c(n)`` where n = 1 + kept tree nodes; it pays when its
expected committed tokens exceed that cost in units of a plain decode step (:mod:`specdec.tree_sizing`).
``c(n)`` is measured here with the acceptance suite's own timer
(:func:`specdec.verify_cost.measure_verify_costs`: a real engine step, target forward + rejection sampling + KV
commit) on a grid of n (1 to the tree-node limit + 1, interpolated linearly between grid points; on a CPU a batch's
grid stops at ``BATCH_QUERY_TOKENS`` query tokens per step and is extrapolated past it), one batch size at a time:
batch 1 when first needed, and when a call of B sequences builds its engine, every power of two up to B rounded
up (the sizes its batch meets as rows finish: a measurement in the middle of the call stalled it for seconds).
Draft costs are not measured here: they depend on the drafter and the text, so the engine measures them online
(:class:`specdec.tree_sizing.TreeSizer`).

The result is cached as JSON under ``$SPECDEC_COST_DIR``, else ``cache_root()/costs``, keyed by everything it
depends on: the model (its shapes, not its weights' values: :func:`model_structure`), dtype, device and its name
(a GPU's; a CPU's model name, family and ISA flags), torch thread count, torch version, the CPU row policy (which is
itself measured first: :func:`ensure_row_policy`) and the calibration's workload.
A different key re-measures, and so does a file that is unreadable or holds what no calibration writes (a warning
names it). Processes sharing the cache (a server's workers) each add their batch sizes to one file, measuring one
at a time (:func:`_measuring_alone`). Where no cache folder is known (no home directory and neither variable set) or
it is read-only, a warning says so and each process measures for itself. ``CALIBRATIONS`` counts the
measurements this process ran (tests). A curve in which n tokens cost more than n one-token steps is no machine's
(decoding them one by one would be cheaper): it was timed while something else ran, and is measured once more; one
cached before this check is measured again.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specdec import cpu_info
from specdec.atomic_write import write_json
from specdec.folder_lock import FolderInUse, only_writer
from specdec.generate_inputs import is_finite_number, is_int
from specdec.kv_cache import available_memory_bytes
from specdec.models import row_policy
from specdec.output_dirs import why_uncreatable
from specdec.sampling import SamplingConfig
from specdec.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

CALIBRATIONS = {"verify": 0, "rows": 0}  # measurements run by this process (cache misses)
# models whose curves a process keeps in memory, the most recently used; an older one's are read from disk again
MEMO_LIMIT = 16
_MEMO: dict[str, dict[int, dict[int, float]]] = {}  # cache file -> curves: the disk read once per key (MEMO_LIMIT)
_ROWS_DONE: dict[str, dict[int, int]] = {}  # row-policy cache file -> its policy, read or measured in this process
_PACKING: dict[str, bool] = {}  # row-policy key (without "packed") -> packed weights allowed, decided once per process
_MEASURING = threading.local()  # .held: this thread holds the cost cache's folder for a measurement
_WARNED: set[str] = set()  # what a warning said once per process: a damaged file's path, or that no folder is known
BATCH_QUERY_TOKENS = 128  # a CPU's calibration grid of a batch: sizes n with batch * n above this are extrapolated
BATCH_CONTEXT_TOKENS = 1024  # and at most this many context tokens are prefilled over the whole batch
STREAM_BYTES = 128 * 2**20  # the row policy times at least this many bytes of weights: beyond a CPU's last-level cache


@dataclass(frozen=True)
class CalibrationConfig:
    """The calibration's workload; small values keep tests fast."""

    sizes: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, MAX_TREE_NODES + 1)
    context: int = 128  # committed tokens per sequence before the timed steps
    repeats: int = 3  # timed rounds (plus one warm-up), median per n
    row_repeats: int = 3  # timed passes of the row-policy micro-benchmark (median)
    # verify steps replayed as captured CUDA graphs, as generate() runs them on a GPU (eager steps there cost several
    # times as much, nearly flat in n: a curve of another machine)
    graphs: bool = False

    def __post_init__(self) -> None:
        sizes = tuple(sorted({int(n) for n in self.sizes}))
        if not sizes or sizes[0] != 1 or sizes[-1] > MAX_TREE_NODES + 1:
            raise ValueError(f"calibration sizes must start at 1 and stay <= {MAX_TREE_NODES + 1}, got {self.sizes}")
        if self.context < 1 or self.repeats < 1 or self.row_repeats < 1:
            raise ValueError("calibration context, repeats and row_repeats must be >= 1")
        object.__setattr__(self, "sizes", sizes)


@contextlib.contextmanager
def _one_off(what: str, total: int, unit: str, where: Path | None, said: bool = False):
    """A measurement the caller waits for once (then cached in ``where``): said in one warning, as a model's
    conversion is (not again when ``said``: a retry the caller announced), and shown as a progress bar on a
    terminal when it lasts over a second; yields the bar's step."""
    from tqdm.auto import tqdm

    if not said:
        why = None if where is None else why_uncreatable(where)  # a read-only cache: not "once", nor "cached"
        logger.warning("measuring %s, %s", what, "once" if where is None else
                       f"once (cached in {where})" if why is None else f"for this process only (not cached: {why})")
    with tqdm(total=total, unit=unit, desc="measuring costs", delay=1.0, disable=None, leave=False) as bar:
        yield bar.update


@contextlib.contextmanager
def _measuring_alone(file: Path | None) -> Iterator[None]:
    """Hold the folder of the cache ``file`` while measuring, so that processes (and threads) sharing the cost cache
    measure one at a time, each reading what the one before cached: two `specdec generate` started together on an
    empty cache each timed its products under the other's load, and cached another row policy, and so another verify
    curve, than the other. Nothing is held where there is no folder or no ``flock``, nor again in a thread that
    holds it (a measurement inside another)."""
    if file is None or getattr(_MEASURING, "held", False):
        yield
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # the measurement is not cached either (write_cache says so): nothing to wait for
        yield
        return
    with contextlib.ExitStack() as hold:
        try:
            hold.enter_context(only_writer(file.parent, "the cost cache"))
        except FolderInUse:
            logger.warning("waiting for another process measuring costs in %s", file.parent)
            hold.enter_context(only_writer(file.parent, "the cost cache", wait=True))
        _MEASURING.held = True
        try:
            yield
        finally:
            _MEASURING.held = False


def _device(device: torch.device) -> dict:
    """What names the processor a measurement ran on: a GPU's device name; a CPU's model name, its x86 family and
    model numbers and the flags its matrix products depend on (:mod:`specdec.cpu_info`): "x86_64" alone keyed an
    EPYC's costs to a Xeon."""
    if device.type == "cuda":
        return {"device_name": torch.cuda.get_device_name(device)}
    return {"device_name": cpu_info.cpu_model(), "cpu": cpu_info.cpu_signature(), "isa": cpu_info.isa()}


def machine_key(runner) -> dict:
    """What every measurement on ``runner`` depends on besides the weights' values: the model's shape, dtype,
    device, the processor (:func:`_device`), torch's thread count and version, the attention backend, and whether
    its forward multiplies fused QKV / gate-up blocks (specdec.models.fused_projections: other products)."""
    return {"shape": asdict(runner.shape), "dtype": str(runner.dtype), "device": str(runner.device),
            **_device(runner.device), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "backend": str(getattr(runner.backend, "name", runner.backend)),
            "fused": runner.fused_projections() is not None}


def _memo_put(memo: dict, key, value) -> None:
    """``memo[key] = value`` as its most recent entry (dicts keep insertion order), the least recently put entries
    dropped past MEMO_LIMIT."""
    memo.pop(key, None)
    memo[key] = value
    while len(memo) > MEMO_LIMIT:
        del memo[next(iter(memo))]


def model_structure(runner) -> str:
    """What of the model a measured cost depends on beyond :func:`machine_key`'s shape: the names, shapes and dtypes
    of the embedding, the first layer's parameters (MLP width, q/k norms, biases), the final norm and the LM head.
    Not their values: weights updated in place (a training loop's rollouts) keep their measured curves."""
    first = list(runner.layers[0].named_parameters()) if len(runner.layers) else []
    named = [("embed", runner.embed), *first, ("final_norm", runner.final_norm), ("lm_head", runner.lm_head)]
    return _digest([[name, list(t.shape), str(t.dtype)] for name, t in named])


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def _warn_once(what: str, message: str, *args) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        logger.warning(message, *args)


def _cache_dir(cache_dir: str | Path | None) -> Path | None:
    """``cache_dir``, else ``$SPECDEC_COST_DIR`` (``~`` expanded; the test suite points it at a temporary directory,
    so that calibrations taken on a machine busy with tests never reach real runs), else ``<cache root>/costs``; None
    (said once) where no cache root is known: measured, never cached, as in a read-only folder."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("SPECDEC_COST_DIR"):
        return Path(os.environ["SPECDEC_COST_DIR"]).expanduser()
    from specdec.errors import SpecdecError
    from specdec.models.embedded import cache_root

    try:
        return cache_root() / "costs"
    except SpecdecError as err:
        _warn_once("no cache folder", "cost model: %s (or SPECDEC_COST_DIR); measured costs are not cached", err)
        return None


def cache_dir() -> Path | None:
    """The folder of this machine's measurement caches (``$SPECDEC_COST_DIR``, else ``<cache root>/costs``; None
    where no cache root is known)."""
    return _cache_dir(None)


def _cache_file(cache_dir: str | Path | None, name: str) -> tuple[str, Path | None]:
    """The cache file ``name`` in :func:`_cache_dir` (None: no folder) and what this process memoizes it under: its
    path, else its name."""
    folder = _cache_dir(cache_dir)
    return (name, None) if folder is None else (str(folder / name), folder / name)


def read_cache(file: Path | None) -> dict | None:
    """A measurement cache file's JSON object, or None when it is missing (or ``file`` is None), unreadable or not
    an object (then measured again)."""
    try:
        data = json.loads(file.read_text()) if file is not None and file.is_file() else None
        if data is None or isinstance(data, dict):
            return data
    except (OSError, ValueError):
        pass
    _warn_once(str(file), "cost model: unreadable cache file %s; measuring again", file)
    return None


def _count(text) -> int | None:
    """A JSON object's key that counts something ("4": 4, at least 1), else None."""
    return int(text) if isinstance(text, str) and text.isdecimal() and int(text) >= 1 else None


def _curve(raw) -> dict[int, float] | None:
    """A batch's curve as :meth:`CostModel.save` writes it, {"n": seconds > 0} from n = 1 with at least two sizes,
    read back; None for anything else."""
    if not isinstance(raw, dict):
        return None
    curve = {_count(n): s for n, s in raw.items()}
    if None in curve or 1 not in curve or len(curve) < 2 or not all(
            is_finite_number(s) and s > 0 for s in curve.values()):
        return None
    return {n: float(s) for n, s in curve.items()}


def _cached_curves(data: dict | None, key: dict, file: Path | None) -> dict[int, dict[int, float]]:
    """The batch curves of a verify cache file's ``data`` written under ``key`` ({}: none, or another key's); a file
    holding anything but such curves (:func:`_curve`) is damaged: {} (a warning names it), measured again."""
    if data is None or data.get("key") != key:
        return {}
    raw = data.get("curves")
    curves = {_count(b): _curve(c) for b, c in raw.items()} if isinstance(raw, dict) else {None: None}
    if None not in curves and None not in curves.values():
        return curves
    _warn_once(str(file), "cost model: damaged cache file %s (its curves); measuring again", file)
    return {}


def _cached_cols(data: dict | None, key: dict, file: Path | None) -> dict[int, int] | None:
    """The row policy in a row-policy cache file's ``data`` written under ``key`` (None: none, or another key's). A
    file holding anything but a policy :func:`row_policy.install` takes for ``key`` is damaged: None (a warning
    names it), measured again."""
    if data is None or data.get("key") != key:
        return None
    raw = data.get("cols")
    cols = {_count(m): c for m, c in raw.items()} if isinstance(raw, dict) else {None: None}
    top = row_policy.SMALL_M_MAX
    if all(m is not None and m <= top and is_int(c) and (m <= c <= top or (c == row_policy.PACKED and key["packed"]))
           for m, c in cols.items()):
        return cols
    _warn_once(str(file), "cost model: damaged cache file %s (its row policy); measuring again", file)
    return None


def write_cache(file: Path | None, data: dict) -> None:
    """Write a measurement cache file atomically (None: no cache folder, nothing); a failure only costs a
    re-measurement next time."""
    if file is None:
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_json(file, data)
    except OSError as err:  # a read-only cache dir costs a re-measurement next time, nothing else (said once)
        _warn_once(f"unwritable {file.parent}", "cost model: cannot write into %s (%s); measurements are not cached",
                   file.parent, err.strerror or err)


def streamed_weights(runner, budget_bytes: int = STREAM_BYTES) -> tuple[list[torch.Tensor], list[float]]:
    """The matrices a forward multiplies, as the row policy should time them: evenly spaced layers holding at
    least ``budget_bytes`` (all layers when the model is smaller), each scaled to stand for its share of the
    layers, plus the LM head once. Returns (weights, scales)."""
    per_layer = runner.layer_weights()  # q / k / v and gate / up one block each where fused
    layer_bytes = max(1, sum(p.numel() * p.element_size() for p in per_layer[0]))
    count = min(len(per_layer), max(1, -(-budget_bytes // layer_bytes)))
    chosen = sorted({round(i * (len(per_layer) - 1) / max(1, count - 1)) for i in range(count)})
    scale = len(per_layer) / len(chosen)
    weights = [p.detach() for i in chosen for p in per_layer[i]]
    return weights + [runner.lm_head.detach()], [scale] * len(weights) + [1.0]


def packed_weights_allowed(runner) -> bool:
    """Whether the row policy may offer oneDNN-packed weights (:mod:`specdec.models.row_policy`): a copy of every
    weight a forward multiplies, so only where this PyTorch has oneDNN, ``SPECDEC_PACKED_WEIGHTS`` is not "0",
    and the memory available now holds those bytes twice over (room left for the KV cache and drafters)."""
    if os.environ.get("SPECDEC_PACKED_WEIGHTS", "1").strip() == "0" or not row_policy.packing_available():
        return False
    needed = 2 * sum(w.numel() * w.element_size() for w in runner.multiplied_weights())
    available = available_memory_bytes(runner.device)
    return available is not None and available >= needed


def ensure_row_policy(runner, config: CalibrationConfig | None = None, cache_dir: str | Path | None = None) -> None:
    """Install the CPU row policy of ``linear()`` for the current thread count, measured on this machine over
    the matrices a forward streams (:func:`streamed_weights`; cached on disk by :func:`machine_key`: CPU model and
    ISA flags, weight shapes, dtype and thread count). No-op on GPU."""
    row_policy_decision(runner, config, cache_dir)


def row_policy_decision(runner, config: CalibrationConfig | None = None,
                        cache_dir: str | Path | None = None) -> dict | None:
    """:func:`ensure_row_policy`, returning what it installed: ``{"packed": whether packed weights were a
    candidate, "cols": the policy}`` (None on GPU), for processes that must compute alike
    (:func:`adopt_row_policy`)."""
    if runner.device.type != "cpu" or not len(runner.layers):
        return None
    key, memo, file = _rows_file(runner, cache_dir)
    cols = _ROWS_DONE.get(memo)
    if cols is None:
        cols = _ROWS_DONE[memo] = _read_or_measure_rows(runner, config, key, file, key["packed"])
    # installed at every engine build: another model's policy (another dtype or shape) may be the active one
    row_policy.install(torch.get_num_threads(), cols, runner.dtype)
    return {"packed": key["packed"], "cols": dict(cols)}


def adopt_row_policy(runner, decision: dict | None, cache_dir: str | Path | None = None) -> None:
    """Make another process's ``decision`` (:func:`row_policy_decision`) this process's row policy for ``runner``:
    installed now and at every later :func:`ensure_row_policy` of this process, which then neither reads the disk
    nor measures. Processes timing the same products side by side (an empty cache) can choose differently, and
    another policy rounds another way: their greedy texts could part at near-ties."""
    if decision is None or runner.device.type != "cpu" or not len(runner.layers):
        return
    _, memo, _ = _rows_file(runner, cache_dir, packed=bool(decision["packed"]))
    cols = _ROWS_DONE[memo] = {int(m): int(c) for m, c in decision["cols"].items()}
    row_policy.install(torch.get_num_threads(), cols, runner.dtype)


def _rows_file(runner, cache_dir: str | Path | None, packed: bool | None = None) -> tuple[dict, str, Path | None]:
    """The row policy's cache key, memo name and file (:func:`_cache_file`) for ``runner``; ``packed``: the decision
    to take (else this process's)."""
    # "timing": how the policy was measured; a policy timed another way (over one cache-resident layer, as older
    # versions did) is measured again; "packed": whether packed weights were a candidate (older caches lack it), decided
    # once per process and key: the packed copies a policy makes use up the memory that decision measured, and must
    # not turn it (and the policy) over at the next engine build
    key = machine_key(runner) | {"kind": "rows", "timing": "streamed"}
    base = _digest(key)
    if packed is not None:
        _PACKING[base] = packed
    elif base not in _PACKING:
        _PACKING[base] = packed_weights_allowed(runner)
    key |= {"packed": _PACKING[base]}
    return key, *_cache_file(cache_dir, f"rows-{_digest(key)}.json")


def _read_or_measure_rows(runner, config: CalibrationConfig | None, key: dict, file: Path | None,
                          packed: bool) -> dict:
    """The row policy cached in ``file`` under ``key``, else measured now and cached there (None: not cached)."""
    threads = torch.get_num_threads()
    cols = _cached_cols(read_cache(file), key, file)
    if cols is not None:
        return cols
    with _measuring_alone(file):
        cols = _cached_cols(read_cache(file), key, file)  # measured meanwhile by another process sharing the cache
        if cols is not None:
            return cols
        weights, scales = streamed_weights(runner)
        CALIBRATIONS["rows"] += 1
        t0 = time.perf_counter()
        with _one_off(f"this CPU's matrix products of 1-{row_policy.SMALL_M_MAX} rows on {threads} "
                      f"thread{'s' if threads != 1 else ''}",
                      row_policy.SMALL_M_MAX, "rows", None if file is None else file.parent) as step:
            cols = row_policy.measure_row_policy(weights, repeats=(config or CalibrationConfig()).row_repeats,
                                                 scales=scales, allow_packed=packed, progress=step)
        cols = {int(m): int(c) for m, c in cols.items()}
        write_cache(file, {"key": key, "cols": {str(m): c for m, c in cols.items()}})
        logger.info("row policy measured for %d threads in %.1f s: %s", threads, time.perf_counter() - t0, cols)
    return cols


@dataclass
class CostModel:
    """c_B(n) per batch size B, seconds; batch sizes missing are measured when first asked for."""

    key: dict
    curves: dict[int, dict[int, float]] = field(default_factory=dict)  # batch -> {n: seconds}
    runner: object = field(default=None, repr=False, compare=False)  # None: a loaded / fixed model, no lazy runs
    config: CalibrationConfig = field(default_factory=CalibrationConfig)
    file: Path | None = None
    measured: bool = True  # False: a model too short to calibrate, every verified token priced at a decode step

    @staticmethod
    def batch_bucket(batch: int) -> int:
        return 1 << max(int(batch) - 1, 0).bit_length()

    def curve(self, batch: int = 1) -> dict[int, float]:
        b = self.batch_bucket(batch)
        if b not in self.curves:
            if self.runner is None:  # nearest measured batch size
                b = min(self.curves, key=lambda x: abs(x - b))
            elif b in (saved := self._saved()):  # measured meanwhile by another process sharing the cache
                self.curves[b] = saved[b]
            else:
                with _measuring_alone(self.file):
                    if b in (saved := self._saved()):  # measured by the process this one waited for
                        self.curves[b] = saved[b]
                    else:
                        where = None if self.file is None else self.file.parent
                        self.curves[b] = calibrate(self.runner, b, self.config, where)
                        self.save()
        return self.curves[b]

    def measure_up_to(self, batch: int) -> None:
        """Every batch size a call of ``batch`` sequences meets as its rows finish (1, 2, 4, ... up to ``batch``
        rounded up), measured now where missing: not in the middle of the call (a stall of seconds)."""
        bucket = 1
        while bucket <= self.batch_bucket(batch):
            self.curve(bucket)
            bucket *= 2

    def _saved(self) -> dict[int, dict[int, float]]:
        """The checked curves of this key in the cache file now ({}: none, no file, or another key's)."""
        data = read_cache(self.file)
        return _cached_curves(data, self.key, self.file) if data is not None and data.get("checked") else {}

    def measured_id(self) -> str:
        """A digest of the batch-1 curve: what is learned on this curve (the guard's memory) is kept under it, so a
        curve measured again (a deleted cache file, an impossible one dropped) starts that learning afresh."""
        return _digest({str(n): s for n, s in sorted(self.curve(1).items())})[:12]

    def save(self) -> None:
        """Write the curves to the cache file (if any), marked as checked by :func:`calibrate`, with the batch sizes
        another process sharing it (a server's other worker) has saved there since: this process's curves win."""
        if self.file is not None:
            merged = sorted((self._saved() | self.curves).items())
            curves = {str(k): {str(n): s for n, s in v.items()} for k, v in merged}
            write_cache(self.file, {"key": self.key, "checked": True, "curves": curves})

    def seconds(self, n: int, batch: int = 1) -> float:
        """Seconds of a verify step with ``n`` query tokens per sequence (linear between and past grid points)."""
        curve = self.curve(batch)
        sizes = sorted(curve)
        n = max(int(n), 1)
        if n in curve:
            return curve[n]
        hi = next((s for s in sizes if s > n), None)
        lo, hi = (sizes[-2], sizes[-1]) if hi is None else (max(s for s in sizes if s < n), hi)
        if lo == hi:
            return curve[lo]
        return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)

    def decode_seconds(self, batch: int = 1) -> float:
        return self.seconds(1, batch)

    def relative(self, n: int, batch: int = 1) -> float:
        """c(n) / c(1) at this batch size: a verify step of n tokens per sequence in plain decode steps (>= 1)."""
        return max(self.seconds(n, batch) / self.decode_seconds(batch), 1.0)


def times_whole_grid(runner) -> bool:
    """Whether a batch's calibration times every size of the grid (a GPU) or stops at BATCH_QUERY_TOKENS (calibrate)."""
    return runner.device.type == "cuda"


def _plan(runner, batch: int, config: CalibrationConfig) -> tuple[list[int], int, int] | None:
    """(sizes, repeats, context) of a batch's calibration, fitted into the model's context (None: it cannot fit)."""
    # a batch runs batch x n query tokens per step. On a CPU, past BATCH_QUERY_TOKENS the curve is extrapolated linearly
    # from its last two points (the forward is compute-bound there), and the prefilled context shrinks with the batch,
    # so any batch size calibrates in seconds, where the full grid took minutes at batch 32. A GPU's forward stays near
    # one weight read far past that many tokens, and its steps take milliseconds: the whole grid is timed (extrapolated
    # from that flat stretch, 32 x 65 tokens would cost about what 32 x 4 do)
    cap = math.inf if times_whole_grid(runner) else BATCH_QUERY_TOKENS
    sizes = [n for n in config.sizes if n <= 2 or batch * n <= cap]
    context = min(config.context, max(runner.shape.max_positions // 4, 2), max(16, BATCH_CONTEXT_TOKENS // batch))
    repeats = config.repeats
    while (repeats + 1) * sum(sizes) + context + 2 > runner.shape.max_positions:  # a short-context model
        if repeats > 1:
            repeats -= 1
        elif len(sizes) > 2:
            sizes.pop()  # extrapolated linearly from the last two points
        else:
            return None
    return sizes, repeats, context


def calibrate(runner, batch: int, config: CalibrationConfig, where: Path | None = None) -> dict[int, float]:
    """Median seconds of one engine step with n query tokens per sequence, batch ``batch``, n on the grid
    (``where``: the folder its cache file goes to, for the message the caller waits with)."""
    from specdec.verify_cost import measure_verify_costs

    plan = _plan(runner, batch, config)
    if plan is None:
        raise ValueError(f"the model's context ({runner.shape.max_positions}) is too short to calibrate")
    sizes, repeats, context = plan
    prompts = [[(7 + 13 * i + b) % runner.shape.vocab_size for i in range(context)] for b in range(batch)]
    CALIBRATIONS["verify"] += 1
    t0 = time.perf_counter()
    for attempt in range(2):  # a curve no machine has (module doc) is measured once more
        with _one_off(f"verify steps of 1-{sizes[-1]} tokens at batch {batch} for the speculation policy",
                      (repeats + 1) * len(sizes), "step", where, said=attempt > 0) as step:
            times = measure_verify_costs(runner, prompts, sizes, SamplingConfig(), repeats=repeats,
                                         graphs=config.graphs, progress=step)
        dearer = _dearer(times)
        if not dearer:
            break
        logger.warning("a verify step of %d tokens was timed at %.1fx a step of 1 token, more than decoding them one "
                       "by one (was the machine busy?)%s", dearer[0], times[dearer[0]] / times[1],
                       ": measuring again" if attempt == 0 else "; kept, and corrected as the runs time their steps")
    logger.info("verify cost measured (batch %d, %d sizes) in %.1f s: c(1) = %.2f ms, c(%d) = %.2fx",
                batch, len(sizes), time.perf_counter() - t0, times[1] * 1e3, sizes[-1], times[sizes[-1]] / times[1])
    # the row policy can compute n rows as m > n rows, so a measured c(n) above a larger c(m) is noise (or a
    # slow row count the policy missed): keep the suffix minimum, a non-decreasing curve
    curve, low = {}, float("inf")
    for n in sorted(times, reverse=True):
        low = min(low, float(times[n]))
        curve[int(n)] = low
    return dict(sorted(curve.items()))


def _dearer(curve: dict[int, float]) -> list[int]:
    """The sizes n at which ``curve`` prices n tokens above n one-token steps: no machine's curve (module doc)."""
    return [n for n in sorted(curve) if curve[n] > n * curve[1]]


def _impossible(curves: dict[int, dict[int, float]], file: Path) -> dict[int, dict[int, float]]:
    """The batch curves of a file cached before :func:`calibrate` checked its timings that have :func:`_dearer`
    sizes, each named in a warning."""
    found = {}
    for batch, curve in sorted(curves.items()):
        dearer = _dearer(curve)
        if dearer:
            found[batch] = curve
            logger.warning("cost model: %s prices a verify step of %d tokens at batch %d at %.1fx a step of 1 token, "
                           "more than decoding them one by one (cached while the machine was busy?): measuring it "
                           "again", file, dearer[0], batch, curve[dearer[0]] / curve[1])
    return found


def load_cost_model(runner, config: CalibrationConfig | None = None, cache_dir: str | Path | None = None,
                    install_rows: bool = True, batch: int = 1) -> CostModel:
    """The cost model of ``runner`` on this machine: from this process's memo, the disk cache, or measured
    (now: every batch size a call of ``batch`` sequences meets as its rows finish, 1, 2, 4, ... up to its own;
    others when first asked for). Installs the CPU row policy first, unless ``install_rows=False`` (a draft model:
    it runs under the target's policy, which is process-wide)."""
    config = config or CalibrationConfig()
    if install_rows:
        ensure_row_policy(runner, config, cache_dir)
    if _plan(runner, 1, config) is None:  # no room for two verify sizes: price every token at a decode step
        logger.info("a context of %d tokens is too short to measure verify costs: speculation='auto' decodes "
                    "plainly", runner.shape.max_positions)
        return CostModel({"unmeasured": True}, {1: {1: 1.0, 2: 2.0}}, None, config, measured=False)
    key = machine_key(runner) | {"model": model_structure(runner), "rows": row_policy.active_cols(runner.dtype),
                                 # curves timed with accepted chains (specdec.verify_cost) are measured again
                                 "workload": asdict(config), "chain": "rejected"}
    if times_whole_grid(runner):  # older curves of this device, whose batches stopped short, are measured again
        key["batch_grid"] = "whole"
    if getattr(runner, "invariant", False):  # the bit-exact mode's products of row blocks: its own curve
        key["invariant"] = True
    key = json.loads(json.dumps(key))  # as it reads back from JSON (tuples -> lists, int keys -> str)
    memo, file = _cache_file(cache_dir, f"verify-{_digest(key)}.json")
    curves, unchecked = _MEMO.get(memo), {}
    if curves is None:
        data = read_cache(file)
        curves = _cached_curves(data, key, file)
        unchecked = {} if data is None or data.get("checked") else _impossible(curves, file)
        curves = {b: c for b, c in curves.items() if b not in unchecked}
    # shared: a batch size measured later is seen by every engine of this key (and written to disk)
    _memo_put(_MEMO, memo, curves)
    model = CostModel(key, curves, runner, config, file)
    if unchecked:
        model.save()  # without them: each is measured again when first needed
    model.measure_up_to(batch)  # not in the middle of a call, as its batch shrinks (the step's timing counted it)
    return model
