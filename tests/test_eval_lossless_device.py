"""`specdec eval lossless --device`: the model runs where asked (cpu here; cuda without a GPU is one line, exit 2,
before the model loads), float32 by default on every device, and the certificate says where it ran."""
from __future__ import annotations

from contextlib import contextmanager


def test_negative_controls_run_on_the_model_device(monkeypatch):
    """generate_with_control (every speculative run of the certificate) makes the model's GPU the current one, as
    generate() does: without it a model on cuda:1 would get its Triton kernels and graphs on cuda:0."""
    import specdec.eval.negative_controls as negative_controls

    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    entered = []

    @contextmanager
    def recording(device):
        entered.append(device)
        yield

    monkeypatch.setattr(negative_controls, "on_device", recording, raising=False)
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    negative_controls.generate_with_control(loaded, [[1, 2, 3]], max_new_tokens=2, drafter="ngram")
    assert entered == [loaded.runner.device]
