"""generate() and the certificate's generate_with_control run in one call frame: the caller's torch state set aside,
the model's device current, the drafter held for the call, a refused call's streamer ended. The certificate's runs
differ from users' only by the engine they build, so each check here runs on both and compares."""
from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from specdec.eval.negative_controls import generate_with_control

import specdec
from specdec import call_claims
from specdec.errors import InputError
from specdec.testing import RandomTreeDrafter, build_tiny_model

gen = importlib.import_module("specdec.generate")  # the module (specdec.generate is also the function)
ENTRIES = {"generate": specdec.generate, "certificate": generate_with_control}
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class Recorder:
    """A put() / end() streamer (transformers' protocol) that records what it is sent."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", value.tolist()))

    def end(self):
        self.calls.append(("end",))


class FrameProbe(RandomTreeDrafter):
    """At its first proposal, records the frame its call runs in, and what a second call with it gets."""

    def __init__(self, entry, model, devices):
        super().__init__(96, seed=1)
        self.entry, self.model, self.devices, self.seen = entry, model, devices, None

    def propose(self, seqs):
        if self.seen is None:
            nested = Recorder()
            with pytest.raises(InputError, match="drafting for another generate"):
                self.entry(self.model, [PROMPT], drafter=self, max_new_tokens=1, streamer=nested)
            self.seen = {"autocast": torch.is_autocast_enabled("cpu"), "default device": torch.get_default_device(),
                         "device current": list(self.devices), "held": id(self) in call_claims._IN_USE,
                         "calls open": len(call_claims._calls()), "refused nested call's streamer": nested.calls}
        return super().propose(seqs)


def _recording_device(monkeypatch):
    """The devices made current (specdec.generate.on_device) and not yet left."""
    current = []

    @contextlib.contextmanager
    def recording(device):
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(gen, "on_device", recording)
    return current


def test_the_certificates_call_runs_in_the_frame_users_get(monkeypatch):
    """Under a caller's autocast and default device, each call's drafter sees the same frame: autocast off, the CPU
    the default, the model's device current, itself held (a second call with it refused, that call's streamer
    ended), one call open on the thread."""
    model = build_tiny_model()
    devices = _recording_device(monkeypatch)
    seen, outputs, streams = {}, {}, {}
    for name, entry in ENTRIES.items():
        probe, streamer = FrameProbe(entry, model, devices), Recorder()
        torch.set_default_device("meta")
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outputs[name] = entry(model, [PROMPT], drafter=probe, max_new_tokens=6, speculation="always",
                                      streamer=streamer)
        finally:
            torch.set_default_device(None)
        seen[name], streams[name] = probe.seen, streamer.calls
        assert not devices and call_claims.drafters_in_use() == 0  # left as found
    assert seen["certificate"] == seen["generate"] == {
        "autocast": False, "default device": torch.device("cpu"), "device current": [torch.device("cpu")],
        "held": True, "calls open": 1, "refused nested call's streamer": [("end",)]}
    assert outputs["certificate"] == outputs["generate"]
    assert streams["certificate"] == streams["generate"] and streams["generate"][-1] == ("end",)


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("refused", ["arguments", "engine build"])
def test_a_refused_call_ends_its_streamer(entry, refused):
    """A call refused before it streams (its arguments, the engine's build) still ends a put() / end() streamer: a
    thread iterating a TextIteratorStreamer would wait for ever. The certificate's call did not end it."""
    streamer = Recorder()
    if refused == "arguments":
        call = dict(input_ids=[[1, 2], [3, 4]], max_new_tokens=2)  # two sequences for a one-sequence streamer
        match = "one sequence"
    else:
        call = dict(input_ids=[[1, 2, 3]], max_new_tokens=2, drafter="self-draft", drafter_options={"num_layers": 99})
        match = "self-draft: num_layers"
    with pytest.raises(InputError, match=match):
        ENTRIES[entry](build_tiny_model(), streamer=streamer, **call)
    assert streamer.calls == [("end",)]
