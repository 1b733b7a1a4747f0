"""Speculative decoding end to end on tiny models: greedy identity, sampling equality,
stops inside accepted runs, and drafter proposals the engine must refuse."""
from __future__ import annotations

import pytest
import torch
from specdec.drafters.base import Drafter
from specdec.eval.two_sample import two_sample_chi2

import specdec
from specdec.rejection import EXACT
from specdec.testing import RandomTreeDrafter, build_tiny_model
from specdec.tree import DraftError, DraftMode, DraftTree

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7, 8], [10, 20, 30, 10, 20, 30, 10, 20], [5, 5, 5, 5], [11] * 3 + [12, 13]]


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation (as a chain), so whole runs get accepted."""

    name = "oracle"

    def __init__(self, continuations: dict[int, list[int]], depth: int = 5) -> None:
        self.continuations, self.depth = continuations, depth

    def propose(self, seqs):
        trees = []
        for s in seqs:
            full = self.continuations[s.seq_id]
            done = len(s.token_ids)
            trees.append(DraftTree.chain(full[done : done + self.depth]))
        return trees


class LyingDrafter(Drafter):
    name = "liar"

    def __init__(self, tree: DraftTree) -> None:
        self.tree = tree

    def propose(self, seqs):
        return [self.tree for _ in seqs]


@pytest.mark.parametrize("variant", ["llama-gqa-tied", "qwen3-qknorm"])
def test_greedy_identity_ngram_and_random_trees(variant):
    model = build_tiny_model(variant)
    plain = specdec.generate(model, PROMPTS, max_new_tokens=256)
    out = specdec.generate(model, PROMPTS, max_new_tokens=256, drafter="ngram", drafter_options={"min_ngram": 1},
                           return_dict=True)
    assert out.sequences == plain
    assert out.tau > 1.0  # the drafter really got tokens accepted (tiny models repeat themselves)
    for mode in ("deterministic", "independent", "without_replacement"):
        drafter = RandomTreeDrafter(model.config.vocab_size, max_nodes=16, mode=mode, seed=1)
        got = specdec.generate(model, PROMPTS, max_new_tokens=256, drafter=drafter, block_size=4)
        assert got == plain, mode
    for p, ref in zip(PROMPTS, plain):  # one at a time
        assert specdec.generate(model, [p], max_new_tokens=256, drafter="ngram")[0] == ref


def test_oracle_drafter_commits_whole_runs_and_stops_exactly_at_eos():
    model = build_tiny_model()
    plain = specdec.generate(model, PROMPTS, max_new_tokens=60)
    oracle = OracleDrafter(dict(enumerate(plain)), depth=5)
    out = specdec.generate(model, PROMPTS, max_new_tokens=60, drafter=oracle, return_dict=True)
    assert out.sequences == plain
    assert out.tau == pytest.approx(6.0, abs=0.3)  # 5 accepted + 1 bonus per step
    assert all(a == 1.0 for s in out.stats for a in s.acceptance_per_depth)
    # an EOS inside an accepted run: nothing after it is emitted
    new0 = plain[0][len(PROMPTS[0]):]
    eos = new0[13]
    out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=60, drafter=OracleDrafter({0: plain[0]}),
                           eos_token_id=eos, return_dict=True)
    assert out.new_tokens[0] == new0[: new0.index(eos) + 1]
    # max_new_tokens that ends mid-run
    out = specdec.generate(model, [PROMPTS[0]], max_new_tokens=9, drafter=OracleDrafter({0: plain[0]}))
    assert out[0] == plain[0][: len(PROMPTS[0]) + 9]


def _first_tokens(model, drafter, n, prompt, k=3, seed=0, temperature=1.0, top_k=0, top_p=1.0, rule=EXACT):
    out = specdec.generate(model, [prompt] * n, max_new_tokens=k, drafter=drafter, do_sample=True, seed=seed,
                           temperature=temperature, top_k=top_k, top_p=top_p, return_dict=True,
                           acceptance_rule=rule)
    return [tuple(t[:k]) for t in out.new_tokens]


_two_sample_test = two_sample_chi2


N = 6000  # per side; each test asserts its own power to detect TV 0.05 (see _two_sample_test)


@pytest.mark.slow
@pytest.mark.parametrize("drafter_kind", ["ngram", "random-independent", "random-deterministic"])
def test_sampling_law_of_first_three_tokens_matches_plain(drafter_kind):
    model = build_tiny_model(vocab_size=4, seed=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = _first_tokens(model, None, N, prompt, seed=1, temperature=0.9, top_k=3)
    if drafter_kind == "ngram":
        drafter = "ngram"
    else:
        drafter = RandomTreeDrafter(4, max_nodes=10, mode=drafter_kind.split("-")[1], seed=5)
    spec = _first_tokens(model, drafter, N, prompt, seed=2, temperature=0.9, top_k=3)
    p, power = _two_sample_test(plain, spec)
    assert power >= 0.9, f"only {power:.2f} power to detect TV 0.05"
    assert p > 1e-3, f"{drafter_kind}: p = {p}"


@pytest.mark.slow
def test_sampling_law_test_catches_a_broken_sampler():
    from specdec.eval import negative_controls

    model = build_tiny_model(vocab_size=4, seed=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    plain = _first_tokens(model, None, N, prompt, seed=1, temperature=0.9, top_k=3)
    broken_rule = negative_controls.BROKEN_RULES["always_accept"]
    drafter = RandomTreeDrafter(4, max_nodes=10, mode="independent", seed=5)
    spec = _first_tokens(model, drafter, N, prompt, seed=2, temperature=0.9, top_k=3, rule=broken_rule)
    assert _two_sample_test(plain, spec)[0] < 1e-6


@pytest.mark.parametrize(
    "tree, match",
    [
        (DraftTree.chain([1, 500]), "vocabulary"),
        (DraftTree.chain([1, 2], torch.full((2, 96), float("nan")), DraftMode.INDEPENDENT), "NaN"),
        (DraftTree.chain([1, 2], torch.full((2, 96), 0.5), DraftMode.INDEPENDENT), "sum to 1"),
        (DraftTree.chain([1], torch.ones(1, 50) / 50, DraftMode.INDEPENDENT), "vocab"),
    ],
)
def test_lying_drafter_is_refused_with_its_name(tree, match):
    model = build_tiny_model()
    with pytest.raises(DraftError, match=f"liar.*{match}|{match}.*liar|liar: .*"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=4, drafter=LyingDrafter(tree))


def test_malformed_trees_rejected_at_construction():
    with pytest.raises(DraftError, match="parent"):
        DraftTree([1, 2], [-1, 1])
    with pytest.raises(DraftError, match="at most"):
        DraftTree.chain(list(range(65)))
    with pytest.raises(DraftError, match="draft_probs"):
        DraftTree([1], [-1], None, DraftMode.INDEPENDENT)


def test_wrong_number_of_trees_is_refused():
    class Short(Drafter):
        name = "short"

        def propose(self, seqs):
            return []

    with pytest.raises(DraftError, match="short"):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=4, drafter=Short())
