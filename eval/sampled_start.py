"""Where the certificate's sampled end-to-end check starts: a greedy-answer prefix where drafts are tried and decided.

    choice = choose_start(loaded, prompts, plain, step_lengths, "ngram", {}, sampling, sizes, seed=0)
    choice.ids, choice.detail

The check compares plain and speculative sampling of a few tokens from one prefix (its window:
:func:`specdec.eval.end_to_end.window`). It tests acceptance only where drafts are both accepted (the accepted-draft
path) and rejected (else a rule that accepts every draft is right): at the middle of the first answer the n-gram
drafter's were almost never accepted, and where a greedy answer repeats itself they are always accepted (a
near-certain target, which always-accept cannot fail). Candidates: per identity prompt, the position in the first
half of its greedy answer (a longer prefix makes the sampling dearer: its prefill and every step's attention) whose
next window of tokens, where the greedy speculative run accepted them as drafts, have the most uncertain acceptance,
``q (1 - q)`` with ``q`` the sampling law's probability of the greedy token (teacher forced); the earliest of ties,
the middle where none was drafted; the ``start_candidates`` best prompts. A pilot samples ``pilot_sequences``
speculative continuations at each, as the check does (and says how far it has come as the check does), and the
check and its negative control run at the one with the most of both per window token: accepted share x rejected
share.

Why the check stays exact: the pilot draws from its own seed (:func:`specdec.eval.end_to_end.pilot_seed`), none of
the check's, so the start is a function of the greedy runs and of draws independent of the check's. Given the
start, the plain and the speculative samples are still independent draws of their two laws at that prefix, which
a lossless engine makes equal, so every p-value keeps its level: the choice moves where the check looks (its power),
not how often a correct engine fails it. Choosing on the check's own samples would bias it: a start picked for how
its compared samples looked is a start where they looked that way.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from specdec.eval.end_to_end import (
    drafted_share,
    pilot_seed,
    rejected_share,
    sample_in_chunks,
    sampled_tokens,
    sampling_kwargs,
    window,
)
from specdec.eval.negative_controls import generate_with_control
from specdec.eval.token_progress import TokenProgress

from specdec.errors import InputError
from specdec.models.loader import eval_mode
from specdec.sampling import SamplingConfig, logits_to_probs

PILOT = "end to end: the start's pilot"  # what its progress lines start with


@dataclass(frozen=True)
class Start:
    prompt: int  # index into the identity prompts
    position: int  # tokens of that prompt's greedy answer before the start
    uncertainty: float  # sum of q (1 - q) over the window's greedily drafted tokens (the pre-screen's score)


@dataclass(frozen=True)
class StartChoice:
    start: Start
    ids: list[int]  # prompt + the first ``position`` tokens of its greedy answer
    candidates: tuple[Start, ...]
    pilot: tuple[tuple[float, float], ...]  # per candidate: (accepted, rejected) drafts per window token
    pilot_sequences: int

    @property
    def detail(self) -> str:
        accepted, rejected = self.pilot[self.candidates.index(self.start)]
        return (f"start: prompt {self.start.prompt}, answer token {self.start.position}, chosen by a pilot of "
                f"{self.pilot_sequences} sequences at each of {len(self.candidates)} starts (own seed): "
                f"{accepted:.0%} accepted, {rejected:.0%} rejected drafts per window token there")


def drafted_flags(step_lengths: tuple[int, ...]) -> list[bool]:
    """Per committed token, whether it was an accepted draft (every token of a step but its last)."""
    return [j < length - 1 for length in step_lengths for j in range(length)]


@torch.inference_mode()
def greedy_token_probs(model: Any, prompts: list[list[int]], plain: list[list[int]], sampling: SamplingConfig,
                       tokens: int) -> list[list[float]]:
    """Per prompt, the sampling law's probability of each of the first ``tokens`` tokens of its greedy answer
    given the ones before (teacher forced with the transformers model, as the check's log-probabilities are)."""
    probs = []
    with eval_mode(model):
        for prompt, out in zip(prompts, plain, strict=True):
            end = min(len(out), len(prompt) + tokens)
            ids = torch.tensor([out[:end]], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : end - 1].float()
            law = logits_to_probs(logits, sampling)
            probs.append(law.gather(-1, ids[0, len(prompt) : end, None]).squeeze(-1).tolist())
    return probs


def candidate_starts(answer_lengths: list[int], flags: list[list[bool]], probs: list[list[float]], k: int, last: int,
                     count: int) -> list[Start]:
    """Per prompt, the position ``p <= last`` (and before its answer's last token) with the largest sum of
    ``q (1 - q)`` over the greedily drafted tokens among the ``k`` after it (``flags``, ``probs``: per answer token),
    the earliest of ties; the answer's middle (``last``) where that sum is 0 everywhere. The ``count`` best prompts,
    in order (ties: the earlier prompt)."""
    best = []
    for prompt, (length, drafted, q) in enumerate(zip(answer_lengths, flags, probs, strict=True)):
        positions = range(min(last, length - 1) + 1)
        if not positions:
            continue
        score = [sum(q[j] * (1 - q[j]) for j in range(p, min(p + k, len(q), len(drafted))) if drafted[j])
                 for p in positions]
        top = max(score)
        position = score.index(top) if top > 0 else positions[-1]
        best.append(Start(prompt, position, top))
    return sorted(best, key=lambda s: -s.uncertainty)[:count]


def pilot_shares(loaded: Any, starts: list[list[int]], drafter: Any, options: dict, sampling: SamplingConfig,
                 sizes: Any, seed: int, progress: Callable[[str], None] | None = None) -> list[tuple[float, float]]:
    """Per start, (accepted, rejected) drafts per window token over ``sizes.pilot_sequences`` speculative
    continuations sampled as the check samples them (exact rule), drawn from :func:`pilot_seed` of ``seed``.
    ``progress`` (optional) is told how far their sampling has come, as the check's (:class:`TokenProgress`)."""
    n, k, common = sizes.pilot_sequences, window(sizes), sampling_kwargs(sampling, sizes)
    if progress is not None:  # a while on a CPU with the embedded model (each start is prefilled once: Engine.add)
        common["streamer"] = TokenProgress(progress, PILOT, len(starts) * n * common["max_new_tokens"])
    outputs = sample_in_chunks(lambda chunk, chunk_seed: generate_with_control(
        loaded, chunk, seed=chunk_seed, drafter=drafter, drafter_options=options, speculation="always", **common),
        [s for s in starts for _ in range(n)], pilot_seed(seed))
    new = [t for o in outputs for t in o.new_tokens]
    stats = [s for o in outputs for s in o.stats]
    rows = [(new[i * n : (i + 1) * n], stats[i * n : (i + 1) * n]) for i in range(len(starts))]
    return [(drafted_share(t, s, k), rejected_share(t, s, k)) for t, s in rows]


def check_room(shape, prompts: list[list[int]], new: int) -> None:
    """An InputError unless an identity prompt leaves room for the ``new`` tokens the check samples after a start
    (``shape``: the runner's; its ``max_positions``, the context or the sliding window + 1)."""
    shortest = min(len(p) for p in prompts)
    if shortest + new > shape.max_positions:
        raise InputError(f"the end-to-end sampled check (level e2e) samples {new} tokens after an identity prompt: "
                         f"the shortest ({shortest} tokens) leaves no room for them in the model's "
                         f"{shape.limit_words}")


def choose_start(loaded: Any, prompts: list[list[int]], plain: list[list[int]], step_lengths: list[tuple[int, ...]],
                 drafter: Any, options: dict, sampling: SamplingConfig, sizes: Any, seed: int = 0,
                 progress: Callable[[str], None] | None = None) -> StartChoice:
    """``plain``: the plain greedy outputs of ``prompts`` (prompt + answer); ``step_lengths``: per prompt, the greedy
    speculative run's (:class:`specdec.eval.divergence.IdentityResult`); ``progress``: see :func:`pilot_shares`."""
    k, last = window(sizes), sizes.identity_tokens // 2
    probs = greedy_token_probs(loaded.model, prompts, plain, sampling, last + k)
    # a start is followed by the sampled tokens, all within the model's context (or sliding window + 1): a start at
    # position p of an answer to a prompt of n tokens needs n + p + new <= limit (answers cut to the starts that fit)
    new, shape = sampled_tokens(sizes), loaded.runner.shape
    room = [shape.max_positions - len(p) - new + 1 for p in prompts]
    fit = [min(len(out) - len(p), r) for p, out, r in zip(prompts, plain, room, strict=True)]
    check_room(shape, prompts, new)  # a prompt with room: one candidate at least
    candidates = candidate_starts(fit, [drafted_flags(lengths) for lengths in step_lengths], probs, k, last,
                                  sizes.start_candidates)
    ids = [plain[c.prompt][: len(prompts[c.prompt]) + c.position] for c in candidates]
    if progress is not None:  # the starts found, which may be fewer than asked for (one per prompt at most)
        progress(f"end to end: choosing where sampling starts (a pilot of {sizes.pilot_sequences} sequences at "
                 f"{len(candidates)} start{'s' * (len(candidates) != 1)})")
    shares = pilot_shares(loaded, ids, drafter, options, sampling, sizes, seed, progress)
    best = best_candidate(shares)
    return StartChoice(candidates[best], ids[best], tuple(candidates), tuple(shares), sizes.pilot_sequences)


def best_candidate(shares: list[tuple[float, float]]) -> int:
    """The index of the (accepted, rejected) pilot shares with the largest product: drafts decided both ways. A start
    whose drafts are all accepted (a near-certain target) scores 0, as one whose drafts are all rejected. Where
    every product is 0, the most accepted; ties: the earlier."""
    return max(range(len(shares)), key=lambda i: (shares[i][0] * shares[i][1], shares[i][0], -i))
