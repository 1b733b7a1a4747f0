"""Helpers for the kernel tests and benchmarks: interpreter setup and random paged-attention cases.

Import this module BEFORE anything that imports triton kernels: :func:`kernel_device` sets
``TRITON_INTERPRET=1`` when no GPU is used, and triton reads it when a kernel is decorated.
A case holds the same attention problem twice: as kernel metadata over real (shuffled) block
tables, and as the engine's :class:`~specdec.attention.AttentionPlan` for the PyTorch reference.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch


def kernel_device() -> str:
    """'cuda' when a GPU is present and the interpreter was not asked for; else 'cpu' + interpreter on."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


# a CUDA-graph bucket's padded rows carry uninitialised attention output through the layers (never read back): in the
# interpreter numpy may warn that their garbage overflows, or multiplies into NaN (tests: pytest filterwarnings)
PADDED_ROWS_WARNINGS = ("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")


@contextlib.contextmanager
def interpreter_dot_by_rows():
    """Inside, the Triton interpreter computes ``tl.dot`` one row of its first operand at a time, as a GPU's matrix
    tile computes every row alike. The interpreter's dot is numpy's matmul, which on some CPUs (OpenBLAS's Haswell
    kernels, an AMD EPYC without AVX-512) sums a tile's last rows in another order than its first: a row's bits
    then depend on its place in the tile, which a test of row invariance would blame on the kernel."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def by_rows(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.ndim != 2 or a.data.shape[0] < 2:
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [dot(self, interpreter.TensorHandle(a.data[i : i + 1], a.dtype), b,
                    interpreter.TensorHandle(d.data[i : i + 1], d.dtype), input_precision, max_num_imprecise_acc)
                for i in range(a.data.shape[0])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows]), rows[0].dtype)

    builder.create_dot = by_rows
    try:
        yield
    finally:
        builder.create_dot = dot


class LaunchSpy:
    """Records the grid of each launch of a Triton kernel, which still runs: put it where the kernel is looked up
    (``monkeypatch.setattr(tree_attention, "_merge_kernel", LaunchSpy(tree_attention._merge_kernel))``); ``grids``."""

    def __init__(self, kernel) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def triton_tiny_model(vocab_size: int, device: str):
    """A tiny random model (``specdec.testing``) loaded on the Triton backend, the interpreter on CPU: its runner and,
    through it, every cache built for it."""
    import dataclasses

    from specdec.models.llama import LlamaRunner
    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    model = load_model(build_tiny_model("llama-gqa-tied", vocab_size), device=device)
    return dataclasses.replace(model, runner=LlamaRunner(model.model, backend="triton"))


def random_tree_mask(num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[1 + num_nodes, 1 + num_nodes] bool verify mask of a random DraftTree (root first), as the engine builds it."""
    from specdec.tree import DraftTree

    parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(num_nodes)]
    tree = DraftTree(torch.zeros(num_nodes, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
    mask = torch.zeros(1 + num_nodes, 1 + num_nodes, dtype=torch.bool)
    mask[:, 0] = True
    mask[1:, 1:] = tree.ancestor_mask
    return mask


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_slots, KVH, D]
    v_cache: torch.Tensor
    block_tables: list[list[int]]
    page_size: int
    cache_lens: list[int]
    new_masks: list  # per sequence: [n, n] bool tree mask or int n (causal run)
    plan: object  # AttentionPlan over the same keys
    scale: float

    def metadata(self):
        from specdec.kernels.tree_attention import TreeAttentionMetadata

        return TreeAttentionMetadata.build(self.block_tables, self.page_size, self.cache_lens, self.new_masks,
                                           device=self.q.device)

    def forward_batch(self):
        """The case as a builder's ForwardBatch over a cache holding its block tables (token ids and positions are
        placeholders): what a CUDA-graph bucket loads (specdec.kernels.graph_metadata)."""
        from types import SimpleNamespace

        from specdec.attention import ForwardBatch
        from specdec.kv_cache import table_slots

        tables = dict(enumerate(self.block_tables))
        cache = SimpleNamespace(block_tables=tables,
                                host_slots=lambda seq_id, positions: table_slots(tables[seq_id], self.page_size,
                                                                                 positions))
        rows = tuple(range(s.query_start, s.query_start + s.num_new) for s in self.plan.seqs)
        n = self.q.shape[0]
        return ForwardBatch([0] * n, [0] * n, self.plan, rows, tuple(range(len(rows))), cache, self.q.device)


def random_case(
    cache_lens: list[int],
    new: list,  # per sequence: int n = causal run of n tokens (1 = decode), or ("tree", num_nodes)
    num_kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    page_size: int = 4,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    shuffle: bool = True,
    spare_blocks: int = 3,
) -> PagedCase:
    from specdec.attention import AttentionPlan, SeqAttention
    from specdec.kv_cache import blocks_for

    gen = torch.Generator().manual_seed(seed)
    masks = [n if isinstance(n, int) else random_tree_mask(n[1], gen) for n in new]
    sizes = [m if isinstance(m, int) else m.shape[0] for m in masks]
    need = [blocks_for(c + n, page_size) for c, n in zip(cache_lens, sizes, strict=True)]
    num_blocks = sum(need) + spare_blocks
    # ids.pop() hands out blocks: unshuffled, each sequence gets consecutive blocks in ascending order
    ids = torch.randperm(num_blocks, generator=gen).tolist() if shuffle else list(range(num_blocks - 1, -1, -1))
    tables, seqs, start = [], [], 0
    for c, n, m, nb in zip(cache_lens, sizes, masks, need, strict=True):
        table = [ids.pop() for _ in range(nb)]
        tables.append(table)
        pos = torch.arange(c + n)
        slots = torch.tensor(table)[pos // page_size] * page_size + pos % page_size
        if isinstance(m, int):  # a causal run after the cached keys
            seqs.append(SeqAttention(start, n, slots.to(device), c))
        else:  # root + tree: the root joins the visible prefix, the nodes go by their ancestor bits
            weights = torch.ones(n - 1, dtype=torch.long) << torch.arange(n - 1)
            bits = (m[:, 1:].long() * weights).sum(-1)
            seqs.append(SeqAttention(start, n, slots.to(device), c + 1, bits.to(device)))
        start += n
    shape = (num_blocks * page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    q = torch.randn(start, num_kv_heads * group, head_dim, generator=gen).to(device, dtype)
    plan = AttentionPlan(tuple(seqs))
    return PagedCase(q, k_cache, v_cache, tables, page_size, list(cache_lens), masks, plan, head_dim**-0.5)


def reference_attention(case: PagedCase) -> torch.Tensor:
    """The PyTorch reference on the same problem (paged_attention's default backend is the reference)."""
    from specdec.attention import paged_attention

    return paged_attention(case.q, case.k_cache, case.v_cache, case.plan, case.scale)
