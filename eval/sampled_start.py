"""Where the certificate's sampled end-to-end check starts: a greedy-answer prefix whose continuations verify drafts.

    choice = choose_start(loaded, prompts, plain, step_lengths, "ngram", {}, sampling, sizes, seed=0)
    choice.ids, choice.detail

The check compares plain and speculative sampling of a few tokens from one prefix; it tests the accepted-draft path
only as far as drafts are accepted there, and at a fixed point (the middle of the first answer) they mostly are not.
Candidates: per identity prompt, the position in the first half of its greedy answer (a longer prefix makes every
sampled sequence's prefill dearer) whose next ``sample_tokens`` tokens the greedy speculative run took most often
from accepted drafts, the latest of the ties (the middle where none); the ``start_candidates`` best prompts. A pilot
samples ``pilot_sequences`` speculative continuations at every candidate, as the check does, and the check (its
negative control too) runs at the one where the most compared tokens were accepted drafts (ties: the earlier).

Why the check stays exact: the pilot draws from its own seed (:func:`specdec.eval.end_to_end.pilot_seed`), none of
the check's, so the start is a function of the greedy runs and of draws independent of the check's. Given the
start, the plain and the speculative samples are still independent draws of their two laws at that prefix, which
a lossless engine makes equal, so every p-value keeps its level: the choice moves where the check looks (its power
to see the accepted-draft path), not how often a correct engine fails it. Choosing on the check's own samples would
bias it: a start picked for how its compared samples looked is a start where they looked that way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specdec.eval.end_to_end import drafted_share, pilot_seed, sample_in_chunks, sampling_kwargs
from specdec.eval.negative_controls import generate_with_control

from specdec.sampling import SamplingConfig


@dataclass(frozen=True)
class Start:
    prompt: int  # index into the identity prompts
    position: int  # tokens of that prompt's greedy answer before the start
    greedy_drafted: int  # of the sample_tokens tokens after it, how many the greedy speculative run accepted as drafts


@dataclass(frozen=True)
class StartChoice:
    start: Start
    ids: list[int]  # prompt + the first ``position`` tokens of its greedy answer
    pilot: tuple[float, ...]  # per candidate, the pilot's share of compared tokens that were accepted drafts
    candidates: tuple[Start, ...]
    pilot_sequences: int

    @property
    def pilot_drafted(self) -> float:
        return self.pilot[self.candidates.index(self.start)]

    @property
    def detail(self) -> str:
        others = sorted(self.pilot, reverse=True)[1:]
        runner_up = f", next best {others[0]:.0%}" if others else ""
        return (f"start: prompt {self.start.prompt}, answer token {self.start.position}, chosen by a pilot of "
                f"{self.pilot_sequences} sequences at each of {len(self.candidates)} starts (own seed): "
                f"{self.pilot_drafted:.0%} accepted drafts there{runner_up}")


def drafted_flags(step_lengths: tuple[int, ...]) -> list[bool]:
    """Per committed token, whether it was an accepted draft (every token of a step but its last)."""
    return [j < length - 1 for length in step_lengths for j in range(length)]


def candidate_starts(answer_lengths: list[int], step_lengths: list[tuple[int, ...]], k: int, last: int,
                     count: int) -> list[Start]:
    """Per prompt, the position ``p <= last`` (and before the answer's last token) whose ``k`` tokens after it were
    most often accepted drafts in the greedy speculative run, the latest of the ties; the ``count`` best prompts,
    in order (ties: the earlier prompt). ``answer_lengths``: new tokens of each plain greedy answer."""
    best = []
    for prompt, (length, lengths) in enumerate(zip(answer_lengths, step_lengths)):
        flags = drafted_flags(lengths)
        positions = range(min(last, length - 1) + 1)
        if positions:
            best.append(max((Start(prompt, p, sum(flags[p : p + k])) for p in positions),
                            key=lambda s: (s.greedy_drafted, s.position)))
    return sorted(best, key=lambda s: -s.greedy_drafted)[:count]


def pilot_shares(loaded: Any, starts: list[list[int]], drafter: Any, options: dict, sampling: SamplingConfig,
                 sizes: Any, seed: int) -> list[float]:
    """Per start, the share of the compared tokens of ``sizes.pilot_sequences`` speculative continuations (sampled as
    the check samples, with the exact rule) that were accepted drafts; drawn from :func:`pilot_seed` of ``seed``."""
    n, common = sizes.pilot_sequences, sampling_kwargs(sampling, sizes)
    outputs = sample_in_chunks(lambda chunk, chunk_seed: generate_with_control(
        loaded, chunk, seed=chunk_seed, drafter=drafter, drafter_options=options, speculation="always", **common),
        [s for s in starts for _ in range(n)], pilot_seed(seed))
    new = [t for o in outputs for t in o.new_tokens]
    stats = [s for o in outputs for s in o.stats]
    return [drafted_share(new[i * n : (i + 1) * n], stats[i * n : (i + 1) * n], sizes.sample_tokens)
            for i in range(len(starts))]


def choose_start(loaded: Any, prompts: list[list[int]], plain: list[list[int]], step_lengths: list[tuple[int, ...]],
                 drafter: Any, options: dict, sampling: SamplingConfig, sizes: Any, seed: int = 0) -> StartChoice:
    """``plain``: the plain greedy outputs of ``prompts`` (prompt + answer); ``step_lengths``: per prompt, the greedy
    speculative run's (:class:`specdec.eval.divergence.IdentityResult`)."""
    answers = [len(out) - len(p) for p, out in zip(prompts, plain)]
    candidates = candidate_starts(answers, step_lengths, sizes.sample_tokens, sizes.identity_tokens // 2,
                                  sizes.start_candidates)
    ids = [plain[c.prompt][: len(prompts[c.prompt]) + c.position] for c in candidates]
    shares = pilot_shares(loaded, ids, drafter, options, sampling, sizes, seed)
    best = max(range(len(candidates)), key=lambda i: (shares[i], -i))
    return StartChoice(candidates[best], ids[best], tuple(shares), tuple(candidates), sizes.pilot_sequences)
