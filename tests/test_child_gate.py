"""The combined drafter's child gate: a child whose extra tokens do not cover its draft time is left out and
probed again, a child that pays keeps running, a left-out child that starts to pay is back within a few calls,
a left-out child still gets every hidden row, and the gate is off wherever wall times must not decide (the engine
offers its decode time only where they may: test_combined_drafter.py)."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from specdec.drafters.base import CostView, Drafter, SequenceView, TargetView
from specdec.drafters.child_gate import ChildGate, GateConfig
from specdec.drafters.combined import CombinedDrafter

from specdec.errors import InputError
from specdec.generate import generate
from specdec.testing import build_tiny_model
from specdec.tree import DraftMode, DraftTree


def tree_cost(nodes: int, batch: int) -> float:
    return 1.0 + 0.05 * nodes


def gate_with(seconds: list[float], decode: float = 0.1) -> ChildGate:
    """A started gate whose children's draft calls took ``seconds`` each (decode step: ``decode`` s)."""
    gate = ChildGate(len(seconds), GateConfig())
    gate.start(CostView(tree_cost, lambda batch: decode))
    for k, s in enumerate(seconds):
        gate.record_seconds(k, s, catch_up=False)
    return gate


def drive(gate: ChildGate, calls: int, record) -> list[tuple[bool, ...]]:
    """``calls`` decisions; after each call where every child ran, one record ``record(call)``."""
    out = []
    for call in range(calls):
        run = gate.choose(1, tree_cost, 64)
        out.append(run)
        if all(run):
            gate.observe(*record(call))
    return out


# ---- the decision -----------------------------------------------------------------------------
def test_an_expensive_child_that_adds_nothing_is_left_out_and_probed_within_budget():
    gate = gate_with([0.001, 0.05])  # draft costs 0.01 and 0.5 decode steps
    runs = drive(gate, 200, lambda call: ((1, 0), (2, 2)))  # child 0 matches a level, child 1 never
    assert all(run[0] for run in runs)
    full = sum(all(run) for run in runs)
    # a probe every ceil(0.5 / 0.02) = 25 calls, ~2% of a decode step per call, from the start: the warm-up's
    # records come from probes too (it ran the expensive child at every call, 3 of them)
    assert 200 // 25 - 1 <= full <= 200 // 25 + 1
    # the same gate with the expensive child made cheap keeps both: nothing to gain by leaving it out
    cheap = gate_with([0.001, 0.001])
    assert all(all(run) for run in drive(cheap, 50, lambda call: ((1, 0), (2, 2))))


def test_an_expensive_child_that_pays_keeps_running():
    # a first call times every child; its record shows the expensive one adding levels, so it runs at every call
    gate = ChildGate(2, GateConfig())
    gate.start(CostView(tree_cost, lambda batch: 0.1))
    runs = []
    for _ in range(100):
        runs.append(gate.choose(1, tree_cost, 64))
        for k in range(2):
            if runs[-1][k]:
                gate.record_seconds(k, [0.001, 0.05][k], catch_up=False)
        if all(runs[-1]):
            gate.observe((0, 4), (2, 4))  # child 1's chain is accepted 4 deep
    assert all(run[1] for run in runs)
    # timed, with no record yet: the expensive child waits for its first probe, then runs at every call
    runs = drive(gate_with([0.001, 0.05]), 100, lambda call: ((0, 4), (2, 4)))
    first = next(i for i, run in enumerate(runs) if run[1])
    assert first < 25 and all(run[1] for run in runs[first:])


def test_a_left_out_child_that_starts_paying_is_back_within_a_few_probes():
    gate = gate_with([0.001, 0.05])
    switch = 100
    runs = drive(gate, switch + 60, lambda call: ((1, 0 if call < switch else 5), (2, 5)))
    assert sum(run[1] for run in runs[switch - 50: switch]) <= 3  # left out before the text changed
    # one regular probe (<= 25 calls), then probes in a row while they pay, until it is chosen outright
    assert all(run[1] for run in runs[-20:])


def test_a_child_timed_only_by_its_catch_up_is_not_left_out_by_that_time():
    """A first call's catch-up (EAGLE's layer over the whole prompt: 16 decode steps here) is no step's cost: the
    warm-up runs the child again for a step's time, then keeps it while it pays (left out by the catch-up's time,
    it was probed once in 64 calls, again as a catch-up)."""
    gate = ChildGate(2, GateConfig())
    gate.start(CostView(tree_cost, lambda batch: 0.025))
    runs, timed = [], set()
    for call in range(40):
        runs.append(gate.choose(1, tree_cost, 64))
        for k in range(2):
            if runs[-1][k]:
                first = k not in timed
                gate.record_seconds(k, ([0.002, 0.4] if first else [0.0005, 0.0025])[k], catch_up=first)
                timed.add(k)
        if all(runs[-1]):
            gate.observe((1, 1) if call == 0 else (0, 3), (4, 8))  # child 1 adds nothing at first, then 3 levels
    assert all(run[1] for run in runs)


def test_a_calls_own_records_replace_an_earlier_calls_once_it_has_a_few():
    """What an earlier call's text taught the gate decides only until the call has ``warmup`` records of its own: a
    costly child that added two levels on the earlier text and adds nothing on this one is left out from the 4th
    call (weighed with the 32 recalled records, it ran for ~30 calls: ngram+eagle after a chat, on rag)."""
    key = ("test", "own records replace recalled ones")
    first = gate_with([0.001, 0.01])  # draft costs 0.01 and 0.1 decode steps
    first.start(CostView(tree_cost, lambda batch: 0.1), key)
    for k, s in enumerate([0.001, 0.01]):
        first.record_seconds(k, s, catch_up=False)
    drive(first, 60, lambda call: ((0, 2), (2, 1)))
    first.finish()
    gate = ChildGate(2, GateConfig())
    gate.start(CostView(tree_cost, lambda batch: 0.1), key)
    assert len(gate.records) == 32
    runs = drive(gate, 40, lambda call: ((1, 0), (2, 1)))
    assert all(run[1] for run in runs[:3])  # the earlier text decides the first calls
    assert sum(run[1] for run in runs[3:]) <= 37 // 5 + 1  # then probes only, every ceil(0.1 / 0.02) = 5 calls


def test_a_subsets_nodes_are_priced_at_most_at_the_nodes_cap():
    """A child proposing 60 nodes of which the cap lets 8 be verified is priced at 8: it matches 6 levels against
    the other child's 1, so it runs alone. Priced at 60 nodes, the child that matches 1 level looked better."""
    gate = gate_with([0.001, 0.001], decode=0.01)  # each child 0.1 decode steps a call
    for _ in range(5):
        gate.observe((1, 6), (4, 60))

    def cost(n, batch):
        return 1.0 + n

    # (0,): 2 tokens / (0.1 + c(4) = 5.1) = 0.39; (1,): 7 / (0.1 + c(8) = 9.1) = 0.77; (0, 1): 7 / (0.2 + 9) = 0.76
    # uncapped, (1,) would be 7 / (0.1 + c(60)) = 0.11
    assert gate.next_best(1, cost, 8) == (1,)


def test_the_gate_is_off_without_the_policys_costs():
    gate = ChildGate(2)
    gate.start(None)
    for k in range(2):
        gate.record_seconds(k, [0.001, 10.0][k], catch_up=False)
    assert all(all(run) for run in drive(gate, 20, lambda call: ((1, 0), (2, 2))))


def test_a_catch_up_call_does_not_move_the_child_timing():
    gate = gate_with([0.01])
    gate.record_seconds(0, 5.0, catch_up=True)  # a prompt's prefill, not a step's cost
    assert gate.times[0].seconds == pytest.approx(0.01)
    gate.record_seconds(0, 0.02, catch_up=False)
    assert gate.times[0].seconds == pytest.approx(0.012)
    # a child's first call is a catch-up: it stands in until the next call's time replaces it (the tree sizer's rule)
    fresh = ChildGate(1)
    fresh.record_seconds(0, 5.0, catch_up=True)
    assert fresh.times[0].seconds == 5.0
    fresh.record_seconds(0, 0.02, catch_up=False)
    assert fresh.times[0].seconds == pytest.approx(0.02)


# ---- the combined drafter ---------------------------------------------------------------------
class HiddenRows(Drafter):
    """Reads hidden states; checks at every call that the rows it got since the first add up to every position
    before the root (the drafter contract), and proposes a chain of a token the target never picks."""

    needs_hidden_states = True

    def __init__(self, name: str = "hidden", token: int = 95) -> None:
        self.name, self.token = name, token
        self.rows: dict[int, int] = {}
        self.calls = 0

    def propose(self, seqs):
        self.calls += 1
        for v in seqs:
            got = 0 if v.new_hidden is None else v.new_hidden.shape[0]
            self.rows[v.seq_id] = self.rows.get(v.seq_id, 0) + got
            assert self.rows[v.seq_id] == len(v.token_ids) - 1, (self.rows[v.seq_id], len(v.token_ids))
        return [DraftTree.chain([self.token]) for _ in seqs]


class Fixed(Drafter):
    name = "fixed"

    def propose(self, seqs):
        return [DraftTree.chain([5]) for _ in seqs]


def test_a_left_out_child_gets_the_hidden_rows_of_the_calls_it_missed(monkeypatch):
    child = HiddenRows()
    combined = CombinedDrafter([Fixed(), child])
    combined.attach(type("Target", (), {"runner": None, "costs": CostView(tree_cost, lambda b: 0.1)})())
    pattern = iter([(True, True), (True, False), (True, False), (True, True), (True, False), (True, True)])
    monkeypatch.setattr(combined.gate, "choose", lambda *a: next(pattern))
    tokens = [1, 2, 3, 4]
    hidden = torch.zeros(3, 8)  # prefill: every prompt position but the root
    for _ in range(6):
        combined.propose([SequenceView(0, list(tokens), 4, hidden)])
        tokens += [5, 6]  # two tokens committed: the old root and one accepted node get rows
        combined.on_accept(0, [5, 6])
        hidden = torch.zeros(2, 8)
    assert child.calls == 3 and child.rows[0] == len(tokens) - 2 - 1


class RowValues(Drafter):
    """Reads hidden states and keeps every row it is given, in the order given."""

    name, needs_hidden_states = "rows", True

    def __init__(self) -> None:
        self.got: list[float] = []

    def propose(self, seqs):
        for v in seqs:
            if v.new_hidden is not None:
                self.got += v.new_hidden[:, 0].tolist()
        return [DraftTree.chain([95]) for _ in seqs]


def test_a_left_out_child_gets_the_missed_hidden_rows_in_the_order_of_their_positions(monkeypatch):
    child = RowValues()
    combined = CombinedDrafter([Fixed(), child])
    combined.attach(type("Target", (), {"runner": None, "costs": CostView(tree_cost, lambda b: 0.1)})())
    pattern = iter([(True, True), (True, False), (True, False), (True, True)])
    monkeypatch.setattr(combined.gate, "choose", lambda *a: next(pattern))
    tokens, position = [1, 2, 3, 4], 0
    for rows in (3, 2, 2, 2):  # the prefill's rows, then two per step; row i holds the value i
        hidden = torch.arange(position, position + rows, dtype=torch.float32)[:, None].expand(rows, 8)
        position += rows
        combined.propose([SequenceView(0, list(tokens), len(tokens), hidden)])
        tokens += [5, 6]
        combined.on_accept(0, [5, 6])
    assert child.got == [float(i) for i in range(9)]  # rows 3..6 held over two calls, then 7, 8 of the third


def test_the_gate_learns_only_from_steps_where_every_child_ran(monkeypatch):
    combined = CombinedDrafter([Fixed(), Counted()])
    combined.attach(type("Target", (), {"runner": None, "costs": CostView(tree_cost, lambda b: 0.1)})())
    pattern = iter([(True, False), (True, True), (True, False)])
    monkeypatch.setattr(combined.gate, "choose", lambda *a: next(pattern))
    for _ in range(3):
        combined.propose([SequenceView(0, [1, 2, 3], 3)])
        combined.on_accept(0, [5, 6])  # Fixed's 5 matches a level, Counted's 3 none
    # one record, of the step where both ran: a step without Counted would have recorded its 0 as a measurement
    assert [successes for successes, _ in combined.gate.records] == [(1, 0)]


class Generous(Drafter):
    """The right next token (score 0.9) and 40 wrong siblings (score 0.05): n-gram's generous trees, of which the
    engine's sizing verifies the one node that pays."""

    name = "generous"

    def propose(self, seqs):
        tokens = [7] + list(range(10, 50))
        return [DraftTree(tokens, [-1] * len(tokens), scores=torch.tensor([0.9] + [0.05] * 40)) for _ in seqs]


class Counted(Drafter):
    """One wrong node per call (score 0.5), counting its calls."""

    name, calls = "counted", 0

    def propose(self, seqs):
        self.calls += 1
        return [DraftTree.chain([3], scores=torch.tensor([0.5])) for _ in seqs]


def test_the_gate_prices_a_childs_tree_by_the_nodes_sizing_would_verify(monkeypatch):
    """A child proposing 41 nodes of which one pays is priced at the one node: a costlier child that adds nothing
    is left out. Priced at all 41 nodes (c = 3.05 decode steps), the generous child looked worse than the costly one
    alone, which then ran at every call (ngram+eagle on translation: EAGLE ran at every call, adding nothing)."""
    costly = Counted()
    combined = CombinedDrafter([Generous(), costly])
    combined.attach(type("Target", (), {"runner": None, "costs": CostView(tree_cost, lambda b: 0.1)})())
    record = combined.gate.record_seconds  # child 1's calls take 10 ms longer: 0.1 decode steps
    monkeypatch.setattr(combined.gate, "record_seconds", lambda k, s, catch_up: record(k, 0.01 * k, catch_up))
    for _ in range(100):
        combined.propose([SequenceView(0, [1, 2, 3], 3)])
        combined.on_accept(0, [7, 8])
    assert costly.calls <= 100 // 5 + 3  # the warm-up, then a probe every ceil(0.1 / 0.02) = 5 calls


def gated(children: list, decode_seconds, monkeypatch) -> CombinedDrafter:
    """A combined drafter whose gate sees a fixed decode time (None: none offered) and times child k's calls 50 ms
    longer than they took: the decisions do not depend on the machine's load. The runs use speculation="always",
    so the engine's own guard, which prices the real wall times, asks the combined drafter at every step."""
    combined = CombinedDrafter(children)
    attach = combined.attach
    costs = None if decode_seconds is None else CostView(tree_cost, decode_seconds)
    monkeypatch.setattr(combined, "attach", lambda target: attach(dataclasses.replace(target, costs=costs)))
    record = combined.gate.record_seconds
    monkeypatch.setattr(combined.gate, "record_seconds", lambda k, s, catch_up: record(k, s + 0.05 * k, catch_up))
    return combined


@pytest.mark.parametrize("gate", ["on", "off"])
def test_generate_leaves_out_a_slow_child_that_adds_nothing_and_stays_greedy_exact(gate, device, monkeypatch):
    model = build_tiny_model().to(device)
    prompts = [[5, 9, 11, 2, 5, 9, 11], [7, 3]]
    plain = generate(model, prompts, max_new_tokens=160)
    refs = {tuple(p): seq[len(p):] for p, seq in zip(prompts, plain, strict=True)}
    assert all(95 not in ref for ref in refs.values())

    class Oracle(Drafter):  # the next greedy token, then a wrong one
        name, calls = "oracle", 0

        def propose(self, seqs):
            self.calls += 1
            out = []
            for v in seqs:
                ref = refs[tuple(v.token_ids[: v.num_prompt_tokens])]
                done = len(v.token_ids) - v.num_prompt_tokens
                out.append(DraftTree.chain(ref[done: done + 1] + [95]) if done < len(ref) else DraftTree.empty())
            return out

    decode_seconds = (lambda batch: 0.002) if gate == "on" else None  # the slow child: 25 decode steps a call
    oracle, slow = Oracle(), HiddenRows("slow")
    out = generate(model, prompts, drafter=gated([oracle, slow], decode_seconds, monkeypatch), max_new_tokens=160,
                   speculation="always")
    assert out == plain
    assert oracle.calls == 80  # 2 tokens a step
    if gate == "off":  # no decode time offered (speculation="always" or seeded sampling): every child, every call
        assert slow.calls == oracle.calls
        return
    # the first two calls (the first, a catch-up, times no step), then a probe every 64 calls: the slow child's rows
    # reach it across the calls it missed (HiddenRows checks)
    assert slow.calls == 3
    # the next call with the same children starts from what this one learned: no warm-up, the probe at call 64
    slow = HiddenRows("slow")
    assert generate(model, prompts, drafter=gated([Oracle(), slow], decode_seconds, monkeypatch),
                    max_new_tokens=160, speculation="always") == plain
    assert slow.calls == 1


class SlowWrong(Drafter):
    """Wrong one-token drafts after sleeping ``seconds`` a call (twice that at a sequence's first: a catch-up)."""

    name = "slow-wrong"

    def __init__(self, seconds: float) -> None:
        self.seconds, self.calls, self.seen = seconds, 0, set()

    def propose(self, seqs):
        first = any(v.seq_id not in self.seen for v in seqs)
        self.seen.update(v.seq_id for v in seqs)
        self.calls += 1
        time.sleep(self.seconds * (2 if first else 1))
        return [DraftTree.chain([95]) for _ in seqs]


def test_the_guard_prices_a_probe_by_the_children_the_gate_will_run():
    """speculation="auto", a cold start, n-gram beside a child that costs ~5 decode steps a call and never
    matches: the gate leaves the slow child out after its first step call, and the guard, whose only step call
    timed included it, prices its next probe by what the gate will run (Drafter.cheapest_call_seconds). Priced by
    that call, it held n-gram back too: 296 of 300 steps plain on this prompt, where n-gram alone needs ~25."""
    model = build_tiny_model(vocab_size=96, num_hidden_layers=2)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    plain = generate(model, [prompt], max_new_tokens=300, eos_token_id=[])
    start = time.perf_counter()
    generate(model, [prompt], max_new_tokens=20, eos_token_id=[])
    step = (time.perf_counter() - start) / 20  # a plain step on this machine, now
    slow = SlowWrong(5 * step)

    class AtTheEnd(CombinedDrafter):  # the price as the call ended (detach lets go of the gate's costs)
        def detach(self):
            self.cheapest_at_the_end = self.cheapest_call_seconds()
            super().detach()

    combined = AtTheEnd(drafters=["ngram", slow])
    out = generate(model, [prompt], max_new_tokens=300, eos_token_id=[], drafter=combined, return_dict=True)
    assert out.sequences == plain
    assert out.forward_passes < 150 and slow.calls <= 4
    assert combined.cheapest_at_the_end < 2 * step  # n-gram's call and the merge, not the slow child's


def test_the_combined_drafters_cheapest_call_is_the_children_its_gate_runs():
    """None until every child the gate will run has a step call timed; then those children's cheapest calls and
    the drafter's own work around them."""
    combined = CombinedDrafter(drafters=["ngram", SlowWrong(0.0)])
    combined.attach(TargetView(runner=None, cache=None, sampling=None, costs=CostView(tree_cost, lambda b: 1.0)))
    assert combined.cheapest_call_seconds() is None  # nothing timed
    combined._own_time.record(0.0002)
    combined.gate.record_seconds(0, 0.0001, catch_up=True)  # first calls: catch-ups, no step's time
    combined.gate.record_seconds(1, 0.2, catch_up=True)
    assert combined.cheapest_call_seconds() is None
    combined.gate.record_seconds(0, 0.0003, catch_up=False)
    combined.gate.record_seconds(1, 0.1, catch_up=False)  # beyond the gate's budget: it will leave it out
    assert combined.gate.next_best(1, tree_cost, 64) == (0,)
    assert combined.cheapest_call_seconds() == pytest.approx(0.0003 + 0.0002)
    for _ in range(40):  # made cheap: within the gate's budget, it runs too
        combined.gate.record_seconds(1, 0.0003, catch_up=False)
    assert combined.gate.next_best(1, tree_cost, 64) == (0, 1)
    assert combined.cheapest_call_seconds() == pytest.approx(0.0003 + 0.0003 + 0.0002)
    combined.attach(TargetView(runner=None, cache=None, sampling=None, costs=None))  # the gate off: every child runs
    assert combined.cheapest_call_seconds() is None


def test_gate_option_must_be_a_bool():
    with pytest.raises(InputError, match="gate must be True or False"):
        CombinedDrafter(["ngram"], gate="yes")


# a warm-up longer than the records kept would never end
@pytest.mark.parametrize("bad", [{"warmup": 0}, {"window": 0}, {"probe_budget": 0.0}, {"ema": 1.5},
                                 {"warmup": 5, "window": 4}])
def test_gate_and_depth_configs_refuse_settings_out_of_range(bad):
    from specdec.drafters.eagle_depth import DepthConfig

    with pytest.raises(ValueError, match="invalid GateConfig"):
        GateConfig(**bad)
    if "warmup" not in bad:
        with pytest.raises(ValueError, match="invalid DepthConfig"):
            DepthConfig(**bad)
    with pytest.raises(ValueError, match="invalid DepthConfig"):
        DepthConfig(prior_weight=0.0)


def test_the_gate_runs_the_cheapest_child_when_no_child_adds_a_token():
    gate = gate_with([0.05, 0.001])  # draft costs 0.5 and 0.01 decode steps
    for _ in range(5):
        gate.observe((0, 0), (1, 1))
    # each subset commits 1 token per step (no level matched): (0,) 1 / (0.5 + c(1) = 1.55), (1,) 1 / (0.01 + 1.05),
    # (0, 1) 1 / (0.51 + c(2) = 1.1): the cheap child alone is the best value
    assert gate.next_best(1, tree_cost, 64) == (1,)


def test_a_subset_is_priced_by_its_mean_nodes_per_record_not_their_sum():
    gate = gate_with([0.001, 0.001])  # each child 0.01 decode steps a call
    for _ in range(5):
        gate.observe((3, 1), (3, 1))  # child 0 matches 3 levels with 3 nodes, child 1 one level with one node

    def cost(n, batch):
        return 1.0 + 0.5 * n

    # (0,): 4 / (0.01 + c(3) = 2.5) = 1.59; (1,): 2 / (0.01 + c(1) = 1.5) = 1.32; (0, 1): 4 / (0.02 + c(4) = 3) = 1.32
    # priced by nodes summed over the 5 records, (0,) looked worse: 4 / (0.01 + c(15)) = 0.47 < 2 / (0.01 + c(5))
    assert gate.next_best(1, cost, 64) == (0,)


class SampledChain(Drafter):
    """A sampled chain of 8 nodes, without scores."""

    name = "sampled"

    def propose(self, seqs):
        probs = torch.full((8, 16), 1 / 16)
        return [DraftTree.chain(list(range(8)), probs, DraftMode.INDEPENDENT) for _ in seqs]


def test_the_gate_prices_a_sampled_childs_tree_at_all_its_nodes(monkeypatch):
    """A sampled tree is cut by its shape only, never by its drawn tokens' scores: the gate counts all 8 nodes, where
    a best-paying prefix by level rates (0.5, 0.25, ...) would keep a few."""
    combined = CombinedDrafter([SampledChain(), Fixed()])
    combined.attach(type("Target", (), {"runner": None, "costs": CostView(tree_cost, lambda b: 0.1)})())
    monkeypatch.setattr(combined.gate, "choose", lambda *a: (True, True))
    combined.propose([SequenceView(0, [1, 2, 3], 3)])
    combined.on_accept(0, [5, 6])
    assert combined.gate.records[0][1][0] == 8
