"""Where a decode step's time goes, from one torch.profiler trace: the speed command's profile rows.

    with profiled(device) as trace:
        generate(...)
    summary = trace.summary()          # per step: wall, GPU busy, launches, host waits, engine phases, top kernels
    prefill = trace.summary("add")     # the same of the prefill (Engine.add), each call's one

Only the engine's steps count (from the first ``Engine.step`` to the end of the last; prefill and set-up are left
out), or, with ``unit="add"``, its prefills (the prompt but its last token, one eager forward). Per step it gives
the wall time under the profiler (which adds some per launch: the timed rows give the speed, this gives the
shares), the GPU's busy time (the union of its kernel and copy intervals, not the engine's
``record_function`` ranges the profiler also puts on the device's timeline) and what is left idle, kernels run and
their time by kind (products, attention, norms, other: where a 65-token verify's extra time goes against a decode's),
CUDA-graph launches and launches from the host (and the ops issuing them: of an eager call, each op's kernels), the
host's waits on the device (synchronisations and their seconds), and the host time of each engine phase (propose,
verify_batch, verify, read, accept, commit, ...).
Each kernel and copy is also put under the engine phase that launched it, CUDA-graph replays included: the device
event's ``linked_correlation_id`` is the ``id`` of the innermost op around its launch; a replay's kernels, launched
under no op, share their runtime call's (``cudaGraphLaunch``) correlation ``id``; either host event's ``cpu_parent``
chain leads to the ``engine.<phase>`` range. What leads to none counts under "(unattributed)".
On the CPU (the rehearsal) there are no device events: it counts the aten ops the steps run instead.

:func:`host_python` is the host's other view: one call under ``cProfile``, the Python functions that take the host's
time per step (their own time, and with what they call), so that a step whose device idles for the host names the
code to cut. ``cProfile`` slows Python about twofold: read shares, not speeds. A function's own time includes the
device waits of a blocking read it makes (``tolist``, ``synchronize``), which the profile rows count as syncs.
"""
from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import time
from collections import Counter, defaultdict

import torch

PHASES = ("add", "step", "propose", "verify_batch", "verify", "read", "process", "accept", "keep_new_hidden", "commit")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel")
GRAPH_CALLS = ("cudaGraphLaunch", "cuGraphLaunch")
TOP_KERNELS = 24  # the report names 8; the JSON keeps these
TOP_OPS = 16  # ops kept by the launches they issue from the host
TOP_PHASE_KERNELS = 12  # kept per engine phase in the JSON; the report names 3
TOP_PYTHON = 24  # host_python: functions kept by own time in the JSON; the report names 12
UNATTRIBUTED = "(unattributed)"  # device events whose launch leads to no engine phase
RUNTIME_CALL = re.compile(r"cu(da)?[A-Z]")  # a CUDA runtime or driver call (cudaLaunchKernel, cuGraphLaunch, ...)
# kernel kinds by name (lower case), first match wins: the tree attention (kernels/tree_attention.py), invariant
# attention, SDPA / flash / CUTLASS fmha; cuBLAS / cuBLASLt / CUTLASS products,
# Triton matmuls and specdec's invariant linear; norms. The rest is "other"; KINDS is the order they are reported in
KERNEL_KINDS = (("attention", ("attn", "attention", "flash", "fmha", "sdpa")),
                ("products", ("gemm", "gemv", "matmul", "nvjet", "cutlass", "xmma", "splitkreduce", "_linear_kernel")),
                ("norms", ("norm",)))
KINDS = ("products", "attention", "norms", "other")


@contextlib.contextmanager
def _annotated_engine():
    """Each engine phase inside a profiler range named ``engine.<phase>`` (restored afterwards)."""
    from specdec.engine import Engine

    saved = {name: Engine.__dict__[name] for name in PHASES}  # as defined: a staticmethod stays one

    def annotate(name, attr):
        method = attr.__func__ if isinstance(attr, staticmethod) else attr

        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(f"engine.{name}"):
                return method(*args, **kwargs)
        return staticmethod(wrapper) if isinstance(attr, staticmethod) else wrapper

    try:
        for name, attr in saved.items():
            setattr(Engine, name, annotate(name, attr))
        yield
    finally:
        for name, attr in saved.items():
            setattr(Engine, name, attr)


def host_python(run, steps_of, top: int = TOP_PYTHON) -> dict:
    """``run()`` under ``cProfile``: its steps (``steps_of(run())``), wall ms per step under the profiler, and by own
    time the ``top`` functions of specdec's packages (``functions``) and the ``top // 3`` others (``others``: torch's
    ops, built-ins; on a GPU launches and blocking reads), each with its calls, own and cumulative microseconds per
    step (module doc). A function is named ``dir/file.py:line(name)``, a built-in by its repr."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    try:
        out = run()
    finally:
        prof.disable()
    wall = time.perf_counter() - t0
    steps = max(int(steps_of(out)), 1)
    ours = _package_dirs()
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: kv[1][2], reverse=True)  # by own seconds

    def listed(keep, n):
        return [dict(name=_function_name(key, ours), calls_per_step=calls / steps, own_us_per_step=1e6 * own / steps,
                     cum_us_per_step=1e6 * cum / steps)
                for key, (_, calls, own, cum, _) in [r for r in rows if keep(r[0][0].startswith(ours))][:n]]

    return dict(steps=steps, wall_ms_per_step=1e3 * wall / steps, functions=listed(bool, top),
                others=listed(lambda mine: not mine, top // 3))


def _package_dirs() -> tuple[str, ...]:
    """The directories of specdec's packages (its subpackages may live apart from it: an editable install)."""
    import specdec.drafters
    import specdec.eval
    import specdec.kernels

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["specdec"], specdec.drafters,
                                                                 specdec.eval, specdec.kernels))


def _function_name(key: tuple[str, int, str], ours: tuple[str, ...] = ()) -> str:
    """A pstats key as ``path:line(name)``: in one of the package directories ``ours`` the path from that package
    on (``specdec/models/llama.py``, ``drafters/eagle.py``), elsewhere the file's last two path parts; a built-in
    by its name (without the address a function's repr carries)."""
    file, line, name = key
    if file == "~" or not file:
        return re.sub(r" at 0x[0-9a-f]+", "", name)
    home = next((d for d in ours if file.startswith(d)), None)
    path = (os.path.basename(home.rstrip(os.sep)) + "/" + file[len(home):] if home else
            "/".join(file.split(os.sep)[-2:]))
    return f"{path.replace(os.sep, '/')}:{line}({name})"


def host_python_lines(host: dict | None) -> list[str]:
    """The report's lines for one model's :func:`host_python` row (bench_speed_gpu.markdown)."""
    if not host:
        return []

    def named(rows):
        return "; ".join(f"`{f['name']}` {f['own_us_per_step']:.0f} ({f['cum_us_per_step']:.0f}), "
                         f"{f['calls_per_step']:.1f} calls" for f in rows)

    return ["", f"{host['call']}, host Python under cProfile ({host['steps']} steps, {host['wall_ms_per_step']:.3f} "
                f"ms/step wall under it), by own time, us/step (cumulative): specdec's functions "
                f"{named(host['functions'][:12])}; others {named(host['others'][:6])}"]


class Trace:
    def __init__(self) -> None:
        self.events = None

    def summary(self, unit: str = "step") -> dict:
        return summarize(self.events, unit)


@contextlib.contextmanager
def profiled(device: torch.device):
    """Profile the block (CPU, and CUDA on a CUDA device) with the engine's phases annotated; the device is waited
    for before the trace closes."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace = Trace()
    with _annotated_engine(), torch.profiler.profile(activities=activities) as prof:
        yield trace
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    trace.events = prof.events()


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _is_device(event) -> bool:
    """A kernel or copy on the device: not a host event, nor a ``record_function`` range (the engine's phases)
    projected onto the device's timeline, which spans the gaps between the kernels it holds."""
    return event.device_type != torch.autograd.DeviceType.CPU and not getattr(event, "is_user_annotation", False)


def _launching_op(launch) -> str:
    """The op that issued a host launch: the outermost aten op above it, else the innermost range that is no engine
    phase (a Triton kernel's launch sits under no aten op), else "(none)"."""
    aten, other, parent = None, None, launch.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            aten = parent.name
        elif other is None and not parent.name.startswith("engine."):
            other = parent.name
        parent = parent.cpu_parent
    return aten or other or "(none)"


def _phase(event) -> str | None:
    """The innermost engine phase around a host event (itself included), without "engine.", or None."""
    while event is not None:
        if event.name.startswith("engine."):
            return event.name[len("engine."):]
        event = event.cpu_parent
    return None


def _linked(event) -> int:
    """The id of the op around a device event's launch, 0 where none; torch 2.11's events have no such field (the
    H200 image's): there each kernel is found by its runtime call's correlation id, as a graph replay's are."""
    return getattr(event, "linked_correlation_id", 0)


def _phase_finders(events):
    """Two functions: the engine phase of a host event, and that of a device event's launch. A device event's launch
    is the host op linked to it (``linked_correlation_id`` is the innermost op's ``id``), else the runtime call with
    its correlation ``id`` (a CUDA-graph replay's kernels: ``cudaGraphLaunch`` runs under no op), else there is none
    (UNATTRIBUTED). A host event whose ``cpu_parent`` chain holds no phase (a runtime call linked to no op is put on
    the thread reading the trace) takes the innermost phase range around its start."""
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    calls = {e.id: e for e in host if RUNTIME_CALL.match(e.name)}  # CUPTI's ids: a call shares its kernels'
    ops = {e.id: e for e in host if not RUNTIME_CALL.match(e.name) and not _linked(e)}  # the profiler's
    ranges = [e for e in host if e.name.startswith("engine.")]
    seen: dict[int, str] = {}  # by id(): a graph replay's kernels share one launch

    def around(t: float) -> str | None:
        inside = [r for r in ranges if r.time_range.start <= t <= r.time_range.end]
        return _phase(min(inside, key=lambda r: r.time_range.end - r.time_range.start)) if inside else None

    def of_host(event) -> str:
        if id(event) not in seen:
            seen[id(event)] = _phase(event) or around(event.time_range.start) or UNATTRIBUTED
        return seen[id(event)]

    def of_device(event) -> str:
        linked = _linked(event)
        launch = (ops.get(linked) if linked else None) or calls.get(event.id)
        return UNATTRIBUTED if launch is None else of_host(launch)
    return of_host, of_device


def _by_phase(events, device, host, n: int) -> dict:
    """Per engine phase, per step: its kernels and their time, its copies, its CUDA-graph replays, its top kernels
    (with their count); the phases by kernel time, largest first."""
    of_host, of_device = _phase_finders(events)
    per: dict[str, dict] = defaultdict(lambda: dict(kernels=defaultdict(list), copies=[], replays=0))
    for e in device:
        entry = per[of_device(e)]
        if e.name.startswith(("Memcpy", "Memset")):
            entry["copies"].append(e.time_range.end - e.time_range.start)
        else:
            entry["kernels"][e.name].append(e.time_range.end - e.time_range.start)
    for e in host:
        if e.name in GRAPH_CALLS:
            per[of_host(e)]["replays"] += 1
    out = {}
    for name, entry in per.items():
        kernels = entry["kernels"]
        top = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:TOP_PHASE_KERNELS]
        out[name] = dict(
            kernels=sum(len(d) for d in kernels.values()) / n,
            kernel_ms=sum(sum(d) for d in kernels.values()) / n / 1e3,
            copies=len(entry["copies"]) / n, copy_ms=sum(entry["copies"]) / n / 1e3,
            graph_replays=entry["replays"] / n,
            top_kernels=[dict(name=kernel_label(k), per_step=len(d) / n, us_per_step=sum(d) / n) for k, d in top])
    return dict(sorted(out.items(), key=lambda kv: (-kv[1]["kernel_ms"], -kv[1]["kernels"], kv[0])))


# identifiers in a PyTorch kernel's template arguments that name its machinery, not the op it computes
_GENERIC = {"gpu_kernel_impl", "gpu_kernel_impl_nocast", "BinaryFunctor", "AUnaryFunctor", "BUnaryFunctor",
            "elementwise_kernel", "unrolled_elementwise_kernel", "vectorized_elementwise_kernel", "ReduceOp",
            "func_wrapper_t", "OffsetCalculator", "TrivialOffsetCalculator", "LoadWithCast", "StoreWithCast",
            "LoadWithoutCast", "StoreWithoutCast", "TensorIteratorBase", "operator", "lambda"}
_OP_WORD = re.compile(r"[A-Za-z_]\w*(?:Functor\w*|Ops|Epilogue|_kernel\w*|_impl\w*)")
_DTYPE_WORD = re.compile(r"\b(c10::BFloat16|c10::Half|float|double|long|int|bool|unsigned char|signed char)\b")


def kernel_label(name: str, width: int = 100) -> str:
    """A kernel's name, short enough for a report line and still telling kernels apart: a C++ template kernel
    (PyTorch's elementwise, reduce and index kernels: ``void at::native::elementwise_kernel<128, 4,
    at::native::gpu_kernel_impl_nocast<...MulFunctor<float>...>>(...)``) as its function and the ops and first
    dtype its template names (``elementwise_kernel[MulFunctor; c10::BFloat16]``), where truncation left only the
    shared prefix; other names (Triton's, cuBLAS's) as they are, cut at ``width``."""
    if not name.startswith("void ") or "<" not in name:
        return name[:width]
    head, _, rest = name[len("void "):].replace("(anonymous namespace)::", "").partition("<")
    base = head.split("(")[0].removeprefix("at::native::")
    ops = []
    for word in _OP_WORD.findall(rest):
        short = word.split("::")[-1]
        if short not in _GENERIC and short != base.split("::")[-1] and short not in ops:
            ops.append(short)
    dtype = _DTYPE_WORD.search(rest)
    detail = ", ".join(ops[:2]) + (f"; {dtype.group(1)}" if dtype else "")
    return (f"{base}[{detail}]" if detail else base)[:width]


def kernel_kind(name: str) -> str:
    """products, attention, norms or other: what a kernel of that name computes (KERNEL_KINDS)."""
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def summarize(events, unit: str = "step") -> dict:
    """The per-step figures of the module doc, from a profiler's events (``prof.events()``); ``unit="add"``: per
    prefill (the figures' "step" is then an ``Engine.add``)."""
    steps = [e for e in events if e.name == f"engine.{unit}" and e.device_type == torch.autograd.DeviceType.CPU]
    if not steps:
        raise ValueError(f"the profiled block ran no engine {unit}")
    start, end = min(e.time_range.start for e in steps), max(e.time_range.end for e in steps)
    n = len(steps)

    def inside(e) -> bool:
        return start <= e.time_range.start and e.time_range.end <= end

    window = [e for e in events if inside(e)]
    device = [e for e in window if _is_device(e)]
    host = [e for e in window if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    copies = Counter(e.name.split(" (")[0] for e in device if e.name.startswith(("Memcpy", "Memset")))
    wall_us = end - start
    busy_us = _union_us([(e.time_range.start, e.time_range.end) for e in device])
    syncs = [e for e in host if e.name in SYNC_CALLS]
    phases: dict[str, float] = defaultdict(float)
    for e in host:
        if e.name.startswith("engine.") and e.name != f"engine.{unit}":
            phases[e.name[len("engine."):]] += e.time_range.end - e.time_range.start
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_kernel[e.name].append(e.time_range.end - e.time_range.start)
    kernel_us = sum(sum(d) for d in per_kernel.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, d in per_kernel.items():
        by_kind[kernel_kind(name)] += sum(d)
    top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    top_aten = Counter(e.name for e in host if e.name.startswith("aten::")
                       and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    by_op = Counter(_launching_op(e) for e in host if e.name in LAUNCH_CALLS)
    return dict(
        steps=n,
        wall_ms_per_step=wall_us / n / 1e3,
        gpu_busy_ms_per_step=busy_us / n / 1e3 if device else None,
        gpu_idle_share=1.0 - busy_us / wall_us if device and wall_us > 0 else None,
        kernels_per_step=len(kernels) / n,
        kernel_ms_per_step=kernel_us / n / 1e3,  # summed, overlaps counted twice (streams): <= busy only on one
        # the same by kind (products, attention, norms, other): where a larger step's extra device time goes
        kernel_ms_by_kind={k: by_kind[k] / n / 1e3 for k in KINDS if k in by_kind},
        graph_launches_per_step=sum(e.name in GRAPH_CALLS for e in host) / n,
        host_launches_per_step=sum(e.name in LAUNCH_CALLS for e in host) / n,
        copies_per_step={k: v / n for k, v in sorted(copies.items())},
        syncs_per_step=len(syncs) / n,
        sync_wait_ms_per_step=sum(e.time_range.end - e.time_range.start for e in syncs) / n / 1e3,
        phases_ms_per_step={k: v / n / 1e3 for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
        aten_ops_per_step=sum(top_aten.values()) / n,
        # the host's kernel launches (outside CUDA graphs) by the outermost aten op issuing them: which ops of an
        # eager call launch many kernels each on the device (its CPU count is the op's; a GPU's, its kernels')
        host_launches_by_op={k: v / n for k, v in by_op.most_common(TOP_OPS)},
        aten_ops_by_name={k: v / n for k, v in top_aten.most_common(TOP_OPS)},  # outermost ones
        top_kernels=[dict(name=kernel_label(name), per_step=len(d) / n, us_per_step=sum(d) / n,
                          share=sum(d) / kernel_us if kernel_us else None) for name, d in top],
        # the kernels, copies and graph replays by the engine phase launching them (empty on the CPU)
        kernels_by_phase=_by_phase(events, device, host, n) if device else {},
    )


def _few(x: float) -> str:
    """A count or time per step, short: whole from 10 up, two digits below (0.5, 1.5, 3)."""
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def markdown_rows(model: dict) -> list[str]:
    """The report's lines for one model's profile rows (bench_speed_gpu.markdown)."""
    rows = model.get("profile") or []
    if not rows:
        return []
    lines = ["", "Profile (torch.profiler, which adds time per launch: shares, not speeds; a prefill row's step is one "
                 "prefill, the prompt but its last token):", "",
             "| call | steps | wall ms/step | GPU busy ms/step | GPU idle | kernels/step | graph launches/step | "
             "host launches/step | syncs/step (wait ms) | host phases, ms/step |", "|---" * 10 + "|"]
    for r in rows:
        s = r["summary"]
        busy = "-" if s["gpu_busy_ms_per_step"] is None else f"{s['gpu_busy_ms_per_step']:.3f}"
        idle = "-" if s["gpu_idle_share"] is None else f"{100 * s['gpu_idle_share']:.0f}%"
        phases = ", ".join(f"{k} {v:.3f}" for k, v in s["phases_ms_per_step"].items())
        kernels = (f"{s['kernels_per_step']:.0f}" if s["gpu_busy_ms_per_step"] is not None
                   else f"({s['aten_ops_per_step']:.0f} aten ops)")
        lines.append(f"| {r['call']} | {s['steps']} | {s['wall_ms_per_step']:.3f} | {busy} | {idle} | {kernels} | "
                     f"{s['graph_launches_per_step']:.1f} | {s['host_launches_per_step']:.1f} | "
                     f"{s['syncs_per_step']:.1f} ({s['sync_wait_ms_per_step']:.3f}) | {phases} |")
    for r in rows:
        s = r["summary"]  # older reports have no kinds
        if s.get("kernel_ms_by_kind"):
            lines += ["", f"{r['call']}, kernel time by kind, ms/step: " + ", ".join(
                f"{k} {v:.3f}" for k, v in s["kernel_ms_by_kind"].items())
                + f" (all {s['kernel_ms_per_step']:.3f}; GPU busy {s['gpu_busy_ms_per_step']:.3f} of "
                  f"{s['wall_ms_per_step']:.3f} wall)"]
        if r["summary"]["top_kernels"]:
            lines += ["", f"{r['call']}, kernels by GPU time: " + "; ".join(
                f"`{k['name'][:48]}` {k['per_step']:.0f}/step {k['us_per_step']:.0f} us ({100 * k['share']:.0f}%)"
                for k in r["summary"]["top_kernels"][:8])]
        phases = r["summary"].get("kernels_by_phase")  # older reports have none; the CPU's is empty
        if phases:
            lines += ["", f"{r['call']}, kernels by the engine phase launching them, per step: " + "; ".join(
                f"**{p}** {_few(v['kernels'])} ({v['kernel_ms']:.3f} ms"
                + (f", graph replays {_few(v['graph_replays'])}" if v["graph_replays"] else "") + ")"
                + "".join(f", `{k['name'][:48]}` {_few(k['per_step'])}x {_few(k['us_per_step'])} us"
                          for k in v["top_kernels"][:3])
                for p, v in phases.items())]
        s = r["summary"]  # reports before 2026-11-30 have neither count by op
        what, ops = (("host launches", s["host_launches_by_op"]) if s.get("host_launches_by_op") else
                     ("aten ops", s.get("aten_ops_by_name")))  # the CPU's: no launches
        if ops:
            lines += ["", f"{r['call']}, {what} by the op issuing them: " + "; ".join(
                f"`{op}` {v:.1f}/step" for op, v in list(ops.items())[:10])]
    return lines
