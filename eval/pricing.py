"""Predicted speedup of an acceptance-suite cell, each step priced by its own draft tree.

    sizes = calibration_sizes(cell.step_nodes_histogram, cell.mean_tree_nodes)   # query sizes to time
    prediction = predicted_speedup(cell)                                          # dict or None

A step that verifies ``n`` tree nodes costs ``c_verify(1 + n)``, so the decode time of a cell is
``sum over steps of (c_draft + c_verify(1 + n_step))``, and the predicted speedup over plain decoding is::

    predicted = tau * c_plain / (c_draft + mean over steps of c_verify(1 + n_step))

``step_nodes_histogram[n]`` counts the sequence steps that verified ``n`` nodes. ``c_verify`` of every size in it
is timed by the suite's calibration (the cell's ``size_calibration``: one entry per query size and process,
median over processes), so no size is interpolated. Pricing every step at the mean tree size instead,
``c_verify(1 + mean n)``, misjudges a drafter whose trees vary (n-gram: often none, sometimes ten nodes) wherever
``c_verify`` is not linear; the row keeps that older figure as ``predicted_speedup_mean_size``. Cells calibrated
before per-step sizes were recorded are priced at the mean size only.

With a batch, the calibration times steps where every sequence has the same tree; a step whose sequences have
trees of different sizes is priced as the mean of its sequences' sizes' costs (an approximation).
"""
from __future__ import annotations

import statistics
from typing import Any

MAX_CALIBRATED_SIZES = 16  # distinct query sizes timed per cell; beyond, the most frequent ones (+ the mean's)


def calibration_sizes(histogram: list[int], mean_nodes: float) -> list[int]:
    """Query sizes (1 + nodes) to time for a cell: 1 (plain), 1 + the mean tree size (rounded), and every tree
    size its steps verified; with more than :data:`MAX_CALIBRATED_SIZES`, the most frequent ones."""
    mean_size = max(1, round(1 + mean_nodes))
    seen = sorted(((count, 1 + n) for n, count in enumerate(histogram) if count), reverse=True)
    sizes = {1, mean_size}
    for _, size in seen:
        if len(sizes) >= MAX_CALIBRATED_SIZES:
            break
        sizes.add(size)
    return sorted(sizes)


def _cost_curve(size_calibration: list[dict]) -> dict[int, float]:
    """Median over processes of each timed query size's verify seconds."""
    by_size: dict[int, list[float]] = {}
    for entry in size_calibration:
        by_size.setdefault(int(entry["query_tokens"]), []).append(float(entry["verify_seconds"]))
    return {n: statistics.median(s) for n, s in by_size.items()}


def _nearest(curve: dict[int, float], n: int) -> float:
    """The cost of ``n`` query tokens; a size that was not timed (a histogram cut to the most frequent sizes)
    takes the linear interpolation of its timed neighbours, or the nearest timed size at the ends."""
    if n in curve:
        return curve[n]
    lower = [m for m in curve if m < n]
    upper = [m for m in curve if m > n]
    if not lower or not upper:
        return curve[max(lower) if lower else min(upper)]
    lo, hi = max(lower), min(upper)
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def mean_step_verify_cost(histogram: list[int], curve: dict[int, float]) -> float | None:
    """Mean over the histogram's steps of ``c_verify(1 + nodes)``."""
    steps = sum(histogram)
    if not steps or not curve:
        return None
    return sum(count * _nearest(curve, 1 + n) for n, count in enumerate(histogram) if count) / steps


def predicted_speedup(cell: Any) -> dict | None:
    """The cell's predicted speedup (module docstring) with its costs, or None without a calibration."""
    if not cell.calibration or not cell.forward_passes or not cell.steps:
        return None
    c_plain = statistics.median(c["plain_seconds"] for c in cell.calibration)
    c_mean_size = statistics.median(c["verify_seconds"] for c in cell.calibration)
    c_draft = cell.draft_seconds / cell.forward_passes
    if c_draft + c_mean_size <= 0:
        return None
    out = {"predicted_speedup_mean_size": cell.tau * c_plain / (c_draft + c_mean_size), "cost_plain_s": c_plain,
           "cost_verify_mean_size_s": c_mean_size, "cost_draft_s": c_draft,
           "verify_query_tokens": statistics.median(c["query_tokens"] for c in cell.calibration)}
    curve = _cost_curve(getattr(cell, "size_calibration", []))
    c_steps = mean_step_verify_cost(getattr(cell, "step_nodes_histogram", []), curve)
    c_verify = c_mean_size if c_steps is None else c_steps
    out.update(predicted_speedup=cell.tau * c_plain / (c_draft + c_verify), cost_verify_s=c_verify,
               priced_per_step=c_steps is not None)
    return out


def size_chunks(sizes: list[int], max_tokens: int = 80) -> list[list[int]]:
    """``sizes`` split into runs whose query tokens sum to at most ``max_tokens`` (a single larger size alone): each
    is calibrated on a fresh context, which grows by (repeats + 1) x the run's sum only."""
    chunks: list[list[int]] = [[]]
    for n in sizes:
        if chunks[-1] and sum(chunks[-1]) + n > max_tokens:
            chunks.append([])
        chunks[-1].append(n)
    return [c for c in chunks if c]
