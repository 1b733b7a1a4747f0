"""Which children of the combined drafter run this step: a child whose extra tokens do not cover its own cost is
left out, and asked again from time to time.

    gate = ChildGate(num_children, GateConfig())     # one per CombinedDrafter
    gate.start(target.costs, memory_key)             # at attach: the speculation policy's costs
    run = gate.choose(batch, tree_cost, nodes_cap)   # before propose: one bool per child
    gate.record_seconds(k, seconds, catch_up)        # wall time of child k's propose call
    gate.observe(successes, nodes)                   # a sequence's step where every child ran

**The choice.** Every step where all children ran leaves a record: per child, how many levels of its own
proposal matched the committed tokens (``successes``) and how many of its nodes sizing would verify (the best-paying
prefix by calibrated path scores: priced at all ~20 it proposes, n-gram looked dearer than EAGLE's one node). As the
merge is a trie union, a subset S commits ``1 + max_{k in S} successes_k`` tokens on a record. The gate runs the
subset with the most expected committed tokens per unit of cost over the last ``window`` records, in decode steps::

    (1 + mean max_{k in S} successes_k) / (sum_{k in S} d_k + c(1 + min(sum_{k in S} nodes_k, nodes_cap)))

with ``d_k`` child k's draft seconds per call (:class:`specdec.tree_sizing.DraftTime`) over the engine's seconds
per decode step and ``c`` the verify-cost curve the combined drafter ranks trees with.

**Probes.** The children left out run again every ``ceil(d_left_out / probe_budget)`` calls (at most
``max_interval``), and a probe showing them adding tokens is followed by another at the next call. Until
``warmup`` records exist, the children left out are those costlier than both the budget and the cheapest child
(timed by a step, not by a first call's catch-up): a costly child run on every call of the warm-up made the whole
drafter look too dear to the break-even guard, which held it back, its cheap children with it, for dozens of steps.

**Memory**: kept across calls per ``memory_key`` (:mod:`specdec.drafters.call_memory`); a call with ``warmup`` records
of its own weighs only those (an earlier text's records kept EAGLE running on rag). **Off** without the policy's
costs (``speculation="always"``, seeded standard sampling): every child runs. Why: docs/speculation-policy.md.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from specdec.drafters.call_memory import CallMemory, DeciderConfig

MAX_SUBSETS_CHILDREN = 6  # beyond this many children every subset is too many to weigh: all of them run


@dataclass(frozen=True)
class GateConfig(DeciderConfig):
    """``window`` records, ``probe_budget`` spent running left-out children (:class:`DeciderConfig`)."""

    warmup: int = 3  # records before the first decision (until then the costly children run as probes)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.warmup > self.window:  # only the last window records are kept: the warm-up would never end
            raise ValueError(f"invalid GateConfig: warmup={self.warmup} exceeds window={self.window}")


class ChildGate(CallMemory):
    """records: (successes, nodes) per child of a step where every child ran; times: per child, seconds per call;
    parts: the children."""

    decider, config_type = "child gate", GateConfig

    def _reset(self) -> None:
        self.since_full = 0  # calls since every child last ran
        self.best: tuple[int, ...] | None = None  # the subset run outside probes (the warm-up's cheap children)
        self.probe_next = False  # the last probe showed the left-out children adding tokens
        self.own = 0  # records observed in this call (the others were recalled from an earlier call's text)

    @property
    def runs(self) -> list[int]:
        """Instrumentation: calls each child ran, across calls."""
        return self.chosen_counts[: self.parts]

    @property
    def active(self) -> bool:
        return self.costs is not None and 1 < self.parts <= MAX_SUBSETS_CHILDREN

    def record_seconds(self, k: int, seconds: float, catch_up: bool) -> None:
        """Wall time of child k's propose call (``catch_up``: a one-off, a sequence's first for it or a CUDA-graph
        capture, see DraftTime)."""
        self._record(k, seconds, catch_up)

    def observe(self, successes: tuple[int, ...], nodes: tuple[int, ...]) -> None:
        """A sequence's step where every child ran: levels of each child's proposal that matched, its nodes."""
        self.records.append((successes, nodes))
        self.own += 1
        if self.best is not None and self._left_out_add(successes, self.best):
            self.probe_next = True

    @staticmethod
    def _left_out_add(successes: tuple[int, ...], best: tuple[int, ...]) -> bool:
        """Whether a record where every child ran shows the children outside ``best`` adding levels."""
        return max(successes) > max(successes[k] for k in best)

    def draft_cost(self, k: int, batch: int) -> float:
        """Child k's draft cost per call in plain decode steps (0 before it was timed)."""
        return self.part_cost(k, batch) or 0.0

    def weighed(self) -> list:
        """The records a decision weighs: this call's once it has ``warmup`` of them, else every one kept (module
        doc, Memory)."""
        own = min(self.own, len(self.records))
        return list(self.records)[-own:] if own >= self.config.warmup else list(self.records)

    def next_best(self, batch: int, tree_cost: Callable[[int, int], float], nodes_cap: int) -> tuple[int, ...] | None:
        """The children a call runs outside probes, as :meth:`choose` picks them now; None while the gate is off or
        a child was never timed (every child runs)."""
        cfg = self.config
        if not self.active or any(t.seconds is None for t in self.times):
            return None
        if len(self.records) < cfg.warmup:  # no decision yet: the cheap children, the others as probes (module doc)
            costs = [self.draft_cost(k, batch) for k in range(self.parts)]
            return tuple(k for k in range(self.parts)  # a first call's catch-up time says nothing of a step's
                         if self.times[k].provisional or costs[k] <= max(cfg.probe_budget, min(costs)))
        records = self.weighed()
        count = len(records)
        successes = list(zip(*(succ for succ, _ in records), strict=True))  # per child, record by record
        nodes = [sum(col) for col in zip(*(n for _, n in records), strict=True)]  # per child, summed over records

        def value(subset: tuple[int, ...]) -> float:  # expected committed tokens per decode step of cost (module doc)
            best = successes[subset[0]] if len(subset) == 1 else map(max, *(successes[k] for k in subset))
            tokens = 1.0 + sum(best) / count
            kept = min(sum(nodes[k] for k in subset) / count, nodes_cap)
            return tokens / max(sum(self.draft_cost(k, batch) for k in subset) + tree_cost(math.ceil(kept), batch),
                                1e-9)

        subsets = (s for r in range(1, self.parts + 1) for s in itertools.combinations(range(self.parts), r))
        return max(subsets, key=value)

    def choose(self, batch: int, tree_cost: Callable[[int, int], float], nodes_cap: int) -> tuple[bool, ...]:
        """Which children propose this call; ``tree_cost(nodes, batch)``: verify cost of a tree of that many nodes
        (and its root) in plain decode steps."""
        cfg = self.config
        best = self.next_best(batch, tree_cost, nodes_cap)
        if best is None:
            return self._full()
        if len(self.records) < cfg.warmup:  # the first record came before any choice (observe had no best then)
            self.probe_next |= bool(self.records) and self._left_out_add(self.records[-1][0], best)
        self.best = best
        left_out = [k for k in range(self.parts) if k not in best]
        # a probe costs the left-out children's drafts once: at most probe_budget decode steps per call on average
        probe_cost = sum(self.draft_cost(k, batch) for k in left_out)
        interval = min(cfg.max_interval, max(1, math.ceil(probe_cost / cfg.probe_budget)))
        if not left_out or self.probe_next or self.since_full + 1 >= interval:
            return self._full()
        self.since_full += 1
        for k in best:
            self.chosen_counts[k] += 1
        return tuple(k in best for k in range(self.parts))

    def _full(self) -> tuple[bool, ...]:
        self.since_full, self.probe_next = 0, False
        for k in range(self.parts):
            self.chosen_counts[k] += 1
        return (True,) * self.parts
