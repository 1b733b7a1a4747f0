"""Shared helpers for the benchmark scripts (run as `python benchmarks/<script>.py`)."""
from __future__ import annotations

import argparse
import atexit
import copy
import datetime
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec import cpu_info
from specdec.cli import transformers_bars
from specdec.errors import SpecdecError, first_line
from specdec.sigterm import exit_code, how_stopped, sigterm_as_interrupt


class HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """A script's ``--help``: its description as written, and each option's default after its help (an option
    without help gets the default alone); a flag, or an option without a default, shows none."""

    def _format_action(self, action):
        shown = not (action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS)
                     or action.default == [])  # 0 is shown: 0 == False, but not False
        if shown and action.option_strings and action.help is not argparse.SUPPRESS \
                and not any(s in (action.help or "") for s in ("%(default)", "(default")):
            action = copy.copy(action)
            action.help = f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        return super()._format_action(action)


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=False
    )


def time_hf_generate(model, ids: list[int], max_new_tokens: int, **kwargs) -> tuple[float, list[int]]:
    """Seconds and new tokens of transformers' greedy generate() on one prompt."""
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, **kwargs
        )
    return time.perf_counter() - t0, out[0, len(ids):].tolist()


def time_specdec(loaded, ids: list[int] | list[list[int]], max_new_tokens: int, **kwargs):
    """Seconds and GenerateOutput of specdec's generate() on one prompt, or on a (ragged) batch of them. A plain row
    (no drafter) is timed without the table's ``speculation`` setting, which generate() would warn is ignored."""
    from specdec.generate import generate

    if kwargs.get("drafter") is None:
        kwargs.pop("speculation", None)
    batch = ids if ids and isinstance(ids[0], list) else [ids]
    t0 = time.perf_counter()
    out = generate(loaded, batch, max_new_tokens=max_new_tokens, return_dict=True, **kwargs)
    return time.perf_counter() - t0, out


def forget_guard() -> None:
    """What earlier generate() calls taught the break-even guard, the combined drafter's child gate and EAGLE's depth
    choice, forgotten, in this process and on disk (what the guard persists goes to a new empty folder): the next
    call runs as the first ever of its drafter on this machine (the verify-cost calibration stays)."""
    from specdec.remembered import forget_all, use_folder

    forget_all()
    shutil.rmtree(_FORGOTTEN, ignore_errors=True)  # one folder per process, emptied for every call, gone at exit
    use_folder(_FORGOTTEN)


_FORGOTTEN = Path(tempfile.gettempdir()) / f"specdec-remembered-{os.getpid()}"
atexit.register(shutil.rmtree, _FORGOTTEN, ignore_errors=True)


def add_guard_memory(ap) -> None:
    """The options saying where a run's guard memory starts (:func:`guard_memory`)."""
    memory = ap.add_mutually_exclusive_group()
    memory.add_argument("--cold", action="store_true", help="forget what the guard learned before every call: each "
                        "call as a new process's first (a CLI user's case)")
    memory.add_argument("--machine-memory", action="store_true",
                        help="start from what earlier runs on this machine taught the guard (its memory on disk) and "
                        "leave this run's there; default: the run's own memory, empty at its start, so two runs of "
                        "one command start alike")


def start_guard_memory(args) -> None:
    """Before a run's first call: unless --machine-memory, the run's own memory, in a folder of its own (--cold
    empties it before every call besides)."""
    if not args.machine_memory:
        forget_guard()


def guard_memory(args) -> str:
    """Where the guard's memory of this run started: ``cold`` (empty before every call), ``run`` (empty at the run's
    start, carried from call to call), ``machine`` (what earlier runs left on disk)."""
    return "cold" if args.cold else "machine" if args.machine_memory else "run"


def eagle_rows(path: str) -> dict[str, tuple[str, dict]]:
    """Benchmark rows (drafter name, options) of a trained EAGLE layer: alone, and merged per step with n-gram's
    copies by the combined drafter (whose child gate leaves the layer out of a call where it does not pay)."""
    return {"eagle": ("eagle", {"path": path}),
            "ngram+eagle": ("combined", {"drafters": ["ngram", {"name": "eagle", "path": path}]})}


def ratio_line(name: str, base_tokens: int, base_s: float, tokens: int, seconds: float) -> str:
    base_tps, tps = base_tokens / base_s, tokens / seconds
    return f"{name:<28} {tps:8.2f} tok/s   vs baseline {base_tps:8.2f} tok/s   ratio {tps / base_tps:5.2f}x"


def check_new_files(ap, overwrite: bool, *paths) -> None:
    """A one-line ``ap.error`` when a result file would replace one that exists, unless ``overwrite``, when it names a
    folder, or when its folder cannot be made (the writers create it: specdec.atomic_write)."""
    from specdec.output_dirs import why_uncreatable

    for path in paths:
        if path is not None and Path(path).is_dir():  # written after the run, it failed with a traceback then
            ap.error(f"{path} is a folder; give the result file's name")
        if path is not None and not overwrite and Path(path).exists():
            ap.error(f"{path} exists; pass --overwrite to replace it")
        why = None if path is None else why_uncreatable(Path(path).parent)
        if why:
            ap.error(f"{path}: cannot create its folder ({why})")


def check_positive(ap, args, *names: str) -> None:
    """A one-line ``ap.error`` naming the options (``args``' attribute ``names``) given a value below 1."""
    bad = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in names
           if getattr(args, n) is not None and getattr(args, n) < 1]
    if bad:
        ap.error(f"must be >= 1: {', '.join(bad)}")


def check_categories(ap, text: str) -> list[str]:
    """``--categories``' comma-separated names, each one of specdec eval acceptance's; else a one-line ``ap.error``."""
    from specdec.eval.prompts import CATEGORIES

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CATEGORIES]
    if unknown or not names:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "none given"
        ap.error(f"--categories: {what}; known: {', '.join(CATEGORIES)}")
    return names


def add_overwrite(ap) -> None:
    ap.add_argument("--overwrite", action="store_true", help="replace result files that exist (else refused)")


def machine_class() -> str | None:
    """docs/gen_benchmarks.py's machine class of this CPU, or None when it names none."""
    vendor = next(iter(cpu_info.cpuinfo_values("vendor_id")), "")
    avx512 = "avx512f" in cpu_info.cpu_flags()
    if vendor == "GenuineIntel":
        return "cpu-intel-avx512" if avx512 else None
    if vendor == "AuthenticAMD":
        return "cpu-avx512" if avx512 else "cpu-no-avx512"
    return None


def check_machine_class(ap, flag: str) -> None:
    """Refuse ``flag`` up front where this CPU has no machine class: its docs/results file would break the docs."""
    if machine_class() is None:
        ap.error(f"{flag}: this CPU has no machine class of docs/gen_benchmarks.py (benchmarks/common.py's "
                 "machine_class), so the run cannot be a docs/results file; run it without " + flag)


def cpu_name() -> str:
    """This CPU's model name (as the cost cache keys it: :func:`specdec.cpu_info.cpu_model`) and its logical CPUs."""
    count = len(cpu_info.cpuinfo_values("model name")) or os.cpu_count()
    return f"{cpu_info.cpu_model()}, {count} cores"


def result_header(script: str, argv: list[str] | None, benchmark: str, title: str, machine: str) -> dict:
    """The fields a docs/results file opens with (docs/gen_benchmarks.py): today's date, this CPU's machine class
    and name with torch's thread count and ``machine`` after them, ``benchmark`` and ``title``, and the command that
    wrote it: ``python benchmarks/SCRIPT`` with ``argv`` (None: the process's arguments)."""
    args = sys.argv[1:] if argv is None else argv
    return {"date": datetime.date.today().isoformat(), "machine_class": machine_class(),
            "machine": f"{cpu_name()}, {torch.get_num_threads()} torch thread(s); {machine}", "benchmark": benchmark,
            "title": title, "command": f"python benchmarks/{script} " + shlex.join(args)}


def cpu_features() -> str:
    """What this CPU offers a bf16 product, in words: "AVX-512, no bf16 instructions" and the like."""
    flags = cpu_info.cpu_flags()
    avx512 = "AVX-512" if "avx512f" in flags else "no AVX-512"
    return f"{avx512}, {'' if flags & {'avx512_bf16', 'amx_bf16'} else 'no '}bf16 instructions"


def run_main(main) -> None:
    """A script's ``main()`` run as a command: exit with its status; Ctrl-C (or SIGTERM: ``timeout``, a scheduler)
    ends it in one line, status 130 (143), not in a traceback, and so does specdec's refusal (a model or checkpoint
    that is not there, a layer count the model lacks: SpecdecError), as ``SCRIPT: error: ...``, status 2, as the
    script's own argument errors. A result file is written whole or not at all (specdec.atomic_write), so what a
    script had written before stays as it was. transformers' progress bars (loading weights) are off, as the
    specdec commands have them without -v: a script's output is its measurements."""
    try:
        with sigterm_as_interrupt(), transformers_bars(shown=False):
            code = main()
    except KeyboardInterrupt as err:
        sys.stdout.flush()
        print(f"{Path(sys.argv[0]).name}: {how_stopped(err)}", file=sys.stderr)
        code = exit_code(err)
    except SpecdecError as err:
        sys.stdout.flush()
        print(f"{Path(sys.argv[0]).name}: error: {first_line(err)}", file=sys.stderr)
        code = 2
    sys.exit(code)
