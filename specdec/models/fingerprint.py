"""A model's identity by content: the same fingerprint means the same config and (sampled) weights.

Used wherever a result or a cache is kept for one model and must not be reused for another of the same name or
path: an acceptance run's settings, a replay record, a training checkpoint, the self-distillation caches. It reads
the config (without the path it was loaded from) and a few thousand evenly strided values of every tensor, so a
retrained checkpoint saved over the old one is told apart in milliseconds per tensor.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

WEIGHT_SAMPLES = 4096  # evenly strided entries per tensor that a model fingerprint reads


def model_fingerprint(model: Any) -> str:
    """SHA-256 (16 hex digits) of a model's config (without the path it was loaded from) and, for every parameter
    and buffer, its name, shape, dtype and :data:`WEIGHT_SAMPLES` evenly strided values: another checkpoint in a
    folder of the same name tells apart, at the cost of reading a few thousand values per tensor."""
    import torch

    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        fields = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            flat = t.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // WEIGHT_SAMPLES)].float().cpu()
            h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode() + sample.numpy().tobytes())
    return h.hexdigest()[:16]
