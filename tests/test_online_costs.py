"""The calibrated verify-cost curve corrected by the run's own step times (specdec.online_costs), and the
sizer pricing trees with it."""
from __future__ import annotations

import pytest
import torch

from specdec.cost_model import CostModel
from specdec.online_costs import OnlineCosts
from specdec.tree import DraftTree
from specdec.tree_sizing import SizingConfig, TreeSizer

# calibrated: 2 tokens cost a decode step, 3 tokens 1.2
CALIBRATED = CostModel({}, {1: {1: 0.030, 2: 0.030, 3: 0.036, 65: 1.0}})


def test_observed_step_times_correct_the_calibrated_curve_where_observed():
    online = OnlineCosts(CALIBRATED)
    assert online.relative(2) == pytest.approx(1.0)  # nothing observed: the calibration
    for _ in range(32):
        online.record(0.030, 1, 1)
        online.record(0.045, 2, 1)  # a real 2-token step costs 1.5 decode steps here
    # shrunk toward 1 by the evidence (32 samples against a prior of 8): 1 + 0.8 * 0.5
    assert online.relative(2) == pytest.approx(1.4)
    assert online.relative(3) == pytest.approx(1.2)  # never observed: calibrated
    assert online.relative(2, batch=4) == pytest.approx(1.0)  # another batch bucket: its own evidence (none)


def test_without_one_token_steps_nothing_is_corrected():
    online = OnlineCosts(CALIBRATED)
    for _ in range(32):
        online.record(0.090, 2, 1)  # every step drafted: no baseline to compare with
    assert online.relative(2) == pytest.approx(1.0)


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
