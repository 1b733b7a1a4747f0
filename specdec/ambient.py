"""The torch global state a ``generate()`` call runs under, whatever its caller left set.

Callers generate from their own programs: inside a training loop, under ``torch.autocast``, after
``torch.set_default_device("cuda")``. Two of those settings would change what specdec computes, so
:func:`neutral_torch_state` sets them back for the duration of the call (and only then: both are restored on exit):

- **autocast** (the CPU's and CUDA's): off. specdec computes in the model's own
  dtype, as its plain decoding does; under autocast its paged KV cache (the model's dtype) would receive bf16 keys.
  Said once per process at warning level: to generate in bf16, cast the model.
- **a default device** other than the CPU: the CPU again. specdec creates its host-side tensors (draft trees, block
  tables) without a device, as tensors of the CPU, and gives every tensor meant for the model's device its device.

Everything else is read as it is or cannot matter: grad mode (every forward runs under ``torch.inference_mode``, so
no autograd graph is built, also for weights that require grad), the default dtype (every tensor specdec computes
with has an explicit dtype; transformers' sequence-bias processors, which make theirs in it, are prepared from
float32 values: specdec/logits_processing.py), the thread count (the CPU row policy is kept per thread count),
deterministic algorithms, matmul precision and ``torch.backends`` flags (the model's own forward runs under them
too). Nothing here costs anything when neither setting is on. docs/serving.md lists every state checked.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)
_WARNED_AUTOCAST: set[str] = set()  # device types whose autocast was already said to be ignored (once per process)


@contextlib.contextmanager
def neutral_torch_state() -> Iterator[None]:
    """Autocast off (the CPU's and CUDA's) and the default device the CPU while the block runs; both back as they
    were after it. Thread-local, as torch keeps both."""
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device_type):
                if device_type not in _WARNED_AUTOCAST:
                    _WARNED_AUTOCAST.add(device_type)
                    logger.warning("torch.autocast is on for %s: specdec's generate() computes in the model's own "
                                   "dtype, not in %s (to generate in it, cast the model: model.to(dtype)); said once",
                                   device_type, torch.get_autocast_dtype(device_type))
                stack.enter_context(torch.autocast(device_type, enabled=False))
        if torch.get_default_device().type != "cpu":
            stack.enter_context(torch.device("cpu"))
        yield
