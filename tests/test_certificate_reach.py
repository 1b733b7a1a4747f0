"""The certificate's reach over a sequence: a drafter that lies only after the first tokens fails the sampled
end-to-end check, and a drafter convicted by a DraftError fails the certificate instead of ending its run."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from specdec.drafters.base import Drafter
from specdec.drafters.ngram import NGramDrafter
from specdec.eval import end_to_end
from specdec.eval.certificate import Certificate, CertificateSizes, Check, drafter_stopped, run_certificate
from specdec.eval.end_to_end import sequence_logprobs

import specdec.engine_setup as engine_setup
from specdec.errors import first_line
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.testing import build_tiny_model
from specdec.tree import DraftError, DraftMode, DraftTree

SAMPLING = SamplingConfig(True, 0.9, 6)
SIZES = CertificateSizes(identity_prompts=3, identity_tokens=16, sample_sequences=200, start_candidates=2,
                         pilot_sequences=8)


def _prompts(n):
    return [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 7, 5, 6, 7], [9, 4, 9, 4, 9]][:n]


class LateLiar(Drafter):
    """A chain of 2 sampled drafts from the target's law flattened (logits halved, its transformers model), reported
    as draft_probs; once ``lie_after`` tokens of the sequence were generated (``None``: never), drawn from a sharper
    law than the one reported."""

    name = "late-liar"
    catches_up = False

    def __init__(self, model, lie_after: int | None = 2) -> None:
        self.model, self.lie_after = model, lie_after

    def attach(self, target) -> None:
        self.target = target
        self.gen = torch.Generator().manual_seed((target.seed or 0) % 2**63)

    @torch.inference_mode()
    def propose(self, views):
        trees = [None] * len(views)
        by_length = {}
        for i, view in enumerate(views):
            by_length.setdefault((len(view.token_ids), view.num_prompt_tokens), []).append(i)
        for (length, prompt), rows in by_length.items():  # one forward per depth for views of one length
            ids = torch.tensor([list(views[i].token_ids) for i in rows])
            lies = self.lie_after is not None and length - prompt >= self.lie_after
            reported = []
            for _ in range(2):
                logits = self.model(ids).logits[:, -1].double() * 0.5
                reported.append(logits_to_probs(logits, self.target.sampling))
                law = logits_to_probs(logits * 3, self.target.sampling) if lies else reported[-1]
                ids = torch.cat([ids, torch.multinomial(law, 1, generator=self.gen)], 1)
            for j, i in enumerate(rows):
                trees[i] = DraftTree(ids[j, length:], [-1, 0], torch.stack([q[j] for q in reported]).float(),
                                     DraftMode.INDEPENDENT)
        return trees


def _sampled_rows(cert):
    return {c.control: c for c in cert.checks if c.name.startswith("sampled")}


def test_a_drafter_that_lies_after_two_tokens_fails_the_sampled_check(monkeypatch):
    """The sampled check compared the first 2 of 3 tokens: a drafter drawing from another law than its draft_probs
    once 2 tokens were generated was never verified there, and its certificate passed (the tokens after moved by TV
    0.09). The log-probability of the 8 tokens' window sees it; the draft audit is off here, so that the check
    alone must catch it, and the same drafter telling the truth passes."""
    monkeypatch.setattr(engine_setup, "call_audit", lambda *args, **kwargs: None)
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    liar = _sampled_rows(run_certificate(loaded, LateLiar(loaded.model), {}, SAMPLING, SIZES, _prompts,
                                         levels=("e2e",)))
    exact = liar[None]
    assert not exact.passed and exact.p_value < SIZES.alpha / 2, exact.detail
    assert "log-prob KS p=" in exact.detail and exact.name.startswith("sampled 8 tokens (of 9)"), exact
    honest = run_certificate(loaded, LateLiar(loaded.model, lie_after=None), {}, SAMPLING, SIZES, _prompts,
                             levels=("e2e",))
    rows = _sampled_rows(honest)
    assert rows[None].passed and not rows["always_accept"].passed, rows
    assert not any("stopped" in c.detail for c in honest.checks)


def test_window_log_probabilities_are_the_targets_teacher_forced_ones():
    """One forward per chunk from the prompt's cache gives what a forward over prompt + continuation gives, for
    continuations of every length (an EOS-ended one is shorter) and the empty one."""
    model = build_tiny_model(vocab_size=12, seed=3)
    prompt = [1, 2, 3, 1, 2]
    gen = torch.Generator().manual_seed(0)
    continuations = [(), (3,), (3, 4)] + [tuple(torch.randint(0, 12, (int(n),), generator=gen).tolist())
                                        for n in torch.randint(1, 9, (40,), generator=gen)]
    got = sequence_logprobs(model, prompt, continuations, chunk=16)
    assert set(got) == set(continuations)
    with torch.no_grad():
        for c in continuations:
            logp = model(torch.tensor([prompt + list(c)])).logits[0].float().log_softmax(-1)
            want = sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(c))
            assert abs(got[c] - want) < 1e-4, (c, got[c], want)


class Convicted(NGramDrafter):
    """n-gram drafts when greedy; when sampling, the DraftError the draft audit raises on a drafter it convicts."""

    name = "convicted"

    def propose(self, seqs):
        if self.target.sampling.do_sample:
            raise DraftError("convicted: its draft tokens were not drawn from the draft_probs it reported\nmore")
        return super().propose(seqs)


def test_a_draft_error_fails_its_check_and_the_certificate_goes_on():
    """A DraftError (the draft audit convicting the drafter) raised out of run_certificate, with --levels coupled
    or end to end: the run was lost. It is now a failed row with the error's first line, and every other check
    still runs."""
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    # 300 sequences: enough that the engine-law row's draw_reused control is caught (20 left it passing: VOID)
    sizes = CertificateSizes(identity_prompts=7, identity_tokens=24, sample_sequences=300, stat_samples=2000,
                             start_candidates=1, pilot_sequences=4)
    prompts = lambda n: [*_prompts(3), [3, 3, 3], [8, 2, 8, 2, 10, 11, 8, 2], [4, 11, 0, 4, 11],  # noqa: E731
                         [7, 3, 10, 6, 7, 3]][:n]
    cert = run_certificate(loaded, Convicted(), {}, SAMPLING, sizes, prompts, levels=("e2e", "coupled"))
    said = "convicted: its draft tokens were not drawn from the draft_probs it reported"
    stopped = [c for c in cert.checks if said in c.detail]
    assert {c.level for c in stopped} == {"end-to-end", "coupled"}, [(c.level, c.name, c.detail) for c in cert.checks]
    assert all(not c.passed and c.control is None for c in stopped)
    coupled, = (c for c in stopped if c.level == "coupled")
    assert coupled.detail == said
    sampled, = (c for c in stopped if c.name.startswith("sampled"))
    assert sampled.detail == f"in the pilot choosing its start: {said}"
    assert not cert.passed and not cert.void and cert.verdict == "FAILED"
    greedy = [c for c in cert.checks if c.name.startswith("greedy identity")]
    assert len(greedy) == 5 and all(c.as_expected for c in greedy), [(c.name, c.control, c.detail) for c in greedy]


def test_a_draft_error_under_a_negative_control_fails_the_certificate():
    """Under a control the drafter is at fault, not the broken rule: the row fails the certificate (a row of the
    configuration) instead of counting as a control caught, which would pass a convicted drafter whose exact run
    happened to go through."""
    err = DraftError("convicted: not drawn from its draft_probs\nsecond line")
    row = drafter_stopped("sampled", "end-to-end", "always_accept", err)
    assert row.control is None and not row.passed
    assert row.detail == f"under the always_accept control: {first_line(err)}"
    assert Certificate({}, [Check("sampled", "end-to-end", True), row]).verdict == "FAILED"


def test_drafted_in_window_counts_the_accepted_drafts_among_the_first_k_tokens():
    # steps of 3, 1, 2 tokens make tokens 0-5: 0, 1 accepted drafts (2 is the first step's own), 3 the second step's
    # own, 4 a draft, 5 the third step's own
    assert [end_to_end.drafted_in_window((3, 1, 2), k) for k in range(8)] == [0, 1, 2, 2, 2, 3, 3, 3]
    assert end_to_end.drafted_in_window((), 4) == 0 and end_to_end.drafted_in_window((1, 1, 1), 3) == 0


def test_drafted_and_rejected_shares_are_per_token_of_the_window():
    first = SimpleNamespace(step_lengths=(3, 1, 2), depth_tried=(2, 1), depth_accepted=(2, 0))
    second = SimpleNamespace(step_lengths=(1, 1), depth_tried=(1,), depth_accepted=(0,))
    tokens = [[5] * 6, [5] * 2]
    # a window of 4: 4 + 2 = 6 tokens, of which 2 drafts (the first sequence's tokens 0 and 1)
    assert end_to_end.drafted_share(tokens, [first, second], 4) == pytest.approx(2 / 6)
    # rejected over the whole generation: (2 + 1 - 2) + (1 - 0) = 2, per 6 window tokens
    assert end_to_end.rejected_share(tokens, [first, second], 4) == pytest.approx(2 / 6)
    assert end_to_end.drafted_share([], [], 4) == end_to_end.rejected_share([], [], 4) == 0.0


def test_sampling_goes_in_chunks_each_seeded_a_stride_apart():
    calls = []

    def run(chunk, seed):
        calls.append((len(chunk), seed))
        return len(chunk)

    out = end_to_end.sample_in_chunks(run, [[1]] * 2500, 5)
    # 2,500 prompts: chunks of 1,000, 1,000 and 500, seeded 5, 5 + 2**32, 5 + 2 * 2**32
    assert calls == [(1000, 5), (1000, 5 + 2**32), (500, 5 + 2**33)] and out == [1000, 1000, 500]


def test_each_side_samples_the_window_and_the_lookahead():
    sizes = CertificateSizes(sample_tokens=2, sample_later=3, sample_lookahead=1)
    assert end_to_end.window(sizes) == 2 + 3
    kwargs = end_to_end.sampling_kwargs(SamplingConfig(True, 0.8), sizes)
    assert kwargs["max_new_tokens"] == 2 + 3 + 1 and kwargs["do_sample"] is True and kwargs["temperature"] == 0.8


def test_the_checks_seeds_differ_between_certificate_seeds():
    # plain side 1 + 2 seed, speculative side 2 + 2 seed: seed 0 -> (1, 2), seed 3 -> (7, 8); none shared
    assert end_to_end.check_seeds(0) == (1, 2) and end_to_end.check_seeds(3) == (7, 8)
    seeds = [s for seed in range(50) for s in end_to_end.check_seeds(seed)]
    assert len(set(seeds)) == len(seeds)
    assert end_to_end.pilot_seed(0) != end_to_end.pilot_seed(1)
