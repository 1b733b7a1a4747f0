"""specdec.pending_trees: a tree's depths and ancestor bits computed on the device equal DraftTree's, and a
PendingTrees refuses fields that do not hold its nodes."""
from __future__ import annotations

import pytest
import torch

from specdec.pending_trees import PendingTrees, tree_fields
from specdec.tree import DraftTree


def test_tree_fields_equal_the_draft_trees_depths_and_bits():
    gen = torch.Generator().manual_seed(0)
    for batch, nodes in ((1, 1), (1, 2), (3, 16), (4, 64)):
        for shape in ("random", "chain", "star"):
            parents = torch.full((batch, nodes), -1, dtype=torch.long)
            for i in range(1, nodes):
                if shape == "random":
                    parents[:, i] = torch.randint(-1, i, (batch,), generator=gen)
                elif shape == "chain":  # 64 deep: bit 63 is the int64 sign
                    parents[:, i] = i - 1
            trees = [DraftTree(torch.zeros(nodes, dtype=torch.long), p) for p in parents]
            depths, bits = tree_fields(parents, max(t.max_depth for t in trees))
            assert depths.tolist() == [t.depth_list for t in trees], (batch, nodes, shape)
            assert bits.tolist() == [t.ancestor_bit_list for t in trees], (batch, nodes, shape)


def test_pending_trees_fields_must_hold_every_node():
    three = torch.zeros(3, dtype=torch.long)
    PendingTrees((2, 0, 1), three, three, three, 2, list, lambda: 0.0)
    nobody = PendingTrees.none(2, torch.device("cpu"), lambda: [DraftTree.empty(), DraftTree.empty()])
    assert nobody.num_nodes == (0, 0) and nobody.tokens.numel() == 0 and nobody.seconds() == 0.0
    with pytest.raises(ValueError, match="depths must be"):
        PendingTrees((2, 0, 2), torch.zeros(4, dtype=torch.long), three, three, 2, list, lambda: 0.0)
