"""Tests of the n-gram (prompt-lookup) drafter: matches, trie shape, incremental index."""
from __future__ import annotations

import dataclasses
import random

import pytest
from specdec.drafters.base import SequenceView, TokenView
from specdec.drafters.ngram import NGramConfig, NGramDrafter
from specdec.drafters.registry import get_drafter

from specdec.errors import InputError
from specdec.tree import DraftMode, DraftTree


def view(tokens, seq_id=0):
    return SequenceView(seq_id, tokens, len(tokens))


def propose1(drafter, tokens, seq_id=0) -> DraftTree:
    (tree,) = drafter.propose([view(tokens, seq_id)])
    return tree


def path_tokens(tree: DraftTree) -> list[list[int]]:
    return [tree.tokens[p].tolist() for p in tree.paths()]


def check_tree(tree: DraftTree, cfg: NGramConfig, vocab: int = 1000) -> None:
    """Structural invariants every n-gram proposal must satisfy."""
    tree.validate(vocab, drafter="ngram")
    assert tree.mode is DraftMode.DETERMINISTIC and tree.draft_probs is None
    assert tree.num_nodes <= cfg.max_nodes
    parents = tree.parents.tolist()
    assert all(-1 <= p < i for i, p in enumerate(parents))
    for kids in tree.children:
        toks = [int(tree.tokens[k]) for k in kids]
        assert len(toks) == len(set(toks)), f"duplicate siblings {toks}"
    if tree.num_nodes:
        assert tree.max_depth <= max(cfg.num_draft_tokens, cfg.long_draft_tokens)
        assert len(tree.children[0]) <= cfg.max_branches


def reference(tokens: list[int], cfg: NGramConfig) -> tuple[list[int], list[int]]:
    """Naive O(n^2) re-implementation of the documented semantics, from scratch each call."""
    L = len(tokens)
    node_of: dict[tuple[int, ...], int] = {}  # token path from the root -> node index
    out_tokens: list[int] = []
    out_parents: list[int] = []
    branches = 0
    for n in range(cfg.max_ngram, cfg.min_ngram - 1, -1):
        if n > L - 1:
            continue
        key = tokens[L - n :]
        occ = [e for e in range(n - 1, L - 1) if tokens[e - n + 1 : e + 1] == key]
        for e in list(reversed(occ))[: cfg.max_occurrences]:
            ext = list(tokens)  # the continuation copies itself past the end of the history
            cont = []
            depth = cfg.num_draft_tokens
            if cfg.long_draft_tokens and n >= cfg.long_match_ngram:
                depth = max(depth, cfg.long_draft_tokens)
            for k in range(depth):
                ext.append(ext[e + 1 + k])
                cont.append(ext[e + 1 + k])
            added = 0
            for d in range(1, len(cont) + 1):
                prefix = tuple(cont[:d])
                if prefix in node_of:
                    continue
                if len(out_tokens) >= cfg.max_nodes:
                    break
                node_of[prefix] = len(out_tokens)
                out_tokens.append(cont[d - 1])
                out_parents.append(node_of[prefix[:-1]] if d > 1 else -1)
                added += 1
            branches += added > 0
            if branches >= cfg.max_branches or len(out_tokens) >= cfg.max_nodes:
                return out_tokens, out_parents
    return out_tokens, out_parents


# ---- matches ---------------------------------------------------------------------------------
def test_repeated_pattern_continues_the_pattern():
    d = NGramDrafter(max_ngram=3, num_draft_tokens=8, max_branches=1, max_nodes=8)
    tree = propose1(d, [1, 2, 3, 4, 5, 1, 2, 3])
    # (1,2,3) was followed by 4,5,1,2,3; past the end the copy repeats with period 5
    assert tree.tokens.tolist() == [4, 5, 1, 2, 3, 4, 5, 1]
    assert tree.parents.tolist() == list(range(-1, 7))


def test_constant_run_gives_full_depth_chain():
    d = NGramDrafter(num_draft_tokens=6, max_nodes=6)
    tree = propose1(d, [3, 9, 9, 9])
    assert tree.tokens.tolist() == [9] * 6 and tree.parents.tolist() == list(range(-1, 5))


def test_continuation_in_the_middle_of_text():
    d = NGramDrafter(max_ngram=2, num_draft_tokens=3, max_branches=1)
    tokens = [10, 11, 12, 13, 14, 15, 16, 20, 21, 11, 12]
    assert propose1(d, tokens).tokens.tolist() == [13, 14, 15]


def test_longest_match_wins():
    # 3-gram (7,8,9) was followed by 1; the most recent 1-gram (9) was followed by 2
    tokens = [7, 8, 9, 1, 5, 9, 2, 6, 7, 8, 9]
    assert propose1(NGramDrafter(min_ngram=1, max_ngram=1, max_branches=1), tokens).tokens[0] == 2
    longest = propose1(NGramDrafter(min_ngram=1, max_ngram=3, max_branches=1), tokens)
    assert longest.tokens[0] == 1
    # with room for two branches, the longer match's branch comes first
    both = propose1(NGramDrafter(min_ngram=1, max_ngram=3, max_branches=2, max_nodes=32), tokens)
    assert [int(both.tokens[k]) for k in both.children[0]] == [1, 2]


def test_distinct_continuations_form_a_trie():
    cfg = NGramConfig(min_ngram=1, max_ngram=1, num_draft_tokens=4, max_branches=4, max_nodes=32)
    # key 5 is followed by 6 7 8 0 / 6 7 9 0 / 6 1 1 0 / 2 2 2 0, most recent last
    tokens = [5, 2, 2, 2, 0, 5, 6, 1, 1, 0, 5, 6, 7, 9, 0, 5, 6, 7, 8, 0, 5]
    tree = propose1(NGramDrafter(cfg), tokens)
    check_tree(tree, cfg)
    assert sorted(path_tokens(tree)) == [[2, 2, 2, 0], [6, 1, 1, 0], [6, 7, 8, 0], [6, 7, 9, 0]]
    assert tree.num_nodes == 4 + 1 + 3 + 2 + 3  # 6 and (6,7) are shared
    # the most recent continuation is the first chain (node i+1 child of node i)
    assert tree.tokens[:4].tolist() == [6, 7, 8, 0] and tree.parents[:4].tolist() == [-1, 0, 1, 2]


def test_max_nodes_and_max_branches_bound_the_tree():
    tokens = [5, 2, 2, 2, 0, 5, 6, 1, 1, 0, 5, 6, 7, 9, 0, 5, 6, 7, 8, 0, 5]
    cfg = NGramConfig(min_ngram=1, max_ngram=1, num_draft_tokens=4, max_branches=4, max_nodes=5)
    tree = propose1(NGramDrafter(cfg), tokens)
    check_tree(tree, cfg)
    assert tree.num_nodes == 5  # the second branch is cut by the node budget
    assert path_tokens(tree) == [[6, 7, 8, 0], [6, 7, 9]]
    cfg = NGramConfig(min_ngram=1, max_ngram=1, num_draft_tokens=4, max_branches=2, max_nodes=32)
    assert sorted(path_tokens(propose1(NGramDrafter(cfg), tokens))) == [[6, 7, 8, 0], [6, 7, 9, 0]]


def test_no_match_gives_empty_tree():
    d = NGramDrafter()
    for tokens in ([], [4], [1, 2, 3, 4, 5], list(range(100))):
        tree = propose1(d, tokens, seq_id=len(tokens))
        assert tree.num_nodes == 0
    d = NGramDrafter(min_ngram=2, max_ngram=3)
    assert propose1(d, [1, 2, 3, 9, 4, 3]).num_nodes == 0  # only a 1-gram match exists


# ---- incremental index == naive reference ------------------------------------------------------
CONFIGS = [
    NGramConfig(),
    NGramConfig(min_ngram=1, max_ngram=3, num_draft_tokens=5, max_branches=4, max_nodes=12, max_occurrences=3),
    NGramConfig(min_ngram=2, max_ngram=5, num_draft_tokens=10, max_branches=6, max_nodes=64),
    NGramConfig(min_ngram=1, max_ngram=1, num_draft_tokens=1, max_branches=1, max_nodes=1, max_occurrences=1),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("vocab", [2, 4, 12])
def test_incremental_matches_reference(cfg, vocab):
    rng = random.Random(vocab * 1000 + cfg.max_nodes)
    d = NGramDrafter(cfg)
    tokens: list[int] = []  # the same list object is mutated in place, as the engine does
    for step in range(250):
        r = rng.random()
        if r < 0.05 and tokens:  # history rewritten (shrunk): the index must rebuild
            del tokens[rng.randrange(len(tokens)) :]
        elif r < 0.08 and len(tokens) > 3:  # a tail token changed in place, same length
            tokens[-2] = (tokens[-2] + 1) % vocab
        tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
        tree = propose1(d, tokens)
        assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(tokens, cfg), f"step {step}"
        check_tree(tree, cfg, vocab)


# ---- batches and lifecycle ---------------------------------------------------------------------
def test_batched_sequences_are_independent():
    rng = random.Random(1)
    seqs = {sid: [rng.randrange(5) for _ in range(30)] for sid in (3, 8, 11)}
    batched = NGramDrafter()
    singles = {sid: NGramDrafter() for sid in seqs}
    for _ in range(40):
        for toks in seqs.values():
            toks.extend(rng.randrange(5) for _ in range(rng.randint(1, 3)))
        order = list(seqs)
        rng.shuffle(order)
        trees = batched.propose([view(seqs[sid], sid) for sid in order])
        assert len(trees) == len(order)
        for sid, tree in zip(order, trees, strict=True):
            alone = propose1(singles[sid], seqs[sid], sid)
            assert tree.tokens.tolist() == alone.tokens.tolist()
            assert tree.parents.tolist() == alone.parents.tolist()
            assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(seqs[sid], batched.config)


def test_release_frees_state():
    d = NGramDrafter(min_ngram=1, max_ngram=2)
    tokens = [1, 2, 3, 1, 2]
    propose1(d, tokens, seq_id=7)
    propose1(d, [4, 4, 4], seq_id=8)
    updates = d.index_updates
    propose1(d, tokens, seq_id=7)
    assert d.index_updates == updates  # nothing new: nothing indexed
    d.release(7)
    d.release(12345)  # unknown ids are fine
    propose1(d, tokens, seq_id=7)
    assert d.index_updates == updates + 7  # re-indexed from scratch: 4 one-grams + 3 two-grams
    d.release(7)
    d.release(8)
    assert d._index == {}
    # a released id reused for a different sequence sees only the new tokens
    assert propose1(d, [9, 8, 9], seq_id=7).tokens.tolist()[:1] == [8]


def test_copies_of_a_prompt_index_it_once():
    """Copies of one prompt (num_return_sequences) index the prompt once and their own tokens after it each; every
    copy proposes and holds what it would alone, in lists of its own."""
    rng = random.Random(3)
    prompt = [rng.randrange(30) for _ in range(60)]
    tails = [[5, 6, 7, 5, 6], [8, 9, 8, 9, 1], [2, 2, 3, 2, 2]]  # each copy's own plain steps after the prompt
    seqs = [SequenceView(i, prompt + tail, len(prompt)) for i, tail in enumerate(tails)]
    seqs.append(SequenceView(9, prompt[:30] + tails[0], 30))  # another prompt: indexed on its own
    d = NGramDrafter()
    trees = d.propose(seqs)

    def updates(tokens) -> int:
        alone = NGramDrafter()
        alone._sync(0, tokens)
        return alone.index_updates

    own = [updates(s.token_ids) - updates(prompt) for s in seqs[:3]]
    assert d.index_updates == updates(prompt) + sum(own) + updates(seqs[3].token_ids)
    def content(tree: DraftTree) -> tuple[list, list, list]:
        return tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()

    for s, tree in zip(seqs, trees, strict=True):
        alone = NGramDrafter()
        assert content(tree) == content(propose1(alone, s.token_ids))
        assert d._index[s.seq_id].tables == alone._index[0].tables
    first, copy = d._index[0].tables[1], d._index[1].tables[1]
    assert all(first[key] is not copy[key] for key in first)  # appending to one never changes the other


def test_a_step_indexes_only_its_new_tokens_under_keys_of_up_to_three():
    rng = random.Random(0)
    cfg = NGramConfig()
    num_n = cfg.max_ngram - cfg.min_ngram + 1
    # 100k tokens over a small vocabulary: every key has thousands of earlier occurrences
    tokens = [rng.randrange(20) for _ in range(100_000)]
    d = NGramDrafter(cfg)
    propose1(d, tokens)
    assert sorted(d._index[0].tables) == [1, 2, 3]  # longer keys are matched from the triples' occurrences
    assert d.index_updates == sum(len(tokens) - n for n in (1, 2, 3))
    for step in range(100):
        updates, scanned = d.index_updates, d.occurrences_scanned
        new = rng.randint(1, 5)
        tokens.extend(rng.randrange(20) for _ in range(new))
        tree = propose1(d, tokens)
        assert d.index_updates - updates == new * 3  # only the appended tokens are indexed
        assert d.occurrences_scanned - scanned <= num_n * cfg.max_occurrences
        if step % 20 == 0:  # the naive reference reads all 100k tokens per key length
            assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(tokens, cfg)
        assert 0 < tree.num_nodes <= cfg.max_nodes


def test_a_run_of_one_token_is_not_read_whole_at_every_step():
    """Every occurrence of the last triple in a run of one token matches the longest key: the scan for longer keys
    stops at the most recent max_occurrences of them (each key length's most recent are among them), and the tree
    is the reference's."""
    cfg = NGramConfig()
    tokens = [3, 1, 2] + [7] * 5000
    d = NGramDrafter(cfg)
    tree = propose1(d, tokens)
    matches = d._longer_matches(d._index[0], len(tokens), cfg.max_ngram)
    assert matches == [(len(tokens) - 2 - i, cfg.max_ngram) for i in range(cfg.max_occurrences)]  # of ~5000
    assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(tokens, cfg)
    tokens[:3] = [7] * 3  # the run now reaches the start (the index is rebuilt): still the reference's tree
    tree = propose1(d, tokens)
    assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(tokens, cfg)


def test_an_end_met_again_under_a_shorter_key_is_walked_once():
    """An occurrence of a key is one of every shorter key: in a periodic text every n matches the same end
    positions, whose continuations are in the trie already. Each is walked once, and the tree is the reference's."""
    cfg = NGramConfig()
    tokens = [1, 2, 3, 4, 5] * 20
    d = NGramDrafter(cfg)
    tree = propose1(d, tokens)
    assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(tokens, cfg)
    assert d.occurrences_scanned == cfg.max_occurrences  # the longest key's most recent ends; no shorter key adds one


# ---- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "options, match",
    [
        (dict(min_ngram=0), "min_ngram must be >= 1"),
        (dict(min_ngram=3, max_ngram=2), "max_ngram .* must be >= min_ngram"),
        (dict(num_draft_tokens=0), "num_draft_tokens must be >= 1"),
        (dict(max_branches=0), "max_branches must be >= 1"),
        (dict(max_nodes=65), "max_nodes must be <= 64"),
        (dict(max_nodes=0), "max_nodes must be >= 1"),
        (dict(max_occurrences=-1), "max_occurrences must be >= 1"),
        (dict(max_ngram=2.5), "max_ngram must be an int"),
        (dict(num_draft_tokens=True), "num_draft_tokens must be an int"),
        (dict(lookahead=3), "unknown option"),
    ],
)
def test_config_validation(options, match):
    with pytest.raises(ValueError, match=match):
        NGramDrafter(**options)


def test_config_object_and_registry():
    cfg = NGramConfig(max_ngram=2)
    assert NGramDrafter(cfg).config is cfg
    with pytest.raises(ValueError, match="not both"):
        NGramDrafter(cfg, max_ngram=2)
    d = get_drafter("ngram", max_ngram=5, num_draft_tokens=4)
    assert isinstance(d, NGramDrafter) and d.name == "ngram"
    assert d.config == NGramConfig(max_ngram=5, num_draft_tokens=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_ngram = 3


def simulated_greedy_steps(tokens: list[int], num_prompt: int, drafter: NGramDrafter) -> int:
    """Target passes greedy speculation needs to produce `tokens` (the plain greedy output):
    each step accepts the longest tree path that agrees with it, plus one token."""
    pos, steps = num_prompt, 0
    while pos < len(tokens):
        tree = propose1(drafter, tokens[:pos])
        node, accepted = -1, 0
        while pos + accepted < len(tokens):
            match = [k for k in tree.children[node + 1] if int(tree.tokens[k]) == tokens[pos + accepted]]
            if not match:
                break
            node, accepted = match[0], accepted + 1
        pos, steps = pos + accepted + 1, steps + 1
    return steps


def test_greedy_end_to_end_matches_plain_and_offline_simulation(tiny_model):
    from specdec.generate import generate

    model = tiny_model(vocab_size=16)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5, 6, 5, 6, 5, 7, 8]]
    plain = generate(model, prompts, max_new_tokens=40)
    # speculation="always": every proposed tree verified whole, as the offline replay assumes
    spec = generate(model, prompts, max_new_tokens=40, drafter="ngram", return_dict=True, speculation="always")
    assert spec.sequences == plain
    # greedy acceptance is deterministic, so the engine must take exactly the steps an
    # offline replay of the drafter over the plain output predicts
    expected = [simulated_greedy_steps(out, len(p), NGramDrafter()) for p, out in zip(prompts, plain, strict=True)]
    assert [s.steps for s in spec.stats] == expected
    assert min(expected) < 40  # the drafts were accepted at least once (the check has teeth)


def test_long_matches_get_deeper_chains():
    d = NGramDrafter(min_ngram=1, max_ngram=3, num_draft_tokens=2, long_match_ngram=3, long_draft_tokens=5,
                     max_nodes=5, max_branches=1)
    strong = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # 3-gram match: trusted, 5 deep
    assert propose1(d, strong).tokens.tolist() == [4, 5, 6, 7, 8]
    weak = [1, 20, 4, 5, 6, 7, 8, 9, 30, 1]  # only a 1-gram match: 2 deep
    d2 = NGramDrafter(min_ngram=1, max_ngram=3, num_draft_tokens=2, long_match_ngram=3, long_draft_tokens=5,
                      max_nodes=5, max_branches=1)
    assert propose1(d2, weak).tokens.tolist() == [20, 4]


def test_a_frequent_triple_is_split_by_the_token_before_it_and_kept_split():
    """A longest stored key met with SPLIT_FROM occurrences or more: its longer matches are looked for among its ends
    after the same token, grouped when first needed and grown with each step (as brute force groups them), and
    the trees stay the reference's; a prompt indexed again (a bulk step) groups them anew."""
    from specdec.drafters import ngram

    rng = random.Random(5)
    cfg = NGramConfig()
    tokens = [v for _ in range(2 * ngram.SPLIT_FROM) for v in (rng.randrange(4), 7, 8, 9)]
    d = NGramDrafter(cfg)
    for step in range(80):
        tree = propose1(d, tokens)
        assert (tree.tokens.tolist(), tree.parents.tolist()) == reference(tokens, cfg), f"step {step}"
        idx = d._index[0]
        for key, split in idx.before.items():
            want: dict[int, list[int]] = {}
            for e in idx.tables[3][key]:
                if e >= 3:
                    want.setdefault(tokens[e - 3], []).append(e)
            assert split == want, f"step {step}"
        tokens += [rng.randrange(4), 7, 8, 9] if step % 20 else [rng.randrange(4) for _ in range(ngram.BULK_INDEX)]
    assert (7, 8, 9) in d._index[0].before  # the split was made and kept


@pytest.mark.parametrize("min_ngram,max_ngram", [(1, 6), (2, 4), (3, 3), (4, 6)])
@pytest.mark.parametrize("prompt", [2, 50])
def test_the_index_grown_in_steps_is_the_index_built_at_once(min_ngram, max_ngram, prompt):
    """The invariant of _SeqIndex, against a brute-force index after every step: a prompt shorter than the longest
    key or one indexed in bulk (ngram.BULK_INDEX), then growth by 1 to 7 tokens a step, and now and then by more
    than BULK_INDEX (each key's end positions, in order; none for the current tail)."""
    from specdec.drafters import ngram

    assert 2 < ngram.BULK_INDEX < 50
    rng = random.Random(min_ngram * 10 + max_ngram + prompt)
    d = NGramDrafter(min_ngram=min_ngram, max_ngram=max_ngram)
    tokens = [rng.randrange(6) for _ in range(prompt)]
    for step in range(40):
        idx = d._sync(0, TokenView(tokens))
        want = {n: {} for n in range(min_ngram, min(max_ngram, max(min_ngram, 3)) + 1)}  # keys of up to three
        for n, table in want.items():
            for e in range(n - 1, len(tokens) - 1):
                table.setdefault(tuple(tokens[e - n + 1 : e + 1]), []).append(e)
        assert idx.tables == want and idx.length == len(tokens) and idx.tokens == tokens
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 7) if step % 9 else 45)]


def test_a_longer_key_scans_only_its_most_recent_max_occurrences():
    # key (9, 1, 2, 3, 4) occurs three times, each after a token other than the final 30 (so 5 tokens match, not 6):
    # the oldest is followed by 7 7, the two most recent by 5 5. With max_occurrences=2, only the two most recent
    # are scanned for every n, so the oldest's 7 7 is never proposed.
    tokens = [20, 9, 1, 2, 3, 4, 7, 7, 21, 9, 1, 2, 3, 4, 5, 5, 22, 9, 1, 2, 3, 4, 5, 5, 30, 9, 1, 2, 3, 4]
    d = NGramDrafter(max_ngram=6, max_occurrences=2, num_draft_tokens=2, long_draft_tokens=0)
    assert path_tokens(propose1(d, tokens)) == [[5, 5]]
    # with room for three occurrences the oldest continuation is a second branch
    wider = NGramDrafter(max_ngram=6, max_occurrences=3, num_draft_tokens=2, long_draft_tokens=0)
    assert path_tokens(propose1(wider, tokens)) == [[5, 5], [7, 7]]


def test_scores_start_at_a_prior_that_grows_with_the_match_length():
    d = NGramDrafter()
    # prior = min(0.9, 0.2 + 0.1 * match), whatever the depth, before anything was accepted
    assert d.score(1, 1) == pytest.approx(0.3) and d.score(1, 5) == pytest.approx(0.3)
    assert d.score(3, 1) == pytest.approx(0.5) and d.score(3, 6) == pytest.approx(0.5)
    assert d.score(9, 2) == pytest.approx(0.9)  # 0.2 + 0.9 capped at 0.9


def chain_drafter() -> tuple[NGramDrafter, DraftTree]:
    """A drafter that proposed the chain 2..11 (1-token match, depths 1..10) for the text 1..12, 1."""
    d = NGramDrafter(min_ngram=1, max_ngram=1, num_draft_tokens=10, long_draft_tokens=0, max_branches=1)
    tree = propose1(d, list(range(1, 13)) + [1])
    assert tree.tokens.tolist() == list(range(2, 12))
    return d, tree


def test_acceptance_is_learned_per_match_and_depth_with_depths_past_eight_shared():
    d, _ = chain_drafter()
    d.on_accept(0, list(range(2, 13)))  # every node accepted, then the bonus token
    # prior 0.3 (match 1) behind two pseudo-observations: depth 1 accepted once -> (1 + 0.6) / (1 + 2)
    assert d.score(1, 1) == pytest.approx(1.6 / 3)
    # depths 8, 9 and 10 share one key: 3 accepted of 3 -> (3 + 0.6) / (3 + 2), at depth 8 and beyond
    assert d.score(1, 8) == pytest.approx(3.6 / 5) and d.score(1, 20) == pytest.approx(3.6 / 5)
    assert d.score(2, 1) == pytest.approx(0.4)  # another match length learned nothing
    # the next proposal carries the learned rates as its nodes' scores
    tree = propose1(d, list(range(1, 13)) + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1])
    assert tree.scores.tolist()[0] == pytest.approx(1.6 / 3) and tree.scores.tolist()[9] == pytest.approx(3.6 / 5)


def test_a_rejected_node_counts_as_tried_not_accepted_and_the_nodes_after_it_as_untried():
    d, _ = chain_drafter()
    d.on_accept(0, [2, 3, 99])  # depths 1 and 2 accepted, depth 3 (token 4) rejected, depth 4 never reached
    assert d.score(1, 2) == pytest.approx(1.6 / 3)
    assert d.score(1, 3) == pytest.approx(0.6 / 3)  # (0 + 2 * 0.3) / (1 + 2)
    assert d.score(1, 4) == pytest.approx(0.3)


def test_an_empty_proposal_leaves_nothing_for_the_next_commit_to_learn_from():
    d, _ = chain_drafter()
    assert propose1(d, [40, 41, 42]).num_nodes == 0  # no match: the chain proposed before is no longer pending
    d.on_accept(0, [41])
    assert d.acceptance == {} and d.score(1, 1) == pytest.approx(0.3)


def test_a_released_sequence_leaves_nothing_for_a_later_commit_to_learn_from():
    d, _ = chain_drafter()
    d.release(0)
    d.on_accept(0, list(range(2, 13)))
    assert d.acceptance == {} and d.score(1, 1) == pytest.approx(0.3)


def test_attach_forgets_the_acceptance_learned_in_an_earlier_run():
    d, _ = chain_drafter()
    d.on_accept(0, list(range(2, 13)))
    assert d.score(1, 1) != pytest.approx(0.3)
    d.attach(None)  # a new generate() call: it scores as a fresh drafter would
    assert d.acceptance == {} and d.score(1, 1) == pytest.approx(0.3)


def test_a_long_match_drafts_at_least_num_draft_tokens_when_long_chains_are_shorter():
    # (1, 2) matches 2 tokens >= long_match_ngram: depth max(num_draft_tokens 5, long_draft_tokens 2) = 5
    d = NGramDrafter(NGramConfig(max_ngram=3, num_draft_tokens=5, long_match_ngram=2, long_draft_tokens=2,
                                 max_branches=1))
    assert propose1(d, [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]).tokens.tolist() == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("options, refusal", [
    (dict(num_draft_tokens=5, long_draft_tokens=2), "long_draft_tokens=2 is not above num_draft_tokens=5"),
    (dict(long_draft_tokens=6), "long_draft_tokens=6 is not above num_draft_tokens=6"),
    (dict(long_match_ngram=3, long_draft_tokens=0), "long_match_ngram=3 starts long chains, which long_draft_tokens=0 "
                                                    "turns off"),
])
def test_long_chain_options_given_where_they_would_do_nothing_are_refused(options, refusal):
    """Given by name, a long_draft_tokens at or below num_draft_tokens (a long match drafted max of the two deep)
    and a long_match_ngram with long chains off were accepted and did nothing; the defaults stay accepted."""
    with pytest.raises(InputError, match="^ngram drafter: " + refusal):
        NGramDrafter(**options)
    assert NGramDrafter(num_draft_tokens=20).config.long_draft_tokens == 16  # the default: left as it is
    assert NGramDrafter(long_draft_tokens=0).config.long_match_ngram == 4
