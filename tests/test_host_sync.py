"""On a GPU, an engine step synchronises the host with the device once: when it reads the target's choices, or under
sampling the rejection walk's result (an EAGLE step twice when its trees are sized before the verify: it also reads
its candidate pool; verified whole, its trees, as a draft model's static trees, are read once the verify is launched,
specdec/pending_trees.py; a draft model's sampled step once more: its draft_probs are checked in one read). Every
per-step input built on the host goes through ``specdec.host_copy.to_device`` (pinned, asynchronous); drafting
times its levels with events (``specdec.drafters.level_clock``), not by waiting for the device."""
from __future__ import annotations

import time
import warnings

import pytest
import torch
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.level_clock import LevelClock

from specdec.engine import Engine
from specdec.generate import generate
from specdec.host_copy import to_device
from specdec.testing import build_tiny_model, ragged_prompts


def test_to_device_gives_the_values_on_the_device_in_the_dtype():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = to_device([[1, 2], [3, 4]], torch.int32, device)
    assert out.device.type == device and out.dtype == torch.int32 and out.tolist() == [[1, 2], [3, 4]]
    host = torch.tensor([True, False])
    assert to_device(host, torch.long, device).tolist() == [1, 0]


def test_reading_a_host_tensor_is_no_launch():
    """In inference mode (as the engine runs) ``.numpy()`` and ``.tolist()`` dispatch the conjugate / negative-bit
    checks, which return the tensor itself: counted as launches they overstated a draft-model step's by about 15."""
    from specdec.launches import Launches

    with torch.inference_mode():
        x = torch.arange(4)
    with torch.inference_mode(), Launches() as counter:
        x.numpy()
        x.tolist()
        x + 1
    assert dict(counter.ops) == {"add": 1}


def test_views_and_no_op_conversions_are_no_launch_but_writes_are():
    """An op that returns its input's memory and writes nothing (flatten, unflatten, to its own dtype) launches
    nothing on a GPU; one that writes into its input's memory through out= does, and so does any op on meta tensors
    (whose storage addresses are all 0)."""
    from specdec.launches import Launches

    x = torch.arange(6.0)
    with torch.inference_mode(), Launches() as counter:
        x.flatten()
        x.view(2, 3).unflatten(0, (1, 2))
        x.to(torch.float32)
        torch.add(x, 1, out=x)
        torch.empty(3, device="meta") + 1
    assert dict(counter.ops) == {"add": 2}


def test_the_level_clock_gives_each_part_its_time_and_the_call_its_total():
    clock = LevelClock(torch.device("cpu"))
    time.sleep(0.02)
    clock.mark()
    clock.mark()
    time.sleep(0.01)  # after the last mark: the last part's
    parts = clock.split()
    total = time.perf_counter() - clock.start
    assert len(parts) == 2 and parts[0] >= 0.02 and parts[1] >= 0.01 and sum(parts) <= total

    class Event:  # CUDA events as the device stamped them, in milliseconds
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

    clock.cuda, clock.marks = True, [Event(0.0), Event(3.0), Event(4.0)]
    clock.start = time.perf_counter() - 0.5  # the call's wall time, launches and the final read included
    catch_up, growth = clock.split()
    # at most the wall time since the start (a fixed 0.6 s bound failed when a loaded worker was preempted here)
    assert catch_up == pytest.approx(3 * growth) and 0.5 <= catch_up + growth <= time.perf_counter() - clock.start


class StampedEvent:
    """A CUDA event as the device stamped it, ``ms`` milliseconds after some origin."""

    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, other):
        return other.ms - self.ms


def test_a_stopped_clock_gives_each_part_its_own_time_not_the_wall_time_after_the_stop():
    clock = LevelClock(torch.device("cpu"))
    start = time.perf_counter() - 10.0  # the call began 10 s ago; its parts ended at +0.1 and +0.3 s, stopped at +0.4
    clock.start, clock.marks, clock.stopped = start, [start, start + 0.1, start + 0.3], start + 0.4
    assert clock.split() == pytest.approx([0.1, 0.3])  # the time from the last mark to the stop is the last part's
    # on CUDA a stopped call's parts are the device's milliseconds between the marks, in seconds
    clock.cuda, clock.marks = True, [StampedEvent(0.0), StampedEvent(3.0), StampedEvent(4.0)]
    assert clock.split() == pytest.approx([0.003, 0.001])
    clock.marks = [StampedEvent(0.0), StampedEvent(3.0), StampedEvent(2.0)]  # a part stamped before its start
    assert clock.split() == pytest.approx([0.003, 0.0])  # counts no negative time


def test_a_clock_whose_parts_took_no_device_time_shares_the_wall_time_equally():
    clock = LevelClock(torch.device("cpu"))
    assert clock.split() == []  # no part marked
    clock.cuda, clock.marks = True, [StampedEvent(1.0)] * 3
    clock.start = time.perf_counter() - 0.5
    first, second = clock.split()
    assert first == second and 0.5 <= first + second <= time.perf_counter() - clock.start


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations")
@pytest.mark.parametrize("drafter,sampled", [(None, ""), ("ngram", ""), ("eagle", ""), (None, "rejection"),
                                             ("ngram", "rejection"), ("eagle", "rejection"), ("ngram", "coupled"),
                                             ("eagle", "coupled"), ("ngram", "penalty"), ("draft-model", ""),
                                             ("draft-model", "rejection"), ("eagle-whole", ""),
                                             ("eagle-whole", "rejection")])
def test_a_step_synchronises_once(drafter, sampled, monkeypatch):
    """Sampled steps too: the rejection walk masks ended rows instead of reading which rows still walk, and the
    coupled walk's and the logits processors' row indices reach the device without a blocking copy."""
    from specdec.cost_model import CALIBRATIONS
    from specdec.cuda_graphs import captures

    syncs: list[int] = []
    step, nested = Engine.step, [0]

    def counted(self, *args, **kwargs):
        if nested[0]:  # a step inside a step (the cost model calibrating a batch size): the outer one's
            return step(self, *args, **kwargs)
        nested[0] += 1
        one_offs = (captures(), CALIBRATIONS["verify"])
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return step(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            nested[0] -= 1
            # a step that captured a graph (the default policy meets tree sizes the warm-up call did not) or
            # calibrated a batch size paid a one-off, with its own synchronisations: not a step's count
            if (captures(), CALIBRATIONS["verify"]) == one_offs:
                syncs.append(sum("synchronizing" in str(w.message) for w in caught))

    model = build_tiny_model().cuda()
    whole = drafter == "eagle-whole"  # speculation="always": its pending trees are read after the verify's launch
    if drafter in ("eagle", "eagle-whole"):  # its candidate pool is read once per step, to rerank
        torch.manual_seed(0)
        eagle = EagleModel(EagleConfig.for_target(model.config, draft_vocab=tuple(range(0, 96, 2))))
        eagle.init_from_target(model)
        drafter = EagleDrafter(model=eagle.cuda())
    if drafter == "draft-model":  # its static tree stays pending (every tree verified whole); sampled, its
        drafter = DraftModelDrafter(model=build_tiny_model(seed=7).cuda())  # draft_probs are checked in one read
    reads = 1  # the target's choices, or the walk's result
    if isinstance(drafter, EagleDrafter) and not whole:
        reads += 1  # the drafter's candidates, read before the verify to size its trees
    if isinstance(drafter, DraftModelDrafter) and sampled == "rejection":
        reads += 1  # the checks of its trees' draft_probs (once the verify is launched)
    prompts = ragged_prompts(3, seed=1)[1:]
    kw = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=2, sampler="coupled" if sampled == "coupled" else
              "standard") if sampled in ("rejection", "coupled") else {}
    if sampled == "penalty":  # logits processors: every verify row with its own prefix
        kw = dict(repetition_penalty=1.2)
    generate(model, prompts, max_new_tokens=24, drafter=drafter, speculation="always", **kw)  # compiles, captures
    monkeypatch.setattr(Engine, "step", counted)
    # the default policy (EAGLE chooses its depth); a draft model as costly as the target would never be asked
    policy = dict(speculation="always") if isinstance(drafter, DraftModelDrafter) or whole else {}
    generate(model, prompts, max_new_tokens=24, drafter=drafter, **kw, **policy)
    assert syncs and max(syncs[1:]) <= reads, syncs
