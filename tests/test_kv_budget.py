"""An explicit num_blocks below the request's worst case: draft trees are cut to the free KV blocks (exact), so a
drafter never changes the outcome; below what plain decoding holds, a warning, and the CacheFullError keeps the
tokens generated."""
from __future__ import annotations

import logging

import pytest

import specdec
from specdec.kv_cache import CacheFullError, blocks_needed, plain_blocks_needed
from specdec.testing import RandomTreeDrafter, build_tiny_model

PROMPT = [5, 6, 7, 8] * 8  # 32 tokens: with 64 new ones, plain decoding holds 95 positions, 6 blocks of 16


def wide_trees(seed: int = 0, mode: str = "deterministic") -> RandomTreeDrafter:
    return RandomTreeDrafter(96, max_nodes=24, max_depth=2, max_width=12, mode=mode, seed=seed)


@pytest.mark.parametrize("sampled", [False, True])
def test_wide_trees_near_the_end_are_cut_to_the_free_blocks(sampled):
    """6 blocks hold plain decoding's 64 new tokens exactly; wide trees near the end must be cut to the free blocks,
    not raise CacheFullError, and give plain decoding's tokens (greedy, and coupled sampling: its text does not
    depend on the trees)."""
    model = build_tiny_model()
    kw = dict(max_new_tokens=64, block_size=16, num_blocks=6)
    if sampled:
        kw.update(do_sample=True, temperature=0.8, seed=11, sampler="coupled")
    assert plain_blocks_needed([len(PROMPT)], 64, 16) == 6
    plain = specdec.generate(model, [PROMPT], **kw)
    assert len(plain[0]) == len(PROMPT) + 64
    mode = "independent" if sampled else "deterministic"
    out = specdec.generate(model, [PROMPT], drafter=wide_trees(0, mode), speculation="always", return_dict=True, **kw)
    assert out.sequences == plain
    assert max(out.stats[0].step_nodes) > 0  # the drafter's trees were verified, not all cut away


def test_a_ragged_batch_shares_the_free_blocks():
    """Two sequences in a pool of exactly plain decoding's size: each tree is cut to its share, the batch finishes
    with the plain tokens of each."""
    model = build_tiny_model()
    prompts = [PROMPT, [9, 10, 11] * 7]
    kw = dict(max_new_tokens=40, block_size=8, num_blocks=plain_blocks_needed(map(len, prompts), 40, 8))
    plain = specdec.generate(model, prompts, **kw)
    assert specdec.generate(model, prompts, drafter=wide_trees(1), speculation="always", **kw) == plain


def test_a_pool_below_plain_decoding_warns_and_the_error_keeps_the_tokens(caplog):
    """num_blocks=3 holds 48 positions of the 95 that plain decoding needs: a warning when the call is built, then a
    CacheFullError that carries the tokens generated until then (plain decoding's first ones)."""
    model = build_tiny_model()
    full = specdec.generate(model, [PROMPT], max_new_tokens=64)[0][len(PROMPT):]
    streamed = []
    with caplog.at_level(logging.WARNING, logger="specdec"):
        with pytest.raises(CacheFullError, match="17 tokens generated so far are in this error's new_tokens") as err:
            specdec.generate(model, [PROMPT], max_new_tokens=64, num_blocks=3, drafter=wide_trees(),
                             speculation="always", streamer=lambda seq, toks: streamed.extend(toks))
    assert any("num_blocks=3 is below the 6 blocks" in r.getMessage() and "CacheFullError" in r.getMessage()
               for r in caplog.records)
    assert err.value.new_tokens == [streamed] == [full[:17]]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec"):
        specdec.generate(model, [PROMPT], max_new_tokens=64, num_blocks=6)  # exactly enough: no warning
    assert not [r for r in caplog.records if "num_blocks" in r.getMessage()]


def test_a_pool_too_small_for_the_prompts_is_refused_before_any_work(caplog, monkeypatch):
    """num_blocks=1 cannot hold a 32-token prompt's prefill: the call warned that it "may raise CacheFullError", then
    measured the machine's verify costs for the drafter (minutes on a large model), then raised it at the prefill.
    It is now the CacheFullError alone (no tokens: new_tokens None), before the cost model or the drafter run."""
    from specdec import engine_setup

    model = build_tiny_model()
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda *a, **k: pytest.fail("costs measured first"))
    with caplog.at_level(logging.WARNING, logger="specdec"):
        with pytest.raises(CacheFullError, match="prefill and first step need 2 blocks of 16 tokens, num_blocks=1") \
                as err:
            specdec.generate(model, [PROMPT], max_new_tokens=8, num_blocks=1, drafter="ngram")
    assert err.value.new_tokens is None and not caplog.records
    monkeypatch.undo()
    out = specdec.generate(model, [PROMPT], max_new_tokens=1, num_blocks=2, drafter="ngram")  # the prefill's 2: runs
    assert len(out[0]) == len(PROMPT) + 1


def test_a_pool_that_holds_the_prefill_but_not_the_first_step_is_refused_before_any_work():
    """The check counted the prefill's positions (all but each prompt's last token), but the first step writes that
    last token for every sequence at once: a 17-token prompt in blocks of 4 ran its prefill in 4 blocks, then raised
    CacheFullError with no token. Refused before any forward now; 5 blocks give the token."""
    model = build_tiny_model()
    prompt = PROMPT[:17]
    with pytest.raises(CacheFullError, match="prefill and first step need 5 blocks of 4 tokens, num_blocks=4") as err:
        specdec.generate(model, [prompt], max_new_tokens=1, block_size=4, num_blocks=4)
    assert err.value.new_tokens is None
    out = specdec.generate(model, [prompt], max_new_tokens=1, block_size=4, num_blocks=5)
    assert out == specdec.generate(model, [prompt], max_new_tokens=1)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_drafter_writing_into_the_targets_cache_never_fails_a_call_plain_decoding_finishes(sampled):
    """Self-draft reserves its draft nodes' K/V in the target's own cache while it drafts: in a pool that holds plain
    decoding's 64 new tokens exactly, a step whose drafting finds no room decodes plainly, where the reservation
    raised CacheFullError. The tokens are plain decoding's (greedy, and coupled sampling)."""
    model = build_tiny_model()
    kw = dict(max_new_tokens=64, block_size=16, num_blocks=6)
    if sampled:
        kw.update(do_sample=True, temperature=0.8, seed=5, sampler="coupled")
    plain = specdec.generate(model, [PROMPT], **kw)
    options = dict(num_layers=1, num_draft_tokens=4, tree="dynamic", max_nodes=24)
    out = specdec.generate(model, [PROMPT], drafter="self-draft", drafter_options=options, speculation="always",
                           return_dict=True, **kw)
    assert out.sequences == plain and max(out.stats[0].step_nodes) > 0


def test_a_draft_model_short_of_blocks_for_a_level_proposes_the_levels_it_grew():
    """A draft model drafts in a cache of its own with the target's num_blocks: at plain decoding's pool a level of
    draft nodes found no block free near the end, the CacheFullError made every row's step plain for the rest of
    the call (9 forward passes where the default pool takes 4). The tree now ends at the levels grown."""
    model = build_tiny_model()
    prompts = [[3, 9, 27, 81], [5, 10, 15, 20, 25, 30, 35], [2] * 13, [7], [4, 5, 6, 4, 5, 6, 4, 5, 6]]
    kw = dict(max_new_tokens=30, block_size=4, speculation="always", return_dict=True,
              drafter="draft-model", drafter_options={"model": build_tiny_model(), "num_draft_tokens": 7})
    plain = specdec.generate(model, prompts, max_new_tokens=30)
    tight = specdec.generate(model, prompts, num_blocks=plain_blocks_needed(map(len, prompts), 30, 4), **kw)
    roomy = specdec.generate(model, prompts, **kw)
    assert tight.sequences == roomy.sequences == plain
    assert all(min(s.step_nodes) > 0 for s in tight.stats)  # every step verified a draft
    assert tight.forward_passes == roomy.forward_passes


def test_drafting_in_the_targets_cache_leaves_the_next_position_of_a_sequence_not_asked(monkeypatch):
    """Two sequences in a pool of exactly plain decoding's size, the guard asking only the second: self-draft's
    scratch reservation for it must not take the block the first one's plain step needs next (it once did, and the
    verify raised CacheFullError in a pool that plain decoding fits)."""
    from specdec.speculation_policy import SpeculationPolicy

    model = build_tiny_model()
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    kw = dict(max_new_tokens=3, block_size=1, num_blocks=plain_blocks_needed(map(len, prompts), 3, 1))
    plain = specdec.generate(model, prompts, **kw)
    monkeypatch.setattr(SpeculationPolicy, "who_drafts", lambda self, live: [s for s in live if s.seq_id == 1])
    options = dict(num_layers=1, num_draft_tokens=4)
    out = specdec.generate(model, prompts, drafter="self-draft", drafter_options=options, speculation="always", **kw)
    assert out == plain


def test_the_default_pool_holds_the_requests_worst_case_with_a_whole_tree():
    """Without num_blocks the pool is the request's worst case: the 32-token prompt, 8 new tokens, the bonus token and,
    with a drafter, a whole tree of MAX_TREE_NODES = 64 nodes on top. 32 + 8 + 1 = 41 positions: 3 blocks of 16;
    41 + 64 = 105: 7 blocks."""
    from specdec.engine_setup import build_engine
    from specdec.generate import prepare

    model = build_tiny_model()
    assert build_engine(prepare(model, [PROMPT], max_new_tokens=8)).cache.num_blocks == 3
    engine = build_engine(prepare(model, [PROMPT], drafter="ngram", max_new_tokens=8, speculation="always"))
    assert engine.cache.num_blocks == 7 and not engine.fit_free_blocks


def test_the_worst_case_pool_counts_the_bonus_token_and_plain_decoding_does_not_count_the_last_token():
    """8 new tokens, blocks of 4. Worst case of prompts of 8 and 3 tokens, no tree: 8 + 8 + 1 = 17 positions -> 5
    blocks, 3 + 8 + 1 = 12 -> 3 blocks: 8; a tree of 4 nodes: 21 -> 6 and 16 -> 4 blocks: 10. Plain decoding never
    runs the last new token; prompts of 9 and 3 tokens: 9 + 8 - 1 = 16 -> 4 blocks, 3 + 8 - 1 = 10 -> 3 blocks: 7."""
    assert blocks_needed([8, 3], 8, 4, 0) == 8
    assert blocks_needed([8, 3], 8, 4, 4) == 10
    assert plain_blocks_needed([9, 3], 8, 4) == 7
