"""The calibrated verify-cost curve corrected by the run's own step times (specdec.online_costs), and the
sizer pricing trees with it."""
from __future__ import annotations

import json
from dataclasses import replace
from itertools import pairwise

import pytest
import torch

from specdec import engine_setup
from specdec.cost_model import CostModel
from specdec.generate import generate
from specdec.online_costs import OnlineCosts
from specdec.speculation_policy import SpeculationPolicy
from specdec.testing import build_tiny_model
from specdec.tree import DraftTree
from specdec.tree_sizing import SizingConfig, TreeSizer

# calibrated: 2 tokens cost a decode step, 3 tokens 1.2
CALIBRATED = CostModel({}, {1: {1: 0.030, 2: 0.030, 3: 0.036, 65: 1.0}})
FLAT_CACHE = CostModel({}, {1: {1: 0.010, 65: 0.010}})  # a cached curve too flat for this machine: c(n) = c(1)


def steep(n: int) -> float:
    """What a verify of n tokens really costs on this (pretend) machine: c(17) = 1.96 c(1)."""
    return 0.010 * (1 + 0.06 * (n - 1))


def test_observed_step_times_correct_the_calibrated_curve_where_observed():
    online = OnlineCosts(CALIBRATED)
    assert online.relative(2) == pytest.approx(1.0)  # nothing observed: the calibration
    for _ in range(32):
        online.record(0.030, 1, 1)
        online.record(0.045, 2, 1)  # a real 2-token step costs 1.5 decode steps here
    # shrunk toward 1 by the evidence (32 samples against a prior of 8): 1 + 0.8 * 0.5
    assert online.relative(2) == pytest.approx(1.4)
    # never observed: calibrated, times the correction of the largest size measured below it
    assert online.relative(3) == pytest.approx(1.2 * 1.4)
    assert online.relative(2, batch=4) == pytest.approx(1.0)  # another batch bucket: its own evidence (none)


def test_a_size_without_samples_of_its_own_takes_the_correction_of_the_sizes_around_it():
    """A cached curve that is flat (c(n) = c(1)) where a 17-token verify really costs 1.96 decode steps: once that is
    measured, the sizes in between cost between 1 and c(17) (interpolated in n), larger ones c(17)'s correction; with
    each size at its calibrated cost the sizer walked down one untried size at a time, each seen three times."""
    online = OnlineCosts(FLAT_CACHE)
    for _ in range(32):
        online.record(steep(1), 1, 1)
        online.record(steep(17), 17, 1)
    top = 1 + 0.8 * 0.96  # shrunk toward 1 by the evidence: 32 samples against a prior of 8
    assert online.relative(17) == pytest.approx(top)
    assert online.relative(9) == pytest.approx(1 + (top - 1) / 2)
    assert [online.relative(n) for n in range(1, 18)] == sorted(online.relative(n) for n in range(1, 18))
    assert online.relative(40) == pytest.approx(top)


def test_a_run_whose_steps_all_draft_measures_a_plain_step_now_and_then():
    """The correction divides by plain steps' times: a bucket that only drafts asks for one after 8 drafted steps
    until it has 3, then after 32 (to keep them fresh); a run that decodes plainly now and then is never asked."""
    online = OnlineCosts(FLAT_CACHE)
    due = []
    for _ in range(200):
        due.append(online.plain_step_due(1))
        online.record(steep(1) if due[-1] else steep(17), 1 if due[-1] else 17, 1)
    at = [i for i, d in enumerate(due) if d]
    assert at[:4] == [8, 17, 26, 59] and [b - a for a, b in pairwise(at[3:])] == [33] * (len(at) - 4)
    assert online.relative(17) > 1.2 and not online.plain_step_due(2)  # another batch bucket drafted nothing yet
    plainly = OnlineCosts(FLAT_CACHE)
    for i in range(200):
        assert not plainly.plain_step_due(1)
        plainly.record(steep(1) if i % 8 == 0 else steep(17), 1 if i % 8 == 0 else 17, 1)  # the guard's skips


def test_without_one_token_steps_nothing_is_corrected():
    online = OnlineCosts(CALIBRATED)
    for _ in range(32):
        online.record(0.090, 2, 1)  # every step drafted: no baseline to compare with
    assert online.relative(2) == pytest.approx(1.0)


def test_plain_steps_work_out_the_correction_once_when_the_curve_is_read(monkeypatch):
    """A drafter the guard holds off decodes plainly step after step, and each plain step's time moves every size's
    correction: worked out at each of them, a held-off drafter's step cost more host time than plain decoding's. It is
    worked out when sizing next reads the curve, and is then the curve that reading it at every step gives."""
    every_step, held_off = OnlineCosts(CALIBRATED), OnlineCosts(CALIBRATED)
    for online in (every_step, held_off):
        for _ in range(8):
            online.record(0.030, 1, 1)
            online.record(0.045, 2, 1)
            online.record(0.050, 5, 1)
    worked_out = []
    correct = OnlineCosts._correct

    def counted(self, bucket, n):
        worked_out.append(self is held_off)
        correct(self, bucket, n)

    monkeypatch.setattr(OnlineCosts, "_correct", counted)
    for k in range(40):
        for online in (every_step, held_off):
            online.record(0.030 + 0.002 * (k % 7), 1, 1)
        every_step.relative(3)  # sizing reads the curve at every step
    assert worked_out.count(True) == 0
    assert [held_off.relative(n) for n in range(1, 9)] == [every_step.relative(n) for n in range(1, 9)]
    assert worked_out.count(True) == 1


def test_a_rare_slow_step_does_not_move_the_correction():
    """Medians: one step in many held up by the machine (a page fault, another process) is not a cost of n."""
    online = OnlineCosts(CALIBRATED)
    for i in range(30):
        online.record(0.030, 1, 1)
        online.record(0.300 if i == 7 else 0.030, 2, 1)
    assert online.relative(2) == pytest.approx(1.0)


def test_one_or_two_slow_steps_of_a_rarely_seen_size_do_not_set_its_cost():
    """A size verified once, held up by the machine, keeps its calibrated cost, and still does after a second, normal
    step (the median of two is their mean); from the third the median outvotes the slow one; a cost seen three times
    is a cost."""
    online = OnlineCosts(CALIBRATED)
    for _ in range(30):
        online.record(0.030, 1, 1)
    for seconds in (0.210, 0.030, 0.030):  # 7 decode steps' worth, then normal ones
        online.record(seconds, 2, 1)
        assert online.relative(2) == pytest.approx(1.0)
    for _ in range(3):
        online.record(0.060, 3, 1)  # 3 tokens cost 2 decode steps here, calibrated 1.2
    assert online.relative(3) > 1.2


def test_the_correction_is_clipped_at_twice_the_calibrated_cost():
    online = OnlineCosts(CostModel({}, {1: {1: 1.0, 8: 1.0}}))  # calibrated flat: c(4) = c(1)
    for _ in range(32):
        online.record(1.0, 1, 1)
        online.record(6.0, 4, 1)
    # raw 6, shrunk 1 + 0.8 * 5 = 5, clipped to 2
    assert online.relative(4) == pytest.approx(2.0)


def test_a_later_call_is_handed_the_last_min_samples_times_of_each_size():
    online = OnlineCosts(CALIBRATED)
    for i in range(1, 11):
        online.record(float(i), 1, 1)
    assert online.kept()["verify_times"] == [[1, 1, [8.0, 9.0, 10.0]]]  # min_samples = 3


def test_a_restored_measuring_bank_holds_one_step_at_most():
    online = OnlineCosts(CALIBRATED)
    online.restore([], [], [[1, 50.0]])  # a damaged or hand-edited memory
    assert online.credit == {1: 1.0}


def test_the_window_follows_a_change_of_cost():
    online = OnlineCosts(CALIBRATED, window=8, prior=1.0)
    for _ in range(8):
        online.record(0.030, 1, 1)
        online.record(0.060, 2, 1)
    assert online.relative(2) > 1.7
    for _ in range(8):
        online.record(0.030, 2, 1)  # the old samples leave the window
    assert online.relative(2) == pytest.approx(1.0)


def test_the_sizer_drops_a_tree_that_pays_only_on_the_calibrated_curve():
    """A 1-node tree accepted ~30% of the time, drafted for free: on the calibrated curve (c(2) = c(1)) it pays;
    after this run's 2-token steps were seen to cost 1.5 decode steps it does not, and the guard backs off."""
    tree = DraftTree.chain([5], scores=torch.tensor([0.3]))
    fresh = TreeSizer(CALIBRATED, SizingConfig(margin=0.0))
    assert fresh.size(0, tree, batch=1).num_nodes == 1 and fresh.paid == 1
    sizer = TreeSizer(CALIBRATED, SizingConfig(margin=0.0))
    for _ in range(32):
        sizer.record_step(0.030, 1, 1)
        sizer.record_step(0.045, 2, 1)
    assert sizer.size(0, tree, batch=1).num_nodes == 0 and sizer.unpaid == 1


def test_the_margin_drops_a_tree_expected_to_break_even():
    """Expected 1.03 committed tokens per decode step's cost: within the calibration's own scatter, not a gain."""
    tree = DraftTree.chain([5], scores=torch.tensor([0.03]))
    assert TreeSizer(CALIBRATED, SizingConfig(margin=0.0)).size(0, tree, batch=1).num_nodes == 1
    sizer = TreeSizer(CALIBRATED)  # the default margin, 5%
    assert sizer.size(0, tree, batch=1).num_nodes == 0 and sizer.unpaid == 1
    sure = DraftTree.chain([5], scores=torch.tensor([0.5]))
    assert sizer.size(1, sure, batch=1).num_nodes == 1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        OnlineCosts(CALIBRATED, window=0)
    with pytest.raises(ValueError):
        SizingConfig(margin=1.5)


class HalfRight:
    """A 16-token chain whose first token is the plain continuation's at every other call, the others never: only the
    first node pays, and only where verifying it costs about a plain step."""

    name = "half-right"

    def __init__(self, plain: list[int], vocab: int) -> None:
        self.plain, self.vocab, self.calls = plain, vocab, 0

    def propose(self, seqs):
        out = []
        for s in seqs:
            right = self.plain[len(s.token_ids): len(s.token_ids) + 16]
            self.calls += 1
            first = right[0] if self.calls % 2 else (right[0] + 1) % self.vocab
            out.append(DraftTree.chain([first] + [(t + 1) % self.vocab for t in right[1:]]))
        return out


def cache_on_a_machine(monkeypatch, cache: CostModel, seconds, draft: float = 0.0) -> None:
    """The cached curve is ``cache``, every verify of n tokens takes ``seconds(n)``, a draft costs ``draft`` decode
    steps."""
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: cache)
    monkeypatch.setattr(TreeSizer, "draft_cost", lambda self, batch: draft)
    monkeypatch.setattr(TreeSizer, "probe_cost", lambda self, batch: draft)
    observe = SpeculationPolicy.observe

    def timed(self, step):
        observe(self, step if step.verify_seconds is None else replace(step, verify_seconds=seconds(step.query_tokens)))

    monkeypatch.setattr(SpeculationPolicy, "observe", timed)


def nodes_verified(drafter, new: int, **sampling) -> list[int]:
    """Draft nodes verified per step over ``new`` tokens of the tiny model, drafted by ``drafter(plain, vocab)``;
    the text is checked to be plain decoding's."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=new + 20, **sampling)[0]
    out = generate(model, [prompt], max_new_tokens=new, drafter=drafter(plain, 32), return_dict=True, **sampling)
    assert out.sequences[0] == plain[: len(prompt) + new]
    return list(out.stats[0].step_nodes)


@pytest.fixture
def flat_cache_on_a_steep_machine(monkeypatch):
    """The cached curve is flat (FLAT_CACHE) and every verify takes steep(n) seconds; drafting is free."""
    cache_on_a_machine(monkeypatch, FLAT_CACHE, steep)


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "sampler": "coupled", "seed": 3}],
                         ids=["greedy", "coupled"])
def test_a_too_flat_cached_curve_is_corrected_in_a_run_where_every_step_drafts(flat_cache_on_a_steep_machine,
                                                                               sampling):
    """The cached curve says 16 more verified tokens are free; here they cost about a decode step. The guard believed
    drafting paid, so no step was plain, nothing was corrected, and every step verified all 16 nodes (1.3-1.4x plain
    decoding's time in a real run). Plain steps now and then measure c(1): within ~30 steps the trees are cut to
    what pays, the first node; the text is plain decoding's (a plain step commits the target's own token)."""
    nodes = nodes_verified(HalfRight, 100, **sampling)
    assert 0 in nodes[:30] and max(nodes[30:]) <= 2, nodes


def test_short_calls_correct_the_curve_together(flat_cache_on_a_steep_machine, tmp_path):
    """One generate() per 12-token answer: a call has too few steps to measure plain steps enough, and each call
    started again from the cached curve. The last verify times are kept with the guard's memory, so a run of short
    calls is corrected too; damaged ones in the cost cache are a fresh start, never an error."""
    from specdec.remembered import forget_all, use_folder

    use_folder(tmp_path)
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=20)[0]
    nodes = []
    for _ in range(10):
        out = generate(model, [prompt], max_new_tokens=12, drafter=HalfRight(plain, 32), return_dict=True)
        assert out.sequences[0] == plain[: len(prompt) + 12]
        nodes.append(list(out.stats[0].step_nodes))
    assert max(nodes[-1]) <= 2, nodes
    forget_all()  # a new process, reading a damaged file
    for file in tmp_path.glob("guard-*.json"):
        data = json.loads(file.read_text())
        file.write_text(json.dumps(data | {"value": data["value"] | {"verify_times": [[1, "two", None]]}}))
    out = generate(model, [prompt], max_new_tokens=12, drafter=HalfRight(plain, 32), return_dict=True)
    assert out.sequences[0] == plain[: len(prompt) + 12]


def test_seeded_standard_sampling_still_verifies_every_draft_whole(flat_cache_on_a_steep_machine):
    """No plain step is forced where the policy is off: a seed's text must not depend on measured times."""
    model = build_tiny_model(vocab_size=32, seed=2)
    prompt = [1, 2, 3, 4]
    plain = generate(model, [prompt], max_new_tokens=60)[0]
    out = generate(model, [prompt], max_new_tokens=40, drafter=HalfRight(plain, 32), return_dict=True,
                   do_sample=True, seed=3)
    assert 0 not in out.stats[0].step_nodes[:-1]  # the last step: one token left to the budget


STEEP_CACHE = CostModel({}, {1: {1: 0.010, 65: 0.650}})  # a cached curve too steep: c(n) = n c(1)


def nearly_flat(n: int) -> float:
    """What a verify of n tokens really costs on this (pretend) machine: c(17) = 1.32 c(1)."""
    return 0.010 * (1 + 0.02 * (n - 1))


@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "sampler": "coupled", "seed": 3}],
                         ids=["greedy", "coupled"])
def test_a_too_steep_cached_curve_is_corrected_though_it_verifies_no_draft(monkeypatch, sampling):
    """The cached curve says a 2-token verify costs two decode steps; here it costs 1.02. No draft seemed to pay, so
    every step was plain, plain steps measured only c(1), and the run (and every later one: the curve is cached)
    decoded plainly while the first node of every other draft would have paid. A tree cut to nothing now keeps its
    best node now and then, from a budget of its own (a probe's price, 2% of a step here as for n-gram on the
    embedded model, would leave a probe budget of 1% a step nothing for it), until the run has timed enough 2-token
    verifies."""
    cache_on_a_machine(monkeypatch, STEEP_CACHE, nearly_flat, draft=0.02)
    nodes = nodes_verified(HalfRight, 300, **sampling)
    assert sum(n > 0 for n in nodes[-50:]) >= 15, nodes


def test_measuring_a_curve_that_is_right_to_be_steep_stays_within_the_probe_budget(monkeypatch):
    """Where 2 tokens do cost two decode steps, a measuring verify costs a whole step: at 1% of a step banked per
    step, about one in a hundred steps measures."""
    cache_on_a_machine(monkeypatch, STEEP_CACHE, lambda n: 0.010 * n)
    measured = [i for i, n in enumerate(nodes_verified(HalfRight, 300)) if n > 0]
    assert 1 <= len(measured) <= 3 and all(b - a >= 90 for a, b in pairwise(measured)), measured


def test_the_measuring_bank_fills_across_short_calls():
    """A hundredth of a step per step, kept with the guard's memory: calls of 60 and 40 steps afford the first
    measured verify where the curve prices it at a whole step, as one call of 100 steps would."""
    online = OnlineCosts(STEEP_CACHE)
    for _ in range(60):
        online.record(nearly_flat(1), 1, 1)
    assert not online.measure_due(1, 0.05)
    later = OnlineCosts(STEEP_CACHE)
    later.restore(**json.loads(json.dumps(online.kept())))
    for _ in range(40):
        later.record(nearly_flat(1), 1, 1)
    assert later.measure_due(1, 0.05) and not later.measure_due(1, 0.05)  # the bank paid for one


def test_a_measured_verify_priced_at_no_extra_cost_needs_no_bank():
    """On a curve where 2 tokens cost what 1 does, measure_due charged 0 from a bucket with nothing banked yet and
    raised KeyError out of generate() (seen with MtpDrafter on a tiny model whose measured curve was that flat)."""
    online = OnlineCosts(FLAT_CACHE)
    assert online.measure_due(1, 0.05) and online.credit == {1: 0.0}


class Wrong(HalfRight):
    """A 4-token chain that is never right."""

    name = "wrong"

    def propose(self, seqs):
        return [DraftTree.chain([(t + 1) % self.vocab for t in self.plain[len(s.token_ids): len(s.token_ids) + 4]])
                for s in seqs]


def test_a_curve_found_right_is_measured_no_further(monkeypatch):
    """Where this run times 2 tokens as the curve prices them, three measured verifies are enough: a drafter that
    never pays, on a cheap 2-token verify, is not measured every few steps until a window is full."""
    right = CostModel({}, {1: {1: 0.010, 65: 0.010 * (1 + 0.03 * 64)}})
    cache_on_a_machine(monkeypatch, right, lambda n: 0.010 * (1 + 0.03 * (n - 1)))
    nodes = nodes_verified(Wrong, 100)
    # its first steps draft on the prior's bet and are measured until 3 plain and 3 two-token times are in (steps
    # 0-10 here); measured until the window filled, a step in three was, up to step 76 of 100
    assert 0 < max(n for n in nodes[:20]) and max(nodes[20:]) == 0, nodes


def test_a_cached_curve_beyond_what_the_correction_can_mend_is_named_once(tmp_path, caplog):
    """Three times too steep, the correction (clipped at 0.5) still cuts drafts that would pay: the log says which
    file to delete, once half a window of times stands behind it, and once per process."""
    file = tmp_path / "verify-steep.json"
    steeper = CostModel({}, {1: {1: 0.010, 65: 0.010 * (1 + 2 * 64)}}, file=file)  # c(2) = 3 c(1)
    online = OnlineCosts(steeper)
    with caplog.at_level("WARNING", logger="specdec.online_costs"):
        for _ in range(15):
            online.record(nearly_flat(1), 1, 1)
            online.record(nearly_flat(2), 2, 1)
        assert not caplog.records  # 15 times of each: not yet
        for _ in range(20):
            online.record(nearly_flat(1), 1, 1)
            online.record(nearly_flat(2), 2, 1)
        again = OnlineCosts(steeper)  # a later call of this process
        again.restore([[1, 1, [nearly_flat(1)] * 16], [1, 2, [nearly_flat(2)] * 16]], [])
        assert again.relative(2) < 3.0
    assert [r.getMessage() for r in caplog.records] == [
        f"the cached verify costs in {file} price 2 query tokens at 3.00 decode steps, where this run measures 1.02 "
        "(a calibration taken while the machine was busy?): speculation='auto' drafts less than it should; delete "
        "the file to measure them again"]
    caplog.clear()
    online = OnlineCosts(replace(STEEP_CACHE, file=tmp_path / "verify-2x.json"))  # twice too steep: mended
    with caplog.at_level("WARNING", logger="specdec.online_costs"):
        for _ in range(32):
            online.record(nearly_flat(1), 1, 1)
            online.record(nearly_flat(2), 2, 1)
    assert not caplog.records


def test_a_value_remembered_while_another_call_saves_is_saved_next_time(tmp_path, monkeypatch):
    """Concurrent generate() calls share the guard's store: save() cleared the whole unsaved set after writing,
    dropping a value another thread's call had remembered meanwhile (so the next process never read it)."""
    from specdec import remembered

    remembered.use_folder(tmp_path)  # conftest gives each test a folder, and resets it after
    write = remembered.write_json
    others = []

    def write_while_another_remembers(file, data):  # another thread's call finishes during this save
        if not others:
            others.append(1)
            remembered.remember("guard", ("other",), {"v": 2}, persist=True)
        return write(file, data)

    monkeypatch.setattr(remembered, "write_json", write_while_another_remembers)
    remembered.remember("guard", ("first",), {"v": 1}, persist=True)
    remembered.save()
    remembered.save()  # the next run's end
    remembered.forget_all()  # a new process
    assert remembered.recall("guard", ("first",), persist=True) == {"v": 1}
    assert remembered.recall("guard", ("other",), persist=True) == {"v": 2}
