"""EAGLE's catch-up on the device: the draft layer over each sequence's newly committed (feature, next token) pairs.

A function of tensors only, with no host read and no shape that depends on values, so the eager drafter and the
CUDA-graph replay of a whole drafting call (drafters/eagle_graphs.py) run the same code. Sequences are right-padded
to ``L`` rows; row j of a sequence attends to its real cached keys and to rows 0..j (causal), so a padded row is
seen by no real row and the real rows' outputs do not depend on the padding. The last real row predicts the
root's feature, from which the tree grows (drafters/eagle_grow.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from specdec.drafters.eagle_grow import cached_keys_bias
from torch.nn import functional as F

from specdec.host_copy import to_device


@dataclass(frozen=True)
class CatchUpRows:
    """A call's catch-up on the host side: target rows [B, L, F] on the device, right-padded host lists."""

    hidden: torch.Tensor
    tokens: Sequence[Sequence[int]]  # [B][L]
    positions: Sequence[Sequence[int]]  # [B][L]
    counts: Sequence[int]  # [B] real rows (>= 1)

    def packed(self, width: int) -> list[list[int]]:
        """[B][2 width + 1] per sequence: its tokens and positions right-padded with 0 to ``width``, and its count
        (the layout of :meth:`CatchUpInputs.upload` and of a graph bucket's inputs)."""
        pad = width - len(self.tokens[0])
        return [[*t, *[0] * pad, *p, *[0] * pad, c]
                for t, p, c in zip(self.tokens, self.positions, self.counts, strict=True)]


@dataclass(frozen=True)
class CatchUpInputs:
    hidden: torch.Tensor  # [B, L, F] target rows (final-norm states, or EAGLE-3's feature layers), right-padded
    tokens: torch.Tensor  # [B, L] int64: the token after each row's position, right-padded with 0
    positions: torch.Tensor  # [B, L] int64: those tokens' positions, right-padded with 0
    counts: torch.Tensor  # [B] int64: real rows per sequence (0: a padded sequence)
    rope_table: torch.Tensor | None = None  # [2, N, head_dim] as GrowInputs.rope_table; None: computed per call

    @classmethod
    def upload(cls, rows: CatchUpRows) -> "CatchUpInputs":
        """From the host lists and the rows on the device: one copy to the device."""
        L = rows.hidden.shape[1]
        packed = to_device(rows.packed(L), torch.long, rows.hidden.device)  # [B, 2L + 1]
        return cls(rows.hidden, packed[:, :L], packed[:, L:2 * L], packed[:, 2 * L])


def catch_up(model, embed: torch.Tensor, x: CatchUpInputs, past_k: torch.Tensor | None,
             past_v: torch.Tensor | None, real: torch.Tensor, fused=None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> the roots' predicted features [B, H] and the rows' keys / values [B, kv_heads, L, head_dim] each.
    ``past_k`` / ``past_v`` [B, kv_heads, P, head_dim] (None when P is 0) are the cached keys, ``real`` [B, P] which
    of their columns are a sequence's own; ``fused``: the layer's fused element-wise ops (TreeGrower.fused)."""
    B, L = x.tokens.shape
    P = real.shape[1]
    # [B, L, P + L] of an aligned bias in the layer's dtype (eagle_grow.cached_keys_bias): row j opens columns
    # P .. P + j, the rows' own keys up to its own (the columns past them, padding included, lie above that diagonal)
    bias = cached_keys_bias(real, L, P + L, model.fc.weight.dtype)
    bias[:, :, P:].triu_(1)
    rope = None if x.rope_table is None else x.rope_table[:, x.positions].unbind(0)  # [B, L, head_dim] each
    out, new_k, new_v = model(F.embedding(x.tokens, embed), model.fuse(x.hidden), x.positions, bias[:, :, : P + L],
                              past_k, past_v, fused, rope=rope)
    last = (x.counts - 1).clamp(min=0)  # a padded sequence reads its row 0
    return out.gather(1, last[:, None, None].expand(B, 1, out.shape[-1]))[:, 0], new_k, new_v
