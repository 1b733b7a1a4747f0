"""The GPU goals (docs/gpu-speed.md, "Goals") judged from one gpu_check.py report: each is met, missed or not measured.

    rows = goals(report["steps"])   # what, goal, measured, verdict: gpu_check.py writes them first

Every number comes from a step of the same report: ``speed`` (bench_speed_gpu.py: plain decoding against the
weight-read floor, the verify-cost curve, the oracle rows), ``acceptance`` (``specdec eval acceptance`` with n-gram
on the embedded model), ``tests`` / ``identity`` (the CUDA test cases) and ``e2e`` (bf16 divergences classified).
A goal whose step did not run, whose row was skipped or failed, or which lacks a row or category it judges (both
batch-32 rows, all seven categories) or any number of them (NaN, None) is "not measured", never met: its measured
cell says what is missing. In a CPU rehearsal the shapes are tiny and the verdicts check the report's plumbing only.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

TARGET = "synthetic:llama-3.1-8b"  # the 8B shape the goals name (its @tiny version in a rehearsal)
EMBEDDED = "default"
TAU = 3.0
BIG_SHAPES = ("chain", "tree")  # bench_speed_gpu.py's oracle rows under speculation="auto" at the largest batch


@dataclass(frozen=True)
class Goal:
    what: str
    goal: str
    measured: str  # "" when not measured, or what was missing
    verdict: str  # "met", "missed" or "not measured"


def _value(x, count: bool = False) -> float | None:
    """A measured number: None where it is absent, not a number, NaN / infinite, or (unless a ``count``, of which 0
    is one) not positive: every other judged quantity is a ratio or a rate of something measured."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or (x <= 0 and not count):
        return None
    return float(x)


def _judge(what: str, goal: str, value, ok, shown, missing: str = "", count: bool = False) -> Goal:
    """``shown``: the measured text, or a function of the value that gives it; ``missing``: what was not measured
    (skipped, failed, absent), which makes the goal "not measured" whatever the rest gave; ``count``: the value
    counts something (0 is a measurement)."""
    value = _value(value, count)
    if value is None or missing:
        return Goal(what, goal, missing, "not measured")
    return Goal(what, goal, shown(value) if callable(shown) else shown, "met" if ok(value) else "missed")


def _model(speed: dict, name: str) -> dict | None:
    models = (speed.get("report") or {}).get("models", [])
    return next((m for m in models if m["model"] == name or m["model"].startswith(name + "@")), None)


def _big_rows(target: dict) -> tuple[list[float], str]:
    """The batch-32 speculation="auto" rows' speedups, and which of them were skipped, failed or are absent."""
    rows = [r for r in target.get("oracle") or [] if r["batch"] == 32 and r.get("speculation") == "auto"]
    items = [(s, "skipped") for s in target.get("skipped") or []] + [(e.split(": ", 1)[0], "failed")
                                                                       for e in target.get("errors") or []]
    lost = [f"{name.split(' (~')[0]} {why}" for name, why in items
            if name.startswith("oracle ") and " b32 auto" in name]
    shapes = {r["shape"] for r in rows}
    lost += [f"no {shape} row" for shape in BIG_SHAPES if shape not in shapes and not any(
        f"oracle {shape} " in x for x in lost)]
    lost += [f"{r['shape']} row's speedup {r.get('speedup')}" for r in rows if _value(r.get("speedup")) is None]
    return [r["speedup"] for r in rows], "; ".join(lost)


def _speed_goals(speed: dict) -> list[Goal]:
    target, embedded = _model(speed, TARGET), _model(speed, EMBEDDED)
    plain = ((target or {}).get("plain") or {}).get("1") or {}
    rows = (target or {}).get("oracle") or []
    chains = [r for r in rows if r["shape"] == "chain" and r["batch"] == 1 and r["eagle"] and r["tau_target"] == TAU
              and r.get("speculation", "always") == "always"]
    # the depth is the drafter's choice: its best, not known where a chain's speedup is not a number
    unknown = "; ".join(f"chain of {r.get('depth') or r.get('nodes')}: speedup {r.get('speedup')}" for r in chains
                        if _value(r.get("speedup")) is None)
    chain = max(chains, key=lambda r: r["speedup"]) if chains and not unknown else None
    ratio = ((target or {}).get("verify_cost") or {}).get("ratio") or {}
    c65 = ratio.get("65", ratio.get(65))  # the root and a 64-node tree
    p = ((target or {}).get("products") or {}).get("ms") or {}  # the products alone (products_curve.py)
    p1, p65 = _value(p.get("1", p.get(1))), _value(p.get("65", p.get(65)))
    p65 = f" (products alone {p65 / p1:.2f})" if p1 and p65 else ""
    big, lost = _big_rows(target) if target else ([], "")
    small = ((embedded or {}).get("plain") or {}).get("1") or {}
    stand_in = f" ({embedded['note'].rsplit(': ', 1)[-1]} stood in)" if embedded and embedded.get("note") else ""
    tok_s, floor = _value(plain.get("decode_tokens_per_s")), _value(plain.get("floor_tokens_per_s"))
    speeds = f" ({tok_s:.0f} tok/s, floor {floor:.0f})" if tok_s is not None and floor is not None else ""
    return [
        _judge("8B shape, batch 1, plain decoding: step / weight-read floor", "<= 1.15",
               plain.get("step_over_floor"), lambda v: v <= 1.15,
               lambda v: f"{v:.2f}{speeds}"),
        _judge(f"8B shape, batch 1, oracle chain at tau {TAU:g} with EAGLE's drafting: speedup over plain", ">= 2.4x",
               chain and chain["speedup"], lambda v: v >= 2.4, lambda v: _chain_text(chain), unknown),
        _judge("8B shape: verify of a 64-node tree (65 query tokens) / of one, c(65) / c(1)", "<= 1.25", c65,
               lambda v: v <= 1.25, lambda v: f"{v:.2f}{p65}"),
        _judge("8B shape, batch 32, default policy (speculation=\"auto\"): speculation over plain, every oracle row",
               ">= 0.97x, the lowest", min(big) if big and not lost else None, lambda v: v >= 0.97,
               lambda v: f"{v:.2f}x lowest of {len(big)} rows", lost and f"{lost} (the rest: "
               + (", ".join(f"{x:.2f}x" for x in big if _value(x) is not None) or "none") + ")"),
        _judge(f"embedded model, batch 1, default settings: plain decoding{stand_in}", ">= 1,000 tok/s",
               small.get("decode_tokens_per_s"), lambda v: v >= 1000, lambda v: f"{v:.0f} tok/s"),
    ]


def _chain_text(row: dict) -> str:
    depth, bound = row.get("depth") or row.get("nodes"), row.get("bound")
    return (f"{row['speedup']:.2f}x (tau {row['tau']:.2f}" + (f", a chain of {depth}" if depth else "")
            + (f"; weight reads allow {bound:.2f}x" if bound else "") + ")")


def _categories() -> tuple[str, ...]:
    """specdec eval acceptance's categories, imported only where the step ran (gpu_check.py imports this module
    before specdec may import)."""
    from specdec.eval.prompts import CATEGORIES

    return CATEGORIES


def _ngram_goals(acceptance: dict) -> list[Goal]:
    rows = {r["category"]: r.get("speedup_vs_plain") for r in acceptance.get("rows", [])}
    categories = _categories() if rows else ()
    lost = [c for c in categories if _value(rows.get(c)) is None]  # every category, each a number
    low = min(categories, key=rows.get) if categories and not lost else None
    absent = [c for c in lost if c not in rows]
    missing = "; ".join(([f"no {', '.join(absent)}"] if absent else []) + [f"{c} {rows[c]}" for c in lost if c in rows])
    goals = [_judge("n-gram on the embedded model over plain, every category of specdec eval acceptance",
                    ">= 1.0x, the lowest", rows.get(low), lambda v: v >= 1.0,
                    lambda v: f"{v:.2f}x ({low}) lowest of {len(categories)}",
                    missing and f"{missing} ({len(categories) - len(lost)} of the {len(categories)} categories)")]
    for category in ("summarisation", "rag"):
        goals.append(_judge(f"n-gram on the embedded model over plain, {category}", ">= 1.8x", rows.get(category),
                            lambda v: v >= 1.8, lambda v: f"{v:.2f}x"))
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
                        "none a bug", bugs, lambda v: v == 0, bugs is not None and f"{bugs} bugs", count=True)
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
