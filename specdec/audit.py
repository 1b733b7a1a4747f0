"""Draft audit: an anytime-valid test that a drafter samples from the draft_probs it reports.

Structural checks (``DraftTree.validate``) cannot see a drafter that draws its tokens from one distribution and
reports another, which breaks exactness silently. The engine passes every step's stochastic proposals to
:meth:`DraftAudit.observe_many` (on by default when sampling; ``generate(audit_drafts=False)`` turns it off),
which raises :class:`~specdec.tree.DraftError` naming the drafter once the evidence against it is overwhelming.

**Transform.** Each sampled node (token x, claimed row q; for without-replacement siblings, q with the earlier
siblings' tokens removed and renormalised) gives two randomised probability integral transforms, V uniform from
the audit's own generator (so the audit never changes the output):

* token order:       u = q(token < x) + V * q(x)
* probability order: u = q(token with q > q(x)) + V * q(token with q == q(x))

If x was drawn from q, each u is Uniform(0, 1) given everything before it.

**Test.** For each view and each resolution K in 2, 4, ..., 64 equal bins, a Krichevsky-Trofimov (add-1/2)
predictor bets on the bin of the next u: the factor ``K * (n_bin + 1/2) / (n + K/2)`` has expectation 1 under
the null, so each running product is a nonnegative martingale. The e-value is the mean of the 12 products, and by
Ville's inequality P(it ever reaches 1 / alpha) <= alpha over the whole run, checked after every draw;
alpha = 1e-6. Bins stop at 1/64 on purpose (float32 sampling cannot draw the tiniest tail tokens, an honest
artefact finer bins would flag). Power, resolution and cost, measured: docs/sampling.md.

The transforms are elementwise passes over [num_nodes, vocab] in draft_probs' device and dtype (float32 at least);
5 x num_nodes numbers travel to the host, on CUDA while the engine goes on (tested at the next step). Across calls,
:func:`call_audit` keeps one audit per drafter object for the life of the process: calls with the same instance
continue one test martingale (Ville's bound holds however the draws are split into calls; a liar whose calls are each
too short is caught over many). Only fresh draws join it: a call redrawing an earlier call's random numbers (the same
seed, torch's RNG reset to one state) adds no evidence and is audited alone (docs/draft-audit.md).
"""
from __future__ import annotations

import hashlib
import logging
import math
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from specdec.errors import InputError
from specdec.host_copy import to_device, to_host_later
from specdec.tree import DraftError, DraftMode, DraftTree

logger = logging.getLogger(__name__)
RESOLUTIONS = (2, 4, 8, 16, 32, 64)  # equal-width histogram bins of the KT bets, in each view
VIEWS = ("token order", "probability order")


class DraftAudit:
    """Sequential test of the claim "each draft token was drawn from its draft_probs row"."""

    def __init__(self, alpha: float = 1e-6, seed: int = 0, resolutions: tuple[int, ...] = RESOLUTIONS) -> None:
        if not 0 < alpha < 1 or not resolutions or min(resolutions) < 2:
            raise InputError(f"DraftAudit: alpha must be in (0, 1) and resolutions >= 2 bins, got alpha={alpha}, "
                             f"resolutions={resolutions}")
        self.alpha = alpha
        self.generator = torch.Generator().manual_seed(seed)
        self.draws = 0  # sampled nodes seen (the draw that raised the alarm included)
        # components: one KT bet per (view, resolution); their bins laid side by side in one counts vector
        parts = [(v, k) for v in range(len(VIEWS)) for k in resolutions]
        self._names = [f"{VIEWS[v]} PIT at {k} bins" for v, k in parts]
        self._view_of = [v for v, _ in parts]  # component -> column of u
        self._bins = torch.tensor([k for _, k in parts], dtype=torch.float64)  # [C]
        self._offsets = torch.cumsum(self._bins, 0) - self._bins  # [C] first column of each component
        self._counts = torch.zeros(int(self._bins.sum()), dtype=torch.float64)  # [sum of bins]
        self._log_e = torch.zeros(len(self._bins), dtype=torch.float64)  # [C] log of each product
        self._log_threshold = math.log(1 / alpha)
        self._waiting = None  # (host read of a step's [5, n] transforms, drafter, spans), on CUDA: settle()

    @property
    def e_value(self) -> float:
        """Current evidence against the drafter (mean of the component martingales; starts at 1)."""
        return math.exp(self._log_mean(self._log_e))

    @property
    def convicted(self) -> bool:
        """Whether the evidence has reached 1 / alpha (every later draw raises again)."""
        return self._log_mean(self._log_e) >= self._log_threshold

    def _log_mean(self, log_e: torch.Tensor) -> float | torch.Tensor:
        return torch.logsumexp(log_e, -1) - math.log(log_e.shape[-1])

    def observe(self, tree: DraftTree, drafter: str) -> None:
        """Audit one proposal; raise DraftError naming `drafter` when the e-value reaches 1 / alpha."""
        self.observe_many([tree], drafter)

    def observe_many(self, trees: list[DraftTree], drafter: str) -> None:
        """Audit one step's proposals. The sampled nodes of every independent-mode tree go through one batched
        transform (their rows need nothing from each other); a without-replacement tree, whose rows depend on
        their earlier siblings, goes alone. Under an honest drafter every u is uniform given all earlier ones,
        whatever the order they are fed in, so the grouping keeps the test valid. On CUDA the transforms reach the
        host without the step waiting for them: they are tested at the next call of this audit or at
        :meth:`settle` (the engine's end of a call), so an alarm may come one step later."""
        self.settle()
        sampled = [(b, t) for b, t in enumerate(trees) if t.mode is not DraftMode.DETERMINISTIC and t.num_nodes]
        independent = [(b, t) for b, t in sampled if t.mode is DraftMode.INDEPENDENT]
        parts = []  # [5, nodes] per group, on the draft_probs' device
        spans = [(b, t.num_nodes) for b, t in independent]  # (tree index in ``trees``, nodes) in column order
        if independent:
            device = independent[0][1].draft_probs.device
            probs = torch.cat([t.draft_probs.to(device) for _, t in independent])
            ids = [t.tokens for _, t in independent]
            tokens = (to_device(torch.cat(ids), torch.long, device) if all(not x.is_cuda for x in ids)
                      else torch.cat([to_device(x, torch.long, device) for x in ids]))
            parts.append(self._parts(probs, tokens, None))
        for b, t in sampled:
            if t.mode is DraftMode.WITHOUT_REPLACEMENT:
                parts.append(self._parts(t.draft_probs, t.tokens, t.parents))
                spans.append((b, t.num_nodes))
        if not parts:
            return
        parts = torch.cat([p.to(parts[0].device) for p in parts], 1)
        if _reads_later(parts):
            self._waiting = (to_host_later(parts), drafter, spans)
        else:
            self._test(parts, drafter, spans)

    def settle(self) -> None:
        """Test the transforms still on their way to the host (:meth:`observe_many`, on CUDA); raises as it does."""
        if self._waiting is None:
            return
        (read, drafter, spans), self._waiting = self._waiting, None
        self._test(read(), drafter, spans)

    def _test(self, parts: torch.Tensor, drafter: str, spans: list[tuple[int, int]]) -> None:
        """Feed a step's transforms ([5, n], read by the host) to the test; ``spans``: (tree index, nodes) of its
        columns in order, to name a node in an error."""
        self.update(self._randomise(*self._from_parts(parts, drafter, spans)), drafter)

    def intervals(self, tree: DraftTree, drafter: str = "drafter") -> tuple[torch.Tensor, torch.Tensor]:
        """(lo, width), each [num_nodes, 2] float64 on the host: node i's PIT is lo + V * width (columns = VIEWS)."""
        without_replacement = tree.mode is DraftMode.WITHOUT_REPLACEMENT
        parts = self._parts(tree.draft_probs, tree.tokens, tree.parents if without_replacement else None)
        return self._from_parts(parts.cpu(), drafter)

    def _parts(self, probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
        """[5, n] (mass below x in token order, q(x), mass above q(x), mass tied with it, total), in ``probs``'
        device and dtype (float32 at least), no read. ``probs`` [n, vocab], ``tokens`` [n]; ``parents`` [n] for a
        without-replacement tree (each row loses its earlier siblings' tokens), None for independent rows."""
        dev, n = probs.device, probs.shape[0]
        tokens = to_device(tokens, torch.long, dev)
        # Masked sums as dot products with exact signs s in {+1, 0, -1} (a float difference is 0 only when the two
        # are equal), in the rows' dtype, float32 at least: bool masks cost ~4x more on CPU, float64 rows 2x the
        # bytes. With A, B the mass strictly above / below q(x): sum(q * s) = A - B, sum(q * |s|) = A + B. Rounding
        # moves u by ~1e-7, far below the finest bin (1/64), and float32 sampling is no more precise than that.
        q = probs.detach().to(torch.promote_types(probs.dtype, torch.float32))  # [n, vocab]; a claim, not a graph
        if parents is not None:  # without replacement: row i loses its earlier siblings' tokens before any sum
            # (subtracting their mass from the row's sums cancelled: a first sibling holding all but 1e-6 of the row
            # left the second's interval ~10% off in float32, and an honest drafter was convicted)
            parents = to_device(parents, torch.long, dev)
            earlier = (parents[:, None] == parents[None, :]) & torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)
            taken = torch.zeros_like(q).scatter_add_(1, tokens[None, :].expand(n, n), earlier.to(q.dtype))  # [n, V]
            q = q.masked_fill(taken > 0, 0.0)
        drawn = q.gather(1, tokens[:, None])  # [n, 1] q_i(x_i)
        total = q.sum(-1)
        sign = torch.sub(q, drawn).sign_()
        above_minus_below = torch.linalg.vecdot(q, sign)
        above_plus_below = torch.linalg.vecdot(q, sign.abs_())
        higher, tied = (above_plus_below + above_minus_below) / 2, total - above_plus_below
        ids = torch.arange(q.shape[1], device=dev, dtype=q.dtype)
        torch.sub(tokens[:, None].to(q.dtype) - 0.5, ids, out=sign).sign_()  # +1 before x in token order, else -1
        below = (total + torch.linalg.vecdot(q, sign)) / 2
        drawn = drawn.squeeze(1)
        return torch.stack([below, drawn, higher, tied, total])

    @staticmethod
    def _from_parts(parts: torch.Tensor, drafter: str, spans: list[tuple[int, int]] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_parts`' [5, n] read by the host -> (lo, width), each [n, 2] float64; ``spans``: (tree index in
        the step, nodes) of the columns in order, None for one tree's columns (its nodes)."""
        below, drawn, higher, tied, total = parts.double().unbind()
        if bool((total <= 0).any()):
            node = int((total <= 0).nonzero()[0])
            where = f"node {node}"
            for tree, nodes in spans or ():
                if node < nodes:
                    where = f"node {node} of the step's tree {tree}"
                    break
                node -= nodes
            raise DraftError(f"{drafter}: {where} was drawn where draft_probs left it no mass (its row is all zero, or "
                             "its earlier siblings, drawn without replacement, took it all)")
        return torch.stack([below, higher], -1) / total[:, None], torch.stack([drawn, tied], -1) / total[:, None]

    def _randomise(self, lo: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
        v = torch.rand(lo.shape[0], 1, generator=self.generator, dtype=torch.float64)  # one V for both views
        return (lo + v * width).clamp_(0.0, 1.0)

    def update(self, u: torch.Tensor, drafter: str = "drafter") -> None:
        """Feed PIT values u [m, 2] (one row per draw, columns = VIEWS) in draw order; alarm at 1 / alpha."""
        u = torch.as_tensor(u, dtype=torch.float64).reshape(-1, len(VIEWS))
        m = u.shape[0]
        if m == 0:
            return
        # column of each draw's bin in the side-by-side counts, per component: [m, C]
        bins = (u[:, self._view_of] * self._bins).floor().clamp_(max=self._bins - 1)
        cols = (bins + self._offsets).long()
        # how many earlier draws of this batch hit the same column: rank within a stable sort by column
        flat = cols.flatten()  # draw-major, so a stable sort keeps draw order within a column
        order = torch.sort(flat, stable=True).indices
        _, runs = torch.unique_consecutive(flat[order], return_counts=True)
        starts = torch.repeat_interleave(torch.cumsum(runs, 0) - runs, runs)
        rank = torch.empty_like(flat).scatter_(0, order, torch.arange(flat.numel()) - starts).view_as(cols)
        seen = (self.draws + torch.arange(m, dtype=torch.float64))[:, None]  # [m, 1] draws before each
        hits = self._counts[cols] + rank  # [m, C] bin count before each draw
        # KT bet: predicted bin probability / bin width; mean exactly 1 under H0, given the past
        factor = self._bins * (hits + 0.5) / (seen + self._bins / 2)  # [m, C]
        log_e = self._log_e + torch.cumsum(factor.log(), 0)  # [m, C]
        crossed = (self._log_mean(log_e) >= self._log_threshold).nonzero()
        last = int(crossed[0]) if crossed.numel() else m - 1
        self._counts.index_add_(0, cols[: last + 1].flatten(), torch.ones((last + 1) * cols.shape[1],
                                                                          dtype=torch.float64))
        self._log_e = log_e[last]
        self.draws += last + 1
        if crossed.numel():
            best = self._names[int(self._log_e.argmax())]
            raise DraftError(
                f"{drafter}: its draft tokens were not drawn from the draft_probs it reported (audit: e-value "
                f"{self.e_value:.3g} >= 1/alpha = {1 / self.alpha:.0e} after {self.draws} sampled draft nodes, "
                f"strongest in the {best}); speculative sampling would not be exact with this "
                "drafter (generate(audit_drafts=False) turns the audit off)"
            )


def _reads_later(parts: torch.Tensor) -> bool:
    """Whether a step's transforms are tested at the audit's next use rather than now: on CUDA, where reading them
    now would make the host wait for the device."""
    return parts.is_cuda


MAX_SOURCES = 1 << 16  # draw sources remembered per drafter object; calls beyond them are audited on their own


@dataclass
class _Kept:
    """A drafter object's audit across calls and the draw sources (Drafter.draw_source) already fed to it."""

    audit: DraftAudit = field(default_factory=DraftAudit)
    sources: set = field(default_factory=set)


_AUDITS: dict[int, _Kept] = {}  # id(drafter object) -> its audit, dropped when the object is collected


def _kept(drafter: object) -> _Kept | None:
    """The process-wide record of ``drafter`` (identity, never equality); None for an object that cannot be weakly
    referenced (keeping it alive to remember it would leak the drafter)."""
    key = id(drafter)
    if key in _AUDITS:
        return _AUDITS[key]
    kept = _Kept()
    try:
        weakref.finalize(drafter, _AUDITS.pop, key, None)
    except TypeError:
        logger.debug("%s cannot be weakly referenced: its draft audit starts afresh in every call",
                     type(drafter).__name__)
        return None
    _AUDITS[key] = kept
    return kept


def audit_of(drafter: object) -> DraftAudit:
    """The process-wide audit of ``drafter`` (the object the caller passed): the evidence of every call with it whose
    draws were fresh (:func:`call_audit`)."""
    kept = _kept(drafter)
    return kept.audit if kept is not None else DraftAudit()


def call_audit(drafter: object, source: Hashable | None) -> DraftAudit:
    """The audit of one generate() call with ``drafter``, whose random draws are a function of ``source``
    (``Drafter.draw_source``; None: torch's global RNG, identified by its state now): the process-wide one when
    ``source`` is new for this object, else a fresh audit of this call alone. A repeated source redraws an earlier
    call's random numbers; adding them again would count the same evidence twice, and an honest drafter reused with
    one seed was convicted at its third call. A convicted drafter stays convicted."""
    kept = _kept(drafter)
    if kept is None:
        return DraftAudit()
    if kept.audit.convicted:
        return kept.audit
    if source is None:
        source = ("torch rng", _global_rng_state())
    if source in kept.sources or len(kept.sources) >= MAX_SOURCES:
        logger.debug("this call's draft randomness was seen before (or too many were): audited on its own")
        return DraftAudit()
    kept.sources.add(source)
    return kept.audit


def _global_rng_state() -> bytes:
    """A digest of torch's default generators' states (CPU, and CUDA once initialised): what unseeded draws use."""
    digest = hashlib.blake2b(torch.random.get_rng_state().numpy().tobytes(), digest_size=16)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for state in torch.cuda.get_rng_state_all():
            digest.update(state.numpy().tobytes())
    return digest.digest()
