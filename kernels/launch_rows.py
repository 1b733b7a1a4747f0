"""How many token rows one program of a row-wise kernel takes (the fused ops, the KV write), and which
(:func:`token_rows`, inside a kernel).

On a GPU: one, the launch these kernels were tuned and measured with. In the Triton interpreter (CPU tensors): a
block of rows, as many as the launch has up to ``INTERPRETER_ROWS``: the interpreter runs a grid's programs one after
another in Python, each op costing about the same for one row or a hundred (numpy under it), so one program per row
made these kernels most of a CPU test's time. A row's values never depend on the others in its block (row-wise ops
and reductions along the row only), so the result is the same either way. :func:`block_rows` takes fewer for wide
rows: a block of ROWS x the row's elements must stay within Triton's largest tensor (``MAX_BLOCK_NUMEL``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.host_ints import next_power_of_2

INTERPRETER_ROWS = 256  # rows per interpreted program at most (its temporaries: rows x the row's width)
MAX_BLOCK_NUMEL = tl.TRITON_MAX_TENSOR_NUMEL  # elements of one block at most (a power of two), the interpreter's too


def rows_per_program(device: torch.device, rows: int) -> int:
    """Rows per program of a launch over ``rows`` token rows of tensors on ``device`` (a power of two), rows whose
    blocks are at most ``MAX_BLOCK_NUMEL // INTERPRETER_ROWS`` elements; wider ones: :func:`block_rows`."""
    if device.type == "cuda":
        return 1
    return min(INTERPRETER_ROWS, next_power_of_2(rows))


def block_rows(device: torch.device, rows: int, row_elements: int) -> int:
    """:func:`rows_per_program`, fewer where a block of that many rows of ``row_elements`` elements each (the
    kernel's largest block per row, a power of two) would pass ``MAX_BLOCK_NUMEL``. A power of two. The GPU /
    interpreter choice stays :func:`rows_per_program`'s (what ``compile_check`` and the tests patch)."""
    return min(rows_per_program(device, rows), max(1, MAX_BLOCK_NUMEL // row_elements))


@triton.jit
def token_rows(ROWS: tl.constexpr):
    """This program's ROWS token rows, [ROWS] int64 (past the launch's last row in its last block: mask them)."""
    return (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
