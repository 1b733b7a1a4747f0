"""Row invariance, checked: a runner's logits for tree rows of a batched verify forward vs one-row decoding.

:func:`batched_tree_logits` prefills several prompts in ONE forward and verifies a draft tree per sequence in
ONE forward (root + nodes of every sequence, as the engine does); :func:`decoded_logits` computes each of those
rows alone, as plain decoding does: its prompt prefilled alone, then the path from the root to the node
decoded one row per forward; :func:`alone_logits` recomputes each batched row by a one-row forward over the same
cache. In the bit-exact mode (``runner.invariant_mode(True)``) they are bitwise equal:

    batched = batched_tree_logits(runner, prompts, trees)
    all(torch.equal(b, decoded_logits(runner, p, t)) for p, t, b in zip(prompts, trees, batched))   # invariant
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.attention import BatchBuilder
from specdec.kv_cache import PagedKVCache, blocks_for
from specdec.tree import DraftTree

BLOCK_SIZE = 16


def _cache(runner, num_tokens: Sequence[int]) -> PagedKVCache:
    s = runner.shape
    blocks = sum(blocks_for(n, BLOCK_SIZE) + 1 for n in num_tokens)
    return PagedKVCache(s.num_layers, s.num_kv_heads, s.head_dim, blocks, BLOCK_SIZE, runner.dtype, runner.device,
                        runner.backend)


def _prefill(runner, cache: PagedKVCache, prompts: Sequence[Sequence[int]], first_id: int = 0) -> None:
    """Every prompt but its last token (the root), all sequences in one forward, committed."""
    todo = [(first_id + i, list(p)) for i, p in enumerate(prompts) if len(p) > 1]
    for i in range(len(prompts)):
        cache.add(first_id + i)
    if not todo:
        return
    cache.reserve_many({sid: len(p) - 1 for sid, p in todo})
    builder = BatchBuilder(cache, runner.device)
    for sid, p in todo:
        builder.add(sid, p[:-1], range(len(p) - 1), num_keys=len(p) - 1, num_visible=0)
    batch = builder.build()
    runner.forward(batch.token_ids, batch.positions, batch.plan, cache, None)
    cache.commit({sid: range(len(p) - 1) for sid, p in todo})


def batched_tree_logits(runner, prompts: Sequence[Sequence[int]], trees: Sequence[DraftTree]
                        ) -> list[torch.Tensor]:
    """Per sequence [1 + num_nodes, vocab] float32 logits of its root and tree nodes, all sequences prefilled in
    one forward and verified in one forward."""
    cache = _cache(runner, [len(p) + t.num_nodes for p, t in zip(prompts, trees, strict=True)])
    return _verify(runner, cache, prompts, trees)


def _verify(runner, cache: PagedKVCache, prompts: Sequence[Sequence[int]], trees: Sequence[DraftTree]
            ) -> list[torch.Tensor]:
    _prefill(runner, cache, prompts)
    cache.reserve_many({i: 1 + t.num_nodes for i, t in enumerate(trees)})
    builder = BatchBuilder(cache, runner.device)
    for i, (p, tree) in enumerate(zip(prompts, trees, strict=True)):
        root, cached = len(p) - 1, len(p) - 1
        tokens = [p[-1]] + tree.tokens.tolist()
        positions = [root] + [root + d for d in tree.depth_list]
        if tree.num_nodes:
            bits = torch.tensor([0] + tree.ancestor_bit_list, dtype=torch.long)
            builder.add(i, tokens, positions, cached + len(tokens), cached + 1, bits)
        else:
            builder.add(i, tokens, positions, cached + 1, cached)
    batch = builder.build()
    rows = torch.arange(batch.token_ids.numel(), device=batch.token_ids.device)
    logits = runner.forward(batch.token_ids, batch.positions, batch.plan, cache, rows).logits
    return [logits[list(r)] for r in batch.rows]


def alone_logits(runner, prompts: Sequence[Sequence[int]], trees: Sequence[DraftTree]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(batched, alone): :func:`batched_tree_logits`, and each of those rows recomputed by a one-row forward over
    the same cache at the same position, seeing the same keys (nodes last to first, so that a row's rewrite of
    its own K/V reaches no row still to be computed)."""
    cache = _cache(runner, [len(p) + t.num_nodes for p, t in zip(prompts, trees, strict=True)])
    batched = _verify(runner, cache, prompts, trees)
    one = torch.zeros(1, dtype=torch.long, device=runner.device)
    alone = []
    for i, (p, tree) in enumerate(zip(prompts, trees, strict=True)):
        cached, tokens, bits = len(p) - 1, tree.tokens.tolist(), tree.ancestor_bit_list
        rows = [None] * (1 + tree.num_nodes)
        for r in range(tree.num_nodes - 1, -2, -1):
            builder = BatchBuilder(cache, runner.device)
            if r < 0:
                builder.add(i, [p[-1]], [cached], cached + 1, cached)
            else:
                builder.add(i, [tokens[r]], [cached + tree.depth_list[r]], cached + 2 + r, cached + 1,
                            torch.tensor([bits[r]], dtype=torch.long))
            batch = builder.build()
            rows[r + 1] = runner.forward(batch.token_ids, batch.positions, batch.plan, cache, one).logits[0]
        alone.append(torch.stack(rows))
    return batched, alone


def decoded_logits(runner, prompt: Sequence[int], tree: DraftTree) -> torch.Tensor:
    """[1 + num_nodes, vocab] float32: the root's and each node's logits as plain decoding computes them (the
    prompt prefilled alone, the path to the node decoded one token per forward)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    rows = []
    for node in range(-1, tree.num_nodes):
        path = []
        j = node
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        seq = list(prompt) + path[::-1]
        cache = _cache(runner, [len(seq)])
        _prefill(runner, cache, [list(prompt)])
        out = None
        for pos in range(len(prompt) - 1, len(seq)):
            cache.reserve(0, 1)
            builder = BatchBuilder(cache, runner.device)
            builder.add(0, [seq[pos]], [pos], pos + 1, pos)
            batch = builder.build()
            out = runner.forward(batch.token_ids, batch.positions, batch.plan, cache,
                                 torch.zeros(1, dtype=torch.long, device=runner.device)).logits
            cache.commit({0: [0]})
        rows.append(out[0])
    return torch.stack(rows)


def random_tree(num_nodes: int, vocab_size: int, gen: torch.Generator) -> DraftTree:
    """A random draft tree of ``num_nodes`` nodes (parents uniform over the earlier nodes and the root)."""
    parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(num_nodes)]
    tokens = torch.randint(vocab_size, (num_nodes,), generator=gen)
    return DraftTree(tokens, torch.tensor(parents, dtype=torch.long))
