"""Rejection sampling over a draft tree: the one place where tokens are accepted.

The walk starts at the root with ``residual = target_probs[root]``. The children of the
current node are tried in order:

- stochastic child ``x`` drawn from ``draft_probs`` (INDEPENDENT; WITHOUT_REPLACEMENT
  renormalises away earlier siblings): accept with ``min(1, residual[x] / draft[x])``,
  else ``residual <- norm(max(0, residual - draft))``;
- deterministic candidate ``x`` (no draft_probs): accept with ``residual[x]``, else zero
  it and renormalise.

An accepted child becomes the current node with ``residual = target_probs[child]``. If all
children are rejected, the *recovered* token is drawn from the residual; at a node with no
children, the *bonus* token is drawn from ``target_probs`` there. Greedy (temperature 0)
is the limit case: the child equal to the target's argmax is accepted.

Coupled sampling (:mod:`specdec.coupling`) replaces the random acceptance by the deterministic walk of
:func:`follow_choices` over the target's Gumbel-max tokens, as greedy decoding does with its argmax.

The walk is vectorised over the batch (loops run over depth and sibling rank only); on a GPU it
never reads the device before its result (:func:`_walk`). The law
itself lives in :class:`AcceptanceRule`, shared with the exact-law enumerator
(``specdec.eval.exact_law``) so that deliberately broken rules can be shown to fail. Under that
exact rule, batches of deterministic trees (EAGLE, n-gram, Medusa) take a shortcut with the same law
and the same random draws (:func:`_deterministic`): it works on the target's probabilities of the
child tokens, not on vocabulary-wide residuals.

    acceptances = rejection_sample(trees, target_logits, sampling, generator)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec.host_copy import to_device
from specdec.sampling import SamplingConfig, choose_max, logits_to_probs, sample
from specdec.tree import DraftMode, DraftTree


def _normalise(x: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of x [B, V] normalised; an all-zero row (a probability-0 branch) keeps `fallback`."""
    total = x.sum(-1, keepdim=True)
    return torch.where(total > 1e-12, x / total.clamp_min(1e-300), fallback)


class AcceptanceRule:
    """The exact, lossless acceptance law. Every method works on a batch of rows [B, V].

    ``deterministic`` [B] marks rows whose candidate has no draft distribution.
    Deliberately broken subclasses live in ``specdec.eval.negative_controls``.
    """

    name = "exact"
    lossy = False

    def sibling_draft(
        self, draft_probs: torch.Tensor, tried: torch.Tensor, without_replacement: torch.Tensor
    ) -> torch.Tensor:
        """Distribution the next sibling was drawn from; tried [B, V] marks earlier siblings."""
        excluded = _normalise(draft_probs.masked_fill(tried, 0.0), draft_probs)
        return torch.where(without_replacement[:, None], excluded, draft_probs)

    def accept_prob(self, residual, draft, token, deterministic) -> torch.Tensor:  # [B]
        r = residual.gather(1, token[:, None])[:, 0]
        q = draft.gather(1, token[:, None])[:, 0]
        return torch.where(deterministic, r, (r / q.clamp_min(1e-300)).clamp(max=1.0))

    def after_reject(self, residual, draft, token, deterministic) -> torch.Tensor:  # [B, V]
        zeroed = residual.scatter(1, token[:, None], 0.0)
        stochastic = (residual - draft).clamp_min(0.0)
        return _normalise(torch.where(deterministic[:, None], zeroed, stochastic), residual)

    def recovered_dist(self, residual, target_probs) -> torch.Tensor:
        return residual

    def bonus_dist(self, target_probs, own_draft, has_own) -> torch.Tensor:
        """own_draft [B, V]: the distribution the node itself was drawn from (if has_own)."""
        return target_probs


EXACT = AcceptanceRule()


@dataclass(frozen=True)
class Acceptance:
    """What one sequence commits in one step: ``accepted_tokens + (next_token,)``. Host values (the walk's one read
    gives them, and the engine reads them per sequence per step: no tensor is built for them)."""

    accepted_nodes: tuple[int, ...]  # [num_accepted] node indices of the accepted path, root-to-leaf
    accepted_tokens: tuple[int, ...]  # [num_accepted] their token ids
    next_token: int  # recovered token (a rejection ended the path) or bonus token
    is_bonus: bool
    depth_tried: tuple[int, ...]  # [max_depth] 1 where a child at depth d+1 was tried (parent accepted)
    depth_accepted: tuple[int, ...]  # [max_depth] 1 where a node at depth d+1 was accepted


def plain_acceptances(tokens: Sequence[int]) -> list[Acceptance]:
    """Steps with no draft: each sequence commits its one token, the bonus token at its root (what the walk over an
    empty tree gives, without walking it)."""
    return [Acceptance((), (), token, True, (), ()) for token in tokens]


def _finish(tree: DraftTree, path: list[int], next_token: int, is_bonus: bool, tried_depths: int,
            tokens: list[int] | None = None) -> Acceptance:
    """``tokens``: the tree's tokens as a list, where the caller has read them already."""
    depth, tried = tree.max_depth, min(tried_depths, tree.max_depth)
    if tokens is None:
        tokens = tree.tokens.tolist() if path else []
    return Acceptance(tuple(path), tuple(tokens[i] for i in path), next_token, is_bonus,
                      (1,) * tried + (0,) * (depth - tried), (1,) * len(path) + (0,) * (depth - len(path)))


def follow_choices(trees: Sequence[DraftTree], choices: list[list[int]]) -> list[Acceptance]:
    """The deterministic walk: ``choices[b][r]`` [B][max_nodes + 1] is the token the target chose at row r of
    tree b (row 0 = root, 1 + i = node i). From the root, move to the child that carries the choice; where
    none does, the choice is the recovered token, at a leaf the bonus token. Greedy decoding (choice =
    argmax) and coupled sampling (:mod:`specdec.coupling`, choice = Gumbel-max) both end here."""
    out = []
    for tree, best in zip(trees, choices, strict=True):
        # the tokens are read once, and only where the root has children (an empty tree is a plain step's)
        children, tokens, path, node = tree.children, None, [], -1
        while True:
            kids, want, match = children[node + 1], best[node + 1], None
            if kids:
                tokens = tree.tokens.tolist() if tokens is None else tokens
                for c in kids:
                    if tokens[c] == want:
                        match = c
                        break
            if match is None:
                out.append(_finish(tree, path, want, not kids, len(path) + bool(kids), tokens))
                break
            path.append(match)
            node = match
    return out


@dataclass(frozen=True)
class _PaddedTrees:
    tokens: torch.Tensor  # [B, N] (0-padded)
    children: torch.Tensor  # [B, N + 1, W] child node ids in order, -1 padded; row 0 = root
    draft_probs: torch.Tensor  # [B, N, V] (zeros for deterministic trees / padding)
    deterministic: torch.Tensor  # [B] bool
    without_replacement: torch.Tensor  # [B] bool

    @staticmethod
    def build(trees: Sequence[DraftTree], vocab: int, dtype: torch.dtype, device: torch.device) -> "_PaddedTrees":
        tokens, children = _tree_tables(trees, device)
        draft = torch.zeros(len(trees), tokens.shape[1], vocab, dtype=dtype, device=device)
        for i, t in enumerate(trees):
            if t.draft_probs is not None:
                draft[i, : t.num_nodes] = to_device(t.draft_probs.detach(), dtype, device)
        det = to_device([t.mode is DraftMode.DETERMINISTIC for t in trees], torch.bool, device)
        wr = to_device([t.mode is DraftMode.WITHOUT_REPLACEMENT for t in trees], torch.bool, device)
        return _PaddedTrees(tokens, children, draft, det, wr)


def _tree_tables(trees: Sequence[DraftTree], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, N] (0-padded) and children [B, N + 1, W] (child node ids in order, -1 padded; row 0 = the root),
    assembled on the CPU (trees are small host records), then moved to ``device`` in one copy each."""
    b, n = len(trees), max(1, max(t.num_nodes for t in trees))  # a column at least: the walk indexes it
    w = max((len(k) for t in trees for k in t.children), default=0)
    tokens = torch.zeros(b, n, dtype=torch.long, device="cpu")
    children = torch.full((b, n + 1, max(w, 1)), -1, dtype=torch.long, device="cpu")
    for i, t in enumerate(trees):
        tokens[i, : t.num_nodes] = t.tokens
        for node, kids in enumerate(t.children):
            children[i, node, : len(kids)] = torch.tensor(kids, dtype=torch.long, device="cpu")
    return to_device(tokens, torch.long, device), to_device(children, torch.long, device)


# One node's children, tried for every row of the batch: (cur [B] each row's node, target [B, V] the target's
# probabilities there, live [B] the rows still walking, uniforms [W, B] one per sibling rank) -> (accepted [B] child
# node or -1, leaf [B], final(rows) [R, V] the distribution the bonus / recovered token of rows that end here is drawn
# from, for ``rows`` [R] or None = every row). Rows that are not live may compute anything: the walk masks them.
Final = Callable[[torch.Tensor | None], torch.Tensor]
TryChildren = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                       tuple[torch.Tensor, torch.Tensor, Final]]


def _stops_early(stop_early: bool | None, device: torch.device) -> bool:
    """The walk's ``stop_early``: as asked, else off the GPU only, where reading the device is free."""
    return device.type != "cuda" if stop_early is None else stop_early


def _walk(trees: Sequence[DraftTree], target_logits: torch.Tensor, sampling: SamplingConfig,
          generator: torch.Generator | None, try_children: TryChildren, width: int, stop_early: bool
          ) -> list[Acceptance]:
    """From the root down, batched: at each node ``try_children`` accepts one child or none; a row ends at a leaf
    (bonus token) or where every child was rejected (recovered token).

    No shape depends on a value, so the device is never read during the walk: every row runs every level, the
    rows that have ended masked, and every uniform of the walk is drawn up front (per level, one per row for the
    final draw, then ``width`` per row for the siblings). The host reads the result once. ``stop_early``
    (:func:`_stops_early`) stops the levels and sibling ranks once no row walks on, computes the
    target's probabilities for the walking rows alone and draws only for the rows that end: the same tokens, as the
    skipped work concerns ended rows only."""
    # every tensor of the walk lives on the logits' device (the generator too: rejection_sample checks)
    bsz, device = len(trees), target_logits.device
    rows = torch.arange(bsz, device=device)
    node = torch.full((bsz,), -1, dtype=torch.long, device=device)  # current node (-1 = root)
    live = torch.ones(bsz, dtype=torch.bool, device=device)  # still walking
    next_token = torch.zeros(bsz, dtype=torch.long, device=device)
    is_bonus = torch.zeros(bsz, dtype=torch.bool, device=device)
    depth = max(t.max_depth for t in trees)
    path = torch.full((bsz, depth + 1), -1, dtype=torch.long, device=device)  # accepted node per depth
    path_len = torch.zeros(bsz, dtype=torch.long, device=device)
    tried_depths = torch.zeros(bsz, dtype=torch.long, device=device)
    final_u = torch.rand(depth + 1, bsz, generator=generator, dtype=torch.float64, device=device)
    sibling_u = torch.rand(depth + 1, width, bsz, generator=generator, dtype=torch.float64, device=device)
    for level in range(depth + 1):  # a row at level l stands on a node of depth l: a leaf by l = depth
        if stop_early and not bool(live.any()):
            break
        target = _target_probs(target_logits, node, live if stop_early else None, sampling)  # [B, V]
        accepted, leaf, final = try_children(node, target, live, sibling_u[level])
        done = live & (leaf | (accepted < 0))
        if stop_early:  # the rows that end here alone
            idx = done.nonzero()[:, 0]
            next_token[idx] = sample(final(idx), uniforms=final_u[level, idx])
        else:
            next_token = torch.where(done, sample(final(None), uniforms=final_u[level]), next_token)
        is_bonus = torch.where(done, leaf, is_bonus)
        tried_depths += (live & ~leaf).long()
        go = live & ~done
        path[rows, path_len] = torch.where(go, accepted, path[rows, path_len])
        path_len += go.long()
        node = torch.where(go, accepted, node)
        live = go
    # one copy to the host for the whole batch
    out = torch.cat([path, torch.stack([path_len, next_token, is_bonus.long(), tried_depths], 1)], 1).tolist()
    return [_finish(t, row[: row[depth + 1]], row[depth + 2], bool(row[depth + 3]), row[depth + 4])
            for t, row in zip(trees, out, strict=True)]


def _target_probs(target_logits: torch.Tensor, node: torch.Tensor, only: torch.Tensor | None,
                  sampling: SamplingConfig) -> torch.Tensor:
    """[B, V] float64 target probabilities at each row's node; with ``only`` [B] bool (off the GPU, where finding
    the rows is free) of those rows alone, the others zero."""
    if only is None or bool(only.all()):
        return logits_to_probs(target_logits[torch.arange(len(node), device=node.device), node + 1].to(torch.float64),
                               sampling)
    idx = only.nonzero()[:, 0]
    out = torch.zeros(len(node), target_logits.shape[-1], dtype=torch.float64, device=node.device)
    return out.index_copy_(0, idx, logits_to_probs(target_logits[idx, node[idx] + 1].to(torch.float64), sampling))


def _stochastic(
    trees: Sequence[DraftTree],
    target_logits: torch.Tensor,  # [B, N + 1, V]
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    rule: AcceptanceRule,
    stop_early: bool | None = None,
) -> list[Acceptance]:
    """The walk of any tree under any rule, on vocabulary-wide residuals."""
    vocab, device, dtype = target_logits.shape[-1], target_logits.device, torch.float64
    stop_early = _stops_early(stop_early, device)
    pt = _PaddedTrees.build(trees, vocab, dtype, device)
    rows = torch.arange(len(trees), device=device)

    def try_children(cur, target, live, uniforms):
        kids = pt.children[rows, cur + 1]  # [B, W]
        leaf = kids[:, 0] < 0
        has_own = cur >= 0
        own = pt.draft_probs[rows, cur.clamp(min=0)] if pt.draft_probs.shape[1] else target
        residual = target
        tried = torch.zeros_like(target, dtype=torch.bool)
        accepted = torch.full_like(cur, -1)
        for k in range(kids.shape[1]):
            child = kids[:, k]
            trying = live & (child >= 0) & (accepted < 0)
            if stop_early and not bool(trying.any()):
                break
            c = child.clamp(min=0)
            tok = pt.tokens[rows, c]
            draft = rule.sibling_draft(pt.draft_probs[rows, c], tried, pt.without_replacement)
            det = pt.deterministic
            take = trying & (uniforms[k] < rule.accept_prob(residual, draft, tok, det))
            accepted = torch.where(take, child, accepted)
            reject = trying & ~take
            residual = torch.where(reject[:, None], rule.after_reject(residual, draft, tok, det), residual)
            tried = tried.scatter(1, tok[:, None], tried.gather(1, tok[:, None]) | reject[:, None])  # no read

        def final(idx):  # leaves draw the bonus token, nodes whose children were all rejected the recovered token
            at = slice(None) if idx is None else idx
            return torch.where(leaf[at, None], rule.bonus_dist(target[at], own[at], has_own[at]),
                               rule.recovered_dist(residual[at], target[at]))

        return accepted, leaf, final

    return _walk(trees, target_logits, sampling, generator, try_children, pt.children.shape[2], stop_early)


def _deterministic(trees: Sequence[DraftTree], target_logits: torch.Tensor, sampling: SamplingConfig,
                   generator: torch.Generator | None, stop_early: bool | None = None) -> list[Acceptance]:
    """The exact rule's walk for trees whose candidates were picked without sampling (EAGLE, n-gram, Medusa), on
    the target's probabilities gathered at the child tokens instead of vocabulary-wide residuals.

    It is the same law: after rejecting candidates of target probabilities ``p_1..p_k``, the residual is
    ``target_probs`` with them zeroed, so candidate ``k + 1`` is accepted with ``p_{k+1} / (1 - p_1 - .. - p_k)``
    (0 for a token already zeroed), and the recovered token is drawn from the zeroed row. It uses the walk's
    uniforms, so the tokens are the walk's up to float64 rounding; a rejection that would leave no mass keeps the
    row as it was, as the walk's ``_normalise`` does. Per level this does one vocabulary-wide softmax and one
    draw: the walk did ~8 vocabulary-wide float64 operations per candidate tried."""
    device, dtype = target_logits.device, torch.float64
    stop_early = _stops_early(stop_early, device)
    tokens, kid_nodes = _tree_tables(trees, device)  # kid_nodes [B, N + 1, W]: the k-th child of row r, -1 = none
    w = kid_nodes.shape[2]
    picked = tokens.gather(1, kid_nodes.clamp(min=0).flatten(1)).view_as(kid_nodes)
    kid_tokens = torch.where(kid_nodes >= 0, picked, -1)  # [B, N + 1, W] their tokens, -1 = none
    rows = torch.arange(len(trees), device=device)

    def try_children(cur, target, live, uniforms):
        kids, toks = kid_nodes[rows, cur + 1], kid_tokens[rows, cur + 1]  # [B, W]
        leaf = kids[:, 0] < 0
        p_kid = torch.where(kids < 0, 0.0, target.gather(1, toks.clamp(min=0)))  # [B, W]
        left = torch.ones(len(cur), dtype=dtype, device=device)  # [B] mass of the residual before normalising
        zeroed = torch.zeros(len(cur), w, dtype=torch.bool, device=device)  # [B, W] candidates zeroed in it
        accepted = torch.full_like(cur, -1)
        for k in range(w):
            trying = live & (kids[:, k] >= 0) & (accepted < 0)
            if stop_early and not bool(trying.any()):
                break
            gone = (zeroed & (toks == toks[:, k : k + 1])).any(-1)  # [B] an earlier sibling's token, zeroed
            p = torch.where(gone, 0.0, p_kid[:, k])
            take = trying & (uniforms[k] < p / left)
            accepted = torch.where(take, kids[:, k], accepted)
            removed = trying & ~take & (left - p > 1e-12 * left)  # else the residual stays as it was
            left = torch.where(removed, left - p, left)
            zeroed[:, k] = removed

        def final(idx):  # a leaf's bonus token from the target's probabilities, else the zeroed residual's
            at = slice(None) if idx is None else idx
            # min with 0 at the dropped tokens, with inf elsewhere (padding, kept): the same whatever the order in
            # which repeated tokens write their column
            zero_or_inf = torch.where(zeroed[at] & ~leaf[at, None], 0.0, float("inf")).to(dtype)
            return target[at].scatter_reduce(1, toks[at].clamp(min=0), zero_or_inf, reduce="amin")

        return accepted, leaf, final

    return _walk(trees, target_logits, sampling, generator, try_children, w, stop_early)


def rejection_sample(
    trees: Sequence[DraftTree],
    target_logits: torch.Tensor,  # [batch, max_nodes + 1, vocab]; row 0 = root, row 1 + i = node i
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
    rule: AcceptanceRule = EXACT,
) -> list[Acceptance]:
    if target_logits.dim() != 3 or target_logits.shape[0] != len(trees):
        raise ValueError(
            f"target_logits must be [batch={len(trees)}, max_nodes + 1, vocab], got {tuple(target_logits.shape)}"
        )
    if any(t.num_nodes + 1 > target_logits.shape[1] for t in trees):
        raise ValueError("target_logits has fewer rows than a tree has nodes + 1")
    _check_generator(generator, target_logits)
    if rule is EXACT and all(t.num_nodes == 0 for t in trees):  # plain steps: every token is the root's choice
        return plain_acceptances(plain_choices(target_logits[:, 0], sampling, generator).tolist())
    if sampling.greedy and rule is EXACT:
        return follow_choices(trees, choose_max(target_logits).tolist())
    if rule is EXACT and all(t.mode is DraftMode.DETERMINISTIC for t in trees):
        return _deterministic(trees, target_logits, sampling, generator)
    return _stochastic(trees, target_logits, sampling, generator, rule)


def plain_choices(root_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """[B, V] the roots' logits of a step with no draft -> [B] int64 on their device: each sequence's token, the
    argmax or a draw from the target's probabilities (the id V for a row with no law), as the walk would choose it
    (a leaf root's bonus distribution is the target's) without its vocabulary-wide bookkeeping. No host sync: a
    plain step queued ahead (specdec.decode_ahead) feeds them to the next one on the device."""
    _check_generator(generator, root_logits)
    if sampling.greedy:
        return choose_max(root_logits)
    return sample(logits_to_probs(root_logits.to(torch.float64), sampling), generator)  # [B, V] float64 -> [B]


def _check_generator(generator: torch.Generator | None, logits: torch.Tensor) -> None:
    if generator is not None and generator.device.type != logits.device.type:
        raise ValueError(
            f"the sampling generator is on {generator.device} but target_logits are on {logits.device}: "
            "create it with torch.Generator(device=...) on the model's device"
        )
