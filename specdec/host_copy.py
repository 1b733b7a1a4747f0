"""Host values onto the model's device without waiting for it.

A blocking host-to-device copy (``torch.tensor(values, device="cuda")``, ``x.to("cuda")``) synchronises the stream:
the host waits for every kernel queued before it. An engine step builds several small inputs on the host (token
ids, positions, verify rows, ancestor masks, slot rows, the attention kernel's metadata), so each would be a
synchronisation. :func:`to_device` stages them in pinned memory and copies asynchronously (PyTorch keeps the
pinned block until the copy has run); a copy from pageable memory may still synchronise, a pinned one does not.
On other devices it is the plain copy. The step's one synchronisation is then the read of the target's choices.
"""
from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, or a host tensor) as a ``dtype`` tensor on ``device``, copied without a stream sync."""
    device = torch.device(device)
    if isinstance(values, torch.Tensor):
        if values.device == device or device.type != "cuda":
            return values.to(device=device, dtype=dtype)
        return values.to(dtype).pin_memory().to(device, non_blocking=True)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
