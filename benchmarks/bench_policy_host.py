"""Host time of the speculation policy's tree sizing per step: what ``speculation="auto"`` adds between two steps.

    python benchmarks/bench_policy_host.py                  # the default grid, medians of 50 rounds
    python benchmarks/bench_policy_host.py --json out.json  # also as JSON (rows of the table)

On a GPU a step synchronises once, so the host's work between reading the target's choices and launching the next
verify is time the device idles. Tree sizing is part of it: per step it sizes every sequence's tree
(``TreeSizer.size_call``), learns from each commit (``observe``), and at the end of a call stores what each
finished sequence learned (``release``). This times the three on synthetic trees (a chain, and trees of 8 children
under the previous level's first child, as the oracle drafter grows them), unscored or with random scores, with a
flat verify-cost curve as on a GPU (so the sizer keeps large parts of the trees and learns from them). No model
runs. It uses only the sizer's public calls, so an older checkout runs it too (for a before/after, run this file
with that checkout's interpreter). Where the sizer has ``padded`` (a verify through CUDA-graph buckets, whose trees
are capped together), each row also times a padded sizer over the same trees, round for round alongside.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HelpWithDefaults, add_overwrite, check_new_files, run_main  # noqa: E402

from specdec.atomic_write import write_json
from specdec.cost_model import CostModel
from specdec.tree import DraftMode, DraftTree
from specdec.tree_sizing import TreeSizer

PADDED = "padded" in {f.name for f in dataclasses.fields(TreeSizer)}  # an older checkout's sizer has no cap
GRID = ((32, 8, 8, False), (32, 8, 8, True), (8, 6, 1, False), (1, 8, 8, False))  # batch, depth, width, scored


def flat_costs() -> CostModel:
    """c(n) / c(1) nearly flat in n, as a GPU's verify of a few dozen tokens."""
    sizes = (1, 2, 4, 8, 16, 32, 65)
    return CostModel(key={"bench": "policy-host"},
                     curves={b: {n: 0.01 * (1 + 0.002 * n * b / 32) for n in sizes} for b in (1, 2, 4, 8, 16, 32)})


def trees(batch: int, depth: int, width: int, scored: bool, seed: int = 0) -> list[DraftTree]:
    g = torch.Generator().manual_seed(seed)
    parents = [-1 if d == 0 else (d - 1) * width for d in range(depth) for _ in range(width)]
    out = []
    for _ in range(batch):
        tokens = torch.randint(100, (len(parents),), generator=g)
        scores = torch.rand(len(parents), generator=g) if scored else None
        out.append(DraftTree(tokens, parents, None, DraftMode.DETERMINISTIC, scores))
    return out


def measure(batch: int, depth: int, width: int, scored: bool, rounds: int) -> dict:
    proposed = trees(batch, depth, width, scored)
    # each sequence commits its tree's first child at depth 1 and 2, then a token of its own: two accepted
    committed = [[t.tokens[0].item(), t.tokens[min(width, t.num_nodes - 1)].item(), 5] for t in proposed]
    sizer = TreeSizer(flat_costs())
    padded = TreeSizer(flat_costs(), padded=True) if PADDED else None
    for each in (sizer, padded) if padded else (sizer,):
        each.record_step(0.01, 1, batch)
    ids = list(range(batch))
    size_s, observe_s, padded_s = [], [], []
    kept = kept_padded = 0
    for r in range(rounds + 10):  # 10 warm-up rounds
        t0 = time.perf_counter()
        out = sizer.size_call(ids, proposed, batch, 0.0005)
        t1 = time.perf_counter()
        for i in ids:
            sizer.observe(i, committed[i])
        t2 = time.perf_counter()
        if padded is not None:
            capped = padded.size_call(ids, proposed, batch, 0.0005)
            for i in ids:
                padded.observe(i, committed[i])
            if r >= 10:
                padded_s.append(time.perf_counter() - t2)
                kept_padded += sum(t.num_nodes for t in capped)
        if r >= 10:
            size_s.append(t1 - t0)
            observe_s.append(t2 - t1)
            kept += sum(t.num_nodes for t in out)
    t0 = time.perf_counter()
    for i in ids:
        sizer.release(i)
    release = time.perf_counter() - t0
    row = dict(batch=batch, nodes=depth * width, scored=scored, size_ms=1e3 * statistics.median(size_s),
               observe_ms=1e3 * statistics.median(observe_s), release_ms=1e3 * release,
               kept_nodes=kept / (rounds * batch))
    if padded is not None:
        row.update(padded_ms=1e3 * statistics.median(padded_s), kept_padded=kept_padded / (rounds * batch))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--json", default=None)
    add_overwrite(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    check_new_files(ap, args.overwrite, args.json)
    torch.set_num_threads(1)
    rows = [measure(*cell, args.rounds) for cell in GRID]
    print(f"{'batch':>5} {'nodes':>5} {'scores':>7} {'size_call ms':>13} {'observe ms':>11} {'release ms':>11} "
          f"{'kept nodes':>11}" + (f" {'padded: size_call + observe ms':>31} {'kept nodes':>11}" if PADDED else ""))
    for r in rows:
        print(f"{r['batch']:>5} {r['nodes']:>5} {'yes' if r['scored'] else 'no':>7} {r['size_ms']:13.3f} "
              f"{r['observe_ms']:11.3f} {r['release_ms']:11.3f} {r['kept_nodes']:11.1f}"
              + (f" {r['padded_ms']:31.3f} {r['kept_padded']:11.1f}" if PADDED else ""))
    if args.json:
        write_json(args.json, rows, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
