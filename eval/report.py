"""Reports of the acceptance suite: JSON for machines, Markdown for people, PNG plots.

    write_reports(rows, out_dir, meta)   ->  report.json, report.md, acceptance_per_depth.png,
                                             tau_speedup.png

Rows may carry a ``level`` (``specdec.eval.spec_bench``): then the Markdown opens with Spec-Bench's table (speedup
and tau per category, MT-bench's categories grouped as ``mt_bench``, overall) and MT-bench's categories one by one;
the plots show categories, groups and overall, not single turns.
"""
from __future__ import annotations

from pathlib import Path

from specdec.atomic_write import replaced_atomically, write_json, write_text

PLOT_FILES = ("acceptance_per_depth.png", "tau_speedup.png")  # what plots() writes, in order

DEFINITIONS = """\
- **accepted length** of a step: draft tokens accepted in it (0 = nothing accepted, also when there was no
  draft). Every step commits accepted + 1 tokens (the recovered or bonus token), cut at a stop.
- **tau**: tokens committed per target forward pass (mean accepted length + 1); plain decoding has tau 1.
- **acceptance at depth d**: P(the node at depth d is accepted | its parent was accepted), summed over steps.
- **same as plain**: every prompt's committed tokens equal plain decoding's in this run (greedy and coupled sampling
  must say yes; standard sampling draws other tokens by design).
- **speedup vs plain / vs HF**: tokens/s (prefill included) over specdec plain decoding / transformers' greedy
  `generate()`, measured in the same run on the same prompts in the same batches (transformers' left-padded, with
  an attention mask).
- **predicted**: tau x c_plain / (c_draft + mean over the cell's steps of c_verify(1 + the step's tree nodes)),
  from costs measured apart from the run it predicts. c_verify(n) = seconds of one verify step (one target forward
  over n query tokens per sequence = root + tree nodes, then rejection sampling and KV commit), timed by a short
  calibration after each cell: median of repeated steps at n = 1 and at every tree size the cell's steps verified
  (at most 16 sizes, the most frequent; others interpolated), on a batch of the cell's prompts extended to the
  mean decoding context. c_plain = c_verify(1). c_draft = the drafter's draft time per step in the cell. The JSON's
  `predicted_speedup_mean_size` prices every step at 1 + the mean tree size instead, as this column does for cells
  calibrated before per-step sizes were kept (`priced_per_step` false). It models decoding only: **pred/meas** is
  predicted over the measured speedup (prefill included); the JSON also has the decode-only measured speedup and
  the costs.
"""


def _fmt(x, spec=".2f", unit="") -> str:
    return "-" if x is None else format(x, spec) + unit


def _same(x) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def _table(rows: list[dict], names: list[str], title: str) -> list[str]:
    """One line per drafter, one column per category: speedup over plain and tau (Spec-Bench's layout)."""
    by = {(r["drafter"], r["category"]): r for r in rows}
    lines = [f"## {title}", "", "| drafter | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for d in (d for d in dict.fromkeys(r["drafter"] for r in rows) if d not in ("plain", "hf-greedy")):
        cells = [f"{_fmt(by[d, n]['speedup_vs_plain'], unit='x')} / {by[d, n]['tau']:.2f}" for n in names]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return lines + ["", "Each entry: speedup over specdec plain decoding (tokens/s, same run) / tau.", ""]


def summary_tables(rows: list[dict]) -> list[str]:
    """Spec-Bench's table (and MT-bench's categories) from rows with a ``level``; nothing without levels."""
    from specdec.eval.spec_bench import MT_BENCH, MT_BENCH_GROUP

    named = {r["category"]: r.get("level") for r in rows}
    if not any(named.values()):
        return []
    # MT-bench's categories merged into the mt_bench group get a table of their own; any other category (a built-in
    # "math" too) is a column here
    members = next((r.get("categories", []) for r in rows
                    if r["category"] == MT_BENCH_GROUP and r.get("level") == "group"), [])
    top = [n for n, lv in named.items() if lv in ("group", "overall") or (lv == "category" and n not in members)]
    top.sort(key=lambda n: (named[n] == "overall", n != MT_BENCH_GROUP))  # mt_bench first, overall last
    lines = _table(rows, top, "Summary (Spec-Bench's categories)")
    mt = [n for n in MT_BENCH if n in members and named.get(n) == "category"]
    if mt:
        lines += _table(rows, mt, "MT-bench by category")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# specdec acceptance report", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", DEFINITIONS, ""]
    lines += summary_tables(rows)
    for category in dict.fromkeys(r["category"] for r in rows):
        level = next((r.get("level") for r in rows if r["category"] == category), None)
        lines += [f"## {category}" + (f" ({level})" if level in ("group", "overall") else ""), "",
                  "| drafter | tau | tok/s | vs plain | same as plain | vs HF | predicted | pred/meas "
                  "| acceptance per depth | accepted-length histogram (length:steps) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in (r for r in rows if r["category"] == category):
            acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]) or "-"
            hist = " ".join(f"{k}:{h}" for k, h in enumerate(r["accepted_histogram"]) if h) or "-"
            lines.append(f"| {r['drafter']} | {_fmt(r['tau'])} | {r['tokens_per_s']:.1f} | "
                         f"{_fmt(r['speedup_vs_plain'], unit='x')} | {_same(r.get('identical_to_plain'))} | "
                         f"{_fmt(r['speedup_vs_hf'], unit='x')} | "
                         f"{_fmt(r.get('predicted_speedup'), unit='x')} | {_fmt(r.get('predicted_over_measured'))} | "
                         f"{acc} | {hist} |")
        lines.append("")
    return "\n".join(lines)


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # ModuleNotFoundError names the package: the CLI says which extra installs it
        raise ModuleNotFoundError("plots need matplotlib: pip install 'specdec[eval]'", name="matplotlib") from err
    rows = [r for r in rows if r.get("level") != "turn"]  # one turn of a conversation is in the Markdown only
    drafters = [d for d in dict.fromkeys(r["drafter"] for r in rows) if d not in ("plain", "hf-greedy")]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["drafter"], r["category"]): r for r in rows}
    paths = []

    fig, axes = plt.subplots(1, len(categories), figsize=(3.2 * len(categories), 3), squeeze=False, sharey=True)
    for ax, cat in zip(axes[0], categories, strict=True):
        for d in drafters:
            acc = by[(d, cat)]["acceptance_per_depth"]
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=d)
        ax.set_title(cat)
        ax.set_xlabel("depth")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("P(accept | parent accepted)")
    _legend(axes[0][-1])
    fig.tight_layout()
    paths.append(out / PLOT_FILES[0])
    _save(fig, paths[-1])
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    width = 0.8 / max(1, len(drafters))
    labelled = False
    for i, d in enumerate(drafters):
        xs = [j + i * width for j in range(len(categories))]
        axes[0].bar(xs, [by[(d, c)]["tau"] for c in categories], width, label=d)
        axes[1].bar(xs, [by[(d, c)]["speedup_vs_plain"] or 0 for c in categories], width, label=d)
        predicted = [(x, by[(d, c)].get("predicted_speedup")) for x, c in zip(xs, categories, strict=True)]
        predicted = [(x, p) for x, p in predicted if p is not None]
        if predicted:
            axes[1].scatter(*zip(*predicted, strict=True), marker="_", s=200, color="black", zorder=3,
                            label=None if labelled else "predicted")
            labelled = True
    titles = ("tau (tokens per target forward)", "speedup vs specdec plain (bars: measured)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, fontsize=8,
                      rotation=20 if len(categories) <= 8 else 45, ha="center" if len(categories) <= 8 else "right")
        ax.set_title(title)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    _legend(axes[1])
    fig.tight_layout()
    paths.append(out / PLOT_FILES[1])
    _save(fig, paths[-1])
    plt.close(fig)
    return paths



def _save(fig, path: Path) -> None:
    """Write ``fig`` to ``path`` as a PNG, atomically: a run stopped while it writes keeps the earlier plot (or none),
    never one cut short beside a finished report."""
    with replaced_atomically(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")


def _legend(ax) -> None:
    """A legend where the panel has labelled lines or bars; none where it has none (a run of plain decoding alone, or
    drafters that never drafted), where matplotlib would warn on the user's console instead."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def write_reports(rows: list[dict], out: Path, meta: dict, with_plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    # atomic: a run stopped while writing (SIGTERM) leaves the earlier report or the new one, never half of one
    write_json(out / "report.json", {"meta": meta, "rows": rows}, indent=2)
    text = markdown(rows, meta)
    write_text(out / "report.md", text)
    written = [out / "report.json", out / "report.md"]
    if with_plots:
        written += plots(rows, out)
    return written
