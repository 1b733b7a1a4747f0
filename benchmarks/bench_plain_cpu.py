"""specdec plain decoding vs transformers' greedy generate() on the embedded model (CPU).

    python benchmarks/bench_plain_cpu.py --prompts 6 --max-new-tokens 64

Same prompts, same process, interleaved per prompt after a warm-up, so machine noise hits
both sides alike. Prints tokens/s of each and the ratio (>1 = specdec faster), and checks
the greedy tokens are identical.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    chat_ids,
    check_categories,
    check_positive,
    ratio_line,
    run_main,
    time_hf_generate,
    time_specdec,
)
from specdec.eval.prompts import load_prompts  # noqa: E402

from specdec.models.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--categories", default="chat,code,summarisation")
    args = ap.parse_args()
    check_positive(ap, args, "prompts", "max_new_tokens")
    categories = check_categories(ap, args.categories)
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    tok = loaded.tokenizer
    warm = chat_ids(tok, "Hello!")
    time_hf_generate(loaded.model, warm, 8)
    time_specdec(loaded, warm, 8)
    total = {"hf": [0, 0.0], "specdec": [0, 0.0]}
    for cat in categories:
        cat_tot = {"hf": [0, 0.0], "specdec": [0, 0.0]}
        for text in load_prompts(cat, args.prompts):
            ids = chat_ids(tok, text)
            hf_s, hf_new = time_hf_generate(loaded.model, ids, args.max_new_tokens)
            sd_s, out = time_specdec(loaded, ids, args.max_new_tokens)
            if out.new_tokens[0] != hf_new:
                print(f"  WARNING: tokens differ on a {cat} prompt", file=sys.stderr)
            for key, n, s in (("hf", len(hf_new), hf_s), ("specdec", len(out.new_tokens[0]), sd_s)):
                cat_tot[key][0] += n
                cat_tot[key][1] += s
                total[key][0] += n
                total[key][1] += s
        print(ratio_line(f"{cat} specdec plain", *cat_tot["hf"], *cat_tot["specdec"]))
    print(ratio_line("ALL specdec plain", *total["hf"], *total["specdec"]))


if __name__ == "__main__":
    run_main(main)
