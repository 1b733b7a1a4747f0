"""Counting the device work a piece of code launches, on any machine: aten ops that are not views or allocations,
plus Triton kernel launches (under ``TRITON_INTERPRET=1`` a kernel's inner tensor ops are not counted).

    with Launches() as counter:
        engine.step()
    counter.ops            # Counter: op name -> launches issued by the host one by one
    counter.inside_ops     # ... those issued while ``counter.inside`` > 0 (e.g. inside a replayed graph)

Counts, not times: on a GPU each launch costs the host a few microseconds and the GPU at least one kernel's start.
Used by ``benchmarks/count_launches.py`` and by the tests that bound what a step launches.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# views, allocations, the interpreter's own argument handling and the conjugate / negative-bit checks that
# ``.numpy()`` and ``.tolist()`` make (they return the tensor itself unless it carries such a bit): no device work
NOT_LAUNCHES = {"view", "_unsafe_view", "slice", "split", "split_with_sizes", "as_strided", "t", "transpose", "expand",
                "unsqueeze", "squeeze", "select", "detach", "detach_", "alias", "permute", "reshape", "unbind",
                "lift_fresh", "empty", "empty_like", "empty_strided", "scalar_tensor", "resolve_conj", "resolve_neg"}


def _aliases(func, out, args) -> bool:
    """An op that writes nothing (neither in place nor into an ``out=`` tensor) and returns its first argument's memory:
    a view (``flatten``, ``unflatten`` of a contiguous tensor, ...) or a no-op (``to`` its own dtype, ``contiguous``
    of a contiguous tensor): no device work. Meta tensors and tensors without storage are never taken for one."""
    if (func._schema.is_mutable or not isinstance(out, torch.Tensor) or not args
            or not isinstance(args[0], torch.Tensor) or out.device.type == "meta" or out.numel() == 0):
        return False
    try:
        return out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # sparse, mkldnn, wrapper subclasses: no storage to compare
        return False


class Launches(TorchDispatchMode):
    """Counts aten ops that launch device work (while ``paused`` is 0) and Triton kernel launches; into ``ops`` while
    ``inside`` is 0, into ``inside_ops`` while it is not."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.inside_ops: collections.Counter = collections.Counter()
        self.paused = self.inside = 0
        self._runs: list = []  # (class, its own launch) of the Triton launches wrapped while counting

    def count(self, name: str) -> None:
        if not self.paused:
            (self.inside_ops if self.inside else self.ops)[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in NOT_LAUNCHES and not _aliases(func, out, args):
            self.count(name)
        return out

    def __enter__(self):
        try:
            import triton.runtime.interpreter as interpreter
            import triton.runtime.jit as jit
        except ImportError:  # no Triton: aten ops only
            return super().__enter__()
        counter = self
        # the interpreter's launches (every Triton 3.x runs a grid's programs in GridExecutor.__call__, which 3.0-3.2
        # reach from ``kernel[grid]`` without InterpretedFunction.run), a GPU's
        for cls, method in ((interpreter.GridExecutor, "__call__"), (jit.JITFunction, "run")):
            real = getattr(cls, method)

            def run(fn, *args, real=real, **kwargs):  # a kernel launch: counted once, its inner tensor ops not at all
                if not kwargs.get("warmup"):  # a warm-up compiles only
                    counter.count(f"triton:{fn.fn.__name__}")
                counter.paused += 1
                try:
                    return real(fn, *args, **kwargs)
                finally:
                    counter.paused -= 1

            setattr(cls, method, run)
            self._runs.append((cls, method, real))
        return super().__enter__()

    def __exit__(self, *exc):
        while self._runs:
            cls, method, real = self._runs.pop()
            setattr(cls, method, real)
        return super().__exit__(*exc)
