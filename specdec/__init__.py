"""specdec: lossless speculative decoding.

    import specdec
    out = specdec.generate("smollm2-135m-instruct", [[1, 2, 3]], drafter="ngram", max_new_tokens=64)
"""
from specdec.errors import InputError, InputTypeError, SpecdecError
from specdec.generate import GenerateOutput, SequenceStats, generate
from specdec.generation_config import GenerationConfig
from specdec.models.loader import load_model
from specdec.sampling import SamplingConfig
from specdec.tree import DraftError, DraftMode, DraftTree

__version__ = "0.1.0"
__all__ = [
    "generate", "GenerationConfig", "GenerateOutput", "SequenceStats", "load_model", "SamplingConfig",
    "DraftTree", "DraftMode", "DraftError", "SpecdecError", "InputError", "InputTypeError",
]
