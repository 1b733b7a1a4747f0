"""What a CUDA graph captures must not need the host: checked on any machine, the GPU's failure seen on the CPU.

A capture refuses the host waiting for a value (a tensor's item or truth value, a boolean mask's indices) and a
copy from host memory; where it is refused, specdec logs it once and verifies or drafts eagerly from then on, which
a GPU run shows only as lost speed. These tests run every callable that specdec captures (a verify bucket's
forward, with and without EAGLE-3's feature layers, a draft model's bucket, EAGLE's whole drafting call: greedy,
over a reduced vocabulary and coupled) under :class:`CaptureHazards`, from each callable's second run on: the
first is the capture's warm-up, which may upload what later runs reuse (a bucket's tile lists). A replay repeats
the captured run's host values (Python numbers given to ops, kernels' grids and scalar arguments), so every later
run of a bucket must trace what its second run traced.
"""
from __future__ import annotations

import pytest
from specdec.kernels.testing import PADDED_ROWS_WARNINGS, kernel_device, triton_tiny_model

DEVICE = kernel_device()  # sets TRITON_INTERPRET=1 without a GPU: must run before triton is imported
pytest.importorskip("triton")

import collections  # noqa: E402
import dataclasses  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from specdec.drafters.draft_model import DraftModelDrafter  # noqa: E402
from specdec.drafters.eagle import EagleDrafter  # noqa: E402
from specdec.drafters.eagle_graphs import EagleGraphs  # noqa: E402
from specdec.drafters.eagle_model import EagleConfig, EagleModel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import specdec  # noqa: E402
from specdec import host_copy  # noqa: E402
from specdec.cuda_graphs import GraphedForward  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.models.llama import LlamaRunner  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.testing import RandomTreeDrafter, build_tiny_model  # noqa: E402

VOCAB = 64
ROOT = Path(specdec.__file__).resolve().parents[1]  # the checkout: specdec/, drafters/, kernels/
pytestmark = [pytest.mark.filterwarnings(w) for w in PADDED_ROWS_WARNINGS]  # padded rows' garbage


class CaptureHazards(TorchDispatchMode):
    """Records, as "op at file:line" (the innermost frame of specdec's own code), what a capture refuses: a host
    wait (an item or truth value, a boolean mask's indices or selection, a unique), a tensor built from host data
    (beyond a 0-d scalar), and a host read (``tolist``, ``cpu``, ``numpy``); and ``specdec.host_copy``'s copies,
    which a capture may take but would replay from the same pinned buffer, stale. ``trace`` keeps every op and
    Triton launch with its arguments' shapes and host values, what a replay repeats. A launch's inside runs
    unwatched: under the interpreter its argument copies are the interpreter's, not specdec's."""

    WAITS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2", "unique_dim",
             "unique_consecutive"}  # item and is_nonzero: what inference mode dispatches instead of the first
    HOST_READS = ("tolist", "cpu", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.trace: list[tuple] = []  # every op and kernel launch with its arguments' shapes and host values
        self.paused = 0
        self._saved: dict = {}

    def note(self, what: str) -> None:
        if self.paused:
            return
        frame = sys._getframe(1)
        # the repository's own frames, not its tests' (ROOT + "/": a sibling such as ROOT + "_venv" holding torch is
        # not the repository)
        while frame is not None and not (frame.f_code.co_filename.startswith(str(ROOT) + os.sep)
                                         and "/tests/" not in frame.f_code.co_filename):
            frame = frame.f_back
        where = "?" if frame is None else f"{Path(frame.f_code.co_filename).relative_to(ROOT)}:{frame.f_lineno}"
        self.found.append(f"{what} at {where}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused:
            self.trace.append((str(func), _signature(args), _signature(kwargs or {})))
        if name in self.WAITS:
            self.note(name)
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            self.note(f"{name} by a boolean mask")
        elif name in ("lift_fresh", "lift_fresh_copy") and args[0].dim() > 0:
            self.note("a tensor from host data")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        import triton.runtime.interpreter as interpreter

        mode = self

        def unwatched(real):
            def run(kernel, *args, **kwargs):  # a launch: its grid and host values are what a replay repeats
                if not mode.paused:
                    mode.trace.append((f"triton:{kernel.fn.__name__}", _signature(args), _signature(kwargs)))
                mode.paused += 1
                try:
                    return real(kernel, *args, **kwargs)
                finally:
                    mode.paused -= 1
            return run

        def noted(real, what):
            def call(*args, **kwargs):
                mode.note(what)
                return real(*args, **kwargs)
            return call

        self._saved = {(interpreter.InterpretedFunction, "run"): interpreter.InterpretedFunction.run}
        interpreter.InterpretedFunction.run = unwatched(interpreter.InterpretedFunction.run)
        for n in self.HOST_READS:
            self._saved[torch.Tensor, n] = getattr(torch.Tensor, n)
            setattr(torch.Tensor, n, noted(getattr(torch.Tensor, n), f"Tensor.{n}"))
        copies = (host_copy.to_device, host_copy.copy_to, host_copy.to_host_later)
        for module in [m for m in list(sys.modules.values()) if m is not None]:  # wherever specdec imported them
            for name, value in list(vars(module).items()):
                if any(value is f for f in copies):
                    self._saved[module, name] = value
                    setattr(module, name, noted(value, f"host_copy.{value.__name__}"))
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), real in self._saved.items():
            setattr(owner, name, real)
        return super().__exit__(*exc)


def _signature(value):
    """What a replay repeats of an argument: a tensor's shape and dtype (its values are the device's, read when the
    graph runs), any other value itself (baked into the graph when it was captured)."""
    if isinstance(value, torch.Tensor):
        return "tensor", tuple(value.shape), value.dtype
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _signature(v)) for k, v in value.items())
    if isinstance(value, float):
        return repr(value)  # NaN equals itself
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                           torch.memory_format)):
        return value
    return "callable" if callable(value) else type(value).__name__


def test_the_check_sees_each_hazard_and_where():
    x, tolist = torch.arange(6, device=DEVICE), torch.Tensor.tolist
    with CaptureHazards() as hazards:
        torch.where(x > 2, x, 0).sum()  # no hazard: stays on the device
        x[:2] = -1  # a scalar into a slice: no hazard
        x[x > 2]
        bool(x.any())
        x.tolist()
        torch.tensor([1, 2], device=DEVICE)
    assert [h.split(" at ")[0] for h in hazards.found] == [
        "index by a boolean mask", "_local_scalar_dense", "Tensor.tolist", "a tensor from host data"]
    with torch.inference_mode(), CaptureHazards() as hazards:  # as the engine runs: other ops are dispatched
        y = x + 1
        bool(y.any())
        y.sum().item()
        host_copy.to_device([1, 2], torch.long, DEVICE)  # a capture would replay its pinned buffer, stale
    assert [h.split(" at ")[0] for h in hazards.found] == ["is_nonzero", "item", "host_copy.to_device",
                                                           "a tensor from host data"]
    assert host_copy.to_device.__module__ == "specdec.host_copy" and host_copy.to_device.__name__ == "to_device"
    assert torch.Tensor.tolist is tolist  # restored on exit


@pytest.fixture(scope="module")
def loaded():
    return triton_tiny_model(VOCAB, DEVICE)


def _head(loaded, **config):
    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(loaded.model.config, depth=3, top_k=3, max_nodes=8, **config))
    head.init_from_target(loaded.model)
    return head.to(DEVICE)


def test_what_cuda_graphs_capture_never_needs_the_host(loaded, monkeypatch):
    """Greedy and sampled generations through every kind of captured callable: no hazard in any of their runs
    after the first, every later run the captured one's ops and host values, and each kind ran watched."""
    hazards: dict[str, list[str]] = collections.defaultdict(list)
    watched: collections.Counter = collections.Counter()
    runs: collections.Counter = collections.Counter()
    captured: dict[tuple, list] = {}  # per bucket (and depth): the second run's trace, which a graph would replay
    compared: collections.Counter = collections.Counter()  # later runs checked against it
    alive: list = []  # every bucket seen, kept: a freed one's id() could name a later call's new bucket

    def watching(cls):
        real = cls._run

        def run(self, bucket, *args):
            key = id(bucket), args
            runs[key] += 1
            if runs[key] == 1:  # the capture's warm-up run
                alive.append(bucket)
                return real(self, bucket, *args)
            with CaptureHazards() as mode:
                out = real(self, bucket, *args)
            watched[cls.__name__] += 1
            hazards[cls.__name__].extend(mode.found)
            replayed = captured.setdefault(key, mode.trace)
            compared[cls.__name__] += replayed is not mode.trace
            if mode.trace != replayed:  # a replay would run the captured ops, with the captured host values
                at = next((i for i, (a, b) in enumerate(zip(mode.trace, replayed, strict=False)) if a != b),
                          min(len(mode.trace), len(replayed)))
                hazards[cls.__name__].append(f"run {runs[key]} differs from the captured run at op {at}: "
                                             f"{mode.trace[at:at + 1]} against {replayed[at:at + 1]}")
            return out

        monkeypatch.setattr(cls, "_run", run)

    watching(GraphedForward)
    watching(EagleGraphs)
    small = load_model(build_tiny_model("llama-gqa-tied", VOCAB, seed=7), device=DEVICE)
    small = dataclasses.replace(small, runner=LlamaRunner(small.model, backend="triton"))
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [6, 7, 8]]
    sampled = dict(do_sample=True, temperature=0.9, seed=3)
    drafters = [(RandomTreeDrafter(VOCAB, max_nodes=7, seed=2), {}),
                (EagleDrafter(model=_head(loaded, draft_vocab=tuple(range(0, VOCAB, 2))), adapt_depth=False,
                              cuda_graphs=True), {}),
                (EagleDrafter(model=_head(loaded), adapt_depth=False, cuda_graphs=True),
                 dict(sampler="coupled", **sampled)),
                (EagleDrafter(model=_head(loaded, arch="eagle3", feature_layers=(0, 1, 2)), adapt_depth=False,
                              cuda_graphs=True), {}),
                (DraftModelDrafter(model=small, num_draft_tokens=3, cuda_graphs=True), sampled)]
    for drafter, kw in drafters:
        generate(loaded, prompts, max_new_tokens=10, drafter=drafter, cuda_graphs=True, speculation="always", **kw)
    generate(loaded, prompts[:1], max_new_tokens=4, cuda_graphs=True)  # plain decoding's one-token buckets
    assert dict(hazards) == {k: [] for k in hazards}, dict(hazards)
    if DEVICE == "cuda":  # each bucket runs twice (the warm-up and the capture), then replays
        assert watched["GraphedForward"] >= 3 and watched["EagleGraphs"] >= 1, dict(watched)
    else:  # uncaptured, every call runs the bucket: its later runs are compared with the second
        assert watched["GraphedForward"] >= 10 and watched["EagleGraphs"] >= 3, dict(watched)
        assert compared["GraphedForward"] >= 5 and compared["EagleGraphs"] >= 5, dict(compared)
