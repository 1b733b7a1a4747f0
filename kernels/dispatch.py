"""Which ops run the engine: the PyTorch reference or the Triton kernels, chosen ONCE.

:func:`resolve_backend` is called when a :class:`~specdec.models.llama.LlamaRunner` or a
:class:`~specdec.kv_cache.PagedKVCache` is built; they store the :class:`Backend` and every
forward, KV write and compaction uses it without looking again. The choice:

* ``auto`` (default): Triton kernels for a CUDA device when triton is installed, else the reference.
* ``reference``: always the PyTorch reference (``specdec.attention`` / ``PagedKVCache``).
* ``triton``: always the kernels; on a CPU device this needs ``TRITON_INTERPRET=1`` set before
  the kernel modules are first imported (the interpreter; how the tests check the kernel path).

It comes from the ``backend=`` argument of the runner / cache, else from the environment variable
``SPECDEC_ATTENTION`` at that moment. A generate() call builds its cache with its runner's backend,
so one engine never mixes the two. Importing this module imports neither torch's CUDA runtime nor
triton: CPU-only installs pay nothing; the kernel modules are imported once, when a Triton backend
is first resolved.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

import torch

from specdec.errors import InputError, SpecdecError

ENV_VAR = "SPECDEC_ATTENTION"
CHOICES = ("auto", "reference", "triton")


class BackendError(SpecdecError, RuntimeError):
    """The requested backend cannot run here (no triton, or Triton on CPU without the interpreter)."""


@dataclass(frozen=True)
class Backend:
    """The resolved choice. On the Triton backend the kernel modules are attributes, looked up at call
    time (``backend.fused.silu_mul(...)``), so a test that patches a module function still sees the call."""

    name: str  # "reference" | "triton"
    attention: ModuleType | None = None  # specdec.kernels.tree_attention
    kv: ModuleType | None = None  # specdec.kernels.kv_write
    fused: ModuleType | None = None  # specdec.kernels.fused_ops
    invariant: ModuleType | None = None  # specdec.kernels.invariant_ops (the bit-exact mode)

    @property
    def triton(self) -> bool:
        return self.name == "triton"

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


REFERENCE = Backend("reference")


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@lru_cache(maxsize=1)
def _triton_backend() -> Backend:
    def load(name: str) -> ModuleType:
        return importlib.import_module(f"specdec.kernels.{name}")

    return Backend("triton", load("tree_attention"), load("kv_write"), load("fused_ops"), load("invariant_ops"))


def requested(choice: str | None = None) -> str:
    """The choice as asked for: ``choice`` if given, else the environment variable (default auto)."""
    value = os.environ.get(ENV_VAR, "auto") if choice is None else choice
    value = value.strip().lower() or "auto"
    if value not in CHOICES:
        source = "backend=" if choice is not None else f"{ENV_VAR}="
        raise InputError(f"{source}{value!r}: expected one of {', '.join(CHOICES)}")
    return value


def resolve_backend(device: torch.device | str, choice: str | Backend | None = None) -> Backend:
    """The backend for tensors on ``device``; ``choice`` overrides the environment variable."""
    if isinstance(choice, Backend):
        return choice
    value = requested(choice)
    device = torch.device(device)
    if value == "reference" or (value == "auto" and not (device.type == "cuda" and triton_available())):
        return REFERENCE
    if not triton_available():
        raise BackendError(f"{ENV_VAR}=triton but triton is not installed (pip install 'specdec[kernels]')")
    backend = _triton_backend()
    if device.type != "cuda" and not all(_interpreted(backend)):
        value = os.environ.get("TRITON_INTERPRET")
        if value is None or value.strip().lower() in ("", "0", "false", "off", "no", "n"):
            raise BackendError(
                f"the Triton backend on {device} needs a CUDA device, or TRITON_INTERPRET=1 (set before specdec's "
                "kernels are imported) to run the kernels in the Triton interpreter"
            )
        raise BackendError(
            f"the Triton backend on {device}: TRITON_INTERPRET={value} is set, but specdec's kernels were imported "
            "before it was (or this triton does not read it as on) and would run compiled for a GPU: set "
            "TRITON_INTERPRET=1 before anything imports them"
        )
    return backend


def _interpreted(backend: Backend) -> list[bool]:
    """For each Triton function of the backend's kernel modules (the helpers they import included): whether the
    interpreter runs it. Triton decides when a function is decorated, by TRITON_INTERPRET as its release reads it
    then; a module imported before the variable was set runs compiled, and mixed with interpreted ones, fails."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    modules = (backend.attention, backend.kv, backend.fused, backend.invariant)
    return [isinstance(fn, InterpretedFunction) for module in modules for fn in vars(module).values()
            if isinstance(fn, KernelInterface)]
