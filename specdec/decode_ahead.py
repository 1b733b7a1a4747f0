"""Plain decoding with the next step queued before the host reads this one.

A plain step on a GPU ends with the host waiting for the target's choices, then building the next step's inputs while
the device idles (what that costs: docs/gpu-speed.md, Plain steps queued ahead). Here each step is launched with the
step before it still unread, its token input written on the device from that step's choices
(:class:`~specdec.cuda_graphs.GraphedForward`'s ``token_ids``); only then does the host read the earlier step. The
device runs step i + 1 while the host reads, checks and commits step i, so a step costs about the larger of the host's
and the device's work, not their sum.

Invariants:

* the tokens are plain decoding's: the same forward over the same inputs, the same choices (the argmax, or draws
  from the run's generator in the same order), learned by the host a step later; but where a sequence of a batch
  stops in the unread step, the queued step drew for it too, so under standard sampling the others' later draws
  shift: the same law, not the same text as steps read first (coupled sampling keys its noise, unaffected);
* a step is queued only where every sequence of the unread step may still take a token after it (max_new_tokens,
  the context) and the KV pool holds one more position for each; a sequence that stops on an EOS or a stop string
  in the unread step has one step of work thrown away (its K/V went to positions of its own, freed with it);
* a choice outside the vocabulary (a row with no valid logit) is fed as the last id to the queued step, which is
  thrown away when reading the step before it raises ``InvalidLogitsError``.

The :class:`~specdec.engine.Engine` decides once, when it is built, whether its steps run here: plain decoding,
greedy or standard sampling (no drafter or one the policy never asks; no coupled sampling, logits processor or
log-probabilities), through a GraphedForward. With a drafter that reads no hidden rows, under the break-even guard
(``guarded``), the steps where the guard holds off every sequence run here too: a step is queued only where
:meth:`~specdec.speculation_policy.SpeculationPolicy.asks_nobody_next` foresees that no sequence drafts in it,
and the guard is asked in each step as in a drafting one (its counts move alike). While the device runs a queued
step, a drafter that looks back (``Drafter.looks_back``: n-gram) is asked for the held-off sequences in hindsight:
its trees are never verified, only judged by the text that follows, so the guard sees the text turn.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.attention import BatchBuilder
from specdec.cuda_graphs import captures
from specdec.host_copy import to_device, to_host_later
from specdec.kv_cache import CacheFullError
from specdec.rejection import plain_acceptances, plain_choices
from specdec.speculation_policy import StepRecord

if TYPE_CHECKING:
    from specdec.engine import Engine, SequenceState

logger = logging.getLogger(__name__)


@dataclass
class QueuedStep:
    """A plain step launched on the device, not yet read by the host."""

    seqs: list[SequenceState]  # the sequences it decodes, in batch order (some may stop before it is read)
    choices: torch.Tensor  # [B] int64 on the device: each sequence's token (the vocabulary size: a row with no law)
    read: Callable[[], torch.Tensor]  # -> [B] the choices on the host, waiting for this step's copy alone
    vocab: int  # the logits' width


class DecodeAhead:
    """The engine's steps for plain decoding, one step queued ahead (module doc)."""

    def __init__(self, engine: Engine, guarded: bool = False) -> None:
        self.engine = engine
        self.guarded = guarded  # a drafter's engine: the steps its guard holds every sequence off (module doc)
        self.queued: QueuedStep | None = None  # the step the device runs ahead of the host, if any

    def runs(self, live: list[SequenceState]) -> bool:
        """Whether the engine's next step is one of these: every step of plain decoding; with ``guarded``, a queued
        step, or one whose guard asks nobody."""
        return not self.guarded or self.queued is not None or self.engine.policy.asks_nobody_next(live)

    def step(self) -> dict[int, list[int]]:
        """Read and commit one step, with the next one queued first. Returns the tokens emitted per seq_id."""
        e = self.engine
        t0, captured = time.perf_counter(), captures()
        queued = self.queued is not None  # launched behind the step before it: timed as a queued step
        step = self.queued or self.launch(e.live, None)
        rows = [b for b, s in enumerate(step.seqs) if not s.finished]  # stopped in the step before it: thrown away
        live = [step.seqs[b] for b in rows]
        if self.guarded:  # the guard's step, asked before what it foresees for the next one
            self._held_off(live)
        self.queued = self.launch(live, step, rows) if self._may_queue(live) else None
        if queued and self.queued is None and live:
            # a queued step's position lost its reservation to the commit before it (which sets each back to the
            # committed length) and was reserved again by the launch queued after it; none was: it is reserved here
            # (in the spare block that commit kept, where its K/V is: no block is taken)
            e.cache.reserve_many({s.seq_id: 1 for s in live})
        choices = step.read().tolist()
        acceptances = plain_acceptances([choices[b] for b in rows])
        e.check_chosen(live, acceptances, step.vocab)
        emitted = e.commit(live, acceptances)
        for s in live:
            s.step_nodes.append(0)
        seconds = time.perf_counter() - t0
        e.seconds["verify"] += seconds
        # a step that captured a CUDA graph paid a one-off: its time prices nothing
        e.policy.observe(StepRecord(live, acceptances, emitted, seconds if captures() == captured else None, 1,
                                    queued))
        if self.guarded and self.queued is not None:  # the device runs the next step: the host looks back meanwhile
            e.look_back([s for s in live if not s.finished])
        return emitted

    def _held_off(self, live: list[SequenceState]) -> None:
        """This step's guard call, which :meth:`runs` foresaw asking nobody (the step decodes plainly either way)."""
        asked = self.engine.policy.who_drafts(live)
        if asked:  # not foreseen: the tokens are plain decoding's still, the guard charged a probe not run
            logger.debug("a queued plain step's guard asked %d sequences to draft", len(asked))

    def _may_queue(self, live: list[SequenceState]) -> bool:
        """Whether every sequence may take a token after the unread step (its root is ``token_ids[-1]``), and, with
        ``guarded``, the guard is sure to hold them all off in it."""
        return (bool(live) and all(self.engine._depth_budget(s) >= 1 for s in live)
                and (not self.guarded or self.engine.policy.asks_nobody_next(live)))

    def launch(self, seqs: list[SequenceState], after: QueuedStep | None, rows: list[int] | None = None
               ) -> QueuedStep | None:
        """Queue a plain step of ``seqs``: their roots are ``token_ids[-1]``, or, ``after`` an unread step, that
        step's choices at its ``rows`` (one position further). None where the KV pool has no room for it then."""
        e, cache = self.engine, self.engine.cache
        ahead = int(after is not None)
        try:
            cache.reserve_many({s.seq_id: 1 + ahead for s in seqs})
        except CacheFullError:
            if after is None:
                raise
            # the unread step is read first; its commit frees what the next one needs. The commit before it set
            # each reservation back to the committed length: its position is reserved again (in the block the
            # commit kept as the spare, where its K/V already is: no block is taken)
            cache.reserve_many({s.seq_id: 1 for s in seqs})
            return None
        builder = BatchBuilder(cache, e.runner.device)
        for s in seqs:
            root = len(s.token_ids) - 1 + ahead
            builder.add(s.seq_id, [0 if ahead else s.token_ids[-1]], [root], root + 1, root)
        roots = None
        if after is not None:  # on the device, never read (the verify runs the id "no valid logit" as the last id)
            roots = after.choices if len(rows) == len(after.seqs) else after.choices[to_device(rows, torch.long,
                                                                                              e.runner.device)]
        out = e.verify(builder.build(), roots)
        choices = plain_choices(out.logits, e.sampling, e.generator)  # [B, V]: one row per sequence
        return QueuedStep(seqs, choices, to_host_later(choices), out.logits.shape[-1])
