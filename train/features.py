"""The frozen target's training features: final-norm hidden states and its own greedy labels.

    hidden, labels = target_features(model, ids, mask)            # one padded batch
    cache = FeatureCache.build(model, seqs, device, batch_size)    # every sequence once, fixed order
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


@torch.no_grad()
def target_features(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-norm hidden states [B, L, H] and the target's argmax next tokens [B, L]."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    lm_w = model.get_output_embeddings().weight
    labels = torch.stack([F.linear(h, lm_w).argmax(-1) for h in hidden])  # row by row: [L, V] at a time
    return hidden, labels


class FeatureCache:
    """Per-sequence ``hidden`` [len, H] and ``labels`` [len], kept on ``device``."""

    def __init__(self, hidden: list[torch.Tensor], labels: list[torch.Tensor]) -> None:
        self.hidden, self.labels = hidden, labels

    @classmethod
    def build(cls, model, seqs: list[list[int]], device, batch_size: int, progress: bool = False) -> FeatureCache:
        hidden: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
        labels: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
        order = sorted(range(len(seqs)), key=lambda r: (len(seqs[r]), r))  # similar lengths: little padding
        chunks = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="target features", unit="seq")
        for rows in chunks:
            ids, mask = collate([seqs[r] for r in rows], device)
            h, y = target_features(model, ids, mask)
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
