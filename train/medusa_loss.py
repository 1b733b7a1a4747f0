"""The Medusa heads' training loss: head ``i`` at position ``t`` learns the target's own greedy prediction at
position ``t + 1 + i`` (the token the target would produce at ``t + 2 + i``).

    loss, correct, count = head_loss(heads, i, hidden, labels, mask, lm_w, "ce", over)
    n = head_loss_count(heads, i, labels, mask, "ce")  # the positions head i's loss averages over

``hidden`` and ``labels`` are the target's final-norm hidden states and argmax tokens (train/features.py). The
recipe (train/medusa_recipe.py) weights head ``i``'s loss by ``head_decay ** i``.
"""
from __future__ import annotations

import torch
from specdec.drafters.draft_vocab import IGNORE
from specdec.drafters.medusa_heads import MedusaHeads
from torch.nn import functional as F


def _head_targets(heads: MedusaHeads, i: int, labels, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Head i's positions (``valid`` [B, L-1-i] bool) and its targets there ([N]; -100 outside a draft vocabulary)."""
    shift = 1 + i
    valid = mask[:, shift:].bool()
    y = labels[:, shift:][valid]
    vocab = heads.vocab()
    return valid, (y if vocab is None else vocab.to_reduced(y))


def head_loss_count(heads: MedusaHeads, i: int, labels, mask, loss: str = "ce") -> int:
    """How many positions head i's loss averages over in this batch: every valid one for ``kl``; for ``ce`` those
    whose label lies in the draft vocabulary."""
    valid, target = _head_targets(heads, i, labels, mask)
    return int(valid.sum()) if loss == "kl" else int((target != IGNORE).sum())


def head_loss(heads: MedusaHeads, i: int, hidden, labels, mask, lm_w,
              loss: str = "ce", over: int | None = None) -> tuple[torch.Tensor, int, int]:
    """Head i's loss vs the target's prediction at t+1+i; returns (loss, correct, count).

    ``ce``: cross-entropy against the target's argmax. ``kl``: KL(target || head) against the
    target's whole next-token distribution at t+1+i, recomputed from the cached final-norm hidden
    state (one extra LM-head forward, no gradient); it also teaches the ranks below the argmax,
    which a tree's siblings use.

    The loss is the sum over positions divided by ``over``: by default this batch's own count
    (:func:`head_loss_count`), a mean; the training loop passes the whole optimizer step's count, so the
    losses of its micro-batches (and processes) add up to the mean over all of them.

    Heads over a reduced draft vocabulary (``heads.config.draft_vocab``) score N tokens: ``ce`` maps
    the labels into it and ignores positions whose label lies outside (they carry no gradient);
    ``kl`` uses the target's distribution restricted to the N tokens and renormalised (a softmax
    over the target's logits of those ids), the best any reduced head can match. ``correct`` /
    ``count`` always count every position, so an out-of-vocabulary label is a miss."""
    shift = 1 + i
    if hidden.shape[1] <= shift:  # every sequence too short for this head: a zero that still reaches its weights
        return sum(p.sum() for p in heads.heads[i].parameters()) * 0.0, 0, 0
    valid, target = _head_targets(heads, i, labels, mask)
    x = heads.heads[i](hidden[:, :-shift][valid])  # [N, H]
    rows = heads.lm_rows(lm_w)  # [draft_size, H] target LM-head rows of the scored tokens
    logits = F.linear(x, rows) if heads.config.shared_lm_head else x  # [N, draft_size]
    if loss == "kl":
        with torch.no_grad():
            target_logp = F.linear(hidden[:, shift:][valid], rows).float().log_softmax(-1)  # [N, draft_size]
        value = F.kl_div(logits.float().log_softmax(-1), target_logp, log_target=True, reduction="sum")
        n = int(valid.sum())
    elif bool((target != IGNORE).any()):
        value = F.cross_entropy(logits.float(), target, ignore_index=IGNORE, reduction="sum")
        n = int((target != IGNORE).sum())
    else:  # every label outside the draft vocabulary: nothing to learn here (mean over none would be NaN)
        value, n = logits.float().sum() * 0.0, 0
    value = value / max(1.0, float(n if over is None else over))
    correct = int((logits.argmax(-1) == target).sum())
    return value, correct, int(target.numel())
