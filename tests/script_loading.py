"""A benchmark script (benchmarks/ is not a package) loaded as a module of its own, for the tests of its logic."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_script(name: str, suffix: str = "_under_test") -> ModuleType:
    """benchmarks/<name>.py as the module ``<name><suffix>``, registered in sys.modules (its dataclasses look their
    module up by name)."""
    spec = importlib.util.spec_from_file_location(name + suffix, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
