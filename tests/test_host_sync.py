"""On a GPU, an engine step synchronises the host with the device once: when it reads the target's choices.
Every per-step input built on the host goes through ``specdec.host_copy.to_device`` (pinned, asynchronous)."""
from __future__ import annotations

import warnings

import pytest
import torch

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts CUDA synchronisations")
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_step_synchronises_once(drafter, monkeypatch):
    syncs: list[int] = []
    step = Engine.step

    def counted(self, *args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                return step(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchronizing" in str(w.message) for w in caught))

    model = build_tiny_model().cuda()
    prompts = ragged_prompts(3, seed=1)[1:]
    generate(model, prompts, max_new_tokens=24, drafter=drafter, speculation="always")  # compiles, captures
    monkeypatch.setattr(Engine, "step", counted)
    generate(model, prompts, max_new_tokens=24, drafter=drafter, speculation="always")
    assert syncs and max(syncs[1:]) <= 1, syncs
