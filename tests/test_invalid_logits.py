"""NaN, infinite or fully masked target logits stop generation with an error naming the step and the sequence,
never a token id outside the vocabulary (sampling, greedy, coupled, with and without a drafter)."""
from __future__ import annotations

import pytest
import torch

import specdec
from specdec.sampling import InvalidLogitsError, SamplingConfig, choose_max, sample, sampling_logits
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
    with pytest.raises(InvalidLogitsError, match=r"sequence 1, step \d, new token 3: the target's logits leave no"
                       r".* outside the vocabulary\. The \d+ tokens generated so far are in this error's "
                       r"new_tokens\.$") as err:
        specdec.generate(model, prompts, max_new_tokens=6, logits_processor=[SpoilRow(value)],
                         logits_processor_prefix_only=True, **MODES[mode])
    # the work done is kept, as a CacheFullError keeps it: both rows' tokens committed before the failing step
    # (a drafted step that failed at new token 3 commits none of its tokens)
    first, second = err.value.new_tokens
    assert 1 <= len(second) <= 2 and 1 <= len(first) <= 6
    if "greedy" in mode:
        assert first == specdec.generate(model, [[1, 2, 3]], max_new_tokens=6)[0][3:][:len(first)]


@pytest.mark.parametrize("mode", ["sampling", "coupled", "ngram-coupled"])
def test_a_plus_inf_logit_leaves_a_sampled_row_without_a_law(device, mode):
    """Coupled sampling emitted the first +inf id, whatever the seed, where standard sampling (and transformers)
    stop: the noise added to +inf leaves +inf. Greedy takes it as the argmax."""
    model = build_tiny_model().to(device)
    modes = {**MODES, "ngram-coupled": dict(MODES["coupled"], drafter="ngram", speculation="always")}
    with pytest.raises(InvalidLogitsError, match=r"sequence 1, step \d, new token 3: the target's logits leave no"):
        specdec.generate(model, [[1, 2, 3], [7, 8, 9]], max_new_tokens=6, logits_processor=[SpoilRow(float("inf"))],
                         logits_processor_prefix_only=True, **modes[mode])


@pytest.mark.parametrize("mode", ["sampling", "greedy"])
def test_a_model_that_computes_nan_is_an_error(device, mode):
    """A damaged checkpoint: one NaN weight in the last layer turns every logit into NaN."""
    model = build_tiny_model().to(device)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(InvalidLogitsError, match="sequence 0, step 1, new token 1:") as err:
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=1, **MODES[mode])
    assert err.value.new_tokens == [[]]  # the first step's: nothing was generated


def test_sample_and_choose_max_mark_rows_without_a_law(device):
    probs = torch.tensor([[0.0, 0.0, 0.0], [0.2, float("nan"), 0.8], [0.0, 1.0, 0.0],
                          [float("inf"), 0.0, 1.0]], device=device)
    assert sample(probs).tolist() == [3, 3, 1, 3]
    logits = torch.tensor([[0.0, float("nan"), 1.0], [float("-inf")] * 3, [0.0, 2.0, float("-inf")]], device=device)
    assert choose_max(logits).tolist() == [3, 3, 1]


@pytest.mark.parametrize("kw", [dict(top_k=3), dict(top_p=0.5), dict(top_p=0.0), dict(min_p=0.3), dict(typical_p=0.4),
                                dict(epsilon_cutoff=0.05), dict(eta_cutoff=0.05), dict(top_h=0.5),
                                dict(top_k=5, top_p=0.3, min_p=0.5, typical_p=0.5, epsilon_cutoff=0.1, eta_cutoff=0.1,
                                     top_h=0.3)], ids=str)
def test_no_warper_setting_removes_a_nan_score(kw):
    """A row with a NaN logit must keep it through the sampling warpers, so the sampler finds no law there and
    reports it: had a warper set only the NaN to -inf, the row would be sampled from what was left. top-h can drop
    a NaN (sampling_logits puts it back); the others never do, which a new transformers could change."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 4
    nan_at = torch.rand(64, 50, generator=gen) < 0.2
    logits[nan_at] = float("nan")
    for dtype in (torch.float32, torch.float64):
        warped = sampling_logits(logits.to(dtype), SamplingConfig(True, 0.9, **kw))
        assert torch.equal(warped.isnan(), nan_at)


def test_a_drafted_eos_before_a_row_without_a_law_ends_the_sequence_as_plain_decoding_does():
    """After an accepted EOS plain decoding never asks for another token; a prefix-only processor that leaves no
    token after EOS gives the row behind a drafted EOS no law. That row must not be an error (commit drops its
    token): checking it raised InvalidLogitsError where plain decoding finished."""
    from specdec.tree import DraftTree

    model = build_tiny_model()
    prompt = [3, 1, 4, 1, 5]
    plain = specdec.generate(model, [prompt], max_new_tokens=6)[0][len(prompt):]
    eos = plain[0]

    class NothingAfterEos:
        def __call__(self, input_ids, scores):
            return scores.masked_fill(input_ids[:, -1:] == eos, float("-inf"))

    class Oracle:  # plain greedy's next three tokens: the first is the EOS
        def propose(self, seqs):
            return [DraftTree.chain(plain[len(s.token_ids) - len(prompt):][:3]) for s in seqs]

    kw = dict(max_new_tokens=6, eos_token_id=eos, logits_processor=[NothingAfterEos()],
              logits_processor_prefix_only=True, return_dict=True)
    drafted = specdec.generate(model, [prompt], drafter=Oracle(), speculation="always", **kw)
    assert drafted.sequences == specdec.generate(model, [prompt], **kw).sequences
    assert drafted.new_tokens == [[eos]] and drafted.stats[0].finish_reason == "eos"
