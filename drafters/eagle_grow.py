"""EAGLE's tree growth on the device: a batch of sequences' candidate pools from their root features.

A function of tensors only, with no host read and no shape that depends on values, so the eager drafter and its
CUDA-graph replay (drafters/eagle_graphs.py) run the same code. Every sequence expands exactly ``top_k`` nodes per
depth, so depth d's queries are [B, top_k]; each query sees its sequence's cached keys, its ancestors and itself.
The pool holds ``top_k`` candidates at depth 1 and ``top_k ** 2`` at each deeper one, parents before children:

    pool[b] = [reduced token index, parent pool index (-1: the root), cumulative log-prob, log-prob under the parent]

Log-probabilities are at the target's temperature; under coupled sampling, of the logits perturbed by the shared
noise of each candidate's position, so their top-k is a Gumbel-top-k sample coupled to the target's choice.
The next frontier is the ``top_k`` best children by cumulative log-probability, ties to the first (stable sorts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from specdec.drafters.eagle_rerank import rerank
from specdec.drafters.top_k import top_k
from torch.nn import functional as F

from specdec.coupling import Coupling, perturbed_logits
from specdec.sampling import SamplingConfig

BIAS_ALIGN = 8  # columns: a multiple of which lets CUDA's memory-efficient attention take a bias unpadded


def cached_keys_bias(real: torch.Tensor, rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """An attention mask as an additive bias in the layer's dtype, which CUDA's attention takes as it is (a boolean
    mask is converted there, and a row stride off BIAS_ALIGN padded, a few kernels): [B, rows, W] (W: ``width``
    rounded up to BIAS_ALIGN columns), 0 on each sequence's cached keys ``real`` [B, P] and -inf on its padding and
    on every later column, for the caller to open. Two launches."""
    B, P = real.shape
    bias = torch.full((B, rows, -(-width // BIAS_ALIGN) * BIAS_ALIGN), float("-inf"), dtype=dtype, device=real.device)
    bias[:, :, :P].masked_fill_(real[:, None], 0.0)
    return bias


@dataclass(frozen=True)
class GrowInputs:
    h_root: torch.Tensor  # [B, H] the roots' predicted features
    past_k: torch.Tensor  # [B, kv_heads, P, head_dim] each sequence's cached keys, right-padded
    past_v: torch.Tensor  # [B, kv_heads, P, head_dim]
    real: torch.Tensor  # [B, P] bool: the real (not padding) key columns
    root_pos: torch.Tensor  # [B] int64: each root's position
    noise_keys: torch.Tensor  # [B] int64: coupled sampling's sequence keys (read only under coupling)
    # [2, N, head_dim] cos and sin of positions 0 .. N - 1 in the layer's dtype (EagleModel.rope_table), whose rows
    # the levels gather; None: the call computes its positions' (the same values)
    rope_table: torch.Tensor | None = None


class TreeGrower:
    """Grows pools for one EAGLE model over one target (its embeddings and LM head) under one sampling setup."""

    def __init__(self, model, embed: torch.Tensor, lm_head: torch.Tensor, sampling: SamplingConfig,
                 coupling: Coupling | None, top_k: int, vocab_size: int, max_nodes: int, fused=None) -> None:
        self.model, self.embed, self.lm_head = model, embed, lm_head
        self.fused = fused  # kernels.fused_ops on the target's Triton backend: the layer's element-wise steps fused
        self.sampling, self.coupling, self.top_k, self.vocab_size = sampling, coupling, top_k, vocab_size
        self.max_nodes = max_nodes  # candidates kept per tree (drafters/eagle_rerank.py)
        self.draft_ids = model.draft_ids  # [N] token id of each reduced logit, None = the full vocabulary
        self.chain = top_k == 1  # one candidate a level, the next one's parent: nothing to rank or gather (pool)

    def token_logp(self, features: torch.Tensor, root_pos: torch.Tensor, depth: int, noise_keys: torch.Tensor
                   ) -> torch.Tensor:
        """[B, R, H] predicted features of nodes whose children sit at depth ``depth`` below roots at ``root_pos``
        [B] -> [B, R, N] draft log-probabilities (module doc)."""
        logits = self.model.logits(features, self.lm_head, self.fused)
        s, coupling = self.sampling, self.coupling
        if coupling is not None:  # [B, 1, N] the children's position's noise
            noise = coupling.draft_noise_batch(noise_keys, (root_pos + depth)[:, None], self.vocab_size,
                                               logits.device, self.draft_ids)
            return perturbed_logits(logits.float(), s, noise).log_softmax(-1)
        if s.do_sample and s.temperature != 1.0:
            logits = logits.float() / s.temperature
        return F.log_softmax(logits, dim=-1, dtype=torch.float32)  # in float32 from the layer's dtype: one launch

    def tree_rows(self, x: GrowInputs, depth: int, on_level: Callable[[int], None] = lambda depth: None
                  ) -> torch.Tensor:
        """The pools of ``depth`` levels reranked on the device -> [B, 4, M] (drafters/eagle_rerank.py)."""
        return rerank(self.pool(x, depth, on_level), self.max_nodes)

    def _attention_bias(self, real: torch.Tensor, K: int, width: int, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The growth's attention mask as an additive bias in the layer's dtype, made once per call: [B, K, W] (W:
        ``width`` rounded up to BIAS_ALIGN columns), 0 on each sequence's cached keys ``real`` [B, P] and -inf on
        its padding; on the tree's columns 0 for a chain (every earlier level is its one query's ancestor), else
        -inf until a level opens them; and the [K, K] block that opens a level's own columns (0 on the diagonal;
        None for a chain). Levels read its first columns, a view whose row stride stays aligned, so CUDA's
        attention takes it as it is: a boolean mask of a new width each level was converted and padded there, a
        few kernels a level."""
        bias = cached_keys_bias(real, K, width, dtype)
        if self.chain:
            bias[:, :, real.shape[1]:] = 0.0
        itself = None if self.chain else torch.full((K, K), float("-inf"), dtype=dtype,
                                                    device=real.device).fill_diagonal_(0.0)
        return bias, itself

    def pool(self, x: GrowInputs, depth: int, on_level: Callable[[int], None] = lambda depth: None) -> torch.Tensor:
        """The candidate pools of ``depth`` levels -> [B, 4, S] float64 (module doc; S = K + (depth - 1) K^2).
        ``on_level(d)`` runs after level d is queued (the eager drafter's level timing)."""
        model, K = self.model, self.top_k
        B, P = x.real.shape
        dev, dtype = x.h_root.device, x.past_k.dtype
        h_root = x.h_root
        values, indices = top_k(self.token_logp(h_root[:, None], x.root_pos, 1, x.noise_keys)[:, 0], K)
        tok, cum, cond = [indices], [values], [values]
        chain = self.chain
        if not chain:
            parent = [torch.full((B, K), -1, dtype=torch.long, device=dev)]
            size = K  # pool entries so far
            frontier = torch.arange(K, device=dev).expand(B, K)  # pool indices expanded next
        front_tok, front_cum = indices, values  # [B, K] their tokens, cumulative log-probabilities
        feats = h_root[:, None].expand(B, K, h_root.shape[-1])  # [B, K, H] the feature each query reads: its parent's
        if depth > 1:
            bias, itself = self._attention_bias(x.real, K, P + (depth - 1) * K, dtype)
            # every level's RoPE tables at once: level d's queries sit at root_pos + d - 1
            positions = x.root_pos[:, None] + torch.arange(1, depth, device=dev)
            cos, sin = model.rope(positions, dtype) if x.rope_table is None else x.rope_table[:, positions]
            # the call's keys / values: the cached ones, then each level's K as it is expanded (columns never read
            # before they are written), each repeated for its query heads once, not at every level
            c = model.config
            groups = c.num_heads // c.num_kv_heads
            keys = [t.new_empty(B, c.num_heads, P + (depth - 1) * K, c.head_dim) for t in (x.past_k, x.past_v)]
            for buf, cached in zip(keys, (x.past_k, x.past_v), strict=True):
                buf[:, :, :P].unflatten(1, (c.num_kv_heads, groups)).copy_(cached[:, :, None].expand(
                    B, c.num_kv_heads, groups, P, c.head_dim))
        on_level(1)
        for d in range(2, depth + 1):
            embeds = F.embedding(front_tok if self.draft_ids is None else self.draft_ids[front_tok], self.embed)
            rope = (cos[:, d - 2, None].expand(B, K, -1), sin[:, d - 2, None].expand(B, K, -1))  # [B, K, head_dim]
            width = P + (d - 1) * K  # the cached keys, then levels 2..d's
            if not chain:  # the level's queries see themselves: the last K columns' diagonal
                bias[:, :, width - K : width] = itself
            out, _, _ = model(embeds, feats.to(dtype), None, bias[:, :, :width], fused=self.fused, rope=rope,
                              into=(*keys, P + (d - 2) * K))
            child_lp, child_tok = top_k(self.token_logp(out, x.root_pos, d, x.noise_keys), K)  # [B, K rows, K]
            child_cum = (front_cum[..., None] + child_lp).flatten(1)  # float32 sums, as the tree's scores
            child_tok, child_lp = child_tok.flatten(1), child_lp.flatten(1)  # [B, K * K]
            tok.append(child_tok), cum.append(child_cum), cond.append(child_lp)
            if chain:  # the one child is the next frontier, as it is (its row of the bias already fits)
                front_tok, front_cum, feats = child_tok, child_cum, out
            else:
                parent.append(frontier.repeat_interleave(K, dim=1))  # child j of row j // K
                # the K best children by cumulative log-probability (ties: the first, a stable sort), in pool order
                order = torch.sort(torch.sort(-child_cum, dim=1, stable=True).indices[:, :K], dim=1).values  # [B, K]
                rows = order // K  # the row of ``out`` each new frontier node's parent is
                frontier, size = size + order, size + K * K
                front_tok, front_cum = child_tok.gather(1, order), child_cum.gather(1, order)
                feats = out.gather(1, rows[..., None].expand(B, K, out.shape[-1]))
                # a child sees what its parent saw, and its parent: the parent's row (the columns past this level's
                # are still masked)
                bias = bias.gather(1, rows[..., None].expand(B, K, bias.shape[-1]))
            on_level(d)
        # a chain's parents: the root, then each level's one node
        parents = torch.arange(-1, depth - 1, device=dev).expand(B, depth) if chain else torch.cat(parent, dim=1)
        fields = (torch.cat(tok, dim=1), parents, torch.cat(cum, dim=1), torch.cat(cond, dim=1))
        return torch.stack([f.to(torch.float64) for f in fields], dim=1)
