"""Combined drafter: runs several drafters and offers, per sequence and step, their merged tree or the best one.

    generate(model, ids, drafter="combined",
             drafter_options={"drafters": ["ngram", {"name": "medusa", "path": "heads/"}], "mode": "merge"})

Children are given by name, by name with options, or as Drafter instances (or any object with ``propose``).
Every lifecycle call (attach, on_accept, release) goes to every child; the combined drafter needs hidden
states when any child does.

Modes (``CombinedConfig.mode``): ``"merge"`` (default), the trie union of the children's trees
(:func:`specdec.tree_merge.merge_trees`) capped at ``max_nodes`` by path score; trees with draft_probs cannot be
merged exactly, so then each probabilistic tree competes whole, as in ``"best"``: the child tree with the most
expected committed tokens (1 + sum of node path acceptance estimates) per unit of estimated cost.

Estimates: a child tree's ``scores``, calibrated per child (:mod:`specdec.score_bins`: in one set of bins EAGLE's
rejected guesses cut n-gram's chains), else its acceptance per level (Beta prior: ``prior_weight`` x ``prior_score``).
Verify cost of n nodes, in decode steps: ``verify_cost(n)`` if given; else the engine's sizing curve
(``TargetView.costs``) under ``speculation="auto"``; else, with ``cost_model=True`` (not for seeded standard
sampling: no measurement may pick its trees), the calibrated curve; else ``1 + alpha * n``. Sizing may prune more.

Sampled children: whether a sampled tree is verified may depend only on what was fixed before its tokens were
drawn, so it is valued by the child's rate on the shape of its previous sampled tree, never by the tree at hand
(its drawn tokens' scores or a shape that depends on them). Deterministic candidates are valued by their nodes.

Which children run: with ``gate=True`` a child whose extra committed tokens do not cover its own draft time is
left out of a call and probed again (:mod:`specdec.drafters.child_gate`); off under ``speculation="always"``.
Where the gate has no costs (seeded sampling), a child that can never pay by its shapes is left out of the run.
A child left out still sees every ``on_accept``, and a child reading hidden states gets, at its next call, every
row since its last.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from specdec.drafters.base import Drafter, SequenceView, TargetView, as_drafter
from specdec.drafters.call_memory import memory_key
from specdec.drafters.child_gate import ChildGate
from specdec.drafters.registry import check_options, drafter_class

from specdec.cuda_graphs import captures
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.score_bins import corrected, learn, new_bins
from specdec.tree import MAX_TREE_NODES, DraftMode, DraftTree, matched_levels, proposed_trees, tried_nodes
from specdec.tree_merge import expected_committed_tokens, merge_trees, path_scores
from specdec.tree_sizing import DraftTime, SizingConfig, best_prefix

if TYPE_CHECKING:
    from specdec.models.llama import LlamaRunner

logger = logging.getLogger(__name__)

MODES = ("merge", "best")
_CALIBRATION = SizingConfig()  # the tree sizer's decay, prior weight and margin: children's calibration, gate nodes


@dataclass(frozen=True)
class CombinedConfig:
    mode: str = "merge"  # "merge": trie union of the children's trees; "best": the most valuable child tree
    max_nodes: int = MAX_TREE_NODES  # cap on the merged tree (highest path scores kept); mode 'best' merges none
    # verify cost of an n-node tree in decode steps when no verify_cost is given: 1 + alpha * n. 0.05 is the
    # order of a 2-core CPU for a handful of nodes (2-4 tokens ~1.05x a decode step); on a GPU it is ~0.
    alpha: float = 0.05
    prior_score: float = 0.5  # acceptance rate per level assumed for a child before any step was seen
    prior_weight: float = 4.0  # pseudo-trials of that prior (how fast the online estimate takes over)
    # without the engine's curve (speculation="always"), rank by the calibrated verify-cost curve
    # (specdec.cost_model) instead of 1 + alpha * n; off by default: the first use on a machine calibrates (seconds)
    cost_model: bool = False  # (not for seeded standard sampling, whose text may not depend on a measurement)
    # leave out, per call, children whose extra tokens do not cover their draft time (module doc, child_gate)
    gate: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"combined drafter: mode must be one of {list(MODES)}, got {self.mode!r}")
        if isinstance(self.max_nodes, bool) or not isinstance(self.max_nodes, int) \
                or not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise InputError(f"combined drafter: max_nodes must be an int in [1, {MAX_TREE_NODES}], "
                             f"got {self.max_nodes!r}")
        if self.mode == "best" and self.max_nodes != MAX_TREE_NODES:
            raise InputError(f"combined drafter: max_nodes={self.max_nodes} caps a merged tree, but mode='best' "
                             "offers one child's tree as it drew it: give that child its own max_nodes")
        for name, lo, hi in (("alpha", 0.0, None), ("prior_score", 0.0, 1.0), ("prior_weight", 0.0, None)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= lo \
                    or not math.isfinite(value) or (hi is not None and value > hi):
                bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
                raise InputError(f"combined drafter: {name} must be a finite number {bound}, got {value!r}")
        for name in ("cost_model", "gate"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"combined drafter: {name} must be True or False, got {getattr(self, name)!r}")


def build_child(spec: Any, index: int = 0) -> Drafter:
    """A child drafter from a name, ``{"name": ..., **options}``, or a Drafter / object with ``propose``; ``index``:
    its place in ``drafters``, which every refusal of it names (:func:`_refusals_name_child`)."""
    with _refusals_name_child(index):
        if isinstance(spec, (str, Mapping)):
            name, options = _child_options(spec)
            check_options(name, options, nested=True)  # get_drafter's check
            return as_drafter(drafter_class(name)(**options))  # a registered class need not subclass Drafter
        _check_instance(spec)
        return as_drafter(spec)


def _children(drafters: Any) -> Sequence[Any]:
    """``drafters`` if it is a non-empty list of children (each one checked on its own)."""
    if isinstance(drafters, (str, Mapping)) or not isinstance(drafters, Sequence) or not drafters:
        raise InputError(f"combined drafter: drafters must be a non-empty list of children, got {drafters!r}")
    return drafters


def _child_options(spec: str | Mapping) -> tuple[str, dict]:
    """A child given by name or as ``{"name": ..., **options}``: its name and options."""
    if isinstance(spec, str):
        return spec, {}
    options = dict(spec)
    name = options.pop("name", None)
    if not isinstance(name, str):
        raise InputTypeError(f"a child given as a dict needs a 'name' string, got {spec!r}")
    return name, options


def _check_instance(spec: Any) -> None:
    """Refuse a child that is neither a name nor a dict and no drafter instance."""
    if isinstance(spec, type):  # its propose() would be called unbound, once the model has loaded
        raise InputTypeError(f"a child must be an instance, got the class {spec.__name__}: pass {spec.__name__}(...)")
    if not callable(getattr(spec, "propose", None)):
        raise InputTypeError(f"a child must be a drafter name, a dict with 'name', or a drafter, "
                             f"got {type(spec).__name__}")


_WHERE = "combined drafter's "


def _where(index: int) -> str:
    return f"{_WHERE}drafters[{index}]"


@contextmanager
def _refusals_name_child(index: int) -> Iterator[None]:
    """A SpecdecError raised inside (a refusal of options, or of a checkpoint read for the target), re-raised as its
    own type naming the child by its place: ``combined drafter's drafters[1]: <refusal>``; one from a nested combined
    drafter's child names the whole path, ``combined drafter's drafters[0].drafters[1]: <refusal>``."""
    try:
        yield
    except SpecdecError as err:
        message = str(err)
        nested = message.startswith(_WHERE + "drafters[")
        named = f"{_where(index)}.{message[len(_WHERE):]}" if nested else f"{_where(index)}: {message}"
        raise type(err)(named) from err


def _refuse_feature_layers(child: Drafter) -> None:
    """A child that reads target layers' residual streams (an EAGLE-3 head) is refused: the combined drafter passes
    its children the final hidden states."""
    if child.feature_layers:
        raise InputError(f"{child.name} is an EAGLE-3 head reading target layers {list(child.feature_layers)}, but "
                         "the combined drafter is passed final hidden states (an EAGLE-3 head cannot run inside the "
                         "combined drafter)")


class _Rate:
    """Online per-level acceptance rate of one child: successes / trials with a Beta prior."""

    __slots__ = ("successes", "trials")

    def __init__(self) -> None:
        self.successes = 0
        self.trials = 0

    def value(self, prior: float, weight: float) -> float:
        return (self.successes + prior * weight) / (self.trials + weight) if self.trials + weight > 0 else prior


class CombinedDrafter(Drafter):
    """Several drafters as one: see the module docstring."""

    options_config = CombinedConfig  # what **options configure (drafters.registry.option_names)
    python_only_options = frozenset({"config", "verify_cost"})  # not --drafter-option keys (drafters.registry)
    calibrated_scores = True  # each child's on its own tried nodes (Estimates): the tree sizer corrects them no more

    @classmethod
    def check_nested_options(cls, options: Mapping[str, Any], *, command_line: bool = False) -> None:
        """The children as far as they can be told before anything is built (on the command line, before the model
        loads): the list, each child's form and name, and the options of one given as ``{"name": ..., **options}``;
        each refusal names the child by its place in drafters. Option values are checked when the child is built."""
        if "drafters" not in options:
            return
        for k, spec in enumerate(_children(options["drafters"])):
            with _refusals_name_child(k):
                if isinstance(spec, (str, Mapping)):
                    check_options(*_child_options(spec), command_line=command_line, nested=True)
                else:
                    _check_instance(spec)

    def __init__(self, drafters: Sequence[Any] = ("ngram",), config: CombinedConfig | None = None,
                 verify_cost: Callable[[int], float] | None = None, **options: Any) -> None:
        if config is not None and options:
            raise InputError("combined drafter: pass either config= or keyword options, not both")
        if config is not None and not isinstance(config, CombinedConfig):
            raise InputTypeError(f"combined drafter: config must be a CombinedConfig, got {type(config).__name__}")
        self.config = config or CombinedConfig(**options)
        self.children: list[Drafter] = [build_child(spec, k) for k, spec in enumerate(_children(drafters))]
        if len(self.children) == 1 and self.config.max_nodes != MAX_TREE_NODES:  # a lone tree is never merged
            raise InputError(f"combined drafter: max_nodes={self.config.max_nodes} caps a tree merged from two or "
                             f"more children, but drafters holds one ({self.children[0].name}), whose tree is offered "
                             "as it drew it: give that child its own max_nodes")
        if verify_cost is not None and not callable(verify_cost):
            raise InputTypeError("combined drafter: verify_cost must be a callable n -> cost in decode steps")
        self.verify_cost = verify_cost
        self.costs = None  # the measured cost model, when config.cost_model and the engine offers none (at attach)
        # c(1 + n, batch) / c(1) in decode steps (at attach): the engine's TargetView.costs, else costs.relative
        self.curve: Callable[[int, int], float] | None = None
        self._batch = 1  # sequences of the current propose (the cost curve depends on the batch)
        # seconds of a propose call outside its children's (scoring, merging): part of any call's cost
        self._own_time = DraftTime(_CALIBRATION.ema)
        self.name = "combined(" + "+".join(c.name for c in self.children) + ")"
        self.needs_hidden_states = any(c.needs_hidden_states for c in self.children)
        self.catches_up = any(c.catches_up for c in self.children)
        self.rates = [_Rate() for _ in self.children]
        # seq_id -> (whether every child ran, per child (tokens, parents, scores or None, nodes sizing would keep) of
        # its last proposal): online rates, score calibration, gate
        self._last: dict[int, tuple[bool, list[tuple[list[int], list[int], list[float] | None, int]]]] = {}
        self.score_bins = [new_bins() for _ in self.children]  # per child: its scores' calibration (Estimates)
        self.gate = ChildGate(len(self.children))
        self.left_out: frozenset[int] = frozenset()  # children that never pay, out of this run (never_pays_by_shape)
        self._held: dict[tuple[int, int], torch.Tensor] = {}  # (child, seq_id) -> hidden rows it has not seen yet
        self._seen: set[tuple[int, int]] = set()  # (child, seq_id) that proposed once: later calls are no catch-up
        self.chosen: list[int] = [0] * (len(self.children) + 1)  # instrumentation: picks per child, last = merge
        # per child: node parents of its last sampled tree, which values its next one (module doc, Sampled children)
        self._sampled_shape: list[list[int] | None] = [None] * len(self.children)

    # ---- lifecycle: every call to every child ------------------------------------------------
    def load_for_target(self, runner: "LlamaRunner", tokenizer: Any = None, name: str | None = None) -> None:
        """Every child's checkpoint read and checked for the target (Drafter.load_for_target)."""
        for k, child in enumerate(self.children):
            with _refusals_name_child(k):  # two draft-model children: which one's vocabulary does not fit
                child.load_for_target(runner, tokenizer, name)
                _refuse_feature_layers(child)  # a head given by path is known now: before any cost measurement

    def unload_for_target(self) -> None:
        for child in self.children:
            child.unload_for_target()

    def attach(self, target: TargetView) -> None:
        """A new run: the children's rates start from the prior again (as in a fresh instance)."""
        self.target = target
        self.rates = [_Rate() for _ in self.children]
        self.score_bins = [new_bins() for _ in self.children]
        self._sampled_shape = [None] * len(self.children)
        self.left_out = frozenset()
        self._last.clear()
        self._held.clear()
        self._seen.clear()
        costs = getattr(target, "costs", None)
        self.gate.start(costs if self.config.gate else None, memory_key(self, getattr(target, "runner", None)))
        self.curve = costs.verify_cost if costs is not None else None
        self.costs = None
        measured = self.config.cost_model and self.verify_cost is None and self.curve is None
        if measured and getattr(target, "seeded_sampling", False):
            logger.info("%s: seeded standard sampling ranks the children by 1 + alpha * n verify steps, not by this "
                        "machine's measured costs, so that a seed gives one text", self.name)
        elif measured:
            from specdec.cost_model import CalibrationConfig, load_cost_model

            # verify steps priced as the engine runs them: replayed CUDA graphs, or eager
            self.costs = load_cost_model(target.runner, CalibrationConfig(graphs=getattr(target, "graphs", False)))
            self.curve = self.costs.relative
        for k, child in enumerate(self.children):
            with _refusals_name_child(k):  # a refusal of the child's options against the target (top_k, choices)
                child.attach(target)
                _refuse_feature_layers(child)  # a drafter attached without load_for_target: before any forward

    def detach(self) -> None:
        """The call's end: its view, the measured curve and the gate's costs (both hold the target's runner) and the
        held hidden rows are dropped, and every child is detached (one that raises after the others have been)."""
        super().detach()
        self.costs = self.curve = None
        self.gate.end_call()
        self._held.clear()
        errors = []
        for child in self.children:
            try:
                child.detach()
            except Exception as err:  # noqa: BLE001 - the other children still let go of the call
                errors.append(err)
        if errors:
            raise errors[0]

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        full, trees = self._last.pop(seq_id, (False, []))
        matched = []
        for k, (tokens, parents, scores, _) in enumerate(trees):
            trials, successes = matched_levels(tokens, parents, committed)
            self.rates[k].trials += trials
            self.rates[k].successes += successes
            matched.append(successes)
            if scores is not None:
                for i, accepted in tried_nodes(tokens, parents, committed):
                    learn(self.score_bins[k], scores[i], accepted, _CALIBRATION.decay)
        if full and trees:
            self.gate.observe(tuple(matched), tuple(kept for *_, kept in trees))
        for child in self.children:
            child.on_accept(seq_id, committed)

    def release(self, seq_id: int) -> None:
        self._last.pop(seq_id, None)
        for k in range(len(self.children)):
            self._held.pop((k, seq_id), None)
            self._seen.discard((k, seq_id))
        self.gate.finish()
        for child in self.children:
            child.release(seq_id)

    def never_pays_by_shape(self) -> str | None:
        """Why no child can pay (None if one may). Asked under speculation="auto" only: where the gate cannot price
        the children (no costs: a seeded call), a child that can never pay by its shapes is left out of the run, as
        the gate leaves it out by its measured time elsewhere; decided from shapes, so a seed still gives one text."""
        why = [child.never_pays_by_shape() for child in self.children]
        if all(w is not None for w in why):
            return "; ".join(f"{child.name}: {w}" for child, w in zip(self.children, why, strict=True))
        if not self.gate.active:
            self.left_out = frozenset(k for k, w in enumerate(why) if w is not None)
            for k in sorted(self.left_out):
                logger.info("%s: child %s left out of this call (%s)", self.name, self.children[k].name, why[k])
        return None

    def cost_key(self) -> str:
        return "|".join([super().cost_key(), *(child.cost_key() for child in self.children)])

    def draw_source(self, seed: int | None) -> Hashable | None:
        sources = tuple(child.draw_source(seed) for child in self.children)
        return None if all(s is None for s in sources) else sources

    # ---- proposals ---------------------------------------------------------------------------
    def child_rate(self, k: int) -> float:
        """Child k's estimated acceptance rate per tree level (online, with the prior)."""
        return self.rates[k].value(self.config.prior_score, self.config.prior_weight)

    def cheapest_call_seconds(self) -> float | None:
        """A call outside the gate's probes: the children the gate runs now, each at its cheapest recent call, and
        the drafter's own work around them. None while the gate is off, or a child it runs has no step call timed
        (Drafter.cheapest_call_seconds). A costly child's first step call, timed with the cheap ones, priced the whole
        drafter's probes for the guard, which then held it back, the cheap children with it, for hundreds of steps."""
        best = self.gate.next_best(self._batch, self.tree_cost, self.config.max_nodes)
        lows = [self.gate.times[k].low for k in best or ()]
        if not lows or None in lows or self._own_time.low is None:
            return None
        return sum(lows) + self._own_time.low

    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        self._batch = max(len(seqs), 1)
        if self.costs is not None:  # cost_model=True: this call's batch sizes measured at its first step, untimed
            self.costs.measure_up_to(self._batch)
        call_start, children_seconds = time.perf_counter(), 0.0
        run = self.gate.choose(self._batch, self.tree_cost, self.config.max_nodes)
        if self.left_out:
            run = tuple(r and k not in self.left_out for k, r in enumerate(run))
        per_child, lists = [], []
        for k, child in enumerate(self.children):
            if not run[k]:
                self._hold_hidden(k, seqs)
                per_child.append([DraftTree.empty() for _ in seqs])
                lists.append([([], [], None)] * len(seqs))
                continue
            catch_up = child.catches_up and any((k, v.seq_id) not in self._seen for v in seqs)
            captured, t0 = captures(), time.perf_counter()
            trees = proposed_trees(child.name, len(seqs), partial(child.propose, self._views_for(k, seqs)))
            # syncs: timed with the drafts; the scores of a deterministic tree calibrate the child's (Estimates)
            lists.append([(t.tokens.tolist(), t.parents.tolist(), t.scores.tolist()
                           if t.scores is not None and t.mode is DraftMode.DETERMINISTIC else None) for t in trees])
            # a call that captured a CUDA graph is a one-off too (DraftTime)
            seconds = time.perf_counter() - t0
            children_seconds += seconds
            self.gate.record_seconds(k, seconds, catch_up or captures() > captured)
            self._seen.update((k, v.seq_id) for v in seqs)
            per_child.append(trees)
        out = []
        # the gate prices each child's tree by the nodes sizing would verify of it, not by all it proposed
        largest = max((t.num_nodes for trees in per_child for t in trees), default=0)
        costs = [self.tree_cost(n, self._batch) for n in range(largest + 1)] if self.gate.active else None
        for s, view in enumerate(seqs):
            scored = [self._with_scores(k, per_child[k][s], lists[k][s][2]) for k in range(len(self.children))]
            kept = [t.num_nodes if costs is None else self._paying_nodes(t, costs) for t in scored]
            self._last[view.seq_id] = (all(run), [(*lists[k][s], kept[k]) for k in range(len(self.children))])
            out.append(self._choose(scored))
        for k, trees in enumerate(per_child):  # after every choice of this call: they value the next call's trees
            last = next((t for t in reversed(trees) if t.num_nodes and t.mode is not DraftMode.DETERMINISTIC), None)
            if last is not None:
                self._sampled_shape[k] = last.parents.tolist()
        self._own_time.record(time.perf_counter() - call_start - children_seconds)
        return out

    def _hold_hidden(self, k: int, seqs: Sequence[SequenceView]) -> None:
        """Child k is left out this call: keep the hidden rows it would have seen for its next call (none for a child
        left out of the run)."""
        if not self.children[k].needs_hidden_states or k in self.left_out:
            return
        for v in seqs:
            if v.new_hidden is not None:
                held = self._held.get((k, v.seq_id))
                self._held[(k, v.seq_id)] = v.new_hidden if held is None else torch.cat([held, v.new_hidden])

    def _views_for(self, k: int, seqs: Sequence[SequenceView]) -> Sequence[SequenceView]:
        """``seqs`` as child k must see them: with the hidden rows of the calls it was left out of first."""
        if not self.children[k].needs_hidden_states or not self._held:
            return seqs
        out = []
        for v in seqs:
            held = self._held.pop((k, v.seq_id), None)
            if held is not None:
                rows = held if v.new_hidden is None else torch.cat([held, v.new_hidden])
                v = dataclasses.replace(v, new_hidden=rows)
            out.append(v)
        return out

    def _combine(self, trees: list[DraftTree]) -> DraftTree:
        """The tree offered for the children's ``trees`` (one per child, empty where it did not run)."""
        return self._choose([self._with_scores(k, t) for k, t in enumerate(trees)])

    def _choose(self, trees: list[DraftTree]) -> DraftTree:
        """:meth:`_combine` of trees already scored (:meth:`_with_scores`)."""
        scored = [(k, t) for k, t in enumerate(trees) if t.num_nodes]
        if not scored:
            return trees[0]
        if len(scored) == 1:
            self.chosen[scored[0][0]] += 1
            return scored[0][1]
        candidates = scored
        if self.config.mode == "merge":
            exact = [t for _, t in scored if t.mode is DraftMode.DETERMINISTIC]
            sampled = [(k, t) for k, t in scored if t.mode is not DraftMode.DETERMINISTIC]
            merged = merge_trees(exact, max_nodes=self.config.max_nodes) if exact else None
            if not sampled:
                self.chosen[-1] += 1
                return merged
            candidates = sampled + ([(len(self.children), merged)] if merged is not None else [])
        k, best = max(candidates, key=lambda kt: self.candidate_value(*kt))
        self.chosen[k if k < len(self.children) else -1] += 1
        return best

    def candidate_value(self, k: int, tree: DraftTree) -> float:
        """What ranks a candidate: a deterministic tree by its own nodes and scores; child k's sampled tree by what
        was fixed before it was drawn, the child's rate on the shape of its previous sampled tree (a one-node
        chain before it had one), never by its drawn tokens, their scores or its shape (module doc)."""
        if tree.mode is DraftMode.DETERMINISTIC:
            return self.value(tree)
        parents = self._sampled_shape[k]  # a sampled candidate is always a child's own tree, never the merge
        shape = DraftTree(torch.zeros(len(parents or [0]), dtype=torch.long), parents or [-1])
        return self.value(self._with_scores(k, shape))

    def _with_scores(self, k: int, tree: DraftTree, own: list[float] | None = None) -> DraftTree:
        """``tree`` with scores: its own (a deterministic tree's corrected by child k's calibration; ``own``: them
        already read to the host), else child k's level rate shared equally among siblings."""
        if not tree.num_nodes or tree.scores is not None and tree.mode is not DraftMode.DETERMINISTIC:
            return tree
        if tree.scores is not None:
            own = tree.scores.tolist() if own is None else own
            scores = corrected(own, self.score_bins[k], _CALIBRATION.prior_weight)
            return dataclasses.replace(tree, scores=torch.tensor(scores, dtype=torch.float32,
                                                                 device=tree.scores.device))
        rate = self.child_rate(k)
        siblings = [len(group) for group in tree.children]  # index 0: root's children
        parents = tree.parents.tolist()
        scores = torch.tensor([rate / siblings[p + 1] for p in parents], dtype=torch.float32,
                              device=tree.tokens.device)
        return DraftTree(tree.tokens, tree.parents, tree.draft_probs, tree.mode, scores)

    def _paying_nodes(self, tree: DraftTree, costs: list[float]) -> int:
        """Nodes of a scored tree that the engine's sizing would verify were it offered alone: the best-paying prefix
        of its nodes by path score, draft time aside (a sampled tree: all of them, it is cut by shape only);
        ``costs[n]``: :meth:`tree_cost` of n nodes."""
        if tree.mode is not DraftMode.DETERMINISTIC or not tree.num_nodes:
            return tree.num_nodes
        return best_prefix(sorted(path_scores(tree), reverse=True), 0.0, costs, _CALIBRATION.margin)

    def tree_cost(self, n: int, batch: int) -> float:
        """Estimated verify cost of an n-node tree (+ the root) in plain decode steps (module doc, Estimates)."""
        if self.verify_cost is not None:
            return float(self.verify_cost(n))
        if self.curve is not None:
            return float(self.curve(1 + n, batch))
        return 1.0 + self.config.alpha * n

    def value(self, tree: DraftTree) -> float:
        """Expected committed tokens per unit of estimated verify cost (tree already scored)."""
        return expected_committed_tokens(tree) / max(self.tree_cost(tree.num_nodes, self._batch), 1e-9)
