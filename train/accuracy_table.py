"""The accuracy rows of the training reports (Medusa's heads, EAGLE's draft depths): top-1 and top-5 over every
position, and over the responses alone where the data was self-distilled (a rate no position reached reads n/a);
and the scopes they are measured over."""
from __future__ import annotations

from specdec.train.loop import number

# under every table: why the two column pairs differ
ALL_POSITIONS_NOTE = ("All positions include each sequence's prompt (the chat template repeats in every sequence and "
                      "is easy to predict); the responses-only columns are what drafting a reply meets.")


def accuracy_scopes(data: list[list[int]], prompt_lengths: dict | None) -> list[list[int] | None]:
    """What the report scores (``scopes`` of the scoped accuracy functions): every position, then, self-distilled
    (``prompt_lengths``: a sequence's prompt length by its tokens), each sequence's response alone."""
    return [None] + ([[prompt_lengths.get(tuple(s), 0) for s in data]] if prompt_lengths else [])


def accuracy_cells(report: dict) -> list[str]:
    """Per head or depth, its cells ``top-1 | top-5 | top-1, responses only | top-5, responses only`` ("-" where
    the report has no responses-only rates: the data was not self-distilled)."""
    responses = report.get("response_top1") is not None
    none = [None] * len(report["top1"])
    rows = zip(report["top1"], report["top5"], report.get("response_top1") or none,
               report.get("response_top5") or none, strict=True)
    return [f"{number(a1)} | {number(a5)} | " + (f"{number(b1)} | {number(b5)}" if responses else "- | -")
            for a1, a5, b1, b5 in rows]
