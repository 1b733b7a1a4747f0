"""Medusa heads over the full vs a reduced draft vocabulary on the embedded model (CPU): draft cost and speed.

    python benchmarks/bench_medusa_vocab_cpu.py --prompts 3 --max-new-tokens 64
    python benchmarks/bench_medusa_vocab_cpu.py --full-path heads/ --reduced-path heads-4k/   # trained heads
    python benchmarks/bench_medusa_vocab_cpu.py --draft-vocab 1024 --self-draft               # + self-draft

Without checkpoints both head sets are built here, untrained, the way training starts them:
3 heads, 1 zero residual block each, LM heads copied from the target's (all 49,152 rows, or the
rows of the ``--draft-vocab`` most frequent tokens of the built-in training prompts, see
drafters/vocab_sources.py). Untrained heads guess poorly, so tau says little; the point is the
per-step draft cost, which is what the reduced vocabulary changes (identical for trained heads of
the same shape). Chat prompts (held out from training), greedy, one prompt at a time, every
drafter interleaved per prompt after a warm-up, all in one process. Prints tokens/s, the ratio
against specdec's plain decoding timed in the same run, tau, draft ms per step, and checks that
every drafter's tokens equal plain decoding's.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    add_overwrite,
    chat_ids,
    check_new_files,
    check_positive,
    run_main,
    time_specdec,
)
from specdec.drafters.medusa import MedusaDrafter  # noqa: E402
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads, load_medusa  # noqa: E402
from specdec.drafters.vocab_sources import builtin_prompt_tokens  # noqa: E402
from specdec.eval.prompts import load_prompts  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402
from specdec.generation_config import GenerationConfig  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402


def untrained_heads(loaded, ids=()) -> MedusaHeads:
    shape = loaded.runner.shape
    heads = MedusaHeads(MedusaConfig(3, 1, shape.hidden_size, shape.vocab_size, draft_vocab=tuple(ids)))
    heads.init_lm_heads_from(loaded.runner.lm_head.detach())
    return heads.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--prompts", type=int, default=3, help="chat prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--draft-vocab", type=int, default=4096, help="size of the reduced vocabulary (built heads)")
    ap.add_argument("--full-path", help="a full-vocabulary Medusa checkpoint instead of built heads")
    ap.add_argument("--reduced-path", help="a reduced-vocabulary Medusa checkpoint instead of built heads")
    ap.add_argument("--max-nodes", type=int, default=8, help="dynamic tree node budget")
    ap.add_argument("--self-draft", action="store_true", help="also self-draft (4 layers), full vs reduced")
    ap.add_argument("--speculation", default="always", choices=("always", "auto"),
                    help="generate(speculation=...) where supported: 'always' verifies every tree (draft cost "
                         "measured each step), 'auto' lets the cost guard skip drafts that do not pay")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    add_overwrite(ap)
    args = ap.parse_args()
    check_positive(ap, args, "prompts", "max_new_tokens", "draft_vocab", "max_nodes")
    check_new_files(ap, args.overwrite, args.json)
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    tok = loaded.tokenizer
    ids = builtin_prompt_tokens(tok, args.draft_vocab)
    full = load_medusa(args.full_path) if args.full_path else untrained_heads(loaded)
    reduced = load_medusa(args.reduced_path) if args.reduced_path else untrained_heads(loaded, ids)
    n_reduced = reduced.config.draft_size
    table = {
        "plain": lambda: None,
        f"medusa full ({full.config.draft_size})": lambda: MedusaDrafter(heads=full, tree="dynamic",
                                                                          max_nodes=args.max_nodes),
        f"medusa reduced ({n_reduced})": lambda: MedusaDrafter(heads=reduced, tree="dynamic",
                                                                max_nodes=args.max_nodes),
    }
    if args.self_draft:
        from specdec.drafters.self_draft import SelfDraftDrafter

        table["self-draft full"] = lambda: SelfDraftDrafter()
        table[f"self-draft reduced ({len(ids)})"] = lambda: SelfDraftDrafter(draft_vocab=ids)
    field_names = {f.name for f in dataclasses.fields(GenerationConfig)}
    extra = {"speculation": args.speculation} if "speculation" in field_names else {}

    def run(make, prompt_ids):
        return time_specdec(loaded, prompt_ids, args.max_new_tokens, drafter=make(), **extra)

    for make in table.values():  # warm-up
        run(make, chat_ids(tok, "Hello!"))
    totals = {k: dict(tokens=0, seconds=0.0, steps=0, draft_s=0.0, differ=0) for k in table}
    for text in load_prompts("chat", args.prompts):
        prompt_ids, ref = chat_ids(tok, text), None
        for key, make in table.items():
            seconds, out = run(make, prompt_ids)
            ref = out.new_tokens[0] if ref is None else ref
            t = totals[key]
            t["tokens"] += len(out.new_tokens[0])
            t["seconds"] += seconds
            t["steps"] += out.stats[0].steps
            t["draft_s"] += out.draft_seconds
            t["differ"] += out.new_tokens[0] != ref
    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    print(f"chat, {args.prompts} prompts x {args.max_new_tokens} tokens, greedy, {torch.get_num_threads()} threads"
          f"{', speculation=' + args.speculation if extra else ''}")
    print(f"{'drafter':<28} {'tok/s':>8} {'vs plain':>9} {'tau':>6} {'draft ms/step':>14}")
    report = {}
    for key, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        row = {"tokens_per_s": tps, "vs_plain": tps / base, "tau": t["tokens"] / max(1, t["steps"]),
               "draft_ms_per_step": 1e3 * t["draft_s"] / max(1, t["steps"]), "prompts_differing": t["differ"]}
        report[key] = row
        print(f"{key:<28} {tps:8.2f} {row['vs_plain']:8.2f}x {row['tau']:6.2f} {row['draft_ms_per_step']:14.2f}"
              + (f"  ({t['differ']} prompts differ from plain!)" if t["differ"] else ""))
    if args.json:
        write_json(args.json, report, indent=2)  # its folder made, as check_new_files promised


if __name__ == "__main__":
    run_main(main)
