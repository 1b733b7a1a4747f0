"""The "medusa" drafter: Medusa heads on the target's last hidden state propose a token tree.

    generate(model, ids, drafter="medusa", drafter_options={"path": "heads/"})
    generate(model, ids, drafter=MedusaDrafter(heads=my_heads, tree="dynamic", max_nodes=32))

Each step the engine hands over the target's final-norm hidden state of the token before
the root (``SequenceView.last_hidden``); head ``i`` scores the tokens at depth ``i + 1``.
Candidates are chosen deterministically (top-k), so the rejection sampler keeps greedy and
sampled output exactly the target's; typical acceptance is deliberately not offered.

Trees:

* ``static``: ``medusa_choices``, a list of top-k paths: ``(2, 0)`` is the best token of
  head 1 under the third-best token of head 0. Every prefix of a path must be listed.
  Default: the checkpoint's saved choices, else a dynamic tree.
* ``dynamic``: per sequence, the ``max_nodes`` paths with the highest product of head
  probabilities (top ``top_k`` tokens per head), grown depth by depth.
"""
from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

import torch
from specdec.drafters.base import Drafter, SequenceView, TargetView
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaHeads, load_medusa

from specdec.tree import MAX_TREE_NODES, DraftTree

logger = logging.getLogger(__name__)


def validate_choices(choices: Sequence[Sequence[int]], num_heads: int) -> tuple[tuple[int, ...], ...]:
    """Sort by (depth, path); raise ValueError for a missing prefix, a path too deep, or too many nodes."""
    paths = sorted({tuple(int(k) for k in p) for p in choices}, key=lambda p: (len(p), p))
    if not paths:
        raise ValueError("medusa_choices is empty")
    if len(paths) > MAX_TREE_NODES:
        raise ValueError(f"medusa_choices has {len(paths)} paths; a tree holds at most {MAX_TREE_NODES} nodes")
    known = set()
    for p in paths:
        if not p or min(p) < 0:
            raise ValueError(f"medusa_choices path {list(p)} must be a non-empty list of ranks >= 0")
        if len(p) > num_heads:
            raise ValueError(f"medusa_choices path {list(p)} is deeper than the {num_heads} Medusa heads")
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"medusa_choices path {list(p)} lacks its prefix {list(p[:-1])}")
        known.add(p)
    return tuple(paths)


class MedusaDrafter(Drafter):
    name = "medusa"
    needs_hidden_states = True

    def __init__(self, path: str | None = None, heads: MedusaHeads | None = None, tree: str | None = None,
                 medusa_choices: Sequence[Sequence[int]] | None = None, max_nodes: int = 32, top_k: int = 8) -> None:
        if (path is None) == (heads is None):
            raise ValueError("medusa: give exactly one of path= (a checkpoint directory) or heads= (MedusaHeads)")
        if not 1 <= max_nodes <= MAX_TREE_NODES or top_k < 1:
            raise ValueError(f"medusa: max_nodes must be in [1, {MAX_TREE_NODES}] and top_k >= 1")
        if tree not in (None, "static", "dynamic"):
            raise ValueError(f"medusa: tree must be 'static' or 'dynamic', got {tree!r}")
        self.path, self.heads = path, heads
        self.max_nodes, self.top_k = max_nodes, top_k
        self.tree, self.choices = tree, medusa_choices

    def attach(self, target: TargetView) -> None:
        self.target = target
        shape = target.runner.shape
        if self.heads is None:
            self.heads = load_medusa(self.path, shape.hidden_size, shape.vocab_size,
                                     dtype=target.runner.dtype, device=target.runner.device)
        cfg = self.heads.config
        for name, want in (("hidden_size", shape.hidden_size), ("vocab_size", shape.vocab_size)):
            if getattr(cfg, name) != want:
                raise MedusaCheckpointError(f"medusa: heads have {name}={getattr(cfg, name)}, the target has {want}")
        choices = self.choices if self.choices is not None else (cfg.medusa_choices or None)
        if self.tree == "static" and choices is None:
            raise ValueError("medusa: tree='static' needs medusa_choices (none given, none saved in the checkpoint)")
        self.tree = self.tree or ("static" if choices is not None else "dynamic")
        self.paths = validate_choices(choices, cfg.num_heads) if self.tree == "static" else ()
        self.lm_head = target.runner.lm_head if cfg.shared_lm_head else None

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        ready = [i for i, v in enumerate(seqs) if v.last_hidden is not None]
        trees = [DraftTree.empty() for _ in seqs]
        if not ready:
            return trees
        hidden = torch.stack([seqs[i].last_hidden for i in ready]).to(self.target.runner.dtype)
        logits = self.heads(hidden, self.lm_head)  # [num_heads, B, vocab]
        depth = len(self.paths[-1]) if self.tree == "static" else self.heads.config.num_heads
        k = max((max(p) for p in self.paths), default=0) + 1 if self.tree == "static" else self.top_k
        top = torch.topk(logits[:depth].float().log_softmax(-1), k, dim=-1)  # [depth, B, k]
        top_tokens, top_logp = top.indices.tolist(), top.values.tolist()
        for b, i in enumerate(ready):
            tok_b = [top_tokens[d][b] for d in range(depth)]  # [depth][k]
            if self.tree == "static":
                trees[i] = self._static(tok_b)
            else:
                trees[i] = self._dynamic(tok_b, [top_logp[d][b] for d in range(depth)])
        return trees

    def _static(self, tok: list[list[int]]) -> DraftTree:
        index = {}
        tokens, parents = [], []
        for p in self.paths:
            index[p] = len(tokens)
            tokens.append(tok[len(p) - 1][p[-1]])
            parents.append(index[p[:-1]] if len(p) > 1 else -1)
        return DraftTree(tokens, parents)

    def _dynamic(self, tok: list[list[int]], logp: list[list[float]]) -> DraftTree:
        """Best-first: pop the most probable path, push its extensions, until max_nodes."""
        tokens, parents = [], []
        heap = [(-logp[0][r], (r,), -1) for r in range(len(tok[0]))]
        heapq.heapify(heap)
        while heap and len(tokens) < self.max_nodes:
            neg, path, parent = heapq.heappop(heap)
            node = len(tokens)
            tokens.append(tok[len(path) - 1][path[-1]])
            parents.append(parent)
            if len(path) < len(tok):
                for r in range(len(tok[len(path)])):
                    heapq.heappush(heap, (neg - logp[len(path)][r], path + (r,), node))
        return DraftTree(tokens, parents)
