"""Cost of one target verify step vs the number of tokens in it (root + tree nodes), CPU.

    python benchmarks/bench_verify_cost.py [--context 600] [--reps 9]

Prints the median time of a verify step of 1..16 tokens on the embedded model, and its ratio to the
1-token decode step measured in the same run. This ratio is what decides how large a draft tree pays off on
a given machine. The steps are timed by :func:`specdec.verify_cost.measure_verify_costs`, the same
measurement the cost model calibrates with: rounds over every size, interleaved (the first a warm-up), so a
machine that slows down for a few seconds hits every size alike.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import HelpWithDefaults, run_main  # noqa: E402

from specdec.cost_model import ensure_row_policy  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.sampling import SamplingConfig  # noqa: E402
from specdec.verify_cost import calibration_need, measure_verify_costs  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--sizes", default="1,2,3,4,5,6,8,12,16")
    args = ap.parse_args(argv)
    try:
        sizes = sorted({int(x) for x in args.sizes.split(",")})
    except ValueError:
        ap.error(f"--sizes: comma-separated integers, got {args.sizes!r}")
    if min(sizes) < 1 or args.context < 1 or args.reps < 1:
        ap.error("--sizes, --context and --reps must be positive")
    torch.set_grad_enabled(False)
    loaded = load_model("default")
    added = calibration_need([1, *sizes], args.reps) - 1  # the positions measure_verify_costs adds to a context
    room = loaded.runner.shape.max_positions - added
    if args.context > room:  # measure_verify_costs would time a shorter context than the one printed
        ap.error(f"--context {args.context}: the model holds {loaded.runner.shape.max_positions} positions, and "
                 f"--reps {args.reps} over --sizes {args.sizes} add {added}: at most {max(room, 0)}")
    ensure_row_policy(loaded.runner)  # linear()'s measured CPU row policy, as every engine built by generate() runs
    times = measure_verify_costs(loaded.runner, [list(range(100, 100 + args.context))], [1, *sizes], SamplingConfig(),
                                 repeats=args.reps)
    base = times[1] * 1000
    print(f"context {args.context}: 1-token step {base:.1f} ms (median of {args.reps}, sizes interleaved)")
    for n in sizes:
        ms = times[n] * 1000
        print(f"  {n:3d} tokens: {ms:7.1f} ms  = {ms / base:4.2f}x a decode step")


if __name__ == "__main__":
    run_main(main)
