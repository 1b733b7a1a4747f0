"""PendingTrees: a step's draft trees still on the device, verified before the host reads them.

A drafter whose candidates come out of the device (EAGLE's reranked pool) would make the host wait for its
drafting before the verify could be built: on a GPU the device then idles while the host turns the candidates into
trees and the verify's inputs. A pending proposal hands the engine what the verify needs without that read: each
sequence's node count (known on the host without a read) and, on the device, the nodes' target token ids, depths
and ancestor bits (:func:`tree_fields`; a chain's are constants, :func:`chain_fields`). The engine builds the
verify around them (CUDA-graph inputs written on the device, ``specdec.cuda_graphs``), launches it, and only then
calls :meth:`PendingTrees.read`: the host copy of the candidates, started right after drafting, is ready by then,
and the device goes on verifying meanwhile.

Invariant: ``read()`` returns exactly the trees the device fields describe (node for node, in the same order), so
the rows the target verified are the trees the acceptance walks.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.host_copy import to_device
from specdec.tree import DraftTree


@dataclass(frozen=True)
class PendingTrees:
    """One propose call's trees, one per sequence asked, still on the device (module doc)."""

    num_nodes: tuple[int, ...]  # per sequence, in the order asked (0: the empty tree)
    tokens: torch.Tensor  # [K] target token ids of every node, sequences in order (K = sum(num_nodes)), device
    depths: torch.Tensor  # [K] depth of each node (a root child: 1), device
    ancestor_bits: torch.Tensor  # [K] int64, bit j: node j of its sequence is the node itself or an ancestor, device
    max_depth: int  # no node is deeper (the engine reads the trees first where a sequence has fewer tokens left)
    read: Callable[[], list[DraftTree]]  # the host's trees; waits, if at all, for the drafting alone
    seconds: Callable[[], float]  # after read(): the drafting's seconds (on CUDA the device's time)
    # host time (time.perf_counter) from which seconds() counts: the drafting ended about seconds() after it
    # (default: when these trees were built)
    started_at: float = field(default_factory=time.perf_counter)

    @classmethod
    def none(cls, num_seqs: int, device: torch.device, read: Callable[[], list[DraftTree]]) -> "PendingTrees":
        """A call in which no sequence drafted: every tree empty (``read`` gives them, and does the drafter's
        bookkeeping)."""
        nothing = torch.zeros(0, dtype=torch.long, device=device)
        return cls((0,) * num_seqs, nothing, nothing, nothing, 0, read, lambda: 0.0)

    def __post_init__(self) -> None:
        total = sum(self.num_nodes)
        for name in ("tokens", "depths", "ancestor_bits"):
            if tuple(getattr(self, name).shape) != (total,):
                raise ValueError(f"PendingTrees.{name} must be [{total}], got {tuple(getattr(self, name).shape)}")


def tree_fields(parents: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, M] (-1: a root child; each parent precedes its child) -> ([B, M] depths, [B, M] int64 ancestor
    bits), on their device with no read. Pointer doubling: after round r each node holds the bits and the count of
    the 2^r nearest nodes on its path (itself first), so ceil(log2(max_depth)) rounds of three gathers cover every
    path; column M stands past the root (no bit, depth 0, its own parent)."""
    B, M = parents.shape
    dev = parents.device
    up = torch.cat([torch.where(parents < 0, M, parents), torch.full((B, 1), M, dtype=torch.long, device=dev)], 1)
    index = torch.arange(M + 1, device=dev)
    bits = torch.where(index < M, torch.ones_like(index) << index, 0).expand(B, M + 1)
    depths = (index < M).long().expand(B, M + 1)
    for _ in range(math.ceil(math.log2(max_depth)) if max_depth > 1 else 0):
        bits = bits | bits.gather(1, up)
        depths = depths + depths.gather(1, up)
        up = up.gather(1, up)
    return depths[:, :M], bits[:, :M]


def chain_fields(batch: int, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tree_fields` of ``batch`` chains of ``length`` nodes (parents j - 1), without a kernel: node j has
    depth j + 1 and the ancestor bits (1 << (j + 1)) - 1 (int64; bit 63 is the sign). Made on the host and copied to
    ``device`` in one upload, each [batch, length] and contiguous (kept unchanged, a CUDA graph may read them)."""
    if not 0 <= length <= 64:
        raise ValueError(f"a chain's ancestor bits cover at most 64 nodes, got {length}")
    depths = list(range(1, length + 1))
    bits = [(1 << d) - 1 - (1 << 64 if d == 64 else 0) for d in depths]  # 64 bits set: -1 as int64
    fields = to_device([[depths] * batch, [bits] * batch], torch.long, device).view(2, batch, length)
    return fields[0], fields[1]


@dataclass(frozen=True)
class NodeRows:
    """Pending trees laid out in one verify forward: the values the device writes into the forward's inputs."""

    rows: torch.Tensor  # [K] the forward's row of each node (int64, device)
    tokens: torch.Tensor  # [K] token ids
    positions: torch.Tensor  # [K] root position + depth
    ancestor_bits: torch.Tensor  # [K] int64, over the sequence's nodes (the root's row sees none)
