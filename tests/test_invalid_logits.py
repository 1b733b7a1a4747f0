"""NaN, infinite or fully masked target logits stop generation with an error naming the step and the sequence,
never a token id outside the vocabulary (sampling, greedy, coupled, with and without a drafter)."""
from __future__ import annotations

import pytest
import torch

import specdec
from specdec.sampling import InvalidLogitsError, choose_max, sample
from specdec.testing import build_tiny_model


class SpoilRow:
    """Replaces the logits of the rows whose prompt starts with 7, once they hold `length` tokens, by `value`."""

    def __init__(self, value: float, length: int = 5) -> None:
        self.value, self.length = value, length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        spoil = (input_ids[:, 0] == 7) & (input_ids.shape[1] >= self.length)
        return torch.where(spoil[:, None], torch.full_like(scores, self.value), scores)


MODES = {
    "sampling": dict(do_sample=True, seed=1),
    "greedy": dict(do_sample=False),
    "coupled": dict(do_sample=True, seed=1, sampler="coupled"),
    "ngram-sampling": dict(do_sample=True, seed=1, drafter="ngram", speculation="always"),
    "ngram-greedy": dict(do_sample=False, drafter="ngram", speculation="always"),
}


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "all-neg-inf"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_spoiled_logits_name_step_and_sequence(device, mode, value):
    model = build_tiny_model().to(device)
    prompts = [[1, 2, 3], [7, 8, 9]]  # sequence 1 goes bad at its third new token (5 tokens = 3 prompt + 2 new)
    with pytest.raises(InvalidLogitsError, match=r"sequence 1, step \d, new token 3: the target's logits leave no"):
        specdec.generate(model, prompts, max_new_tokens=6, logits_processor=[SpoilRow(value)],
                         logits_processor_prefix_only=True, **MODES[mode])


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_a_model_that_computes_nan_is_an_error(device, mode):
    """A damaged checkpoint: one NaN weight in the last layer turns every logit into NaN."""
    model = build_tiny_model().to(device)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(InvalidLogitsError, match="sequence 0, step 1, new token 1:"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=1, **MODES[mode])


def test_sample_and_choose_max_mark_rows_without_a_law(device):
    probs = torch.tensor([[0.0, 0.0, 0.0], [0.2, float("nan"), 0.8], [0.0, 1.0, 0.0],
                          [float("inf"), 0.0, 1.0]], device=device)
    assert sample(probs).tolist() == [3, 3, 1, 3]
    logits = torch.tensor([[0.0, float("nan"), 1.0], [float("-inf")] * 3, [0.0, 2.0, float("-inf")]], device=device)
    assert choose_max(logits).tolist() == [3, 3, 1]
