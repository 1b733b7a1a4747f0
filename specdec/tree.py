"""DraftTree: the token tree a drafter proposes for one sequence in one step.

Nodes are proposed tokens. ``parents[i] < i``; ``parents[i] == -1`` means node i is a
child of the *root*, the last committed token of the sequence (whose K/V is written in
the same verify forward). A chain is the tree with ``parents[i] = i - 1``; plain decoding
is the empty tree. Depth of a root child is 1; a node's position id is
``root_position + depth``.

Usage::

    tree = DraftTree.chain([5, 7, 9])                 # deterministic candidates
    tree = DraftTree(tokens, parents, draft_probs, DraftMode.INDEPENDENT)
    tree.validate(vocab_size, drafter="ngram")      # clear DraftError on bad input
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise

import torch

from specdec.errors import SpecdecError
from specdec.generate_inputs import is_int
from specdec.host_copy import to_device

MAX_TREE_NODES = 64  # the ancestor bitmask of the GPU kernels holds 64 bits
_EMPTY: "DraftTree | None" = None  # DraftTree.empty()


class DraftError(SpecdecError, ValueError):
    """A drafter returned a proposal that cannot be verified exactly."""


class DraftMode(str, enum.Enum):
    """How the drafter chose the children of each node (decides the acceptance rule)."""

    INDEPENDENT = "independent"  # each child drawn i.i.d. from draft_probs of its parent
    WITHOUT_REPLACEMENT = "without_replacement"  # siblings drawn without replacement
    DETERMINISTIC = "deterministic"  # candidates picked without sampling; draft_probs is None


def _describe(x) -> str:
    return f"{type(x).__name__} {x!r}" if not isinstance(x, torch.Tensor) else f"{x.dtype} tensor {x.tolist()!r}"


def _id_vector(value, what: str) -> torch.Tensor:
    """`value` (tensor, list, tuple, numpy array, scalar) as a 1-D int64 tensor, or a one-line DraftError.

    Float, bool and complex ids are refused, not truncated: a drafter that hands over 3.7 has a bug."""
    if isinstance(value, (list, tuple)):
        if not all(type(x) is int for x in value):  # the common case at once; else each id checked and converted
            for i, x in enumerate(value):
                if not is_int(x):
                    raise DraftError(f"{what} must be integer ids, got {_describe(x)} at node {i} "
                                     "(float and bool ids are refused, not truncated)")
            value = [int(x) for x in value]
        try:
            return torch.tensor(value, dtype=torch.long)
        except (RuntimeError, OverflowError, ValueError) as err:  # an int beyond int64
            raise DraftError(f"{what}: id out of the int64 range ({str(err).splitlines()[0]})") from None
    try:
        t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise DraftError(f"{what} must be a 1-D tensor or list of integer ids, got {type(value).__name__}") from None
    if t.dim() > 1:
        raise DraftError(f"{what} must be 1-D [num_nodes], got shape {tuple(t.shape)}")
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise DraftError(f"{what} must be integer ids, got a {t.dtype} tensor (node 0: {t.reshape(-1)[0].item()!r}); "
                         "float and bool ids are refused, not truncated")
    return t.to(torch.long).reshape(-1)


def _first_bad_parent(parents: torch.Tensor) -> int | None:
    """Index of the first node breaking -1 <= parents[i] < i (topological order, no cycles), or None.

    On a list (at most MAX_TREE_NODES entries get here): cheaper than four tensor ops per tree."""
    for i, p in enumerate(parents.tolist()):
        if not -1 <= p < i:
            return i
    return None


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A drafter's proposal for one sequence in one step: node ``i`` proposes ``tokens[i]`` after ``parents[i]``
    (-1: the root, the sequence's last committed token). The empty tree is plain decoding.

    Checked when built (a one-line DraftError): ``tokens`` and ``parents`` are 1-D integer ids of one length, at
    most ``MAX_TREE_NODES``; ``-1 <= parents[i] < i``; a DETERMINISTIC tree has no ``draft_probs``, a sampled one
    ``[num_nodes, vocab]`` floats (row ``i``: the distribution node ``i`` was drawn from); ``scores`` in [0, 1].
    :meth:`validate` adds what needs the vocabulary (ids inside it, rows summing to 1, distinct siblings drawn
    without replacement). Frozen; the engine may verify an ancestor-closed part of it (:meth:`subtree`)."""

    tokens: torch.Tensor  # [num_nodes] int64 token ids
    parents: torch.Tensor  # [num_nodes] int64, -1 = root, else parents[i] < i
    # [num_nodes, vocab] float: row i is the distribution node i's token was drawn from
    # (the drafter's distribution at parents[i], after temperature/top-k/top-p), or None
    draft_probs: torch.Tensor | None = None
    mode: DraftMode = DraftMode.DETERMINISTIC
    # [num_nodes] float in [0, 1]: the drafter's own estimate that node i is accepted given its parent is
    # (e.g. its draft probability). Only tree sizing reads it (a pruned tree is still verified exactly);
    # acceptance never does. None: the drafter gives no estimate.
    scores: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = _id_vector(self.tokens, "tokens")
        parents = _id_vector(self.parents, "parents")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        try:
            object.__setattr__(self, "mode", DraftMode(self.mode))
        except (ValueError, TypeError):
            raise DraftError(f"mode must be one of {[m.value for m in DraftMode]}, got {self.mode!r}") from None
        if tokens.numel() != parents.numel():
            raise DraftError(f"tokens has {tokens.numel()} nodes but parents has {parents.numel()}")
        if tokens.numel() > MAX_TREE_NODES:
            raise DraftError(f"draft tree has {tokens.numel()} nodes; at most {MAX_TREE_NODES} are supported")
        bad = _first_bad_parent(parents)
        if bad is not None:
            raise DraftError(
                f"node {bad} has parent {int(parents[bad])}: parents must satisfy -1 <= parents[i] < i "
                "(topological order, no cycles)"
            )
        if self.mode is DraftMode.DETERMINISTIC:
            if self.draft_probs is not None:
                raise DraftError(
                    "deterministic drafts carry no draft_probs; pass mode=INDEPENDENT or WITHOUT_REPLACEMENT"
                )
        else:
            if self.draft_probs is None:
                raise DraftError(f"mode {self.mode.value} needs draft_probs [num_nodes, vocab]")
            if not isinstance(self.draft_probs, torch.Tensor) or not self.draft_probs.is_floating_point():
                got = self.draft_probs.dtype if isinstance(self.draft_probs, torch.Tensor) else type(self.draft_probs)
                raise DraftError(f"draft_probs must be a floating-point tensor [num_nodes, vocab], got {got}")
            if self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != tokens.numel():
                raise DraftError(
                    f"draft_probs must be [num_nodes={tokens.numel()}, vocab], got {tuple(self.draft_probs.shape)}"
                )
        if self.scores is not None:
            sc = self.scores
            if not isinstance(sc, torch.Tensor) or not sc.is_floating_point() or tuple(sc.shape) != (tokens.numel(),):
                got = tuple(sc.shape) if isinstance(sc, torch.Tensor) else type(sc).__name__
                raise DraftError(f"scores must be a float tensor [num_nodes={tokens.numel()}], got {got}")
            # one read of at most 64 values, no tensor op; NaN fails the comparison
            if not all(0.0 <= x <= 1.0 for x in sc.tolist()):
                raise DraftError("scores must lie in [0, 1] (estimated acceptance probabilities)")

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def empty(cls) -> "DraftTree":
        """The empty tree (plain decoding). One shared instance: it has nothing to mutate, and the engine asks
        for one per sequence per step."""
        global _EMPTY
        if _EMPTY is None:
            _EMPTY = cls(torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
        return _EMPTY

    @classmethod
    def chain(cls, tokens, draft_probs: torch.Tensor | None = None, mode: DraftMode | None = None,
              scores: torch.Tensor | None = None) -> "DraftTree":
        tokens = _id_vector(tokens, "tokens")  # float / bool ids refused here too, not truncated
        parents = torch.arange(tokens.numel()) - 1
        if mode is None:
            mode = DraftMode.DETERMINISTIC if draft_probs is None else DraftMode.INDEPENDENT
        return cls(tokens, parents, draft_probs, mode, scores)

    # ---- derived structure --------------------------------------------------------------
    @cached_property
    def num_nodes(self) -> int:  # the engine asks per sequence several times a step
        return self.tokens.shape[0]

    @cached_property
    def depth_list(self) -> list[int]:  # [num_nodes] depths as a list: the engine asks per sequence per step
        depths: list[int] = []
        for p in self.parents.tolist():
            depths.append(1 if p < 0 else depths[p] + 1)
        return depths

    @cached_property
    def depths(self) -> torch.Tensor:  # [num_nodes], root children have depth 1
        return torch.tensor(self.depth_list, dtype=torch.long, device=self.parents.device)

    @cached_property
    def max_depth(self) -> int:
        return max(self.depth_list, default=0)

    def position_ids(self, root_position: int) -> torch.Tensor:  # [num_nodes]
        return self.depths + root_position

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:  # [num_nodes, num_nodes] bool: j is i or an ancestor of i
        n = self.num_nodes
        mask = torch.zeros(n, n, dtype=torch.bool, device=self.parents.device)
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def ancestor_bits(self) -> torch.Tensor:  # [num_nodes] int64 bitmask of ancestor_mask rows
        return torch.tensor(self.ancestor_bit_list, dtype=torch.long, device=self.parents.device)

    @cached_property
    def ancestor_bit_list(self) -> list[int]:  # [num_nodes] ancestor_bits() as int64 values in a list
        bits: list[int] = []
        for i, p in enumerate(self.parents.tolist()):
            bits.append((bits[p] if p >= 0 else 0) | (1 << i))
        # bit 63 is the int64 sign bit: the two's-complement value, as a shift in int64 gives
        return [b - (1 << 64) if b >> 63 else b for b in bits]

    @cached_property
    def children(self) -> list[list[int]]:  # index 0 = root's children, index i+1 = node i's children
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids

    def paths(self) -> list[list[int]]:
        """Root-to-leaf node index paths."""
        out = []
        for leaf in range(self.num_nodes):
            if self.children[leaf + 1]:
                continue
            path = [leaf]
            while (p := int(self.parents[path[-1]])) >= 0:
                path.append(p)
            out.append(path[::-1])
        return out

    def prune(self, keep: torch.Tensor) -> "DraftTree":
        """Sub-tree of the nodes where `keep` [num_nodes] bool is True (must be ancestor-closed)."""
        kept = torch.as_tensor(keep, dtype=torch.bool).tolist()
        return self.subtree([i for i, k in enumerate(kept) if k])

    def subtree(self, nodes: list[int]) -> "DraftTree":
        """Sub-tree of ``nodes``: ascending node indices, ancestor-closed (what tree sizing keeps, per sequence and
        step: one gather per tensor)."""
        if any(a >= b for a, b in pairwise(nodes)) or (nodes and not 0 <= nodes[0] <= nodes[-1] < self.num_nodes):
            raise ValueError(f"subtree: node indices must be ascending within [0, {self.num_nodes}), got {nodes}")
        k = len(nodes)
        if not nodes or nodes[-1] == k - 1:  # the first k nodes (a chain's cut, a depth cut of a tree in level order):
            # their parents are among them and keep their indices, so each tensor's first k rows are the subtree
            # (views: a tree's tensors are never written in place)
            return self._trusted(self.tokens[:k], self.parents[:k],
                                 None if self.draft_probs is None else self.draft_probs[:k],
                                 None if self.scores is None else self.scores[:k])
        old_parents = self.parents.tolist()
        new_index = {-1: -1}  # old index -> new index, of the nodes kept so far
        parents: list[int] = []
        for j, i in enumerate(nodes):
            p = old_parents[i]
            if p not in new_index:
                raise ValueError("prune: a kept node's parent is dropped")
            new_index[i] = j
            parents.append(new_index[p])
        index = {}  # per device

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if t.device not in index:
                index[t.device] = to_device(nodes, torch.long, t.device)  # no stream sync on CUDA
            return t[index[t.device]]

        return self._trusted(pick(self.tokens), to_device(parents, torch.long, self.parents.device),
                             pick(self.draft_probs), pick(self.scores))

    def _trusted(self, tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None,
                 scores: torch.Tensor | None) -> "DraftTree":
        """A tree of this one's mode built from parts of it (a sub-tree): the construction checks hold for it
        as they held for this tree (and a sub-tree of a validated tree is validated), so none is run again (the
        engine prunes per sequence per step)."""
        return type(self).unchecked(tokens, parents, draft_probs, self.mode, scores)

    @classmethod
    def unchecked(cls, tokens: torch.Tensor, parents: torch.Tensor, draft_probs: torch.Tensor | None = None,
                  mode: DraftMode = DraftMode.DETERMINISTIC, scores: torch.Tensor | None = None) -> "DraftTree":
        """A tree built without the construction checks, for parts that meet them where they are made (1-D int64
        ``tokens`` and ``parents`` of one length, ``scores`` clamped to [0, 1], a ``mode`` that matches
        ``draft_probs``): a drafter building a batch of trees per step from tensors of its own (EAGLE's). The engine
        still validates every proposal (:func:`validate_trees`: parents, token range, sibling rules)."""
        tree = object.__new__(cls)
        # the fields set as frozen dataclasses set them in __init__, in one update (the engine copies every
        # proposal per step: validate_trees)
        tree.__dict__.update(tokens=tokens, parents=parents, draft_probs=draft_probs, mode=mode, scores=scores)
        return tree

    # ---- checks the engine runs on every proposal ---------------------------------------
    def validate(self, vocab_size: int, drafter: str = "drafter", atol: float = 1e-4) -> None:
        """Raise DraftError naming `drafter` and the problem if this tree cannot be verified exactly.

        Rows of draft_probs are accepted when they sum to 1 within `atol`, or within what rounding to their dtype
        can move a distribution's sum when that is more (float16 / bfloat16: the relative rounding ``eps`` plus
        ``vocab`` times the subnormal spacing, which ~6e-6-probability float16 entries fall into); they are then
        replaced by the rows divided by their sums, computed in float64 and stored in the rows' dtype (float32
        at least): the exact rule sees the distributions that were sampled from, summing to 1 up to
        that dtype's rounding (float32: ~1e-7, the precision torch.multinomial draws float32 rows with).
        """
        checked = validate_trees([self], vocab_size, drafter, atol)[0]
        object.__setattr__(self, "draft_probs", checked.draft_probs)

    def _check_structure(self, vocab_size: int, drafter: str) -> None:
        """The host-side checks of :meth:`validate`: parents, token range, distinct siblings, draft_probs' shape."""
        n = self.num_nodes
        # the structure was checked at construction, but tensors are mutable: re-check what the engine relies on
        if self.parents.numel() != n or _first_bad_parent(self.parents) is not None:
            raise DraftError(f"{drafter}: malformed tree: parents must satisfy -1 <= parents[i] < i, "
                             f"got {self.parents.tolist()}")
        tokens = self.tokens.tolist()  # one read (a tree of at most 64 nodes), not a reduction each way
        if n and (min(tokens) < 0 or max(tokens) >= vocab_size):
            bad = [(i, t) for i, t in enumerate(tokens) if not 0 <= t < vocab_size]
            where = ", ".join(f"node {i} has token {t}" for i, t in bad[:5])
            raise DraftError(f"{drafter}: draft token ids outside the vocabulary [0, {vocab_size}): {where}")
        if self.mode is DraftMode.WITHOUT_REPLACEMENT:  # siblings (same parent) have distinct tokens
            first: dict[tuple[int, int], int] = {}
            for i, key in enumerate(zip(self.parents.tolist(), tokens, strict=True)):
                j = first.setdefault(key, i)
                if j != i:
                    raise DraftError(f"{drafter}: nodes {j} and {i} are siblings with the same token {key[1]}, "
                                     "impossible when drawn without replacement")
        probs = self.draft_probs
        if probs is None:
            return
        if probs.dim() != 2 or probs.shape[0] != n:
            raise DraftError(f"{drafter}: draft_probs must be [num_nodes={n}, vocab], got {tuple(probs.shape)}")
        if probs.shape[1] != vocab_size:
            raise DraftError(f"{drafter}: draft_probs has {probs.shape[1]} columns but the target vocabulary has "
                             f"{vocab_size} tokens (drafter and target must share one vocabulary)")

    def _probs_checks(self, vocab_size: int, atol: float) -> tuple[torch.Tensor, torch.Tensor]:
        """On draft_probs' device, no read: [4] bool (a NaN / inf, a negative entry, a row not summing to 1, a
        drafted token of probability 0) and the rows' float64 sums."""
        probs = self.draft_probs
        sums = probs.double().sum(-1)
        if probs.dtype.is_floating_point:
            info = torch.finfo(probs.dtype)
            atol = max(atol, info.eps + vocab_size * info.smallest_normal * info.eps)
        drawn = probs.gather(1, to_device(self.tokens, torch.long, probs.device)[:, None]).squeeze(1)
        flags = torch.stack([~torch.isfinite(probs).all(), (probs < 0).any(),
                             ~torch.isclose(sums, torch.ones_like(sums), rtol=1e-5, atol=atol).all(),
                             (drawn <= 0).any()])
        return flags, sums

    def _raise_probs_error(self, flags: list[bool], sums: torch.Tensor, drafter: str) -> None:
        """The first failed check of ``flags`` (:meth:`_probs_checks`), with its rows: only an error reads more."""
        probs = self.draft_probs
        if flags[0]:
            kind = "NaN" if bool(torch.isnan(probs).any()) else "inf"
            rows = (~torch.isfinite(probs)).any(-1).nonzero().flatten().tolist()
            raise DraftError(f"{drafter}: draft_probs contains {kind} (rows of nodes {rows[:5]}); a drafting model's "
                             "logits that are not finite give it: a float16 overflow (of the target's own layers, "
                             "for self-draft) or NaN weights")
        if flags[1]:
            rows = (probs < 0).any(-1).nonzero().flatten().tolist()
            raise DraftError(f"{drafter}: draft_probs has negative entries (rows of nodes {rows[:5]})")
        if flags[2]:
            raise DraftError(f"{drafter}: draft_probs rows must sum to 1, got {[round(x, 6) for x in sums.tolist()]}")
        drawn = probs.gather(1, self.tokens.to(probs.device)[:, None]).squeeze(1)
        nodes = (drawn <= 0).nonzero().flatten().tolist()
        raise DraftError(f"{drafter}: drafted tokens at nodes {nodes[:5]} have draft probability 0, "
                         "so they cannot have been sampled from draft_probs")


def proposed_trees(drafter: str, count: int, propose: Callable[[], object]) -> Sequence[DraftTree]:
    """What ``propose()`` returned when it is one DraftTree per sequence (``count``), else a one-line DraftError
    naming ``drafter`` (a DraftError raised inside it, e.g. by a malformed DraftTree it built, gets the name too).
    The trees' contents are :func:`validate_trees`' to check."""
    try:
        trees = propose()
    except DraftError as err:
        if str(err).startswith(f"{drafter}:"):
            raise
        raise DraftError(f"{drafter}: {err}") from err
    if not isinstance(trees, (list, tuple)) or len(trees) != count:
        got = f"{len(trees)} trees" if isinstance(trees, (list, tuple)) else type(trees).__name__
        raise DraftError(f"{drafter}: propose() must return one DraftTree per sequence ({count}), got {got}")
    for tree in trees:
        if not isinstance(tree, DraftTree):
            raise DraftError(f"{drafter}: propose() returned {type(tree).__name__}, expected DraftTree")
    return trees


def validate_trees(trees: Sequence[DraftTree], vocab_size: int, drafter: str = "drafter", atol: float = 1e-4
                   ) -> list[DraftTree]:
    """The trees to verify: :meth:`DraftTree.validate`'s checks of every tree, the draft_probs of all of them with
    one read of the device (a read per check and tree made the host wait for the GPU four times per sampled tree),
    every tree's host-side checks first; a failing tree raises its own message. Each returned tree is the engine's
    own over the proposal's tensors: its structure derived afresh and its draft_probs normalised into a tensor of
    its own, so a drafter that refills one tree's tensors in place each step is read anew, and its object is never
    written (a normalised copy left on it would be verified again against the next step's tokens)."""
    owned = [t if t.tokens.numel() == 0 else t._trusted(t.tokens, t.parents, t.draft_probs, t.scores) for t in trees]
    checks = []
    for tree in owned:
        tree._check_structure(vocab_size, drafter)
        if tree.draft_probs is not None:
            checks.append((tree, *tree._probs_checks(vocab_size, atol)))
    if not checks:
        return owned
    failed = torch.stack([flags for _, flags, _ in checks]).tolist()  # the one read
    for (tree, _, sums), row in zip(checks, failed, strict=True):
        if any(row):
            tree._raise_probs_error(row, sums, drafter)
        # invariant from here on: every row sums to 1 up to its dtype's rounding
        dtype = torch.promote_types(tree.draft_probs.dtype, torch.float32)
        object.__setattr__(tree, "draft_probs", (tree.draft_probs.double() / sums[:, None]).to(dtype))
    return owned


def matched_levels(tokens: Sequence[int], parents: Sequence[int], committed: Sequence[int]) -> tuple[int, int]:
    """(trials, successes) of walking a proposed tree (``tokens``, ``parents`` as lists) along the ``committed``
    tokens of its step: one trial per level where the matched node (or the root) has children, a success when
    one of them is the committed token. Under greedy decoding the successes are the levels the whole tree would
    have had accepted, whatever the engine pruned (the committed tokens are the target's own)."""
    kids: dict[int, dict[int, int]] = {}
    for i, (tok, p) in enumerate(zip(tokens, parents, strict=True)):
        kids.setdefault(p, {}).setdefault(tok, i)
    trials = successes = 0
    node = -1
    for tok in committed:
        options = kids.get(node)
        if not options:
            break
        trials += 1
        node = options.get(int(tok), -2)
        if node == -2:
            break
        successes += 1
    return trials, successes


def tried_nodes(tokens: Sequence[int], parents: Sequence[int], committed: Sequence[int]) -> list[tuple[int, bool]]:
    """(node, accepted) of every node a commit tested, in node order: its parent is the root or accepted, and its
    depth is at most len(committed); accepted when its token is the committed one at its depth (greedy: exactly
    what a verify of the whole tree would have accepted, whatever was pruned)."""
    out: list[tuple[int, bool]] = []
    depth: list[int] = []
    ok: list[bool] = []
    for i, (tok, p) in enumerate(zip(tokens, parents, strict=True)):
        depth.append(1 if p < 0 else depth[p] + 1)
        hit = False
        if (p < 0 or ok[p]) and depth[i] <= len(committed):
            hit = int(committed[depth[i] - 1]) == int(tok)
            out.append((i, hit))
        ok.append(hit)
    return out
