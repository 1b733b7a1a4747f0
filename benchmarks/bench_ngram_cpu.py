"""specdec + n-gram drafter vs transformers' greedy and prompt-lookup generate() (CPU).

    python benchmarks/bench_ngram_cpu.py --prompts 4 --max-new-tokens 128

Per category (summarisation of pydoc_data documents, HumanEval completion, open chat),
same prompts, same process, interleaved per prompt after a warm-up. Prints tokens/s of
each method, ratios against transformers' greedy generate() measured in the same run,
and tau (committed tokens per target forward) of specdec. Also checks that specdec's
greedy tokens equal transformers' greedy tokens.

On a CPU the prompt's prefill is compute-bound and costs the same in both libraries (a
1,500-token pydoc document takes ~3 s, as long as ~50 decode steps), so it caps the
end-to-end ratio of long-prompt categories. The second table therefore also reports the
decode phase alone: transformers' time-to-first-token is measured with max_new_tokens=1 on
the same prompt, specdec's is its own prefill time.
"""
from __future__ import annotations

import argparse
import json
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
    run_main,
    time_hf_generate,
    time_specdec,
)
from specdec.drafters.registry import get_drafter  # noqa: E402
from specdec.eval.prompts import load_prompts  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402
from specdec.errors import SpecdecError  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--categories", default="summarisation,code,chat")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    ap.add_argument("--drafter-options", default="{}", help="JSON options for the ngram drafter")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    add_overwrite(ap)
    args = ap.parse_args()
    check_positive(ap, args, "prompts", "max_new_tokens", "lookup_tokens")
    if args.max_new_tokens < 2:  # the decode-phase table times the tokens after the first
        ap.error(f"--max-new-tokens {args.max_new_tokens}: at least 2, the decode phase being the tokens after the "
                 "first")
    categories = check_categories(ap, args.categories)
    try:  # refused here, not by the first generate() after the model has loaded
        options = json.loads(args.drafter_options)
        if not isinstance(options, dict):
            ap.error(f"--drafter-options {args.drafter_options!r}: a JSON object of the ngram drafter's options is due")
        get_drafter("ngram", **options)
    except (json.JSONDecodeError, SpecdecError) as err:
        ap.error(f"--drafter-options {args.drafter_options!r}: {err}")
    check_new_files(ap, args.overwrite, args.json)
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    tok = loaded.tokenizer
    warm = chat_ids(tok, "Hello!")
    time_hf_generate(loaded.model, warm, 8)
    time_hf_generate(loaded.model, warm, 8, prompt_lookup_num_tokens=args.lookup_tokens)
    time_specdec(loaded, warm, 8, drafter="ngram", drafter_options=options)
    report = {}
    print(f"{'category':<14} {'hf greedy':>10} {'hf lookup':>10} {'specdec':>10} {'lookup/hf':>10} {'specdec/hf':>11} "
          f"{'specdec/lookup':>15} {'tau':>6}  (tok/s)")
    for cat in categories:
        tot = {"hf": [0, 0.0], "lookup": [0, 0.0], "specdec": [0, 0.0]}
        decode = {"hf": [0, 0.0], "specdec": [0, 0.0]}  # tokens after the first, seconds after prefill
        steps = 0
        mismatches = 0
        for text in load_prompts(cat, args.prompts):
            ids = chat_ids(tok, text)
            hf_s, hf_new = time_hf_generate(loaded.model, ids, args.max_new_tokens)
            lk_s, lk_new = time_hf_generate(loaded.model, ids, args.max_new_tokens,
                                            prompt_lookup_num_tokens=args.lookup_tokens)
            sd_s, out = time_specdec(loaded, ids, args.max_new_tokens, drafter="ngram", drafter_options=options)
            ttft_s, _ = time_hf_generate(loaded.model, ids, 1)
            decode["hf"][0] += len(hf_new) - 1
            decode["hf"][1] += hf_s - ttft_s
            decode["specdec"][0] += len(out.new_tokens[0]) - 1
            decode["specdec"][1] += sd_s - out.prefill_seconds
            mismatches += out.new_tokens[0] != hf_new
            steps += out.stats[0].steps
            for key, n, s in (("hf", len(hf_new), hf_s), ("lookup", len(lk_new), lk_s),
                              ("specdec", len(out.new_tokens[0]), sd_s)):
                tot[key][0] += n
                tot[key][1] += s
        tps = {k: n / s for k, (n, s) in tot.items()}
        dec = {k: n / s for k, (n, s) in decode.items()}
        tau = tot["specdec"][0] / max(steps, 1)
        report[cat] = {"tokens_per_s": tps, "tau": tau, "specdec_over_hf": tps["specdec"] / tps["hf"],
                       "specdec_over_lookup": tps["specdec"] / tps["lookup"], "greedy_mismatches": mismatches,
                       "decode_tokens_per_s": dec, "decode_specdec_over_hf": dec["specdec"] / dec["hf"]}
        print(f"{cat:<14} {tps['hf']:10.2f} {tps['lookup']:10.2f} {tps['specdec']:10.2f} "
              f"{tps['lookup'] / tps['hf']:9.2f}x {tps['specdec'] / tps['hf']:10.2f}x "
              f"{tps['specdec'] / tps['lookup']:14.2f}x {tau:6.2f}"
              + (f"  ({mismatches} prompts differ!)" if mismatches else ""))
    print(f"\ndecode phase only (prefill excluded): {'category':<14} {'hf greedy':>10} {'specdec':>10} {'ratio':>7}")
    for cat, r in report.items():
        d = r["decode_tokens_per_s"]
        print(f"{'':38}{cat:<14} {d['hf']:10.2f} {d['specdec']:10.2f} {r['decode_specdec_over_hf']:6.2f}x")
    if args.json:
        write_json(args.json, report, indent=2)


if __name__ == "__main__":
    run_main(main)
