"""Token identity against plain decoding (greedy, or coupled sampling), with a diagnosis of every divergence.

    result = greedy_identity(loaded, prompts_ids, drafter="ngram", max_new_tokens=64)
    result.identical, result.divergences   # [Divergence(prompt, position, gap, kind, ...)]

At the first position where speculative and plain greedy output differ, the target's
logits for the common prefix are recomputed with the transformers model (an implementation
independent of specdec's runner): if both emitted tokens lie less than ``near_tie`` below the top
logit there, the divergence is classified ``numerical near-tie`` (float rounding picked the
other of two equal candidates); otherwise it is a ``real mismatch``, i.e. a bug (a token far
below the top is one even where the top two are tied). Under coupled sampling
(``sampling={"do_sample": True, "seed": 7, "sampler": "coupled", ...}``) the candidates are ranked by
the perturbed logits ``sampling_logits + G`` of :mod:`specdec.coupling` (float64), which decide the same way
with ``COUPLED_NEAR_TIE``.

``rule`` / ``fault`` run the speculative side with a negative control of
:mod:`specdec.eval.negative_controls` (a broken acceptance rule / a broken engine).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from specdec.eval.negative_controls import generate_with_control

from specdec.coupling import Coupling, perturbed_logits, sequence_keys
from specdec.engine_setup import EngineFault
from specdec.generate import generate
from specdec.rejection import EXACT, AcceptanceRule
from specdec.sampling import SamplingConfig

NEAR_TIE = 1e-3  # absolute logit gap (float32 logits of order 10 carry ~1e-5 of rounding noise)
COUPLED_NEAR_TIE = 1e-5  # perturbed-logit gap under coupled sampling


@dataclass(frozen=True)
class Divergence:
    prompt: int
    position: int  # index into the new tokens
    plain_token: int
    speculative_token: int
    top1_logit: float
    top2_logit: float
    gap: float  # top logit - the lower of the two emitted tokens' logits
    kind: str  # "numerical near-tie" | "real mismatch"


@dataclass(frozen=True)
class IdentityResult:
    prompts: int
    tokens_compared: int
    divergences: tuple[Divergence, ...]
    tau: float
    # per prompt, the tokens each speculative step committed (accepted drafts + 1): where drafts were accepted
    step_lengths: tuple[tuple[int, ...], ...] = ()

    @property
    def real_mismatches(self) -> int:
        return sum(d.kind == "real mismatch" for d in self.divergences)

    @property
    def identical(self) -> bool:
        return not self.divergences

    def to_json(self) -> dict:
        return {"prompts": self.prompts, "tokens_compared": self.tokens_compared, "tau": self.tau,
                "divergences": [asdict(d) for d in self.divergences]}


@torch.inference_mode()
def diagnose(model: Any, prefix: list[int], prompt: int, position: int, plain: int, spec: int,
             near_tie: float = NEAR_TIE, coupled: tuple[Coupling, SamplingConfig, int] | None = None) -> Divergence:
    """``coupled`` = (coupling, sampling, sequence key): rank by the perturbed logits of the token at len(prefix)."""
    logits = model(torch.tensor([prefix], device=model.device)).logits[0, -1].float()
    cut_gap = None
    if coupled is not None:
        coupling, sampling, key = coupled
        noise = coupling.draft_noise(key, [len(prefix)], logits.shape[-1], logits.device)[0]
        scaled = logits.double() / sampling.temperature
        logits = perturbed_logits(logits, sampling, noise)
        cut_gap = _cut_off_gap(scaled, torch.isfinite(logits), (plain, spec))
    top = torch.topk(logits, 2).values.tolist()
    gap = top[0] - min(float(logits[plain]), float(logits[spec])) if cut_gap is None else cut_gap
    kind = "numerical near-tie" if gap < near_tie else "real mismatch"
    return Divergence(prompt, position, plain, spec, top[0], top[1], gap, kind)


def _cut_off_gap(scaled: torch.Tensor, kept: torch.Tensor, tokens: tuple[int, int]) -> float | None:
    """Where a warper cut one of the two tokens here (its perturbed logit -inf, a gap of inf whatever the margin):
    how far below the kept tokens' lowest temperature-scaled logit it lies, the most any of them does. A cut-off
    that rounding moved past it (the other side kept it) is within that of it; None where neither was cut."""
    cut = [t for t in tokens if not kept[t]]
    if not cut or not kept.any():
        return None
    floor = float(scaled[kept].min())
    return max(floor - float(scaled[t]) for t in cut)


def greedy_identity(loaded: Any, prompts: list[list[int]], drafter: Any, drafter_options: dict | None = None,
                    max_new_tokens: int = 64, batched: bool = True, rule: AcceptanceRule = EXACT,
                    near_tie: float = NEAR_TIE, plain: list[list[int]] | None = None,
                    fault: EngineFault | None = None, sampling: dict | None = None,
                    speculation: str = "always") -> IdentityResult:
    """``plain``: plain output for ``prompts`` if already computed (prompt + new tokens). ``sampling``: generate()
    keyword arguments of a coupled-sampling run (``do_sample``, ``temperature``, the warpers, ``seed``,
    ``sampler="coupled"``), both sides; None = greedy. ``speculation``: the speculative side's policy; "always"
    checks every proposal (the break-even guard would stop asking a drafter that does not pay, e.g. on a tiny
    model), "auto" the path users run by default."""
    sampling = dict(sampling or {})
    coupled = sampling.get("sampler") == "coupled" and sampling.get("do_sample", False)
    if sampling and not coupled:
        raise ValueError("identity under sampling needs sampler='coupled' and do_sample=True (standard rejection "
                         "sampling keeps the law, not the text)")
    if coupled and sampling.get("seed") is None:
        raise ValueError("identity under coupled sampling needs a seed, the same on both sides")
    if coupled and not batched and len(set(map(tuple, prompts))) < len(prompts):
        raise ValueError("identity of single runs under coupled sampling needs distinct prompts: a copy's noise is "
                         "keyed by its place among the batch's equal prompts, which a run of its own does not have")
    spec_kw = dict(rule=rule, fault=fault, max_new_tokens=max_new_tokens, drafter=drafter,
                   drafter_options=drafter_options, return_dict=True, speculation=speculation, **sampling)
    if plain is None:
        plain = generate(loaded, prompts, max_new_tokens=max_new_tokens, **sampling)
    if coupled:
        sampling_config = SamplingConfig.from_kwargs(sampling)
        keys = sequence_keys(prompts) if batched else [sequence_keys([p])[0] for p in prompts]
        if near_tie == NEAR_TIE:
            near_tie = COUPLED_NEAR_TIE
    if batched:
        out = generate_with_control(loaded, prompts, **spec_kw)
        spec, tau, stats = out.sequences, out.tau, out.stats
    else:
        outs = [generate_with_control(loaded, [p], **spec_kw) for p in prompts]
        spec = [o.sequences[0] for o in outs]
        stats = [o.stats[0] for o in outs]
        tau = sum(o.total_new_tokens for o in outs) / max(1, sum(s.steps for o in outs for s in o.stats))
    divergences = []
    compared = 0
    for i, (p, a, b) in enumerate(zip(prompts, plain, spec, strict=True)):
        new_a, new_b = a[len(p):], b[len(p):]
        compared += len(new_a)
        for j, (x, y) in enumerate(zip(new_a + [None], new_b + [None], strict=False)):
            if x != y:
                if x is None or y is None:  # one stopped earlier (EOS) while the other went on
                    divergences.append(Divergence(i, j, x if x is not None else -1, y if y is not None else -1,
                                                  0.0, 0.0, 0.0, "real mismatch"))
                else:
                    how = (Coupling(sampling["seed"]), sampling_config, keys[i]) if coupled else None
                    divergences.append(diagnose(loaded.model, a[: len(p) + j], i, j, x, y, near_tie, how))
                break
    return IdentityResult(len(prompts), compared, tuple(divergences), tau, tuple(s.step_lengths for s in stats))
