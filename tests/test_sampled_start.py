"""Where the certificate's sampled end-to-end check starts (specdec.eval.sampled_start): a greedy-answer prefix whose
continuations verify drafts, chosen by a pilot whose seeds the check never draws from."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from specdec.eval.certificate import CertificateSizes, end_to_end_checks
from specdec.eval.end_to_end import CHUNK_SEED_STRIDE, check_seeds, pilot_seed
from specdec.eval.sampled_start import (
    Start,
    best_candidate,
    candidate_starts,
    choose_start,
    drafted_flags,
    greedy_token_probs,
)

from specdec.errors import InputError
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model


def test_candidates_are_where_greedy_drafts_had_an_uncertain_acceptance():
    assert drafted_flags((1, 3, 2)) == [False, True, True, False, True, False]
    k, last = 2, 4
    # prompt 0: nothing drafted -> the middle (the old start); prompt 1: drafted tokens 1-2 and 5, the target sure of
    # 1 and 5 (q = 1: always-accept could not fail there), unsure of 2, so positions 1 and 2 tie (the earlier wins);
    # prompt 2: drafted 2-3 (q 0.5, 0.9) and 7-8 (q 0.5, 0.5: the best, but past the first half); prompt 3: a 3-token
    # answer, drafted nothing
    flags = [drafted_flags(lengths) for lengths in [(1,) * 10, (1, 3, 1, 2, 1, 1, 1), (1, 1, 3, 1, 1, 3, 1), (1,) * 3]]
    probs = [[0.5] * 10, [0.9, 1.0, 0.8, 0.5, 0.5, 1.0] + [0.5] * 4, [0.5, 0.5, 0.5, 0.9] + [0.5] * 6, [0.5] * 3]
    got = candidate_starts([10, 10, 10, 3], flags, probs, k, last, count=4)
    assert [(s.prompt, s.position) for s in got] == [(2, 2), (1, 1), (0, 4), (3, 2)]
    assert [s.uncertainty for s in got] == pytest.approx([0.25 + 0.09, 0.16, 0, 0])
    assert candidate_starts([10, 10, 10, 3], flags, probs, k, last, count=2) == got[:2]
    assert candidate_starts([10], flags[2:3], probs[2:3], k, last=8, count=1) == [Start(0, 7, 0.5)]


def test_the_pilot_prefers_drafts_decided_both_ways():
    """Choosing by accepted drafts alone picked, on the embedded model with n-gram, a start where the target was
    near-certain: every compared token an accepted draft, 2 distinct outcomes in 1,200, and the always-accept control
    passed there (p = 1), voiding the certificate. Accepted x rejected per compared token scores such a start 0."""
    assert best_candidate([(1.0, 0.0), (0.3, 0.4), (0.0, 0.9), (0.6, 0.1)]) == 1
    assert best_candidate([(0.0, 0.0), (0.2, 0.0), (0.2, 0.0)]) == 1  # none rejected: the most accepted, the earlier
    assert best_candidate([(0.0, 0.0), (0.0, 0.0)]) == 0


@pytest.mark.parametrize("seed", [0, 1, 7, 12345, 2**40, -1, -(2**40)])
def test_the_pilot_never_draws_from_a_seed_of_the_check(seed):
    """torch reads a seed mod 2**64; the check draws chunk c of each side from its side's seed + c * stride."""
    check = {(s + c * CHUNK_SEED_STRIDE) % 2**64 for s in check_seeds(seed) for c in range(1000)}
    pilot = {(pilot_seed(seed) + c * CHUNK_SEED_STRIDE) % 2**64 for c in range(1000)}
    assert not check & pilot


def _fault_setup():
    """The tiny model of tests/test_eval_certificate.py whose greedy answers soon repeat, so n-gram drafts are
    accepted at some starts more than at others (prompt 0's middle: 10-16% of the compared tokens)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 32, (int(torch.randint(3, 10, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(8)]
    return load_model(build_tiny_model("llama-mha-untied", vocab_size=32, seed=3)), prompts


def test_sampled_check_starts_where_drafts_feed_the_compared_tokens(monkeypatch):
    """The check sampled from one fixed start, the middle of the first prompt's greedy answer, where the embedded
    model's n-gram drafts fed none of the compared tokens: it tested the rejection path alone. It now starts where a
    pilot, on seeds of its own, saw drafts accepted and rejected, and its negative control runs at the same start."""
    import specdec.eval.certificate as certificate
    import specdec.eval.end_to_end as end_to_end
    import specdec.eval.sampled_start as sampled_start

    loaded, prompts = _fault_setup()
    sizes = CertificateSizes(identity_prompts=8, identity_tokens=32, sample_sequences=100, sample_tokens=2)
    sampling = SamplingConfig(True, 0.9, 6)
    seeds, checked = {"pilot": set(), "check": set()}, []

    def spy(module, name, side):
        real = getattr(module, name)

        def call(*args, **kwargs):
            if kwargs.get("do_sample"):
                seeds[side].add(kwargs["seed"])
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, call)

    spy(sampled_start, "generate_with_control", "pilot")
    spy(end_to_end, "generate_with_control", "check")
    spy(end_to_end, "generate", "check")
    real_check = end_to_end.sampled_two_sample

    def recording(loaded, start, *args, **kwargs):
        res = real_check(loaded, start, *args, **kwargs)
        checked.append((list(start), res))
        return res
    monkeypatch.setattr(end_to_end, "sampled_two_sample", recording)
    # not this test's subject, and it calibrates the verify costs (seconds)
    monkeypatch.setattr(certificate, "default_policy_identity", lambda *a: certificate.Check("", "end-to-end", True))
    checks, _ = end_to_end_checks(loaded, "ngram", {}, sampling, sizes, lambda n: prompts[:n], seed=3)

    (start, exact), (control_start, _) = checked
    assert control_start == start  # always_accept at the same start
    rows = [c for c in checks if c.name.startswith("sampled")]
    assert len(rows) == 2 and "start: prompt" in rows[0].detail and rows[0].passed and not rows[1].passed
    assert seeds["pilot"] and seeds["check"] and not seeds["pilot"] & seeds["check"]
    monkeypatch.undo()
    old = end_to_end.sampled_two_sample(loaded, _old_start(loaded, prompts, sizes), "ngram", {}, sampling, sizes,
                                        seeds=check_seeds(3))
    # more accepted drafts, and as many decided both ways (accepted x rejected per compared token)
    assert exact["drafted"] > old["drafted"] + 0.1, (exact, old)
    assert exact["drafted"] * exact["rejected"] > old["drafted"] * old["rejected"], (exact, old)


def test_starts_leave_room_for_the_sampled_tokens_in_the_context():
    """A start in the first half of a greedy answer that fits the context could leave no room for the tokens the
    check samples after it: the pilot ended the certificate in generate()'s refusal. Starts now stop where those
    tokens fit, and identity prompts that leave no room at all are refused in one line naming the context."""
    from specdec.generate import generate

    loaded = load_model(build_tiny_model(vocab_size=32, max_position_embeddings=24))
    prompts = [list(range(1, 11))]
    sizes = CertificateSizes(identity_prompts=1, identity_tokens=12, sample_sequences=4, start_candidates=1,
                             pilot_sequences=2)
    plain = generate(loaded, prompts, max_new_tokens=12)  # 22 tokens; 9 sampled after the answer's middle: 25
    choice = choose_start(loaded, prompts, plain, [(1,) * 12], "ngram", {}, SamplingConfig(True), sizes)
    assert choice.start.position == 24 - 10 - 9 and len(choice.ids) + 9 == 24
    with pytest.raises(InputError, match=r"^the end-to-end sampled check \(level e2e\) samples 9 tokens after an "
                                         r"identity prompt: the shortest \(16 tokens\) leaves no room for them in "
                                         r"the model's context of 24 tokens$"):
        choose_start(loaded, [list(range(1, 17))], [list(range(1, 19))], [(1, 1)], "ngram", {}, SamplingConfig(True),
                     sizes)


def _old_start(loaded, prompts, sizes):
    """The start before the pilot: prompt 0 + the first half of its greedy answer."""
    from specdec.generate import generate

    plain = generate(loaded, prompts[:1], max_new_tokens=sizes.identity_tokens)
    return plain[0][: len(prompts[0]) + sizes.identity_tokens // 2]


class _RepeatsItsInput(torch.nn.Module):
    """A 3-token model whose logits at each position are log(3) at that position's own token, 0 elsewhere: the next
    token repeats the current one with probability 3 / 5, each other token 1 / 5."""

    device = torch.device("cpu")

    def forward(self, ids):
        return SimpleNamespace(logits=torch.nn.functional.one_hot(ids, 3).float() * math.log(3))


def test_greedy_token_probs_score_each_answer_token_by_the_logits_before_it():
    # prompt [0], answer [0, 1]: token 0 follows 0 (3 / 5), token 1 follows 0 (1 / 5); the window of 5 is cut to 2
    got = greedy_token_probs(_RepeatsItsInput(), [[0]], [[0, 0, 1]], SamplingConfig(True), tokens=5)
    assert got == [pytest.approx([0.6, 0.2])]
