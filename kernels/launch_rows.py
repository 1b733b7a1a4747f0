"""How many token rows one program of a row-wise kernel takes (the fused ops, the KV write), and which
(:func:`token_rows`, inside a kernel).

On a GPU: one, the launch these kernels were tuned and measured with. In the Triton interpreter (CPU tensors): a
block of rows, as many as the launch has up to ``INTERPRETER_ROWS``: the interpreter runs a grid's programs one after
another in Python, each op costing about the same for one row or a hundred (numpy under it), so one program per row
made these kernels most of a CPU test's time. A row's values never depend on the others in its block (row-wise ops
and reductions along the row only), so the result is the same either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from specdec.kernels.host_ints import next_power_of_2

INTERPRETER_ROWS = 256  # rows per interpreted program at most (its temporaries: rows x the row's width)


def rows_per_program(device: torch.device, rows: int) -> int:
    """Rows per program of a launch over ``rows`` token rows of tensors on ``device`` (a power of two)."""
    if device.type == "cuda":
        return 1
    return min(INTERPRETER_ROWS, next_power_of_2(rows))


@triton.jit
def token_rows(ROWS: tl.constexpr):
    """This program's ROWS token rows, [ROWS] int64 (past the launch's last row in its last block: mask them)."""
    return (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
