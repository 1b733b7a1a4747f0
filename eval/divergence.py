"""Greedy token identity against plain decoding, with a diagnosis of every divergence.

    result = greedy_identity(loaded, prompts_ids, drafter="ngram", max_new_tokens=64)
    result.identical, result.divergences   # [Divergence(prompt, position, gap, kind, ...)]

At the first position where speculative and plain greedy output differ, the target's
logits for the common prefix are recomputed with the transformers model (an implementation
independent of specdec's runner): if the top-1 / top-2 gap there is below ``near_tie``,
the divergence is classified ``numerical near-tie`` (float rounding picked the other of two
equal candidates); otherwise it is a ``real mismatch``, i.e. a bug.

``rule`` / ``fault`` run the speculative side with a negative control of
:mod:`specdec.eval.negative_controls` (a broken acceptance rule / a broken engine).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from specdec.eval.negative_controls import generate_with_control

from specdec.engine_setup import EngineFault
from specdec.generate import generate
from specdec.rejection import EXACT, AcceptanceRule

NEAR_TIE = 1e-3  # absolute logit gap (float32 logits of order 10 carry ~1e-5 of rounding noise)


@dataclass(frozen=True)
class Divergence:
    prompt: int
    position: int  # index into the new tokens
    plain_token: int
    speculative_token: int
    top1_logit: float
    top2_logit: float
    gap: float
    kind: str  # "numerical near-tie" | "real mismatch"


@dataclass(frozen=True)
class IdentityResult:
    prompts: int
    tokens_compared: int
    divergences: tuple[Divergence, ...]
    tau: float

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
             near_tie: float = NEAR_TIE) -> Divergence:
    logits = model(torch.tensor([prefix], device=model.device)).logits[0, -1].float()
    top = torch.topk(logits, 2).values.tolist()
    gap = top[0] - top[1]
    kind = "numerical near-tie" if gap < near_tie else "real mismatch"
    return Divergence(prompt, position, plain, spec, top[0], top[1], gap, kind)


def greedy_identity(loaded: Any, prompts: list[list[int]], drafter: Any, drafter_options: dict | None = None,
                    max_new_tokens: int = 64, batched: bool = True, rule: AcceptanceRule = EXACT,
                    near_tie: float = NEAR_TIE, plain: list[list[int]] | None = None,
                    fault: EngineFault | None = None) -> IdentityResult:
    """``plain``: plain greedy output for ``prompts`` if already computed (prompt + new tokens)."""
    # speculation="always": every proposal verified whole, so identity is checked on the drafting path (the
    # break-even guard would stop asking a drafter that does not pay, e.g. on a tiny model)
    spec_kw = dict(rule=rule, fault=fault, max_new_tokens=max_new_tokens, drafter=drafter,
                   drafter_options=drafter_options, return_dict=True, speculation="always")
    if plain is None:
        plain = generate(loaded, prompts, max_new_tokens=max_new_tokens)
    if batched:
        out = generate_with_control(loaded, prompts, **spec_kw)
        spec, tau = out.sequences, out.tau
    else:
        outs = [generate_with_control(loaded, [p], **spec_kw) for p in prompts]
        spec = [o.sequences[0] for o in outs]
        tau = sum(o.total_new_tokens for o in outs) / max(1, sum(s.steps for o in outs for s in o.stats))
    divergences = []
    compared = 0
    for i, (p, a, b) in enumerate(zip(prompts, plain, spec)):
        new_a, new_b = a[len(p):], b[len(p):]
        compared += len(new_a)
        for j, (x, y) in enumerate(zip(new_a + [None], new_b + [None])):
            if x != y:
                if x is None or y is None:  # one stopped earlier (EOS) while the other went on
                    divergences.append(Divergence(i, j, x if x is not None else -1, y if y is not None else -1,
                                                  0.0, 0.0, 0.0, "real mismatch"))
                else:
                    divergences.append(diagnose(loaded.model, a[: len(p) + j], i, j, x, y, near_tie))
                break
    return IdentityResult(len(prompts), compared, tuple(divergences), tau)
