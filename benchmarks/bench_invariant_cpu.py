"""The bit-exact mode on the CPU: divergences from plain decoding with and without it, and what it costs.

    python benchmarks/bench_invariant_cpu.py --dtype bfloat16 --prompts 20 --tokens 128 --out docs/results/raw/x.json
    python benchmarks/bench_invariant_cpu.py --setting coupled        # T=0.8, sampler="coupled"

For each mode (default, invariant=True) plain decoding of each prompt alone is the reference. Every drafter then
decodes the prompts in ragged batches of ``--batch`` and ``--alone`` of them one at a time; every output whose
tokens or log-probability bits part from plain's is a divergence, reported at its first token with the logit gap
of the model there (top-1 minus top-2, transformers' forward in the same dtype). Speed: plain and n-gram, each
prompt alone, the two modes interleaved prompt by prompt after an untimed warm-up of each; only same-run ratios are
printed. The JSON is rewritten after every cell, so an interrupted run keeps what it measured.

Medusa and EAGLE run trained heads when ``--medusa-path`` / ``--eagle-path`` name checkpoints (the quick recipes'),
else untrained ones (heads initialised from the LM head, the layer from the target's last layer): identity needs
any drafter that proposes, but trained heads get more of their trees accepted. All batched cells run before the
alone ones, so a run cut short still covers every drafter.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    add_overwrite,
    chat_ids,
    check_new_files,
    check_positive,
    cpu_features,
    cpu_name,
    run_main,
)

from specdec.atomic_write import write_text  # noqa: E402

DRAFTERS = ("ngram", "self-draft", "draft-model", "medusa", "eagle")  # drafters()' labels' first words


def drafters(loaded, medusa_path=None, eagle_path=None):
    from specdec.drafters.eagle import EagleDrafter
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

    model = loaded.model
    dtype = model.dtype

    def medusa():
        if medusa_path:
            return MedusaDrafter(path=medusa_path, tree="dynamic", max_nodes=8), None
        heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, model.config.vocab_size))
        heads.init_lm_heads_from(model.get_output_embeddings().weight.detach().float())
        return MedusaDrafter(heads=heads.to(dtype), tree="dynamic", max_nodes=8), None

    def eagle():
        if eagle_path:
            return EagleDrafter(path=eagle_path, depth=3, top_k=3, max_nodes=8), None
        torch.manual_seed(0)
        layer = EagleModel(EagleConfig.for_target(model.config))
        layer.init_from_target(model)
        return EagleDrafter(model=layer.to(dtype), depth=3, top_k=3, max_nodes=8), None

    return {
        "ngram": lambda: ("ngram", None),
        "self-draft": lambda: ("self-draft", None),
        "draft-model (itself)": lambda: ("draft-model", {"model": loaded, "num_draft_tokens": 3}),
        "medusa (trained)" if medusa_path else "medusa (untrained)": medusa,
        "eagle (trained)" if eagle_path else "eagle (untrained)": eagle,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpWithDefaults)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="ragged batch size of the batched runs")
    ap.add_argument("--alone", type=int, default=2, help="prompts also decoded one at a time by each drafter")
    ap.add_argument("--setting", choices=("greedy", "coupled"), default="greedy")
    ap.add_argument("--drafters", default="ngram,self-draft,draft-model,medusa,eagle",
                    help="comma-separated drafter names (a label's first word)")
    ap.add_argument("--default-drafters", default="ngram,self-draft",
                    help="drafters also run on the default path (its divergences)")
    ap.add_argument("--medusa-path", default=None, help="trained Medusa heads (else untrained ones)")
    ap.add_argument("--eagle-path", default=None, help="a trained EAGLE checkpoint (else an untrained layer)")
    ap.add_argument("--machine", default=None, help="the machine, in words, for the JSON (default: this CPU's name)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_positive(ap, args, "prompts", "tokens", "batch", "alone", "threads")
    for option, names in (("--drafters", args.drafters), ("--default-drafters", args.default_drafters)):
        unknown = [n.strip() for n in names.split(",") if n.strip() and n.split()[0] not in DRAFTERS]
        if unknown:
            ap.error(f"{option}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(DRAFTERS)}")
    check_new_files(ap, args.overwrite, args.out)
    machine = args.machine or f"{cpu_name()} ({cpu_features()}), {args.threads} torch thread(s)"
    torch.set_num_threads(args.threads)

    from specdec.eval.bitwise_level import bitwise_identity, plain_outputs
    from specdec.eval.prompts import load_prompts

    from specdec.generate import generate
    from specdec.models.embedded import DEFAULT_ALIAS
    from specdec.models.loader import load_model

    loaded = load_model(DEFAULT_ALIAS, dtype=getattr(torch, args.dtype))
    prompts = [chat_ids(loaded.tokenizer, t) for t in load_prompts("chat", args.prompts)]
    coupled = args.setting == "coupled"
    sampling = dict(do_sample=True, temperature=0.8, top_k=0, seed=0, sampler="coupled") if coupled else {}
    table = drafters(loaded, args.medusa_path, args.eagle_path)
    result = {"model": loaded.name, "dtype": args.dtype, "setting": args.setting, "prompts": len(prompts),
              "tokens": args.tokens, "batch": args.batch, "threads": args.threads,
              "machine": machine, "medusa_path": args.medusa_path, "eagle_path": args.eagle_path, "cells": []}
    out = Path(args.out) if args.out else None

    def save():  # atomically: a run stopped while it writes keeps the file of the cell before
        if out is not None:
            write_text(out, json.dumps(result, indent=1, default=str))

    # plain decoding, each prompt alone: the reference of each mode, and the speed of plain / n-gram
    plain = {False: [], True: []}
    speed = {"plain": {False: 0.0, True: 0.0}, "ngram": {False: 0.0, True: 0.0}}
    tokens_done = {False: 0, True: 0}
    warm = chat_ids(loaded.tokenizer, "Hello!")
    for invariant in (False, True):  # untimed warm-up: one-time setup (calibrations) stays out of the timed calls
        plain_outputs(loaded, [warm], args.tokens, invariant, sampling)
        if args.setting == "greedy":
            generate(loaded, [warm], max_new_tokens=args.tokens, drafter="ngram", invariant=invariant)
    for i, p in enumerate(prompts):
        for invariant in (False, True) if i % 2 == 0 else (True, False):  # order alternates: drift hits both
            t0 = time.perf_counter()
            plain[invariant] += plain_outputs(loaded, [p], args.tokens, invariant, sampling)
            speed["plain"][invariant] += time.perf_counter() - t0
            tokens_done[invariant] += len(plain[invariant][-1][0])
        if args.setting == "greedy":
            for invariant in (True, False) if i % 2 == 0 else (False, True):
                t0 = time.perf_counter()
                generate(loaded, [p], max_new_tokens=args.tokens, drafter="ngram", invariant=invariant)
                speed["ngram"][invariant] += time.perf_counter() - t0
        print(f"prompt {i}: plain {speed['plain'][False]:.0f} s default, {speed['plain'][True]:.0f} s invariant",
              file=sys.stderr, flush=True)
    result["speed_seconds"] = {k: {"default": v[False], "invariant": v[True]} for k, v in speed.items()}
    result["speed_ratio_invariant_over_default"] = {k: v[True] / v[False] for k, v in speed.items() if v[False]}
    result["plain_identical_across_modes"] = sum(a == b for a, b in zip(plain[False], plain[True], strict=True))
    save()

    def label(name):  # "medusa" -> "medusa (trained)" (names checked against DRAFTERS above)
        return next(k for k in table if k.split()[0] == name.split()[0])

    names = [label(n.strip()) for n in args.drafters.split(",") if n.strip()]
    default_names = {label(n.strip()) for n in args.default_drafters.split(",") if n.strip()}
    runs = [(name, invariant, batched) for batched in (True, False) for name in names for invariant in (True, False)
            if invariant or name in default_names]
    for name, invariant, batched in runs:
        count = len(prompts) if batched else min(args.alone, len(prompts))
        divergences, compared, taus = [], 0, []
        for start in range(0, count, args.batch if batched else 1):
            chunk = list(range(start, min(count, start + (args.batch if batched else 1))))
            drafter, options = table[name]()
            r = bitwise_identity(loaded, [prompts[i] for i in chunk], drafter, options, args.tokens, True,
                                 invariant, [plain[invariant][i] for i in chunk], sampling)
            compared += r.tokens_compared
            taus.append(r.tau)
            for d in r.divergences:
                divergences.append(dict(d.__dict__, prompt=chunk[d.prompt]))
        cell = {"drafter": name, "mode": "invariant" if invariant else "default",
                "run": f"batched ({args.batch})" if batched else "alone", "outputs": count,
                "tokens_compared": compared, "tau": sum(taus) / len(taus),
                "divergent_outputs": len(divergences),
                "text_divergences": sum(d["text_position"] is not None for d in divergences),
                "divergences": divergences}
        result["cells"].append(cell)
        save()
        print(f"{name:<22} {cell['mode']:<9} {cell['run']:<12} tau {cell['tau']:.2f}: "
              f"{cell['divergent_outputs']}/{count} outputs differ ({cell['text_divergences']} in text)",
              flush=True)
        for d in divergences:
            gap = "" if d["gap"] is None else f" logit gap {d['gap']:.3g}"
            lp = "" if d["logprob_delta"] != d["logprob_delta"] else f" log-prob delta {d['logprob_delta']:.3g}"
            text = "" if d["text_position"] is None else f"; text from token {d['text_position']}" + (
                "" if d["text_gap"] is None else f" (logit gap {d['text_gap']:.3g})")
            print(f"    prompt {d['prompt']} token {d['position']}:{gap}{lp}{text}", flush=True)
    for k, v in result["speed_ratio_invariant_over_default"].items():
        print(f"{k}: invariant / default time = {v:.2f}x (same run, each prompt alone; machine shared)")
    print(f"plain outputs identical across the two modes: {result['plain_identical_across_modes']}/{len(prompts)}")
    save()
    return 0


if __name__ == "__main__":
    run_main(main)
