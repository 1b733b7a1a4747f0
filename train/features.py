"""The frozen target's training features: final-norm hidden states (or, for EAGLE-3, the residual streams
entering some of its layers) and its own greedy labels.

    hidden, labels = target_features(model, ids, mask)            # one padded batch
    cache = FeatureCache.build(model, seqs, device, batch_size)    # every sequence once, fixed order
    feats, labels = target_features(model, ids, mask, (2, 15, 27)) # [B, L, 3H]: the streams entering those layers
    hidden, labels, mask = cache.batch(rows)

The target never changes during training, so ``FeatureCache`` computes each sequence's features
once (in float32, in a fixed order of fixed chunks: the values do not depend on which rows a
training batch happens to group, which keeps resume bit-exact) and later epochs only run the heads.
"""
from __future__ import annotations

import logging

import torch
from torch.nn import functional as F

logger = logging.getLogger(__name__)


def collate(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``ids`` and ``mask``, both [B, L]."""
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    return ids.to(device), mask.to(device)


def scope_masks(mask: torch.Tensor, scopes: list[list[int] | None], start: int) -> list[torch.Tensor]:
    """Per scope, [B, L] the positions of ``mask`` (a batch of sequences from index ``start``) it scores: None all,
    else each sequence's from its first scored position on (the token at position p is scored through mask[p - 1],
    where the labels, the heads' and EAGLE's queries predicting it stand)."""
    scored = []
    for starts in scopes:
        scored.append(mask.clone())
        if starts is not None:
            for b, first in enumerate(starts[start : start + mask.shape[0]]):
                scored[-1][b, : max(0, first - 1)] = 0
    return scored


@torch.no_grad()
def target_features(model, ids: torch.Tensor, mask: torch.Tensor, feature_layers: tuple[int, ...] = ()
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-norm hidden states [B, L, H] (with ``feature_layers``: the residual streams entering those layers,
    [B, L, k * H], id num_layers = the last one before the final norm) and the target's argmax next tokens [B, L]."""
    before_norm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda module, args, out: before_norm.append(args[0])) \
        if model.config.num_hidden_layers in feature_layers else None
    try:
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=bool(feature_layers))
    finally:
        if hook is not None:
            hook.remove()
    hidden = out.last_hidden_state
    lm_w = model.get_output_embeddings().weight
    labels = torch.stack([F.linear(h, lm_w).argmax(-1) for h in hidden])  # row by row: [L, V] at a time
    if feature_layers:  # hidden_states[i]: the input of layer i, for i < num_layers
        streams = [before_norm[0] if i == model.config.num_hidden_layers else out.hidden_states[i]
                   for i in feature_layers]
        hidden = torch.cat(streams, dim=-1)
    return hidden, labels


class FeatureCache:
    """Per-sequence ``hidden`` [len, H] and ``labels`` [len], kept on ``device``."""

    def __init__(self, hidden: list[torch.Tensor], labels: list[torch.Tensor]) -> None:
        self.hidden, self.labels = hidden, labels

    @classmethod
    def build(cls, model, seqs: list[list[int]], device, batch_size: int, progress: bool = False,
              feature_layers: tuple[int, ...] = ()) -> FeatureCache:
        hidden: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
        labels: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
        order = sorted(range(len(seqs)), key=lambda r: (len(seqs[r]), r))  # similar lengths: little padding
        chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="target features", unit="seq", disable=None)
        for rows in chunks:
            ids, mask = collate([seqs[r] for r in rows], device)
            h, y = target_features(model, ids, mask, feature_layers)
            for j, r in enumerate(rows):
                n = len(seqs[r])
                hidden[r], labels[r] = h[j, :n].clone(), y[j, :n].clone()
            if bar is not None:
                bar.update(len(rows))
        if bar is not None:
            bar.close()
        mib = sum(h.numel() * h.element_size() for h in hidden) / 2**20
        logger.info("cached target features of %d sequences (%.0f MiB)", len(seqs), mib)
        return cls(hidden, labels)

    def batch(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded ``hidden`` [B, L, H], ``labels`` [B, L] and ``mask`` [B, L] for these sequences."""
        L = max(len(self.labels[r]) for r in rows)
        first = self.hidden[rows[0]]
        hidden = first.new_zeros(len(rows), L, first.shape[-1])
        labels = self.labels[rows[0]].new_zeros(len(rows), L)
        mask = torch.zeros(len(rows), L, dtype=torch.long, device=first.device)
        for j, r in enumerate(rows):
            n = len(self.labels[r])
            hidden[j, :n], labels[j, :n], mask[j, :n] = self.hidden[r], self.labels[r], 1
        return hidden, labels, mask
