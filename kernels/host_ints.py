"""Integer helpers for the host side of a launch: grid sizes and power-of-two block widths.

Triton's own ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions (since Triton 3.5): called from
host code they unwrap every argument first, a few microseconds a call, and an eager forward's launches made hundreds
of such calls (prefills and uncaptured steps run eagerly). These are the same functions of plain ints.
"""
from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for ints, y > 0."""
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as ``triton.next_power_of_2`` gives for n >= 1."""
    return 1 << (n - 1).bit_length() if n > 1 else 1
