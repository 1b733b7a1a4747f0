"""tau and tokens/s of every drafter on the embedded model (CPU), against plain decoding.

    python benchmarks/bench_drafters_cpu.py --prompts 3 --max-new-tokens 96
    python benchmarks/bench_drafters_cpu.py --sweep-self-draft          # pick N layers / depth
    python benchmarks/bench_drafters_cpu.py --medusa-path heads/        # trained Medusa heads
    python benchmarks/bench_drafters_cpu.py --speculation always        # verify every proposed tree whole

Per category (summarisation, code, chat), the same prompts run through each drafter in
one process, interleaved per prompt after a warm-up, greedy. Prints tokens/s, the ratio
against specdec's plain decoding measured in the same run, tau, and checks that every
drafter's tokens equal plain decoding's. Drafters run with ``speculation="auto"`` (the default: tree
sizing by the measured cost model and the break-even guard) unless ``--speculation always``; the row
"ngram (whole trees)" runs n-gram with ``speculation="always"`` in the same run, for comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import chat_ids, time_specdec  # noqa: E402
from specdec.eval.prompts import load_prompts  # noqa: E402

from specdec.models.loader import load_model  # noqa: E402


def drafters(args, loaded) -> dict[str, tuple[str | None, dict]]:
    if args.sweep_self_draft:
        return {"plain": (None, {})} | {
            f"self-draft N={n} k={k}": ("self-draft", {"num_layers": n, "num_draft_tokens": k})
            for n in (4, 8, 12) for k in (2, 3, 4)
        }
    out = {
        "plain": (None, {}),
        "ngram": ("ngram", {}),
        "ngram (whole trees)": ("ngram", {"speculation": "always"}),
        "self-draft": ("self-draft", {}),
        "draft-model (itself)": ("draft-model", {"model": loaded, "num_draft_tokens": 3}),
    }
    if args.medusa_path:
        out["medusa (static 16)"] = ("medusa", {"path": args.medusa_path})  # saved choices, first 16 nodes
        out["medusa (dynamic 16)"] = ("medusa", {"path": args.medusa_path, "tree": "dynamic"})
    else:  # untrained heads that start as copies of the LM head: a floor, not what training gives
        from specdec.drafters.medusa import MedusaDrafter
        from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

        shape = loaded.runner.shape
        heads = MedusaHeads(MedusaConfig(3, 1, shape.hidden_size, shape.vocab_size))
        heads.init_lm_heads_from(loaded.runner.lm_head)
        out["medusa (untrained)"] = (lambda: MedusaDrafter(heads=heads, tree="dynamic", max_nodes=8), {})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--categories", default="summarisation,code,chat")
    ap.add_argument("--sweep-self-draft", action="store_true", help="compare self-draft layer counts and depths")
    ap.add_argument("--medusa-path", help="a Medusa checkpoint directory for the base model")
    ap.add_argument("--speculation", choices=("auto", "always"), default="auto",
                    help="auto: tree sizing + break-even guard (default); always: verify every tree whole")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    tok = loaded.tokenizer
    table = drafters(args, loaded)

    def run(spec, ids):
        name, options = spec
        options = dict(options)
        speculation = options.pop("speculation", args.speculation)
        drafter = name() if callable(name) else name
        return time_specdec(loaded, ids, args.max_new_tokens, drafter=drafter,
                            drafter_options=(options or None) if isinstance(name, str) else None,
                            speculation=speculation)

    warm = chat_ids(tok, "Hello!")
    for spec in table.values():
        run(spec, warm)
    report = {}
    for cat in args.categories.split(","):
        totals = {k: [0, 0.0, 0, 0] for k in table}  # tokens, seconds, steps, mismatching prompts
        for text in load_prompts(cat, args.prompts):
            ids = chat_ids(tok, text)
            ref = None
            for key, spec in table.items():
                seconds, out = run(spec, ids)
                ref = out.new_tokens[0] if ref is None else ref
                t = totals[key]
                t[0] += len(out.new_tokens[0])
                t[1] += seconds
                t[2] += out.stats[0].steps
                t[3] += out.new_tokens[0] != ref
        base = totals["plain"][0] / totals["plain"][1]
        print(f"\n{cat}: {'drafter':<22} {'tok/s':>8} {'vs plain':>9} {'tau':>6}")
        report[cat] = {}
        for key, (n, s, steps, bad) in totals.items():
            tps = n / s
            report[cat][key] = {"tokens_per_s": tps, "speedup": tps / base, "tau": n / max(steps, 1),
                                "mismatching_prompts": bad}
            print(f"{'':<14} {key:<22} {tps:8.2f} {tps / base:8.2f}x {n / max(steps, 1):6.2f}"
                  + (f"  ({bad} prompts differ from plain!)" if bad else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
