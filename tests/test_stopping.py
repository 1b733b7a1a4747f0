"""StopCriteria: a multi-token commit never emits anything past a stop."""
from __future__ import annotations

import pytest

from specdec.stopping import StopCriteria


class CharTokenizer:
    """Token i decodes to chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(ord("a") + i) for i in ids)


def test_eos_inside_a_commit_truncates_after_it():
    stop = StopCriteria(100, frozenset({7}))
    assert stop.scan([1, 2], [3, 7, 4, 5]) == (2, "eos")


def test_max_new_tokens_inside_a_commit():
    stop = StopCriteria(5)
    assert stop.scan([1, 2, 3], [4, 5, 6, 7]) == (2, "length")
    assert stop.scan([], [1, 2]) == (2, None)


def test_stop_sequence_spanning_history_and_commit():
    stop = StopCriteria(100, stop_sequences=((3, 4, 5),))
    assert stop.scan([1, 3, 4], [5, 6]) == (1, "stop")
    assert stop.scan([1, 3], [4, 6, 5]) == (3, None)


def test_stop_string_across_token_boundaries():
    stop = StopCriteria(100, stop_strings=("cde",), tokenizer=CharTokenizer())
    assert stop.scan([0, 2], [3, 4, 5]) == (2, "stop")  # "a c | d e f": stops at "e"


def test_invalid_criteria():
    with pytest.raises(ValueError):
        StopCriteria(0)
    with pytest.raises(ValueError, match="tokenizer"):
        StopCriteria(5, stop_strings=("x",))
    with pytest.raises(ValueError):
        StopCriteria(5, stop_sequences=((),))
