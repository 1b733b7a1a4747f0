"""specdec.pending_trees: a tree's depths and ancestor bits computed on the device equal DraftTree's, a chain's
constant ones equal those computed, and a PendingTrees refuses fields that do not hold its nodes."""
from __future__ import annotations

import pytest
import torch

from specdec.pending_trees import PendingTrees, chain_fields, tree_fields
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


def test_a_chains_constant_fields_are_the_tree_fields_of_its_parents():
    """chain_fields (made on the host, no pointer doubling) equal tree_fields of parents j - 1, for every depth up
    to 64 (bit 63, the int64 sign) and any batch, each a contiguous [batch, length] tensor; past 64 it refuses."""
    for length in (1, 2, 6, 7, 64):
        for batch in (1, 3, 8):
            parents = torch.arange(-1, length - 1).expand(batch, length)
            depths, bits = chain_fields(batch, length, "cpu")
            assert depths.shape == bits.shape == (batch, length) and depths.is_contiguous() and bits.is_contiguous()
            assert [t.tolist() for t in (depths, bits)] == [t.tolist() for t in tree_fields(parents, length)]
    assert chain_fields(2, 64, "cpu")[1][0, -1].item() == -1  # all 64 bits
    with pytest.raises(ValueError, match="at most 64 nodes"):
        chain_fields(1, 65, "cpu")


def test_pending_trees_fields_must_hold_every_node():
    three = torch.zeros(3, dtype=torch.long)
    PendingTrees((2, 0, 1), three, three, three, 2, list, lambda: 0.0)
    nobody = PendingTrees.none(2, torch.device("cpu"), lambda: [DraftTree.empty(), DraftTree.empty()])
    assert nobody.num_nodes == (0, 0) and nobody.tokens.numel() == 0 and nobody.seconds() == 0.0
    with pytest.raises(ValueError, match="depths must be"):
        PendingTrees((2, 0, 2), torch.zeros(4, dtype=torch.long), three, three, 2, list, lambda: 0.0)
