"""The certificate's bit-exact level (``specdec eval lossless --levels bitwise``).

In the bit-exact mode (``invariant=True``) speculative decoding must be plain decoding bit for bit, in the
model's own dtype. Checked on the model with the drafter:

1. **rows**: a batched verify forward (two prompts prefilled together, a random tree each; a single prompt runs
   as two copies) gives every row the logits a one-row forward at the same position gives it
   (:mod:`specdec.models.invariance_check`).
2. **text**: speculative output (batched, and one prompt at a time) has the same tokens and bitwise the same
   log-probabilities as plain decoding of each prompt alone, greedy; and under coupled sampling when the
   certificate samples.

Controls that must fail: ``default_path`` (the same checks with ``invariant=False``: BLAS kernels chosen by row
count, attention over padded batches) and ``row_dependent_kernel`` (an invariant runner whose products split
the K reduction in two whenever they have more than one row: what a library choosing kernels by M does; the text
checks run it on two prompts, batched and alone, which is enough to fail by construction). Where
the default path itself gives every row of the batched forward bitwise its one-row logits (a device whose kernels
do not depend on the row count, e.g. some GPUs in float32), ``default_path`` has nothing to catch: its checks are
recorded as not applicable there (neither pass nor void, with a warning) and ``row_dependent_kernel``, which
differs by construction, carries the level's power.

    checks, warnings = bitwise_checks(loaded, "ngram", {}, SamplingConfig(False), sizes, make_prompts, seed=0)
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from specdec.eval.certificate import CertificateSizes, Check
from specdec.eval.divergence import diagnose

from specdec.models import invariance_check
from specdec.models.llama import LlamaRunner
from specdec.sampling import SamplingConfig

LEVEL = "bitwise"
CONTROLS = ("default_path", "row_dependent_kernel")
CONTROL_PROMPTS = 2  # prompts of the text checks' row_dependent_kernel control (batched, and each alone)
# the detail of a default_path check where that path is row-invariant (run_certificate reads "not applicable")
EXACT_DEFAULT = ("not applicable on this device: its default path gave every row bitwise its one-row logits, so "
                 "this control had nothing to catch")


class SplitKWhenBatched(LlamaRunner):
    """A deliberately row-dependent runner (negative control): its products sum the two halves of K separately
    whenever a forward has more than one row, so a row's last bits depend on the other rows."""

    def _linear(self, x, weight, bias=None):
        if x.shape[0] == 1:
            return super()._linear(x, weight, bias)
        half = x.shape[1] // 2
        out = super()._linear(x[:, :half].contiguous(), weight[:, :half].contiguous()) \
            + super()._linear(x[:, half:].contiguous(), weight[:, half:].contiguous())
        return out if bias is None else out + bias


def row_dependent(runner: LlamaRunner) -> LlamaRunner:
    """An invariant copy of ``runner`` (sharing its weights) with the row-dependent product."""
    broken = copy.copy(runner.invariant_mode(True))
    broken.__class__ = SplitKWhenBatched
    return broken


@dataclass(frozen=True)
class BitwiseDivergence:
    prompt: int
    position: int  # index into the new tokens: the first one whose token or log-probability differs
    plain_token: int  # -1 past the end of a shorter output
    speculative_token: int
    logprob_delta: float  # speculative - plain log-probability at that position (nan when the tokens differ)
    gap: float | None  # top-1 / top-2 logit gap of the model at that prefix (greedy with a model; else None)
    text_position: int | None = None  # the first new token that differs (None: same text, log-probabilities apart)
    text_gap: float | None = None  # the logit gap at text_position (greedy with a model; else None)


@dataclass(frozen=True)
class BitwiseResult:
    prompts: int
    tokens_compared: int
    divergences: tuple[BitwiseDivergence, ...]
    tau: float

    @property
    def identical(self) -> bool:
        return not self.divergences

    def to_json(self) -> dict:
        return {"prompts": self.prompts, "tokens_compared": self.tokens_compared, "tau": self.tau,
                "divergences": [dataclasses.asdict(d) for d in self.divergences]}


def _generate(loaded, prompts, **kw):
    from specdec.generate import generate

    return generate(loaded, prompts, output_logprobs=True, return_dict=True, **kw)


def plain_outputs(loaded: Any, prompts: list[list[int]], max_new_tokens: int, invariant: bool,
                  sampling: dict | None = None) -> list[tuple[list[int], list[float]]]:
    """(new tokens, log-probabilities) of plain decoding, each prompt alone."""
    outs = [_generate(loaded, [p], max_new_tokens=max_new_tokens, invariant=invariant, **(sampling or {}))
            for p in prompts]
    return [(o.new_tokens[0], o.logprobs[0]) for o in outs]


def first_divergence(i: int, prompt: list[int], plain: tuple[list[int], list[float]],
                     spec: tuple[list[int], list[float]], model: Any = None) -> BitwiseDivergence | None:
    """The first position where ``spec`` parts from ``plain`` (token, or log-probability bits), and the first where
    its text does; ``model`` (the transformers model) gives the logit gap of plain's prefix at each."""
    (a, la), (b, lb) = plain, spec
    n = max(len(a), len(b))
    tokens = [(a[j] if j < len(a) else -1, b[j] if j < len(b) else -1) for j in range(n)]
    first = next((j for j, (x, y) in enumerate(tokens) if x != y or la[j] != lb[j]), None)
    if first is None:
        return None
    text = next((j for j, (x, y) in enumerate(tokens) if x != y), None)

    def gap(j):
        if model is None or j is None or j >= len(a):
            return None
        x, y = tokens[j]
        d = diagnose(model, list(prompt) + a[:j], i, j, x, max(y, 0))
        return d.top1_logit - d.top2_logit

    x, y = tokens[first]
    delta = lb[first] - la[first] if x == y else math.nan
    first_gap = gap(first)
    return BitwiseDivergence(i, first, x, y, delta, first_gap, text,
                             first_gap if text == first else gap(text))


def bitwise_identity(loaded: Any, prompts: list[list[int]], drafter: Any, options: dict | None, max_new_tokens: int,
                     batched: bool, invariant: bool, plain: list[tuple[list[int], list[float]]],
                     sampling: dict | None = None, diagnose_gaps: bool = True) -> BitwiseResult:
    """Speculative output (one batch, or one prompt at a time) against ``plain`` (:func:`plain_outputs`)."""
    kw = dict(max_new_tokens=max_new_tokens, drafter=drafter, drafter_options=options or None,
              speculation="always", invariant=invariant, **(sampling or {}))
    outs = [_generate(loaded, prompts, **kw)] if batched else [_generate(loaded, [p], **kw) for p in prompts]
    spec = [(t, lp) for o in outs for t, lp in zip(o.new_tokens, o.logprobs, strict=True)]
    steps = sum(s.steps for o in outs for s in o.stats)
    tau = sum(o.total_new_tokens for o in outs) / max(1, steps)
    model = getattr(loaded, "model", None) if diagnose_gaps and not sampling else None
    divergences = [d for i, (p, a, b) in enumerate(zip(prompts, plain, spec, strict=True))
                   if (d := first_divergence(i, p, a, b, model)) is not None]
    return BitwiseResult(len(prompts), sum(len(a[0]) for a in plain), tuple(divergences), tau)


def row_checks(loaded: Any, seed: int, prompts: list[list[int]]) -> list[Check]:
    gen = torch.Generator().manual_seed(seed)
    vocab = loaded.runner.shape.vocab_size
    trees = [invariance_check.random_tree(n, vocab, gen) for n in (15, 6)]
    # two sequences in one forward, one tree each: with a single prompt (--identity-prompts 1), that prompt twice
    together = "2 prompts" if len(prompts) > 1 else "the one prompt twice"
    prompts = [p[:48] for p in (prompts * 2)[:2]]
    rows = sum(1 + t.num_nodes for t in trees)
    checks = []
    runners = [(None, loaded.runner.invariant_mode(True)), ("default_path", loaded.runner.invariant_mode(False)),
               ("row_dependent_kernel", row_dependent(loaded.runner))]
    for control, runner in runners:
        batched, alone = invariance_check.alone_logits(runner, prompts, trees)
        bad = sum(int((b != a).any(-1).sum()) for b, a in zip(batched, alone, strict=True))
        worst = max(float((b - a).abs().max()) for b, a in zip(batched, alone, strict=True))
        detail = f"{bad} of {rows} rows differ (trees of 15 and 6 nodes, {together} together)"
        if control == "default_path" and bad == 0:
            detail = f"{EXACT_DEFAULT}; {detail}"
        checks.append(Check("row logits in a batched tree forward == one-row forward", LEVEL, bad == 0, control,
                            bound=worst, samples=rows, detail=detail))
    return checks


def bitwise_checks(loaded: Any, drafter: Any, options: dict, sampling: SamplingConfig, sizes: CertificateSizes,
                   make_prompts: Callable[[int], list[list[int]]], seed: int = 0) -> tuple[list[Check], list[str]]:
    prompts = make_prompts(sizes.identity_prompts)
    checks, warnings = row_checks(loaded, seed, prompts), []
    # the default path is row-invariant here: its text cannot part from plain decoding's either
    exact_default = any(c.control == "default_path" and c.passed for c in checks)
    if exact_default:
        warnings.append("bitwise: the default path was row-invariant on this device (every row of a batched "
                        "forward bitwise its one-row logits), so its control is not applicable here; the "
                        "row_dependent_kernel control must still fail")
    settings = [("greedy", None)]
    if sampling.do_sample:
        settings.append(("coupled", dict(sampling.generate_kwargs(), seed=seed, sampler="coupled")))
    tokens = sizes.identity_tokens
    # row_dependent_kernel differs by construction, so each text check has a control that fails on every device;
    # run on CONTROL_PROMPTS prompts (batched, and each alone): enough to fail, at a fraction of the checks' time
    broken = dataclasses.replace(loaded, runner=row_dependent(loaded.runner))
    runs = ((None, loaded, True, prompts), ("default_path", loaded, False, prompts),
            ("row_dependent_kernel", broken, True, prompts[:CONTROL_PROMPTS]))
    for name, kw in settings:
        for control, model, invariant, some in runs:
            plain = plain_outputs(model, some, tokens, invariant, kw)
            gaps = control != "row_dependent_kernel"  # where a broken kernel parts needs no diagnosis
            results = [bitwise_identity(model, some, drafter, options, tokens, True, invariant, plain, kw, gaps),
                       bitwise_identity(model, some[:2], drafter, options, tokens, False, invariant, plain[:2], kw,
                                        gaps)]
            divergences = [d for r in results for d in r.divergences]
            token_level = [d for d in divergences if d.text_position is not None]
            detail = (f"tau {results[0].tau:.2f}; {len(divergences)} outputs differ ({len(token_level)} in text, "
                      f"the rest in log-probability bits)")
            if divergences:
                d = divergences[0]
                detail += (f"; first: prompt {d.prompt} token {d.position}"
                           + (f" logit gap {d.gap:.3g}" if d.gap is not None else "")
                           + ("" if math.isnan(d.logprob_delta) else f" log-prob delta {d.logprob_delta:.3g}"))
            if control == "default_path" and exact_default and not divergences:
                detail = f"{EXACT_DEFAULT}; {detail}"
            checks.append(Check(f"{name} text and log-probabilities == plain, bit for bit (batched + single)", LEVEL,
                                not divergences, control, samples=sum(r.tokens_compared for r in results),
                                detail=detail))
            if control is None and results[0].tau <= 1.0:
                warnings.append(f"bitwise {name}: no draft was accepted, so tree rows never reached the output")
    return checks, warnings
