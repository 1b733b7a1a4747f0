"""The ``k`` best scores along the last dimension, as ``torch.topk`` gives them (values, indices; best first).

For ``k == 1`` (a chain's one candidate) it is a single max reduction, the first index among equal maxima. On CUDA
``torch.topk`` over a vocabulary runs a multi-block radix select: two memsets and about six kernels per call, each
a node of a drafting call's CUDA graph, where one reduction does.
"""
from __future__ import annotations

import torch


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (values, indices), each ``scores.shape[:-1] + (k,)``, the best first."""
    if k == 1:
        return scores.max(dim=-1, keepdim=True)
    return torch.topk(scores, k)
