"""Reports of the acceptance suite: JSON for machines, Markdown for people, PNG plots.

    write_reports(rows, out_dir, meta)   ->  report.json, report.md, acceptance_per_depth.png,
                                             tau_speedup.png
"""
from __future__ import annotations

import json
from pathlib import Path

DEFINITIONS = """\
- **tau**: tokens committed per target forward pass (mean accepted length + 1); plain decoding has tau 1.
- **acceptance at depth d**: P(the node at depth d is accepted | its parent was accepted), summed over steps.
- **speedup vs plain / vs HF**: tokens/s (prefill included) over specdec plain decoding / transformers' greedy
  `generate()`, measured in the same run on the same prompts.
- **predicted**: tau x (plain seconds per step) / (draft + verify seconds per step), from this run's measured
  costs, prefill excluded. It should agree with the measured speedup up to the prefill share.
"""


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# specdec acceptance report", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", DEFINITIONS, ""]
    for category in dict.fromkeys(r["category"] for r in rows):
        lines += [f"## {category}", "",
                  "| drafter | tau | tok/s | vs plain | vs HF | predicted | acceptance per depth "
                  "| committed/step histogram |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in (r for r in rows if r["category"] == category):
            acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]) or "-"
            hist = " ".join(str(h) for h in r["histogram"][1:]) or "-"
            tau = "-" if r["drafter"] == "hf-greedy" else f"{r['tau']:.2f}"
            lines.append(f"| {r['drafter']} | {tau} | {r['tokens_per_s']:.1f} | "
                         f"{_fmt(r['speedup_vs_plain'])}x | {_fmt(r['speedup_vs_hf'])}x | "
                         f"{_fmt(r.get('predicted_speedup'))}x | {acc} | {hist} |")
        lines.append("")
    return "\n".join(lines)


def plots(rows: list[dict], out: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("plots need matplotlib: pip install 'specdec[eval]'") from err
    drafters = [d for d in dict.fromkeys(r["drafter"] for r in rows) if d not in ("plain", "hf-greedy")]
    categories = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["drafter"], r["category"]): r for r in rows}
    paths = []

    fig, axes = plt.subplots(1, len(categories), figsize=(3.2 * len(categories), 3), squeeze=False, sharey=True)
    for ax, cat in zip(axes[0], categories):
        for d in drafters:
            acc = by[(d, cat)]["acceptance_per_depth"]
            if acc:
                ax.plot(range(1, len(acc) + 1), acc, marker="o", label=d)
        ax.set_title(cat)
        ax.set_xlabel("depth")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("P(accept | parent accepted)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "acceptance_per_depth.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    width = 0.8 / max(1, len(drafters))
    for i, d in enumerate(drafters):
        xs = [j + i * width for j in range(len(categories))]
        axes[0].bar(xs, [by[(d, c)]["tau"] for c in categories], width, label=d)
        axes[1].bar(xs, [by[(d, c)]["speedup_vs_plain"] or 0 for c in categories], width, label=d)
    for ax, title in zip(axes, ("tau (tokens per target forward)", "speedup vs specdec plain")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=20, fontsize=8)
        ax.set_title(title)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "tau_speedup.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_reports(rows: list[dict], out: Path, meta: dict, with_plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "report.md").write_text(markdown(rows, meta))
    written = [out / "report.json", out / "report.md"]
    if with_plots:
        written += plots(rows, out)
    return written
