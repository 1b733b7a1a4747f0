"""What outlives a generate() call: a dropped target is freed though an EAGLE head (loaded once by path=, its CUDA-graph
buckets kept on it) or a drafter object reused across calls remains; a drafter's own KV cache of the call is freed at
its end; a reused drafter drafts as a fresh one."""
from __future__ import annotations

import gc
import weakref

import torch
from specdec.drafters import loaded_once
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_checkpoint import save_eagle
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.self_draft import SelfDraftDrafter

from specdec.generate import generate
from specdec.testing import RandomTreeDrafter, build_tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 10, 11, 12, 10, 11]]


def _target(seed: int):
    return build_tiny_model("llama-mha-untied", seed=seed)


def _head(target) -> EagleModel:
    torch.manual_seed(0)
    head = EagleModel(EagleConfig.for_target(target.config, depth=2, top_k=2, max_nodes=3))
    head.init_from_target(target)
    return head


def _refs(model) -> list[weakref.ref]:
    return [weakref.ref(model), weakref.ref(model.get_input_embeddings().weight), weakref.ref(model.lm_head.weight)]


def test_a_dropped_target_is_freed_while_the_eagle_head_keeps_its_graphs(tmp_path):
    """The EAGLE head loaded by path= is kept by the process (drafters/loaded_once.py), and its CUDA-graph buckets
    (eagle_graphs: the CUDA default, taken uncaptured here) kept on it held each target's embeddings and LM head:
    a server swapping targets kept the last four dropped ones' (gigabytes each at a real vocabulary). The buckets
    still serve later calls over the same target and head."""
    save_eagle(_head(_target(0)), tmp_path / "eagle")
    options = {"path": str(tmp_path / "eagle"), "cuda_graphs": True}
    dropped = []
    try:
        for seed in (1, 2):
            target = _target(seed)
            kept = []
            for _ in range(2):
                drafter = EagleDrafter(**options)
                out = generate(target, PROMPTS, max_new_tokens=8, drafter=drafter, speculation="always")
                kept.append(drafter.graphs)
            assert out == generate(target, PROMPTS, max_new_tokens=8)
            assert kept[0] is kept[1] and kept[0].replays > 0  # the second call replayed the first call's buckets
            dropped.append(_refs(target))
            del target, drafter, kept
            gc.collect()
            assert [[r() is not None for r in refs] for refs in dropped] == [[False] * 3] * len(dropped)
        head, = (m for key, m in loaded_once._LOADED.items() if key[1] == str((tmp_path / "eagle").resolve()))
        assert head.__dict__.get("_specdec_eagle_graphs") == {}  # the buckets went with their targets
    finally:
        loaded_once.forget()


def test_a_reused_drafter_object_keeps_no_target_and_no_cache_of_the_call():
    """A drafter object kept across calls (one per server worker) held the last call's TargetView, so the target
    model outlived the caller's reference, and a draft-model drafter its own KV pool sized for the call's worst case
    until its next call. Both drafters still draft as before in the next call."""
    small = build_tiny_model(seed=5, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
    draft_model = DraftModelDrafter(small, num_draft_tokens=3)
    eagle = EagleDrafter(model=_head(build_tiny_model()), cuda_graphs=True)
    for drafter in (draft_model, eagle):
        for seed in (0, 1):
            target = build_tiny_model(seed=seed)
            out = generate(target, PROMPTS, max_new_tokens=12, drafter=drafter, speculation="always",
                           return_dict=True)
            assert out.sequences == generate(target, PROMPTS, max_new_tokens=12) and out.tau > 1
            refs = _refs(target)
            del target, out
            gc.collect()
            assert [r() is not None for r in refs] == [False] * 3, drafter.name
    assert draft_model.cache is None and draft_model.runner is not None


def _reused_drafters() -> dict:
    from specdec.drafters.combined import CombinedDrafter
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
    from specdec.drafters.ngram import NGramDrafter

    config = build_tiny_model().config
    small = dict(seed=5, num_hidden_layers=1)
    return {
        "ngram": NGramDrafter(),
        "medusa (the target's LM head)": MedusaDrafter(heads=MedusaHeads(MedusaConfig(
            2, 1, config.hidden_size, config.vocab_size, shared_lm_head=True)), tree="dynamic"),
        "eagle, its depth chosen by the policy's costs": EagleDrafter(model=_head(build_tiny_model())),
        "combined, a draft-model child and a measured curve": CombinedDrafter(
            [DraftModelDrafter(build_tiny_model(**small), num_draft_tokens=3), "ngram"], cost_model=True),
    }


def test_no_reused_drafter_keeps_a_dropped_target():
    """The default detach kept the TargetView (n-gram, Medusa, any drafter that does not override it); Medusa kept
    the target's LM head; EAGLE's depth chooser and the combined drafter's gate kept the policy's costs, which hold
    the target's runner; the combined drafter detached none of its children (a draft-model child kept its KV pool)."""
    for name, drafter in _reused_drafters().items():
        target = build_tiny_model(seed=1)
        generate(target, PROMPTS, max_new_tokens=8, drafter=drafter)  # speculation="auto": the policy's costs
        refs = _refs(target)
        del target
        gc.collect()
        assert [r() is not None for r in refs] == [False] * 3, name
        children = getattr(drafter, "children", [])
        assert all(getattr(child, "cache", None) is None for child in children), name


def test_a_dropped_target_is_freed_at_once_not_at_the_next_garbage_collection():
    """The engine kept a bound method of itself (its acceptor), and a self-draft drafter the call's TargetView, whose
    policy costs hold the drafter: reference cycles that kept each call's engine and target until Python's next
    full collection, so ``del model`` (then torch.cuda.empty_cache()) freed nothing. A self-draft drafter reused
    across calls kept its runner over the last target's layers, and so that target, for good."""
    reused = SelfDraftDrafter(num_layers=1)
    for drafter, options in ((None, None), ("ngram", None), ("self-draft", {"num_layers": 1}), (reused, None)):
        kw = dict(max_new_tokens=8, drafter=drafter, drafter_options=options)
        generate(build_tiny_model(seed=1), PROMPTS, **kw)  # what a first call sets up
        gc.collect()
        gc.disable()
        try:
            target = build_tiny_model(seed=2)
            generate(target, PROMPTS, **kw)
            refs = _refs(target)
            del target
            alive = [r() is not None for r in refs]
        finally:
            gc.enable()
        assert alive == [False] * 3, drafter


def test_a_draft_model_drafters_own_cache_is_freed_when_its_call_ends():
    """Freed at once (the caller may still hold the object): its storage, not only the drafter's reference."""
    small = build_tiny_model(seed=5, num_hidden_layers=1)
    drafter = DraftModelDrafter(small, num_draft_tokens=3)
    seen = []
    real = DraftModelDrafter._own_cache

    def recorded(self):
        seen.append(real(self))
        return seen[-1]

    DraftModelDrafter._own_cache = recorded
    try:
        generate(build_tiny_model(), PROMPTS, max_new_tokens=8, drafter=drafter, speculation="always")
    finally:
        DraftModelDrafter._own_cache = real
    assert len(seen) == 1 and seen[0].kv.numel() == 0 and seen[0].num_blocks == 0 and drafter.cache is None


def test_a_reused_random_tree_drafter_drafts_as_a_fresh_one():
    """specdec.testing.RandomTreeDrafter (offered to drafter authors) seeded its draws once, in __init__, so a
    reused object's seeded text depended on the calls before it, against the drafter contract."""
    model = build_tiny_model()
    kw = dict(max_new_tokens=24, do_sample=True, seed=3, speculation="always")
    for mode in ("deterministic", "independent"):
        fresh = generate(model, PROMPTS, drafter=RandomTreeDrafter(96, mode=mode), **kw)
        reused = RandomTreeDrafter(96, mode=mode)
        generate(model, PROMPTS, drafter=reused, max_new_tokens=24)  # an earlier greedy call with the same object
        assert generate(model, PROMPTS, drafter=reused, **kw) == fresh, mode
