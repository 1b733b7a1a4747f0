"""Evaluate a trained EAGLE layer: per-depth top-1 / top-5 on held-out sequences, and the tree chosen by speed.

    acc = eagle_accuracies(model, eagle, held_out, steps=3)          # {"top1": [...], "top5": [...]}
    best, table = choose_tree_by_speed(loaded, eagle, prompts, max_new_tokens=64)
    best, chain = tree_from_accuracies(acc["top1"], train_depth=3)  # --no-eval-tau: nothing timed

The tree (depth, top-k, node budget) is not taken from a table: each candidate drafts the same
held-out chat prompts, each right after plain decoding of the same prompt, and the paying candidate with the
highest speedup over plain decoding is written to the checkpoint together with the measurements.
"""
from __future__ import annotations

import logging
import math
import time

import torch
from specdec.train.eagle_loss import depth_rows, depth_targets, unrolled_passes
from specdec.train.features import collate, scope_masks, target_features

from specdec.log_levels import logger_at

logger = logging.getLogger(__name__)

# (depth, top_k, max_nodes) tried by choose_tree_by_speed: small trees for CPUs (on the 2-core CPU a 2-row verify
# costs a decode step, the padded 1-row product's own price, 3-4 rows 1.35 and 6 rows 1.8), larger for GPUs
TREE_CANDIDATES = ((1, 1, 1), (2, 1, 2), (3, 1, 3), (3, 2, 4), (3, 3, 6), (4, 4, 10), (5, 6, 16), (6, 8, 24),
                   (6, 10, 40))
# a measured speedup below this is timing noise, not a win (a tree that accepted nothing has measured 1.01x)
PAYS_MARGIN = 1.02
# tree_from_accuracies: a depth whose whole chain is accepted less often adds less than this many tokens per step,
# about what drafting one more depth costs (δ ≈ 0.1 of a decode step, docs/training/eagle.md)
MIN_CHAIN_ACCEPTANCE = 0.1


def tree_pays(m: dict) -> bool:
    """A measured candidate pays only if it accepted drafts (tau above 1) and beat plain decoding past noise."""
    return m["tau"] > 1.0 and m["speedup_vs_plain"] >= PAYS_MARGIN


def tree_from_accuracies(top1: list[float], train_depth: int, candidates=TREE_CANDIDATES,
                         min_chain: float = MIN_CHAIN_ACCEPTANCE) -> tuple[tuple[int, int, int], list[float]]:
    """The tree without timing: the deepest depth up to ``train_depth`` whose estimated chance of accepting the
    whole chain (the product of the per-depth top-1) is still >= ``min_chain`` (at least depth 1), with the largest
    candidate of at most that depth. Returns it and the chain estimates."""
    chain, p = [], 1.0
    for a in top1[:train_depth]:
        p *= a
        chain.append(p)
    depth = max(1, sum(c >= min_chain for c in chain))  # accuracies <= 1: the products never rise
    return max((c for c in candidates if c[0] <= depth), key=lambda c: (c[0], c[2])), chain


def eagle_accuracies(model, eagle, seqs: list[list[int]], steps: int, batch_size: int = 4, device="cpu",
                     starts: list[int] | None = None) -> dict:
    """Per-depth top-1 / top-5 against the target's own tokens; with ``starts`` (per sequence, the first position
    to score, e.g. its response's), tokens before it are not counted."""
    return scoped_eagle_accuracies(model, eagle, seqs, steps, [starts], batch_size, device)[0]


@torch.no_grad()
def scoped_eagle_accuracies(model, eagle, seqs: list[list[int]], steps: int, scopes: list[list[int] | None],
                            batch_size: int = 4, device="cpu") -> list[dict]:
    """:func:`eagle_accuracies` for each scope (None: every position; else per sequence the first position scored),
    from one forward of the target and of the layer's passes over ``seqs``: each scope counts a subset of the
    positions scored, as training counts them (a target token outside the draft vocabulary is a miss)."""
    hits = torch.zeros(len(scopes), 2, steps, dtype=torch.long)  # [scope, top-1 / top-5, depth]
    counts = torch.zeros(len(scopes), steps, dtype=torch.long)
    embed_w = model.get_input_embeddings().weight
    lm_w = model.get_output_embeddings().weight
    for start in range(0, len(seqs), batch_size):
        ids, mask = collate(seqs[start : start + batch_size], device)
        if ids.shape[1] < 2:
            continue
        hidden, labels = target_features(model, ids, mask, eagle.config.feature_layers)
        scored = scope_masks(mask, scopes, start)  # per scope: [B, L] a subset of mask's positions
        valid, want_index = depth_targets(eagle, labels, torch.stack(scored).amax(0), lm_w.shape[0])
        for s, out in enumerate(unrolled_passes(eagle, ids, hidden, embed_w, steps), start=1):
            rows = depth_rows(valid, s)  # [B, L-1] the union of the scopes' queries at depth s
            logits = eagle.logits(out[rows], lm_w).float()  # [R, draft vocab]
            target = want_index[rows]  # [R]
            top5 = logits.topk(min(5, logits.shape[-1]), -1).indices  # [R, <=5]
            # top-1 by argmax, as eagle_loss counts it (topk may order tied logits otherwise)
            hit = torch.stack([logits.argmax(-1) == target, (top5 == target[:, None]).any(-1)])  # [2, R]
            for i, kept in enumerate(scored):
                counted = kept[:, 1:].bool()[rows]  # [R] the scope's rows among the union's
                hits[i, :, s - 1] += hit[:, counted].sum(-1).cpu()
                counts[i, s - 1] += int(counted.sum())
    rates = hits.double() / counts.clamp(min=1).unsqueeze(1)  # [scope, top-1 / top-5, depth]
    return [{"top1": rates[i, 0].tolist(), "top5": rates[i, 1].tolist(), "positions": counts[i].tolist()}
            for i in range(len(scopes))]


def _run(loaded, ids, max_new_tokens: int, drafter=None, **config) -> tuple[float, float]:
    from specdec.generate import generate

    t0 = time.perf_counter()
    out = generate(loaded, ids, drafter=drafter, max_new_tokens=max_new_tokens, return_dict=True, **config)
    seconds = time.perf_counter() - t0
    new = sum(s.new_tokens for s in out.stats)
    steps = sum(s.steps for s in out.stats)
    return new / seconds, new / max(1, steps)


def choose_tree_by_speed(loaded, eagle, prompts: list[list[int]], max_new_tokens: int, candidates=TREE_CANDIDATES,
                         patience: int = 2, progress: bool = False,
                         **config) -> tuple[tuple[int, int, int], list[dict]]:
    """Time each candidate tree against plain decoding on the same prompts (batch 1, greedy) and return the paying
    one (``tree_pays``) with the highest speedup, with the table; when none pays, the smallest tree. Plain decoding
    runs right before each candidate on each prompt, and a candidate's speedup is the geometric mean of those
    per-prompt ratios, so a machine whose speed drifts moves both sides of every ratio alike. Every candidate's
    tree is verified whole (``speculation="always"``): under the default guard a tree that does not pay is left out
    and the candidate times plain decoding. Candidates go from small to large; after ``patience`` in a row below the
    best so far the larger ones are not tried. ``progress``: a tqdm bar over the timed prompts."""
    from specdec.drafters.eagle import EagleDrafter

    table = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(candidates) * len(prompts), desc="tree choice", unit="prompt", disable=None)
    # warm-up, with a drafter: the first drafting call of a process loads (on a fresh machine: calibrates, ~10 s)
    # the cost model, which once landed in the first candidate's time (depth 1 measured 0.90x, then 1.17x)
    # (no more new tokens than the measurement's own: those fit in the model's context); generate()'s warnings are
    # the timed runs' to say, of their count of new tokens (the caller's), not the warm-up's fewer
    with logger_at("specdec.generate", logging.ERROR):
        _run(loaded, prompts[:1], min(8, max_new_tokens), EagleDrafter(model=eagle, depth=1, top_k=1, max_nodes=1),
             **config)
    worse_in_a_row = 0
    for depth, top_k, nodes in candidates:
        plain, runs = [], []
        for p in prompts:
            plain.append(_run(loaded, [p], max_new_tokens, **config)[0])
            # each candidate timed as itself (adapt_depth=False): drafting at run time then chooses up to its depth
            runs.append(_run(loaded, [p], max_new_tokens, EagleDrafter(model=eagle, depth=depth, top_k=top_k,
                                                                      max_nodes=nodes, adapt_depth=False),
                             **{**config, "speculation": "always"}))
            if bar is not None:
                bar.update(1)
        speedup = math.exp(sum(math.log(r[0] / b) for r, b in zip(runs, plain, strict=True)) / len(runs))
        best_so_far = max((r["speedup_vs_plain"] for r in table), default=0.0)
        table.append({"depth": depth, "top_k": top_k, "max_nodes": nodes,
                      "tau": sum(r[1] for r in runs) / len(runs), "tokens_per_s": sum(r[0] for r in runs) / len(runs),
                      "plain_tokens_per_s": sum(plain) / len(plain), "speedup_vs_plain": speedup})
        logger.info("eagle tree depth %d top-k %d nodes %d: tau %.2f, %.1f tok/s (%.2fx plain)", depth, top_k,
                    nodes, table[-1]["tau"], table[-1]["tokens_per_s"], speedup)
        worse_in_a_row = worse_in_a_row + 1 if speedup < best_so_far else 0
        if worse_in_a_row >= patience:
            logger.info("eagle tree choice: %d candidates in a row slower than the best; larger ones not tried",
                        patience)
            break
    if bar is not None:
        bar.close()
    paying = [r for r in table if tree_pays(r)]
    if paying:
        best = max(paying, key=lambda r: r["speedup_vs_plain"])
    else:
        top = max(table, key=lambda r: r["speedup_vs_plain"])
        best = min(table, key=lambda r: (r["max_nodes"], r["depth"]))
        logger.warning("eagle tree choice: no tree beat plain decoding (the best: %.2fx, tau %.2f; a tree pays with "
                       "tau above 1 and at least %.2fx); saving the smallest, depth %d top-k %d nodes %d",
                       top["speedup_vs_plain"], top["tau"], PAYS_MARGIN, best["depth"], best["top_k"],
                       best["max_nodes"])
    return (best["depth"], best["top_k"], best["max_nodes"]), table
