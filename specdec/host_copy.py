"""Copies between the host and the model's device without waiting for it.

A blocking host-to-device copy (``torch.tensor(values, device="cuda")``, ``x.to("cuda")``) synchronises the stream:
the host waits for every kernel queued before it. An engine step builds several small inputs on the host (token
ids, positions, verify rows, ancestor masks, slot rows, the attention kernel's metadata), so each would be a
synchronisation. :func:`to_device` stages them in pinned memory and copies asynchronously (PyTorch keeps the
pinned block until the copy has run); a copy from pageable memory may still synchronise, a pinned one does not.
On other devices it is the plain copy. The step's one synchronisation is then the read of the target's choices.
:func:`copy_to` writes a list into an existing device tensor (a CUDA graph's static input) the same way.
:func:`to_host_later` goes the other way for what the host reads later in the step (pending draft trees): the copy
starts now, and waiting for it waits for nothing queued after it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, or a host tensor) as a ``dtype`` tensor on ``device``, copied without a stream sync."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        if values.device == device or device.type != "cuda" or values.device.type != "cpu":  # a device's own copy
            return values.to(device=device, dtype=dtype)
        return values.to(dtype).pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def copy_to(dst: torch.Tensor, values) -> torch.Tensor:
    """``values`` (a list) written into the tensor ``dst`` of its shape, in place, with no stream sync: on CUDA one
    copy from pinned memory (``to_device`` and a copy would be two)."""
    host = torch.tensor(values, dtype=dst.dtype, pin_memory=dst.is_cuda)
    return dst.copy_(host, non_blocking=dst.is_cuda)


def to_host_later(values: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Start copying ``values`` to the host; the returned call gives the host tensor, waiting (on CUDA) for that copy
    alone, through an event, not for work queued after it. Off CUDA the copy is made now (``values`` may be a buffer
    that later work overwrites, such as a CUDA graph's static output)."""
    if not values.is_cuda:
        host = values.clone()
        return lambda: host
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True).copy_(values, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> torch.Tensor:
        copied.synchronize()
        return host

    return wait
