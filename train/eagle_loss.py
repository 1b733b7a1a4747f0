"""The EAGLE training loss, unrolled through the draft layer's own steps ("training-time test").

Pass 1 is teacher-forced: the query at token ``j + 1`` reads the target's feature ``f_j`` and
predicts ``f_{j+1}`` and the target's own next token there. Pass ``s`` replays what depth ``s`` of
a draft tree sees at inference: it reads pass ``s - 1``'s *predicted* feature instead of the
target's, and attends to pass-1 keys up to ``s - 1`` positions back, one key of each pass in
between, and itself (the keys of its would-be ancestors in the tree). So the layer learns to
draft several tokens deep on its own predictions, not only one step on true features.

An EAGLE-3 layer reads its fused target features (``hidden`` holds the streams of its feature
layers, [B, L, kH]) in pass 1 and its own pre-norm outputs after; its loss is the token
cross-entropy alone (its outputs live in no target feature space to regress onto), as
speculators' ``ttt_steps`` and SpecForge's ``ttt_length`` train it.

    loss, correct, count = eagle_loss(model, ids, hidden, labels, mask, embed_w, lm_w, steps=3)
    # correct[s] / count[s]: top-1 agreement with the target at draft depth s + 1
    over = eagle_loss_counts(model, labels, mask, vocab_size, steps=3)  # what each term averages over
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from specdec.drafters.draft_vocab import IGNORE, DraftVocab
from specdec.drafters.eagle_model import EagleModel
from torch.nn import functional as F


def unrolled_mask(L: int, s: int, device) -> torch.Tensor:
    """[L, s * L] bool: pass ``s`` query j sees pass-1 keys i <= j - s + 1 and pass-m key j - (s - m), m = 2..s."""
    j = torch.arange(L, device=device)[:, None]
    i = torch.arange(L, device=device)[None, :]
    blocks = [i <= j - s + 1] + [i == j - (s - m) for m in range(2, s + 1)]
    return torch.cat(blocks, dim=1)


def depth_targets(model: EagleModel, labels, mask, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``valid`` [B, L-1] (the queries that predict a real token) and their targets [B, L-1] (the target's token,
    mapped into the draft vocabulary: -100 outside it)."""
    valid = mask[:, 1:].bool()
    want_token = labels[:, 1:]  # the target's token after t_{j+1}
    draft_ids = model.draft_ids
    if draft_ids is None:
        return valid, want_token
    return valid, DraftVocab(draft_ids.cpu(), vocab_size).to_reduced(want_token)


def depth_rows(valid: torch.Tensor, s: int) -> torch.Tensor:
    """[B, L-1] the queries of ``valid`` that pass ``s`` scores."""
    rows = valid.clone()
    rows[:, : s - 1] = False  # the first s - 1 queries have no depth-s context
    return rows


def eagle_loss_counts(model: EagleModel, labels, mask, vocab_size: int, steps: int) -> list[int]:
    """What each term of :func:`eagle_loss` averages over in this batch: per depth the positions with a target in
    the draft vocabulary (token loss), then per depth every position (feature regression; EAGLE-3 has none)."""
    valid, want_index = depth_targets(model, labels, mask, vocab_size)
    ce, reg = [], []
    for s in range(1, steps + 1):
        rows = depth_rows(valid, s)
        ce.append(int((want_index[rows] != IGNORE).sum()))
        reg.append(0 if model.eagle3 else int(rows.sum()))
    return ce + reg


def unrolled_passes(model: EagleModel, ids: torch.Tensor, hidden: torch.Tensor, embed_w: torch.Tensor,
                    steps: int) -> Iterator[torch.Tensor]:
    """The layer's outputs [B, L-1, H] of passes 1..``steps`` over every query (``ids`` [B, L] with L >= 2, ``hidden``
    and ``embed_w`` as :func:`eagle_loss` takes them); which queries a depth scores is the caller's choice."""
    L = ids.shape[1]
    n = L - 1  # queries j = 0..L-2 read (f_j, t_{j+1}) and predict position j + 1
    dev = hidden.device
    embeds = F.embedding(ids[:, 1:], embed_w).to(hidden.dtype)  # [B, n, H] embeddings of t_{j+1}
    positions = torch.arange(1, L, device=dev)
    keys_k, keys_v = [], []
    features = model.fuse(hidden[:, :-1])  # pass 1 reads the target's features (EAGLE-3: fused by fc)
    out = features
    for s in range(1, steps + 1):
        if s > 1:  # depth s reads the previous pass's prediction of f_j, made at query j - 1
            features = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)
        attn = unrolled_mask(n, s, dev)  # keys: pass 1, ..., pass s-1, this pass
        past_k = torch.cat(keys_k, dim=2) if keys_k else None
        past_v = torch.cat(keys_v, dim=2) if keys_v else None
        out, k, v = model(embeds, features, positions, attn[None], past_k, past_v)
        keys_k.append(k), keys_v.append(v)
        yield out


def eagle_loss(
    model: EagleModel,
    ids: torch.Tensor,  # [B, L] token ids
    hidden: torch.Tensor,  # [B, L, H] the target's final-norm features (EAGLE-3: [B, L, kH] fused-layer streams)
    labels: torch.Tensor,  # [B, L] the target's argmax next token at each position
    mask: torch.Tensor,  # [B, L] 1 = real token
    embed_w: torch.Tensor,  # [vocab, H] the target's embedding (frozen)
    lm_w: torch.Tensor,  # [vocab, H] the target's LM head (frozen; used when the draft vocabulary is full)
    steps: int = 3,
    reg_weight: float = 1.0,
    step_decay: float = 0.8,
    top5: list[int] | None = None,
    over: list[int] | None = None,
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Weighted sum over passes of cross-entropy vs the target's token + reg_weight * smooth-L1 vs its feature.
    Each term is its sum over positions divided by its entry of ``over`` (laid out as :func:`eagle_loss_counts`;
    default: this batch's own counts, so a mean; the training loop passes the optimizer step's counts).
    ``top5``, if given, receives per depth the count of positions whose target token is in the draft's top 5."""
    if ids.shape[1] < 2:  # no query: the first token predicts nothing
        if top5 is not None:
            top5 += [0] * steps
        return hidden.new_zeros(()), [0] * steps, [0] * steps
    if over is None:
        over = eagle_loss_counts(model, labels, mask, lm_w.shape[0], steps)
    valid, want_index = depth_targets(model, labels, mask, lm_w.shape[0])  # [B, n]
    want_feature = hidden[:, 1:]  # [B, n, H] f_{j+1}
    total = hidden.new_zeros(())
    correct, count = [], []
    for s, out in enumerate(unrolled_passes(model, ids, hidden, embed_w, steps), start=1):
        rows = depth_rows(valid, s)
        if not bool(rows.any()):
            correct.append(0), count.append(0)
            if top5 is not None:
                top5.append(0)
            continue
        pred = out[rows]  # [R, H]
        logits = model.logits(pred, lm_w).float()
        target = want_index[rows]
        ce = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="sum") \
            if bool((target != IGNORE).any()) else logits.sum() * 0.0
        ce = ce / max(1.0, float(over[s - 1]))
        reg = 0.0 if model.eagle3 else \
            F.smooth_l1_loss(pred.float(), want_feature[rows].float(), reduction="sum") / (
                pred.shape[-1] * max(1.0, float(over[steps + s - 1])))  # the mean over elements: H per position
        total = total + step_decay ** (s - 1) * (ce + reg_weight * reg)
        correct.append(int((logits.argmax(-1) == target).sum()))  # out-of-vocabulary tokens count as misses
        if top5 is not None:
            top5.append(int((logits.topk(min(5, logits.shape[-1]), -1).indices == target[:, None]).any(-1).sum()))
        count.append(int(target.numel()))
    return total, correct, count
