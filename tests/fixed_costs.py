"""speculation="auto" on fixed costs, for tests whose assertions must not hang on this machine's timings.

The tree sizer and the guard read wall time in four places: the calibrated verify-cost curve, the run's verify
times that correct it, each propose call's time (the draft's cost), and a catch-up call's time, charged in full to the
guard's probe budget. A loaded CI worker moves each of them (a steep calibration verified nothing; a slow catch-up
left a remembered guard without probe budget), so a test that asserts what the policy verified fixes all four.
"""
from __future__ import annotations

from specdec import engine_setup
from specdec.cost_model import CostModel
from specdec.online_costs import OnlineCosts
from specdec.tree_sizing import TreeSizer


def fix_costs(monkeypatch, curve: dict[int, float]) -> CostModel:
    """Sizing on ``curve`` (c(n): seconds of a verify step with n query tokens, linear between the points given; the
    same at every batch size), never corrected by a verify's wall time; every propose call took no time, so drafting
    is free and a probe's price and a catch-up's charge are nothing. Returns the cost model."""
    costs = CostModel({}, {1: curve})
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda runner, config=None, **kw: costs)
    monkeypatch.setattr(OnlineCosts, "record", lambda self, *args: None)
    size_call = TreeSizer.size_call
    monkeypatch.setattr(TreeSizer, "size_call", lambda self, ids, trees, batch, draft_seconds, *args, **kw:
                        size_call(self, ids, trees, batch, 0.0, *args, **kw))
    return costs
