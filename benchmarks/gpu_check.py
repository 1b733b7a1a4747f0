"""One command that checks and measures specdec's GPU path, and writes one JSON + Markdown report.

    pip install -e ".[dev]"                       # with the CUDA torch you already have
    python benchmarks/gpu_check.py                # every step (about 10 minutes on an H100, docs/gpu/kernels.md)
    python benchmarks/gpu_check.py --steps tests  # some of them; --out DIR (default gpu-report/)
    python benchmarks/gpu_check.py --steps env,speed             # speed at real sizes, at most ~7 minutes
    python benchmarks/gpu_check.py --steps env,graphs,speed      # the same after the CUDA-graph tests, ~8.5 min
    python benchmarks/gpu_check.py --steps speed --rehearse      # the same on the CPU, tiny shapes (no GPU)
    python benchmarks/gpu_check.py --steps acceptance,speed --model /tmp/smol.gguf   # every goal's speed number

Steps, run in this order, each in its own process with its own time limit, so a crash or a hang in one
is reported and the others still run:

* ``env``: GPU, driver, torch / triton / transformers versions.
* ``tests``: the test suite's CUDA cases: the kernel and CUDA-graph tests natively (bf16 / fp16 on,
  real graph capture), and every ``device``-parametrised test on ``cuda`` (greedy identity of every
  drafter, seeded and first-token sampling); ``--slow`` adds the slow ones (the sampling laws of
  speculative vs plain sampling, seeded model drafters).
* ``graphs``: the first half of ``tests`` alone (the kernel, CUDA-graph and host-synchronisation tests, about a
  minute), to run before ``speed`` in one call: the speed numbers come from the paths these tests check.
* ``identity``: of the second half, the greedy cases alone (``-k "cuda and greedy"``): every drafter's greedy
  output is the target's on CUDA, in float32, through CUDA graphs where ``cuda_graphs="auto"`` uses them.
* ``kernels``: ``bench_kernels_gpu.py`` over the goal points of ``docs/gpu/kernels.md``, timed as
  CUDA-graph replays (the kernel alone) and with ``do_bench`` (what one eager call costs).
* ``e2e``: ``bench_e2e_gpu.py`` on the embedded model (bf16, batch 1, greedy): transformers, specdec
  plain / n-gram, eager and CUDA graphs, and bf16 greedy identity against transformers with each
  divergence classified as a near-tie (transformers' own logit gap there is within bf16 rounding)
  or a bug.
* ``acceptance`` (not in the default set): ``specdec eval acceptance`` with the n-gram drafter on the embedded model
  (``--model``), every prompt category, 128 new tokens, ``--acceptance-prompts`` prompts each: n-gram over plain
  decoding per category, the goals' n-gram rows. Its model needs a tokenizer: the embedded GGUF, not its shape.
* ``policy`` (not in the default set): the same suite under generate()'s default policy (``--speculation auto``),
  whose rows the report gives beside the goals' n-gram rows.
* ``speed`` (not in the default set; ``--steps env,speed``): ``bench_speed_gpu.py``, plain decoding against the
  weight-read floor, the verify-cost curve and the oracle drafter's speedup at tau 2-4 for synthetic targets of
  published shapes (Llama-3.1-8B, Qwen3-1.7B, Llama-3.2-1B) and the embedded model, batch 1 / 8 / 32, with
  transformers' static-cache generate() as the baseline (docs/gpu-speed.md). It keeps to a time budget, marking
  what does not fit as skipped; ``speed.json`` / ``speed.md`` hold its numbers. ``--rehearse`` runs it on the CPU
  with tiny shapes, so a GPU session only measures.

``report.json`` holds every number; ``report.md`` starts with the goals of docs/gpu-speed.md, each met, missed or
not measured by this run (``gpu_goals.py``), then what failed. Exit status: 0 when every
step passed, 1 when one failed, 2 without a CUDA device.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_goals  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
STEPS = ("env", "tests", "graphs", "identity", "kernels", "e2e", "acceptance", "policy", "speed")
REHEARSED = ("acceptance", "policy", "speed")  # the steps --rehearse runs on the CPU
DEFAULT_STEPS = ("env", "tests", "kernels", "e2e")
SPEED_BUDGET_S, SPEED_TIMEOUT_S = 360, 440  # the speed step: measuring, and its process with loading and imports
POLICY_MIN_S = 90  # the policy step runs only with this much of --deadline-s left: its rows judge no goal
# the least of --deadline-s each step starts with, else it is skipped: under its shortest committed run (docs/gpu/:
# graphs 38-52 s, identity 52-66 s, acceptance 45-65 s, quick e2e 100-122 s on an H200; tests 238 s, kernels 115 s on
# an H100). The speed step sizes its own budget to what is left
STEP_MIN_S = dict(tests=180, graphs=35, identity=45, kernels=90, e2e=90, acceptance=40, policy=POLICY_MIN_S)
ACCEPTANCE_TIMEOUT_S = 240  # about 50 s on an H200: 7 categories x 4 prompts x (plain, n-gram) of ~0.3 s each
# (tests/test_kernels_compile.py is left out: it compiles for sm_90 without a GPU; here every kernel compiles
# and runs natively)
KERNEL_FILES = ["tests/test_kernels_attention.py", "tests/test_kernels_kv.py", "tests/test_kernels_fused_ops.py",
                "tests/test_cuda_graphs.py", "tests/test_decode_ahead.py", "tests/test_capture_hazards.py",
                "tests/test_host_sync.py"]
# every test file with a `device`-parametrised test (tests/test_gpu_check.py keeps this list complete)
DEVICE_FILES = ["tests/test_generate.py", "tests/test_speculative.py", "tests/test_rejection_device.py",
                "tests/test_model_drafters.py", "tests/test_medusa_drafter.py", "tests/test_eagle_drafter.py",
                "tests/test_audit.py", "tests/test_coupled_sampling.py", "tests/test_model_equivalence.py",
                "tests/test_sliding_window.py", "tests/test_transformers_parity.py", "tests/test_cli_errors.py",
                "tests/test_cost_model.py", "tests/test_child_gate.py",
                "tests/test_combined_drafter.py", "tests/test_invalid_logits.py"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                    help=f"comma-separated, of {', '.join(STEPS)} (default: all but speed)")
    ap.add_argument("--out", default="gpu-report", help="report directory (created)")
    ap.add_argument("--model", default="default",
                    help="model of the e2e step and the embedded model of the speed step (alias, checkpoint dir or "
                         ".gguf)")
    ap.add_argument("--prompts", type=int, default=2, help="e2e prompts per category")
    ap.add_argument("--quick-e2e", action="store_true",
                    help="e2e without transformers' static-cache rows, whose torch.compile runs take most of its time "
                         "(divergences are judged against the dynamic cache either way)")
    ap.add_argument("--acceptance-prompts", type=int, default=4, help="acceptance prompts per category")
    ap.add_argument("--workers", type=int, default=8, help="pytest-xdist workers sharing the GPU")
    ap.add_argument("--slow", action="store_true",
                    help="also the CUDA cases of tests marked slow (sampling laws over 6,000 sequences, model "
                         "drafters' seeded runs): several more minutes")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds for the whole check: each step's limit (and the speed step's budget) shrinks to fit "
                         "what is left, so a device call's own limit never cuts the report (default: none)")
    ap.add_argument("--rehearse", action="store_true",
                    help=f"with steps of {', '.join(REHEARSED)} only: run them on the CPU with tiny shapes and few "
                         "tokens (checks the command, no GPU)")
    args = ap.parse_args(argv)
    if args.deadline_s is not None and args.deadline_s <= 0:
        ap.error(f"--deadline-s must be positive, got {args.deadline_s:g}")
    unknown = set(args.steps.split(",")) - set(STEPS)
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEPS)}")
    if args.rehearse and not set(args.steps.split(",")) <= set(REHEARSED):
        ap.error(f"--rehearse goes with steps of {', '.join(REHEARSED)} only")
    return args


DEADLINE: list[float | None] = [None]  # time.perf_counter() by which every step has ended (--deadline-s)
DEADLINE_MARGIN_S = 15  # left after a step's limit for its report and the next step's start


def time_left() -> float:
    """Seconds a step may still take under --deadline-s (inf without one)."""
    end = DEADLINE[0]
    return float("inf") if end is None else end - time.perf_counter() - DEADLINE_MARGIN_S


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | None, float]:
    """Runs cmd with stdout+stderr into log, for at most ``timeout`` seconds and what --deadline-s leaves; returns
    (exit status or None on timeout, seconds)."""
    timeout = max(1.0, min(timeout, time_left()))
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = None
            f.write(f"\n[gpu_check] timed out after {timeout:.0f} s\n")
    return rc, time.perf_counter() - t0


def starved(name: str) -> dict | None:
    """The skipped step's result where --deadline-s leaves ``name`` less than its STEP_MIN_S, else None."""
    if name not in STEP_MIN_S or time_left() >= STEP_MIN_S[name]:  # env; speed sizes its own budget
        return None
    return dict(status="skipped", seconds=0.0, why=f"{max(time_left(), 0):.0f} s left (--deadline-s), "
                                                   f"{STEP_MIN_S[name]} s needed")


def tail(path: Path, lines: int = 25) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def junit_summary(path: Path) -> dict:
    """Counts and the failed tests' ids and first message line, from a pytest --junitxml file."""
    if not path.is_file():
        return dict(passed=0, failed=0, skipped=0, failures=[])
    root = ET.parse(path).getroot()
    counts = dict(passed=0, failed=0, skipped=0)
    failures = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            failures.append(f"{case.get('classname')}::{case.get('name')}: {message[0][:300] if message else ''}")
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return dict(counts, failures=failures)


def step_env(out: Path) -> dict:
    import torch

    info = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(0).multi_processor_count)
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,memory.total,clocks.max.sm",
                          "--format=csv,noheader"], capture_output=True, text=True)
    info["nvidia_smi"] = smi.stdout.strip()
    return dict(status="passed", **info)


def step_tests(out: Path, workers: int, slow: bool, part: str = "all") -> dict:
    """``part``: "all" (``tests``), "graphs" (the kernel and graph files) or "identity" (the greedy device cases)."""
    # the slow device cases alone ran past 240 s on an H100: opt-in, with a longer limit. The kernel and graph files
    # took 47 s on an H200: alone (``graphs``), limited to leave a call of 600 s its speed step
    runs = {}
    if part in ("all", "graphs"):
        runs["kernels_and_graphs"] = (KERNEL_FILES, 150 if part == "graphs" else 240)
    if part == "all":
        runs["device_cuda"] = (DEVICE_FILES + ["-k", "cuda"] + ([] if slow else ["-m", "not slow"]),
                               600 if slow else 240)
    if part == "identity":
        runs["greedy_cuda"] = (DEVICE_FILES + ["-k", "cuda and greedy", "-m", "not slow"], 180)
    result, failed = {}, False
    for name, (files, limit) in runs.items():
        # the junit file outside out (a device call brings back 8 files at most): its counts go into report.json
        with tempfile.TemporaryDirectory(prefix="gpu_check-junit-") as tmp:
            xml = Path(tmp) / f"tests_{name}.xml"
            # --maxprocesses too: pyproject's addopts cap xdist at 4 workers, which a 16-core GPU machine need not keep
            cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers),
                   "--maxprocesses", str(workers), f"--junitxml={xml}", *files]
            rc, seconds = run(cmd, out / f"tests_{name}.log", timeout=limit)
            summary = junit_summary(xml)
        # pytest exits 5 when -k selects nothing: a CPU-only file set is not a failure of the GPU path
        ok = rc in (0, 5) and summary["failed"] == 0
        failed |= not ok
        result[name] = dict(rc=rc, seconds=round(seconds, 1), **summary,
                            log_tail=None if ok else tail(out / f"tests_{name}.log"))
    return dict(status="failed" if failed else "passed", **result)


def step_kernels(out: Path) -> dict:
    # the goal points of docs/gpu/kernels.md: decode and 16-node trees at 2k-32k context, batch 1 / 8 / 32
    common = ["--batch", "1,8,32", "--context", "2048,8192,32768", "--tree", "1,16,64", "--page", "16",
              "--shapes", "embedded,llama8b"]
    result, failed = {}, False
    for name, extra in (("graph", ["--graph"]), ("eager", ["--batch", "1,8", "--context", "8192", "--tree", "1,16"])):
        js = out / f"kernels_{name}.json"
        # a flag given twice: argparse keeps the last, so `extra` narrows the eager sweep
        cmd = [sys.executable, "-P", str(BENCH / "bench_kernels_gpu.py"), *common, *extra, "--json", str(js),
               "--overwrite"]  # the report folder's earlier kernel files are this check's to replace
        rc, seconds = run(cmd, out / f"kernels_{name}.log", timeout=200)
        ok = rc == 0 and js.is_file()
        failed |= not ok
        result[name] = dict(rc=rc, seconds=round(seconds, 1), table=tail(out / f"kernels_{name}.log", 80),
                            points=json.loads(js.read_text())["points"] if ok else None)
    return dict(status="failed" if failed else "passed", **result)


def step_e2e(out: Path, model: str, prompts: int, quick: bool = False) -> dict:
    js = out / "e2e.json"
    cmd = [sys.executable, "-P", str(BENCH / "bench_e2e_gpu.py"), "--model", model, "--prompts", str(prompts),
           "--json", str(js), "--overwrite"] + (["--skip-static"] if quick else [])  # as the kernels step's
    rc, seconds = run(cmd, out / "e2e.log", timeout=330)
    ok = rc == 0 and js.is_file()
    data = json.loads(js.read_text()) if ok else {}
    bugs = sum(d["kind"] == "bug" for divs in data.get("divergences", {}).values() for d in divs)
    return dict(status="passed" if ok and bugs == 0 else "failed", rc=rc, seconds=round(seconds, 1),
                divergence_bugs=bugs, table=tail(out / "e2e.log", 30), **data)


def _acceptance_run(out: Path, rehearse: bool, model: str, prompts: int, speculation: str
                    ) -> tuple[int | None, float, dict, str]:
    """One ``specdec eval acceptance`` of n-gram under ``speculation``: (exit status, seconds, its report.json, its
    log's tail). "always" keeps its log as ``acceptance.log`` and its report.json as ``acceptance.json``; the default
    policy's run keeps neither (a device call brings back 8 files at most): its rows go into report.json."""
    # the suite's own folder (4 files and its cells) outside out
    with tempfile.TemporaryDirectory(prefix="gpu_check-acceptance-") as tmp:
        folder = Path(tmp)
        cmd = [sys.executable, "-P", "-m", "specdec.cli", "eval", "acceptance", "--model", model, "--drafters",
               "ngram", "--prompts", str(1 if rehearse else prompts), "--max-new-tokens", str(8 if rehearse else 128),
               "--no-hf-baseline", "--no-plots", "--calibration-repeats", "0", "--speculation", speculation,
               "--out", str(folder / "suite")]
        # on the GPU, as the goals mean (without --device the suite would load the model on the machine's CPU)
        cmd += ["--device", "cpu"] if rehearse else ["--device", "cuda", "--dtype", "bfloat16"]
        first = speculation == "always"
        log = out / "acceptance.log" if first else folder / "log"
        rc, seconds = run(cmd, log, timeout=ACCEPTANCE_TIMEOUT_S)
        js = folder / "suite" / "report.json"
        data = json.loads(js.read_text()) if rc == 0 and js.is_file() else {}
        if data and first:
            shutil.copyfile(js, out / "acceptance.json")
        return rc, seconds, data, tail(log) if log.is_file() else ""


def step_acceptance(out: Path, rehearse: bool, model: str, prompts: int, speculation: str = "always") -> dict:
    """n-gram over plain in every category: every draft verified whole (``acceptance``, the goals' rows), or under
    the default policy (``policy``: what generate() gives by default, ``speculation="auto"``)."""
    from specdec.eval.prompts import CATEGORIES

    rc, seconds, data, log_tail = _acceptance_run(out, rehearse, model, prompts, speculation)
    keep = ("category", "tau", "speedup_vs_plain", "decode_speedup_vs_plain", "tokens_per_s", "identical_to_plain")
    rows = [{k: r[k] for k in keep} for r in data.get("rows", [])
            if r["drafter"] == "ngram" and r["category"] in CATEGORIES]
    device = (data.get("meta") or {}).get("device", "")
    ok = rc == 0 and len(rows) == len(CATEGORIES) and (rehearse or device.startswith("cuda"))  # every category
    return dict(status="passed" if ok else "failed", rc=rc, seconds=round(seconds, 1), meta=data.get("meta"),
                rows=rows, log_tail=None if ok else log_tail)


def step_speed(out: Path, rehearse: bool, model: str) -> dict:
    # the measuring budget shrinks with --deadline-s, keeping the process's margin for loading and imports
    budget = min(SPEED_BUDGET_S, time_left() - (SPEED_TIMEOUT_S - SPEED_BUDGET_S))
    if not rehearse and budget < 60:
        return dict(status="failed", seconds=0.0, errors=[f"not run: {budget:.0f} s of budget left (--deadline-s)"])
    cmd = [sys.executable, "-P", str(BENCH / "bench_speed_gpu.py"), "--out", str(out), "--embedded", model,
           "--overwrite"]  # the report folder's earlier speed files are this check's to replace
    cmd += ["--rehearse"] if rehearse else ["--budget", str(round(budget))]
    rc, seconds = run(cmd, out / "speed.log", timeout=SPEED_TIMEOUT_S)
    js = out / "speed.json"
    data = json.loads(js.read_text()) if js.is_file() else {}
    errors = [e for m in data.get("models", []) for e in m.get("errors", [])]
    ok = rc == 0 and bool(data) and not errors
    return dict(status="passed" if ok else "failed", rc=rc, seconds=round(seconds, 1), errors=errors,
                table=(out / "speed.md").read_text() if (out / "speed.md").is_file() else tail(out / "speed.log"),
                log_tail=None if ok else tail(out / "speed.log"), report=data)


def _fenced(text: str) -> list[str]:
    """``text`` as a code block, with the blank line after it that a list or paragraph following it needs."""
    return ["```", text, "```", ""]


def markdown(report: dict) -> str:
    lines = [f"# specdec GPU check, {report['date']}", ""]
    env = report["steps"].get("env", {})
    if env:
        lines += [f"{env.get('gpu')} ({env.get('nvidia_smi')}), torch {env.get('torch')} (CUDA {env.get('cuda')}), "
                  f"triton {env.get('triton')}, transformers {env.get('transformers')}", ""]
    lines += ["| step | status | seconds |", "|---|---|---|"]
    for name, step in report["steps"].items():
        lines.append(f"| {name} | **{step['status']}** | {step.get('seconds', '')} |")
    lines += [""] + gpu_goals.markdown(gpu_goals.goals(report["steps"]), report.get("rehearse", False))
    failures = [(name, step) for name, step in report["steps"].items() if step["status"] not in ("passed", "skipped")]
    if failures:
        lines += ["", "## What failed", ""]
        for name, step in failures:
            lines.append(f"### {name}")
            for part in step.values():
                if isinstance(part, dict):
                    lines += [f"- {f}" for f in part.get("failures", [])]
                    if part.get("log_tail"):
                        lines += _fenced(part["log_tail"])
            if step.get("error"):
                lines += _fenced(step["error"])
            lines += [f"- {e}" for e in step.get("errors", []) if isinstance(e, str)]
            if step.get("log_tail") and name in ("speed", "acceptance", "policy"):
                lines += _fenced(step["log_tail"])
            if step.get("table") and name == "e2e":
                lines += _fenced(step["table"])
    parts = [(name, part) for step in ("tests", "graphs", "identity") for name, part in
             (report["steps"].get(step) or {}).items() if isinstance(part, dict)]
    if parts:
        lines += ["", "## Tests on CUDA", ""]
        for name, part in parts:
            lines.append(f"- {name}: {part['passed']} passed, {part['failed']} failed, {part['skipped']} skipped "
                         f"({part['seconds']} s)")
    kernels = report["steps"].get("kernels")
    if kernels:
        for name in ("graph", "eager"):
            if kernels.get(name):
                lines += ["", f"## Kernels ({name} timing)", "", *_fenced(kernels[name]["table"])]
    e2e = report["steps"].get("e2e")
    if e2e and e2e.get("table"):
        lines += ["", "## End to end", "", *_fenced(e2e["table"])]
        for method, divs in e2e.get("divergences", {}).items():
            for d in divs:
                lines.append(f"- {method}, prompt {d['prompt']}: diverges at token {d['position']} "
                             f"({d['got']} vs {d['want']}), transformers' logit gap {d['gap']:.4f}: {d['kind']}")
    acceptance = report["steps"].get("acceptance")
    if acceptance and acceptance.get("rows"):
        auto = {r["category"]: r for r in (report["steps"].get("policy") or {}).get("rows") or []}
        lines += ["", "## n-gram by category (specdec eval acceptance)", "",
                  "Every draft verified whole (`--speculation always`, the goals' rows), and under the default "
                  "policy (`--speculation auto`, the `policy` step) where it ran.", "",
                  "| category | tau | over plain | decode over plain | same text as plain | default policy: tau | "
                  "over plain |", "|---|---|---|---|---|---|---|"]
        for r in acceptance["rows"]:
            decode, a = r["decode_speedup_vs_plain"], auto.get(r["category"])
            policy = "| | |" if a is None else f"| {a['tau']:.2f} | {a['speedup_vs_plain']:.2f}x |"
            lines.append(f"| {r['category']} | {r['tau']:.2f} | {r['speedup_vs_plain']:.2f}x | "
                         f"{'' if decode is None else f'{decode:.2f}x'} | {r['identical_to_plain']} {policy}")
    speed = report["steps"].get("speed")
    if speed and speed.get("table"):
        lines += ["", "## Speed", ""] + ["#" + line if line.startswith("#") else line  # its headings one level down
                                         for line in speed["table"].splitlines()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from specdec.atomic_write import write_json, write_text

    if not torch.cuda.is_available() and not args.rehearse:
        print("gpu_check.py needs a CUDA GPU (none found); --steps speed --rehearse runs on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(date=str(datetime.datetime.now().replace(microsecond=0)), rehearse=args.rehearse, steps={})
    steps = {"env": lambda: step_env(out), "speed": lambda: step_speed(out, args.rehearse, args.model),
             "acceptance": lambda: step_acceptance(out, args.rehearse, args.model, args.acceptance_prompts),
             "policy": lambda: step_acceptance(out, args.rehearse, args.model, args.acceptance_prompts, "auto"),
             "tests": lambda: step_tests(out, args.workers, args.slow),
             "graphs": lambda: step_tests(out, args.workers, args.slow, part="graphs"),
             "identity": lambda: step_tests(out, args.workers, args.slow, part="identity"),
             "kernels": lambda: step_kernels(out),
             "e2e": lambda: step_e2e(out, args.model, args.prompts, args.quick_e2e)}
    t_all = time.perf_counter()
    DEADLINE[0] = None if args.deadline_s is None else t_all + args.deadline_s
    for name in args.steps.split(","):
        print(f"[gpu_check] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result = starved(name) or steps[name]()
        except Exception as err:  # the report must still be written: say what broke
            result = dict(status="failed", error=f"{type(err).__name__}: {err}")
        result.setdefault("seconds", round(time.perf_counter() - t0, 1))
        report["steps"][name] = result
        print(f"[gpu_check] {name}: {result['status']} ({result['seconds']} s)", flush=True)
        report["seconds"] = round(time.perf_counter() - t_all, 1)
        report["goals"] = gpu_goals.as_json(gpu_goals.goals(report["steps"]))
        write_json(out / "report.json", report, indent=1)  # after every step, atomically: a kill keeps the rest
        write_text(out / "report.md", markdown(report))
    print(markdown(report))
    return 0 if all(s["status"] in ("passed", "skipped") for s in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
