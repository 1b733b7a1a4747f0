"""Tree size per step and the break-even guard: keep the part of a proposal that pays, or none of it.

    sizer = TreeSizer(cost_model)                      # one per engine (speculation="auto")
    ask = [s for s in live if sizer.wants_draft(s.seq_id)]  # the guard: who drafts this step
    trees = sizer.size_call(ids, trees, batch, draft_s)  # after propose: size every tree, record the draft time
    sizer.observe(seq_id, committed, accepted)         # after the commit: acceptance, learned online
    sizer.record_step(verify_s, n, batch)              # after the verify: how long a decode step is

Each node gets an acceptance estimate (the drafter's ``scores`` corrected online per score bin, or the rate
observed per (depth, sibling rank)); a kept subset S is expected to commit ``1 + sum_{i in S} P_i`` tokens (P_i:
the product along the path) for ``d + c(1 + |S|)`` decode steps (d: draft time, c: the cost model corrected by
:mod:`specdec.online_costs`). The best prefix of the nodes ordered by P_i is kept when it beats the empty tree
by ``margin``. The guard keeps running averages per sequence and skips the drafter with a growing backoff when
they do not pay, probing again when the sequence has banked the probe's price (``probe_budget`` of a decode step
per step: probes, catch-ups included, cost about that share of a run of calls); ``never_pays`` drafters are never
asked. **Measured verifies**: while the run has timed few drafted verifies and the curve may be too steep, a tree cut
to nothing keeps its best node now and then, from a budget of its own (:mod:`specdec.online_costs`): a curve
calibrated too steep verifies no draft, and plain steps alone correct nothing in it. **Looks**: where held-off steps
are queued, a drafter that looks back is asked in hindsight while the device runs (``look_budget`` of a step per
step); its tree, never verified, is judged by the text that follows, and one that would have paid asks it again.
``memory`` carries backoff, probe price, banked budget, acceptance evidence and the verify times that correct the
cost curve across calls, and processes (:mod:`specdec.remembered`, in the cost cache): a run of short calls is guarded
as one long call would be.

Invariants: pruning is exact (an ancestor-closed part of the tree), so sizing changes speed only. A sampled tree is
cut only to a prefix of the drafter's node order whose length was decided, with token-independent estimates, on an
earlier sampled tree's shape (none yet: the whole tree), never on its own, which may depend on its drawn tokens; a
call with sampled trees records its draft time after sizing (:meth:`size_call`). The derivations and the reasons for
the constants: docs/speculation-policy.md ("the page").
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from specdec.cost_model import CostModel
from specdec.generate_inputs import is_finite_number, is_int
from specdec.online_costs import OnlineCosts
from specdec.remembered import recall, remember
from specdec.score_bins import BINS, corrected, learn, new_bins
from specdec.tree import MAX_TREE_NODES, DraftMode, DraftTree

logger = logging.getLogger(__name__)

_CATCH_UPS = 8  # catch-up calls whose costs set what an outlier's is charged (_charge_catch_up)
# what the guard keeps across calls, in this meaning (_Kept); a memory of another format is a fresh start. Bump it
# when the guard's decisions change what a kept value means: a backoff and price from an older guard (priced while
# the combined drafter still ran its costly child) kept a cheap drafter unasked in every later short call
MEMORY_FORMAT = 2


@dataclass(frozen=True)
class _Kept:
    """What a sizer keeps under its ``memory`` key when a sequence finishes, in this process and in the cost cache
    (:mod:`specdec.remembered`; JSON: lists, no tuples)."""

    backoff: int = 0  # the guard's backoff of that sequence
    score_bins: list = field(default_factory=list)  # acceptance evidence: [accepted, predicted] per score bin
    unscored: list = field(default_factory=list)  # [depth, rank, accepted, tried] per (depth, rank) seen
    tokens: float | None = None  # the sequence's running expected tokens of a drafted step
    cost: float | None = None  # ... and its cost
    last_shape: list | None = None  # parents of the last sampled tree
    price: float | None = None  # the guard's probe price (None: drafting paid when the sequence finished)
    # with the backoff, a run of calls is guarded as one long call is (short calls still probe a drafter remembered
    # not to pay: the page, Memory)
    skip: int = 0  # steps of the backoff left to skip
    credit: float = 0.0  # probe budget banked (below zero: a catch-up still being paid back)
    format: int = 0  # MEMORY_FORMAT when written (0: a memory older than the format)
    # the verify-cost correction's last evidence (OnlineCosts.kept): a run of short calls corrects the curve too
    verify_times: list = field(default_factory=list)
    since_plain: list = field(default_factory=list)
    measure_credit: list = field(default_factory=list)
    catch_ups: list = field(default_factory=list)  # the last catch-up calls' costs in decode steps (_charge_catch_up)
    # a queued plain step's seconds per batch bucket, [[bucket, seconds], ...] (TreeSizer.plain_price): the next call
    # prices by it (a float, from before it was kept per bucket: nothing)
    queued: list | None = None

    @classmethod
    def recalled(cls, key: tuple | None) -> "_Kept | None":
        """What is kept under ``key``; None: nothing, another version's memory, or a damaged one (:func:`_damaged`,
        named in a warning)."""
        data = recall("guard", key, persist=True, damaged=_damaged)
        if not _this_format(data):
            return None
        return cls(**data)


def _this_format(data: object) -> bool:
    """Whether ``data`` is a guard memory as this version writes it (fields of _Kept, MEMORY_FORMAT); a memory older
    than a field leaves it at its default."""
    return isinstance(data, dict) and data.get("format") == MEMORY_FORMAT and data.keys() <= _KEPT_FIELDS


_number = is_finite_number


def _count(x: object) -> bool:
    return is_int(x) and x >= 0


def _bucket(x: object) -> bool:
    return _count(x) and x >= 1


def _seconds(x: object) -> bool:
    return _number(x) and x > 0


def _rows(*checks: Callable[[object], bool]) -> Callable[[object], bool]:
    """A check of a list of rows of len(checks) values, each passing its check."""
    return lambda v: isinstance(v, list) and all(
        isinstance(row, list) and len(row) == len(checks) and all(c(x) for c, x in zip(checks, row, strict=True))
        for row in v)


def _optional(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


# what TreeSizer.release writes into each field of a guard memory (a queued float: an older call's, ignored)
_KEPT_CHECKS: dict[str, Callable[[object], bool]] = {
    "backoff": _count, "skip": _count, "credit": _number, "format": _count,
    "tokens": _optional(_number), "cost": _optional(_number), "price": _optional(_number),
    "score_bins": _rows(_number, _number), "unscored": _rows(_count, _count, _number, _number),
    "last_shape": _optional(lambda v: isinstance(v, list) and all(
        is_int(p) and -1 <= p < i for i, p in enumerate(v))),
    "verify_times": _rows(_bucket, _bucket, lambda v: isinstance(v, list) and bool(v) and all(map(_seconds, v))),
    "since_plain": _rows(_bucket, _count), "measure_credit": _rows(_bucket, _number),
    "catch_ups": lambda v: isinstance(v, list) and all(map(_number, v)),
    "queued": lambda v: v is None or _number(v) or _rows(_bucket, _seconds)(v),
}
_KEPT_FIELDS = frozenset(f.name for f in fields(_Kept))


def _damaged(data: object) -> str | None:
    """What makes a recalled guard memory unusable (None: nothing): not an object, or one of this format holding a
    value TreeSizer.release never writes (a damaged file's). Another version's memory is no damage: recalled
    starts fresh without a word."""
    if not isinstance(data, dict):
        return "not an object"
    if not _this_format(data):
        return None
    wrong = [name for name, value in data.items() if not _KEPT_CHECKS[name](value)]
    return f"its {', '.join(wrong)}" if wrong else None


def _path_probs(accept: list[float], parents: list[int]) -> list[float]:
    """P_i: the product of the acceptance estimates along node i's path."""
    path: list[float] = []
    for a, p in zip(accept, parents, strict=True):
        path.append(a * (path[p] if p >= 0 else 1.0))
    return path


def best_prefix(gains: list[float], draft: float, costs: list[float], margin: float) -> int:
    """k maximising ``(1 + sum(gains[:k])) / (draft + c(1 + k))`` (``costs[k]``: c(1 + k) / c(1)), 0 unless it
    beats the empty tree by ``margin``: how many nodes, taken in the order of ``gains``, a tree keeps."""
    best_k, best, expected = 0, (1.0 + margin) / (draft + 1.0), 1.0
    for k, gain in enumerate(gains, start=1):
        expected += gain
        ratio = expected / (draft + costs[k])
        if ratio > best:
            best_k, best = k, ratio
    return best_k


@functools.lru_cache(maxsize=1024)  # a drafter proposes few shapes (EAGLE's, a static tree's): each worked out once
def _unscored_keys(parents: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(depth, rank among siblings) per node, capped: what unscored acceptance is learned and looked up by."""
    seen: dict[int, int] = {}
    depths: list[int] = []
    keys = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
        rank = seen.get(p, 0)
        seen[p] = rank + 1
        keys.append((min(depths[-1], 16), min(rank, 4)))
    return tuple(keys)


def _walk(tree: DraftTree, committed: list[int], verified: set[int] | None = None, accepted: set[int] | None = None
          ) -> tuple[list[int], set[int], int, bool]:
    """The nodes of ``tree`` tried by a step that committed ``committed`` (in node order), those accepted, the
    accepted path's depth, and whether the tokens ran out on an accepted path with nodes below (undecided).

    A node is tried when its parent is the root or accepted; the nodes below a rejected one are never looked at.
    Deterministic trees: accepted when its token is the committed one at its depth. Sampled trees (``verified``
    given): tried when verified, accepted when in ``accepted``."""
    children = tree.children  # index 0: the root's, i + 1: node i's
    tokens = tree.tokens.tolist()
    tried, on_path, level, longest = [], set(), children[0], 0
    for depth in range(1, len(tokens) + 1):
        if verified is None and depth > len(committed):
            return sorted(tried), on_path, longest, bool(level)
        below = []
        for i in level:
            if verified is not None:
                if i in verified:
                    tried.append(i)
                ok = i in accepted
            else:
                tried.append(i)
                ok = committed[depth - 1] == tokens[i]
            if ok:
                on_path.add(i)
                longest = depth
                below += children[i + 1]
        if not below:
            break
        level = below
    # learned in node order, as the decaying sums' rounding expects
    return sorted(tried), on_path, longest, False


@dataclass(frozen=True)
class SizingConfig:
    """The constants of tree sizing and the break-even guard, fixed for a sizer (validated here)."""

    prior: float = 0.3  # acceptance assumed for unscored nodes before any observation
    # pseudo-observations behind the prior, and behind a score bin's correction (toward the pooled one, which is
    # toward 1: specdec.score_bins)
    prior_weight: float = 2.0
    ema: float = 0.2  # weight of the newest wall-time sample
    probe_budget: float = 0.01  # at most this fraction of a decode step per step spent on probes
    max_backoff: int = 256  # the most steps the guard holds a drafter off after a step that did not pay
    decay: float = 0.95  # per observation of a bin / (depth, rank): old evidence fades, estimates follow the text
    # a draft must be expected to beat plain decoding by this fraction to be verified or to count as paying
    # (the page, Sizing)
    margin: float = 0.05
    # weight of the newest drafted step in a sequence's running expected tokens and cost (the page, break-even
    # guard)
    judge_ema: float = 0.25
    # a catch-up is charged at most this many times what the drafter's recent catch-ups cost (_charge_catch_up)
    catch_up_cap: float = 3.0
    # at most this fraction of a decode step per step spent asking a held-off drafter in hindsight (module doc, Looks)
    look_budget: float = 0.02

    def __post_init__(self) -> None:
        if not (0 <= self.prior <= 1 and self.prior_weight > 0 and 0 < self.ema <= 1 and self.probe_budget > 0
                and self.max_backoff >= 0 and 0 <= self.margin < 1 and 0 < self.judge_ema <= 1
                and self.catch_up_cap >= 1 and self.look_budget >= 0):
            raise ValueError(f"invalid SizingConfig {self}")


@dataclass
class DraftTime:
    """A drafter's wall seconds per propose call: an exponential average (weight ``ema`` on the newest call).

    ``record(seconds, catch_up=True)``: the call included a one-off, not a step's cost: a sequence's first (the
    drafter caught up on its whole prompt: EAGLE's layer over every prompt row, a draft model's prefill), or a
    CUDA-graph capture (:func:`specdec.cuda_graphs.captures`; ~0.1-1 s on a GPU, which as a step's time would price
    the guard's probes at a hundred steps' worth or more). It stands in
    only while nothing else is known, and the next call's time replaces it: as the first sample of the average, a
    512-token summary's first EAGLE call (~16 steps' worth) set a maximal backoff that the guard's memory carried
    into the next calls (EAGLE then drafted nothing on qa after summarisation). Used by the tree sizer, and per part
    by the combined drafter's child gate (per child) and EAGLE's depth chooser (per level).

    ``low``: the lower envelope of the step calls' times (it falls to a faster call at once and rises toward slower
    ones at the average's weight): what asking the drafter costs at least, its cheapest path (the combined drafter
    with its costly child gated out, EAGLE one level deep), the guard's probe price."""

    ema: float
    seconds: float | None = None  # None: no call timed yet
    provisional: bool = False  # seconds is a catch-up call's time, replaced by the next call's
    low: float | None = None  # None: no step call timed yet

    def record(self, seconds: float, catch_up: bool = False) -> None:
        if catch_up:
            if self.seconds is None:
                self.seconds, self.provisional = seconds, True
            return
        self.low = seconds if self.low is None else min(seconds, self.low + self.ema * (seconds - self.low))
        if self.seconds is None or self.provisional:
            self.seconds, self.provisional = seconds, False
            return
        self.seconds += self.ema * (seconds - self.seconds)


@dataclass
class _Guard:
    """One sequence's break-even guard: its backoff, running averages and probe bank (the page, break-even guard)."""

    backoff: int = 0  # steps skipped after the last drafted step that did not pay (the next: 4x, at least 2)
    skip: int = 0  # steps left to skip
    tokens: float | None = None  # running expected committed tokens of a drafted step (the page, break-even guard)
    cost: float | None = None  # running cost of a drafted step in decode steps: draft + c(1 + kept nodes)
    # while drafting does not pay: what a probe surely costs (its draft), in decode steps (None: it pays, or
    # nothing is known yet); a probe waits until the sequence has banked that much probe budget (credit)
    price: float | None = None
    credit: float = 0.0  # probe budget banked: probe_budget per step, spent by probes, kept across calls (_Kept)
    charged: float | None = None  # the price this step's probe was charged when asked (None: no probe asked)


@dataclass
class _Pending:  # what was proposed for a sequence this step, to learn from the commit
    tree: DraftTree
    accept: list[float]  # a_i used for sizing
    kept: list[int]  # indices (into tree) of the nodes verified, ascending: the pruned tree's node order
    cost: float  # of the whole tree, in decode steps: draft + c(1 + num_nodes)
    batch: int  # live sequences when it was drafted: what a plain step it is judged against costs (_pays)
    best: int  # the first node of the sizing order: what a measured verify keeps of a tree cut to nothing
    # the nodes in sizing order and each node's P_i, by which a padded batch's cap cuts (_cap_padded)
    order: list[int] = field(default_factory=list)
    path: list[float] = field(default_factory=list)


@dataclass
class _Look:  # a held-off sequence's draft, asked in hindsight (TreeSizer.looked_back): judged by the text that comes
    tree: DraftTree  # deterministic
    cost: float  # of the whole tree, in decode steps, as a drafted step's (_Pending.cost)
    batch: int  # live sequences when it was asked
    committed: list[int] = field(default_factory=list)  # the tokens committed since


@dataclass
class TreeSizer:
    """One engine's tree sizing and break-even guard over the calibrated ``costs`` (module doc). What the engine
    fixes for the run (``padded``, ``calibrated_scores``, ``queues_held_off``) is set when it is built."""

    costs: CostModel
    config: SizingConfig = field(default_factory=SizingConfig)
    memory: tuple | None = None  # key of the guard's memory across calls (module doc); None: start fresh
    # the drafter calibrates its deterministic trees' scores itself (Drafter.calibrated_scores): taken as they are
    calibrated_scores: bool = False
    # the drafter's own account of its cheapest call (Drafter.cheapest_call_seconds), asked when a probe is priced
    cheapest_call: Callable[[], float | None] | None = None
    # the verify pads every sequence to the batch's largest tree (CUDA-graph buckets): trees are capped together
    padded: bool = False

    def __post_init__(self) -> None:
        if not self.costs.measured:  # nothing learned on unmeasured costs is kept, nor read
            self.memory = None
        self.unscored: dict[tuple[int, int], list[float]] = {}  # (depth, rank) -> [accepted, tried]
        self.rates_of: dict[tuple, list[float]] = {}  # _rates per node-key tuple, until unscored learns again
        self.score_bins = new_bins()  # [accepted, predicted] of tried scored nodes (specdec.score_bins)
        # sampled trees are cut by the shape of an earlier one (_sampled_prefix): per sequence, and the last one
        # of any sequence whose step has finished
        self.shapes: dict[int, list[int]] = {}
        self.last_shape: list[int] | None = None
        self.online = OnlineCosts(self.costs)  # the calibrated curve, corrected by this run's verify times
        kept = _Kept.recalled(self.memory)
        self.catch_ups: list[float] = [] if kept is None else list(kept.catch_ups[-_CATCH_UPS:])
        if kept is not None and len(kept.score_bins) == BINS:  # what earlier calls learned (the page, Memory)
            self.score_bins = [list(b) for b in kept.score_bins]
            self.unscored = {(d, r): [a, t] for d, r, a, t in kept.unscored}
            self.last_shape = None if kept.last_shape is None else list(kept.last_shape)
            self.online.restore(kept.verify_times, kept.since_plain, kept.measure_credit)
        self.guards: dict[int, _Guard] = {}
        self.pending: dict[int, _Pending] = {}
        self.looks: dict[int, _Look] = {}  # held-off sequences' drafts in hindsight, until the text judges them
        self.look_credit = 0.0  # look_budget banked per queued step, spent by looks (who_looks_back)
        self.draft_time = DraftTime(self.config.ema)  # seconds per propose call
        self.decode_seconds: float | None = None  # EMA of a plain decode step, from verify times
        # per batch bucket, EMA of a plain step queued behind an unread one (specdec.decode_ahead): what a held-off
        # step costs where the engine queues them (plain_price); a bucket absent: none timed
        # (a recalled memory's rows are checked, _damaged; a float, kept by an older call of no known batch: none)
        self.queued_seconds: dict[int, float] = (
            {int(b): float(t) for b, t in kept.queued} if kept is not None and isinstance(kept.queued, list) else {})
        self.queues_held_off = False  # the engine queues the steps the guard holds all off (set when it is built)
        self.paid = 0  # proposals that were expected to pay (stats, tests)
        self.unpaid = 0
        # no sequence drafts: never_pays held (switch_off), or the costs are unmeasured (a context too short to time,
        # specdec.cost_model), which price every verified token at a decode step
        self.off = not self.costs.measured

    # ---- costs ----------------------------------------------------------------------------
    def _ema(self, old: float | None, new: float, weight: float | None = None) -> float:
        """The running average ``old`` moved toward ``new`` (weight: the config's ``ema`` by default)."""
        return new if old is None else old + (self.config.ema if weight is None else weight) * (new - old)

    def record_draft(self, draft_seconds: float, catch_up: bool = False) -> None:
        """Wall time of one propose call, recorded before its trees are sized: the first probe's judgement (and so
        the guard's first backoff) already knows what drafting costs.

        ``catch_up``: the call included a one-off (a sequence's first, a CUDA-graph capture) that prices this call's
        judgement only when nothing else is known (:class:`DraftTime`)."""
        self.draft_time.record(draft_seconds, catch_up)

    def record_step(self, verify_seconds: float, query_tokens: int, batch: int, queued: bool = False) -> None:
        """Wall time of one step's verify with ``query_tokens`` tokens for its largest sequence. ``queued``: a plain
        step launched before the one before it was read, kept apart (:meth:`plain_price`): the curve's c(1) stays a
        step read back, as every drafted step is."""
        if queued:
            bucket = self.costs.batch_bucket(batch)
            self.queued_seconds[bucket] = self._ema(self.queued_seconds.get(bucket), verify_seconds)
            return
        self.online.record(verify_seconds, query_tokens, batch)
        relative = self.online.relative(query_tokens, batch)
        self.decode_seconds = self._ema(self.decode_seconds, verify_seconds / relative)

    def plain_step_due(self, batch: int) -> bool:
        """Whether every sequence decodes plainly this step, so that the verify-cost correction measures a plain step
        (:meth:`OnlineCosts.plain_step_due`; a run whose steps all draft has none). Exact: a plain step commits the
        target's own token, by the same rule as any step."""
        return not self.off and self.online.plain_step_due(batch)

    def step_seconds(self, batch: int) -> float:
        """Wall seconds of one plain decode step: this run's, else the cost model's at ``batch``."""
        return self.decode_seconds or self.costs.decode_seconds(batch)

    def plain_price(self, batch: int) -> float:
        """What a held-off step costs in decode steps read back: a queued step's time (the engine queues them where
        the guard holds every sequence off: specdec.decode_ahead) over :meth:`step_seconds`, at most 1; 1 until one
        is timed at the batch's bucket (a batch of 1's queued step prices no batch of 32). Drafting pays where it
        beats that, and a probe costs the queued step it replaces too."""
        queued = self.queued_seconds.get(self.costs.batch_bucket(batch))
        if not self.queues_held_off or queued is None:
            return 1.0
        return min(queued / self.step_seconds(batch), 1.0)

    def probe_cost(self, batch: int) -> float:
        """What asking the drafter costs at least, in plain decode steps: its cheapest recent call (DraftTime.low), or
        less where the drafter knows its next call to be cheaper than any it made (``cheapest_call``)."""
        low = self.draft_time.low
        told = self.cheapest_call() if self.cheapest_call is not None and low is not None else None
        if told is not None:
            low = min(low, told)
        return (low or 0.0) / self.step_seconds(batch)

    def draft_cost(self, batch: int) -> float:
        """The drafter's cost per step in plain decode steps (0 before its first call)."""
        if self.draft_time.seconds is None:
            return 0.0
        return self.draft_time.seconds / self.step_seconds(batch)

    # ---- the guard --------------------------------------------------------------------------
    def _guard(self, seq_id: int) -> _Guard:
        if seq_id not in self.guards:
            kept = _Kept.recalled(self.memory) or _Kept()
            self.guards[seq_id] = _Guard(backoff=kept.backoff, skip=kept.skip, tokens=kept.tokens, cost=kept.cost,
                                         price=kept.price, credit=kept.credit)
        return self.guards[seq_id]

    def _pays(self, tokens: float, cost: float, batch: int) -> bool:
        """Whether a drafted step's ``tokens`` for its ``cost`` beat the run's plain steps at ``batch`` (their price:
        :meth:`plain_price`) by the margin."""
        return tokens * self.plain_price(batch) > cost * (1.0 + self.config.margin)

    def _kept_price(self, guard: _Guard) -> float | None:
        """The probe price a finished sequence leaves to the next call: by its running averages, not its last step
        (a paying drafter's last step, cut to the token budget, is an unpaid one). Priced at a batch of 1, as
        :meth:`probe_cost` is here: the next call's batch is not known."""
        if guard.tokens is None or guard.cost is None or self._pays(guard.tokens, guard.cost, 1):
            return None
        return guard.price if guard.price is not None else self.probe_cost(1)

    def never_pays(self, forward_seconds: float | None, batch: int = 1) -> bool:
        """Whether a drafter whose every depth costs ``forward_seconds`` (one forward of its own model; None:
        unknown) could never pay, even with every node accepted: ``1 + L <= L r + c(1 + L)`` for every depth L,
        r = forward_seconds / c(1)."""
        if forward_seconds is None:
            return False
        r = forward_seconds / self.costs.decode_seconds(batch)
        return all(1 + n <= n * r + self.costs.relative(1 + n, batch) for n in range(1, MAX_TREE_NODES + 1))

    def switch_off(self) -> None:
        """Decode every sequence plainly from now on (the drafter is never asked)."""
        self.off = True

    def wants_draft(self, seq_id: int) -> bool:
        """Whether the drafter proposes for ``seq_id`` this step (called once per live sequence per step)."""
        guard = self._guard(seq_id)
        if self.off:
            return False
        guard.credit = self._banked(guard)
        if self._holds_off(guard, guard.credit):
            guard.skip = max(guard.skip - 1, 0)
            return False
        if guard.price is not None:
            guard.credit -= guard.price
        guard.charged = guard.price
        return True

    def queue_due(self, batch: int) -> bool:
        """Whether the plain step the verify-cost correction asks for now should have the next step queued behind it:
        where held-off steps are queued (the engine sets ``queues_held_off``) and none has been timed at this batch's
        bucket, a guard that never holds a step off would price every draft against a step read back
        (:meth:`plain_price`), dearer than a queued one. Once one is timed (or remembered) there, never again."""
        return (not self.off and self.queues_held_off and self.costs.batch_bucket(batch) not in self.queued_seconds
                and self.online.plain_step_due(batch))

    def skips_next(self, seq_ids: list[int]) -> bool:
        """Whether the next :meth:`wants_draft` of every one of ``seq_ids`` is sure to say no, read without changing
        what the guard counts (a sequence not seen yet: not sure)."""
        if self.off:
            return True
        for seq_id in seq_ids:
            guard = self.guards.get(seq_id)
            if guard is None or not self._holds_off(guard, self._banked(guard)):
                return False
        return True

    def _banked(self, guard: _Guard) -> float:
        """The probe budget ``guard`` holds at its next step: probe_budget of a decode step per step, at most one
        step's worth (or one probe's) banked; a drafter that does not pay probes only on what has been banked, in
        this call and the calls it remembers, so a call too short to afford a probe decodes plainly and leaves its
        savings to the next (the page, break-even guard)."""
        return min(guard.credit + self.config.probe_budget, max(1.0, guard.price or 0.0))

    @staticmethod
    def _holds_off(guard: _Guard, credit: float) -> bool:
        """Whether ``guard``, holding ``credit`` at this step, skips the drafter: inside its backoff, or short of its
        probe's price (:meth:`wants_draft` decides by it, :meth:`skips_next` foresees by it)."""
        return guard.skip > 0 or (guard.price is not None and credit < guard.price)

    def _charge_catch_up(self, seq_ids: list[int], draft_seconds: float, batch: int) -> None:
        """A probe whose call was a catch-up (a sequence's first: the drafter caught up on its prompt; or a CUDA-graph
        capture) is charged all it cost, not its price: the bank may go below zero and is paid back before the next
        probe. In a run of short calls nearly every probe is a sequence's first ask of its call; charged its price
        only, EAGLE's or a draft model's catch-ups cost 5-9% of such a run where the budget is 1%.

        An outlier (a GC pause, a descheduled process, a CUDA-graph capture) is charged at most ``catch_up_cap``
        times what the drafter's catch-ups cost: the second largest of its last ``_CATCH_UPS`` (kept across calls;
        none yet: in full), so one outlier among them raises no cap, and two catch-ups of longer prompts do. A
        probe's debt is then at most that charge, and the drafter is probed again within charge / probe_budget steps
        (or its backoff): charged in full, one 50 ms pause on 2 ms steps kept a drafter unprobed for ~2,500 steps,
        across the calls that remembered the debt, however the text changed."""
        cost = draft_seconds / self.step_seconds(batch)
        recent = sorted(self.catch_ups)
        charge = min(cost, self.config.catch_up_cap * recent[-min(2, len(recent))]) if recent else cost
        self.catch_ups = [*self.catch_ups, cost][-_CATCH_UPS:]
        for seq_id in seq_ids:
            guard = self.guards.get(seq_id)
            if guard is not None and guard.charged is not None:
                guard.credit -= max(charge - guard.charged, 0.0)

    def _judge(self, seq_id: int, tokens: float, verify: float, batch: int) -> None:
        """A drafted step's expected committed tokens and cost (the draft, plus ``verify``: c(1 + kept nodes) in
        decode steps) join the sequence's running averages, which decide whether drafting pays (the page, break-even
        guard)."""
        draft = self.draft_cost(batch)
        cost = draft + verify
        guard = self._guard(seq_id)
        guard.tokens = self._ema(guard.tokens, tokens, self.config.judge_ema)
        guard.cost = self._ema(guard.cost, cost, self.config.judge_ema)
        if self._pays(guard.tokens, guard.cost, batch):
            # undo one growth step: a lucky probe of a drafter that rarely pays does not restart its ramp
            self.paid += 1
            guard.backoff //= 4
            guard.price = None
            logger.debug("sequence %d: drafting pays (%.2f tokens a step for %.2f decode steps, batch %d)", seq_id,
                         guard.tokens, guard.cost, batch)
            return
        self.unpaid += 1
        # a probe costs its draft and the verify of its kept tree beyond a plain step: at most probe_budget of a
        # decode step per step on average. The draft is priced as a probe is, by its cheapest recent call: the
        # average lags a drafter that has made itself cheaper (the combined drafter, its costly child gated out,
        # was held back for dozens of steps by the calls before its gate had decided)
        # (and, where held-off steps are queued, the queued step it replaces: plain_price)
        plain = self.plain_price(batch)
        excess = verify - plain + (draft if self.draft_time.low is None else self.probe_cost(batch))
        cap = min(self.config.max_backoff, int(max(excess, 0.0) / self.config.probe_budget))
        guard.backoff = min(max(4 * guard.backoff, 2), cap)
        guard.skip = guard.backoff
        logger.debug("sequence %d: drafting does not pay (%.2f tokens a step for %.2f decode steps, batch %d): the "
                     "next %d steps decode plainly", seq_id, guard.tokens, guard.cost, batch, guard.skip)
        # the price: what asking the drafter costs for sure, its cheapest draft (the verify of a kept tree is the
        # sizer's bet, placed only where the tree is expected to pay; a costly part of the drafter, the combined
        # drafter's child gate budgets); a catch-up call's time is no step's (DraftTime)
        if self.draft_time.low is not None:
            guard.price = self.probe_cost(batch) + 1.0 - plain

    # ---- acceptance estimates ---------------------------------------------------------------
    def acceptance(self, tree: DraftTree, use_scores: bool = True) -> list[float]:
        """a_i = estimated P(node i accepted | parent accepted), per node."""
        cfg = self.config
        if tree.scores is not None and use_scores:
            if self.calibrated_scores and tree.mode is DraftMode.DETERMINISTIC:
                return tree.scores.tolist()
            # each bin's correction shrinks toward the pooled one, not toward 1 (specdec.score_bins): a drafter
            # over-confident by 2x everywhere was read as over-confident by ~1.2x, its trees kept where they did not pay
            return corrected(tree.scores.tolist(), self.score_bins, cfg.prior_weight)
        return self._rates(_unscored_keys(tuple(tree.parents.tolist())))

    def _rates(self, keys: tuple[tuple[int, int], ...]) -> list[float]:
        """The acceptance observed in this run (with the prior) per (depth, rank among siblings); the list is shared
        by the trees of that shape until :meth:`observe` learns (read it, never change it)."""
        out = self.rates_of.get(keys)
        if out is None:
            cfg = self.config
            out = self.rates_of[keys] = [(acc + cfg.prior * cfg.prior_weight) / (tried + cfg.prior_weight)
                                         for acc, tried in (self.unscored.get(key, (0.0, 0.0)) for key in keys)]
        return out

    def _relative_costs(self, batch: int, nodes: int) -> list[float]:
        """c(1 + k) / c(1) for k = 0..nodes at ``batch``: looked up once for a whole call's trees (the costs move only
        when a verify is recorded)."""
        return [self.online.relative(1 + k, batch) for k in range(nodes + 1)]

    # ---- sizing -----------------------------------------------------------------------------
    def size_call(self, seq_ids: list[int], trees: list[DraftTree], batch: int, draft_seconds: float,
                  catch_up: bool = False, verified: bool = False) -> list[DraftTree]:
        """Size every tree of one propose call (:meth:`size`; capped together where the verify is ``padded``:
        :meth:`_cap_padded`; one node of a tree cut to nothing where a measured verify is due:
        :meth:`OnlineCosts.measure_due`) and record the call's draft time.

        A call of deterministic trees is priced by its own time (the first probe already knows what drafting
        costs). With a sampled tree the time is recorded after sizing: a drafter whose run time depended on what
        it drew must not move the cut (module doc, Invariants). ``verified``: the trees were verified whole
        before this call (pending trees, specdec/pending_trees.py): sized to learn what would have been cut, their
        acceptance is learned node for node."""
        sampled = any(t.mode is not DraftMode.DETERMINISTIC for t in trees)
        if catch_up:
            self._charge_catch_up(seq_ids, draft_seconds, batch)
        if not sampled:
            self.record_draft(draft_seconds, catch_up)
        costs = self._relative_costs(batch, max((t.num_nodes for t in trees), default=0))
        for seq_id, tree in zip(seq_ids, trees, strict=True):
            self._size(seq_id, tree, batch, costs)
        if self.padded and not sampled and batch > 1:  # a lone tree too: the sequences not asked run its padded verify
            self._cap_padded(seq_ids, costs, batch)
        for seq_id in seq_ids:  # what is verified, after the cap
            self._judge_kept(seq_id, costs, batch)
        for seq_id in seq_ids:
            pending = self.pending.get(seq_id)
            if pending is not None and not pending.kept and not verified and self.online.measure_due(
                    batch, self.config.margin):
                pending.kept = [pending.best]  # judged as the empty tree it was: a measurement, not a bet
        out = [self._kept_tree(seq_id, tree) for seq_id, tree in zip(seq_ids, trees, strict=True)]
        if sampled:
            self.record_draft(draft_seconds, catch_up)
        if verified:
            for seq_id in seq_ids:
                pending = self.pending.get(seq_id)
                if pending is not None:
                    pending.kept = list(range(pending.tree.num_nodes))
        return out

    def size(self, seq_id: int, tree: DraftTree, batch: int, costs: list[float] | None = None) -> DraftTree:
        """The best-paying ancestor-closed part of ``tree`` (possibly empty); judges the guard. ``costs``: this
        call's :meth:`_relative_costs` (looked up here if not given)."""
        if costs is None or len(costs) <= tree.num_nodes:
            costs = self._relative_costs(batch, tree.num_nodes)
        self._size(seq_id, tree, batch, costs)
        self._judge_kept(seq_id, costs, batch)
        return self._kept_tree(seq_id, tree)

    def _kept_tree(self, seq_id: int, tree: DraftTree) -> DraftTree:
        """What :meth:`_size` (and a padded call's cap) kept of ``tree``: one gather per tree and call."""
        pending = self.pending.get(seq_id)
        if pending is None or len(pending.kept) == tree.num_nodes:
            return tree
        return tree.subtree(pending.kept)

    def _size(self, seq_id: int, tree: DraftTree, batch: int, costs: list[float]) -> None:
        """:meth:`size`'s choice, kept as the sequence's pending record (its ``kept`` nodes), for the guard to judge
        (:meth:`_judge_kept`) once a padded call's cap has cut it. ``costs``: c(1 + k) / c(1) up to the whole tree."""
        if tree.num_nodes == 0:
            self.pending.pop(seq_id, None)
            return
        d = self.draft_cost(batch)
        parents = tree.parents.tolist()
        if tree.mode is DraftMode.DETERMINISTIC:
            accept = self.acceptance(tree)
            path = _path_probs(accept, parents)
            order = sorted(range(len(path)), key=path.__getitem__, reverse=True)  # stable: ties in node order
            best_k = best_prefix([path[i] for i in order], d, costs, self.config.margin)
        else:  # a prefix of the drafter's order, its length fixed before this tree was drawn (module doc)
            accept = self.acceptance(tree, use_scores=False)
            path = _path_probs(accept, parents)
            order = list(range(len(path)))
            best_k = self._sampled_prefix(seq_id, tree, d, batch, costs)
            self.shapes[seq_id] = parents
        kept = sorted(order[:best_k])
        self.pending[seq_id] = _Pending(tree, accept, kept, d + costs[tree.num_nodes], batch, order[0], order, path)

    def _judge_kept(self, seq_id: int, costs: list[float], batch: int) -> None:
        """The guard judges what the sequence's tree has verified of it, as sized and capped (a tree cut to nothing, or
        none: the empty tree): its expected tokens for c(1 + kept nodes); a measured verify's node is not counted."""
        pending = self.pending.get(seq_id)
        if pending is None:
            self._judge(seq_id, 1.0, 1.0, batch)
            return
        kept = len(pending.kept)  # the first nodes of its sizing order
        self._judge(seq_id, 1.0 + sum(pending.path[i] for i in pending.order[:kept]), costs[kept], batch)

    def _cap_padded(self, seq_ids: list[int], costs: list[float], batch: int) -> None:
        """The kept trees cut to at most K nodes each, K chosen for the whole call: a padded verify costs every sequence
        c(1 + the largest kept tree), so one sequence's long tree prices the batch's step. K maximises the call's
        expected tokens over that cost; 0 (no tree) unless it beats plain steps by the margin, as :func:`best_prefix`
        judges one tree. Each tree keeps a prefix of its own sizing order, ancestor-closed as before."""
        kept = {seq_id: len(self.pending[seq_id].kept) for seq_id in seq_ids if seq_id in self.pending}
        if not any(kept.values()):
            return
        d = self.draft_cost(batch)
        best_k, best = 0, batch * (1.0 + self.config.margin) / (d + 1.0)  # the step's every sequence, asked or not
        gain_at = [0.0] * max(kept.values())  # what every tree's k-th kept node adds
        for i, n in kept.items():
            pending = self.pending[i]
            for k, node in enumerate(pending.order[:n]):
                gain_at[k] += pending.path[node]
        expected = float(batch)  # one token each, and the gains of every tree's first k nodes it kept
        for k, gain in enumerate(gain_at, start=1):
            expected += gain
            if expected / (d + costs[k]) > best:
                best_k, best = k, expected / (d + costs[k])
        for seq_id, n in kept.items():
            if n > best_k:
                pending = self.pending[seq_id]
                pending.kept = sorted(pending.order[:best_k])

    def _sampled_prefix(self, seq_id: int, tree: DraftTree, draft: float, batch: int, costs: list[float]) -> int:
        """How many leading nodes of a sampled tree to verify, decided on the shape of the last sampled tree
        this sequence (else any sequence of this sizer, in a finished step) proposed: nothing of the tree at
        hand, whose shape may depend on its drawn tokens. No such shape yet: the whole tree."""
        reference = self.shapes.get(seq_id, self.last_shape)
        if reference is None:
            return tree.num_nodes
        if len(costs) <= len(reference):
            costs = self._relative_costs(batch, len(reference))
        path = _path_probs(self._rates(_unscored_keys(tuple(reference))), reference)
        return min(best_prefix(path, draft, costs, self.config.margin), tree.num_nodes)

    # ---- learning ---------------------------------------------------------------------------
    def observe(self, seq_id: int, committed: list[int], accepted_nodes: list[int] | None = None) -> None:
        """After the commit: learn acceptance from the tree proposed for ``seq_id`` (pruned nodes included), and from
        its draft in hindsight (:meth:`looked_back`) once the text has judged it.

        Deterministic trees: a node was tried when its parent's path equals the committed tokens, and would
        have been accepted when its own token is the next committed one (exact for greedy; for sampling the
        chance that the target's token equals the candidate is its acceptance probability). Sampled trees:
        only verified nodes count, by ``accepted_nodes`` (indices into the verified, pruned tree)."""
        if seq_id in self.looks:
            self._look_judged(seq_id, committed)
        pending = self.pending.pop(seq_id, None)
        if pending is None:
            return
        tree = pending.tree
        if tree.mode is DraftMode.DETERMINISTIC:
            tried, on_path, longest, _ = _walk(tree, committed)
        else:
            accepted = {pending.kept[j] for j in accepted_nodes or []}
            tried, on_path, longest, _ = _walk(tree, committed, set(pending.kept), accepted)
            self.last_shape = tree.parents.tolist()
        self._learn(tree, tried, on_path)
        if self._pays(1 + longest, pending.cost, pending.batch):  # the drafts paid (by the margin)
            self._ask_next(seq_id)

    def _ask_next(self, seq_id: int) -> None:
        """The drafter is asked for ``seq_id`` at its next step, one growth step of the backoff undone: its last
        tree, or a look, would have paid."""
        guard = self._guard(seq_id)
        guard.backoff, guard.skip, guard.price = guard.backoff // 4, 0, None

    def _learn(self, tree: DraftTree, tried: list[int], on_path: set[int]) -> None:
        """The acceptance evidence of one judged tree: its ``tried`` nodes, accepted where ``on_path``."""
        if tree.scores is not None and tree.mode is DraftMode.DETERMINISTIC:
            if not self.calibrated_scores:  # else the drafter learns them itself
                scores = tree.scores.tolist()
                for i in tried:
                    learn(self.score_bins, scores[i], i in on_path, self.config.decay)
        else:
            keys = _unscored_keys(tuple(tree.parents.tolist()))
            for i in tried:
                entry = self.unscored.setdefault(keys[i], [0.0, 0.0])
                entry[0] = entry[0] * self.config.decay + float(i in on_path)
                entry[1] = entry[1] * self.config.decay + 1.0
            self.rates_of.clear()

    # ---- looks: a held-off drafter asked in hindsight -----------------------------------------
    def who_looks_back(self, seq_ids: list[int]) -> list[int]:
        """Of ``seq_ids`` (a queued step's, every one held off), those whose drafter to ask in hindsight now: held off
        at their next step too, with no look still open, while the looks' bank (``look_budget`` of a decode step per
        queued step) is above zero. Called once per queued step (module doc, Looks)."""
        if self.off or not self.queues_held_off:
            return []
        self.look_credit = min(self.look_credit + self.config.look_budget, 1.0)
        if self.look_credit <= 0:
            return []
        return [i for i in seq_ids if i not in self.looks and i in self.guards
                and self._holds_off(self.guards[i], self._banked(self.guards[i]))]

    def looked_back(self, seq_ids: list[int], trees: list[DraftTree], seconds: float, batch: int) -> None:
        """The drafter's trees for the sequences :meth:`who_looks_back` named, proposed in ``seconds`` (charged to the
        looks' bank) and never verified: each deterministic tree is judged by the tokens committed after it
        (:meth:`observe`)."""
        self.look_credit -= seconds / self.step_seconds(batch)
        costs = self._relative_costs(batch, max((t.num_nodes for t in trees), default=0))
        draft = self.draft_cost(batch)
        for seq_id, tree in zip(seq_ids, trees, strict=True):
            if tree.num_nodes and tree.mode is DraftMode.DETERMINISTIC:
                self.looks[seq_id] = _Look(tree, draft + costs[tree.num_nodes], batch)

    def _look_judged(self, seq_id: int, committed: list[int]) -> None:
        """A look's tree against the tokens committed since it was asked: once they decide it (a node rejected on
        every path, or a leaf reached), its nodes are learned as a drafted tree's, and if it would have paid, with the
        queue of held-off steps that asking breaks counted, the drafter is asked at the next step (one look decides:
        docs/speculation-policy.md)."""
        look = self.looks[seq_id]
        look.committed += committed
        tried, on_path, longest, undecided = _walk(look.tree, look.committed)
        if undecided:
            return
        del self.looks[seq_id]
        self._learn(look.tree, tried, on_path)
        # asking the drafter breaks the queue of held-off steps (1 - plain_price), as a probe's price counts
        if self._pays(1.0 + longest, look.cost + 1.0 - self.plain_price(look.batch), look.batch):
            self._ask_next(seq_id)

    def release(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)
        self.looks.pop(seq_id, None)
        self.shapes.pop(seq_id, None)
        guard = self.guards.pop(seq_id, None)
        if guard is not None and not self.off:
            kept = _Kept(guard.backoff, [list(b) for b in self.score_bins],
                         [[d, r, a, t] for (d, r), (a, t) in self.unscored.items()], guard.tokens, guard.cost,
                         None if self.last_shape is None else list(self.last_shape), self._kept_price(guard),
                         guard.skip, guard.credit, MEMORY_FORMAT, **self.online.kept(),
                         catch_ups=list(self.catch_ups), queued=[[b, t] for b, t in self.queued_seconds.items()])
            remember("guard", self.memory, dict(vars(kept)), persist=True)  # its lists are fresh copies already

