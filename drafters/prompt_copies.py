"""Copies of one prompt at their first catch-up: the drafter runs the prompt's catch-up once and copies its result.

    copies = prompt_copies(views, fresh)    # {copy's index: its first's index} among views
    for leader, group in leaders(copies): ... # the first of each prompt, and its copies

The engine prefills identical prompts once (num_return_sequences, a batch that repeats a prompt): every copy holds
its first's K/V and hidden rows bit for bit. A drafter's catch-up over a prompt (EAGLE's layer over its hidden rows,
a draft model's prefill of its own cache) is then the same work with the same inputs for every copy, so the drafter
runs it for the first and copies what it holds (drafters/eagle.py, drafters/model_drafter.py): each copy holds bit
for bit what the first holds over the prompt, in storage of its own (no block or row is shared, so the copies stay
independent). Only the prompt is shared: the copies' tokens after it (plain steps taken before their first draft)
are their own, caught up after the copy.

A copy is a sequence of the call at its first catch-up (``fresh``) whose prompt and length equal an earlier such
sequence's; the earliest is their first. Sequences of other calls are never copies (each call groups its own).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from specdec.drafters.base import SequenceView


def prompt_copies(views: Sequence[SequenceView], fresh: Callable[[SequenceView], bool]) -> dict[int, int]:
    """{index of a copy in ``views``: index of its first}: the fresh views whose prompt (``token_ids[:
    num_prompt_tokens]``) and number of tokens equal an earlier fresh view's (module doc)."""
    first: dict[tuple, int] = {}
    copies: dict[int, int] = {}
    for i, v in enumerate(views):
        if not fresh(v):
            continue
        key = (v.num_prompt_tokens, len(v.token_ids), tuple(v.token_ids[:v.num_prompt_tokens]))
        if key in first:
            copies[i] = first[key]
        else:
            first[key] = i
    return copies


def leaders(copies: dict[int, int]) -> dict[int, list[int]]:
    """{first's index: its copies' indices, in order} from :func:`prompt_copies`'s map."""
    groups: dict[int, list[int]] = {}
    for copy, first in copies.items():
        groups.setdefault(first, []).append(copy)
    return groups
