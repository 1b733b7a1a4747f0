"""Offline replay of a drafter over a recorded run (``specdec eval replay run``): tau and speed without the target.

    record = load_record("run.json")                       # specdec.eval.replay_record
    result = replay(record, ReplayConfig("ngram", {"max_nodes": 16}))
    result["tau"], result["predicted_speedup"]

Greedy (the record must be greedy): the recorded committed sequence is walked as the engine would: each step the
drafter proposes a tree for the committed prefix (the engine's budget cut applied), the tree is cut to
``max_nodes``, the path of nodes equal to the recorded tokens is accepted, and the step commits accepted + 1
tokens. For a deterministic drafter this reproduces the real run's steps exactly.

Sampled (``temperature > 0``): the record's top-k log-probabilities give the target's tempered distribution at
every recorded position, and each step's expected outcome is computed instead of sampled (a deterministic
candidate is accepted with probability ``target_probs[x]``). Approximations, listed in the result's ``notes``:
the text is the recorded one (a step accepting a token off the recorded path stops there); tokens outside the
recorded top-k have probability 0; the tail's tempered mass is bounded, exact at T = 1. Drafters that sample are
replayed as if deterministic.

Guard (``guard=True``, the engine's default): the engine's own :class:`specdec.tree_sizing.TreeSizer` runs in
the replay with the record's verify-cost curve and the draft times measured here, so a replay matches a real
``auto`` run closely, not token for token; ``guard=False`` matches a deterministic drafter's real run exactly.

Costs: each step is priced ``c_draft + c_verify(1 + nodes)``; the predicted speedup over plain decoding is
``(tokens / total cost) / (1 / c_verify(1))``, and ``predicted_speedup_overall`` counts the prefill too
(:func:`overall_speedup`). ``queued_step`` (greedy, guard on): held-off steps queued as a GPU engine queues them
(:mod:`specdec.decode_ahead`; each after a stretch's first costs ``queued_step``, the baseline's every step),
drafts priced against it, a drafter that looks back asked in hindsight. ``verify_seconds``: another machine's c(n).
Drafters that read the target's hidden states, model or cache cannot be replayed from tokens: they are refused
with a one-line InputError.
"""
from __future__ import annotations

import importlib
import logging
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from specdec.drafters.base import SequenceView, TargetView, TokenView
from specdec.drafters.model_drafter import ModelDrafter
from specdec.drafters.registry import BUILTIN, get_drafter
from specdec.eval.replay_record import verify_cost_at

from specdec.errors import InputError
from specdec.sampling import SamplingConfig
from specdec.tree import MAX_TREE_NODES, DraftTree

logger = logging.getLogger(__name__)

TOKEN_ONLY_HINT = "replay supports drafters whose propose reads only token ids (e.g. ngram)"
READS_TARGET = ("reads the target's model or cache (its dtype, weights or K/V), which a replay does not load; "
                f"{TOKEN_ONLY_HINT}")


@dataclass(frozen=True)
class ReplayConfig:
    drafter: Any = "ngram"  # a name, or a Drafter instance (tests)
    drafter_options: dict = field(default_factory=dict)
    max_nodes: int | None = None  # cut every tree to its first max_nodes nodes (None: as proposed)
    temperature: float = 0.0  # 0 = greedy
    guard: bool = True  # the engine's tree sizing and break-even guard (speculation="auto"); False: "always"
    # seconds of a plain step queued behind an unread one (a GPU through CUDA graphs); None: every step read back
    queued_step: float | None = None
    verify_seconds: dict[int, float] | None = None  # c(n) in seconds replacing the record's (None: the record's)
    look_budget: float | None = None  # the guard's SizingConfig.look_budget (None: its default; 0: no looks)

    def __post_init__(self) -> None:
        if self.queued_step is not None:
            if not (math.isfinite(self.queued_step) and self.queued_step > 0):
                raise InputError(f"queued_step must be a positive number of seconds, got {self.queued_step}")
            if not self.guard or self.temperature != 0:
                raise InputError("queued steps are replayed greedily with the guard on: the steps it holds off are "
                                 "the ones queued")
        if self.look_budget is not None and not (math.isfinite(self.look_budget) and self.look_budget >= 0):
            raise InputError(f"look_budget must be a number >= 0, got {self.look_budget}")
        if self.look_budget is not None and self.queued_step is None:
            raise InputError("look_budget is spent on queued steps only: give it with queued_step (greedy, guard on)")
        if self.verify_seconds is not None and (1 not in self.verify_seconds or any(
                not (math.isfinite(c) and c > 0) for c in self.verify_seconds.values())):
            raise InputError("verify_seconds needs c(1) and positive, finite seconds for every n it gives")
        if self.max_nodes is not None and not 0 <= self.max_nodes <= MAX_TREE_NODES:
            raise InputError(f"max_nodes must be in 0..{MAX_TREE_NODES}, got {self.max_nodes}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature}")


class ReplayDrafter:
    """The drafter under replay, fed committed prefixes; times its proposals."""

    def __init__(self, config: ReplayConfig, record: dict) -> None:
        if isinstance(config.drafter, str) and config.drafter in BUILTIN:  # refused before it loads anything
            module, _, attr = BUILTIN[config.drafter].partition(":")
            kind = getattr(importlib.import_module(module), attr)
            if getattr(kind, "needs_hidden_states", False):
                raise InputError(f"replay: drafter {config.drafter!r} reads the target's hidden states, which a "
                                 f"record does not hold; {TOKEN_ONLY_HINT}")
            if issubclass(kind, ModelDrafter):  # draft-model asked for model= first, only to be refused after
                raise InputError(f"replay: drafter {config.drafter!r} {READS_TARGET}")
        drafter = get_drafter(config.drafter, **config.drafter_options)
        self.name = getattr(drafter, "name", str(config.drafter))
        if drafter.needs_hidden_states:
            raise InputError(f"replay: drafter {self.name!r} reads the target's hidden states, which a record "
                             f"does not hold; {TOKEN_ONLY_HINT}")
        self.vocab_size = int(record["vocab_size"])
        sampling = SamplingConfig(config.temperature > 0, config.temperature or 1.0)
        runner = SimpleNamespace(shape=SimpleNamespace(vocab_size=self.vocab_size), device=torch.device("cpu"))
        self.drafter, self.seconds, self.calls = drafter, 0.0, 0
        self._guard(lambda: drafter.attach(TargetView(runner, None, sampling)))

    def _guard(self, fn):
        try:
            return fn()
        except (AttributeError, TypeError) as err:  # what it read is the stand-in's: not the user's to decode
            logger.debug("replay: drafter %r failed on the target stand-in: %s", self.name, err)
            raise InputError(f"replay: drafter {self.name!r} {READS_TARGET}") from None

    def propose(self, seq_id: int, tokens: list[int], num_prompt_tokens: int) -> tuple[DraftTree, float]:
        """The drafter's tree for this prefix and the seconds its propose took."""
        view = SequenceView(seq_id, TokenView(tokens), num_prompt_tokens)
        t0 = time.perf_counter()
        tree = self._guard(lambda: self.drafter.propose([view]))[0]
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.calls += 1
        tree.validate(self.vocab_size, drafter=self.name)
        return tree, seconds


class _Step:
    """One step's tree as the engine would verify it: the guard may skip the drafter; the proposal is cut to the
    token budget and ``max_nodes``, then sized (specdec.tree_sizing, one sizer per sequence as in one generate()
    call per prompt, its costs the record's curve and the draft times measured here)."""

    def __init__(self, drafter: ReplayDrafter, config: ReplayConfig, costs: dict[int, float]) -> None:
        self.drafter, self.config, self.costs = drafter, config, costs
        self.sizer = None
        if config.guard:
            from specdec.cost_model import CostModel
            from specdec.tree_sizing import SizingConfig, TreeSizer

            curve = {n: verify_cost_at(costs, n) for n in range(1, MAX_TREE_NODES + 2)}
            sizing = SizingConfig() if config.look_budget is None else SizingConfig(look_budget=config.look_budget)
            self.sizer = TreeSizer(CostModel({"record": True}, {1: curve}), sizing,
                                   calibrated_scores=drafter.drafter.calibrated_scores)
            if config.queued_step is not None:  # as an engine that queues held-off steps, one already timed
                self.sizer.queues_held_off = True
                self.sizer.record_step(config.queued_step, 1, 1, queued=True)
        self.draft_call: float | None = None
        self.proposed: set[int] = set()  # sequences proposed for once (their first call is a catch-up)
        self.queued = False  # this step is queued behind the last (held off, as the one before it)
        self.queue_next = False  # the next step is queued: the guard foresaw holding it off
        self.looks = 0  # propose calls in hindsight (queued steps: the host's time, overlapped with the device's)

    def tree(self, seq_id: int, tokens: list[int], num_prompt_tokens: int, max_depth: int) -> DraftTree:
        self.draft_call = None
        self.queued = self.queue_next
        asked = self.sizer is None or self.sizer.wants_draft(seq_id)
        if self.queued or not asked:  # a queued step decodes plainly, whatever the guard said in it
            # the next one queued where the guard foresees holding it off (specdec.decode_ahead)
            self.queue_next = self.config.queued_step is not None and self.sizer.skips_next([seq_id])
            return DraftTree.empty()
        self.queue_next = False
        tree, self.draft_call = self.drafter.propose(seq_id, tokens, num_prompt_tokens)
        if self.sizer is not None:  # as the engine: a sequence's first call is a catch-up, not a step's cost
            self.sizer.record_draft(self.draft_call, catch_up=seq_id not in self.proposed)
        self.proposed.add(seq_id)
        tree = _cut(tree, max_depth, self.config.max_nodes)
        return tree if self.sizer is None else self.sizer.size(seq_id, tree, 1)

    def seconds(self, nodes: int) -> float:
        """What this step costs on the curve: a queued plain step, or a verify of ``1 + nodes`` tokens read back."""
        return self.config.queued_step if self.queued else verify_cost_at(self.costs, 1 + nodes)

    def after(self, seq_id: int, committed: list[int], nodes: int, tokens: list[int] | None = None,
              num_prompt_tokens: int = 0, max_depth: int = 0) -> None:
        """The step's commit, learned; where the next step is queued, the drafter asked in hindsight for the text
        so far (``tokens``, with the budget's ``max_depth``) if the guard looks back."""
        if self.sizer is None:
            return
        self.sizer.observe(seq_id, committed, [])
        self.sizer.record_step(self.seconds(nodes), 1 + nodes, 1, queued=self.queued)
        may_look = self.queue_next and tokens is not None and self.drafter.drafter.looks_back and max_depth > 0
        if may_look and self.sizer.who_looks_back([seq_id]):
            tree, seconds = self.drafter.propose(seq_id, tokens, num_prompt_tokens)
            self.sizer.looked_back([seq_id], [_cut(tree, max_depth, self.config.max_nodes)], seconds, 1)
            self.looks += 1


def _cut(tree: DraftTree, max_depth: int, max_nodes: int | None) -> DraftTree:
    """The engine's budget cut (no node deeper than ``max_depth``), then the first ``max_nodes`` nodes (parents come
    first, so any prefix of the nodes is a tree)."""
    if tree.num_nodes and tree.max_depth > max_depth:
        tree = tree.prune(tree.depths <= max(max_depth, 0))
    if max_nodes is not None and tree.num_nodes > max_nodes:
        tree = tree.prune(torch.arange(tree.num_nodes) < max_nodes)
    return tree


def _greedy_accepted(tree: DraftTree, upcoming: list[int]) -> int:
    """Nodes accepted by greedy verification when the target's argmaxes are ``upcoming``."""
    children, node, accepted = tree.children, -1, 0
    tokens = tree.tokens.tolist()
    while accepted < len(upcoming):
        match = next((c for c in children[node + 1] if tokens[c] == upcoming[accepted]), None)
        if match is None:
            break
        node, accepted = match, accepted + 1
    return accepted


def tempered_probs(ids: list[int], logprobs: list[float], temperature: float) -> dict[int, float]:
    """The target's probabilities at ``temperature`` of the recorded top-k tokens (module docstring, note 3)."""
    p = [math.exp(x) for x in logprobs]
    tail = max(0.0, 1.0 - sum(p))
    inv = 1.0 / temperature
    powered = [x ** inv for x in p]
    tail_t = tail * (min(p) ** (inv - 1.0)) if tail and min(p) > 0 else 0.0
    z = sum(powered) + tail_t
    return {i: x / z for i, x in zip(ids, powered, strict=True)}


def _accepted_distribution(tree: DraftTree, seq: dict, j: int, temperature: float) -> list[float]:
    """P(accepted = a) for a = 0..max_depth at recorded position j (module docstring)."""
    new, children, tokens = seq["new_tokens"], tree.children, tree.tokens.tolist()
    dist = [0.0] * (tree.max_depth + 1 if tree.num_nodes else 1)

    def walk(node: int, depth: int, mass: float) -> None:  # node on the recorded path at this depth
        pos = j + depth
        if pos >= len(new) or not children[node + 1]:
            dist[depth] += mass
            return
        probs = tempered_probs(seq["topk_ids"][pos], seq["topk_logprobs"][pos], temperature)
        left = mass
        for c in children[node + 1]:
            pc = mass * probs.get(tokens[c], 0.0)
            left -= pc
            if tokens[c] == new[pos]:
                walk(c, depth + 1, pc)
            else:
                dist[depth + 1] += pc  # off the recorded path: counted, not followed
        dist[depth] += max(left, 0.0)

    walk(-1, 0, 1.0)
    return dist


def replay_sequence(drafter: ReplayDrafter, seq_id: int, seq: dict, record: dict, config: ReplayConfig,
                    costs: dict[int, float], oracle: bool = False) -> dict:
    """One recorded sequence replayed: its tokens, steps, verify seconds (record curve), draft calls, nodes.

    ``oracle`` (greedy, with ``config.guard`` off; :mod:`specdec.eval.replay_bounds`): each step verifies only the
    path that will be accepted (perfect foresight), so it is priced ``c_verify(1 + accepted)``, not by its tree."""
    if oracle and (config.guard or config.temperature != 0):
        raise ValueError("the oracle walk is greedy and unguarded (whole trees, priced by their accepted path)")
    prompt, new = list(seq["prompt_ids"]), list(seq["new_tokens"])
    budget = int(record["max_new_tokens"])
    m = len(new)
    step = _Step(drafter, config, costs)
    if config.temperature == 0:  # walk the recorded greedy sequence step by step
        j, steps, verify, nodes, histogram, calls = 0, 0, 0.0, 0, [], drafter.calls
        while j < m:
            tree = step.tree(seq_id, prompt + new[:j], len(prompt), budget - j - 1)
            accepted = _greedy_accepted(tree, new[j:])
            count = min(accepted + 1, m - j)
            step.after(seq_id, new[j : j + count], tree.num_nodes, prompt + new[: j + count], len(prompt),
                       budget - j - count - 1)
            histogram += [0] * (accepted + 1 - len(histogram))
            histogram[accepted] += 1
            priced = count - 1 if oracle else tree.num_nodes  # the oracle's last token comes as the bonus
            seconds = verify_cost_at(costs, 1 + priced) if oracle else step.seconds(tree.num_nodes)
            steps, nodes, verify = steps + 1, nodes + tree.num_nodes, verify + seconds
            j += count
            if j < m:
                drafter.drafter.on_accept(seq_id, new[j - count : j])
        drafter.drafter.release(seq_id)
        return {"new_tokens": m, "steps": steps, "verify_seconds": verify,
                "draft_calls": drafter.calls - calls - step.looks, "looks": step.looks, "nodes": nodes,
                "accepted_histogram": histogram}
    # sampled: expected steps and verify cost to finish from every position, back to front
    trees, dists, asked = [], [], []
    for j in range(m):
        tree = step.tree(seq_id, prompt + new[:j], len(prompt), budget - j - 1)
        trees.append(tree.num_nodes)
        asked.append(step.draft_call is not None)
        dists.append(_accepted_distribution(tree, seq, j, config.temperature))
        step.after(seq_id, new[j:], tree.num_nodes)  # the sizer learns from the recorded continuation
        drafter.drafter.on_accept(seq_id, new[j : j + 1])
    drafter.drafter.release(seq_id)
    steps, verify, nodes, calls = [0.0] * (m + 1), [0.0] * (m + 1), [0.0] * (m + 1), [0.0] * (m + 1)
    for j in range(m - 1, -1, -1):
        nxt = [(p, min(j + a + 1, m)) for a, p in enumerate(dists[j]) if p > 0]
        steps[j] = 1 + sum(p * steps[k] for p, k in nxt)
        verify[j] = verify_cost_at(costs, 1 + trees[j]) + sum(p * verify[k] for p, k in nxt)
        nodes[j] = trees[j] + sum(p * nodes[k] for p, k in nxt)
        calls[j] = asked[j] + sum(p * calls[k] for p, k in nxt)
    return {"new_tokens": m, "steps": steps[0], "verify_seconds": verify[0], "draft_calls": calls[0], "nodes": nodes[0],
            "accepted_histogram": None}


def recorded_prefill(record: dict) -> float | None:
    """Seconds the record's plain run spent on its prompts' prefills; None for a record written before they were
    kept."""
    prefill = [s.get("prefill_seconds") for s in record["sequences"]]
    return None if any(p is None for p in prefill) else sum(prefill)


def plain_step_seconds(record: dict) -> float:
    """Seconds of one plain decode step as the record's run measured it (the curve's c(1) for older records)."""
    costs = record["costs"]
    return costs.get("decode_step_seconds") or verify_cost_at(costs["verify_seconds"], 1)


def overall_speedup(record: dict, tokens: int, seconds: float) -> float | None:
    """Speedup over plain decoding with the prompts' prefill counted: ``seconds`` of verification (and drafting) on
    the record's curve, rescaled, as plain decoding's steps, to the decode step the record measured; None for a
    record without prefill times."""
    prefill = recorded_prefill(record)
    if seconds <= 0 or prefill is None:
        return None
    step = plain_step_seconds(record)
    scale = step / verify_cost_at(record["costs"]["verify_seconds"], 1)
    return (prefill + tokens * step) / (prefill + seconds * scale)


def replay(record: dict, config: ReplayConfig, drafter: ReplayDrafter | None = None) -> dict:
    """Predicted tau and speed of ``config``'s drafter over ``record`` (module docstring); a JSON-able dict.
    ``drafter``: one that has proposed elsewhere already (the oracle's walk, :mod:`specdec.eval.replay_bounds`): a
    draft is then priced at the mean of all its calls, those included."""
    if config.temperature == 0 and record.get("temperature", 0) != 0:
        raise InputError(f"replay at temperature 0 needs a greedy record; this one was sampled at "
                         f"{record['temperature']} (replay it with --temperature > 0)")
    costs = config.verify_seconds or record["costs"]["verify_seconds"]
    drafter = drafter or ReplayDrafter(config, record)
    per_sequence = [replay_sequence(drafter, i, s, record, config, costs) for i, s in enumerate(record["sequences"])]
    tokens = sum(r["new_tokens"] for r in per_sequence)
    steps = sum(r["steps"] for r in per_sequence)
    # plain decoding's step: every one queued where the engine queues them (the first of each call's read first)
    c_plain = verify_cost_at(costs, 1) if config.queued_step is None else config.queued_step
    c_draft = drafter.seconds / drafter.calls if drafter.calls else 0.0  # per propose call
    calls = sum(r["draft_calls"] for r in per_sequence)  # greedy: calls made; sampled: expected share of steps
    seconds = sum(r["verify_seconds"] for r in per_sequence) + c_draft * calls
    histogram: list[int] = []
    for r in per_sequence:
        for a, x in enumerate(r["accepted_histogram"] or []):
            histogram += [0] * (a + 1 - len(histogram))
            histogram[a] += x
    looks = sum(r.get("looks", 0) for r in per_sequence)
    notes = [] if config.temperature == 0 else [
        "expected values along the recorded text: acceptances off it count their depth and stop",
        "tokens outside the recorded top-k have target probability 0",
        "tempered tail mass approximated from the k-th probability (exact at temperature 1)"] + (
        ["guard and tree sizing run once per recorded position, learning from the recorded text"]
        if config.guard else [])
    if config.queued_step is not None:
        notes.append(f"held-off steps queued at {config.queued_step * 1e3:.3f} ms; {looks} proposals in hindsight, "
                     "their host time not counted (it overlaps the device's queued step)")
    return {"drafter": drafter.name, "drafter_options": dict(config.drafter_options), "max_nodes": config.max_nodes,
            "temperature": config.temperature, "guard": config.guard, "draft_calls": calls,
            "queued_step_s": config.queued_step, "looks": looks,
            "sequences": len(per_sequence), "new_tokens": tokens,
            "steps": steps, "tau": tokens / steps if steps else 0.0,
            "mean_tree_nodes": sum(r["nodes"] for r in per_sequence) / steps if steps else 0.0,
            "cost_plain_s": c_plain, "cost_draft_s": c_draft, "seconds": seconds,
            "predicted_speedup": (tokens / seconds) * c_plain if seconds else None,
            # the record's prefill is its own machine's: none beside another machine's costs
            "predicted_speedup_overall": (overall_speedup(record, tokens, seconds) if config.verify_seconds is None
                                          and config.queued_step is None else None),
            "accepted_histogram": histogram or None, "notes": notes,
            "per_sequence_tau": [r["new_tokens"] / r["steps"] if r["steps"] else 0.0 for r in per_sequence]}
