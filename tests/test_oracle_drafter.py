"""The oracle drafter (a measuring instrument): exact by construction, acceptance per depth as profiled, tau as
the chain formula says, on a tiny synthetic target."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from specdec.drafters.base import SequenceView
from specdec.eval.oracle_drafter import AcceptanceProfile, OracleDrafter, reference_continuations

from specdec.errors import InputError
from specdec.generate import generate
from specdec.models.loader import load_model

PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79], [32, 38, 46, 26, 43, 38], [7, 1, 8, 2]]
NEW = 120


@pytest.fixture(scope="module")
def target():
    with pytest.MonkeyPatch.context() as mp:  # no CPU row-policy calibration for a throwaway shape
        mp.setattr("specdec.engine_setup.ensure_row_policy", lambda runner: None)
        loaded = load_model("synthetic:llama-3.2-1b@tiny", device="cpu")
        yield loaded, reference_continuations(loaded, PROMPTS, NEW)


def _run(loaded, oracle, prompts=PROMPTS):
    return generate(loaded, prompts, drafter=oracle, max_new_tokens=NEW, speculation="always", return_dict=True)


def test_profile_formulas_and_checks():
    a, k = 0.7, 5
    assert AcceptanceProfile.constant(a, k).expected_tau == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert AcceptanceProfile.for_tau(3.0, 6).expected_tau == pytest.approx(3.0, abs=1e-9)
    with pytest.raises(InputError):
        AcceptanceProfile.constant(0.5, 8, width=9)  # 72 nodes
    with pytest.raises(InputError):
        AcceptanceProfile((1.2,))


def test_profile_from_an_acceptance_report(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"rows": [
        {"drafter": "plain", "category": "chat", "acceptance_per_depth": []},
        {"drafter": "medusa", "category": "chat", "acceptance_per_depth": [0.6, 0.5, 0.25]},
        {"drafter": "medusa", "category": "code", "acceptance_per_depth": [0.9]}]}))
    profile = AcceptanceProfile.from_acceptance_report(report, "medusa", "chat", width=2)
    assert profile.rates == (0.6, 0.5, 0.25) and profile.width == 2
    assert profile.expected_tau == pytest.approx(1 + 0.6 + 0.3 + 0.075)
    with pytest.raises(InputError, match="no per-depth acceptance"):
        AcceptanceProfile.from_acceptance_report(report, "plain", "chat")


def test_greedy_output_is_the_targets_whatever_the_oracle_knows(target):
    loaded, reference = target
    wrong = {p: [(t + 1) % 256 for t in c] for p, c in reference.items()}  # an oracle that is always wrong
    for knowledge, profile in ((reference, AcceptanceProfile.constant(0.6, 4, width=3)),
                               (wrong, AcceptanceProfile.constant(1.0, 3))):
        out = _run(loaded, OracleDrafter(knowledge, profile, seed=1))
        assert out.new_tokens == [reference[tuple(p)] for p in PROMPTS]
    assert max(s.tau for s in out.stats) == 1.0  # the wrong oracle never got a token accepted


def test_perfect_oracle_commits_depth_plus_one_every_step(target):
    loaded, reference = target
    out = _run(loaded, OracleDrafter(reference, AcceptanceProfile.constant(1.0, 4)))
    assert len(out.stats) == len(PROMPTS)
    for s in out.stats:
        assert set(s.step_lengths[:-1]) == {5}  # the last step may be cut by max_new_tokens


@pytest.mark.parametrize("rates, width", [((0.8, 0.6, 0.4), 1), ((0.7, 0.7, 0.7, 0.7, 0.7), 2)])
def test_acceptance_per_depth_and_tau_follow_the_profile(target, rates, width):
    loaded, reference = target
    profile = AcceptanceProfile(rates, width)
    out = _run(loaded, OracleDrafter(reference, profile, seed=7))
    tried = [sum(s.depth_tried[d] for s in out.stats if d < len(s.depth_tried)) for d in range(len(rates))]
    accepted = [sum(s.depth_accepted[d] for s in out.stats if d < len(s.depth_accepted)) for d in range(len(rates))]
    for d, rate in enumerate(rates):
        sigma = math.sqrt(rate * (1 - rate) / tried[d])
        assert abs(accepted[d] / tried[d] - rate) < 4 * sigma + 1e-9, (d, accepted[d], tried[d])
    lengths = [n for s in out.stats for n in s.step_lengths[:-1]]  # full steps only
    mean = sum(lengths) / len(lengths)
    sd = math.sqrt(sum((n - mean) ** 2 for n in lengths) / (len(lengths) - 1))
    assert abs(mean - profile.expected_tau) < 4 * sd / math.sqrt(len(lengths))


def test_each_sequence_meets_the_profile_to_within_a_hit_per_depth(target):
    """Stratified draws: one short sequence reaches the profile (independent draws miss it by several hits)."""
    loaded, reference = target
    profile = AcceptanceProfile.for_tau(3.0, 6)
    for seed in (1, 2, 3):
        out = _run(loaded, OracleDrafter(reference, profile, seed=seed))
        for s in out.stats:
            for d, rate in enumerate(profile.rates):
                # the last step's tree may be cut by max_new_tokens after its hits were drawn: one more
                assert abs(s.depth_accepted[d] - rate * s.depth_tried[d]) <= 2.0, (seed, d, s.depth_tried[d])
            full = s.step_lengths[:-1]
            assert sum(full) / len(full) == pytest.approx(profile.expected_tau, abs=0.15)


def test_inner_drafter_runs_and_changes_nothing_but_the_cost(target):
    loaded, reference = target
    calls = []

    class Counting(OracleDrafter):  # stands for a real drafter: counts its propose calls
        def propose(self, seqs):
            calls.append(len(seqs))
            return super().propose(seqs)

    inner = Counting(reference, AcceptanceProfile.constant(0.0, 2))
    out = _run(loaded, OracleDrafter(reference, AcceptanceProfile.constant(1.0, 3), inner=inner), PROMPTS[:1])
    assert out.new_tokens == [reference[tuple(PROMPTS[0])]]
    assert len(calls) == out.forward_passes and out.stats[0].tau > 3.5  # the inner tokens were not verified


def test_a_sequences_prompt_is_looked_up_once_not_every_step(target):
    """The instrument's own host time per step stays small: the continuation of a sequence's prompt is found once,
    by the prompt (a key as long as it), and kept by sequence until released; a second call finds it anew."""
    loaded, reference = target

    class Counted(dict):
        lookups = 0

        def get(self, key, default=None):
            Counted.lookups += 1
            return super().get(key, default)

    oracle = OracleDrafter(Counted(reference), AcceptanceProfile.constant(0.8, 4), seed=1)
    for call in (1, 2):
        out = _run(loaded, oracle, PROMPTS[:2])
        assert out.new_tokens == [reference[tuple(p)] for p in PROMPTS[:2]]
        assert out.forward_passes > 10  # many steps, each drafted
        assert Counted.lookups == 2 * call  # one per sequence per call, whatever its steps


def test_references_of_a_tensor_batch_are_keyed_by_ints_and_an_unknown_prompt_is_refused(target):
    """A [B, L] tensor's rows key the same continuations as lists (0-d tensors would hash by identity, and every
    proposal would then miss: tau 1, unannounced); a prompt the oracle has no reference for is an InputError."""
    import torch

    loaded, reference = target
    same_length = [p for p in PROMPTS if len(p) == 5][:1] + [[9, 8, 7, 6, 5]]
    keyed = reference_continuations(loaded, torch.tensor(same_length), 8)
    assert list(keyed) == [tuple(p) for p in same_length]
    assert keyed[tuple(same_length[0])] == reference[tuple(same_length[0])][:8]
    with pytest.raises(InputError, match="no reference continuation for a prompt of 4 tokens"):
        _run(loaded, OracleDrafter(keyed, AcceptanceProfile.constant(0.5, 2)), prompts=[[1, 2, 3, 4]])


def _attached(reference, profile, seed=0):
    """An oracle attached to a stand-in target of 50 tokens, knowing ``reference`` as the continuation of [1, 2]."""
    oracle = OracleDrafter({(1, 2): reference}, profile, seed=seed)
    oracle.attach(SimpleNamespace(runner=SimpleNamespace(shape=SimpleNamespace(vocab_size=50))))
    return oracle


def test_a_missed_depth_never_proposes_the_reference_token():
    """Rate 0, width 2, after root 10 of the reference 10, 11, 12, 13: depth 1 wants 11 and proposes 11 + 1 and
    11 + 2; depth 2 (under a wrong child) wants 12 and proposes 13 and 14. The root's successor (11) is the
    reference token here, so a wrong token counted from the root would be accepted."""
    oracle = _attached([10, 11, 12, 13], AcceptanceProfile.constant(0.0, 2, width=2))
    tree = oracle.propose([SequenceView(0, [1, 2, 10], 2)])[0]
    assert tree.tokens.tolist() == [12, 13, 13, 14] and tree.parents.tolist() == [-1, -1, 0, 0]


def test_the_last_reference_tokens_are_proposed_and_none_past_them():
    """Rate 1, width 2, the reference 10, 11, 12, 13 with 10 and 11 committed: depth 1 proposes 12 (and 12 + 2),
    depth 2 the reference's last token 13 (and 13 + 2). With all four committed there is nothing to know: both depths
    propose the root 13 + 1, 13 + 2."""
    oracle = _attached([10, 11, 12, 13], AcceptanceProfile.constant(1.0, 2, width=2))
    assert oracle.propose([SequenceView(0, [1, 2, 10, 11], 2)])[0].tokens.tolist() == [12, 14, 13, 15]
    assert oracle.propose([SequenceView(0, [1, 2, 10, 11, 12, 13], 2)])[0].tokens.tolist() == [14, 15, 14, 15]


def test_hits_are_stratified_per_depth_among_the_steps_that_reach_it():
    """Rates 0.5 and 0.5 over 100 steps at one position: depth 1 holds the reference in floor(u + 100 x 0.5) = 50
    trees exactly, and depth 2, tried only under those, in floor(u' + 50 x 0.5) = 25 of them (u, u' in [0, 1))."""
    oracle = _attached(list(range(10, 20)), AcceptanceProfile.constant(0.5, 2), seed=3)
    trees = [oracle.propose([SequenceView(0, [1, 2, 10], 2)])[0].tokens.tolist() for _ in range(100)]
    first = [t for t in trees if t[0] == 11]
    assert len(first) == 50 and sum(t[1] == 12 for t in first) == 25
    assert oracle.proposed_tries == [100, 50] and oracle.proposed_hits == [50, 25]


def test_a_profile_may_reach_the_full_tau_and_fill_the_largest_tree():
    """tau = depth + 1 is every drafted token accepted: rate 1 at every depth; 8 x 8 = 64 nodes is the largest
    tree the kernels take (MAX_TREE_NODES), so allowed."""
    assert AcceptanceProfile.for_tau(5.0, 4).rates == pytest.approx((1.0,) * 4)
    assert AcceptanceProfile.constant(0.5, 8, width=8).width == 8
