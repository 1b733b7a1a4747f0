"""The GPU goals (docs/gpu-speed.md, "Goals") judged from one gpu_check.py report: each is met, missed or not measured.

    rows = goals(report["steps"])   # what, goal, measured, verdict: gpu_check.py writes them first

Every number comes from a step of the same report: ``speed`` (bench_speed_gpu.py: plain decoding against the
weight-read floor, the verify-cost curve, the oracle rows), ``acceptance`` (``specdec eval acceptance`` with n-gram
on the embedded model), ``tests`` / ``identity`` (the CUDA test cases) and ``e2e`` (bf16 divergences classified).
A goal whose step did not run, or whose row was skipped, is "not measured", never met. In a CPU rehearsal the
shapes are tiny and the verdicts check the report's plumbing only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

TARGET = "synthetic:llama-3.1-8b"  # the 8B shape the goals name (its @tiny version in a rehearsal)
EMBEDDED = "default"
TAU = 3.0


@dataclass(frozen=True)
class Goal:
    what: str
    goal: str
    measured: str  # "" when not measured
    verdict: str  # "met", "missed" or "not measured"


def _judge(what: str, goal: str, value: float | None, ok, shown: str) -> Goal:
    if value is None:
        return Goal(what, goal, "", "not measured")
    return Goal(what, goal, shown, "met" if ok(value) else "missed")


def _model(speed: dict, name: str) -> dict | None:
    models = (speed.get("report") or {}).get("models", [])
    return next((m for m in models if m["model"] == name or m["model"].startswith(name + "@")), None)


def _speed_goals(speed: dict) -> list[Goal]:
    target, embedded = _model(speed, TARGET), _model(speed, EMBEDDED)
    plain = ((target or {}).get("plain") or {}).get("1")
    rows = (target or {}).get("oracle") or []
    chains = [r for r in rows if r["shape"] == "chain" and r["batch"] == 1 and r["eagle"] and r["tau_target"] == TAU
              and r.get("speculation", "always") == "always"]
    chain = max(chains, key=lambda r: r["speedup"], default=None)  # the depth is the drafter's choice: its best
    ratio = ((target or {}).get("verify_cost") or {}).get("ratio") or {}
    c65 = ratio.get("65", ratio.get(65))  # the root and a 64-node tree
    p = ((target or {}).get("products") or {}).get("ms") or {}  # the products alone (products_curve.py)
    p1, p65 = p.get("1", p.get(1)), p.get("65", p.get(65))
    p65 = f" (products alone {p65 / p1:.2f})" if p1 and p65 else ""
    big = [r["speedup"] for r in rows if r["batch"] == 32 and r.get("speculation") == "auto"]
    small = ((embedded or {}).get("plain") or {}).get("1")
    stand_in = f" ({embedded['note'].rsplit(': ', 1)[-1]} stood in)" if embedded and embedded.get("note") else ""
    return [
        _judge("8B shape, batch 1, plain decoding: step / weight-read floor", "<= 1.15",
               plain and plain["step_over_floor"], lambda v: v <= 1.15,
               plain and f"{plain['step_over_floor']:.2f} ({plain['decode_tokens_per_s']:.0f} tok/s, floor "
                         f"{plain['floor_tokens_per_s']:.0f})"),
        _judge(f"8B shape, batch 1, oracle chain at tau {TAU:g} with EAGLE's drafting: speedup over plain", ">= 2.4x",
               chain and chain["speedup"], lambda v: v >= 2.4,
               chain and _chain_text(chain)),
        _judge("8B shape: verify of a 64-node tree (65 query tokens) / of one, c(65) / c(1)", "<= 1.25", c65,
               lambda v: v <= 1.25, c65 is not None and f"{c65:.2f}{p65}"),
        _judge("8B shape, batch 32, default policy (speculation=\"auto\"): speculation over plain, every oracle row",
               ">= 0.97x, the lowest",
               min(big) if big else None, lambda v: v >= 0.97,
               big and f"{min(big):.2f}x lowest of {len(big)} rows"),
        _judge(f"embedded model, batch 1, default settings: plain decoding{stand_in}", ">= 1,000 tok/s",
               small and small["decode_tokens_per_s"], lambda v: v >= 1000,
               small and f"{small['decode_tokens_per_s']:.0f} tok/s"),
    ]


def _chain_text(row: dict) -> str:
    depth, bound = row.get("depth") or row.get("nodes"), row.get("bound")
    return (f"{row['speedup']:.2f}x (tau {row['tau']:.2f}" + (f", a chain of {depth}" if depth else "")
            + (f"; weight reads allow {bound:.2f}x" if bound else "") + ")")


def _ngram_goals(acceptance: dict) -> list[Goal]:
    rows = {r["category"]: r["speedup_vs_plain"] for r in acceptance.get("rows", [])}
    low = min(rows, key=rows.get) if rows else None
    goals = [_judge("n-gram on the embedded model over plain, every category of specdec eval acceptance",
                    ">= 1.0x, the lowest", rows.get(low), lambda v: v >= 1.0,
                    low and f"{rows[low]:.2f}x ({low}) lowest of {len(rows)}")]
    for category in ("summarisation", "rag"):
        goals.append(_judge(f"n-gram on the embedded model over plain, {category}", ">= 1.8x", rows.get(category),
                            lambda v: v >= 1.8, category in rows and f"{rows[category]:.2f}x"))
    return goals


def _exactness_goals(steps: dict) -> list[Goal]:
    # every device case (``tests``), or their greedy ones (``identity``)
    device = (steps.get("tests") or {}).get("device_cuda") or (steps.get("identity") or {}).get("greedy_cuda")
    # a run that ran nothing (cut by its deadline, or nothing collected) measured nothing
    ran = bool(device) and device["passed"] + device["failed"] > 0
    greedy = device["failed"] == 0 if ran else None
    found = Goal("greedy identity of every drafter on CUDA (the device test cases)", "every case passes",
                 "" if greedy is None else f"{device['passed']} passed, {device['failed']} failed",
                 "not measured" if greedy is None else "met" if greedy else "missed")
    e2e = steps.get("e2e") or {}
    bugs = e2e.get("divergence_bugs") if e2e.get("rc") == 0 else None
    classified = _judge("bf16 greedy divergences from transformers, each classified at its first token",
                        "none a bug", bugs, lambda v: v == 0, bugs is not None and f"{bugs} bugs")
    return [found, classified]


def goals(steps: dict) -> list[Goal]:
    """Every goal, in the order docs/gpu-speed.md lists them, from a gpu_check.py report's ``steps``."""
    return (_speed_goals(steps.get("speed") or {}) + _ngram_goals(steps.get("acceptance") or {})
            + _exactness_goals(steps))


def markdown(rows: list[Goal], rehearse: bool) -> list[str]:
    lines = ["## Goals", ""]
    if rehearse:
        lines += ["REHEARSAL: tiny shapes on the CPU; the verdicts check the report, not the goals.", ""]
    lines += ["| goal | target | measured | verdict |", "|---|---|---|---|"]
    lines += [f"| {g.what} | {g.goal} | {g.measured} | **{g.verdict}** |" for g in rows]
    return lines


def as_json(rows: list[Goal]) -> list[dict]:
    return [asdict(g) for g in rows]
