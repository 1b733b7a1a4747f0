"""The losslessness certificate on a tiny model: passes for exact drafters, every negative
control fails, and too-small sample sizes void it instead of passing it."""
from __future__ import annotations

import pytest
from specdec.eval.certificate import CertificateSizes, run_certificate
from specdec.eval.divergence import diagnose, greedy_identity

from specdec.models.loader import load_model
from specdec.rejection import EXACT
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model

SMALL = CertificateSizes(stat_samples=6000, identity_prompts=3, identity_tokens=24, sample_sequences=800,
                         sample_tokens=2, e2e_tv=0.1)


def _prompts(n):
    return [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7], [9, 4, 9, 4, 9], [3, 3, 3]][:n]


@pytest.mark.parametrize("drafter, options", [
    ("ngram", {}),
    ("draft-model", {"mode": "independent", "widths": [2, 1], "num_draft_tokens": 2}),
])
def test_certificate_passes_and_every_control_is_caught(drafter, options):
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    if drafter == "draft-model":
        options = dict(options, model=build_tiny_model(vocab_size=12, seed=9))
    cert = run_certificate(loaded, drafter, options, SamplingConfig(True, 0.9, 6), SMALL, _prompts)
    failed = [(c.level, c.name, c.control, c.detail) for c in cert.checks if not c.as_expected]
    assert cert.passed and not cert.void, failed
    controls = {c.control for c in cert.checks if c.control}
    assert "always_accept" in controls
    assert all(not c.passed for c in cert.checks if c.control)
    md = cert.to_markdown()
    assert "PASSED" in md and "always_accept" in md
    assert cert.to_json()["passed"] is True


def test_too_few_samples_void_the_certificate():
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    tiny = CertificateSizes(stat_samples=30, identity_prompts=1, identity_tokens=4, sample_sequences=20)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True), tiny, _prompts, levels=("exact", "stats"))
    assert cert.void and not cert.passed
    assert any("power" in w for w in cert.warnings)
    assert "VOID" in cert.to_markdown()


def test_divergence_is_diagnosed_as_real_or_near_tie():
    model = build_tiny_model(vocab_size=12, seed=3)
    loaded = load_model(model)
    from specdec.eval.negative_controls import BROKEN_RULES

    res = greedy_identity(loaded, _prompts(3), "ngram", {}, 24, rule=BROKEN_RULES["always_accept"])
    assert res.divergences and all(d.kind == "real mismatch" and d.gap > 1e-3 for d in res.divergences)
    assert greedy_identity(loaded, _prompts(3), "ngram", {}, 24, rule=EXACT).identical
    # a forced tie: equal top-2 logits are classified as numerical
    import torch

    class Tied(torch.nn.Module):
        device = torch.device("cpu")

        def forward(self, ids):
            logits = torch.zeros(ids.shape[0], ids.shape[1], 12)
            logits[..., 4] = logits[..., 7] = 5.0
            return type("Out", (), {"logits": logits})()

    d = diagnose(Tied(), [1, 2], prompt=0, position=0, plain=4, spec=7)
    assert d.kind == "numerical near-tie" and d.gap == 0.0
