"""Resolve what the user calls a model into a transformers model + tokenizer + runner.

Accepted: a loaded transformers ``PreTrainedModel``; a local checkpoint directory; a
``.gguf`` file (dequantized once, converted copy cached: :mod:`specdec.models.embedded`); the embedded
default's alias (``"smollm2-135m-instruct"``, also ``"default"``); a synthetic target of a published shape with
random weights (``"synthetic:llama-3.1-8b"``, ``"synthetic:qwen3-1.7b@tiny"``: :mod:`specdec.models.synthetic`,
built on ``device``, default CUDA when present, in ``dtype``, default bf16 there). Never downloads,
never runs remote code unless ``trust_remote_code=True`` is passed. Without ``dtype`` a checkpoint loads in float32,
or, for ``device`` CUDA, in the half dtype its config declares (bfloat16 when it declares float32 or none). A model
passed loaded (or a ``LoadedModel``) is moved to ``device`` in place, as ``model.to(device)`` would; a ``dtype`` other
than its own is refused, not converted behind the caller's back.
What a checkpoint directory must hold (config.json of a supported type, unquantized, safetensors, every tensor):
:mod:`specdec.models.checkpoint_files`; what a model must be for specdec's forward to be its own:
:mod:`specdec.models.runnable` (both refuse in one line).

    loaded = load_model("default")
    loaded.runner, loaded.tokenizer
    loaded.source          # "HuggingFaceTB/SmolLM2-135M-Instruct": what drafter checkpoints record as their base

``LoadedModel.source`` is the reference other tools resolve (``base_model_name_or_path`` in the Medusa and EAGLE
checkpoints specdec writes): a local checkpoint directory or .gguf file as an absolute path, the embedded default
as the hub id of the model it quantizes (its GGUF is a Q4_1 copy of it), a loaded model as its ``_name_or_path``
(made absolute when it names a local path).
"""
from __future__ import annotations

import inspect
import json
import logging
import os
import textwrap
import weakref
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from specdec.errors import InputError, InputTypeError, ModelNotFoundError, closest
from specdec.generation_config import LOAD_ARGUMENTS
from specdec.log_levels import logger_at
from specdec.models import checkpoint_files, embedded, runnable, synthetic
from specdec.models.fused_projections import pack_projections
from specdec.models.installed_versions import check_installed
from specdec.models.llama import LlamaRunner, check_supported

logger = logging.getLogger(__name__)

NO_TOKENIZER_FILES = "holds no tokenizer files (tokenizer.json, tokenizer.model, vocab.json, ...)"

EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the embedded GGUF (Q4_1) quantizes


@dataclass(frozen=True)
class LoadedModel:
    model: Any  # transformers PreTrainedModel (eval mode)
    tokenizer: Any | None
    runner: LlamaRunner
    name: str  # short display name (a folder or file name, the alias; a model passed without one: its class)
    source: str = ""  # a reference other tools can resolve: hub id or absolute path (model_reference)


def path_like(spec: str) -> bool:
    """Whether ``spec`` can only be a local path, never a hub id (``org/name`` or a bare name): it starts with
    ``.``, ``/`` or ``~``, or has more than one ``/``."""
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


def model_reference(spec: str) -> str:
    """What to record as a drafter checkpoint's ``base_model_name_or_path`` for the model ``spec`` names: an
    existing local path as an absolute path, the embedded default's aliases as its hub id, anything else (a hub
    id) as given. Never a bare folder name that only resolves from one working directory."""
    spec = str(spec)
    if spec in embedded.ALIASES:
        return EMBEDDED_HUB_ID
    path = Path(spec).expanduser()
    if spec and path.exists():
        return str(path.resolve())
    return spec


def _is_hf_model(obj: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, PreTrainedModel)


HALF_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # config.json names a checkpoint keeps on CUDA


def checkpoint_dtype(path: Path, device: str | torch.device | None) -> torch.dtype:
    """The dtype a checkpoint directory loads in when none is asked for: float32 unless it goes to CUDA; there the
    half dtype its config.json declares (``dtype``, or ``torch_dtype`` before transformers 5), else bfloat16, as
    synthetic targets are built there. A float32 8B model would read twice the bytes per token."""
    default = synthetic.default_dtype(torch.device("cpu" if device is None else device))
    if default == torch.float32:
        return default
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return HALF_DTYPES.get(config.get("dtype") or config.get("torch_dtype"), default)


def _config_invalid() -> tuple[type[BaseException], ...]:
    """What transformers raises for a config.json value it refuses: huggingface_hub's strict dataclasses' error (an
    older huggingface_hub has none: its transformers raised ValueError)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # pragma: no cover
        return ()
    return (StrictDataclassError,)


def _from_dir(path: Path, dtype: torch.dtype, trust_remote_code: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    checkpoint_files.check_before_load(path)  # config.json, model type, no quantization, no pickles
    from safetensors import SafetensorError

    try:
        with checkpoint_files.own_load_report():  # check_loaded says it, in one line
            model, info = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code, use_safetensors=True,
                output_loading_info=True, ignore_mismatched_sizes=True,  # a wrong shape: check_loaded refuses it
            )
    except SafetensorError as err:  # a truncated or half-downloaded weights file
        raise InputError(f"{path}: its safetensors weights cannot be read ({err}); copy or download them again") \
            from err
    except _config_invalid() as err:  # a value transformers' config validation refuses, before any weight is read
        raise InputError(f"{path / checkpoint_files.CONFIG} is not a valid config ({' '.join(str(err).split())})") \
            from err
    checkpoint_files.check_loaded(path, info)  # no tensor left to transformers' random initialisation
    return model, _tokenizer(path, trust_remote_code)


def _tokenizer(path: Path, trust_remote_code: bool) -> Any:
    """The directory's tokenizer, or None (token ids only) with one warning line saying why: no tokenizer files
    (a model saved alone, where transformers would blame a missing sentencepiece), or transformers' reason."""
    from transformers import AutoTokenizer

    if not holds_tokenizer_files(path):
        logger.warning("no tokenizer loaded from %s: it %s; token ids only", path, NO_TOKENIZER_FILES)
        return None
    needs_protobuf = _needs_protobuf(path)
    # without protobuf, transformers' five lines blaming it (then tiktoken) came before the one line below
    try:
        with logger_at("transformers", logging.ERROR) if needs_protobuf else nullcontext():
            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for a tokenizer.json it cannot parse
        # any failure leaves token ids, as a tokenizer that is not JSON does: one line, no traceback kept
        why = f"{type(err).__name__}: {textwrap.shorten(str(err), 300, placeholder=' ...')}"
        if needs_protobuf:  # transformers blamed a missing tiktoken, the fallback it tried last
            why = "its SentencePiece tokenizer.model is read through protobuf, not installed: pip install protobuf"
        logger.warning("no tokenizer loaded from %s (%s); token ids only", path, why)
        return None


def _needs_protobuf(path: Path) -> bool:
    """Whether the directory's tokenizer is a SentencePiece model alone (no tokenizer.json), which transformers
    converts through protobuf, and protobuf is not installed."""
    from transformers.utils import is_protobuf_available

    return (not (path / "tokenizer.json").exists() and any(f.suffix == ".model" for f in path.iterdir())
            and not is_protobuf_available())


def holds_tokenizer_files(path: Path) -> bool:
    """Whether the directory holds a file transformers' tokenizers read: tokenizer.json / _config.json, sentencepiece
    models, BPE / WordPiece vocabularies and merges, tiktoken files (where it has none, transformers blames a missing
    sentencepiece for a Llama model, which would not help)."""
    return any(f.name.startswith(("tokenizer", "vocab", "merges")) or f.name.endswith((".model", ".tiktoken"))
               for f in path.iterdir())


# Models loaded from a path, shared while someone still holds them (a second load_model of the same
# checkpoint, dtype and device costs nothing then; weights changed in place are shared too) and freed with their
# last user: nothing is kept alive here. One moved to another dtype or device since is not given out (_lies_as), nor
# one whose folder was written again since (_files_stamp is part of the key).
_MODELS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # _model_key(...) -> model
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (tokenizer, name, source)


@contextmanager
def eval_mode(model) -> Iterator[Any]:
    """``model`` in eval mode (no dropout) for a transformers forward of specdec's own, each module's mode given
    back after: a caller's model passed in train mode (a training loop's rollouts) stays so. specdec's runner never
    calls the modules, so generate() needs no mode at all."""
    training = [m for m in model.modules() if m.training]
    model.eval()
    try:
        yield model
    finally:
        for module in training:
            module.training = True


# a LoadedModel's runner that no longer describes its model -> the runner built again for it (LlamaRunner.stale):
# later calls with that LoadedModel reuse it, and with it the model's CUDA-graph cache, until the model changes again
_REBUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def config_dir(spec: str) -> Path:
    """Where the config.json of a checkpoint spec is (or will be, once a GGUF is converted): nothing is read."""
    gguf = gguf_file(spec)
    return embedded.converted_dir(gguf) if gguf is not None else Path(spec).expanduser()


def gguf_file(spec: str | os.PathLike) -> Path | None:
    """The GGUF file a model path spec names: the embedded model's for an alias, an existing ``.gguf`` file; None for
    anything else (a checkpoint directory, a path that is not there)."""
    if spec in embedded.ALIASES:
        return embedded.embedded_gguf_path()
    p = Path(spec).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def _model_key(spec: str, dtype: torch.dtype | None, device: str | torch.device | None, trust_remote_code: bool):
    """The shared-model key of a load: the dtype and device it ends in, not as they were asked, so asks that end in
    one model share it (no dtype and the checkpoint's own; ``"cuda"`` and ``"cuda:0"``; no device and the CPU)."""
    synthetic_spec = synthetic.is_synthetic(spec)
    if device is None:
        device = synthetic.default_device() if synthetic_spec else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if dtype is None:
        dtype = synthetic.default_dtype(device) if synthetic_spec else checkpoint_dtype(config_dir(spec), device)
    return _checkpoint_named(spec), dtype, str(device), trust_remote_code, _files_stamp(spec)


def _checkpoint_named(spec: str) -> str:
    """The checkpoint ``spec`` names, one string whatever its spelling: every alias the embedded model's, a path
    resolved (``m``, ``./m/`` and its absolute path one checkpoint, as a target and its own draft model spelled apart
    are; a relative path read from another folder another one)."""
    if spec in embedded.ALIASES:
        return embedded.DEFAULT_ALIAS
    if synthetic.is_synthetic(spec):
        return spec
    try:
        return str(Path(spec).expanduser().resolve())
    except (OSError, RuntimeError):  # a symlink loop: refused by the load itself
        return spec


def _names_gguf(path: Path) -> bool:
    """Whether a path spec names a GGUF file: a folder so named is a checkpoint directory."""
    return path.suffix == ".gguf" and not path.is_dir()


def _files_stamp(spec: str) -> tuple:
    """A checkpoint directory's files by name, size and modification time: a folder written again since a model was
    loaded from it (a training run saving into it) is another key, so its new weights are read, not the old ones
    shared. () for anything else (the embedded model and a GGUF convert into a folder keyed by the file's content;
    a synthetic shape has no files)."""
    folder = Path(spec).expanduser()
    if spec in embedded.ALIASES or _names_gguf(folder) or synthetic.is_synthetic(spec):
        return ()
    try:
        files = [f for f in folder.iterdir() if f.suffix in (".json", ".safetensors", ".model", ".txt")]
        return tuple(sorted((f.name, st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()]))
    except OSError:
        return ()


def _lies_as(model, key: tuple) -> bool:
    """Whether a shared model is still in the dtype and on the device of its key: a holder may have moved it since
    (``loaded.model.half()``), and a later load asking for the key's must not get it so (it loads its own)."""
    weight = model.get_input_embeddings().weight
    return weight.dtype == key[1] and str(weight.device) == key[2]


def _load_path(spec: str, dtype: torch.dtype | None, device: str | torch.device | None,
               trust_remote_code: bool) -> tuple[Any, Any, str, str]:
    if not spec:  # else read as the current folder, and refused as "." is not a checkpoint
        raise InputError(f"the model is an empty string: pass a checkpoint directory, a .gguf file, a loaded "
                         f"transformers model, or one of the aliases {', '.join(embedded.ALIASES)}")
    key = _model_key(spec, dtype, device, trust_remote_code)
    dtype = key[1]
    model = _MODELS.get(key)
    if model is not None and _lies_as(model, key):
        return (model, *_TOKENIZERS[model])
    if synthetic.is_synthetic(spec):
        model = synthetic.build(spec, device=device, dtype=dtype)
        _pack(model)
        _MODELS[key] = model
        _TOKENIZERS[model] = (None, spec, spec)
        return model, None, spec, spec
    if spec in embedded.ALIASES:
        path = embedded.embedded_checkpoint()
        name = embedded.DEFAULT_ALIAS
    else:
        p = Path(spec).expanduser()
        if _names_gguf(p):
            if not p.is_file():
                raise ModelNotFoundError(f"GGUF file not found: {spec!r} (looked for the file {p.resolve()})")
            path = embedded.convert_gguf(p, embedded.converted_dir(p))
        elif p.is_dir():
            path = p
        elif p.is_file():
            raise InputError(f"model {spec!r} is a file, not a checkpoint directory: pass the directory that holds "
                             f"config.json and the weights ({p.resolve().parent}?), or a .gguf file")
        else:
            hub = spec.count("/") == 1 and not path_like(spec)  # "org/name": a hub id?
            hint = (f"; specdec never downloads: fetch it first (hf download {spec} --local-dir DIR) and pass DIR"
                    if hub else " (nothing is downloaded)")
            raise ModelNotFoundError(
                f"unknown model {spec!r}: no checkpoint directory or file at {p.resolve()} and no alias of that "
                f"name; pass a checkpoint directory, a .gguf file, a loaded transformers model, or one of the "
                f"aliases {', '.join(embedded.ALIASES)}{hint}"
            )
        name = p.name
    model, tokenizer = _from_dir(path, dtype, trust_remote_code)
    if device is not None:
        model.to(device)  # before it is shared: a later load for another device gets its own copy
    _pack(model)
    _MODELS[key] = model
    _TOKENIZERS[model] = (tokenizer, name, model_reference(spec))
    return model, tokenizer, name, model_reference(spec)


def _pack(model) -> None:
    """A model specdec built itself: each layer's QKV and gate/up weights side by side, so the runner multiplies
    once per block (specdec.models.fused_projections): on a GPU fewer launches, on a CPU wider products over
    packed oneDNN weights, which stream faster than their narrow parts."""
    blocks = pack_projections(model)
    logger.debug("fused %d QKV / gate-up projection blocks", blocks)


DTYPE_NAMES = ("float32", "bfloat16", "float16")
RUN_DTYPES = (*DTYPE_NAMES, "float64")  # what a model runs in (float64: the reference path only, for checks)
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32"}


def check_dtype(dtype: Any) -> torch.dtype | None:
    """``dtype`` as a torch.dtype a model runs in (RUN_DTYPES, given as a torch.dtype or one of torch's names of it:
    ``"bfloat16"``, ``"half"``), or a one-line InputError naming the name likely meant (``"bf16"``) (a float8 dtype
    failed deep in transformers with a bare TypeError)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.") if isinstance(dtype, (str, torch.dtype)) else None
    named = getattr(torch, name, None) if name else None
    if isinstance(named, torch.dtype) and str(named).removeprefix("torch.") in RUN_DTYPES:
        return named
    raise InputError(f"dtype must be a floating torch.dtype or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}"
                     + _dtype_hint(name, named))


def _dtype_hint(name: str | None, named: Any) -> str:
    """What the dtype name refused (``name``, ``named`` torch's object of that name) likely meant, as a hint."""
    if isinstance(named, torch.dtype):
        return " (a model does not run in it: load it in one of those)"
    if name is None:
        return ""
    folded = name.strip().lower()
    if folded == "auto":
        return " (leave dtype out for the default: float32 on the CPU, the config's half dtype on CUDA)"
    meant = DTYPE_ALIASES.get(folded) or closest(folded, DTYPE_NAMES)
    return f" (did you mean {meant}?)" if meant else ""


def check_device(spec: Any, label: str = "device") -> torch.device:
    """``spec`` as a torch.device this torch can allocate on, checked before a (slow) model load; ``label`` names
    the argument in the one-line InputError."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        if isinstance(spec, int) and not isinstance(spec, bool):  # an accelerator's index, with none present
            raise InputError(f"{label} {spec!r}: no CUDA device is available (torch {torch.__version__})") from None
        raise InputError(f"{label} {spec!r} is not a device torch knows; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{label} {spec!r}: no CUDA device is available (torch {torch.__version__})")
    if device.type == "meta":  # it allocates, but holds no data: a model moved there has lost its weights
        raise InputError(f"{label} {spec!r} holds no weights, so a model cannot run there; use cpu, cuda or cuda:N")
    try:
        torch.empty(1, device=device)
    except Exception as err:  # noqa: BLE001 - each backend fails its own way (Assertion-, NotImplemented-, ...)
        reason = (str(err).split(". ")[0].splitlines() or [type(err).__name__])[0][:200]  # first sentence
        raise InputError(f"{label} {spec!r}: torch {torch.__version__} cannot use it ({reason})") from None
    return device


def _place_passed_model(model, dtype: torch.dtype | None, device: torch.device | None) -> None:
    """A model passed loaded (a transformers model, a LoadedModel's) with ``dtype`` / ``device``: moved to ``device``
    in place, as ``model.to(device)`` moves it (no copy of an 8B model's weights); a ``dtype`` other than its own is
    refused in one line, as converting would change what the caller's model computes (module doc)."""
    weight = model.get_input_embeddings().weight  # its dtype is the runner's (LlamaRunner.dtype), as in _lies_as
    if dtype is not None and weight.dtype != dtype:
        raise InputError(f"dtype={dtype} is the dtype to load a checkpoint in, but the model passed is already "
                         f"loaded in {weight.dtype}: convert it first (model.to({dtype})) or leave dtype out")
    if device is not None:
        runnable.check_modules(model)  # a quantized model's .to() is transformers' traceback, this one line
        now = weight.device
        if now.type != device.type or device.index not in (None, now.index):
            logger.info("moving the model passed to %s (in place: the caller's model object moves)", device)
        model.to(device)


def _unknown_load_arguments(unknown: list[str]) -> str:
    """The one-line error for keywords load_model does not take: each with the argument likely meant (for
    from_pretrained's ``torch_dtype`` / ``device_map``, :data:`~specdec.generation_config.LOAD_ARGUMENTS`)."""
    known = [name for name in inspect.signature(load_model).parameters if name not in ("spec", "unknown")]
    named = []
    for name in unknown:
        meant = LOAD_ARGUMENTS.get(name) or closest(name, known)
        named.append(f"{name} (did you mean {meant}=?)" if meant else name)
    plural = "s" if len(unknown) > 1 else ""
    return f"load_model() got unknown argument{plural} {', '.join(named)}; it takes {', '.join(known)}"


def load_model(
    spec: Any,
    *,
    tokenizer: Any | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    **unknown: Any,
) -> LoadedModel:
    """Load ``spec`` as a ``LoadedModel`` (its transformers model, tokenizer and specdec's runner of it).

    Args:
        spec: a loaded transformers model (or ``LoadedModel``), a local checkpoint directory, a ``.gguf`` file, the
            embedded default's alias (``"default"``) or a synthetic target (``"synthetic:llama-3.1-8b"``).
        tokenizer: the tokenizer to use instead of the one found with the model.
        dtype: the dtype a checkpoint loads in (default: float32 on the CPU, the config's half dtype on CUDA); a
            model passed loaded in another dtype is refused, never converted.
        device: where the model runs (default: where a passed model is; a checkpoint: the CPU, a synthetic
            target: CUDA when present); a passed model moves there in place.
        trust_remote_code: allow a checkpoint's own code, as transformers' flag does; nothing is downloaded.

    Another keyword (``torch_dtype=``, ``device_map=``, a typo) is a one-line InputTypeError naming the one meant.
    """
    if unknown:
        raise InputTypeError(_unknown_load_arguments(sorted(unknown)))
    check_installed()  # a transformers older than specdec's checks loads some models as others
    dtype = check_dtype(dtype)
    device = check_device(device) if device is not None else None
    if isinstance(spec, LoadedModel):  # a tokenizer passed with it serves this use (generate(tokenizer=...))
        _place_passed_model(spec.model, dtype, device)
        stale = spec.runner.stale()
        if stale is not None:  # the model was changed since: a runner of it as it is now serves this use
            runner = _REBUILT.get(spec.runner)
            if runner is None or runner.stale() is not None:
                logger.info("the LoadedModel's runner no longer describes its model (%s): built again", stale)
                runner = _REBUILT[spec.runner] = spec.runner.rebuilt()
            spec = replace(spec, runner=runner)
        runnable.check_modules(spec.model)  # a module replaced or hooked since the load (~0.1 ms)
        return spec if tokenizer is None or tokenizer is spec.tokenizer else replace(spec, tokenizer=tokenizer)
    if isinstance(spec, torch.nn.Module) and _is_hf_model(getattr(spec, "_orig_mod", None)):
        spec = spec._orig_mod  # torch.compile(model): specdec runs its own forward on the same weights
    if _is_hf_model(spec):
        model, name = spec, getattr(spec.config, "_name_or_path", "") or type(spec).__name__  # one built in memory
        source = model_reference(getattr(spec.config, "_name_or_path", "") or "")
        _place_passed_model(model, dtype, device)
    elif isinstance(spec, (str, Path)):
        model, loaded_tok, name, source = _load_path(str(spec), dtype, device, trust_remote_code)
        model.eval()  # its transformers forward (training features, the certificate's checks) without dropout
        tokenizer = tokenizer or loaded_tok
    else:
        hint = (" (a PEFT model: merge its adapter into the weights, model.merge_and_unload(), and pass the result)"
                if hasattr(spec, "get_base_model") else "")
        if getattr(spec, "active_peft_config", None) is not None and \
                getattr(spec.active_peft_config, "is_prompt_learning", False):  # nothing to merge: virtual tokens
            hint = (" (a PEFT prompt-learning model: its virtual tokens are inputs specdec does not run, and no "
                    "merge removes them; pass the base model to decode without them)")
        raise InputTypeError(f"model must be a transformers model, a path or an alias, got {type(spec).__name__}"
                             f"{hint}")
    check_supported(model)  # the family, its activation and RoPE, before its modules are read
    runnable.check_modules(model)  # nothing the runner's own forward would leave out, before it is built on them
    runner = LlamaRunner(model)
    return LoadedModel(model, tokenizer, runner, name, source)
