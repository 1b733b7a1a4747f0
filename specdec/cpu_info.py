"""This CPU's model name and instruction-set flags: they key cached measurements and label benchmark results.

    cpu_model()      # "AMD EPYC 9454 48-Core Processor"; /proc/cpuinfo, else the OS's name for it
    cpu_signature()  # "AuthenticAMD family 25 model 17" on x86 ("" elsewhere)
    isa()            # "avx2 avx512_bf16 avx512f fma": the flags a matrix product's speed depends on
"""
from __future__ import annotations

import functools
import platform
import subprocess
import sys
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# flags a matrix product's kernel choice and speed depend on (x86, then Arm): a virtual machine may hide some of them
# from a CPU model that has them, and a kernel update may add unrelated flags, which must not re-measure everything
ISA_FLAGS = frozenset({"fma", "f16c", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                       "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
                       "asimd", "asimdhp", "asimddp", "fphp", "sve", "sve2", "bf16", "i8mm", "sme"})


@functools.cache
def cpuinfo_text() -> str:
    """``/proc/cpuinfo`` as read once per process (reading it can take milliseconds on many cores); "" elsewhere."""
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return ""


def cpuinfo_values(name: str, text: str | None = None) -> list[str]:
    """The value of every ``name : value`` line of ``text`` (default :func:`cpuinfo_text`), one per logical CPU."""
    return list(_values(name, cpuinfo_text() if text is None else text))


@functools.lru_cache(maxsize=64)
def _values(name: str, text: str) -> tuple[str, ...]:
    """:func:`cpuinfo_values`, read once per name and text: a cost model's key reads five names at every engine
    built, and a server's ``/proc/cpuinfo`` has some thirty lines per logical CPU."""
    return tuple(line.split(":", 1)[1].strip() for line in text.splitlines()
                 if ":" in line and line.split(":", 1)[0].strip() == name)


def cpu_flags(text: str | None = None) -> frozenset[str]:
    """The first CPU's flags (x86 "flags", Arm "Features"); empty where ``/proc/cpuinfo`` has none."""
    line = next(iter(cpuinfo_values("flags", text) or cpuinfo_values("Features", text)), "")
    return frozenset(line.split())


def isa(text: str | None = None) -> str:
    """The flags of :data:`ISA_FLAGS` this CPU has, sorted and space-separated ("" where none are known)."""
    return " ".join(sorted(cpu_flags(text) & ISA_FLAGS))


def cpu_signature(text: str | None = None) -> str:
    """x86's vendor, family and model numbers ("AuthenticAMD family 25 model 17": a microarchitecture, which a
    virtual machine's model name, "AMD EPYC", may not tell); "" where ``/proc/cpuinfo`` has none."""
    fields = [next(iter(cpuinfo_values(name, text)), "") for name in ("vendor_id", "cpu family", "model")]
    return f"{fields[0]} family {fields[1]} model {fields[2]}" if all(fields) else ""


def cpu_model(text: str | None = None) -> str:
    """The CPU's model name: ``/proc/cpuinfo``'s "model name" (several, joined by " + ", on a hybrid CPU), an Arm
    core's implementer and part numbers, macOS's brand string, else ``platform.processor()`` or the machine type."""
    names = sorted(set(cpuinfo_values("model name", text)))
    if names:
        return " + ".join(names)
    # paired per core by the kernel; a malformed file pairs what it can (a label must never raise)
    parts = sorted(set(zip(cpuinfo_values("CPU implementer", text), cpuinfo_values("CPU part", text), strict=False)))
    if parts:
        return "Arm " + " + ".join(f"implementer {i} part {p}" for i, p in parts)
    return _os_cpu_name()


@functools.cache
def _os_cpu_name() -> str:
    if sys.platform == "darwin":
        try:
            name = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            name = ""
        if name:
            return name
    return platform.processor() or platform.machine() or "unknown CPU"
