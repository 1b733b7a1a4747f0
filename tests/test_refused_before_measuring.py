"""A drafter whose checkpoint was made for another model is refused before the engine measures anything for the
call: the row policy and the verify-cost calibration take minutes on a big model on a CPU, and the refusal came
only after them (build_engine measured, then the policy attached the drafter, which loaded its checkpoint)."""
from __future__ import annotations

import pytest
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, save_eagle
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.medusa_heads import MedusaCheckpointError, MedusaConfig, MedusaHeads, save_medusa

from specdec import cost_model, verify_cost
from specdec.generate import generate
from specdec.models import row_policy
from specdec.models.loader import load_model
from specdec.testing import build_tiny_model


@pytest.fixture
def unmeasured(monkeypatch, tmp_path):
    """An empty cost cache and no in-process memo (a first run on this machine), with every measurement refused:
    the count of those asked for, and the error raised if one runs."""
    monkeypatch.setenv("SPECDEC_COST_DIR", str(tmp_path / "costs"))
    for memo in ("_MEMO", "_ROWS_DONE", "_PACKING"):
        monkeypatch.setattr(cost_model, memo, {})
    saved = dict(row_policy._ACTIVE)

    def measured(*args, **kwargs):
        raise AssertionError("a measurement ran before the checkpoint was refused")

    monkeypatch.setattr(row_policy, "measure_row_policy", measured)
    monkeypatch.setattr(verify_cost, "measure_verify_costs", measured)
    before = dict(cost_model.CALIBRATIONS)
    yield tmp_path
    assert cost_model.CALIBRATIONS == before, "the row policy or the verify costs were measured before the refusal"
    row_policy._ACTIVE.clear()
    row_policy._ACTIVE.update(saved)


def _medusa(tmp_path):  # heads 32 wide, a target 64 wide
    heads = save_medusa(MedusaHeads(MedusaConfig(2, 1, hidden_size=32, vocab_size=96)), tmp_path / "medusa")
    return build_tiny_model(), dict(drafter="medusa", drafter_options={"path": str(heads)})


def _eagle(tmp_path):  # a layer made for a target 64 wide, a target 32 wide
    save_eagle(EagleModel(EagleConfig.for_target(build_tiny_model().config)), tmp_path / "eagle")
    target = build_tiny_model(hidden_size=32, intermediate_size=64)
    return target, dict(drafter="eagle", drafter_options={"path": str(tmp_path / "eagle")})


def _mtp(tmp_path):  # the MTP layer of a checkpoint of another vocabulary
    build_tiny_model(vocab_size=80).save_pretrained(tmp_path / "other")
    return build_tiny_model(), dict(drafter="mtp", drafter_options={"path": str(tmp_path / "other")})


def _draft_model(tmp_path):  # a draft model of another vocabulary
    draft = build_tiny_model(vocab_size=80, num_hidden_layers=1)
    return build_tiny_model(), dict(drafter="draft-model", drafter_options={"model": draft})


@pytest.mark.parametrize("case, refusal, match", [
    (_medusa, MedusaCheckpointError, "heads have hidden_size=32 but the target model has 64"),
    (_eagle, EagleCheckpointError, "hidden_size=64 but the target model has hidden_size=32"),
    (_mtp, EagleCheckpointError, "vocab_size=80 but the target model has vocab_size=96"),
    (_draft_model, ValueError, "vocabulary has 80 ids, the target's 96"),
])
def test_a_checkpoint_for_another_model_is_refused_before_any_measurement(unmeasured, case, refusal, match):
    target, drafter = case(unmeasured)
    target.save_pretrained(unmeasured / "target")  # loaded from a directory, as the command line loads it
    with pytest.raises(refusal, match=match):
        generate(load_model(str(unmeasured / "target")), [[1, 2, 3]], max_new_tokens=2, **drafter)


def test_the_draft_model_build_engine_loaded_is_the_one_attach_uses(monkeypatch):
    """Loaded once per call: build_engine's load() makes the draft runner and attach() takes it (not a second)."""
    from specdec.drafters.draft_model import DraftModelDrafter

    made = []
    real = DraftModelDrafter.make_runner
    monkeypatch.setattr(DraftModelDrafter, "make_runner", lambda self, *a: made.append(1) or real(self, *a))
    drafter = DraftModelDrafter(build_tiny_model(num_hidden_layers=1, seed=1))
    for calls in (1, 2):  # a reused drafter makes its runner anew per call, as before
        generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=2, drafter=drafter)
        assert len(made) == calls
