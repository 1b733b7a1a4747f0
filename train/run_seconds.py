"""A training report's wall seconds: data, training, evaluation and total, from the run's clock readings.

After ``--resume``, the training seconds are this run's alone (the steps after the checkpoint it resumed from, whose
own time was never recorded), and the report says from which step, rather than pass them for the whole training.
"""
from __future__ import annotations


def run_seconds(times: dict, end: float) -> dict:
    """``times``: perf_counter at start, data and train, and ``resumed_from_step`` (absent or None: a fresh run)."""
    return {"data": times["data"] - times["start"], "train": times["train"] - times["data"],
            "eval": end - times["train"], "total": end - times["start"],
            "resumed_from_step": times.get("resumed_from_step")}


def wall_time_line(s: dict) -> str:
    """The report.md line of :func:`run_seconds` (or a report.json's ``seconds``, which may predate the resume)."""
    resumed = s.get("resumed_from_step")
    train = f"training {s['train']:.0f} s" + ("" if resumed is None else f" (this run's, resumed at step {resumed})")
    return f"Wall time: data {s['data']:.0f} s, {train}, evaluation {s['eval']:.0f} s, total {s['total']:.0f} s"
