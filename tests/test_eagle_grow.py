"""EAGLE's tree growth (drafters/eagle_grow.py) against the layer run along each node's path, the layout of the
attention bias its levels read, which nodes a level expands, and the scores its trees carry."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.eagle_grow import BIAS_ALIGN, GrowInputs, TreeGrower
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from torch.nn import functional as F

from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model

B, P = 3, 9  # cached key columns: 9, 4 and 0 of them a sequence's own (the rest padding)


def _grower(top_k: int, seed: int = 0, fused=None) -> tuple[TreeGrower, GrowInputs]:
    model = build_tiny_model()
    torch.manual_seed(seed)
    eagle = EagleModel(EagleConfig.for_target(model.config)).eval()
    c, gen = eagle.config, torch.Generator().manual_seed(seed + 1)
    x = GrowInputs(torch.randn(B, c.hidden_size, generator=gen),
                   torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen),
                   torch.randn(B, c.num_kv_heads, P, c.head_dim, generator=gen),
                   torch.arange(P)[None] < torch.tensor([[9], [4], [0]]), torch.tensor([20, 8, 3]),
                   torch.tensor([5, 6, 7]))
    grower = TreeGrower(eagle, model.get_input_embeddings().weight.detach(),
                        model.get_output_embeddings().weight.detach(), SamplingConfig(), None, top_k, c.vocab_size,
                        max_nodes=64, fused=fused)
    return grower, x


def _along_path(grower: TreeGrower, x: GrowInputs, b: int, path: list[int]) -> torch.Tensor:
    """Log-probabilities [V] of the children of the node reached by ``path`` (its tokens from depth 1 down) in
    sequence ``b``: the layer run one token at a time over the path, each seeing the sequence's own cached keys and
    the path's earlier tokens, nothing of the rest of the tree."""
    model, own = grower.model, x.real[b]
    past_k, past_v = x.past_k[b : b + 1, :, own], x.past_v[b : b + 1, :, own]
    feature = x.h_root[b][None, None]
    for i, token in enumerate(path):
        position = x.root_pos[b] + 1 + i  # depth 1 sits right after the root
        mask = torch.ones(1, 1, past_k.shape[2] + 1, dtype=torch.bool)
        feature, k, v = model(F.embedding(torch.tensor([[token]]), grower.embed), feature, position.view(1, 1), mask,
                              past_k, past_v)
        past_k, past_v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
    return grower.token_logp(feature, x.root_pos[b : b + 1], len(path) + 1, x.noise_keys[b : b + 1])[0, 0]


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_every_node_is_scored_as_the_layer_run_along_its_path_scores_it(top_k):
    """Each pool entry's conditional log-probability is the one the layer gives it after its own path alone (its
    sequence's real cached keys, its ancestors, itself): a level seeing a sibling's or a cousin's keys, a padding
    column, or missing an ancestor changes it. Sequence 2 has no cached key of its own."""
    grower, x = _grower(top_k)
    depth = 4
    with torch.inference_mode():
        pool = grower.pool(x, depth)
        for b in range(B):
            tokens, parents, cum, cond = (pool[b, i].tolist() for i in range(4))
            checked = 0
            for j, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
                path, up = [], int(parent)
                while up >= 0:
                    path.insert(0, int(tokens[up]))
                    up = int(parents[up])
                expected = _along_path(grower, x, b, path)[int(token)]
                torch.testing.assert_close(torch.tensor(cond[j], dtype=torch.float64), expected.double(), rtol=1e-4,
                                           atol=1e-5, msg=f"sequence {b}, node {j}, path {path}")
                checked += len(path) == depth - 1
            assert checked >= top_k  # the deepest level's nodes were among them


@pytest.mark.parametrize("top_k", [1, 3], ids=["chain", "tree"])
def test_levels_read_an_additive_bias_the_gpu_attention_takes_as_it_is(sdpa_masks, top_k):
    """Every level of the growth passes the attention an additive bias in the queries' dtype whose strides are
    multiples of BIAS_ALIGN (a boolean mask, or one of another width each level, is converted and padded by CUDA's
    memory-efficient attention: a few kernels per level inside the drafting's graph), and it masks what the
    boolean mask did."""
    grower, x = _grower(top_k)
    seen = sdpa_masks
    with torch.inference_mode():
        grower.pool(x, 4)
    assert len(seen) == 3  # levels 2..4
    for level, (dtype, mask) in enumerate(seen, start=2):
        assert mask.dtype == dtype and mask.stride(-1) == 1
        assert all(s % BIAS_ALIGN == 0 for s in mask.stride()[:-1]), mask.stride()
        assert mask.shape[-1] == P + (level - 1) * top_k
        own = mask[:, 0, :, :P] == 0  # [B, K, P]: each query sees its sequence's own cached keys, no padding
        assert torch.equal(own, x.real[:, None].expand_as(own))
        assert set(mask.unique().tolist()) <= {0.0, float("-inf")}


def test_each_level_expands_its_best_nodes_by_cumulative_probability():
    """The nodes a level expands are its top_k by cumulative log-probability (the pool's scoring test passed with
    the worst ones expanded: the tree then never got past depth 2)."""
    grower, x = _grower(3)
    with torch.inference_mode():
        pool = grower.pool(x, 4)
    for b in range(B):
        tokens, parents, cum = pool[b, 0].tolist(), [int(p) for p in pool[b, 1].tolist()], pool[b, 2].tolist()
        depth = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        for d in range(1, max(depth)):
            level = [j for j in range(len(tokens)) if depth[j] == d]
            expanded = {p for j, p in enumerate(parents) if depth[j] == d + 1}
            best = sorted(level, key=lambda j: -cum[j])[: grower.top_k]
            assert expanded == set(best), (b, d, expanded, best)


def test_sampled_draft_logprobs_are_at_the_targets_temperature():
    """Standard sampling at temperature 0.5: the layer's log-probabilities (which rank the tree and become its
    scores) are log_softmax(logits / 0.5); the coupled tests take another branch."""
    grower, _ = _grower(3)
    grower.sampling = SamplingConfig(True, 0.5)
    features = torch.randn(1, 2, grower.model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got = grower.token_logp(features, torch.tensor([5]), 1, torch.tensor([0]))
        want = F.log_softmax(grower.model.logits(features, grower.lm_head, None).float() / 0.5, dim=-1)
    torch.testing.assert_close(got, want)


def test_an_eagle_trees_scores_are_each_nodes_probability_under_its_parent():
    """Not the path's cumulative probability: the sizer multiplies scores along a path."""
    import math
    from types import SimpleNamespace

    from specdec.drafters.eagle import EagleDrafter

    cond = [0.5, 0.4, 0.3]
    pools = torch.tensor([[[3.0, 4.0, 5.0], [-1.0, 0.0, 0.0], [math.log(0.5), math.log(0.2), math.log(0.15)],
                           [math.log(c) for c in cond]]])
    tree = EagleDrafter._trees(SimpleNamespace(draft_ids=None), pools)[0]
    assert tree.tokens.tolist() == [3, 4, 5] and tree.parents.tolist() == [-1, 0, 0]
    torch.testing.assert_close(tree.scores, torch.tensor(cond))
