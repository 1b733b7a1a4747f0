"""Which attention / KV-cache backend runs: the PyTorch reference or the Triton kernels.

The switch is the environment variable ``SPECDEC_ATTENTION``, read at every call (cheap):

* ``auto`` (default): Triton kernels for CUDA tensors when triton is installed, else the reference.
* ``reference``: always the PyTorch reference (``specdec.attention`` / ``PagedKVCache``).
* ``triton``: always the kernels; on CPU tensors this needs ``TRITON_INTERPRET=1`` set before
  triton is first imported (the interpreter; how the tests check the dispatch path).

This module imports neither torch's CUDA runtime nor triton, so CPU-only installs pay nothing.
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

ENV_VAR = "SPECDEC_ATTENTION"
BACKENDS = ("auto", "reference", "triton")


@lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(BACKENDS)}")
    return value


def use_triton(t: torch.Tensor) -> bool:
    """True when the op on tensor ``t`` should run the Triton kernel."""
    choice = backend()
    if choice == "reference":
        return False
    if choice == "auto":
        return t.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError(f"{ENV_VAR}=triton but triton is not installed (pip install 'specdec[kernels]')")
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") not in ("1", "true", "True"):
        raise RuntimeError(
            f"{ENV_VAR}=triton on {t.device} tensors needs a CUDA device, or TRITON_INTERPRET=1 (set before triton "
            "is imported) to run the kernels in the Triton interpreter"
        )
    return True
