"""How deep the EAGLE drafter grows its tree this call: the depth whose expected committed tokens best cover its
own draft time and its verify cost on the machine at hand, learned from the run.

    chooser = DepthChooser(max_depth, DepthConfig())
    chooser.start(target.costs, memory_key)                  # at attach: the speculation policy's costs
    depth = chooser.choose(batch)                            # before a propose call
    chooser.record_seconds(level_seconds, catch_up)          # wall seconds of each level of that call
    chooser.observe(trials, successes)                       # a sequence's step (specdec.tree.matched_levels)

**The choice.** Level j has an acceptance rate r_j, the share of steps where level j had a candidate to try and
one of them was the committed token. Drafting ``d`` levels is expected to commit ``1 + sum_{j<=d} r_1 ... r_j``
tokens per step for ``sum_{j<=d} t_j / decode_seconds + c(1 + d)`` decode steps, ``t_j`` the measured seconds of
level j (:class:`specdec.tree_sizing.DraftTime`) and ``c`` the policy's verify-cost curve priced as a chain of
``d`` nodes. The chooser drafts the ``d`` with the most tokens per unit of cost; ``r_j`` is counted over the last
``window`` steps with a prior of ``prior_weight`` steps at level j-1's rate (0.5 for level 1).

**Start shallow**: the first call drafts one level; a level never timed is priced as the deepest timed one.
**Probes**: every ``ceil(extra / probe_budget)`` calls (at most ``max_interval``) it drafts one level deeper
than its choice, and a step whose tree matched deeper is followed by a probe one level deeper than it matched.
**Memory**: records and level times are kept across calls per ``memory_key`` (:mod:`specdec.drafters.call_memory`).

**Off** (the configured depth, every call) without the policy's costs (``speculation="always"``, seeded standard
sampling). Exactness is untouched: the depth depends
on past commits and times only, never on the current step's draws. Why: docs/speculation-policy.md.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.drafters.call_memory import CallMemory, DeciderConfig


@dataclass(frozen=True)
class DepthConfig(DeciderConfig):
    """``window`` steps, ``probe_budget`` spent drafting one level deeper than chosen (:class:`DeciderConfig`)."""

    window: int = 128
    prior_weight: float = 2.0  # pseudo-steps of a level's prior (the rate of the level above)


class DepthChooser(CallMemory):
    """records: (trials, successes) per sequence step; times: seconds of level j + 1 per call; parts: the levels
    (``max_depth``)."""

    decider, config_type = "depth", DepthConfig

    @property
    def max_depth(self) -> int:
        return self.parts

    @property
    def active(self) -> bool:
        return self.costs is not None and self.max_depth > 1

    def _reset(self) -> None:
        """A new call (module doc): the window's counts rebuilt from the records kept."""
        self.since_probe, self.chosen, self.probe_next = 0, None, 0  # chosen: the last decision's depth (None: none)
        # records in the window whose level j + 1 was tried / matched (kept with the window: choose() runs every call)
        self.tried, self.matched = [0] * self.max_depth, [0] * self.max_depth
        for record in self.records:
            self._count(record, 1)

    @property
    def used(self) -> list[int]:
        """Instrumentation: calls drafted at each depth (index 0 unused), across calls."""
        return self.chosen_counts

    def record_seconds(self, level_seconds: Sequence[float], catch_up: bool) -> None:
        """Wall seconds of each level drafted by one call (all its sequences); ``catch_up``: the call included a
        one-off, a sequence's first (whose level 1 ran over its whole prompt) or a CUDA-graph capture."""
        for j, seconds in enumerate(level_seconds):
            self._record(j, seconds, catch_up and j == 0)

    def observe(self, trials: int, successes: int) -> None:
        """One sequence's step: levels of the proposal walked and matched along the committed tokens."""
        if len(self.records) == self.records.maxlen:
            self._count(self.records[0], -1)  # leaves the window
        self.records.append((trials, successes))
        self._count((trials, successes), 1)
        if self.chosen is not None and successes > self.chosen:
            self.probe_next = max(self.probe_next, min(self.max_depth, successes + 1))

    def _count(self, record: tuple[int, int], sign: int) -> None:
        trials, successes = record
        for j in range(min(trials, self.max_depth)):
            self.tried[j] += sign
        for j in range(min(successes, self.max_depth)):
            self.matched[j] += sign

    def rates(self) -> list[float]:
        """r_j for j = 1..max_depth (module doc)."""
        out, prior = [], 0.5
        w = self.config.prior_weight
        for tried, matched in zip(self.tried, self.matched, strict=True):
            prior = (matched + w * prior) / (tried + w)
            out.append(prior)
        return out

    def draft_cost(self, depth: int, batch: int) -> float:
        """Seconds of the first ``depth`` levels over a decode step's; a level never timed costs as the deepest
        timed one (module doc, Start shallow)."""
        steps, last = 0.0, 0.0
        for j in range(depth):
            timed = self.part_cost(j, batch)
            last = timed if timed is not None else last
            steps += last
        return steps

    def values(self, batch: int) -> list[float]:
        """Expected committed tokens per decode step of cost, for depth 1..max_depth."""
        out, tokens, reach = [], 1.0, 1.0
        for d, r in enumerate(self.rates(), start=1):
            reach *= r
            tokens += reach
            out.append(tokens / max(self.draft_cost(d, batch) + self.costs.verify_cost(1 + d, batch), 1e-9))
        return out

    def choose(self, batch: int) -> int:
        cfg = self.config
        if not self.active:
            return self._use(self.max_depth)
        if self.times[0].seconds is None:
            return self._use(1)
        values = self.values(batch)
        self.chosen = best = 1 + max(range(self.max_depth), key=lambda i: (values[i], -i))
        if best == self.max_depth:
            self.probe_next = 0
            return self._use(best)
        deeper = max(best + 1, self.probe_next)
        extra = (self.draft_cost(deeper, batch) - self.draft_cost(best, batch)
                 + self.costs.verify_cost(1 + deeper, batch) - self.costs.verify_cost(1 + best, batch))
        interval = min(cfg.max_interval, max(1, math.ceil(extra / cfg.probe_budget)))
        if self.probe_next or self.since_probe + 1 >= interval:
            self.since_probe, self.probe_next = 0, 0
            return self._use(deeper)
        self.since_probe += 1
        return self._use(best)

    def _use(self, depth: int) -> int:
        self.chosen_counts[depth] += 1
        return depth
