"""EAGLE against specdec's plain decoding and the n-gram drafter, per category, in one run (CPU).

    python benchmarks/bench_eagle_cpu.py --eagle-path eagle-smollm2/ --prompts 3 --max-new-tokens 128
    python benchmarks/bench_eagle_cpu.py --eagle-path eagle-smollm2/ --temperature 0.8
    python benchmarks/bench_eagle_cpu.py --eagle-path e/ --medusa-path old=heads/ --medusa-path reduced=heads-4k/
    python benchmarks/bench_eagle_cpu.py --eagle-path e/ --categories chat --always --eagle-tree 8,10,64

Embedded model, fp32, batch 1, the held-out prompts of ``specdec eval acceptance`` (none of them is in the training
prompts), every category by default. Per prompt the drafters run one after another (interleaved, after a warm-up, in
an order rotated per prompt and ``--repeats`` run), so the ratios against plain decoding come from the same minutes of
the same machine; the row "plain (again)" is plain decoding run a second time in every block, this run's noise floor.
Prints tokens/s, the ratio against plain, tau, and eagle's acceptance per draft depth; greedy runs also check that
every drafter's tokens equal plain decoding's. The break-even guard is on (the default); seeded standard sampling
verifies every tree whole (a seed's text may not depend on measured costs), ``--unseeded`` leaves the seed out (sized
by wall time); ``--always`` forces speculation every step. ``--eagle-tree DEPTH,TOP_K,NODES`` adds a row of the layer
drafting that fixed tree (no per-call depth choice): with ``--always``, the tau that a tree of that size reaches,
whatever it costs on this machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    add_overwrite,
    chat_ids,
    check_categories,
    check_new_files,
    check_positive,
    eagle_rows,
    run_main,
    time_specdec,
)
from specdec.eval.prompts import CATEGORIES, load_prompts  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.output import acceptance_rates  # noqa: E402


def tree_shape(text: str) -> tuple[int, int, int]:
    """``DEPTH,TOP_K,NODES`` -> three positive ints (the eagle drafter checks NODES against its limit)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected DEPTH,TOP_K,NODES (three positive integers), got {text!r}")
    depth, top_k, nodes = (int(p) for p in parts)
    return depth, top_k, nodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--eagle-path", required=True, help="an EAGLE checkpoint directory (specdec train-eagle)")
    ap.add_argument("--medusa-path", action="append", default=[], help="NAME=DIR of Medusa heads to compare")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--repeats", type=int, default=1, help="runs of each prompt per drafter, order rotated each time")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (seed 0 per prompt)")
    ap.add_argument("--always", action="store_true", help="speculation='always': no break-even guard")
    ap.add_argument("--unseeded", action="store_true",
                    help="with --temperature: no seed, so the guard sizes by this run's wall times (a seed sizes "
                         "from cached costs, so that the seed reproduces the text)")
    ap.add_argument("--eagle-tree", action="append", default=[], type=tree_shape, metavar="DEPTH,TOP_K,NODES",
                    help="also run the layer with this fixed tree (repeatable)")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    add_overwrite(ap)
    args = ap.parse_args()
    check_positive(ap, args, "prompts", "max_new_tokens", "repeats")
    categories = check_categories(ap, args.categories)
    if args.temperature < 0:
        ap.error(f"--temperature {args.temperature}: 0 (greedy) or above")
    bad = [spec for spec in args.medusa_path if not all(spec.partition("=")[::2])]
    if bad:
        ap.error(f"--medusa-path: NAME=DIR, got {', '.join(map(repr, bad))}")
    check_new_files(ap, args.overwrite, args.json)
    try:
        measure(args, categories)
    finally:
        torch.set_grad_enabled(True)


def measure(args, categories: list[str]) -> None:
    """The run: every drafter against plain decoding per prompt, the tables printed, the JSON written."""
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    # "plain (again)": plain decoding a second time in every block, this run's noise floor
    table = {"plain": (None, {}), "plain (again)": (None, {}), "ngram": ("ngram", {})} | eagle_rows(args.eagle_path)
    for depth, top_k, nodes in args.eagle_tree:
        table[f"eagle {depth}/{top_k}/{nodes}"] = ("eagle", {"path": args.eagle_path, "depth": depth, "top_k": top_k,
                                                             "max_nodes": nodes, "adapt_depth": False})
    for spec in args.medusa_path:
        name, _, path = spec.partition("=")
        table[f"medusa {name}"] = ("medusa", {"path": path, "tree": "dynamic"})
    sampling = ({"do_sample": True, "temperature": args.temperature, "top_k": 0, "seed": 0}
                if args.temperature > 0 else {})
    if sampling and args.unseeded:
        del sampling["seed"]
    if args.always:
        sampling["speculation"] = "always"

    def run(spec, ids):
        name, options = spec
        return time_specdec(loaded, ids, args.max_new_tokens, drafter=name, drafter_options=options or None,
                            **sampling)

    warm = chat_ids(loaded.tokenizer, "Hello!")
    for spec in table.values():
        run(spec, warm)
    report: dict = {"temperature": args.temperature, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                    "categories": {}}
    mode = f"temperature {args.temperature}" if args.temperature > 0 else "greedy"
    print(f"{mode}, {args.max_new_tokens} new tokens, {args.prompts} prompt(s) per category x {args.repeats} "
          "run(s), batch 1")
    for cat in categories:
        totals = {k: {"tokens": 0, "seconds": 0.0, "steps": 0, "differ": set(), "tried": [], "accepted": []}
                  for k in table}
        keys = list(table)
        runs = [(p, r, text) for p, text in enumerate(load_prompts(cat, args.prompts)) for r in range(args.repeats)]
        for p, r, text in runs:
            ids = chat_ids(loaded.tokenizer, text)
            shift = (p + r) % len(keys)  # order rotated per prompt and repeat: no drafter always runs after another
            block = {key: run(table[key], ids) for key in keys[shift:] + keys[:shift]}
            for key, (seconds, out) in block.items():
                s, toks = out.stats[0], out.new_tokens[0]
                t = totals[key]
                t["tokens"] += len(toks)
                t["seconds"] += seconds
                t["steps"] += s.steps
                if not sampling and toks != block["plain"][1].new_tokens[0]:  # plain's tokens of the same block
                    t["differ"].add(p)
                for field, new in (("tried", s.depth_tried), ("accepted", s.depth_accepted)):
                    acc = t[field]
                    acc.extend([0] * (len(new) - len(acc)))
                    for d, x in enumerate(new):
                        acc[d] += x
        base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
        print(f"\n{cat}: {'drafter':<18} {'tok/s':>8} {'vs plain':>9} {'tau':>6}   acceptance per depth")
        report["categories"][cat] = {}
        for key, t in totals.items():
            tps = t["tokens"] / t["seconds"]
            per_depth = list(acceptance_rates(t["accepted"], t["tried"]))
            report["categories"][cat][key] = {"tokens_per_s": tps, "speedup_vs_plain": tps / base,
                                              "tau": t["tokens"] / max(1, t["steps"]),
                                              "acceptance_per_depth": per_depth,
                                              "prompts_differing_from_plain": len(t["differ"])}
            depth = " ".join(f"{a:.2f}" for a in per_depth[:8])
            print(f"{'':<6} {key:<18} {tps:8.2f} {tps / base:8.2f}x {t['tokens'] / max(1, t['steps']):6.2f}   "
                  f"{depth}" + (f"  ({len(t['differ'])} prompts differ from plain!)" if t["differ"] else ""))
    if args.json:
        write_json(args.json, report, indent=2)


if __name__ == "__main__":
    run_main(main)
