"""Evaluate trained heads: per-head rank accuracies on held-out sequences, and tau with the Medusa drafter.

    acc = head_accuracies(model, heads, held_out_seqs)   # {"top1": [...], "top5": [...], "rank_acc": [[...]]}
    tau = measure_tau(loaded, heads, choices, prompts, max_new_tokens=128)
"""
from __future__ import annotations

import logging
import sys

import torch
from specdec.train.features import collate, scope_masks, target_features

logger = logging.getLogger(__name__)


def eval_prompts(n: int) -> list[str]:
    """The first ``n`` held-out chat prompts of the acceptance suite (--eval-prompts); more than there are gives all
    (:func:`say_few_eval_prompts` says so, once, before the run)."""
    from specdec.eval.prompts import load_prompts

    return load_prompts("chat", n)


def say_few_eval_prompts(n: int) -> None:
    """Warn when --eval-prompts asks for more held-out chat prompts than there are (the measurement uses them all)."""
    from specdec.eval.prompts import CHAT

    if n > len(CHAT):
        logger.warning("--eval-prompts %d: there are %d held-out chat prompts; using all %d", n, len(CHAT), len(CHAT))


MAX_RANK = 10


def head_accuracies(model, heads, seqs: list[list[int]], batch_size: int = 4, device="cpu",
                    starts: list[int] | None = None) -> dict:
    """rank_acc[i][k] = P(the target's token is head i's rank-k guess); top1/top5 are its prefix sums.

    Heads over a reduced draft vocabulary rank only its N tokens (ranks mapped back to token ids); a
    target token outside it is a miss at every rank, so the accuracies are those the drafter gets. With
    ``starts`` (per sequence, the first position to score, e.g. its response's), tokens before it are not counted."""
    return scoped_head_accuracies(model, heads, seqs, [starts], batch_size, device)[0]


@torch.no_grad()
def scoped_head_accuracies(model, heads, seqs: list[list[int]], scopes: list[list[int] | None], batch_size: int = 4,
                           device="cpu") -> list[dict]:
    """:func:`head_accuracies` for each scope (None: every position; else per sequence the first position scored),
    from one forward of the target and the heads over ``seqs``: each scope counts a subset of the real positions."""
    n = heads.config.num_heads
    hits = torch.zeros(len(scopes), n, MAX_RANK, dtype=torch.float64)
    counts = torch.zeros(len(scopes), n, dtype=torch.float64)
    lm_w = model.get_output_embeddings().weight
    rows = heads.lm_rows(lm_w)  # [draft_size, hidden]
    vocab = heads.vocab()
    k = min(MAX_RANK, heads.config.draft_size)
    for start in range(0, len(seqs), batch_size):
        ids, mask = collate(seqs[start : start + batch_size], device)
        hidden, labels = target_features(model, ids, mask)
        scored = scope_masks(mask, scopes, start)  # per scope: [B, L] a subset of mask's positions
        for i in range(n):
            shift = 1 + i
            if hidden.shape[1] <= shift:
                continue
            valid = mask[:, shift:].bool()
            x = heads.heads[i](hidden[:, :-shift][valid])
            logits = torch.nn.functional.linear(x, rows) if heads.config.shared_lm_head else x
            ranks = logits.topk(k, dim=-1).indices  # [N, k] best first, columns of the heads' logits
            if vocab is not None:
                ranks = vocab.to_full(ranks)  # -> token ids
            eq = ranks == labels[:, shift:][valid].unsqueeze(-1)
            for s, kept in enumerate(scored):
                counted = kept[:, shift:][valid].bool()  # [N] the scope's rows among the real ones
                hits[s, i, :k] += eq[counted].sum(0).double().cpu()
                counts[s, i] += int(counted.sum())
    out = []
    for s in range(len(scopes)):
        rank_acc = (hits[s] / counts[s].clamp(min=1).unsqueeze(-1)).tolist()
        out.append({"rank_acc": rank_acc, "top1": [r[0] for r in rank_acc], "top5": [sum(r[:5]) for r in rank_acc],
                    "positions": counts[s].tolist()})
    return out


DYNAMIC_TOP_K = 20  # candidates per head of the dynamic eval tree


def measure_tau(loaded, heads, choices, prompts: list[str], max_new_tokens: int, batch_size: int = 8,
                progress: bool = False, tree: str = "static", budget: int | None = None) -> dict:
    """Greedy generation with the Medusa drafter; tau = new tokens per target forward, every proposed tree verified
    whole (``speculation="always"``): tau measures the heads, not the break-even guard leaving them out.

    ``tree="static"`` drafts the ``choices`` tree; ``"dynamic"`` drafts, per step, the ``budget`` (--tree-budget;
    None: ``len(choices)``) most probable paths under the heads' top-``min(DYNAMIC_TOP_K, budget)`` tokens, the
    drafter options ``tree=dynamic max_nodes=budget top_k=min(20, budget)``: the chosen tree may have fewer nodes
    (no more paths of a measured accuracy above zero), which a dynamic tree does not read."""
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.train.distill import encode_prompt

    from specdec.generate import generate

    ids = [encode_prompt(loaded.tokenizer, p) for p in prompts]
    # generate() draws its bar wherever asked; off a terminal (a pipe, a log file) none, as the run's other bars
    on_terminal = progress and sys.stderr is not None and sys.stderr.isatty()
    nodes = len(choices) if tree == "static" or budget is None else budget
    new = steps = 0
    for start in range(0, len(ids), batch_size):
        if tree == "static":
            drafter = MedusaDrafter(heads=heads, tree="static", medusa_choices=choices)
        else:
            drafter = MedusaDrafter(heads=heads, tree="dynamic", max_nodes=nodes,
                                    # a small draft vocabulary, or a tree of fewer nodes, holds fewer candidates
                                    top_k=min(DYNAMIC_TOP_K, heads.config.draft_size, nodes))
        out = generate(loaded, ids[start : start + batch_size], drafter=drafter, max_new_tokens=max_new_tokens,
                       return_dict=True, progress=on_terminal, speculation="always")
        new += sum(s.new_tokens for s in out.stats)
        steps += sum(s.steps for s in out.stats)
    return {"tau": new / max(1, steps), "new_tokens": new, "target_forwards": steps, "prompts": len(prompts),
            "max_new_tokens": max_new_tokens, "tree": tree, "tree_nodes": nodes}
