"""specdec: lossless speculative decoding.

    import specdec
    out = specdec.generate("smollm2-135m-instruct", [[1, 2, 3]], drafter="ngram", max_new_tokens=64)

The public names are imported on first use (PEP 562), so ``import specdec.cli`` does not import torch: the command
line answers Ctrl-C during its first seconds itself, and ``--help`` is quick.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from specdec.errors import InputError, InputTypeError, ModelNotFoundError, SpecdecError

if TYPE_CHECKING:
    from specdec.drafters.draft_model import VocabularyMismatchError
    from specdec.drafters.eagle_checkpoint import EagleCheckpointError
    from specdec.drafters.medusa_heads import MedusaCheckpointError
    from specdec.generate import GenerateOutput, SequenceStats, generate
    from specdec.generation_config import GenerationConfig
    from specdec.kernels.dispatch import BackendError
    from specdec.kv_cache import CacheFullError
    from specdec.models.embedded import GGUFError
    from specdec.models.llama import UnsupportedModelError
    from specdec.models.loader import load_model
    from specdec.sampling import InvalidLogitsError, SamplingConfig
    from specdec.tree import DraftError, DraftMode, DraftTree

__version__ = "0.1.0"
__all__ = [
    "generate", "GenerationConfig", "GenerateOutput", "SequenceStats", "load_model", "SamplingConfig",
    "DraftTree", "DraftMode", "DraftError", "SpecdecError", "InputError", "InputTypeError", "ModelNotFoundError",
    "CacheFullError", "InvalidLogitsError", "UnsupportedModelError", "GGUFError", "BackendError",
    "VocabularyMismatchError", "EagleCheckpointError", "MedusaCheckpointError",
]
_HOME = {  # public name -> the module that defines it
    "generate": "specdec.generate", "GenerateOutput": "specdec.generate", "SequenceStats": "specdec.generate",
    "GenerationConfig": "specdec.generation_config", "load_model": "specdec.models.loader",
    "SamplingConfig": "specdec.sampling", "DraftTree": "specdec.tree", "DraftMode": "specdec.tree",
    "DraftError": "specdec.tree", "CacheFullError": "specdec.kv_cache", "InvalidLogitsError": "specdec.sampling",
    "UnsupportedModelError": "specdec.models.llama", "GGUFError": "specdec.models.embedded",
    "BackendError": "specdec.kernels.dispatch", "VocabularyMismatchError": "specdec.drafters.draft_model",
    "EagleCheckpointError": "specdec.drafters.eagle_checkpoint",
    "MedusaCheckpointError": "specdec.drafters.medusa_heads",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule not imported yet (specdec.testing, ...): bound on first use, as an import binds it
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """Importing the submodule ``specdec.generate`` binds it on the package, where ``specdec.generate`` must stay
    the function: a submodule bound over a public name of its own is replaced by that name."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOME and isinstance(value, types.ModuleType) and hasattr(value, name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
