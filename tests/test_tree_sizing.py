"""Tree size per step and the break-even guard (specdec.tree_sizing) with fixed costs: the best-paying
prefix is kept, nothing is kept when nothing pays, and the guard stops asking a drafter that never matches
and asks again once it matches; speculation="always" asks every step."""
from __future__ import annotations

import json
import time
from itertools import pairwise

import pytest
import torch
from specdec.drafters.base import Drafter

from specdec import engine_setup
from specdec.cost_model import CostModel
from specdec.cuda_graphs import note_capture
from specdec.generate import generate
from specdec.online_costs import OnlineCosts
from specdec.score_bins import corrected, learn, new_bins
from specdec.testing import build_tiny_model
from specdec.tree import DraftMode, DraftTree
from specdec.tree_sizing import MEMORY_FORMAT, TreeSizer

FLAT = CostModel({}, {1: {1: 1.0, 65: 1.0}})  # verifying is free: only the draft cost counts


def test_sizing_keeps_the_best_paying_prefix_and_nothing_when_nothing_pays():
    costs = CostModel({}, {1: {1: 1.0, 2: 1.05, 3: 1.05, 4: 3.0, 65: 64.0}})  # 2-3 tokens ~ a step, a 4th: 2 more
    sizer = TreeSizer(costs)
    # a chain 10, 11, 12, 13 (likely) and a root sibling 20 (unlikely)
    tree = DraftTree([10, 11, 20, 12, 13], [-1, 0, -1, 1, 3], scores=torch.tensor([0.9, 0.9, 0.05, 0.9, 0.9]))
    kept = sizer.size(0, tree, batch=1)
    assert kept.tokens.tolist() == [10, 11] and kept.parents.tolist() == [-1, 0]
    assert sizer.paid == 1
    hopeless = DraftTree.chain([10, 11], scores=torch.tensor([0.01, 0.01]))
    assert sizer.size(1, hopeless, batch=1).num_nodes == 0 and sizer.unpaid == 1


def test_observed_acceptance_corrects_overconfident_scores():
    sizer = TreeSizer(FLAT)
    tree = DraftTree.chain([5, 6], scores=torch.tensor([0.95, 0.95]))
    first = sizer.acceptance(tree)[0]
    for _ in range(10):
        sizer.size(0, tree, batch=1)
        sizer.observe(0, [7])  # the target never takes token 5
    assert sizer.acceptance(tree)[0] < first / 3


def test_score_bins_count_a_score_of_one_in_the_last_bin_and_sum_predicted_scores():
    bins = new_bins()
    learn(bins, 1.0, True, 0.5)  # 1.0 is in the last bin, [0.9, 1.0]
    assert bins[9] == [1.0, 1.0]
    learn(bins, 0.25, True, 0.5)  # bin 2: [0 * 0.5 + 1, 0 * 0.5 + 0.25]
    learn(bins, 0.25, False, 0.5)  # [1 * 0.5 + 0, 0.25 * 0.5 + 0.25]
    assert bins[2] == pytest.approx([0.5, 0.375])
    assert sum(map(sum, bins)) == pytest.approx(2.0 + 0.875)  # nothing else counted


def test_a_score_of_one_is_corrected_by_the_last_bins_factor():
    bins = new_bins()
    bins[9] = [1.0, 2.0]  # scores in [0.9, 1.0] accepted half as often as predicted
    # pooled = (1 + 1) / (2 + 1) = 2/3; last bin's factor = (1 + 1 * 2/3) / (2 + 1) = 5/9
    assert corrected([1.0, 0.9], bins, 1.0) == pytest.approx([5 / 9, 0.9 * 5 / 9])


def test_a_drafter_that_calibrates_its_scores_has_them_taken_as_they_are():
    """The combined drafter calibrates each child's deterministic scores itself (Drafter.calibrated_scores): the
    sizer neither corrects them again nor learns from them; a sampled tree's scores it still corrects."""
    sizer = TreeSizer(FLAT, calibrated_scores=True)
    tree = DraftTree.chain([5, 6], scores=torch.tensor([0.95, 0.6]))
    for _ in range(10):
        sizer.size(0, tree, batch=1)
        sizer.observe(0, [7])  # the target never takes token 5
    assert sizer.acceptance(tree) == pytest.approx([0.95, 0.6])
    sampled = DraftTree.chain([5, 6], draft_probs=torch.full((2, 8), 0.125), mode=DraftMode.INDEPENDENT,
                              scores=torch.tensor([0.95, 0.95]))
    sizer.score_bins[9] = [1.0, 9.5]  # evidence that 0.95 means ~0.1, as a sizer of another drafter learned
    assert sizer.acceptance(sampled)[0] < 0.5


def test_overconfidence_seen_in_one_score_bin_discounts_the_others_too():
    """Each bin's correction shrinks toward the pooled one: a drafter found over-confident at high scores is
    trusted less at scores the run has not seen yet (a bin without observations once kept its raw score)."""
    sizer = TreeSizer(FLAT)
    seen = DraftTree.chain([5], scores=torch.tensor([0.95]))
    for i in range(20):
        sizer.size(0, seen, batch=1)
        sizer.observe(0, [5 if i % 2 else 7])  # accepted half the time
    unseen = DraftTree.chain([9], scores=torch.tensor([0.45]))
    assert sizer.acceptance(unseen)[0] < 0.45 * 0.75


def test_a_new_sizer_starts_from_what_the_last_one_of_its_key_learned_of_the_scores():
    """Overconfident scores (0.95, never right) are discounted from the first step of the next call of the same
    drafter, not believed again for its first probes; another key starts fresh."""
    tree = DraftTree.chain([5, 6], scores=torch.tensor([0.95, 0.95]))
    first = TreeSizer(FLAT, memory=("costs", "liar")).acceptance(tree)[0]
    sizer = TreeSizer(FLAT, memory=("costs", "liar"))
    for _ in range(10):
        sizer.size(0, tree, batch=1)
        sizer.observe(0, [7])
    sizer.release(0)
    assert TreeSizer(FLAT, memory=("costs", "liar")).acceptance(tree)[0] < first / 3
    assert TreeSizer(FLAT, memory=("costs", "other")).acceptance(tree)[0] == first


# a probe that costs half a step beyond a plain one waits until the sequence has banked half a step of probe budget
# (SizingConfig.probe_budget, 0.01 a step, the asking step's share included): the 49th step after the last one
BANKED_HALF_STEP = 49


class Scripted:
    """A chain of 4 wrong tokens until the sequence has ``switch`` new tokens, then the right ones."""

    name = "scripted"

    def __init__(self, plain, prompt_len, vocab, switch):
        self.plain, self.prompt_len, self.vocab, self.switch = plain, prompt_len, vocab, switch
        self.asked_at: list[int] = []  # new-token count at every propose

    def propose(self, seqs):
        out = []
        for s in seqs:
            n = len(s.token_ids)
            self.asked_at.append(n - self.prompt_len)
            right = self.plain[n: n + 4]
            chain = right if n - self.prompt_len >= self.switch else [(t + 1) % self.vocab for t in right]
            out.append(DraftTree.chain(chain) if chain else DraftTree.empty())
        return out


@pytest.fixture
def fixed_costs(monkeypatch):
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: FLAT)
    monkeypatch.setattr(TreeSizer, "draft_cost", lambda self, batch: 0.5)  # half a decode step per propose
    monkeypatch.setattr(TreeSizer, "probe_cost", lambda self, batch: 0.5)  # ... on every path
    monkeypatch.setattr(OnlineCosts, "record", lambda self, *args: None)  # no wall time corrects the flat curve
    # ... nor prices a catch-up: every propose call took half a decode step (a call's wall time, charged in full to
    # a catch-up, went over once on a loaded CI worker and left a remembered guard without probe budget)
    size_call = TreeSizer.size_call
    monkeypatch.setattr(TreeSizer, "size_call", lambda self, ids, trees, batch, seconds, *args:
                        size_call(self, ids, trees, batch, 0.5 * self.step_seconds(batch), *args))


def test_guard_turns_speculation_off_for_a_drafter_that_never_matches_and_back_on(fixed_costs, caplog):
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=140)[0]
    drafter = Scripted(plain, len(prompt), 32, switch=40)
    with caplog.at_level("DEBUG", logger="specdec.tree_sizing"):
        out = generate(model, [prompt], max_new_tokens=140, drafter=drafter, return_dict=True)
    # its decisions, at DEBUG for a user asking why a drafter was held off
    assert "sequence 0: drafting does not pay (" in caplog.text and "sequence 0: drafting pays (" in caplog.text
    assert out.sequences[0] == plain
    before = [a for a in drafter.asked_at if a < 40]
    after = [a for a in drafter.asked_at if a >= 40]
    # off: the first call catches up on the prompt (its time prices nothing), the probe at step 3 costs half a
    # step beyond a plain one, so the next waits until the call has banked half a step of probe budget
    assert before == [0, 3] and drafter.asked_at[2] == BANKED_HALF_STEP, drafter.asked_at
    # back on: after the first probe that matches it is asked every step, and whole chains are committed
    lengths = out.stats[0].step_lengths
    assert lengths[-10:].count(5) >= 8 and len(after) >= 10, (drafter.asked_at, lengths)
    # forced: asked every step, never matching or not
    drafter = Scripted(plain, len(prompt), 32, switch=40)
    forced = generate(model, [prompt], max_new_tokens=140, drafter=drafter, return_dict=True, speculation="always")
    assert forced.sequences[0] == plain and len(drafter.asked_at) == forced.stats[0].steps
    assert len([a for a in drafter.asked_at if a < 40]) == 40  # one token per step until the switch


def test_a_drafter_held_off_costs_its_probes_only_its_other_steps_launch_what_plain_steps_do(fixed_costs,
                                                                                                monkeypatch):
    """The steps the guard decodes plainly, before and after a probe, run plain decoding's ops at that position (no
    block, attention path or tree left over from a probe), counted: per step the ops that launch work."""
    from specdec.engine import Engine
    from specdec.launches import Launches

    steps = []  # (root position, probed, ops launched)
    step = Engine.step

    def counted(engine):
        s = engine.live[0]
        position, asked = len(s.token_ids), s.proposals
        with Launches() as launched:
            out = step(engine)
        steps.append((position, s.proposals > asked, launched.ops))
        return out

    monkeypatch.setattr(Engine, "step", counted)
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=140)[0]
    plain_ops = {position: ops for position, _, ops in steps}
    steps.clear()
    assert generate(model, [prompt], max_new_tokens=140, drafter=Scripted(plain, 4, 32, switch=10**9))[0] == plain
    probes = [i for i, (_, probed, _) in enumerate(steps) if probed]
    assert len(probes) >= 3 and probes[-1] < len(steps) - 10, probes  # unprobed steps after several probes
    differ = [(i, dict(ops - plain_ops[p]), dict(plain_ops[p] - ops)) for i, (p, probed, ops) in enumerate(steps)
              if not probed and ops != plain_ops[p]]
    assert not differ, (probes, differ[:3])


def test_the_steps_a_drafter_is_held_off_work_out_no_cost_correction(monkeypatch):
    """A held-off step's time is recorded, and the verify-cost correction it moves is worked out only when a probe's
    sizing reads the curve: counted, the steps between probes work out none (each had worked out every size's)."""
    from specdec.engine import Engine

    costs = CostModel({}, {1: {1: 0.01, 65: 0.02}})  # this machine's verify times correct it (not fixed_costs)
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: costs)

    worked_out, steps = [], []  # per step: whether it probed, and the corrections worked out in it
    step, correct = Engine.step, OnlineCosts._correct

    def counted(engine):
        s = engine.live[0]
        asked, before = s.proposals, len(worked_out)
        out = step(engine)
        steps.append((s.proposals > asked, len(worked_out) - before))
        return out

    def correcting(self, bucket, n):
        worked_out.append(n)
        correct(self, bucket, n)

    monkeypatch.setattr(Engine, "step", counted)
    monkeypatch.setattr(OnlineCosts, "_correct", correcting)
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=140)[0]
    assert generate(model, [prompt], max_new_tokens=140, drafter=Scripted(plain, 4, 32, switch=10**9))[0] == plain
    held_off = [(i, corrections) for i, (probed, corrections) in enumerate(steps) if not probed]
    assert len(held_off) > 100
    assert [(i, corrections) for i, corrections in held_off if corrections] == []


class LuckyOnce(Scripted):
    """Wrong, except on its ``lucky``-th propose call (0-based)."""

    def __init__(self, plain, prompt_len, vocab, lucky):
        super().__init__(plain, prompt_len, vocab, switch=10**9)
        self.lucky = lucky

    def propose(self, seqs):
        if len(self.asked_at) != self.lucky:
            return super().propose(seqs)
        n = len(seqs[0].token_ids)
        self.asked_at.append(n - self.prompt_len)
        return [DraftTree.chain(self.plain[n: n + 4])]


def test_one_lucky_probe_costs_one_more_probe_not_the_whole_ramp(fixed_costs):
    """A drafter that rarely pays and is right once: each paying step divides the backoff by four, so, wrong
    again, the guard is back near its old backoff within two probes (a reset to 0 restarted the ramp, 2, 8, 32
    ...: untrained Medusa heads, right once in a while, measured 0.92x of plain on translation that way)."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=140)[0]
    drafter = LuckyOnce(plain, len(prompt), 32, lucky=1)
    assert generate(model, [prompt], max_new_tokens=140, drafter=drafter)[0] == plain
    # the second probe (step 3) is the lucky one (5 tokens): it paid, so the drafter is asked right after it (step 4,
    # token 8); wrong again, the next probes wait for half a step of banked budget each: steps 49 and 99 (tokens 53
    # and 103; a reset of the ramp asked at tokens 9, 12, 21, 54, ...)
    assert drafter.asked_at == [0, 3, 8, 53, 103]


class SlowFirstCall(Scripted):
    """Wrong drafts, instantly, except that its first call takes ``first_seconds`` (a catch-up on the prompt)."""

    def __init__(self, plain, prompt_len, vocab, first_seconds):
        super().__init__(plain, prompt_len, vocab, switch=10**9)
        self.first_seconds = first_seconds

    def propose(self, seqs):
        if not self.asked_at:
            time.sleep(self.first_seconds)
        return super().propose(seqs)


def test_a_sequences_first_propose_call_is_not_a_steps_draft_cost(monkeypatch):
    """A drafter's first call for a sequence catches up on the whole prompt (EAGLE's layer over every prompt row):
    the engine flags it, and the sizer prices only that call's judgement by it, until the next call's time
    replaces it. As the first sample of the average, a 512-token summary's catch-up set a maximal backoff that the
    guard's memory carried into the next calls (EAGLE then drafted nothing on qa)."""
    recorded = []
    real = TreeSizer.record_draft
    monkeypatch.setattr(TreeSizer, "record_draft", lambda self, s, catch_up=False: recorded.append(catch_up)
                        or real(self, s, catch_up))
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=30)[0]
    drafter = SlowFirstCall(plain, len(prompt), 32, first_seconds=0.3)
    assert generate(model, [prompt], max_new_tokens=30, drafter=drafter)[0] == plain
    assert recorded[0] and not any(recorded[1:]) and len(recorded) == len(drafter.asked_at) >= 2

    sizer = TreeSizer(FLAT)  # FLAT: a decode step is 1 s
    sizer.record_draft(16.0, catch_up=True)  # nothing known yet: it prices this call's judgement
    assert sizer.draft_cost(1) == 16.0
    sizer.record_draft(0.1)  # the next call replaces it, not averaged with it
    assert sizer.draft_cost(1) == pytest.approx(0.1)
    sizer.record_draft(5.0, catch_up=True)  # another sequence's catch-up: the steps' average is kept
    sizer.record_draft(0.2)
    assert sizer.draft_cost(1) == pytest.approx(0.1 + 0.2 * (0.2 - 0.1))


class CapturesOnItsSecondCall(Scripted):  # as a drafter whose graphs are captured at their first replay
    def propose(self, seqs):
        if len(self.asked_at) == 1:
            note_capture()
        return super().propose(seqs)


def test_a_call_that_captured_a_cuda_graph_prices_nothing(monkeypatch):
    """A CUDA-graph capture (~0.1-1 s on a GPU) inside a drafter's call or a step's verify is a one-off: the call
    is flagged as a sequence's first is (its time prices no step's draft), and the step's verify time is not
    recorded. As a step's draft time, a capture would price the guard's probes at a hundred steps or more."""
    from specdec.engine import Engine

    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=30)[0]
    flags, timed, steps = [], [], []
    draft, step, verify = TreeSizer.record_draft, TreeSizer.record_step, Engine.verify

    def verify_capturing_at_the_third_step(self, batch):
        steps.append(1)
        if len(steps) == 3:
            note_capture()
        return verify(self, batch)

    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: FLAT)  # no calibration steps
    monkeypatch.setattr(TreeSizer, "record_draft", lambda self, s, catch_up=False: flags.append(catch_up)
                        or draft(self, s, catch_up))
    monkeypatch.setattr(TreeSizer, "record_step", lambda self, *a: timed.append(a) or step(self, *a))
    monkeypatch.setattr(Engine, "verify", verify_capturing_at_the_third_step)
    drafter = CapturesOnItsSecondCall(plain, len(prompt), 32, switch=10**9)
    assert generate(model, [prompt], max_new_tokens=30, drafter=drafter)[0] == plain
    assert flags[:2] == [True, True] and not any(flags[2:]) and len(flags) == len(drafter.asked_at) >= 3
    assert len(timed) == len(steps) - 1  # every step's verify time but the capturing one's


class NoCatchUp(Scripted):
    catches_up = False  # a sequence's first call costs what a step's does (self-draft, Medusa)


def test_a_drafter_without_a_catch_up_is_priced_by_its_first_call(fixed_costs, monkeypatch):
    """Self-draft's first call for a sequence takes what every later one does (its layers' K/V of the prompt are the
    target's): flagged as a catch-up, it priced nothing, so the guard asked again three steps later, one probe more
    per answer (self-draft on the embedded model probed 4 times in 64 tokens). Not flagged, the first judgement
    prices the probe and the next waits for banked budget; a drafter that catches up keeps the early second probe."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=140)[0]
    drafter = NoCatchUp(plain, len(prompt), 32, switch=10**9)
    assert generate(model, [prompt], max_new_tokens=140, drafter=drafter)[0] == plain
    assert drafter.asked_at[:2] == [0, BANKED_HALF_STEP], drafter.asked_at
    drafter = Scripted(plain, len(prompt), 32, switch=10**9)
    assert generate(model, [prompt], max_new_tokens=140, drafter=drafter)[0] == plain
    assert drafter.asked_at[:3] == [0, 3, BANKED_HALF_STEP], drafter.asked_at

    recorded = []  # the built-in drafters say it: self-draft's calls are never flagged
    real = TreeSizer.record_draft
    monkeypatch.setattr(TreeSizer, "record_draft", lambda self, s, catch_up=False: recorded.append(catch_up)
                        or real(self, s, catch_up))
    generate(model, [prompt], max_new_tokens=8, drafter="self-draft", drafter_options={"num_layers": 1})
    assert recorded and not any(recorded)


def test_never_pays_when_a_draft_forward_costs_a_decode_step_whatever_the_acceptance():
    assert TreeSizer(FLAT).never_pays(1.0)  # r = 1: L drafted tokens cost L steps + a verify, commit <= L + 1
    assert not TreeSizer(FLAT).never_pays(0.5)  # 1 + 1 > 0.5 + c(2) = 1.5: a chain of one could pay
    assert not TreeSizer(FLAT).never_pays(None)  # no model of its own: the guard probes
    steep = CostModel({}, {1: {1: 1.0, 2: 1.5, 65: 64.0}})  # every extra verified token costs half a step or more
    assert steep.relative(2) == 1.5 and TreeSizer(steep).never_pays(0.6)
    assert not TreeSizer(steep).never_pays(0.4)


def test_the_target_drafting_for_itself_is_never_asked_under_the_guard():
    """Its forward IS a decode step (the same cost model), so the engine decodes plainly from the first step:
    no drafter prefill, no probe, no KV pool of its own; speculation="always" still drafts (and is accepted: it is
    the target)."""
    from specdec.drafters.draft_model import DraftModelDrafter

    model = build_tiny_model(vocab_size=64, seed=3)
    prompt = [1, 2, 3, 4, 5]
    plain = generate(model, [prompt], max_new_tokens=24)[0]
    guarded = DraftModelDrafter(model=model, num_draft_tokens=3)
    out = generate(model, [prompt], max_new_tokens=24, drafter=guarded, return_dict=True)
    assert out.sequences[0] == plain and guarded.draft_forwards == 0 and out.stats[0].steps == 24
    assert guarded.cache is None
    forced = DraftModelDrafter(model=model, num_draft_tokens=3)
    out = generate(model, [prompt], max_new_tokens=24, drafter=forced, return_dict=True, speculation="always")
    assert out.sequences[0] == plain and forced.draft_forwards > 0 and out.stats[0].steps < 12
    assert forced.cache is None  # its own pool, made at its first propose, freed when the call ended (detach)


def test_a_draft_model_that_can_never_pay_is_not_asked_under_seeded_sampling():
    """Seeded standard sampling runs speculation="auto" without a sizer: a draft model bigger than the target can
    never pay by its shapes, so it is never asked (no draft forward) and each of the 6 steps commits one token."""
    from specdec.drafters.draft_model import DraftModelDrafter

    big = DraftModelDrafter(model=build_tiny_model(hidden_size=128, intermediate_size=256, num_attention_heads=4),
                            num_draft_tokens=3)
    out = generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=6, do_sample=True, seed=0, drafter=big,
                   return_dict=True)
    assert big.draft_forwards == 0 and out.stats[0].steps == 6


def test_a_drafter_that_can_never_pay_makes_every_step_plain_and_queueable(monkeypatch):
    """speculation="auto" without a sizer and a drafter whose shapes can never pay: nobody drafts, and the next step
    is known to ask nobody (so it may be queued ahead, specdec.decode_ahead)."""
    from types import SimpleNamespace

    from specdec.drafters.base import TargetView

    from specdec import speculation_policy

    class NeverPays:
        name = "too-big"

        def attach(self, target):
            pass

        def never_pays_by_shape(self):
            return "it is bigger than the target"

        def cost_key(self):
            return "too-big"

    monkeypatch.setattr(speculation_policy, "_NEVER_PAYS_WARNED", set())
    policy = speculation_policy.SpeculationPolicy(auto=True).start(NeverPays(), TargetView(None, None, None))
    live = [SimpleNamespace(seq_id=0), SimpleNamespace(seq_id=1)]
    assert policy.who_drafts(live) == [] and policy.asks_nobody_next(live)


class _SizerCutting:
    """A stand-in sizer whose every call keeps the first ``keep`` nodes of each tree."""

    off = False

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def size_call(self, seq_ids, trees, batch, seconds, catch_up, verified):
        return [t.subtree(list(range(min(self.keep, t.num_nodes)))) for t in trees]


def _propose_call(trees, verified=False):
    from specdec.speculation_policy import ProposeCall

    return ProposeCall(list(range(len(trees))), trees, len(trees), 0.0, False, verified)


def test_the_policy_verifies_the_sized_part_and_says_whether_it_cut():
    """Trees of 3 and 1 nodes under a sizer keeping 2: [3 -> 2, 1 -> 1], a cut, so the next pending trees are read
    before they are verified; keeping 3 cuts nothing, and the proposals are verified whole again."""
    from specdec.speculation_policy import SpeculationPolicy

    trees = [DraftTree.chain([1, 2, 3]), DraftTree.chain([4])]
    policy = SpeculationPolicy()
    policy.sizer = _SizerCutting(2)  # (a real TreeSizer reads costs; the policy only calls size_call)
    assert [t.num_nodes for t in policy.size(_propose_call(trees))] == [2, 1] and not policy.verifies_whole
    policy.sizer.keep = 3
    assert [t.num_nodes for t in policy.size(_propose_call(trees))] == [3, 1] and policy.verifies_whole


def test_pending_trees_already_verified_whole_are_not_cut_after():
    """Pending trees were verified whole before sizing: the acceptance walks those whole trees (3 nodes), while the
    sizing's cut (to 2) is only learned from, and said by verifies_whole for the next step."""
    from specdec.speculation_policy import SpeculationPolicy

    trees = [DraftTree.chain([1, 2, 3])]
    policy = SpeculationPolicy()
    policy.sizer = _SizerCutting(2)
    assert policy.size(_propose_call(trees, verified=True)) == trees and not policy.verifies_whole


def test_guard_remembers_across_calls_where_a_drafter_stopped_paying(fixed_costs):
    """generate() once per answer: the second call of a drafter that never matched starts priced (no probe until
    the calls have banked one), the same text; once a call finds it paying, the next call asks it from the first
    step. What a call leaves is judged by its running averages, not by its last step (cut to the token budget)."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=200)[0]
    calls = []
    # never right, never right, always right (a short call, then a long one), always right
    for switch, new in ((10**9, 60), (10**9, 60), (0, 60), (0, 200), (0, 60)):
        drafter = Scripted(plain, len(prompt), 32, switch=switch)
        assert generate(model, [prompt], max_new_tokens=new, drafter=drafter)[0] == plain[: len(prompt) + new]
        calls.append(drafter.asked_at)
    assert calls[0] == [0, 3, BANKED_HALF_STEP]  # a fresh guard: the catch-up, a priced probe, then budget
    # remembered not to pay: no probe before the calls can afford one; the first call banked 10 steps' budget
    # after its last probe (steps 50-59), so this call's probe comes 10 steps earlier than a fresh bank's
    assert calls[1] == [BANKED_HALF_STEP - 10]
    # still remembered (20 steps banked after the last probe); the first probe pays, and from then on the drafter is
    # asked every step (5 tokens each); six paying steps outweigh two calls of evidence
    assert calls[2] == [30, 35, 40, 45, 50, 55]
    assert calls[3][:2] == [0, 5] and len(calls[3]) == 40  # the last call ended paying: asked from the first step
    assert calls[4][0] == 0


def test_guard_memory_outlives_the_process_in_the_cost_cache(fixed_costs, tmp_path):
    """What the guard learned is kept in the cost cache too: a new process (this one's store emptied) starts where
    the last call left off; an unreadable or damaged file, or one an older guard wrote (another MEMORY_FORMAT: its
    backoff and price meant something else), is a fresh start, never an error."""
    from specdec.remembered import forget_all, use_folder

    use_folder(tmp_path)
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=60)[0]
    asked = []
    for damage in (None, None, "older format", "a null", "not json"):
        forget_all()  # a new process
        for file in tmp_path.glob("*.json") if damage else ():
            data = json.loads(file.read_text())
            data["value"] |= {"format": MEMORY_FORMAT - 1} if damage == "older format" else {"skip": None}
            file.write_text("{not json" if damage == "not json" else json.dumps(data))
        drafter = Scripted(plain, len(prompt), 32, switch=10**9)
        assert generate(model, [prompt], max_new_tokens=60, drafter=drafter)[0] == plain
        asked.append(drafter.asked_at)
    assert list(tmp_path.glob("guard-*.json"))
    assert asked[0] == [0, 3, BANKED_HALF_STEP]  # nothing kept yet: probes at once
    assert asked[1] == [BANKED_HALF_STEP - 10]  # the last process's judgement and bank, read from the cost cache
    assert asked[2] == [0, 3, BANKED_HALF_STEP]  # an older guard's memory: fresh
    assert asked[3] == asked[4] == [0, 3, BANKED_HALF_STEP]  # a count that is no number, or unreadable: fresh


def test_short_calls_probe_a_drafter_remembered_not_to_pay_as_one_long_call_would(fixed_costs):
    """One generate() per 20-token answer of a drafter that never matches: the guard keeps its backoff and banked
    probe budget across calls, so the answers together probe once per ~50 steps (a probe costs half a step, the
    budget is 1% of a step per step). Each call once started with an empty bank and half its backoff: no call
    after the first could afford a probe, and a drafter that began to pay later was never asked again."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=20)[0]
    probes = []  # step numbers counted over all the calls
    for call in range(12):
        drafter = Scripted(plain, len(prompt), 32, switch=10**9)
        assert generate(model, [prompt], max_new_tokens=20, drafter=drafter)[0] == plain
        probes += [20 * call + step for step in drafter.asked_at]
    assert probes[:2] == [0, 3] and len(probes) >= 6, probes
    gaps = [b - a for a, b in pairwise(probes[2:])]
    assert all(BANKED_HALF_STEP - 1 <= gap <= BANKED_HALF_STEP + 3 for gap in gaps), probes


def test_a_run_of_short_calls_pays_for_its_probes_catch_ups():
    """In a run of short calls nearly every probe is a sequence's first ask of its call: a catch-up (EAGLE's layer
    over the prompt, a draft model's prefill), here 10 decode steps against a step's 0.6. Charged only its price,
    the probes of a drafter that never pays took ~6% of 100 calls of 16 steps; charged what they cost, the bank pays
    them back first and the run stays near the 1% budget (the first call's catch-up alone is 0.6% of it)."""
    drafted = steps = asks_after_first_call = 0
    for call in range(100):
        sizer = TreeSizer(FLAT, memory=("catch-up",))  # FLAT: a decode step is 1 s
        asked_before = False
        for _ in range(16):
            if sizer.wants_draft(0):
                seconds = 0.6 if asked_before else 10.0
                sizer.size_call([0], [DraftTree.chain([5, 6])], 1, seconds, catch_up=not asked_before)
                sizer.observe(0, [1])  # never the drafted token
                drafted += seconds
                asks_after_first_call += call > 0
                asked_before = True
            steps += 1
        sizer.release(0)
    assert asks_after_first_call >= 1  # still probed: the bank and the backoff carry over
    assert drafted / steps < 0.025, (drafted, steps)


def _short_calls(catch_ups: list[float], calls: int) -> tuple[list[tuple[int, float]], list[tuple[float, float]]]:
    """A run of 16-step calls of a drafter that never pays (FLAT: a decode step is 1 s; a step's draft 0.5 s): each
    call's first ask is a catch-up, the run's i-th costing ``catch_ups[i]`` (the last one from then on). Returns the
    probes (step, counted over the run; draft seconds) and per priced catch-up its cost and all it took from the
    bank."""
    probes, charges = [], []
    for call in range(calls):
        sizer = TreeSizer(FLAT, memory=("short calls",))
        asked_before = False
        for step in range(16):
            if not sizer.wants_draft(0):
                continue
            guard = sizer.guards[0]
            credit, price = guard.credit, guard.charged  # the price is taken already
            seconds = 0.5 if asked_before else catch_ups[min(sum(s != 0.5 for _, s in probes), len(catch_ups) - 1)]
            sizer.size_call([0], [DraftTree.chain([5, 6])], 1, seconds, catch_up=not asked_before)
            if not asked_before and price is not None:
                charges.append((seconds, credit + price - guard.credit))
            sizer.observe(0, [1])  # never the drafted token
            probes.append((16 * call + step, seconds))
            asked_before = True
        sizer.release(0)
    return probes, charges


def test_one_outlier_catch_up_keeps_a_drafter_unprobed_for_at_most_three_typical_ones():
    """A catch-up is charged at most 3x what the drafter's recent ones cost (the second largest of its last eight),
    so after any one catch-up the drafter is probed again within 3 x 2 / 0.01 = 600 steps here. Charged in full, one
    25x outlier (a GC pause, a descheduled process: 50 steps) kept it unprobed for ~5,000 steps, carried from call to
    call in the guard's memory, however the text changed meanwhile."""
    typical, outlier = 2.0, 50.0
    probes, charges = _short_calls([typical] * 5 + [outlier, typical], calls=120)
    assert [cost for cost, _ in charges[:5]] == [typical] * 4 + [outlier]  # the first catch-up was priced nothing
    assert charges[4][1] == pytest.approx(3 * typical)
    at = next(step for step, seconds in probes if seconds == outlier)
    assert any(at < step <= at + 3 * typical / 0.01 + 1 for step, _ in probes), (at, probes)


def test_catch_ups_of_usual_sizes_are_charged_in_full():
    """Catch-ups that vary as prompts do (here 1-2.5 steps) are each charged all they cost: the cap is for outliers.
    Prompts that turn several times longer are charged in full from the third such catch-up within eight."""
    usual = [2.0, 1.0, 2.5, 1.5] * 3
    _, charges = _short_calls([*usual, 8.0], calls=300)
    first = len(usual) - 1  # the run's first catch-up was priced nothing
    assert [cost for cost, _ in charges] == usual[1:] + [8.0] * (len(charges) - first) and len(charges) > first + 3
    assert all(taken == pytest.approx(cost) for cost, taken in charges[:first])
    # longer prompts: charged 3 x 2.5 until two of the last eight are long
    assert [taken for _, taken in charges[first:]] == pytest.approx([7.5, 7.5] + [8.0] * (len(charges) - first - 2))


def test_a_guard_memory_without_catch_up_costs_is_read_and_a_damaged_one_is_not():
    """A memory of this format written before catch-up costs were kept is read (the next catch-up is charged in full);
    one whose catch-up costs are no numbers is a fresh start, never an error."""
    from specdec.remembered import remember

    older = {"backoff": 8, "skip": 3, "credit": -1.5, "format": MEMORY_FORMAT}
    remember("guard", ("older",), older)
    sizer = TreeSizer(FLAT, memory=("older",))
    assert sizer.catch_ups == [] and sizer.wants_draft(0) is False and sizer.guards[0].credit == pytest.approx(-1.49)
    remember("guard", ("damaged",), older | {"catch_ups": [2.0, None]})
    sizer = TreeSizer(FLAT, memory=("damaged",))
    assert sizer.catch_ups == [] and sizer.wants_draft(0) is True


class ScriptedCheckpoint(Drafter):
    """Scripted under one name for every checkpoint ``path``, as two EAGLE or Medusa checkpoints share theirs."""

    name = "scripted"

    def __init__(self, path, *args):
        self.path, self.script = path, Scripted(*args)

    def propose(self, seqs):
        return self.script.propose(seqs)


def test_guard_memory_is_kept_per_checkpoint_not_per_drafter_name(fixed_costs):
    """Two checkpoints of one drafter type and name keep apart backoffs (the key is ``cost_key()``, which names
    the checkpoint): a bad checkpoint's backoff once made a good one's next call skip its first 25 steps."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=60)[0]
    bad = ScriptedCheckpoint("bad", plain, len(prompt), 32, 10**9)
    assert generate(model, [prompt], max_new_tokens=60, drafter=bad)[0] == plain
    good = ScriptedCheckpoint("good", plain, len(prompt), 32, 0)
    assert generate(model, [prompt], max_new_tokens=60, drafter=good)[0] == plain
    assert good.script.asked_at[0] == 0  # a fresh guard for this checkpoint: asked from the first step
    again = ScriptedCheckpoint("bad", plain, len(prompt), 32, 10**9)
    assert generate(model, [prompt], max_new_tokens=60, drafter=again)[0] == plain
    assert again.script.asked_at == [BANKED_HALF_STEP - 10]  # the bad checkpoint's own judgement (and bank)


def test_the_first_unpaid_probe_backs_off_with_its_own_draft_time():
    """The propose call's time is recorded before its tree is judged: the very first probe of a drafter that
    costs half a step is priced by it, and the next waits for half a step of banked budget (it once skipped none,
    so every call probed at steps 0 and 1; then 2 steps, so a 16-token call probed 3-4 times)."""
    sizer = TreeSizer(FLAT)
    sizer.record_draft(0.5)  # FLAT: a decode step is 1 s
    sizer.size(0, DraftTree.chain([10], scores=torch.tensor([0.01])), batch=1)  # expected 1.01 tokens for 1.5 steps
    assert sizer.unpaid == 1 and sizer.guards[0].price == pytest.approx(0.5)
    asked = [sizer.wants_draft(0) for _ in range(60)]
    assert asked.index(True) == BANKED_HALF_STEP and asked.count(True) == 1  # 50 steps: the probe's own banked none


def test_a_low_confidence_step_between_confident_ones_does_not_back_off():
    """The guard judges a sequence's running expected tokens and cost, not each step alone, and a new answer
    starts from the last one's: a trained draft layer's pruned low-confidence step between confident ones once
    started a backoff that skipped the confident drafts after it (EAGLE drafting one token, 2-core CPU: 0.98x of
    plain, 1.20x when asked every step)."""
    costs = CostModel({}, {1: {1: 1.0, 2: 1.1, 65: 64.0}})
    sizer = TreeSizer(costs, memory=("low confidence",))
    sizer.record_draft(0.08)  # a decode step is 1 s
    asked = []
    for step in range(12):
        asked.append(sizer.wants_draft(0))
        if asked[-1]:
            confident = step % 2 == 0
            tree = DraftTree.chain([10], scores=torch.tensor([0.9 if confident else 0.1]))
            assert sizer.size(0, tree, batch=1).num_nodes == int(confident)
            sizer.observe(0, [10 if confident else 11, 12])
    assert all(asked)
    sizer.release(0)  # the next answer's first draft is a low-confidence one: it starts from this answer's average
    sizer = TreeSizer(costs, memory=("low confidence",))
    sizer.record_draft(0.08)
    assert sizer.wants_draft(0)
    sizer.size(0, DraftTree.chain([10], scores=torch.tensor([0.1])), batch=1)
    sizer.observe(0, [11, 12])
    assert sizer.guards[0].backoff == 0 and sizer.wants_draft(0)
    for _ in range(12):  # only low-confidence drafts from now on: the average falls and the guard backs off
        if sizer.wants_draft(0):
            sizer.size(0, DraftTree.chain([10], scores=torch.tensor([0.1])), batch=1)
            sizer.observe(0, [11, 12])
    assert sizer.guards[0].backoff > 0


def test_a_cheap_drafter_is_priced_by_its_draft_not_by_the_tree_the_sizer_bet_on():
    """A probe surely costs its draft; verifying a kept tree is the sizer's bet, placed only where the tree is
    expected to pay. Priced by the verify of the tree kept on the step that was judged, n-gram (a draft of 0.5% of
    a step) came out of a call on text it could not copy with a price of ~0.3 steps, and in every later 16-token
    call it was never asked again, not even on text it copies well (tau 3.5 before, 1.0 after)."""
    steep = CostModel({}, {1: {1: 1.0, 65: 17.0}})  # each extra verified token costs a quarter of a step
    sizer = TreeSizer(steep)
    sizer.record_draft(0.005)  # a decode step is 1 s
    for _ in range(3):  # nothing to propose: the running averages say drafting does not pay
        sizer.size(0, DraftTree.empty(), batch=1)
    # one node expected to pay on its own (1.45 tokens for 1.26 steps) is kept, yet the averages still do not pay
    assert sizer.size(0, DraftTree.chain([10], scores=torch.tensor([0.45])), batch=1).num_nodes == 1
    assert sizer.unpaid == 4 and sizer.guards[0].price == pytest.approx(0.005)  # not the kept node's 0.255


def test_a_probe_is_priced_by_the_drafters_cheapest_path():
    """The combined drafter (n-gram + self-draft) costs 0.6 of a step when its child gate tries self-draft and
    0.005 when it leaves it out; priced by its average, a call that tried self-draft left it unasked in every later
    16-token call, n-gram's copies included (held-out: tau 3.5 before). Its price is the cheaper path's, and the
    child gate budgets the costly child."""
    sizer = TreeSizer(FLAT)  # a decode step is 1 s
    for seconds in (0.6, 0.005, 0.6):
        sizer.record_draft(seconds)
    assert sizer.draft_cost(1) > 0.3 and sizer.probe_cost(1) < 0.2  # the low envelope rises slowly toward 0.6
    sizer.size(0, DraftTree.empty(), batch=1)  # nothing proposed: unpaid
    assert sizer.guards[0].price == pytest.approx(sizer.probe_cost(1))


def test_a_drafter_that_made_itself_cheap_is_not_held_back_by_its_dearer_past():
    """The backoff is capped by what a probe costs, its cheapest draft (its price) plus the verify beyond a step: a
    combined drafter whose gate had just left out a child costing 0.6 of a step was capped by its average draft
    time, still ~0.4 steps, and skipped for 2, 8, 32 steps while its n-gram child cost 0.5% of one (cold chat: tau
    1.06 against n-gram's 1.25 alone)."""
    sizer = TreeSizer(FLAT)  # a decode step is 1 s
    for _ in range(3):
        sizer.record_draft(0.6)
        sizer.size(0, DraftTree.empty(), batch=1)
    assert sizer.guards[0].backoff > 0
    sizer.record_draft(0.005)  # the costly child left out
    sizer.size(0, DraftTree.empty(), batch=1)
    assert sizer.draft_cost(1) > 0.3  # the average has not caught up
    assert sizer.guards[0].backoff == sizer.guards[0].skip == 0
    assert sizer.guards[0].price == pytest.approx(0.005)


def test_a_probe_is_priced_by_the_cheaper_call_the_drafter_says_it_will_make():
    """A drafter that knows its next call is cheaper than any it made (the combined drafter, once its gate has timed
    a costly child and leaves it out) prices the probe: the guard had priced it by the one step call it saw, the
    costly child's first, and held the cheap children back for hundreds of steps (n-gram + a child of ~10 decode
    steps a call: tau 1.02 over a 300-token call where n-gram alone had 12.5). Dearer than the calls made, or
    unknown, it changes nothing."""
    told = [0.01]
    sizer = TreeSizer(FLAT, cheapest_call=lambda: told[0])  # a decode step is 1 s
    sizer.record_draft(10.0)  # the one step call timed: the costly child ran
    sizer.size(0, DraftTree.empty(), batch=1)  # unpaid
    assert sizer.guards[0].price == pytest.approx(0.01) and sizer.probe_cost(1) == pytest.approx(0.01)
    asked = [sizer.wants_draft(0) for _ in range(40)]
    assert asked.count(True) >= 1  # probed again within the backoff (2) and a hundredth of a step of budget
    for value in (None, 20.0):
        told[0] = value
        assert sizer.probe_cost(1) == pytest.approx(10.0)


def test_a_pending_tree_verified_whole_is_learned_node_for_node():
    """Pending trees (specdec.pending_trees) are verified whole and sized after: what is learned of a sampled tree
    indexes every verified node, not only the part sizing would have kept."""
    sizer = TreeSizer(CostModel({}, {1: {1: 1.0, 2: 1.5, 65: 64.0}}))  # every extra token costs half a step or more
    sizer.last_shape = [-1, 0, 1]  # an earlier sampled chain
    tree = DraftTree([1, 2, 3], [-1, 0, 1], torch.full((3, 8), 1 / 8), DraftMode.INDEPENDENT)
    sized = sizer.size_call([0], [tree], batch=1, draft_seconds=0.0, verified=True)
    assert sized[0].num_nodes < 3  # what sizing would have verified
    sizer.observe(0, [1, 2, 3, 4], accepted_nodes=[0, 1, 2])  # indices into the whole tree, as verified
    assert sizer.unscored == {(1, 0): [1.0, 1.0], (2, 0): [1.0, 1.0], (3, 0): [1.0, 1.0]}


def test_the_policy_host_benchmark_runs_and_keeps_trees_under_flat_costs(tmp_path):
    """benchmarks/bench_policy_host.py (the sizer's host time per step): every row measured, and under a GPU-like
    flat cost curve the sizer keeps nodes of every tree, so the rows time real sizing and learning."""
    import json

    from tests.script_loading import load_script

    bench = load_script("bench_policy_host")
    assert bench.main(["--rounds", "2", "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["batch"], r["nodes"], r["scored"]) for r in rows] == [(b, d * w, s) for b, d, w, s in bench.GRID]
    assert all(r["size_ms"] > 0 and r["observe_ms"] > 0 and r["kept_nodes"] > 1 for r in rows)


def _padded_ratio(sizer: TreeSizer, sizes: dict[int, int], costs: CostModel) -> float:
    """Expected tokens of a call over the cost of its padded verify: every sequence pays c(1 + the largest tree)."""
    tokens = sum(1.0 + sum(sizer.pending[i].path[j] for j in sizer.pending[i].order[:k]) for i, k in sizes.items())
    return tokens / costs.relative(1 + max(sizes.values()), 1)


def test_a_padded_batch_caps_its_trees_together_where_one_long_tree_would_price_every_sequence():
    costs = CostModel({}, {1: {1: 1.0, 2: 1.05, 9: 1.8, 65: 20.0}})  # each token past the second: a tenth of a step
    confident = DraftTree.chain(list(range(10, 18)), scores=torch.full((8,), 0.95))
    weak = DraftTree.chain(list(range(20, 28)), scores=torch.full((8,), 0.3))
    trees = [confident] + [weak] * 7
    sized = {}
    for padded in (False, True):
        sizer = TreeSizer(costs, padded=padded)
        out = sizer.size_call(list(range(8)), trees, batch=8, draft_seconds=0.0)
        sized[padded] = (sizer, {i: t.num_nodes for i, t in enumerate(out)})
        for t in out:  # a prefix of each chain: ancestor-closed
            assert t.parents.tolist() == list(range(-1, t.num_nodes - 1))
    alone_sizer, alone = sized[False]
    capped_sizer, capped = sized[True]
    assert alone[0] > max(alone[i] for i in range(1, 8))  # sized alone, the confident tree is the longest
    assert max(capped.values()) < alone[0]  # together, it is cut
    best = _padded_ratio(capped_sizer, capped, costs)
    assert best > _padded_ratio(alone_sizer, alone, costs)
    for k in range(1, 9):  # no common cap does better by the sizer's own estimates
        assert best >= _padded_ratio(capped_sizer, {i: min(k, alone[i]) for i in alone}, costs) - 1e-12


def test_a_padded_batch_caps_a_lone_asked_tree_too():
    """Through CUDA-graph buckets the sequences the guard holds off run the padded verify of the one it asks: a lone
    confident chain at batch 8, kept whole as an eager verify keeps it, prices the 8 sequences' step at c(9) for
    fewer tokens than 8 plain steps' worth; the cap cuts it, as it cuts the trees of a call of two, to a tree whose
    step beats the batch's plain steps."""
    costs = CostModel({}, {1: {1: 1.0, 2: 1.05, 9: 1.8, 65: 20.0}})  # each token past the second: a tenth of a step
    confident = DraftTree.chain(list(range(10, 18)), scores=torch.full((8,), 0.95))
    kept, ratio = {}, {}
    for padded in (False, True):
        sizer = TreeSizer(costs, padded=padded)
        kept[padded] = sizer.size_call([0], [confident], batch=8, draft_seconds=0.0)[0].num_nodes
        pending = sizer.pending[0]
        # the step's tokens (one for each of the 8 sequences, and the kept nodes' expected ones) per plain step
        ratio[padded] = (8 + sum(pending.path[j] for j in pending.order[:kept[padded]])) / costs.relative(
            1 + kept[padded], 8)
    assert kept[False] == confident.num_nodes and 0 < kept[True] < kept[False]
    assert ratio[False] < 8 < ratio[True]


def test_the_guard_judges_what_the_padded_cap_left_of_a_tree():
    """Two sequences of 32 asked (a draft costing a tenth of a step), each with a node that pays alone (0.9 tokens
    for 0.05 of a step) but not for the 32 sequences its padded verify prices: the cap verifies neither, and the
    guard judges each step as the empty one it was, holding the drafter off, as sized alone (eager) it judges the
    node it verifies. (Judged as sized alone, the drafter was asked at every step for nothing verified.)"""
    costs = CostModel({}, {1: {1: 1.0, 2: 1.05, 9: 1.8, 65: 20.0}})  # a decode step: 1 s
    tree = DraftTree.chain([5], scores=torch.tensor([0.9]))
    for padded in (False, True):
        sizer = TreeSizer(costs, calibrated_scores=True, padded=padded)
        verified = [t.num_nodes for t in sizer.size_call([0, 1], [tree, tree], 32, 0.1)]
        assert verified == ([0, 0] if padded else [1, 1])
        assert (sizer.paid, sizer.unpaid) == ((0, 2) if padded else (2, 0))
        assert [sizer.wants_draft(i) for i in (0, 1)] == [not padded] * 2


def test_capped_trees_keep_greedy_the_targets_in_a_batch(monkeypatch):
    """A batch sized by the padded cap (as under CUDA-graph buckets: engine_setup passes ``padded`` when the verify
    runs through them) commits plain greedy's tokens; the cap cut some step's trees below what each kept alone."""
    from specdec.testing import ragged_prompts

    steep = CostModel({}, {1: {1: 1.0, 2: 1.02, 65: 8.0}})  # each token past the second: about a ninth of a step
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: steep)
    policy = engine_setup._policy
    monkeypatch.setattr(engine_setup, "_policy", lambda *args, **kwargs: policy(*args, **{**kwargs, "padded": True}))
    cut = []
    cap = TreeSizer._cap_padded

    def spied(self, seq_ids, costs, batch):
        before = [len(self.pending[i].kept) for i in seq_ids if i in self.pending]
        cap(self, seq_ids, costs, batch)
        cut.append(sum(len(self.pending[i].kept) for i in seq_ids if i in self.pending) < sum(before))

    monkeypatch.setattr(TreeSizer, "_cap_padded", spied)
    model = build_tiny_model(vocab_size=32, seed=2)
    prompts = ragged_prompts(4, 32, seed=3, max_len=24)
    plain = generate(model, prompts, max_new_tokens=40)
    assert generate(model, prompts, max_new_tokens=40, drafter="ngram", speculation="auto") == plain
    assert any(cut), cut


def test_where_held_off_steps_are_queued_drafts_must_beat_a_queued_step():
    """Once a queued plain step is timed (half a step read back here), a drafter whose steps commit 1.5 tokens for
    one step read back no longer pays (0.75 step's worth at queued prices), is held off, and its probe is priced at
    the queued step it replaces too; a queued step's time corrects no verify cost."""
    tree = DraftTree.chain([5, 6], scores=torch.tensor([0.5, 0.01]))  # ~1.5 tokens expected, verifying free
    judged = {}
    for queued in (False, True):
        sizer = TreeSizer(FLAT, calibrated_scores=True)
        sizer.queues_held_off = True  # as the engine sets it where it queues held-off steps
        sizer.record_step(0.01, 1, 1)  # a plain step read back: 10 ms
        if queued:
            sizer.record_step(0.005, 1, 1, queued=True)
            assert sizer.plain_price(1) == pytest.approx(0.5) and sizer.step_seconds(1) == pytest.approx(0.01)
            sizer.queues_held_off = False  # an engine that reads every step back: no queued step to compare with
            assert sizer.plain_price(1) == 1.0
            sizer.queues_held_off = True
        sizer.record_draft(0.0001)  # a cheap drafter: a hundredth of a step
        sizer.size_call([0], [tree], 1, 0.0001)
        judged[queued] = (sizer.paid, sizer.unpaid, sizer.guards[0].price, sizer.wants_draft(0))
    assert judged[False] == (1, 0, None, True)
    paid, unpaid, price, asked = judged[True]
    assert (paid, unpaid, asked) == (0, 1, False) and price == pytest.approx(0.51)


def _held_off_sizer() -> TreeSizer:
    """A sizer whose guard holds sequence 0 off where held-off steps are queued at half a step read back: its drafter
    (a hundredth of a step) did not pay, so a probe waits for 0.51 of a step banked, ~50 steps at 1% a step."""
    sizer = TreeSizer(CostModel({}, {1: {1: 1.0, 65: 1.6}}), calibrated_scores=True)
    sizer.queues_held_off = True
    sizer.record_step(0.01, 1, 1)
    sizer.record_step(0.005, 1, 1, queued=True)
    sizer.record_draft(0.0001)
    sizer.size_call([0], [DraftTree.chain([5, 6], scores=torch.tensor([0.5, 0.01]))], 1, 0.0001)
    sizer.observe(0, [9])
    assert not sizer.wants_draft(0) and sizer.guards[0].price == pytest.approx(0.51)
    return sizer


def test_a_held_off_drafter_asked_in_hindsight_is_asked_again_once_its_draft_would_have_paid():
    """Where held-off steps are queued, the guard asks a held-off drafter in hindsight: its tree is judged by the
    tokens committed after it (never verified), once they decide it; a tree the text followed to its leaf would have
    paid, so the drafter is asked at the next step, not ~50 steps later; one the text left at its first node moves no
    backoff and asks nothing."""
    chain = DraftTree.chain([5, 6, 7, 8], scores=torch.tensor([0.9, 0.9, 0.9, 0.9]))
    # 3 tokens for ~1.05 steps read back pay at queued prices (1.5 of 0.5-step steps), not with the queue that
    # asking breaks (half a step) counted
    for text, decided, pays in (([5, 6, 7, 8], 4, True), ([5, 4, 3, 2], 2, False), ([5, 6, 9, 2], 3, False)):
        sizer = _held_off_sizer()
        backoff = sizer.guards[0].backoff
        assert sizer.who_looks_back([0]) == [0]
        sizer.looked_back([0], [chain], 0.00001, 1)
        assert sizer.who_looks_back([0]) == []  # one look open per sequence
        for k, token in enumerate(text[:decided]):
            assert 0 in sizer.looks, (text, k)  # undecided: an accepted path with nodes below, not yet committed
            sizer.observe(0, [token])
        assert 0 not in sizer.looks
        assert sizer.wants_draft(0) is pays
        assert sizer.guards[0].backoff == (backoff // 4 if pays else backoff)
    # what a look costs is paid from its own bank: one of half a step waits ~25 steps at 2% a step
    sizer = _held_off_sizer()
    assert sizer.who_looks_back([0]) == [0]
    sizer.looked_back([0], [DraftTree.empty()], 0.005, 1)  # an empty tree: nothing to judge
    waited = 0
    while not sizer.who_looks_back([0]):
        waited += 1
    assert 20 <= waited <= 26
    engine_reads_back = _held_off_sizer()
    engine_reads_back.queues_held_off = False  # no queued step whose device time hides a look
    assert engine_reads_back.who_looks_back([0]) == []


def test_a_timed_queued_step_is_remembered_by_the_next_call_and_a_damaged_one_is_not():
    """A queued step's time is kept per batch bucket: one timed at batch 1 prices no batch of 32 (a small model's
    queued step at 32 costs nearly twice its step at 1), whose first plain step due times its own."""
    sizer = TreeSizer(FLAT, memory=("queued-step",))
    sizer.queues_held_off = True
    sizer.record_step(0.01, 1, 1)
    sizer.record_step(0.005, 1, 1, queued=True)
    assert sizer.plain_price(1) == pytest.approx(0.5) and sizer.plain_price(32) == 1.0
    sizer.online.drafted[sizer.costs.batch_bucket(32)] = 99  # a plain step due at 32 (OnlineCosts.plain_step_due)
    assert sizer.queue_due(32) and not sizer.queue_due(1)
    sizer.size_call([0], [DraftTree.chain([5], scores=torch.tensor([0.5]))], 1, 0.0001)
    sizer.release(0)
    assert TreeSizer(FLAT, memory=("queued-step",)).queued_seconds == {1: pytest.approx(0.005)}
    from specdec.remembered import recall, remember

    kept = recall("guard", ("queued-step",), persist=True)
    for damaged in ("fast", 0.005, [[1, "x"]], [[0, 0.005]]):  # (a float: an older call's, of no known batch)
        remember("guard", ("queued-step",), {**kept, "queued": damaged}, persist=True)
        assert TreeSizer(FLAT, memory=("queued-step",)).queued_seconds == {}


def test_whether_a_whole_proposal_would_have_paid_is_judged_at_the_batch_it_was_drafted_in():
    """A probe at batch 8, where a queued step costs half a step read back, whose whole tree committed 2 tokens for
    about one step read back (1 queued step's worth each) would not have paid there: the guard keeps its backoff. With
    a queued step timed at batch 1 only, a step at batch 8 is priced as one read back, and the same tree would have
    paid: the drafter is asked again at once. (Judged at batch 1's price whatever the batch, each went the other
    way.)"""
    costs = CostModel({}, {1: {1: 1.0, 65: 1.0}, 8: {1: 1.0, 65: 1.0}})  # verifying is free at both sizes
    tree = DraftTree.chain([5, 6], scores=torch.tensor([0.01, 0.01]))  # cut to nothing: a probe that does not pay
    for queued_at, asked_again in ((8, False), (1, True)):
        sizer = TreeSizer(costs, calibrated_scores=True)
        sizer.queues_held_off = True
        sizer.record_step(0.01, 1, 8)
        sizer.record_step(0.005, 1, queued_at, queued=True)  # a queued step: half of one read back
        sizer.record_draft(0.0001)
        sizer.size_call([0], [tree], 8, 0.0001)
        assert sizer.unpaid == 1 and sizer.guards[0].skip > 0
        sizer.observe(0, [5, 9])  # its first node was the text's: 2 tokens for ~1 step read back
        assert (sizer.guards[0].skip == 0) is asked_again, queued_at
