"""End-to-end sampling check: speculative sampling vs plain sampling on the real model.

    res = sampled_two_sample(loaded, prompt_ids, "ngram", {}, SamplingConfig(True, 0.8), sizes)
    res["chi2_p"], res["ks_p"], res["power"]

Both sides sample ``sizes.sample_sequences`` continuations of ``sample_tokens + sample_later + sample_lookahead``
tokens from the same prompt with different seeds. Two tests, each on a marginal of that law (so still exact): a
two-sample chi-square on the joint law of the first ``sample_tokens`` (rare outcomes pooled), and a two-sample
Kolmogorov-Smirnov test on the log-probability under the target of the first ``sample_tokens + sample_later``, the
window (teacher-forced with the transformers model, an independent implementation; a sequence that ends in EOS
inside the window counts what it generated, a function of its law all the same). The later tokens give the KS test
reach past the first steps: a drafter that lies only after a few tokens, after a rejection or past a cache block
moves their law, and drawing its drafts from a sharper or flatter law than it reports moves their log-probability.
The lookahead lets the steps that make the window's tokens verify drafts: a step verifies no deeper than the
tokens still allowed but one (its bonus token), so without it the window's last token had no room for a draft,
and every rejected draft's recovered token lies in the window. The certificate decides on the two tests with Holm
at ``sizes.alpha``, so the chi-square alone fails the check at ``sizes.alpha / 2`` (:data:`TESTS`): its power to
detect ``sizes.e2e_tv`` is reported at that level, a lower bound on the pair's. Where the certificate starts it (a
prefix whose continuations verify drafts, chosen by a pilot on seeds of its own): :mod:`specdec.eval.sampled_start`.
"""
from __future__ import annotations

import inspect
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


def window(sizes: Any) -> int:
    """Tokens of each sequence that the log-probability KS test reads: the chi-square's ``sample_tokens`` and
    ``sample_later`` more."""
    return sizes.sample_tokens + sizes.sample_later


def sampled_tokens(sizes: Any) -> int:
    """New tokens each side samples after its start: the window's and ``sample_lookahead`` more."""
    return window(sizes) + sizes.sample_lookahead


def sampling_kwargs(sampling: SamplingConfig, sizes: Any) -> dict:
    """generate() arguments of one side: :func:`sampled_tokens` new tokens, sampled."""
    return dict(sampling.generate_kwargs(), max_new_tokens=sampled_tokens(sizes), do_sample=True, return_dict=True)


def drafted_share(new_tokens: list[list[int]], stats: list[Any], k: int) -> float:
    """Of the first ``k`` new tokens of every sequence (its SequenceStats in ``stats``), the share that were accepted
    drafts."""
    compared = sum(len(t[:k]) for t in new_tokens)
    return sum(drafted_in_window(s.step_lengths, k) for s in stats) / compared if compared else 0.0


def rejected_share(new_tokens: list[list[int]], stats: list[Any], k: int) -> float:
    """Per token of the window (the first ``k`` of each sequence), the drafts rejected: steps that tried a child at
    some depth and accepted none there, each then emitting a recovered token. Counted over the whole generation;
    with a lookahead of 1 every such token lies in the window (a step verifies no deeper than the tokens allowed
    but one)."""
    compared = sum(len(t[:k]) for t in new_tokens)
    rejected = sum(sum(s.depth_tried) - sum(s.depth_accepted) for s in stats)
    return rejected / compared if compared else 0.0


def _cache_argument(model: Any) -> str:
    """The name transformers' forward takes a KV cache by: ``cache`` from 5.x on, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def sequence_logprobs(model: Any, prompt: list[int], continuations: list[tuple[int, ...]],
                      chunk: int = 64) -> dict[tuple[int, ...], float]:
    """log p_target(continuation | prompt) for every distinct continuation (temperature 1), with the transformers
    model: per ``chunk`` of continuations, the prompt is run once into a KV cache that the chunk's rows share, then
    the continuations (shorter ones padded at the end, which causal attention keeps from the tokens before) in one
    forward."""
    from transformers import DynamicCache

    distinct = sorted(set(continuations))
    longest = max((len(c) for c in distinct), default=0)
    result = {c: 0.0 for c in distinct if not c}
    distinct = [c for c in distinct if c]
    argument = _cache_argument(model)
    with eval_mode(model):
        for i in range(0, len(distinct), chunk):
            batch = distinct[i : i + chunk]
            ids = torch.tensor([list(c) + [c[0]] * (longest - len(c)) for c in batch], device=model.device)
            cache = DynamicCache()
            first = model(torch.tensor([prompt], device=model.device), use_cache=True, **{argument: cache}).logits
            logits = first[:, -1:].float().expand(len(batch), 1, -1)
            if longest > 1:
                cache.batch_repeat_interleave(len(batch))
                later = model(ids[:, :-1], use_cache=True, **{argument: cache}).logits.float()
                logits = torch.cat([logits, later], 1)
            logp = logits.log_softmax(-1).gather(-1, ids[..., None])[..., 0].cpu()
            result.update((c, float(row[: len(c)].sum())) for c, row in zip(batch, logp, strict=True))
    return result


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
    starts and how far their sampling has come (:class:`~specdec.eval.token_progress.TokenProgress`): minutes on a
    CPU with the embedded model at default sizes (each side prefills the prompt once, not its ``n`` copies)."""
    n, k, w = sizes.sample_sequences, sizes.sample_tokens, window(sizes)
    # the laws of the first k and of the first w tokens of w + lookahead: marginals of the law sampled, so exactness
    # still requires each
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
    # the window as generated: shorter where EOS ended the sequence in it, a function of the sequence all the same
    wa = [tuple(t[:w]) for out in plain for t in out.new_tokens]
    wb = [tuple(t[:w]) for out in spec for t in out.new_tokens]
    runs = [s for o in spec for s in o.stats]
    steps = sum(s.steps for s in runs)  # tau over every chunk and the whole generation, as GenerateOutput.tau of one
    tau = sum(s.new_tokens for s in runs) / steps if steps else 0.0
    # Holm's first step: alone, the chi-square fails the pair at alpha / TESTS; its power there is what the check has
    fit = two_sample_chi2(a, b, tv=sizes.e2e_tv, alpha=sizes.alpha / TESTS)
    logp = sequence_logprobs(loaded.model, list(prompt), wa + wb)
    ks_p = float(stats.ks_2samp([logp[x] for x in wa], [logp[x] for x in wb]).pvalue)
    return {"chi2_p": fit.p_value, "ks_p": ks_p, "power": fit.power, "detects_tv": fit.detects_tv, "tau": tau,
            "drafted": drafted_share(wb, runs, w), "rejected": rejected_share(wb, runs, w),
            "distinct_outcomes": len(set(a + b)), "distinct_windows": len(set(wa + wb))}
