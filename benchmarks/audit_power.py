"""How many draft nodes the draft audit (specdec/audit.py) needs to stop a drafter that samples from one law and
reports another: a simulation, seeded, so a count and not a time.

    python benchmarks/audit_power.py                       # print the table
    python benchmarks/audit_power.py --out audit.json      # ... and write it as a docs/results file

Each simulated node has logits of its own (``--vocab`` standard normals times ``--scale``: a model's most likely
tokens change with the context); the liar draws the node's token from the first law of a row and reports the
second as its ``draft_probs``. Nodes go to :meth:`DraftAudit.observe_many` ``--batch`` at a time, as one step's
one-level trees (the audit stops at the node that crossed, wherever it sits in a step), until the audit raises or
``--max-nodes``. Each
row runs ``--seeds`` seeds (the liar's and the audit's generator); the table gives the fewest and most nodes, and
the mean Kullback-Leibler divergence per node of the sampled law from the reported one with ln(1/alpha) / KL, the
fewest nodes any test can expect to need (docs/sampling.md). Deterministic for given options on one machine.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HelpWithDefaults,
    add_overwrite,
    check_machine_class,
    check_new_files,
    check_positive,
    result_header,
    run_main,
)

from specdec.atomic_write import write_json  # noqa: E402
from specdec.audit import DraftAudit  # noqa: E402
from specdec.tree import MAX_TREE_NODES, DraftError, DraftMode, DraftTree  # noqa: E402

TITLE = "Draft audit: draft nodes until a lying drafter is stopped (simulation)"


def temperature(t: float):
    return lambda logits: torch.softmax(logits / t, -1)


def top_k(k: int):
    def law(logits):
        kept = logits.topk(k, -1)
        return torch.zeros_like(logits).scatter_(-1, kept.indices, torch.softmax(kept.values, -1))
    return law


def top_p(p: float):
    def law(logits):
        probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
        keep = (probs.cumsum(-1) - probs) < p  # the smallest head holding p, its last token included
        probs = probs * keep
        return torch.zeros_like(probs).scatter_(-1, order, probs / probs.sum(-1, keepdim=True))
    return law


def fixed_token(logits):
    return torch.zeros_like(logits).index_fill_(-1, torch.tensor([0]), 1.0)


def uniform(logits):
    return torch.full_like(logits, 1.0 / logits.shape[-1])


# (the drafter samples from ..., but reports ..., sampled law, reported law)
ROWS = [
    ("one fixed token", "the uniform law", fixed_token, uniform),
    ("temperature 0.3", "temperature 1", temperature(0.3), temperature(1.0)),
    ("temperature 0.5", "temperature 1", temperature(0.5), temperature(1.0)),
    ("temperature 0.7", "temperature 1", temperature(0.7), temperature(1.0)),
    ("temperature 0.9", "temperature 1", temperature(0.9), temperature(1.0)),
    ("temperature 1.5", "temperature 1", temperature(1.5), temperature(1.0)),
    ("top-k 100", "no top-k", top_k(100), temperature(1.0)),
    ("top-k 400", "no top-k", top_k(400), temperature(1.0)),
    ("top-p 0.9", "no top-p", top_p(0.9), temperature(1.0)),
    ("top-p 0.99", "no top-p", top_p(0.99), temperature(1.0)),
]


def kl(sampled: torch.Tensor, reported: torch.Tensor) -> torch.Tensor:
    """KL(sampled || reported) per row, in nats (0 log 0 = 0)."""
    ratio = torch.where(sampled > 0, sampled / reported, torch.ones_like(sampled))
    return (sampled * ratio.log()).sum(-1)


def nodes_until_stopped(sample_law, report_law, seed: int, args) -> tuple[int | None, float]:
    """(nodes the audit saw when it raised, or None if it did not within args.max_nodes; mean KL per node)."""
    gen = torch.Generator().manual_seed(seed)
    audit = DraftAudit(seed=seed)
    divergence, seen = 0.0, 0
    while seen < args.max_nodes:
        n = min(args.batch, args.max_nodes - seen)
        logits = torch.randn(n, args.vocab, generator=gen) * args.scale
        sampled, reported = sample_law(logits), report_law(logits)
        tokens = torch.multinomial(sampled, 1, generator=gen)[:, 0]
        divergence += float(kl(sampled.double(), reported.double()).sum())
        seen += n
        try:
            parts = zip(tokens.split(MAX_TREE_NODES), reported.split(MAX_TREE_NODES), strict=True)
            audit.observe_many([DraftTree(t, [-1] * len(t), r, DraftMode.INDEPENDENT) for t, r in parts], "liar")
        except DraftError:
            return audit.draws, divergence / seen
    return None, divergence / seen


def span(counts: list[int | None], limit: int) -> str:
    if any(c is None for c in counts):
        return f"not within {limit:,}"
    low, high = min(counts), max(counts)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--seeds", type=int, default=5, help="runs per row (seeds 0, 1, ...)")
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--scale", type=float, default=2.0, help="the logits' standard deviation")
    ap.add_argument("--batch", type=int, default=500, help="nodes per observed tree")
    ap.add_argument("--max-nodes", type=int, default=30_000, help="give up on a seed after this many nodes")
    ap.add_argument("--out", help="also write the table here as a docs/results file")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    check_positive(ap, args, "seeds", "vocab", "batch", "max_nodes")
    if not args.scale > 0:
        ap.error(f"--scale {args.scale}: must be > 0")
    if args.vocab < 401:
        ap.error(f"--vocab {args.vocab}: the top-k 400 row needs at least 401 tokens")
    if args.out:
        check_machine_class(ap, "--out")
        check_new_files(ap, args.overwrite, args.out)
    threshold = math.log(1 / DraftAudit().alpha)
    columns = ["the drafter samples from ... but reports ...", "KL per node", "ln(10^6) / KL", "draft nodes"]
    rows = []
    for sample_name, report_name, sample_law, report_law in ROWS:
        runs = [nodes_until_stopped(sample_law, report_law, seed, args) for seed in range(args.seeds)]
        divergence = sum(d for _, d in runs) / len(runs)
        rows.append([f"{sample_name} / {report_name}", f"{divergence:.3g}", f"{threshold / divergence:,.0f}",
                     span([n for n, _ in runs], args.max_nodes)])
        print(" | ".join(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {
            **result_header("audit_power.py", argv, "audit-power", TITLE, "a simulation, no model"),
            "conditions": f"{args.vocab}-token vocabulary, logits of each node N(0, {args.scale:g}^2), "
                          f"{args.seeds} seeds per row (the fewest and most draft nodes), alpha = 1e-6, batches "
                          f"of {args.batch} nodes, at most {args.max_nodes:,} nodes. KL: the mean per node of the "
                          "sampled law from the reported one; ln(10^6) / KL: the fewest nodes a test can expect.",
            "columns": columns,
            "rows": rows,
        }, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
