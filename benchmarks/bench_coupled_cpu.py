"""Coupled vs standard sampling on the embedded model (CPU, fp32): identity and tau per drafter.

    python benchmarks/bench_coupled_cpu.py --part identity --out runs/coupled   # 20 prompts x 128 tokens, T=0.8
    python benchmarks/bench_coupled_cpu.py --part tau --out runs/coupled        # tau table, T=0.8 and 1.0
    python benchmarks/bench_coupled_cpu.py --part tau --result tau.json         # ... also as a docs/results file

``identity``: plain coupled sampling of the prompts (one batch), then every drafter batched and one prompt
at a time, whole trees (``speculation="always"``); every divergence from plain coupled output is diagnosed
by the perturbed-logit gap at that position (recomputed with transformers' model): a gap below 1e-5 is a
numerical near-tie, anything else a real mismatch. ``tau``: committed tokens per target forward of every
drafter per category under standard rejection sampling and under coupled sampling, same prompts, same seed.
tau does not depend on wall time, so this part may run on a busy machine. The JSON is rewritten after every row, so
an interrupted run keeps what it measured; ``--result`` also writes the tau table as a docs/results file at the end
(a cell: tau standard / coupled).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import specdec.drafters.draft_model  # noqa: E402,F401 -- imported up front: the tree may change while this runs
import specdec.drafters.medusa  # noqa: E402,F401
import specdec.drafters.ngram  # noqa: E402,F401
import specdec.drafters.self_draft  # noqa: E402,F401
from common import (  # noqa: E402
    HelpWithDefaults,
    add_overwrite,
    chat_ids,
    check_categories,
    check_machine_class,
    check_new_files,
    check_positive,
    result_header,
    run_main,
)
from specdec.eval.divergence import greedy_identity  # noqa: E402
from specdec.eval.prompts import CATEGORIES, load_prompts  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402
from specdec.generate import generate  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402

DRAFTERS = ("ngram", "self-draft", "draft-model (itself)", "medusa (untrained)", "eagle (untrained)",
            "combined (ngram+self-draft)")


def drafters(loaded) -> dict:
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

    shape = loaded.runner.shape
    heads = MedusaHeads(MedusaConfig(3, 1, shape.hidden_size, shape.vocab_size))
    heads.init_lm_heads_from(loaded.runner.lm_head)  # untrained: a floor, not what training gives
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    torch.manual_seed(0)
    eagle = EagleModel(EagleConfig.for_target(loaded.model.config)).to(loaded.runner.dtype)
    eagle.init_from_target(loaded.model)  # untrained: identity only, its tau is a floor
    return dict(zip(DRAFTERS, (
        lambda: ("ngram", None),
        lambda: ("self-draft", None),
        lambda: ("draft-model", {"model": loaded, "num_draft_tokens": 3}),
        lambda: (MedusaDrafter(heads=heads, tree="dynamic", max_nodes=8), None),
        lambda: (EagleDrafter(model=eagle, max_nodes=8), None),
        lambda: ("combined", {"drafters": ["ngram", "self-draft"]}),
    ), strict=True))


def chosen_names(ap, args) -> list[str]:
    """--drafters' names (default: every one of DRAFTERS); unknown ones are a one-line ``ap.error``."""
    names = [n.strip() for n in args.drafters.split(",") if n.strip()] if args.drafters else list(DRAFTERS)
    unknown = [n for n in names if n not in DRAFTERS]
    if unknown:
        ap.error(f"--drafters: unknown {', '.join(map(repr, unknown))}; known: {', '.join(map(repr, DRAFTERS))}")
    return names


def chosen(loaded, args) -> dict:
    every = drafters(loaded)
    return {n: every[n] for n in args.drafters}


def identity_part(loaded, args, out: dict, save) -> None:
    per_cat = -(-args.identity_prompts // len(CATEGORIES))
    prompts = [chat_ids(loaded.tokenizer, t) for c in CATEGORIES for t in load_prompts(c, per_cat)]
    prompts = prompts[: args.identity_prompts]
    kw = dict(do_sample=True, temperature=args.identity_temperature, top_k=0, seed=args.seed, sampler="coupled")
    t0 = time.perf_counter()
    plain = generate(loaded, prompts, max_new_tokens=args.identity_tokens, **kw)
    print(f"plain coupled: {len(prompts)} prompts x {args.identity_tokens} tokens in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    out["identity"] = {"prompts": len(prompts), "tokens": args.identity_tokens, "sampling": kw, "rows": rows}
    for name, make in chosen(loaded, args).items():
        for batched in (True, False):
            drafter, options = make()
            t0 = time.perf_counter()
            res = greedy_identity(loaded, prompts, drafter, options, args.identity_tokens, batched, plain=plain,
                                  sampling=kw)
            row = {"drafter": name, "batched": batched, "tau": res.tau, "tokens": res.tokens_compared,
                   "identical": res.identical, "real_mismatches": res.real_mismatches,
                   "divergences": res.to_json()["divergences"], "seconds": time.perf_counter() - t0}
            rows.append(row)
            save()
            gaps = ", ".join(f"{d['gap']:.1e}" for d in row["divergences"]) or "-"
            print(f"{name:<22} {'batched' if batched else 'single ':<8} tau {res.tau:5.2f}  "
                  f"{'IDENTICAL' if res.identical else 'DIFFERS'}  real mismatches {res.real_mismatches}  "
                  f"divergence gaps {gaps}  ({row['seconds']:.0f} s)", flush=True)


def tau_part(loaded, args, out: dict, save) -> None:
    cats = args.categories
    prompts = {c: [chat_ids(loaded.tokenizer, t) for t in load_prompts(c, args.prompts)] for c in cats}
    rows = []
    out["tau"] = {"prompts_per_category": args.prompts, "max_new_tokens": args.max_new_tokens, "rows": rows}
    for temperature in args.temperatures:
        for name, make in chosen(loaded, args).items():
            for cat in cats:
                taus = {}
                for sampler in ("standard", "coupled"):
                    new = steps = 0
                    for ids in prompts[cat]:
                        drafter, options = make()
                        res = generate(loaded, [ids], max_new_tokens=args.max_new_tokens, drafter=drafter,
                                       drafter_options=options, do_sample=True, temperature=temperature, top_k=0,
                                       seed=args.seed, sampler=sampler, speculation="always", return_dict=True)
                        new += res.total_new_tokens
                        steps += sum(s.steps for s in res.stats)
                    taus[sampler] = new / max(steps, 1)
                rows.append({"temperature": temperature, "drafter": name, "category": cat, **taus})
                save()
                print(f"T={temperature} {name:<22} {cat:<14} tau standard {taus['standard']:5.2f}  "
                      f"coupled {taus['coupled']:5.2f}", flush=True)


def tau_result(args, loaded, tau: dict) -> dict:
    """The tau part (``out["tau"]``) as a docs/results file: a row per temperature and drafter, a column per
    category, each cell tau under standard / coupled sampling."""
    cells = {(r["temperature"], r["drafter"], r["category"]): f"{r['standard']:.2f} / {r['coupled']:.2f}"
             for r in tau["rows"]}
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    return {
        **result_header("bench_coupled_cpu.py", None, "coupled-tau",
                        "Seeded sampling: tau under standard and coupled sampling, same prompts and seed",
                        f"embedded model ({loaded.name}), {dtype}, seed {args.seed}, top-k off, every tree verified "
                        "whole"),
        "conditions": f"{tau['prompts_per_category']} prompt(s) per category x {tau['max_new_tokens']} new tokens, "
                      "each prompt alone; a cell is tau (committed tokens per target forward) under standard / "
                      "coupled sampling. tau counts tokens, not time.",
        "columns": ["drafter", "temperature", *args.categories],
        "rows": [[name, f"{t:g}", *(cells[(t, name, c)] for c in args.categories)]
                 for t in args.temperatures for name in args.drafters],
    }


def temperatures(ap, text: str) -> list[float]:
    """--temperatures as floats, each positive (the tau part samples), checked before any model loads."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        ap.error(f"--temperatures: comma-separated numbers, got {text!r}")
    if not all(v > 0 for v in values):  # also refuses nan
        ap.error(f"--temperatures: each must be positive (sampling), got {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--part", choices=("identity", "tau", "both"), default="both")
    ap.add_argument("--identity-prompts", type=int, default=20)
    ap.add_argument("--identity-tokens", type=int, default=128)
    ap.add_argument("--identity-temperature", type=float, default=0.8)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per category (tau)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (tau)")
    ap.add_argument("--temperatures", default="0.8,1.0")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--drafters", default="", help="comma list of the drafters to run (default: all)")
    ap.add_argument("--tag", default="", help="suffix of the output file name")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default="runs/coupled")
    ap.add_argument("--result", help="also write the tau table here as a docs/results file (--part tau)")
    add_overwrite(ap)
    args = ap.parse_args()
    check_positive(ap, args, "identity_prompts", "identity_tokens", "prompts", "max_new_tokens")
    args.categories = check_categories(ap, args.categories)
    args.temperatures = temperatures(ap, args.temperatures)
    args.drafters = chosen_names(ap, args)
    file = Path(args.out) / f"coupled-{args.part}{args.tag}.json"
    check_new_files(ap, args.overwrite, file, args.result)
    if args.result:
        if args.part != "tau":
            ap.error(f"--result: only with --part tau (got --part {args.part})")
        check_machine_class(ap, "--result")
    loaded = load_model(args.model)
    out: dict = {"model": loaded.name, "seed": args.seed}

    def save():  # after every row, atomically: a run stopped part way keeps the rows it finished
        write_json(file, out, indent=2)

    if args.part in ("identity", "both"):
        identity_part(loaded, args, out, save)
    if args.part in ("tau", "both"):
        tau_part(loaded, args, out, save)
    save()
    if args.result:
        write_json(args.result, tau_result(args, loaded, out["tau"]), indent=1)
    print(f"wrote {file}" + (f" and {args.result}" if args.result else ""))


if __name__ == "__main__":
    run_main(main)
