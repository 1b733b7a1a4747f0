"""generate() from several threads on one loaded model: calls with drafter objects of their own give the outputs
sequential calls give; a drafter object serves one call at a time, and a second call with it while the first runs
(another thread's, or a streamer's) is refused in one line."""
from __future__ import annotations

import threading

import pytest
from specdec.drafters.combined import CombinedDrafter
from specdec.drafters.draft_model import DraftModelDrafter

import specdec
from specdec.call_claims import drafters_in_use
from specdec.errors import InputError
from specdec.models.loader import load_model
from specdec.testing import build_tiny_model, ragged_prompts

BUSY = r"^this DraftModelDrafter object is drafting for another generate\(\) call that is still running"


@pytest.fixture(scope="module")
def parts():
    return load_model(build_tiny_model(num_hidden_layers=4)), build_tiny_model(seed=7)


def _draft_model(draft):
    return DraftModelDrafter(draft, num_draft_tokens=3)


def test_threads_with_their_own_drafters_get_the_sequential_outputs(parts):
    loaded, draft = parts
    prompts = ragged_prompts(8, seed=4)
    jobs = [([p], dict(max_new_tokens=6 + i % 5, speculation="always")) for i, p in enumerate(prompts)]
    jobs += [([p], dict(max_new_tokens=6, do_sample=True, sampler="coupled", seed=i)) for i, p in enumerate(prompts)]
    expected = [specdec.generate(loaded, p, drafter=_draft_model(draft), **kw) for p, kw in jobs]
    got, failed, start = {}, [], threading.Barrier(2)

    def worker(t):
        drafter = _draft_model(draft) if t else "ngram"  # an object of its own, or a name (a new one per call)
        start.wait()
        for i in range(t, len(jobs), 2):
            try:
                got[i] = specdec.generate(loaded, jobs[i][0], drafter=drafter, **jobs[i][1])
            except Exception as err:  # noqa: BLE001 - reported below
                failed.append(repr(err))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not failed and [got.get(i) for i in range(len(jobs))] == expected
    assert drafters_in_use() == 0


def test_a_drafter_object_drafts_for_one_call_at_a_time(parts):
    """A draft-model drafter shared by two threads died on a bare KeyError / IndexError from its KV cache (the
    second call's attach replaced the first one's state); the second call is now refused in one line, the first
    one's output is untouched, and the object serves again once the first call ended."""
    loaded, draft = parts
    drafter = _draft_model(draft)
    first, second = [[1, 2, 3, 4, 1, 2, 3]], [[5, 6, 7]]
    expected = specdec.generate(loaded, first, drafter=_draft_model(draft), max_new_tokens=12, speculation="always")
    running, tried, refused, out = threading.Event(), threading.Event(), [], []

    def streamer(seq, tokens):  # holds the first call mid-generation until the other thread has tried
        running.set()
        tried.wait(timeout=60)

    def first_call():
        out.append(specdec.generate(loaded, first, drafter=drafter, max_new_tokens=12, speculation="always",
                                    streamer=streamer))

    thread = threading.Thread(target=first_call)
    thread.start()
    assert running.wait(timeout=60)
    try:
        with pytest.raises(InputError, match=BUSY):
            specdec.generate(loaded, second, drafter=drafter, max_new_tokens=12, speculation="always")
    finally:
        tried.set()
        thread.join(timeout=60)
    assert out == [expected] and drafters_in_use() == 0

    def reentrant(seq, tokens):  # a streamer calling generate() with the drafter of the call it streams
        if not refused:
            with pytest.raises(InputError, match=BUSY):
                specdec.generate(loaded, second, drafter=drafter, max_new_tokens=4)
            refused.append(True)

    assert specdec.generate(loaded, first, drafter=drafter, max_new_tokens=12, speculation="always",
                            streamer=reentrant) == expected
    assert refused and drafters_in_use() == 0
    # a combined drafter holds its children: one of them cannot draft for another call meanwhile
    inner = []

    def via_child(seq, tokens):
        if not inner:
            with pytest.raises(InputError, match=BUSY):
                specdec.generate(loaded, second, drafter=drafter, max_new_tokens=4)
            inner.append(True)

    assert specdec.generate(loaded, first, drafter=CombinedDrafter(["ngram", drafter]), max_new_tokens=12,
                            speculation="always", streamer=via_child) == expected
    assert inner and drafters_in_use() == 0
