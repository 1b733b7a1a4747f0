"""The speculation policy: which sequences draft this step, how much of each proposal the target verifies, and what
the run taught. The engine calls it at five points::

    policy.start(drafter, target)        # Engine(): attach the drafter, handing it the policy's costs
    asked = policy.who_drafts(live)      # before propose: the break-even guard (asks_nobody_next: foreseen)
    trees = policy.size(call)            # after propose: the part of each tree expected to pay (exact pruning)
    policy.observe(step)                 # after the commit: the step's time, what was committed, who finished
                                         # (the run's last step saves what the guard learned: specdec.remembered)
    policy.who_looks_back(live)          # after a queued step's commit: held-off drafts asked in hindsight

Behind it (``speculation="auto"``): the measured cost model (:mod:`specdec.cost_model`) corrected by the run's step
times (:mod:`specdec.online_costs`), the guard and tree sizing (:mod:`specdec.tree_sizing`), and the never-pays
check on a drafter's own forward. Drafters see its costs as one :class:`~specdec.drafters.base.CostView`, which the
combined drafter's child gate and EAGLE's depth chooser price their choices with; what is learned is kept across
calls in one store (:mod:`specdec.remembered`). ``SpeculationPolicy()`` without a sizer verifies every proposal
whole and hands drafters no costs (``speculation="always"``, no drafter); ``SpeculationPolicy(auto=True)`` does so
too but never asks a drafter that can never pay by its shapes (seeded standard sampling: it reads no timing).

Invariant: the policy changes what is verified, never what is committed (pruning keeps an ancestor-closed part).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specdec.drafters.base import CostView, Drafter, TargetView
from specdec.remembered import save
from specdec.tree import DraftTree
from specdec.tree_sizing import TreeSizer

if TYPE_CHECKING:
    from specdec.engine import SequenceState
    from specdec.rejection import Acceptance

logger = logging.getLogger(__name__)
# (drafter name, cost key, reason) already warned about: once per process for each drafter and cause (then debug),
# so a second draft model that can never pay is still told, and a server's repeated calls are not
_NEVER_PAYS_WARNED: set[tuple[str, str, str]] = set()


@dataclass(frozen=True)
class ProposeCall:
    """One propose call as the engine saw it, for :meth:`SpeculationPolicy.size`."""

    seq_ids: list[int]  # the sequences asked, in the order of trees
    trees: list[DraftTree]  # as proposed (validated, cut to each sequence's token budget and KV blocks)
    batch: int  # live sequences this step
    draft_seconds: float  # wall seconds of the call, its trees' draft audit included
    catch_up: bool  # the call included a sequence's first (the drafter caught up on its whole prompt)
    verified: bool = False  # pending trees, already verified whole: sizing is learned from, not applied


@dataclass(frozen=True)
class StepRecord:
    """One finished step, for :meth:`SpeculationPolicy.observe`."""

    live: Sequence["SequenceState"]  # the step's sequences (finished ones included), in batch order
    acceptances: Sequence["Acceptance"]  # per sequence: accepted_nodes index the verified (sized) tree
    emitted: dict[int, list[int]]  # seq_id -> the tokens it committed this step
    # wall seconds of the verify half of the step (forward, sampling, commit); None: it paid a one-off (a CUDA-graph
    # capture), and its time prices nothing
    verify_seconds: float | None
    query_tokens: int  # 1 + the largest verified tree's nodes
    queued: bool = False  # a plain step launched before the one before it was read (specdec.decode_ahead)


class SpeculationPolicy:
    """Who drafts and how much is verified (module doc); ``sizer`` None: every proposal is verified whole."""

    def __init__(self, sizer: TreeSizer | None = None, auto: bool = False) -> None:
        """``auto`` (implied by a sizer): speculation="auto", which never asks a drafter that can never pay."""
        self.sizer = sizer
        self.auto = auto or sizer is not None
        self.costs = None if sizer is None else CostView(sizer.online.relative, sizer.step_seconds)
        self.cut_last = False  # the last size() cut a tree
        self.plain = False  # the drafter can never pay: it is never asked
        self.looks_back = False  # a held-off drafter is asked in hindsight (Drafter.looks_back, under a sizer)

    def start(self, drafter: Drafter | None, target: TargetView) -> "SpeculationPolicy":
        """Attach ``drafter`` to ``target`` with the policy's costs; returns the policy. With ``auto``, a drafter
        whose own forward costs a decode step of the target or more can never pay: it is never asked (decided once,
        here). By its shapes (``never_pays_by_shape``) always; by its measured forward only with a sizer."""
        if drafter is None:
            self.sizer = self.costs = None
            return self
        drafter.attach(replace(target, costs=self.costs))
        if self.sizer is not None:
            self.sizer.cheapest_call = drafter.cheapest_call_seconds
            self.looks_back = drafter.looks_back
        if not self.auto:
            return self
        why = drafter.never_pays_by_shape()
        # (a sizer off from the start, on unmeasured costs, asks for no draft model's forward time)
        if why is None and self.sizer is not None and not self.sizer.off and self.sizer.never_pays(
                drafter.forward_seconds()):
            why = "one forward of its model costs a decode step of the target or more"
        if why is not None:
            said = (drafter.name, drafter.cost_key(), why)
            log = logger.warning if said not in _NEVER_PAYS_WARNED else logger.debug
            _NEVER_PAYS_WARNED.add(said)
            # the one warning for it: a draft model's own size warning is given only when it drafts
            log("%s: %s, so no draft can pay; decoding plainly. Use a smaller draft model (speculation='always' "
                "verifies its drafts anyway)", drafter.name, why)
            self.plain = True
            if self.sizer is not None:
                self.sizer.switch_off()
        return self

    @property
    def verifies_whole(self) -> bool:
        """This step's proposals are expected to be verified whole: there is no sizer, or its last call cut no tree.
        A drafter's pending trees (specdec.pending_trees) are then verified before they are sized, and sized after
        (what sizing would have cut is learned, and the next step sizes its trees first)."""
        return not self.cut_last

    def who_drafts(self, live: list["SequenceState"]) -> list["SequenceState"]:
        """The sequences the drafter proposes for this step: none when the drafter can never pay, all of them without
        a sizer, none when the cost correction asks for a plain step, else the guard's choice."""
        if self.plain:
            return []
        if self.sizer is None:
            return live
        if self.sizer.plain_step_due(len(live)):  # the cost correction measures a plain step: nobody drafts
            return []
        return [s for s in live if self.sizer.wants_draft(s.seq_id)]

    def asks_nobody_next(self, live: list["SequenceState"]) -> bool:
        """Whether the next :meth:`who_drafts` of ``live`` is sure to ask nobody (the guard holds every sequence
        off), known without changing what the guard counts: such a step may be queued before the host reads the
        one before it (specdec.decode_ahead). False without a sizer, whose every call asks every sequence. Also
        true, once, behind a plain step due while no queued step has been timed: that next step is queued, plain,
        whoever its guard would have asked."""
        if self.plain:
            return True
        if self.sizer is None:
            return False
        # a plain step due for the cost correction, while no queued step has been timed: the next one is queued
        # behind it, once, so that drafts are priced against a queued step (TreeSizer.queue_due)
        return self.sizer.queue_due(len(live)) or self.sizer.skips_next([s.seq_id for s in live])

    def who_looks_back(self, live: list["SequenceState"]) -> list["SequenceState"]:
        """Of a queued step's sequences (every one held off), those whose drafter to ask in hindsight now
        (:meth:`TreeSizer.who_looks_back`): none unless the drafter looks back, under a sizer."""
        if not self.looks_back or self.plain:
            return []
        ids = set(self.sizer.who_looks_back([s.seq_id for s in live]))
        return [s for s in live if s.seq_id in ids]

    def looked_back(self, seqs: list["SequenceState"], trees: list[DraftTree], seconds: float, batch: int) -> None:
        """The trees of a call :meth:`who_looks_back` asked for, never verified: judged by the text that follows."""
        self.sizer.looked_back([s.seq_id for s in seqs], trees, seconds, batch)

    def size(self, call: ProposeCall) -> list[DraftTree]:
        """The part of each proposed tree to verify, and the call's draft time recorded."""
        if self.sizer is None:
            return call.trees
        sized = self.sizer.size_call(call.seq_ids, call.trees, call.batch, call.draft_seconds, call.catch_up,
                                     call.verified)
        self.cut_last = any(a.num_nodes < b.num_nodes for a, b in zip(sized, call.trees, strict=True))
        return call.trees if call.verified else sized

    def observe(self, step: StepRecord) -> None:
        """Learn from a finished step: acceptance per sequence, the verify time; forget finished sequences."""
        if self.sizer is None or self.sizer.off:  # off: the drafter is never asked, so nothing learned is used
            return
        if step.verify_seconds is not None:  # first: a finished sequence's release keeps it for the next call
            self.sizer.record_step(step.verify_seconds, step.query_tokens, len(step.live), step.queued)
        for s, acc in zip(step.live, step.acceptances, strict=True):
            self.sizer.observe(s.seq_id, step.emitted[s.seq_id], list(acc.accepted_nodes))
            if s.finished:
                self.sizer.release(s.seq_id)
        if all(s.finished for s in step.live):  # every step holds every live sequence: the run is over
            save()
