"""TokenProgress: a long sampling step says how far it has come at each tenth, but only after a quiet period, so a
quick one says nothing more."""
from __future__ import annotations

from specdec.eval.token_progress import TokenProgress


def test_a_line_at_each_tenth_once_the_quiet_period_has_passed():
    now = [0.0]
    said = []
    counter = TokenProgress(said.append, "end to end: the exact rule", total=100, clock=lambda: now[0])
    counter(0, [1] * 5)  # half a tenth
    now[0] = 11.0
    counter(1, [1] * 6)  # 11 tokens: the first tenth, 11 s in
    now[0] = 12.0
    counter(0, [1] * 20)  # 31 tokens: the third tenth, 1 s after the last line: quiet
    now[0] = 30.0
    counter(1, [1] * 9)  # 40 tokens
    counter(1, [1] * 60)  # all of them at once, 0 s after the last line
    now[0] = 45.0
    counter(0, [1])  # past the total (never above 100%)
    assert said == ["end to end: the exact rule: 10% of the sampled tokens (11 of 100)",
                    "end to end: the exact rule: 40% of the sampled tokens (40 of 100)"]


def test_a_quick_step_says_nothing():
    said = []
    counter = TokenProgress(said.append, "x", total=50)
    for _ in range(50):
        counter(0, [7])
    assert said == []


def test_a_count_that_jumps_past_the_total_is_said_as_100_percent():
    """15 tokens of 10 in one call: 15 x 10 // 10 = 15 tenths, said as the whole (100%), not 150%."""
    now = [0.0]
    said = []
    counter = TokenProgress(said.append, "x", total=10, clock=lambda: now[0])
    now[0] = 11.0
    counter(0, [1] * 15)
    assert said == ["x: 100% of the sampled tokens (15 of 10)"]


def test_a_line_is_said_once_exactly_the_quiet_period_has_passed():
    """quiet_seconds=10 and the first tenth (10 of 100 tokens) reached exactly 10 s in: 10 s have passed, so it is
    said."""
    now = [0.0]
    said = []
    counter = TokenProgress(said.append, "x", total=100, quiet_seconds=10.0, clock=lambda: now[0])
    now[0] = 10.0
    counter(0, [1] * 10)
    assert said == ["x: 10% of the sampled tokens (10 of 100)"]


def test_a_step_of_no_tokens_counts_towards_a_total_of_1():
    """total=0 (nothing to sample) is counted as 1: no division by zero; an empty call says nothing (0 of 1 is 0
    tenths), one token is the whole (1 x 10 // 1 = 10 tenths: 100%)."""
    now = [0.0]
    said = []
    counter = TokenProgress(said.append, "x", total=0, clock=lambda: now[0])
    now[0] = 11.0
    counter(0, [])
    assert said == []
    counter(0, [5])
    assert said == ["x: 100% of the sampled tokens (1 of 1)"]
