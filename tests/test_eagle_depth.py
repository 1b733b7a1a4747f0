"""EAGLE's depth per call (drafters/eagle_depth.py): levels that do not pay are not drafted and are probed within
budget, levels that pay are kept, a deeper tree that starts to pay is back within a few calls, the chooser is off
without the engine's decode time or cost curve, and in the engine the output stays the target's."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from specdec.drafters.base import CostView
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_depth import DepthChooser, DepthConfig
from specdec.drafters.eagle_model import EagleConfig, EagleModel

from specdec.errors import InputError
from specdec.generate import generate
from specdec.testing import build_tiny_model


def chain_cost(n: int, batch: int) -> float:  # a CPU-like verify curve: 2 rows cost one decode step, then +0.3
    return 1.0 + 0.3 * max(0, n - 2)


def started(max_depth: int = 4, decode: float = 0.05) -> DepthChooser:
    chooser = DepthChooser(max_depth, DepthConfig())
    chooser.start(CostView(chain_cost, lambda batch: decode))
    return chooser


def drive(chooser: DepthChooser, calls: int, matched, level_seconds: list[float]) -> list[int]:
    """``calls`` decisions; a call drafting d levels takes ``level_seconds[:d]`` and its step matches
    ``matched(call)`` levels (at most d)."""
    depths = []
    for call in range(calls):
        depth = chooser.choose(1)
        depths.append(depth)
        chooser.record_seconds(level_seconds[:depth], catch_up=False)
        successes = min(matched(call), depth)
        chooser.observe(successes + (successes < depth), successes)
    return depths


def test_levels_that_do_not_pay_are_not_drafted_and_are_probed_within_budget():
    # level 1 cheap, deeper levels 0.1 decode steps each; level 1 matches 2 steps in 3, level 2 never
    depths = drive(started(), 400, lambda call: 1 if call % 3 else 0, [0.002, 0.005, 0.005, 0.005])
    assert depths[0] == 1  # the first call drafts one level: nothing is timed yet
    assert depths.count(1) > 0.9 * 400
    probes = depths.count(2)
    assert 0 < probes <= 400 * 0.02 / (0.1 + 0.3) + 2  # one level deeper, within the probe budget
    assert max(depths) == 2


def test_cheap_levels_that_match_reach_the_full_depth_within_a_few_calls():
    depths = drive(started(), 100, lambda call: 4, [0.001, 0.001, 0.001, 0.001])
    assert depths[0] == 1 and depths[10:] == [4] * 90


def test_a_deeper_tree_that_starts_to_pay_is_back_within_a_few_calls():
    chooser = started()
    depths = drive(chooser, 300, lambda call: 1 if call < 200 else 4, [0.001, 0.002, 0.002, 0.002])
    assert depths[150:200].count(1) > 40
    first = next(i for i in range(200, 300) if depths[i] > 1)  # the first probe after the text changed
    assert depths[first + 10: first + 20] == [4] * 10


def test_the_chooser_is_off_without_the_policys_costs():
    chooser = DepthChooser(4)
    chooser.start(None)
    assert not chooser.active
    assert drive(chooser, 20, lambda call: 0, [1.0, 1.0, 1.0, 1.0]) == [4] * 20


def test_a_catch_up_call_does_not_move_level_one_for_good():
    chooser = DepthChooser(2)
    chooser.start(CostView(chain_cost, lambda batch: 0.05))
    chooser.record_seconds([2.0, 0.001], catch_up=True)  # the whole prompt through the layer
    assert chooser.times[0].seconds == 2.0 and chooser.times[1].seconds == 0.001
    chooser.record_seconds([0.001, 0.001], catch_up=False)
    assert chooser.times[0].seconds == 0.001


def test_a_fresh_chooser_rates_every_level_at_the_prior_of_one_half():
    # no steps: r_1 = (0 + 2 * 0.5) / (0 + 2) = 0.5, and each deeper level takes the level above's
    assert started().rates() == [0.5] * 4


def test_steps_that_leave_the_window_leave_its_counts():
    chooser = DepthChooser(4, DepthConfig(window=4))
    chooser.start(CostView(chain_cost, lambda batch: 0.05))
    for _ in range(20):
        chooser.observe(4, 4)
    for _ in range(4):
        chooser.observe(4, 0)  # the window now holds only these
    assert chooser.tried == [4] * 4 and chooser.matched == [0] * 4
    # r_1 = (0 + 2 * 0.5) / (4 + 2)
    assert chooser.rates()[0] == pytest.approx(1 / 6)


def test_a_level_never_timed_is_priced_as_the_deepest_timed_one():
    chooser = started(decode=0.01)
    chooser.record_seconds([0.005], catch_up=False)  # level 1 only: 0.005 s / 0.01 s = 0.5 decode steps
    # levels 2-4 cost level 1's 0.5 each: 0.5, 1.0, 1.5, 2.0
    assert [chooser.draft_cost(d, 1) for d in range(1, 5)] == pytest.approx([0.5, 1.0, 1.5, 2.0])


def fixed_machine(drafter: EagleDrafter, monkeypatch, decode_seconds: float, verify_cost,
                  extra_level_seconds: float) -> None:
    """The engine's decode time and cost curve fixed, and each level timed 1 ms (past the first: plus
    ``extra_level_seconds``) whatever it took: the choice does not depend on the machine's load (a load spike once
    timed a real level deep enough to keep the flat machine shallow).
    speculation="always" makes the engine ask EAGLE at every step."""
    attach = drafter.attach
    monkeypatch.setattr(drafter, "attach", lambda target: attach(dataclasses.replace(
        target, costs=CostView(verify_cost, lambda batch: decode_seconds))))
    original = DepthChooser.record_seconds
    monkeypatch.setattr(DepthChooser, "record_seconds", lambda self, seconds, catch_up: original(
        self, [0.001 + extra_level_seconds * (j > 0) for j in range(len(seconds))], catch_up))


@pytest.mark.parametrize("machine", ["flat verify, cheap levels", "steep verify, dear levels"])
def test_in_the_engine_the_depth_follows_the_costs_and_the_output_is_the_targets(machine, monkeypatch):
    model = build_tiny_model()
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, depth=4, top_k=2, max_nodes=8))
    eagle.init_from_target(model)  # right ~90% of the time on this model
    prompts = [[5, 9, 11, 2, 5, 9, 11], [7, 3]]
    plain = generate(model, prompts, max_new_tokens=40)
    drafter = EagleDrafter(model=eagle)
    if machine.startswith("flat"):  # a GPU's shape: 5 rows cost a decode step, a level ~1/300 of one
        fixed_machine(drafter, monkeypatch, 1.0, lambda n, batch: 1.0, 0.0)
    else:  # a level past the first costs 5 decode steps more than it took
        fixed_machine(drafter, monkeypatch, 0.01, chain_cost, 0.05)
    assert generate(model, prompts, drafter=drafter, max_new_tokens=40, speculation="always") == plain
    used = drafter.chooser.used
    assert used[1] >= 1  # the first call: one level
    assert (used[4] if machine.startswith("flat") else used[1]) > 0.8 * sum(used), used


def test_adapt_depth_option_must_be_a_bool():
    with pytest.raises(InputError, match="adapt_depth must be True or False"):
        EagleDrafter(model=None, path="x", adapt_depth="yes")


@pytest.mark.parametrize("graphs", [False, True])
def test_each_call_times_every_level_it_drafted_within_its_own_wall_time(graphs, monkeypatch):
    """The levels' seconds (drafters/level_clock.py; level 1 with the catch-up) cover the depth drafted and never add
    up to more than the call took, eagerly and through the (uncaptured) graph buckets."""
    model = build_tiny_model()
    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(model.config, depth=3, top_k=2, max_nodes=6))
    eagle.init_from_target(model)
    drafter = EagleDrafter(model=eagle, adapt_depth=False, cuda_graphs=graphs)
    calls = []
    propose, record = EagleDrafter.propose, DepthChooser.record_seconds

    def timed(self, seqs):
        t0 = time.perf_counter()
        trees = propose(self, seqs)
        calls[-1].append(time.perf_counter() - t0)
        return trees

    monkeypatch.setattr(EagleDrafter, "propose", timed)
    def recorded(self, seconds, catch_up):
        calls.append([list(seconds)])
        record(self, seconds, catch_up)

    monkeypatch.setattr(DepthChooser, "record_seconds", recorded)
    generate(model, [[5, 9, 11, 2, 5, 9, 11], [7, 3, 4]], drafter=drafter, max_new_tokens=12, speculation="always")
    assert len(calls) > 3 and (drafter.graphs is not None) == graphs
    for seconds, wall in calls:
        assert len(seconds) == 3 and min(seconds) > 0 and sum(seconds) <= wall, (seconds, wall)


def test_the_chain_the_chooser_learns_from_is_each_levels_best_child():
    """The most probable chain of a proposal (the child of the highest score at each level, the first on ties),
    taken in one pass over the tree, against a walk that looks for each level's children anew; and the trees EAGLE
    builds without the construction checks are the checked constructor's."""
    import random

    from specdec.drafters.eagle import _top_chain

    from specdec.tree import DraftTree

    def walk(tree):
        tokens, parents, scores = tree.tokens.tolist(), tree.parents.tolist(), tree.scores.tolist()
        chain, node = [], -1
        while kids := [i for i, p in enumerate(parents) if p == node]:
            node = max(kids, key=lambda i: (scores[i], -i))
            chain.append(tokens[node])
        return chain, list(range(-1, len(chain) - 1))

    rng = random.Random(0)
    for n in (0, 1, 5, 24, 64):
        parents = [rng.randrange(-1, i) for i in range(n)]
        scores = torch.tensor([rng.choice((0.25, 0.5, 0.75)) for _ in range(n)])  # ties on purpose
        tokens = torch.tensor([rng.randrange(100) for _ in range(n)], dtype=torch.long)
        checked = DraftTree(tokens, parents, scores=scores)
        unchecked = DraftTree.unchecked(tokens, torch.tensor(parents, dtype=torch.long), scores=scores)
        assert _top_chain(unchecked) == walk(checked)
        assert all(torch.equal(getattr(checked, f), getattr(unchecked, f)) for f in ("tokens", "parents", "scores"))
        assert unchecked.mode is checked.mode and unchecked.draft_probs is None


def test_levels_of_equal_value_choose_the_shallower_depth():
    # rates 0.5 (no steps): tokens 1.5, 1.75, 1.875, 1.9375 at depths 1-4; levels cost nothing and the verify of
    # 1 + d rows costs exactly those tokens, so every depth is worth 1.0 token per step: the shallowest wins
    tokens = {2: 1.5, 3: 1.75, 4: 1.875, 5: 1.9375}
    chooser = DepthChooser(4, DepthConfig())
    chooser.start(CostView(lambda n, batch: tokens[n], lambda batch: 0.05))
    chooser.record_seconds([0.0] * 4, catch_up=False)
    assert chooser.values(1) == [1.0] * 4
    assert chooser.choose(1) == 1


def test_probes_come_every_interval_th_call():
    # rates 0.5; depth 1 is best (1.5 / (0.04 + 1.0) against 1.75 / (0.14 + 1.3) ...); probing depth 2 costs
    # 0.1 decode steps of drafting + 0.3 of verify = 0.4, so with probe_budget 0.15 the interval is ceil(2.67) = 3:
    # calls 3 and 6 probe
    chooser = DepthChooser(4, DepthConfig(probe_budget=0.15))
    chooser.start(CostView(chain_cost, lambda batch: 0.05))
    chooser.record_seconds([0.002, 0.005, 0.005, 0.005], catch_up=False)
    assert [chooser.choose(1) for _ in range(6)] == [1, 1, 2, 1, 1, 2]


def test_a_step_matched_deeper_than_chosen_probes_one_level_deeper_than_it_matched():
    chooser = started()
    chooser.record_seconds([0.002, 0.005, 0.005, 0.005], catch_up=False)
    assert chooser.choose(1) == 1  # level 1 cheap, deeper ones dear (as above); the first probe is 20 calls away
    chooser.observe(3, 2)  # two levels matched: one deeper than that is 3
    # r = 2/3, 7/9, 14/27, 14/27: depth 1 still best (1.67 / 1.04 against 2.19 / 1.44 and 2.46 / 1.84)
    assert chooser.choose(1) == 3


def test_a_catch_up_call_times_its_deeper_levels_as_any_step():
    # only level 1 of a catch-up call runs over the prompt: level 2's 0.004 s is a step's time, averaged with the
    # next call's 0.002 s at ema 0.2: 0.004 + 0.2 * (0.002 - 0.004) = 0.0036
    chooser = DepthChooser(2)
    chooser.start(CostView(chain_cost, lambda batch: 0.05))
    chooser.record_seconds([2.0, 0.004], catch_up=True)
    chooser.record_seconds([0.001, 0.002], catch_up=False)
    assert chooser.times[1].seconds == pytest.approx(0.0036)


def test_a_probe_asked_for_by_a_deep_match_is_dropped_once_the_full_depth_is_chosen():
    # decode 0.5 s: levels cost 0.004, then +0.01 decode steps each. A steep verify (+1 a row past 2) keeps depth 1;
    # a step matching 2 levels asks for a probe at 3; then a flat verify (1.0) makes the full depth 4 the best
    # (2.59 / 1.03 against 2.45 / 1.02 at 3), which spends that probe: back on the steep verify, depth 1, no probe
    flat = [False]
    chooser = DepthChooser(4, DepthConfig())
    chooser.start(CostView(lambda n, batch: 1.0 if flat[0] else 1.0 + max(0, n - 2), lambda batch: 0.5))
    chooser.record_seconds([0.002, 0.005, 0.005, 0.005], catch_up=False)
    assert chooser.choose(1) == 1
    chooser.observe(3, 2)
    flat[0] = True
    assert chooser.choose(1) == 4
    flat[0] = False
    assert chooser.choose(1) == 1
