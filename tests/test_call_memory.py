"""What a drafter-side decision keeps across generate() calls (drafters/call_memory.py): the records and part times
of the last finished call under its key, nothing from another key, and part costs priced at the call's batch."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from specdec.drafters.base import CostView
from specdec.drafters.call_memory import memory_key
from specdec.drafters.eagle_depth import DepthChooser, DepthConfig

# c(n) = 1 decode step for any n; a decode step of b sequences takes 0.01 * b seconds
COSTS = CostView(lambda n, batch: 1.0, lambda batch: 0.01 * batch)


def test_a_decider_started_again_under_its_key_resumes_from_the_records_it_finished_with():
    """The same chooser object reused for the next call (one drafter object per server worker)."""
    chooser = DepthChooser(4)
    chooser.start(COSTS, ("same",))
    for _ in range(10):
        chooser.observe(3, 2)
    chooser.finish()
    chooser.end_call()
    chooser.start(COSTS, ("same",))
    assert len(chooser.records) == 10
    # 10 steps that tried 3 levels and matched 2, rebuilt into the window's counts
    assert chooser.tried == [10, 10, 10, 0] and chooser.matched == [10, 10, 0, 0]


def test_a_decider_started_under_another_key_has_no_records():
    chooser = DepthChooser(4)
    chooser.start(COSTS, ("first",))
    for _ in range(10):
        chooser.observe(3, 2)
    chooser.start(COSTS, ("other",))  # nothing kept under this key
    assert len(chooser.records) == 0 and chooser.tried == [0] * 4


@pytest.mark.parametrize("field, other", [("dtype", torch.bfloat16), ("shape", "T"), ("device", "cuda:0")])
def test_targets_differing_in_dtype_shape_or_device_keep_separate_memories(field, other):
    drafter = SimpleNamespace(cost_key=lambda: "eagle-x")
    runner = SimpleNamespace(shape="S", dtype=torch.float32, device="cpu")
    changed = SimpleNamespace(**(vars(runner) | {field: other}))
    assert memory_key(drafter, runner) != memory_key(drafter, changed)
    assert memory_key(drafter, runner) == memory_key(drafter, SimpleNamespace(**vars(runner)))


def test_a_parts_cost_is_its_time_over_a_decode_step_at_the_calls_batch():
    chooser = DepthChooser(4)
    chooser.start(COSTS, ("batch",))
    chooser.record_seconds([0.04], catch_up=False)
    # 0.04 s over a decode step of 8 sequences (0.08 s) = 0.5; at 1 sequence (0.01 s) = 4
    assert chooser.part_cost(0, 8) == pytest.approx(0.5)
    assert chooser.part_cost(0, 1) == pytest.approx(4.0)


def test_a_call_that_never_finishes_leaves_the_remembered_times_as_they_were():
    chooser = DepthChooser(4)
    chooser.start(COSTS, ("times",))
    chooser.record_seconds([0.04], catch_up=False)
    chooser.finish()  # remembered: 0.04 s for part 0
    chooser.start(COSTS, ("times",))
    chooser.record_seconds([1.0], catch_up=False)  # this call records, and no sequence of it finishes
    chooser.start(COSTS, ("times",))
    # 0.04 s over a decode step of 1 sequence (0.01 s) = 4, as the finished call left it
    assert chooser.part_cost(0, 1) == pytest.approx(4.0)


def test_a_decider_weighs_the_newest_time_alone_at_ema_1_and_refuses_weights_outside_0_to_1():
    assert DepthConfig(ema=1.0).ema == 1.0
    for ema in (0.0, 1.5):
        with pytest.raises(ValueError, match="invalid DepthConfig"):
            DepthConfig(ema=ema)
