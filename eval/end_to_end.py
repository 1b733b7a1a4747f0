"""End-to-end sampling check: speculative sampling vs plain sampling on the real model.

    res = sampled_two_sample(loaded, prompt_ids, "ngram", {}, SamplingConfig(True, 0.8), sizes)
    res["chi2_p"], res["ks_p"], res["power"]

Both sides sample ``sizes.sample_sequences`` continuations of ``sizes.sample_tokens + sizes.sample_lookahead``
tokens from the same prompt with different seeds and compare the first ``sizes.sample_tokens`` (a marginal of the
same law, so still exact). The lookahead lets the steps that make the compared tokens verify drafts: with
max_new_tokens = sample_tokens the last compared token's step has no room for a draft (its bonus token would pass
the budget), so the window would test plain vs plain. Two tests: a two-sample chi-square on
the joint law of the compared tokens (rare outcomes pooled), and a two-sample Kolmogorov-Smirnov
test on their log-probability under the target (teacher-forced with the transformers model,
an independent implementation). The certificate decides on them with Holm at ``sizes.alpha``,
so the chi-square alone fails the check at ``sizes.alpha / 2`` (:data:`TESTS`): its power to
detect ``sizes.e2e_tv`` is reported at that level, a lower bound on the pair's. Where the certificate starts it
(a prefix whose continuations verify drafts, chosen by a pilot on seeds of its own): :mod:`specdec.eval.sampled_start`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from scipy import stats
from specdec.eval.negative_controls import generate_with_control
from specdec.eval.token_progress import TokenProgress
from specdec.eval.two_sample import two_sample_chi2

from specdec.generate import generate
from specdec.models.loader import eval_mode
from specdec.rejection import EXACT, AcceptanceRule
from specdec.sampling import SamplingConfig

TESTS = 2  # the chi-square and the KS test, Holm-corrected together by the certificate
# sequences per generate() call: --full's 40,000 at once would need a 412 GiB float32 KV cache for the embedded
# model (its worst case: prompt + tokens + a 64-node tree each); chunk c > 0 is seeded seed + c * CHUNK_SEED_STRIDE
CHUNK = 1000
CHUNK_SEED_STRIDE = 2**32
# the pilot that chooses the check's start (specdec.eval.sampled_start) draws from PILOT_SEED + --seed: for |--seed| <
# 2**60 above every seed of the check (1 + 2 seed, 2 + 2 seed, plus chunk strides) as torch reads them (mod 2**64)
PILOT_SEED = 2**62


def check_seeds(seed: int) -> tuple[int, int]:
    """The plain and the speculative side's seeds of the check for the certificate's ``seed`` (--seed)."""
    return 1 + 2 * seed, 2 + 2 * seed


def pilot_seed(seed: int) -> int:
    """The seed of the pilot run for the certificate's ``seed``: none of the check's (:data:`PILOT_SEED`)."""
    return PILOT_SEED + seed


def sample_in_chunks(run: Callable[[list[list[int]], int], Any], prompts: list[list[int]], seed: int) -> list[Any]:
    """``run(chunk, chunk_seed)`` on CHUNK prompts at a time, chunk c seeded ``seed + c * CHUNK_SEED_STRIDE``."""
    return [run(prompts[start : start + CHUNK], seed + c * CHUNK_SEED_STRIDE)
            for c, start in enumerate(range(0, len(prompts), CHUNK))]


def sampling_kwargs(sampling: SamplingConfig, sizes: Any) -> dict:
    """generate() arguments of one side: ``sample_tokens + sample_lookahead`` sampled tokens."""
    return dict(sampling.generate_kwargs(), max_new_tokens=sizes.sample_tokens + sizes.sample_lookahead,
                do_sample=True, return_dict=True)


def drafted_share(new_tokens: list[list[int]], stats: list[Any], k: int) -> float:
    """Of the first ``k`` new tokens of every sequence (its SequenceStats in ``stats``), the share that were accepted
    drafts."""
    compared = sum(len(t[:k]) for t in new_tokens)
    return sum(drafted_in_window(s.step_lengths, k) for s in stats) / compared if compared else 0.0


def rejected_share(new_tokens: list[list[int]], stats: list[Any], k: int) -> float:
    """Per compared token (the first ``k`` of each sequence), the drafts rejected: steps that tried a child at some
    depth and accepted none there, each then emitting a recovered token. Counted over the whole generation; with a
    lookahead of 1 every such token is a compared one (a step verifies no deeper than the tokens allowed but one)."""
    compared = sum(len(t[:k]) for t in new_tokens)
    rejected = sum(sum(s.depth_tried) - sum(s.depth_accepted) for s in stats)
    return rejected / compared if compared else 0.0


@torch.inference_mode()
def sequence_logprobs(model: Any, prompt: list[int], continuations: list[tuple[int, ...]],
                      chunk: int = 64) -> dict[tuple[int, ...], float]:
    """log p_target(continuation | prompt) for every distinct continuation (temperature 1)."""
    distinct = sorted(set(continuations))
    step_logp: dict[tuple[int, ...], torch.Tensor] = {}  # prefix -> [vocab] log-probs of the next token
    depth = max((len(c) for c in distinct), default=0)
    with eval_mode(model):
        for d in range(depth):
            prefixes = sorted({c[:d] for c in distinct if len(c) > d})
            for i in range(0, len(prefixes), chunk):
                batch = prefixes[i : i + chunk]
                ids = torch.tensor([prompt + list(p) for p in batch], device=model.device)
                logp = model(ids).logits[:, -1].float().log_softmax(-1).cpu()
                step_logp.update(zip(batch, logp, strict=True))
    return {c: float(sum(step_logp[c[:d]][c[d]] for d in range(len(c)))) for c in distinct}


def drafted_in_window(step_lengths: tuple[int, ...], k: int) -> int:
    """How many of a sequence's first ``k`` tokens were accepted drafts: every token of a step but its last (the
    target's own: the bonus or the correction)."""
    drafted = position = 0
    for length in step_lengths:
        drafted += max(min(position + length - 1, k) - position, 0)
        position += length
    return drafted


def sampled_two_sample(loaded: Any, prompt: list[int], drafter: Any, options: dict, sampling: SamplingConfig,
                       sizes: Any, rule: AcceptanceRule = EXACT, seeds: tuple[int, int] = (1, 2),
                       progress: Callable[[str], None] | None = None, what: str = "sampling") -> dict:
    """The check (module doc); ``progress`` (optional) is told, in lines that start with ``what``, when each side
    starts and how far their sampling has come (:class:`~specdec.eval.token_progress.TokenProgress`): about a minute
    on a CPU with the embedded model at default sizes (each side prefills the prompt once, not its ``n`` copies)."""
    n, k = sizes.sample_sequences, sizes.sample_tokens
    # the law of the first k tokens of k + lookahead: a marginal of the law compared, so exactness still requires it
    common = sampling_kwargs(sampling, sizes)
    common["streamer"] = None if progress is None else TokenProgress(progress, what, 2 * n * common["max_new_tokens"])
    # each side starts with one prefill of the prompt, whose K/V its n copies get (Engine.add)
    side = f"{n} sequences of {len(prompt)} + {common['max_new_tokens']} tokens"
    say = progress or (lambda msg: None)
    say(f"{what}: plain sampling, {side}")
    plain = sample_in_chunks(lambda chunk, chunk_seed: generate(loaded, chunk, seed=chunk_seed, **common),
                             [prompt] * n, seeds[0])
    # speculation="always": every proposal verified whole, as under the negative controls' broken rules (seeded
    # sampling would otherwise size the trees, and a guard that stops drafting would make this plain vs plain)
    say(f"{what}: speculative sampling, {side}")
    spec = sample_in_chunks(lambda chunk, chunk_seed: generate_with_control(
        loaded, chunk, rule, seed=chunk_seed, drafter=drafter, drafter_options=options, speculation="always",
        **common), [prompt] * n, seeds[1])
    a = [tuple(t[:k]) for out in plain for t in out.new_tokens]
    b = [tuple(t[:k]) for out in spec for t in out.new_tokens]
    runs = [s for o in spec for s in o.stats]
    steps = sum(s.steps for s in runs)  # tau over every chunk and the whole generation, as GenerateOutput.tau of one
    tau = sum(s.new_tokens for s in runs) / steps if steps else 0.0
    # Holm's first step: alone, the chi-square fails the pair at alpha / TESTS; its power there is what the check has
    fit = two_sample_chi2(a, b, tv=sizes.e2e_tv, alpha=sizes.alpha / TESTS)
    logp = sequence_logprobs(loaded.model, list(prompt), a + b)
    ks_p = float(stats.ks_2samp([logp[x] for x in a], [logp[x] for x in b]).pvalue)
    return {"chi2_p": fit.p_value, "ks_p": ks_p, "power": fit.power, "detects_tv": fit.detects_tv, "tau": tau,
            "drafted": drafted_share(b, runs, k), "rejected": rejected_share(b, runs, k),
            "distinct_outcomes": len(set(a + b))}
