"""The oracle drafter: a measuring instrument for speed at a chosen acceptance, never a user-facing drafter.

It knows the target's own greedy continuation of each prompt (from a plain run on the same prompt) and proposes a
chain, or a tree of ``width`` children per depth, whose acceptance per depth follows an :class:`AcceptanceProfile`:
at depth d one child carries the reference token with probability ``rates[d-1]``, every other node a token that is
not it. So speedup at any tau can be measured end to end on any target, random weights included.

Invariants: proposals are deterministic candidates (``draft_probs`` None), so greedy output is the target's whatever
the oracle proposes; its own draws come from its own seeded generator (never the target's randomness); the tree's
shape is fixed before its tokens are drawn. Hits are stratified per sequence and depth (a credit that grows by the
rate on each try and pays one hit per whole unit, from a seeded start), so a sequence's hits at a depth are its
tries times the rate to within one: a single short sequence reaches the profile's tau. ``inner=`` runs a real
drafter's ``propose`` each step and discards its tokens, so a step also pays that drafter's true cost (an EAGLE
head's forward, a draft model's). Where the inner drafter offers pending trees (EAGLE's), so does the oracle: its
own trees' fields go to the device, and the inner's candidates are read when the engine reads the step's trees,
after the verify's launch, as EAGLE's own would be.
Measure with ``speculation="always"``: the guard and tree sizing would otherwise cut the trees the profile
describes. Where the target's output leaves the reference (bf16 near-ties), the oracle stops knowing the answer; the
measured tau says so.

    oracle = OracleDrafter(reference_continuations(loaded, prompts, 128), AcceptanceProfile.constant(0.8, 6))
    out = generate(loaded, prompts, drafter=oracle, max_new_tokens=128, speculation="always")
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from specdec.drafters.base import Drafter, SequenceView, TargetView

from specdec.errors import InputError
from specdec.host_copy import to_device
from specdec.pending_trees import PendingTrees
from specdec.tree import MAX_TREE_NODES, DraftTree


@dataclass(frozen=True)
class AcceptanceProfile:
    rates: tuple[float, ...]  # per depth 1..k: P(the reference child is proposed at depth d | its parent was)
    width: int = 1  # children per depth (1: a chain); the tree has len(rates) * width nodes

    def __post_init__(self) -> None:
        rates = tuple(float(r) for r in self.rates)
        object.__setattr__(self, "rates", rates)
        if not rates or any(not 0.0 <= r <= 1.0 for r in rates):
            raise InputError(f"acceptance rates must be a non-empty list in [0, 1], got {list(rates)}")
        if not isinstance(self.width, int) or self.width < 1 or len(rates) * self.width > MAX_TREE_NODES:
            raise InputError(f"width must be >= 1 with depth x width <= {MAX_TREE_NODES}, got {len(rates)} x "
                             f"{self.width}")

    @classmethod
    def constant(cls, rate: float, depth: int, width: int = 1) -> "AcceptanceProfile":
        return cls((rate,) * depth, width)

    @classmethod
    def for_tau(cls, tau: float, depth: int, width: int = 1) -> "AcceptanceProfile":
        """The constant rate whose chain of ``depth`` reaches mean accepted length ``tau`` (bisection)."""
        if not 1.0 <= tau <= depth + 1:
            raise InputError(f"tau must be in [1, {depth + 1}] for depth {depth}, got {tau}")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cls.constant(mid, depth).expected_tau < tau else (lo, mid)
        return cls.constant((lo + hi) / 2, depth, width)

    @classmethod
    def from_acceptance_report(cls, path: str | Path, drafter: str, category: str, width: int = 1
                               ) -> "AcceptanceProfile":
        """The per-depth rates ``specdec eval acceptance`` measured for ``drafter`` on ``category`` (report.json)."""
        rows = json.loads(Path(path).read_text())["rows"]
        for row in rows:
            if row.get("drafter") == drafter and row.get("category") == category and row.get("acceptance_per_depth"):
                return cls(tuple(row["acceptance_per_depth"]), width)
        raise InputError(f"{path}: no per-depth acceptance for drafter {drafter!r} on category {category!r}")

    @property
    def expected_tau(self) -> float:
        """Committed tokens per step: 1 + sum over d of prod(rates[:d]) ((1 - a^(k+1)) / (1 - a) when constant)."""
        tau, alive = 1.0, 1.0
        for r in self.rates:
            alive *= r
            tau += alive
        return tau


def reference_continuations(loaded, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                            **generate_kwargs) -> dict[tuple[int, ...], list[int]]:
    """The target's greedy continuation of each prompt, from a plain run of specdec on it, keyed by the prompt's
    token ids as ints (``prompts`` may be lists or a ``[B, L]`` tensor, whose 0-d elements would hash by identity)."""
    from specdec.generate import generate

    rows = [tuple(int(t) for t in p) for p in prompts]
    out = generate(loaded, [list(p) for p in rows], max_new_tokens=max_new_tokens, return_dict=True,
                   **generate_kwargs)
    return {p: list(new) for p, new in zip(rows, out.new_tokens, strict=True)}


class OracleDrafter(Drafter):
    name = "oracle"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], profile: AcceptanceProfile,
                 inner: Drafter | None = None, seed: int = 0) -> None:
        self.continuations, self.profile, self.inner, self.seed = continuations, profile, inner, seed
        self.needs_hidden_states = bool(inner is not None and inner.needs_hidden_states)
        self.feature_layers = () if inner is None else inner.feature_layers  # an EAGLE-3 head's true cost too
        self.proposed_hits = [0] * len(profile.rates)  # per depth: steps whose tree held the reference token
        self.proposed_tries = [0] * len(profile.rates)  # per depth: steps whose parent on the path held it
        # seq_id -> (its prompt's continuation, per depth the stratified draws' credit in [0, 1)), from its first tree
        self._seqs: dict[int, tuple[list[int], list[float]]] = {}
        self.pending_trees = bool(inner is not None and inner.pending_trees)  # as the inner drafter (module doc)
        # every tree's shape: at each depth ``width`` children of the previous depth's first child (one tensor, shared)
        self.parents = torch.tensor([-1 if d == 0 else (d - 1) * profile.width
                                     for d in range(len(profile.rates)) for _ in range(profile.width)])
        shape = DraftTree(torch.zeros_like(self.parents), self.parents)  # every tree's depths and ancestor bits
        self.shape_fields = (shape.depth_list, shape.ancestor_bit_list)

    def cost_key(self) -> str:
        inner = "" if self.inner is None else "|" + self.inner.cost_key()
        return f"oracle:{self.profile.rates}x{self.profile.width}{inner}"

    def attach(self, target: TargetView) -> None:
        self.target = target
        self.vocab = target.runner.shape.vocab_size
        self.generator = torch.Generator().manual_seed(self.seed)
        self._seqs.clear()
        if self.inner is not None:
            self.inner.attach(target)

    def on_accept(self, seq_id: int, committed: Sequence[int]) -> None:
        if self.inner is not None:
            self.inner.on_accept(seq_id, committed)

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)
        if self.inner is not None:
            self.inner.release(seq_id)

    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        if self.inner is not None:  # its true cost; its tokens are not used
            self.inner.propose(seqs)
        return [self._tree(view) for view in seqs]

    def propose_pending(self, seqs: Sequence[SequenceView]) -> PendingTrees:
        """The oracle's trees with their fields on the device, while the inner drafter's pending trees are read when
        the engine reads these (after the verify's launch): each step pays EAGLE's drafting where EAGLE's own
        pending step does."""
        inner = self.inner.propose_pending(seqs)
        trees = [self._tree(view) for view in seqs]
        depths, bits = self.shape_fields
        fields = to_device([[t for tree in trees for t in tree.tokens.tolist()], depths * len(trees),
                            bits * len(trees)], torch.long, self.target.runner.device)  # one copy: [3, K]

        def read() -> list[DraftTree]:
            inner.read()
            return trees

        return PendingTrees(tuple(t.num_nodes for t in trees), *fields, len(self.profile.rates), read, inner.seconds,
                            inner.started_at)

    def _tree(self, view: SequenceView) -> DraftTree:
        rates, width = self.profile.rates, self.profile.width
        state = self._seqs.get(view.seq_id)
        if state is None:  # a sequence's first tree: its continuation found by the prompt (a prompt-long key: once,
            # not every step), each depth's credit started at a draw of the oracle's generator
            prompt = tuple(view.token_ids[: view.num_prompt_tokens])
            credit = torch.rand(len(rates), generator=self.generator).tolist()
            reference = self.continuations.get(prompt)
            if reference is None:  # every proposal would miss: a measurement of tau 1, unannounced
                raise InputError(f"the oracle has no reference continuation for a prompt of {len(prompt)} tokens "
                                 f"(starting {list(prompt[:8])}): build it with reference_continuations() on the "
                                 "same prompts")
            state = self._seqs[view.seq_id] = (reference, credit)
        reference, credit = state
        done = len(view.token_ids) - view.num_prompt_tokens  # new tokens committed; the root is the last of them
        tokens, on_path = [], True
        for d, rate in enumerate(rates):
            want = reference[done + d] if done + d < len(reference) else None
            hit = False
            if on_path and want is not None:  # a try: the credit grows by the rate and pays a hit per whole unit
                credit[d] += rate
                hit = credit[d] >= 1.0
                credit[d] -= hit
                self.proposed_tries[d] += 1
                self.proposed_hits[d] += hit
            wrong = want if want is not None else view.token_ids[-1]
            tokens += [want if (hit and j == 0) else (wrong + 1 + j) % self.vocab for j in range(width)]
            on_path = hit  # the next depth hangs under this depth's first child (self.parents)
        # the instrument's own host time per step stays small next to a real drafter's: its trees are well formed
        # by construction (the one shape checked in __init__, int64 tokens), so built unchecked (the engine
        # validates every proposal all the same)
        return DraftTree.unchecked(torch.tensor(tokens), self.parents)
