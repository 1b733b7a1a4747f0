"""Published Medusa heads -> specdec's Medusa checkpoint: ``specdec convert-medusa`` and the reader behind it.

    specdec convert-medusa ./medusa-vicuna-7b-v1.3 --output-dir heads/       # config.json + medusa_lm_head.pt
    specdec convert-medusa ./medusa-1.0-zephyr-7b-beta --output-dir heads/   # heads inside the model's weights

    config, state = read_published("medusa-vicuna-7b-v1.3/")   # MedusaConfig + state dict in specdec's keys
    convert_published("medusa-vicuna-7b-v1.3/", "heads/")      # writes heads/ (load_medusa reads it)

Sources are local files, nothing is downloaded:

* **Medusa-1 heads** (FasterDecoding/Medusa): ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``,
  ``base_model_name_or_path``) with ``medusa_lm_head.pt`` or ``.safetensors``, or that file alone. Keys
  ``{head}.{layer}.linear.weight`` / ``.bias`` and ``{head}.{num_layers}.weight``; heads without their own LM
  head share the base model's.
* **Medusa-2** (``medusa-1.0-*``, Medusa's axolotl fork): a transformers checkpoint holding
  ``medusa_head.{head}.{layer}...`` beside the base weights, which were fine-tuned with the heads, so the heads
  go with that checkpoint (``base_model_name_or_path`` becomes its absolute path).

Pickles are read with ``torch.load(weights_only=True)`` only: anything but tensors and plain containers is
refused, never unpickled.

The mapping is exact: the same ResBlock (``x + SiLU(W x + b)``), bias-free LM heads, the same keys, dtypes kept.
A head's blocks are one block repeated (``[ResBlock(h)] * num_layers``), so a file storing only some copies gets
the stored one repeated. specdec's own layout (config.json with ``medusa_shared_lm_head``, as train-medusa writes it:
read to re-record ``--base-model`` or ``--medusa-choices``) keeps its distinct blocks as stored. Refused by name
rather than converted approximately: an LM head with a bias, a block missing its weight or bias, differing copies
of one repeated block (another source's), a missing block (specdec's), another key layout, inconsistent shapes,
fewer heads than config.json promises, and shared-LM-head heads whose vocabulary size cannot be read.
"""
from __future__ import annotations

import json
import logging
import os
import pickle
import re
from pathlib import Path

import torch
from specdec.drafters.medusa_heads import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    MedusaCheckpointError,
    MedusaConfig,
    MedusaHeads,
    save_medusa,
)
from specdec.drafters.medusa_tree import check_paths

from specdec.atomic_write import leftover_of
from specdec.errors import InputError
from specdec.output_dirs import check_creatable, sticky_for_others

logger = logging.getLogger(__name__)

PUBLISHED_PICKLE = "medusa_lm_head.pt"
MODEL_PREFIX = "medusa_head."  # the heads' keys inside a Medusa-2 / axolotl model's weights
# a whole model's weights, in the order transformers prefers them
MODEL_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                 "pytorch_model.bin")
_KEY = re.compile(r"^(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight|bias)$")


def find_published(path: str | os.PathLike) -> tuple[str, list[Path]] | None:
    """``(kind, files)`` of the published Medusa weights at ``path``; kind is ``"heads"`` (a medusa_lm_head file)
    or ``"model"`` (heads inside a whole model's weights); None when there are none."""
    path = Path(path)
    if path.is_file():
        return ("heads", [path]) if path.suffix in (".pt", ".bin", ".safetensors") else None
    for name in (WEIGHTS_FILE, PUBLISHED_PICKLE):
        if (path / name).is_file():
            return "heads", [path / name]
    for name in MODEL_WEIGHTS:
        file = path / name
        if not file.is_file():
            continue
        if name.endswith(".index.json"):
            try:
                weight_map = json.loads(file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise MedusaCheckpointError(f"{file} is not a weights index (no weight_map): {err}") from err
            shards = sorted({v for k, v in weight_map.items() if k.startswith(MODEL_PREFIX)})
            return "model", [path / s for s in shards]
        return "model", [file]
    return None


_VLLM_KEY = re.compile(r"^(blocks\.\d+\.layers\.\d+|lm_heads\.\d+)\.")  # vLLM's MedusaModel (export-head --format vllm)


def model_weights_hold(files: list[Path]) -> str | None:
    """What a model's weights (:func:`find_published`'s ``"model"`` files) hold, from their safetensors headers:
    ``"medusa-2"`` (``medusa_head.*`` tensors), ``"vllm"`` (vLLM's Medusa layout) or ``"none"``; None where only
    unpickling would tell (``pytorch_model.bin``) or a file is unreadable."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for file in files:  # none: an index listing no medusa_head.* tensors
        if file.suffix != ".safetensors":
            return None
        try:
            with safe_open(str(file), framework="pt") as f:
                names += f.keys()
        except (SafetensorError, OSError):
            return None
    if any(n.startswith(MODEL_PREFIX) for n in names):
        return "medusa-2"
    return "vllm" if any(_VLLM_KEY.match(n) for n in names) else "none"


# how torch.save's legacy (pre-zip) format begins: its magic number, pickled with protocol 2
_LEGACY_TORCH_START = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)[:-1]
_EXPECTED = "expected a torch.save'd state dict of Medusa head tensors (medusa_lm_head.pt)"


def _load_pickle(file: Path) -> dict:
    """A torch.save'd state dict, read with weights_only=True (memory-mapped when the format allows)."""
    with open(file, "rb") as f:
        start = f.read(len(_LEGACY_TORCH_START))
    if not start.startswith(b"PK\x03\x04") and start != _LEGACY_TORCH_START:  # a zip archive's first bytes
        raise MedusaCheckpointError(f"{file} is not a torch checkpoint (neither torch.save's zip archive nor its "
                                    f"legacy format); {_EXPECTED}")
    try:
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # the legacy (non-zip) format cannot be memory-mapped: read it whole
                raise
            obj = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        first = _first_line(err)
        raise MedusaCheckpointError(
            f"{file} holds more than tensors: torch.load(weights_only=True) refused it ({first}); specdec never "
            "unpickles arbitrary objects. Re-save only its state dict (tensors) with torch.save or safetensors"
        ) from err
    except Exception as err:  # a damaged file: torch's readers raise RuntimeError, EOFError, IndexError, ...
        raise MedusaCheckpointError(f"{file} is a damaged torch checkpoint ({type(err).__name__}: {_first_line(err)}); "
                                    f"{_EXPECTED}") from err
    if not isinstance(obj, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                            for k, v in obj.items()):
        raise MedusaCheckpointError(f"{file} is not a state dict (a dict of tensors): it holds a "
                                    f"{type(obj).__name__}")
    return obj


def _first_line(err: Exception) -> str:
    """The first line of torch's message, without its terminal styling."""
    return re.sub(r"\x1b\[[0-9;]*m", "", (str(err).strip().splitlines() or ["?"])[0])[:300]


def _read_tensors(kind: str, files: list[Path]) -> dict[str, torch.Tensor]:
    """The heads' tensors under their Medusa keys (``{head}.{layer}...``, prefix stripped)."""
    from safetensors import SafetensorError, safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        if file.suffix == ".safetensors":
            try:
                with safe_open(str(file), framework="pt") as f:
                    keys = list(f.keys())
                    if kind == "heads" and not any(k.startswith(MODEL_PREFIX) for k in keys):
                        state.update({k: f.get_tensor(k) for k in keys})
                    else:
                        state.update({k: f.get_tensor(k) for k in keys if k.startswith(MODEL_PREFIX)})
            except (SafetensorError, OSError) as err:
                raise MedusaCheckpointError(f"{file} is not a readable safetensors file: {err}") from err
        else:
            loaded = _load_pickle(file)
            if kind == "heads" and not any(k.startswith(MODEL_PREFIX) for k in loaded):
                state.update(loaded)
            else:
                state.update({k: v for k, v in loaded.items() if k.startswith(MODEL_PREFIX)})
    return {k.removeprefix(MODEL_PREFIX): v for k, v in state.items()}


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise MedusaCheckpointError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise MedusaCheckpointError(f"{file} does not hold a JSON object")
    return raw


def _base_reference(value: str, relative_to: Path) -> str:
    """``value`` as a reference other tools resolve: an existing local path made absolute (relative paths are
    tried from the working directory, then from the checkpoint's directory), else as given (a hub id)."""
    from specdec.models.loader import model_reference

    ref = model_reference(value)
    if ref == value and value and not Path(value).expanduser().is_absolute() and (relative_to / value).exists():
        return str((relative_to / value).resolve())
    return ref


def _config_vocab(raw: dict, base_ref: str) -> int | None:
    """The vocabulary size from the source's config.json, else from the base model's (a local checkpoint)."""
    if isinstance(raw.get("vocab_size"), int):
        return raw["vocab_size"]
    base = Path(base_ref)
    if base.is_dir() and (base / CONFIG_FILE).is_file():
        value = _read_config(base).get("vocab_size")
        return value if isinstance(value, int) else None
    return None


def _map_heads(state: dict[str, torch.Tensor], num_layers: int | None, where: str, independent: bool = False) \
        -> tuple[dict[str, torch.Tensor], int, int, bool]:
    """Medusa keys -> specdec's (the same names, every block present): ``(state, num_heads, num_layers, shared)``.
    ``independent``: specdec's own layout, whose blocks are distinct and all stored (not one block repeated)."""
    entries: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
    bad = [k for k in state if not _KEY.match(k)]
    if bad:
        raise MedusaCheckpointError(
            f"{where}: keys of another layout, e.g. {', '.join(sorted(bad)[:3])} (expected "
            "{head}.{layer}.linear.weight / .linear.bias and {head}.{num_layers}.weight)")
    if not state:
        raise MedusaCheckpointError(f"{where}: holds no Medusa head tensors")
    for key, tensor in state.items():
        head, layer, name = _KEY.match(key).groups()
        entries.setdefault(int(head), {})[(int(layer), name)] = tensor
    num_heads = max(entries) + 1
    missing = sorted(set(range(num_heads)) - set(entries))
    if missing:
        raise MedusaCheckpointError(f"{where}: heads {missing} are missing (the heads stored go up to "
                                    f"{num_heads - 1})")
    lm_layers = {layer for e in entries.values() for (layer, name) in e if name in ("weight", "bias")}
    block_layers = {layer for e in entries.values() for (layer, name) in e if name.startswith("linear.")}
    if num_layers is None:  # no config: the LM head's index, else the blocks stored
        num_layers = min(lm_layers) if lm_layers else max(block_layers, default=-1) + 1
    shared = not lm_layers
    out: dict[str, torch.Tensor] = {}
    for head in range(num_heads):
        e = entries[head]
        for (layer, name) in e:
            if name in ("weight", "bias") and layer != num_layers:
                raise MedusaCheckpointError(
                    f"{where}: {head}.{layer}.{name} is not where a head with medusa_num_layers={num_layers} keeps "
                    f"its LM head ({head}.{num_layers}.weight)")
            if name.startswith("linear.") and layer >= num_layers:
                raise MedusaCheckpointError(f"{where}: {head}.{layer}.{name} is a block beyond "
                                            f"medusa_num_layers={num_layers}")
        if (num_layers, "bias") in e:
            raise MedusaCheckpointError(
                f"{where}: {head}.{num_layers}.bias: this LM head has a bias, which specdec's Medusa LM heads (as "
                "Medusa's) do not have; it cannot be converted exactly")
        if shared != ((num_layers, "weight") not in e):
            raise MedusaCheckpointError(f"{where}: some heads have their own LM head ({{head}}.{num_layers}.weight) "
                                        f"and some do not (head {head})")
        stored = []
        for layer in range(num_layers):
            w, b = e.get((layer, "linear.weight")), e.get((layer, "linear.bias"))
            if (w is None) != (b is None):
                have, lack = ("weight", "bias") if b is None else ("bias", "weight")
                raise MedusaCheckpointError(f"{where}: block {head}.{layer} has a linear.{have} but no linear.{lack}")
            if w is not None:
                stored.append((layer, w, b))
        if (not stored and num_layers) or (independent and len(stored) < num_layers):
            raise MedusaCheckpointError(f"{where}: head {head} stores {len(stored) or 'none'} of its {num_layers} "
                                        "residual blocks")
        if not independent and len(stored) > 1:
            _, w0, b0 = stored[0]
            for layer, w, b in stored[1:]:
                if not (torch.equal(w, w0) and torch.equal(b, b0)):
                    raise MedusaCheckpointError(
                        f"{where}: head {head} stores blocks {stored[0][0]} and {layer} with different weights; "
                        "Medusa's heads repeat one block ([ResBlock] * medusa_num_layers) and its loader would keep "
                        "only the last copy, so which weights are meant is ambiguous")
        by_layer = {layer: (w, b) for layer, w, b in stored}
        for layer in range(num_layers):
            w, b = by_layer.get(layer, (stored[0][1], stored[0][2]))  # a dropped copy of the repeated block
            out[f"{head}.{layer}.linear.weight"], out[f"{head}.{layer}.linear.bias"] = w, b
        if not shared:
            out[f"{head}.{num_layers}.weight"] = e[(num_layers, "weight")]
    return out, num_heads, num_layers, shared


def _existing(source: str | os.PathLike) -> Path:
    """``source`` as a path, refused where nothing is there: convert-medusa downloads nothing."""
    src = Path(source).expanduser()
    if not src.exists():
        raise MedusaCheckpointError(
            f"{src} does not exist; convert-medusa reads local files only (download the repository first, e.g. "
            "huggingface-cli download FasterDecoding/medusa-vicuna-7b-v1.3 --local-dir DIR)")
    return src


def read_published(source: str | os.PathLike, base_model: str | None = None,
                   medusa_choices=None, vocab_size: int | None = None) -> tuple[MedusaConfig, dict]:
    """Read published Medusa heads (see the module docstring for the layouts) into ``(MedusaConfig, state)``,
    ``state`` keyed as ``MedusaHeads.heads``. ``base_model`` overrides the base model recorded;
    ``vocab_size`` is used for heads that share the base model's LM head when no config gives it."""
    src = _existing(source)
    found = find_published(src)
    if found is None:
        raise MedusaCheckpointError(
            f"{src}: no Medusa weights found (expected {PUBLISHED_PICKLE}, {WEIGHTS_FILE}, or a model's weights "
            f"with {MODEL_PREFIX}* tensors: {', '.join(MODEL_WEIGHTS)})")
    kind, files = found
    directory = src if src.is_dir() else src.parent
    raw = _read_config(directory)
    if kind == "heads" and raw.get("draft_vocab"):
        raise MedusaCheckpointError(f"{src} is already specdec's Medusa layout (with a draft_vocab): load it "
                                    "directly with --drafter medusa --drafter-option path=...")
    choices_from = "the medusa_choices given"
    ours = kind == "heads" and "medusa_shared_lm_head" in raw  # config.json as specdec writes it (MedusaConfig)
    if medusa_choices is not None:  # refused as the drafter's option refuses it (a repeat, an empty list)
        try:
            check_paths(medusa_choices)
        except InputError as err:
            raise MedusaCheckpointError(f"{choices_from}: {err}") from err
    elif kind == "heads":
        medusa_choices = raw.get("medusa_choices")  # specdec's own layout keeps its tree
        choices_from = str(directory / CONFIG_FILE)
    if kind == "model" and not files:
        raise MedusaCheckpointError(f"{src}: the model's weights index lists no {MODEL_PREFIX}* tensors: "
                                    "this is not a Medusa-2 checkpoint")
    state = _read_tensors(kind, files)
    where = str(src if src.is_file() else files[0] if len(files) == 1 else src)
    if kind == "model" and not state:
        raise MedusaCheckpointError(f"{where}: the model's weights hold no {MODEL_PREFIX}* tensors: this is not a "
                                    "Medusa-2 checkpoint")
    layers = raw.get("medusa_num_layers")
    if layers is not None and (not isinstance(layers, int) or isinstance(layers, bool) or layers < 0):
        raise MedusaCheckpointError(f"{directory / CONFIG_FILE}: medusa_num_layers must be an integer >= 0, "
                                    f"got {layers!r}")
    state, num_heads, num_layers, shared = _map_heads(state, layers, where, independent=ours)
    promised = raw.get("medusa_num_heads")
    if isinstance(promised, int) and promised > num_heads:
        raise MedusaCheckpointError(f"{directory / CONFIG_FILE} promises medusa_num_heads={promised} but {where} "
                                    f"stores {num_heads} heads")
    if isinstance(promised, int) and promised < num_heads:
        logger.warning("%s says medusa_num_heads=%d but %s stores %d heads: converting all %d", directory / CONFIG_FILE,
                       promised, where, num_heads, num_heads)
    if base_model is not None:
        base_ref = _base_reference(str(base_model), Path.cwd())
    elif kind == "model":
        base_ref = str(directory.resolve())  # fine-tuned together with its heads: this checkpoint is the base
    else:
        base_ref = _base_reference(str(raw.get("base_model_name_or_path") or ""), directory)
    if not base_ref:
        raise MedusaCheckpointError(f"{src}: no base_model_name_or_path in {directory / CONFIG_FILE}: pass "
                                    "--base-model (the hub id or path of the model these heads were trained on)")
    first = next(iter(state.values()))
    hidden = int(first.shape[-1])
    vocab = None if shared else int(state[f"0.{num_layers}.weight"].shape[0])
    if vocab is None:
        vocab = _config_vocab(raw, base_ref) or vocab_size
        if vocab is None:
            raise MedusaCheckpointError(
                f"{where}: these heads share the base model's LM head, so the vocabulary size is not in their "
                "weights and no config gives it: pass --base-model with a local checkpoint directory")
    for key, tensor in state.items():
        name = _KEY.match(key).group(3)
        want = (vocab, hidden) if name == "weight" else (hidden,) if name == "linear.bias" else (hidden, hidden)
        if tuple(tensor.shape) != want:
            raise MedusaCheckpointError(f"{where}: {key} has shape {list(tensor.shape)}, expected {list(want)} "
                                        f"(hidden_size={hidden}, vocab_size={vocab})")
    try:
        config = MedusaConfig(num_heads=num_heads, num_layers=num_layers, hidden_size=hidden, vocab_size=vocab,
                              shared_lm_head=shared, base_model_name_or_path=base_ref,
                              medusa_choices=tuple(tuple(p) for p in medusa_choices or ()))
    except (ValueError, TypeError) as err:
        raise MedusaCheckpointError(f"{choices_from}: {err}") from err
    return config, state


def convert_published(source: str | os.PathLike, output_dir: str | os.PathLike, base_model: str | None = None,
                      medusa_choices=None, overwrite: bool = False) -> Path:
    """Read published heads (:func:`read_published`) and write specdec's layout (config.json +
    medusa_lm_head.safetensors) to ``output_dir``; load it with ``drafter="medusa"``, option ``path``."""
    out = Path(output_dir).expanduser()
    src = _existing(source)  # the first problem to name: a missing source, not the output directory's contents
    src_dir = src if src.is_dir() else src.parent
    if out.exists() and src_dir.exists() and out.resolve() == src_dir.resolve():
        raise MedusaCheckpointError(f"--output-dir {out} is the source's own directory: its config.json would be "
                                    "replaced; choose another directory")
    check_creatable(out, "--output-dir")  # a file in the way: named now, not as [Errno 17] after reading the heads
    existing = [n for n in (CONFIG_FILE, WEIGHTS_FILE) if (out / n).exists()]
    if existing and not overwrite:
        raise MedusaCheckpointError(f"{out} already holds {', '.join(existing)}: pass --overwrite to replace it, or "
                                    "choose another --output-dir")
    if existing:
        _check_previous_conversion(out)
    if sticky_for_others(out, existing):  # its config is deleted, the weights renamed over: "Operation not permitted"
        raise MedusaCheckpointError(f"--overwrite cannot replace the previous conversion in {out}: it has the sticky "
                                    "bit (as /tmp) and the conversion is another user's, which only its owner may "
                                    "replace there; choose another --output-dir")
    config, state = read_published(src, base_model, medusa_choices)
    with torch.device("meta"):  # the module only checks names and shapes; the tensors are assigned as read
        heads = MedusaHeads(config)
    seen: set[int] = set()
    tensors = {}
    for key, tensor in state.items():  # blocks repeated from one stored copy share memory: safetensors wants copies
        ptr = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if ptr in seen else tensor
        seen.add(ptr)
    try:
        heads.heads.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as err:  # a mapping bug, not the user's file: say so plainly
        raise MedusaCheckpointError(f"{src}: the converted heads do not fit MedusaHeads: {err}") from err
    save_medusa(heads, out)
    logger.info("converted %d Medusa head(s) (%d residual block(s) each, %s LM head, %s) from %s to %s",
                config.num_heads, config.num_layers, "shared" if config.shared_lm_head else "own",
                next(iter(state.values())).dtype, src, out)
    return out


def _check_previous_conversion(out: Path) -> None:
    """--overwrite replaces a previous conversion only: a directory holding exactly config.json (a Medusa one) and
    medusa_lm_head.safetensors (and leftovers of their atomic writes), never a model's or a training run's files."""
    others = sorted(p.name for p in out.iterdir()
                    if (leftover_of(p.name) or p.name) not in (CONFIG_FILE, WEIGHTS_FILE))
    if others:
        raise MedusaCheckpointError(f"--overwrite will not write into {out}: it holds more than a previous conversion "
                                    f"({', '.join(others[:5])}); choose another --output-dir")
    try:
        config = json.loads((out / CONFIG_FILE).read_text()) if (out / CONFIG_FILE).is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict) or (config and "medusa_num_heads" not in config):
        raise MedusaCheckpointError(f"--overwrite will not replace {out / CONFIG_FILE}: it is not a Medusa heads "
                                    "config (a model's?); choose another --output-dir")
