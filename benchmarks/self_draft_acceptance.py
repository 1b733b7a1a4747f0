"""How often an untrained early exit (self-draft: the target's first N layers, its final norm and LM head) drafts
the full model's next token: acceptance at depth 1 per layer count, greedy, a count and not a time.

    python benchmarks/self_draft_acceptance.py                              # 4, 8, 12, 18, 24, 29 layers
    python benchmarks/self_draft_acceptance.py --layers 4,29 --out acc.json # ... as a docs/results file

Every prompt of ``--category`` is decoded greedily with ``drafter="self-draft"`` drafting one token a step and every
draft verified (``speculation="always"``, so the break-even guard leaves nothing out); a row is the draft tokens
the target accepted over those it verified, summed over the prompts. Greedy output is the target's own, so every
row sees the same answers. Deterministic for given options on one machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    add_overwrite,
    chat_ids,
    check_machine_class,
    check_new_files,
    check_positive,
    result_header,
    run_main,
)
from specdec.eval.prompts import CATEGORIES, load_prompts  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402

TITLE = "Self-draft: how often an untrained early exit drafts the full model's next token"


def layer_counts(ap, text: str) -> list[int]:
    """--layers as positive integers, checked before any model loads."""
    try:
        values = [int(n) for n in text.split(",")]
    except ValueError:
        ap.error(f"--layers: comma-separated layer counts, got {text!r}")
    if not all(v >= 1 for v in values):
        ap.error(f"--layers: each must be >= 1, got {text!r}")
    return values


def acceptance(loaded, prompts: list[list[int]], num_layers: int, max_new_tokens: int) -> tuple[int, int]:
    """(draft tokens accepted, draft tokens verified) of self-draft at ``num_layers`` over ``prompts``."""
    accepted = tried = 0
    for ids in prompts:
        res = generate(loaded, [ids], max_new_tokens=max_new_tokens, drafter="self-draft",
                       drafter_options={"num_layers": num_layers, "num_draft_tokens": 1}, speculation="always",
                       return_dict=True)
        for s in res.stats:
            accepted += s.depth_accepted[0] if s.depth_accepted else 0
            tried += s.depth_tried[0] if s.depth_tried else 0
    return accepted, tried


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--layers", default="4,8,12,18,24,29", help="the layer counts N to draft with")
    ap.add_argument("--category", default="chat", choices=CATEGORIES)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", help="also write the table here as a docs/results file")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_positive(ap, args, "prompts", "max_new_tokens")
    layers = layer_counts(ap, args.layers)
    if args.out:
        check_machine_class(ap, "--out")
        check_new_files(ap, args.overwrite, args.out)
    loaded = load_model(args.model)
    prompts = [chat_ids(loaded.tokenizer, t) for t in load_prompts(args.category, args.prompts)]
    rows = []
    for n in layers:
        accepted, tried = acceptance(loaded, prompts, n, args.max_new_tokens)
        rows.append([str(n), f"{100 * accepted / max(tried, 1):.0f}%", f"{accepted:,} / {tried:,}"])
        print(" | ".join(rows[-1]), flush=True)
    if args.out:
        total = loaded.runner.shape.num_layers
        dtype = str(loaded.model.dtype).removeprefix("torch.")
        write_json(args.out, {
            **result_header("self_draft_acceptance.py", argv, "self-draft-acceptance", TITLE,
                            f"{loaded.name} ({total} layers), {dtype}, greedy"),
            "conditions": f"{args.prompts} {args.category} prompt(s) x {args.max_new_tokens} new tokens, one draft "
                          "token a step, every draft verified (speculation=\"always\"); acceptance: draft tokens "
                          "the target accepted over those it verified. Counts, not times.",
            "columns": ["layers N", "acceptance at depth 1", "accepted / verified"],
            "rows": rows,
        }, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
