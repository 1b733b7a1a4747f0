"""Deliberately broken acceptance rules: every level of the certificate must reject them.

A certificate that cannot fail certifies nothing, so each check is also run with these
rules and must fail. Use by name: ``BROKEN_RULES["always_accept"]``; pass as ``rule=`` to
:func:`specdec.rejection.rejection_sample` or to :func:`specdec.eval.exact_law.emitted_law`.
"""
from __future__ import annotations

import torch

from specdec.rejection import AcceptanceRule


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
