"""Engine: one speculative step for a batch of sequences over the paged KV cache.

    engine = Engine(runner, cache, sampling=sampling, stop=stop, drafter=drafter, policy=policy)
    engine.add(prompts)            # prefill: K/V of prompt[:-1] (run once for equal ones); prompt[-1] is the first root
    while engine.live: engine.step()   # propose -> verify -> accept -> commit

Invariant between steps: for a live sequence, ``token_ids[-1]`` is the *root* (committed but
not yet run through the target) and the cache holds K/V of ``token_ids[:-1]``. Plain decoding
is the empty draft tree: the same verify / sample / commit path with one query token.

The :class:`~specdec.speculation_policy.SpeculationPolicy` decides who drafts and how much of each proposal is
verified (``speculation="auto"``, the default of generate(): the break-even guard and tree sizing by the measured
cost model); the acceptor (rejection or coupled sampling) is chosen once, when the engine is built.

On a GPU a drafter's trees may stay on the device until the verify is launched (:mod:`specdec.pending_trees`): the
step reads them after :meth:`Engine.verify`, where the policy expects to verify them whole. Plain decoding through
CUDA-graph buckets queues each step before reading the one before it (:mod:`specdec.decode_ahead`), as do the
steps where the guard holds every sequence off, for a drafter that reads no hidden rows.

Logits processors (repetition penalty, min_new_tokens, ...: :mod:`specdec.logits_processing`) are applied to the
target's logits of every verify row with that row's own prefix before the walk (:meth:`Engine.process`); with
``output_logprobs`` each committed token's log-probability is kept (:mod:`specdec.logprobs`). Neither costs
anything when not asked for.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from specdec.attention import BatchBuilder, ForwardBatch
from specdec.audit import DraftAudit
from specdec.coupling import Coupling, coupled_sample, sequence_keys
from specdec.cuda_graphs import GraphedForward, captures
from specdec.decode_ahead import DecodeAhead
from specdec.drafters.base import Drafter, SequenceView, TargetView, TokenView, as_drafter
from specdec.host_copy import to_device
from specdec.kv_cache import CacheFullError, PagedKVCache
from specdec.logits_processing import LogitsProcessing
from specdec.logprobs import committed_rows, token_logprobs
from specdec.models.llama import ForwardOutput, LlamaRunner
from specdec.pending_trees import NodeRows, PendingTrees
from specdec.rejection import EXACT, Acceptance, AcceptanceRule, rejection_sample
from specdec.sampling import SamplingConfig, check_chosen
from specdec.speculation_policy import ProposeCall, SpeculationPolicy, StepRecord
from specdec.stopping import StopCriteria
from specdec.tree import DraftError, DraftTree, proposed_trees, validate_trees

logger = logging.getLogger(__name__)


@dataclass
class SequenceState:
    """One sequence of a call, as the engine keeps it between steps: its tokens (the invariant of the module
    docstring), what it counted for the output's stats, and the drafter's hidden rows not yet seen."""

    seq_id: int
    token_ids: list[int]  # prompt + committed tokens; token_ids[-1] is the root of the next step
    num_prompt_tokens: int
    finish_reason: str | None = None  # "eos" | "stop" | "length" once finished
    steps: int = 0  # target forward passes (verify steps) spent on this sequence
    depth_tried: list[int] = field(default_factory=list)  # per depth d+1: steps that tried a child
    depth_accepted: list[int] = field(default_factory=list)  # per depth d+1: steps that accepted one
    step_lengths: list[int] = field(default_factory=list)  # tokens committed by each step
    step_nodes: list[int] = field(default_factory=list)  # draft nodes each step verified (after sizing)
    finished_at: float | None = None  # time.perf_counter() when it finished
    # the target's final-norm hidden states (or a drafter's feature layers) of the positions committed since the
    # drafter last saw them, ending at token_ids[-2], a [k_i, hidden_size] chunk per prefill or step (kept only for
    # drafters that ask): steps the guard decodes plainly add chunks, joined only when the drafter is asked
    hidden_chunks: list[torch.Tensor] = field(default_factory=list)
    hidden_seen: bool = False  # the chunks reached the drafter (else the next step's rows are added to them)
    proposals: int = 0  # propose calls that included this sequence
    noise_key: int = 0  # coupled sampling: the sequence's key (specdec.coupling.sequence_keys)
    logprobs: list[float] = field(default_factory=list)  # per new token, with output_logprobs (specdec.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def new_hidden(self) -> torch.Tensor | None:
        """[k, hidden_size] the hidden states the drafter has not seen (SequenceView.new_hidden); None for a one-token
        prompt's first step."""
        if len(self.hidden_chunks) > 1:
            self.hidden_chunks = [torch.cat(self.hidden_chunks)]
        return self.hidden_chunks[0] if self.hidden_chunks else None

    @property
    def new_tokens(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_new_tokens(self) -> int:  # len(new_tokens), without copying them
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def tau(self) -> float:
        """Committed tokens per target forward (mean accepted length + 1)."""
        return self.num_new_tokens / self.steps if self.steps else 0.0


def prefill_groups(seqs: Sequence[SequenceState]) -> list[list[SequenceState]]:
    """``seqs`` grouped by the tokens their prefill runs (the prompt but its last token), in order of first
    occurrence, each group in batch order: the prefill runs the first of each group and copies its K/V and hidden
    rows into the others (PagedKVCache.copy_prefix), which then hold bit for bit what it holds."""
    groups: dict[tuple[int, ...], list[SequenceState]] = {}
    for s in seqs:
        groups.setdefault(tuple(s.token_ids[:-1]), []).append(s)
    return list(groups.values())


@dataclass(frozen=True)
class VerifyBatch(ForwardBatch):
    """One verify forward: the root and tree nodes of every live sequence, flattened into T rows."""

    # pending trees' nodes, whose tokens, positions and ancestor bits the device writes (the host's are placeholders)
    nodes: NodeRows | None = None

    @classmethod
    def of(cls, batch: ForwardBatch, nodes: NodeRows | None = None) -> "VerifyBatch":
        return cls(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}, nodes=nodes)

    @cached_property
    def row_index(self) -> torch.Tensor:  # [B, max_nodes + 1] rows of T per sequence (padding repeats its first row)
        width = max(len(r) for r in self.rows)
        rows = [list(r) + [r[0]] * (width - len(r)) for r in self.rows]
        return to_device(rows, torch.long, self.device)

    def per_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, max_nodes + 1, ...] (``x[row_index]``): a view where every sequence has as many rows
        (plain decoding: rows are added in order, so sequence b's are b * width ...), with no index copied over."""
        width = max(len(r) for r in self.rows)
        if all(len(r) == width for r in self.rows):
            return x.reshape(len(self.rows), width, *x.shape[1:])
        return x[self.row_index]


@dataclass(frozen=True)
class PendingStep:
    """A step's proposal left on the device (specdec.pending_trees), from the sequences the guard asked."""

    trees: PendingTrees  # one per asked sequence
    asked: list[SequenceState]  # in batch order
    catch_up: bool  # the call included a sequence's first

    def num_nodes(self, live: list[SequenceState]) -> list[int]:
        """Per live sequence: its pending tree's nodes, 0 where it was not asked."""
        by_id = {s.seq_id: n for s, n in zip(self.asked, self.trees.num_nodes, strict=True)}
        return [by_id.get(s.seq_id, 0) for s in live]


class Engine:
    """A batch of sequences decoded over one paged KV cache (module docstring): :meth:`add` prefills, each
    :meth:`step` proposes, verifies, accepts and commits; every decision fixed for the run (the acceptor, whether
    hidden rows are kept, pending trees, queued plain steps) is made in ``__init__``."""

    def __init__(
        self,
        runner: LlamaRunner,
        cache: PagedKVCache,
        *,
        sampling: SamplingConfig,
        stop: StopCriteria,
        drafter: Drafter | None = None,
        policy: SpeculationPolicy | None = None,
        generator: torch.Generator | None = None,
        draft_seed: int | None = None,
        audit: DraftAudit | None = None,
        rule: AcceptanceRule = EXACT,
        graphed: GraphedForward | None = None,
        coupling: Coupling | None = None,
        processing: LogitsProcessing | None = None,
        output_logprobs: bool = False,
        fit_free_blocks: bool = False,
        queue_ahead: bool = True,
    ) -> None:
        self.runner, self.cache, self.sampling, self.stop = runner, cache, sampling, stop
        self.drafter, self.generator, self.audit = as_drafter(drafter), generator, audit
        self.rule = rule  # EXACT unless a certificate runs a deliberately broken negative control
        self.graphed = graphed  # fixed-shape (CUDA-graph) verify forwards; None = always eager
        # coupled sampling: tokens are Gumbel-max choices keyed by (seed, sequence, position); None = rejection
        self.coupling = coupling if not sampling.greedy else None
        self.processing = processing  # logits processors at every tree row with its own prefix; None = none
        self.output_logprobs = output_logprobs  # keep each committed token's log-probability (SequenceState)
        # the KV pool may not hold every tree (an explicit num_blocks below the request's worst case): each tree is cut
        # to the blocks free for its sequence before the verify (Engine._kv_rooms)
        self.fit_free_blocks = fit_free_blocks
        self.seqs: list[SequenceState] = []
        self.forward_passes = 0
        self.seconds = {"draft": 0.0, "verify": 0.0}  # wall time of the two halves of step(), summed
        self.keep_hidden = self.drafter is not None and self.drafter.needs_hidden_states
        # who drafts and how much is verified (None: every proposal whole); it attaches the drafter
        seeded_sampling = not sampling.greedy and self.coupling is None and generator is not None
        target = TargetView(runner, cache, sampling, stop.tokenizer, self.coupling, processing, seed=draft_seed,
                            seeded_sampling=seeded_sampling, graphs=graphed is not None and graphed.config.capture)
        self.policy = (policy or SpeculationPolicy()).start(self.drafter, target)
        # EAGLE-3: the drafter's rows are these layers' streams
        self.feature_layers: tuple[int, ...] = () if self.drafter is None else tuple(self.drafter.feature_layers)
        # a sequence's first propose call catches the drafter up on its whole prompt: a one-off, no step's cost
        self.catches_up = self.drafter is not None and self.drafter.catches_up
        # the drafter's trees may stay on the device until the verify is launched (specdec.pending_trees), on steps
        # whose trees the policy expects to verify whole: the verify runs through CUDA-graph buckets (whose inputs the
        # device can write)
        self.pending = self.drafter is not None and self.drafter.pending_trees and graphed is not None
        # on CUDA the device drafts pending trees after propose() returns, ahead of the verify on its stream
        self.drafts_during_verify = self.pending and runner.device.type == "cuda"
        # plain decoding (greedy or standard sampling; no drafter, or one the policy never asks) through CUDA-graph
        # buckets, where the host need not see a step's logits: each step is queued before the host reads the one
        # before it (specdec.decode_ahead)
        plain = (self.drafter is None or self.policy.plain) and self.coupling is None and rule is EXACT
        # ... and, with a drafter the break-even guard may hold off, the steps where it holds off every sequence,
        # where the drafter reads no hidden rows (a queued step keeps none)
        guarded = (not plain and self.policy.sizer is not None and not self.keep_hidden and self.coupling is None
                   and rule is EXACT)
        queues = queue_ahead and graphed is not None and processing is None and not output_logprobs
        self.ahead = DecodeAhead(self, guarded) if queues and (plain or guarded) else None
        if self.ahead is not None and guarded:  # the guard prices drafts against a queued step (plain_price)
            self.policy.sizer.queues_held_off = True

    @property
    def live(self) -> list[SequenceState]:
        return [s for s in self.seqs if not s.finished]

    # ---- prefill ------------------------------------------------------------------------
    def add(self, prompts: Sequence[Sequence[int]]) -> list[SequenceState]:
        keys = sequence_keys(prompts)  # coupled sampling: the same prompt has the same noise alone or in a batch
        new = [SequenceState(len(self.seqs) + i, list(p), len(p), noise_key=key)
               for i, (p, key) in enumerate(zip(prompts, keys, strict=True))]
        for s in new:
            self.cache.add(s.seq_id)
        self.seqs.extend(new)
        todo = [s for s in new if len(s.token_ids) > 1]
        self.cache.reserve_many({s.seq_id: len(s.token_ids) - 1 for s in todo})
        if todo:
            # identical prompts run once, in their first copy; the others get its K/V and hidden rows (copied)
            groups = prefill_groups(todo)
            firsts = [first for first, *_ in groups]
            chunk = None if self.graphed is None else self.graphed.prefill_chunk([len(s.token_ids) - 1 for s in firsts])
            hidden = self._prefill(firsts, chunk)
            for (first, *copies), rows in zip(groups, hidden, strict=True):
                self.cache.copy_prefix(first.seq_id, [s.seq_id for s in copies], len(first.token_ids) - 1)
                if self.keep_hidden:  # each sequence owns its rows
                    first.hidden_chunks = rows
                    for s in copies:
                        s.hidden_chunks = [r.clone() for r in rows]
            self.cache.commit({s.seq_id: range(len(s.token_ids) - 1) for s in todo})
        return new

    def _prefill(self, firsts: list[SequenceState], chunk: int | None) -> list[list[torch.Tensor]]:
        """Every prompt but its last token, a causal run each (no n x n mask is built): one eager forward, or with
        ``chunk`` (GraphedForward.prefill_chunk) a replay per ``chunk`` rows of every sequence through the CUDA-graph
        buckets, each chunk after the ones before it (its keys written by them), the LM head left out. Per sequence
        the drafter's rows of each forward (hidden states of every prompt row but the root: Medusa starts from the
        last, EAGLE reads them all), none unless it keeps them."""
        lengths = [len(s.token_ids) - 1 for s in firsts]
        size = chunk or max(lengths)
        parts: list[list[torch.Tensor]] = [[] for _ in firsts]
        for start in range(0, max(lengths), size):
            builder = BatchBuilder(self.cache, self.runner.device)
            running = [i for i, n in enumerate(lengths) if n > start]
            for i in running:
                end = min(start + size, lengths[i])
                builder.add(firsts[i].seq_id, firsts[i].token_ids[start:end], range(start, end), num_keys=end,
                            num_visible=start)
            batch = builder.build()
            if chunk is None:
                rows = torch.arange(batch.token_ids.numel(), device=batch.token_ids.device)
                out = self.runner.forward(batch.token_ids, batch.positions, batch.plan, self.cache,
                                          rows if self.keep_hidden else None, with_logits=False,
                                          feature_layers=self.feature_layers)
            else:
                out = self.graphed(batch, feature_layers=self.feature_layers, with_logits=False, prefill=True)
            if self.keep_hidden:  # copies: a bucket's output is overwritten by its next replay
                for i, r in zip(running, batch.rows, strict=True):
                    parts[i].append(self.drafter_rows(out)[list(r)])
        return parts

    # ---- one step -----------------------------------------------------------------------
    def step(self) -> dict[int, list[int]]:
        """Propose, verify, accept, commit. Returns the tokens emitted per seq_id this step."""
        live = self.live
        if self.ahead is not None and self.ahead.runs(live):  # a plain step, the next queued before it is read
            return self.ahead.step()
        t0 = time.perf_counter()
        drafts = self.propose(live)  # DraftTrees, or a PendingStep: trees left on the device
        t1 = time.perf_counter()
        captured = captures()
        batch = self.verify_batch(live, drafts)
        out = self.verify(batch)
        trees, audited = self.read(live, drafts)  # pending trees: read (and audited) while the device verifies
        target_logits = self.process(live, trees, batch.per_sequence(out.logits))
        acceptances = self.accept(live, trees, target_logits)
        if self.keep_hidden:
            self.keep_new_hidden(live, acceptances, batch.per_sequence(self.drafter_rows(out)))
        emitted = self.commit(live, acceptances)
        if self.output_logprobs:
            self.record_logprobs(live, acceptances, target_logits, emitted)
        for s, tree in zip(live, trees, strict=True):
            s.step_nodes.append(tree.num_nodes)
        t2 = time.perf_counter()
        drafting = self.drafting_after(t1, t2, drafts) + audited  # pending trees' drafting and audit inside t1..t2
        self.seconds["draft"] += t1 - t0 + drafting
        self.seconds["verify"] += t2 - t1 - drafting  # verify forward + sampling + commit
        # a verify that captured a CUDA graph paid a one-off: its time prices no step
        timed = t2 - t1 - drafting if captures() == captured else None
        self.policy.observe(StepRecord(live, acceptances, emitted, timed, 1 + max(t.num_nodes for t in trees)))
        return emitted

    def finish(self) -> None:
        """The end of a call: the draft audit tests what the last step left on its way to the host (on CUDA)."""
        if self.audit is not None:
            self.audit.settle()

    def close(self, failed: bool = True) -> None:
        """The end of a call however it ended (run()'s ``finally``; ``failed``: by an exception): sequences a raised
        call left live are freed and released from the drafter (which would meet their ids again in the next call);
        a KV cache of this call alone frees its storage now (a drafter reused across calls holds this call's view of
        it); a shared graph cache is left to the next call; the drafter then drops what it keeps of the call
        (``Drafter.detach``). A drafter whose ``release`` or ``detach`` raises after a failed call is logged, never
        raised over the call's own error; a ``detach`` raising after a call that succeeded is raised. Every
        sequence is still freed and the streamer still ended."""
        for s in self.live:
            if s.seq_id in self.cache.block_tables:
                self.cache.free(s.seq_id)
            if self.drafter is not None:
                try:
                    self.drafter.release(s.seq_id)
                except Exception:  # noqa: BLE001 - the call already failed; its error is the one to raise
                    logger.warning("the drafter's release(%d) raised while the call ended", s.seq_id, exc_info=True)
        if self.graphed is None or not self.graphed.shared:
            self.cache.discard()
        self.ahead = None  # it holds this engine: a cycle that kept the call's target until a full collection
        if self.drafter is not None:
            try:
                self.drafter.detach()
            except Exception:  # noqa: BLE001 - as release's: a failed call's own error stands
                if not failed:
                    raise
                logger.warning("the drafter's detach() raised while the call ended", exc_info=True)

    def propose(self, live: list[SequenceState]) -> list[DraftTree] | PendingStep:
        if self.drafter is None:
            return [DraftTree.empty() for _ in live]
        asked = self.policy.who_drafts(live)
        if not asked:  # the guard decodes every sequence plainly this step: the drafter is not asked
            return [DraftTree.empty() for _ in live]
        try:
            return self._draft(live, asked)
        except CacheFullError:
            if not self.fit_free_blocks:
                raise
            # an explicit pool had no room for the drafter's own K/V (self-draft drafts in this cache): this step
            # decodes plainly, as the pool's block counts decide (never a token drawn), so exactly
            logger.debug("no KV blocks free for drafting: a plain step")
            return [DraftTree.empty() for _ in live]

    def _draft(self, live: list[SequenceState], asked: list[SequenceState]) -> list[DraftTree] | PendingStep:
        """The asked sequences' proposals, sized by the policy (propose())."""
        # a one-off, not a step's cost: a sequence's first call (catches_up); a call that captured a CUDA graph paid
        # for the capture
        catch_up = self.catches_up and any(s.proposals == 0 for s in asked)
        captured = captures()
        if self.pending and self.policy.verifies_whole:
            trees = self.drafter.propose_pending(self._views(asked))
            step = PendingStep(trees, asked, catch_up or captures() > captured)
            if self._verifiable(live, step):
                return step
            # near a sequence's token budget, or beyond every bucket: read first, as from propose()
            trees, seconds = self._read(step)
            return self._spread(live, asked, self._sized(asked, trees, seconds + self._audited(trees), step.catch_up))
        views = self._views(asked)
        t0 = time.perf_counter()
        trees = self._checked(asked, lambda: self.drafter.propose(views))
        seconds = time.perf_counter() - t0 + self._audited(trees)
        return self._spread(live, asked, self._sized(asked, trees, seconds, catch_up or captures() > captured))

    @staticmethod
    def _spread(live: list[SequenceState], asked: list[SequenceState], trees: list[DraftTree]) -> list[DraftTree]:
        """The asked sequences' trees in the batch, the empty tree for the others."""
        if len(asked) == len(live):
            return trees
        by_id = {s.seq_id: t for s, t in zip(asked, trees, strict=True)}
        return [by_id.get(s.seq_id, DraftTree.empty()) for s in live]

    def _views(self, asked: list[SequenceState]) -> list[SequenceView]:
        """What the drafter sees of each sequence; they are marked as asked."""
        for s in asked:
            s.hidden_seen = True
            s.proposals += 1
        return [SequenceView(s.seq_id, TokenView(s.token_ids), s.num_prompt_tokens, s.new_hidden, s.noise_key,
                             self._depth_budget(s)) for s in asked]

    def look_back(self, live: list[SequenceState]) -> None:
        """Ask the drafter in hindsight for the held-off sequences the policy names (a queued step's, while the device
        runs the next one; specdec.decode_ahead): their trees are never verified, only judged by the text that
        follows, so that the guard sees the text turn (specdec.tree_sizing, Looks)."""
        seqs = self.policy.who_looks_back(live)
        if not seqs:
            return
        views = [SequenceView(s.seq_id, TokenView(s.token_ids), s.num_prompt_tokens, None, s.noise_key) for s in seqs]
        t0 = time.perf_counter()
        trees = self._checked(seqs, lambda: self.drafter.propose(views))
        seconds = time.perf_counter() - t0
        self.seconds["draft"] += seconds
        self.policy.looked_back(seqs, trees, seconds, len(live))

    def _sized(self, asked: list[SequenceState], trees: list[DraftTree], draft_seconds: float, catch_up: bool,
               verified: bool = False) -> list[DraftTree]:
        """The part of each proposed tree to verify: cut to the sequence's token budget and to the KV blocks it may
        take (:meth:`_kv_rooms`: the nodes before the first it has no room for), then to what is expected to pay
        (pruning is exact). ``verified``: pending trees already verified whole, sized to learn from.
        ``draft_seconds``: the drafter's, its trees' audit included (:meth:`_audited`)."""
        out = [self._fit_budget(s, tree) for s, tree in zip(asked, trees, strict=True)]
        rooms = None if verified else self._kv_rooms(asked)  # verified trees fitted the blocks (_verifiable)
        if rooms is not None:
            out = [tree.subtree(list(range(room))) if tree.num_nodes > room else tree
                   for tree, room in zip(out, rooms, strict=True)]
        return self.policy.size(ProposeCall([s.seq_id for s in asked], out, len(self.live), draft_seconds, catch_up,
                                            verified))

    def _audited(self, trees: list[DraftTree]) -> float:
        """The draft audit of every tree as proposed, before pruning; its seconds, which the policy prices as
        drafting (0 without an audit)."""
        if self.audit is None:
            return 0.0
        t0 = time.perf_counter()
        self.audit.observe_many(trees, self.drafter.name)
        return time.perf_counter() - t0

    def _checked(self, asked: list[SequenceState], propose) -> list[DraftTree]:
        """``propose()``'s trees, one valid DraftTree per sequence, or a DraftError that names the drafter."""
        name = self.drafter.name
        trees = proposed_trees(name, len(asked), propose)
        return validate_trees(trees, self.runner.shape.vocab_size, drafter=name)  # one read of the device for all

    def _verifiable(self, live: list[SequenceState], step: PendingStep) -> bool:
        """Whether pending trees can be verified before they are read: whole (every sequence has the tokens left
        for their depth, and the KV blocks for its nodes) and through a CUDA-graph bucket."""
        longest = 1 + max(step.trees.num_nodes)
        rooms = self._kv_rooms(step.asked)
        return (all(self._depth_budget(s) >= step.trees.max_depth for s in step.asked)
                and (rooms is None or all(n <= room for n, room in zip(step.trees.num_nodes, rooms, strict=True)))
                and self.graphed.fits(len(live), longest, max(len(s.token_ids) for s in live) + longest - 1))

    def _kv_rooms(self, asked: list[SequenceState]) -> list[int] | None:
        """Per asked sequence, the most tree nodes the KV pool holds for it in this step's verify: its own blocks'
        room, and an equal share of the free blocks among the asked (PagedKVCache.room). From block counts before the
        verify, never from a token drawn, so the cut is exact as the depth cut is (a tree's nodes come parents
        first: its first nodes are a tree). None: the pool holds every tree (fit_free_blocks off); 0 where even the
        roots do not fit (the verify's reservation raises CacheFullError, as plain decoding's would)."""
        if not self.fit_free_blocks:
            return None
        room = self.cache.room([s.seq_id for s in self.live], {s.seq_id for s in asked})
        return [room[s.seq_id] - 1 for s in asked]  # the root takes one position

    def _read(self, step: PendingStep) -> tuple[list[DraftTree], float]:
        """Pending trees read by the host (checked as propose()'s are), node for node the ones on the device, and the
        drafting's seconds."""
        trees = self._checked(step.asked, step.trees.read)
        if [t.num_nodes for t in trees] != list(step.trees.num_nodes):
            raise DraftError(f"{self.drafter.name}: its pending trees have {list(step.trees.num_nodes)} nodes, the "
                             f"trees read {[t.num_nodes for t in trees]}")
        return trees, step.trees.seconds()

    def read(self, live: list[SequenceState], drafts: list[DraftTree] | PendingStep) -> tuple[list[DraftTree], float]:
        """The trees the verify holds: pending trees read by the host once the verify is launched, whole (the
        policy's sizing sees them as it would have before the verify: what it would have cut is learned, and the
        next step reads its trees first); host trees as they are. With the seconds of the pending trees' audit, which
        ran inside the verify's wall time."""
        if not isinstance(drafts, PendingStep):
            return drafts, 0.0
        trees, seconds = self._read(drafts)
        audited = self._audited(trees)
        sized = self._sized(drafts.asked, trees, seconds + audited, drafts.catch_up, True)
        return self._spread(live, drafts.asked, sized), audited

    def _fit_budget(self, s: SequenceState, tree: DraftTree) -> DraftTree:
        """Drop nodes deeper than the tokens still allowed (max_new_tokens, context)."""
        max_depth = self._depth_budget(s)
        if tree.num_nodes and tree.max_depth > max_depth:
            return tree.prune(tree.depths <= max(max_depth, 0))
        return tree

    def drafting_after(self, t1: float, t2: float, drafts: list[DraftTree] | PendingStep) -> float:
        """Seconds of pending trees' drafting that the device ran after ``t1``, so inside the verify's wall time
        ``t2 - t1`` (its price would otherwise count the drafting twice, as verify and as draft): on CUDA, from
        ``t1`` to the drafting's end, its device seconds after its clock's start (the device is idle when a step
        begins), at most half the span; 0 where the drafting ended before ``t1`` (trees read in propose(), or the
        CPU's)."""
        if not (self.drafts_during_verify and isinstance(drafts, PendingStep)):
            return 0.0
        pending = drafts.trees
        return min(max(pending.started_at + pending.seconds() - t1, 0.0), (t2 - t1) / 2)

    def _depth_budget(self, s: SequenceState) -> int:
        """The deepest node worth verifying for ``s``: its tokens still allowed (max_new_tokens, context) but one."""
        root_position = len(s.token_ids) - 1
        return min(self.stop.max_new_tokens - s.num_new_tokens - 1, self.runner.shape.max_positions - 1 - root_position)

    def verify_batch(self, live: list[SequenceState], drafts: list[DraftTree] | PendingStep) -> VerifyBatch:
        """Root + tree nodes of every live sequence: the cached prefix and the root are visible to every
        row, the nodes by their ancestor bits (the root's row sees none of them). Pending trees' nodes get
        placeholders here, and their values on the device (``VerifyBatch.nodes``)."""
        pending = drafts.trees if isinstance(drafts, PendingStep) else None
        sizes = drafts.num_nodes(live) if pending is not None else [t.num_nodes for t in drafts]
        self.cache.reserve_many({s.seq_id: 1 + n for s, n in zip(live, sizes, strict=True)})
        builder = BatchBuilder(self.cache, self.runner.device)
        # every tree's [1 + num_nodes] ancestor bits (the root's row sees no node) from one host tensor
        flat = ([0] * sum(1 + n for n in sizes if n) if pending is not None else
                [b for t in drafts if t.num_nodes for b in (0, *t.ancestor_bit_list)])
        bits = iter(torch.tensor(flat, dtype=torch.long).split_with_sizes([1 + n for n in sizes if n]) if flat else ())
        for b, (s, n) in enumerate(zip(live, sizes, strict=True)):
            cached, root_position = self.cache.committed_length(s.seq_id), len(s.token_ids) - 1
            if cached != root_position:  # the invariant between steps (module docstring)
                raise RuntimeError(f"sequence {s.seq_id}: the KV cache holds {cached} committed positions, "
                                   f"expected {root_position} (every token but the root)")
            # host-side per-sequence vectors (a drafter's tree may live on its device); the builder moves them once
            if pending is not None:
                positions, tokens = [root_position] * (1 + n), [s.token_ids[-1]] + [0] * n
            else:
                positions = [root_position] + [root_position + d for d in drafts[b].depth_list]
                tokens = [s.token_ids[-1]] + drafts[b].tokens.tolist()
            if n:
                builder.add(s.seq_id, tokens, positions, cached + len(tokens), cached + 1, next(bits))
            else:
                builder.add(s.seq_id, tokens, positions, cached + 1, cached)
        batch = builder.build()
        return VerifyBatch.of(batch, None if pending is None else self._node_rows(live, sizes, pending, batch.rows))

    def _node_rows(self, live: list[SequenceState], sizes: list[int], pending: PendingTrees, rows: tuple[range, ...]
                   ) -> NodeRows:
        """Where the pending trees' nodes sit in the verify (after each root's row), and their values on the device."""
        index, roots = [], []
        for s, n, r in zip(live, sizes, rows, strict=True):
            index += range(r.start + 1, r.start + 1 + n)
            roots += [len(s.token_ids) - 1] * n
        device = self.runner.device
        return NodeRows(to_device(index, torch.long, device), pending.tokens,
                        to_device(roots, torch.long, device) + pending.depths, pending.ancestor_bits)

    def verify(self, batch: ForwardBatch, token_ids: torch.Tensor | None = None) -> ForwardOutput:
        """ONE target forward over every root and tree node of every live sequence. ``token_ids`` [T] on the device
        stand for the batch's tokens (a queued plain step's roots, specdec.decode_ahead; an id past the vocabulary,
        a row with no law, runs as the last id)."""
        self.forward_passes += 1
        nodes = batch.nodes if isinstance(batch, VerifyBatch) else None
        if self.graphed is not None:
            out = self.graphed(batch, token_ids, nodes=nodes, feature_layers=self.feature_layers)
            if out is not None:  # else no bucket fits this step (never with pending trees: Engine._verifiable)
                return out
        token_ids = batch.token_ids if token_ids is None else token_ids.clamp(max=self.runner.shape.vocab_size - 1)
        all_rows = torch.arange(token_ids.numel(), device=token_ids.device)
        return self.runner.forward(token_ids, batch.positions, batch.plan, self.cache, all_rows,
                                   feature_layers=self.feature_layers)

    def drafter_rows(self, out: ForwardOutput) -> torch.Tensor:
        """What ``SequenceView.new_hidden`` holds: the final-norm hidden states, or the drafter's feature layers."""
        return out.features if self.feature_layers else out.hidden

    def process(self, live: list[SequenceState], trees: list[DraftTree], target_logits: torch.Tensor
                ) -> torch.Tensor:
        """target_logits [B, max_nodes + 1, V] -> the same after the logits processors, each row with its own
        prefix (committed tokens + the row's path in the tree): what plain decoding would see there."""
        if self.processing is None:
            return target_logits
        return self.processing.apply([(s.token_ids, s.num_prompt_tokens) for s in live], trees, target_logits)

    def record_logprobs(self, live: list[SequenceState], acceptances: list[Acceptance], target_logits: torch.Tensor,
                        emitted: dict[int, list[int]]) -> None:
        """Append to each sequence the log-probabilities of the tokens it committed this step (specdec.logprobs)."""
        b_idx, rows, tokens = [], [], []
        for b, (s, acc) in enumerate(zip(live, acceptances, strict=True)):
            toks = emitted[s.seq_id]
            b_idx += [b] * len(toks)
            rows += committed_rows(acc, len(toks))
            tokens += toks
        if not tokens:
            return
        device = target_logits.device
        picked = target_logits[to_device(b_idx, torch.long, device), to_device(rows, torch.long, device)]
        values = token_logprobs(picked, tokens, self.sampling)
        start = 0
        for s in live:
            n = len(emitted[s.seq_id])
            s.logprobs.extend(values[start:start + n])
            start += n

    def accept(self, live: list[SequenceState], trees: list[DraftTree], target_logits: torch.Tensor
               ) -> list[Acceptance]:
        """target_logits [B, max_nodes + 1, V] -> what each sequence commits, by the run's acceptor: the exact
        rejection sampler, or the coupled walk (the same text as plain coupled sampling, whatever the trees)."""
        walk = self.rejection_walk if self.coupling is None else self.coupled_walk  # not kept: a cycle through self
        acceptances = walk(live, trees, target_logits)
        self.check_chosen(live, acceptances, target_logits.shape[-1])
        return acceptances

    def check_chosen(self, live: list[SequenceState], acceptances: list[Acceptance], vocab: int) -> None:
        """InvalidLogitsError naming the sequence, step and token where a row had no law (specdec.sampling), unless
        the step's accepted tokens already end the sequence (a drafted EOS or stop): plain decoding never reaches
        the row after them, and commit drops its token."""
        checked = [b for b, acc in enumerate(acceptances) if acc.next_token < vocab or self.stop.scan(
            live[b].token_ids, acc.accepted_tokens, start=live[b].num_prompt_tokens)[1] is None]
        check_chosen([acceptances[b] for b in checked], vocab,
                     lambda i: (live[checked[i]].seq_id, live[checked[i]].steps + 1, live[checked[i]].num_new_tokens))

    def rejection_walk(self, live: list[SequenceState], trees: list[DraftTree], target_logits: torch.Tensor
                       ) -> list[Acceptance]:
        return rejection_sample(trees, target_logits, self.sampling, self.generator, self.rule)

    def coupled_walk(self, live: list[SequenceState], trees: list[DraftTree], target_logits: torch.Tensor
                     ) -> list[Acceptance]:
        keys = torch.tensor(self.noise_keys(live), dtype=torch.long)
        return coupled_sample(trees, target_logits, self.sampling, self.coupling, keys, self.root_positions(live))

    @staticmethod
    def noise_keys(live: list[SequenceState]) -> list[int]:
        return [s.noise_key for s in live]  # the sequence's own key, never its row in the batch

    @staticmethod
    def root_positions(live: list[SequenceState]) -> list[int]:
        return [len(s.token_ids) - 1 for s in live]  # positions in the sequence, never step counts

    @staticmethod
    def keep_new_hidden(live: list[SequenceState], acceptances: list[Acceptance], hidden: torch.Tensor) -> None:
        """hidden [B, max_nodes + 1, H]: keep the rows of the root and the accepted nodes (the committed path), all
        sequences' by one gather (views of it, one per sequence)."""
        B, W = hidden.shape[:2]
        index, counts = [], []
        for b, acc in enumerate(acceptances):
            index += [b * W] + [b * W + 1 + i for i in acc.accepted_nodes]
            counts.append(1 + len(acc.accepted_nodes))
        kept = hidden.reshape(B * W, -1)[to_device(index, torch.long, hidden.device)].split(counts)
        for s, new in zip(live, kept, strict=True):
            if s.hidden_seen:
                s.hidden_chunks, s.hidden_seen = [new], False
            else:  # the guard skipped the drafter: it gets them all when next asked (joined then, not every step)
                s.hidden_chunks.append(new)

    def commit(self, live: list[SequenceState], acceptances: list[Acceptance]) -> dict[int, list[int]]:
        """Emit accepted + next tokens (up to a stop), keep the accepted path's K/V, free the rest."""
        keep: dict[int, list[int]] = {}
        emitted: dict[int, list[int]] = {}
        for s, acc in zip(live, acceptances, strict=True):
            committed = [*acc.accepted_tokens, acc.next_token]
            count, reason = self.stop.scan(s.token_ids, committed, start=s.num_prompt_tokens)
            emitted[s.seq_id] = committed[:count]
            s.token_ids.extend(committed[:count])
            s.steps += 1
            s.step_lengths.append(count)
            self._count_depths(s, acc)
            if reason is not None:
                s.finish_reason, s.finished_at = reason, time.perf_counter()
                self.cache.free(s.seq_id)
                if self.drafter is not None:
                    self.drafter.release(s.seq_id)
                continue
            # root (offset 0) and the accepted nodes (offset 1 + node) become positions length..
            keep[s.seq_id] = [0] + [1 + i for i in acc.accepted_nodes]
            if self.drafter is not None:
                # a tuple: the list is the engine's (streamed, priced, logged); a drafter may keep what it is given
                self.drafter.on_accept(s.seq_id, tuple(emitted[s.seq_id]))
        self.cache.commit(keep)
        return emitted

    @staticmethod
    def _count_depths(s: SequenceState, acc: Acceptance) -> None:
        for stats, new in ((s.depth_tried, acc.depth_tried), (s.depth_accepted, acc.depth_accepted)):
            if len(stats) < len(new):
                stats.extend([0] * (len(new) - len(stats)))
            for d, x in enumerate(new):
                stats[d] += x
