"""Deliberately broken samplers and engines: every level of the certificate must reject them.

A certificate that cannot fail certifies nothing, so each check is also run with these
controls and must fail. Two kinds:

- broken acceptance RULES, by name: ``BROKEN_RULES["always_accept"]``; pass as ``rule=`` to
  :func:`specdec.rejection.rejection_sample`, :func:`specdec.eval.exact_law.emitted_law` or
  :func:`generate_with_control`;
- broken ENGINES (the tree mask, the KV compaction), by name:
  ``ENGINE_FAULTS["off_by_one_tree_mask"]``; pass as ``fault=`` to :func:`generate_with_control`.
  Only the end-to-end level can see these, and only on steps that accept a draft.
  ``COUPLING_FAULTS`` break coupled sampling's noise (keyed to the step, or to the batch row); only the
  coupled level's identity checks can see them. ``LAW_FAULTS`` give every sequence of a step one draw or one
  noise key: the engine-law rows (:mod:`specdec.eval.engine_law`) must see them.
- broken SELECTIONS of sampled trees: :class:`ShapeAwareSizer` (cuts a tree by its own token-dependent shape) and
  :class:`ScoreChoosingCombined` (picks a sampled child by its drawn token's score); the exact-law level sees
  them (:mod:`specdec.eval.selection_law`).

``generate_with_control`` is generate() with the control injected where the engine is built
(:func:`specdec.engine_setup.build_engine`): ``specdec.generate()`` itself has no way to switch one on.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

import torch
from specdec.drafters.combined import CombinedDrafter

from specdec.attention import AttentionPlan, SeqAttention
from specdec.engine import Engine, SequenceState, VerifyBatch
from specdec.engine_setup import EngineFault, build_engine
from specdec.generate import generate_with
from specdec.kv_cache import PagedKVCache
from specdec.rejection import EXACT, Acceptance, AcceptanceRule
from specdec.tree import DraftTree
from specdec.tree_sizing import TreeSizer, _path_probs, _unscored_keys, best_prefix


class AlwaysAccept(AcceptanceRule):
    name = "always_accept"
    lossy = True

    def accept_prob(self, residual, draft, token, deterministic):
        return torch.ones_like(token, dtype=residual.dtype)


class ResampleFromTarget(AcceptanceRule):
    """On rejection, draw the recovered token from the target instead of the residual."""

    name = "resample_from_target"
    lossy = True

    def recovered_dist(self, residual, target_probs):
        return target_probs


class NoSiblingRenormalisation(AcceptanceRule):
    """Siblings are each tested against the untouched target, and drafts drawn without
    replacement are treated as if drawn independently."""

    name = "no_sibling_renormalisation"
    lossy = True

    def sibling_draft(self, draft_probs, tried, without_replacement):
        return draft_probs

    def after_reject(self, residual, draft, token, deterministic):
        return residual


class BonusFromDrafter(AcceptanceRule):
    """Bonus token drawn from the drafter's distribution instead of the target's."""

    name = "bonus_from_drafter"
    lossy = True

    def bonus_dist(self, target_probs, own_draft, has_own):
        usable = has_own[:, None] & (own_draft.sum(-1, keepdim=True) > 0)
        return torch.where(usable, own_draft, target_probs)


class BonusFromUniform(AcceptanceRule):
    """For deterministic drafters (no draft distribution): bonus token uniform over the vocab."""

    name = "bonus_uniform"
    lossy = True

    def bonus_dist(self, target_probs, own_draft, has_own):
        return torch.full_like(target_probs, 1.0 / target_probs.shape[-1])


BROKEN_RULES: dict[str, AcceptanceRule] = {
    r.name: r
    for r in (AlwaysAccept(), ResampleFromTarget(), NoSiblingRenormalisation(), BonusFromDrafter(), BonusFromUniform())
}


# ---- engine faults ----------------------------------------------------------------------
def _sees_next(s: SeqAttention) -> SeqAttention:
    """The same sequence's attention with the verify block's diagonal off by one.

    Rows of the verify block: 0 = root, 1 + i = tree node i; the nodes are the masked keys (bit i =
    node i), the root is in the visible prefix. Row r also sees node r, as ``tril(diagonal=1)``
    instead of ``tril()`` would for a chain: the root sees its first child, a node its first child
    (chain) or its next sibling / another branch.
    """
    if s.ancestor_bits is None:  # empty tree: nothing after the root
        return s
    rows = torch.arange(s.num_new, device=s.ancestor_bits.device)
    peek = torch.where(rows < s.num_masked, torch.ones_like(rows) << rows.clamp(max=s.num_masked - 1), 0)
    return dataclasses.replace(s, ancestor_bits=s.ancestor_bits | peek)


class OffByOneTreeMaskEngine(Engine):
    """Verify under an off-by-one tree mask: every token of the verify block also sees the
    token right after it (``j <= i + 1`` where ``j <= i`` on the ancestors was meant). Every
    step with a non-empty draft computes the root's logits with a peek at the first draft
    token, and the nodes' logits / K/V with a peek at a child or sibling."""

    def verify_batch(self, live: list[SequenceState], trees: list[DraftTree]) -> VerifyBatch:
        batch = super().verify_batch(live, trees)
        plan = AttentionPlan(tuple(_sees_next(s) for s in batch.plan.seqs))
        return dataclasses.replace(batch, plan=plan)


class WrongCompactionSlotCache(PagedKVCache):
    """Commit keeps, for every accepted tree node, the K/V one offset too early: the slot of
    ``keep[j] - 1`` (the root or the previous node of the verify block) instead of ``keep[j]``,
    i.e. node index where ``1 + node index`` was meant. The emitted tokens of the step are right;
    every later step attends to wrong K/V at the accepted positions."""

    def commit(self, keep: Mapping[int, Sequence[int]]) -> None:
        # gather the wrong sources before the real compaction moves anything
        wrong: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first committed position, kv [L, 2, n, H, D])
        for seq_id, offsets in keep.items():
            offsets = list(offsets)
            if len(offsets) > 1:  # offsets[0] == 0 is the root, already in place
                length = self.lengths[seq_id]
                src = self.slots(seq_id, length, length + offsets[-1] + 1)[torch.tensor(offsets[1:]) - 1]
                wrong[seq_id] = (length + 1, self.kv[:, :, src].clone())
        super().commit(keep)
        for seq_id, (start, kv) in wrong.items():
            self.kv[:, :, self.slots(seq_id, start, start + kv.shape[2])] = kv


ENGINE_FAULTS: dict[str, EngineFault] = {
    f.name: f
    for f in (EngineFault("off_by_one_tree_mask", engine_cls=OffByOneTreeMaskEngine),
              EngineFault("wrong_compaction_slot", cache_cls=WrongCompactionSlotCache))
}


class StepKeyedNoiseEngine(Engine):
    """Coupled sampling with the noise keyed to the step count instead of the token's position: plain decoding
    still samples the target's law, but a step that commits several tokens shifts every later token's noise,
    so speculative output stops being plain output."""

    @staticmethod
    def root_positions(live: list[SequenceState]) -> list[int]:
        return [s.steps for s in live]


class RowKeyedNoiseEngine(Engine):
    """Coupled sampling with the noise keyed to the sequence's row in the live batch instead of its prompt: a
    sequence sampled in a batch no longer matches the same sequence sampled alone."""

    @staticmethod
    def noise_keys(live: list[SequenceState]) -> list[int]:
        return list(range(len(live)))


# coupled sampling only (greedy and rejection sampling never read the noise, so they would pass these)
COUPLING_FAULTS: dict[str, EngineFault] = {
    f.name: f
    for f in (EngineFault("noise_keyed_to_step", engine_cls=StepKeyedNoiseEngine),
              EngineFault("noise_keyed_to_batch_row", engine_cls=RowKeyedNoiseEngine))
}


class ReusedNoiseEngine(Engine):
    """Coupled sampling with one noise key for every sequence: copies of a prompt all draw the same text, so the first
    tokens of many sequences no longer follow the target's law."""

    @staticmethod
    def noise_keys(live: list[SequenceState]) -> list[int]:
        return [0] * len(live)


class ReusedDrawEngine(Engine):
    """Standard sampling where every sequence of a step takes the first one's draw (its steps always through
    rejection_walk: no plain step queued ahead): copies of a prompt all draw the same text."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ahead = None

    def rejection_walk(self, live: list[SequenceState], trees: list[DraftTree], target_logits: torch.Tensor
                       ) -> list[Acceptance]:
        return super().rejection_walk(live[:1], trees[:1], target_logits[:1]) * len(live)


# the engine's own sampling against the target's exact law (specdec.eval.engine_law), one control per sampler
LAW_FAULTS: dict[str, EngineFault] = {
    f.name: f
    for f in (EngineFault("draw_reused", engine_cls=ReusedDrawEngine),
              EngineFault("noise_reused", engine_cls=ReusedNoiseEngine))
}


# ---- selections of sampled trees (exact law: specdec.eval.selection_law) ---------------------------------------
class ShapeAwareSizer(TreeSizer):
    """Cuts a sampled tree at the best prefix of its own shape, which may depend on its drawn tokens."""

    def _sampled_prefix(self, seq_id: int, tree: DraftTree, draft: float, batch: int, costs: list[float]) -> int:
        parents = tree.parents.tolist()  # costs cover the tree at hand (TreeSizer.size)
        path = _path_probs(self._rates(_unscored_keys(tuple(parents))), parents)
        return best_prefix(path, draft, costs, self.config.margin)


class ScoreChoosingCombined(CombinedDrafter):
    """Ranks sampled children by the scores of the tokens they drew, as deterministic ones."""

    def candidate_value(self, k: int, tree: DraftTree) -> float:
        return self.value(tree)


def generate_with_control(model, input_ids, rule: AcceptanceRule = EXACT, fault: EngineFault | None = None,
                          **generate_kwargs):
    """``specdec.generate(model, input_ids, **generate_kwargs)`` with a broken ``rule`` or ``fault`` built into its
    engine: deliberately WRONG output, for the certificate's negative controls (EXACT and None: the real thing). It
    runs in generate()'s own call frame (:func:`specdec.generate.generate_with`): only the engine differs. The broken
    rule or fault is logged at info level: the certificate runs them on purpose, and its table reports them."""
    return generate_with(functools.partial(build_engine, rule=rule, fault=fault, warn=False), model, input_ids,
                         **generate_kwargs)
