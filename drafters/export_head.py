"""``specdec export-head``: write a specdec head in a layout that vLLM or SGLang serves.

    specdec export-head eagle3-head/ --format speculators --output-dir serve/eagle3   # vllm serve reads it
    specdec export-head eagle3-head/ --format sglang --output-dir serve/eagle3-sglang
    specdec export-head medusa-heads/ --format vllm --output-dir serve/medusa

* EAGLE-3 heads (any layout the eagle drafter loads): ``speculators`` (vLLM reads it directly; ``vllm`` is an
  alias) or ``sglang`` (EAGLE's own layout, ``midlayer.*``); :mod:`specdec.drafters.head_layouts`.
* Medusa heads with their own LM heads: vLLM's Medusa layout (``blocks.{h}.layers.{l}``, ``lm_heads.{h}``,
  ``model_type: medusa``; a reduced draft vocabulary as ``token_map`` with ``truncated_vocab_size``).
* EAGLE-1 heads: no serving engine loads specdec's layer (its input / output norms and reduced head), so the
  command refuses in one line. A directory holding no draft head (a model, say) is refused naming what was expected.

Every config names the target model: ``--target`` (a local directory as an absolute path), else the base model the
head recorded when it was trained. Where that target's config.json is on this machine, a head made for another target
is refused, naming both sides; an EAGLE-3 head reading the target's last residual stream (layer L, which specdec's
heads of targets of 2 to 6 layers read) exports with a warning: vLLM and SGLang capture only the streams
entering layers 0 to L - 1.
"""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from specdec.drafters.cli import EXPORT_FORMATS as FORMATS
from specdec.drafters.eagle_checkpoint import (
    CONFIG_FILE,
    PICKLES,
    WEIGHTS_FILE,
    EagleCheckpointError,
    _read_config,
    _read_weights,
    check_fits_target,
    read_json_object,
)
from specdec.drafters.eagle_model import EagleModel

from specdec.atomic_write import leftover_of, save_tensors, write_json
from specdec.errors import InputError, SpecdecError
from specdec.output_dirs import check_creatable, sticky_for_others

logger = logging.getLogger(__name__)


def export_head(source: str | Path, fmt: str, output_dir: str | Path, target: str | None = None,
                overwrite: bool = False) -> tuple[Path, str]:
    """Write the head at ``source`` in ``fmt`` to ``output_dir``; returns the directory and what was written. A
    non-empty ``output_dir`` is refused unless ``overwrite``, and then written only over an earlier export."""
    from specdec.drafters.medusa_heads import WEIGHTS_FILE as MEDUSA_WEIGHTS

    src, out = Path(source), Path(output_dir)
    if fmt not in FORMATS:
        raise InputError(f"export-head: --format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if not src.exists():
        raise InputError(f"export-head: {src} does not exist")
    if not src.is_dir():
        raise InputError(f"export-head: {src} is not a head directory")
    if out.resolve() == src.resolve():
        raise InputError(f"export-head: --output-dir {out} is the source's own directory")
    _check_output_dir(out, overwrite)
    if (src / MEDUSA_WEIGHTS).is_file():
        return _export_medusa(src, fmt, out, target), "Medusa heads"
    if not (src / CONFIG_FILE).is_file() or not ((src / WEIGHTS_FILE).is_file() or
                                                 any((src / n).exists() for n in PICKLES)):
        raise _no_head(src, f"it has no {CONFIG_FILE} + {WEIGHTS_FILE}")
    return _export_eagle(src, fmt, out, target), "an EAGLE-3 head"


def _no_head(src: Path, why: str) -> InputError:
    from specdec.drafters.medusa_heads import WEIGHTS_FILE as MEDUSA_WEIGHTS

    return InputError(f"export-head: {src} holds no draft head ({why}); expected a head directory: Medusa heads "
                      f"({MEDUSA_WEIGHTS}) or an EAGLE-3 head ({CONFIG_FILE} + {WEIGHTS_FILE} with fc.* "
                      "tensors), as train-medusa and train-eagle --arch eagle3 write them")


def _check_output_dir(out: Path, overwrite: bool) -> None:
    """Nothing in ``out`` is replaced unasked (a head or model there would be broken by another config.json), and
    with ``overwrite`` only an earlier export is (its config and weights, and leftovers of their atomic writes)."""
    if out.exists() and not out.is_dir():
        raise InputError(f"export-head: --output-dir {out} exists and is not a directory")
    check_creatable(out, "export-head: --output-dir")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if held and not overwrite:
        raise InputError(f"export-head: --output-dir {out} is not empty ({', '.join(held[:5])}); pass --overwrite to "
                         "replace an earlier export there, or name another directory")
    others = [n for n in held if (leftover_of(n) or n) not in (CONFIG_FILE, WEIGHTS_FILE)]
    if others:
        raise InputError(f"export-head: --overwrite will not write into {out}: it holds more than an earlier export "
                         f"({', '.join(others[:5])}); name another directory")
    if sticky_for_others(out, {CONFIG_FILE, WEIGHTS_FILE}):  # each write renames over one: "Operation not permitted"
        raise InputError(f"export-head: --overwrite cannot replace the earlier export in {out}: it has the sticky bit "
                         "(as /tmp) and the export is another user's, which only its owner may replace there; name "
                         "another directory")


def _target(recorded: str, given: str | None, src: Path) -> tuple[str, str]:
    """The target the export names (``--target`` as other tools resolve it: a local path made absolute), and how to
    name it in an error."""
    from specdec.models.loader import model_reference, path_like

    if given:
        if path_like(given) and not Path(given).expanduser().exists():  # else the export names a missing target
            raise InputError(f"export-head: --target {given} does not exist: give the target's checkpoint directory, "
                             "or its hub id (org/name)")
        return model_reference(given), f"--target {given}"
    if not recorded:
        raise InputError(f"export-head: {src} records no target model; name it with --target (hub id or path)")
    return recorded, f"its recorded target {recorded}"


def _target_config(name: str):
    """The transformers config of the target ``name`` where its config.json is on this machine (a local checkpoint,
    the embedded default's converted copy for its hub id, or a hub id's copy in the Hugging Face cache); else None,
    with a warning that the export is not checked (specdec downloads nothing)."""
    from transformers import AutoConfig

    from specdec.models import embedded
    from specdec.models.loader import EMBEDDED_HUB_ID, config_dir

    where = Path(name).expanduser()
    if name == EMBEDDED_HUB_ID and not where.exists():
        try:
            where = config_dir(embedded.DEFAULT_ALIAS)
        except (SpecdecError, OSError):  # the wheel is not installed: the cache may hold it
            pass
    try:
        if (where / CONFIG_FILE).is_file():
            return AutoConfig.from_pretrained(str(where)).get_text_config()
        if not where.exists():  # a hub id: its copy in the cache, never a download
            return AutoConfig.from_pretrained(name, local_files_only=True).get_text_config()
    except (OSError, ValueError):  # not in the cache, or a config transformers cannot read
        pass
    logger.warning("the export is not checked against its target %s: no config.json of it on this machine "
                   "(specdec downloads nothing)", name)
    return None


@contextmanager
def _writing(out: Path):
    """A write into ``out`` that fails (no permission, a full disk) as one line naming it (save_tensors says
    safetensors' refusals of the disk as OSErrors)."""
    try:
        yield
    except OSError as err:
        why = err.strerror or str(err)
        raise InputError(f"export-head: cannot write into --output-dir {out}: {why}") from err


def _export_eagle(src: Path, fmt: str, out: Path, target: str | None) -> Path:
    from specdec.drafters.head_layouts import is_eagle3, is_eagle_layer, layer_model_type, read_eagle3, write_eagle3

    raw, state = _read_config(src), _read_weights(src)
    if not is_eagle_layer(raw, state):
        looks = f": it looks like a {layer_model_type(raw)} model" if layer_model_type(raw) else ""
        raise _no_head(src, f"{WEIGHTS_FILE} has no fc.* tensors{looks}")
    if not is_eagle3(raw, state):
        raise EagleCheckpointError(f"export-head: {src} is an EAGLE-1 head; vLLM and SGLang load no layout of "
                                   "specdec's EAGLE-1 layer (input / output norms, reduced LM head): use EAGLE-3")
    config, tensors = read_eagle3(raw, state, str(src))
    try:
        model = EagleModel.from_state(config, tensors)
    except RuntimeError as err:
        raise EagleCheckpointError(f"{src}: the weights do not match config.json "
                                   f"({str(err).splitlines()[0]})") from err
    name, named = _target(config.base_model_name_or_path, target, src)
    target_config = _target_config(name)
    if target_config is not None:
        check_fits_target(config, target_config, f"export-head: {src} does not fit {named}")
        _warn_unservable(src, config.feature_layers, int(target_config.num_hidden_layers))
    with _writing(out):
        return write_eagle3(model, out, "sglang" if fmt == "sglang" else "speculators", name, _architectures(name))


def _warn_unservable(src: Path, feature_layers: tuple[int, ...], depth: int) -> None:
    """vLLM's and SGLang's Llama capture a feature as the residual stream entering a layer (its input plus the
    residual carried beside it), for layers 0 to depth - 1 only, and at layer 0 there is no residual yet to add
    (their forward fails on it): a head reading the stream after the last layer, or the embeddings, runs in specdec
    only. Only targets too shallow for EAGLE-3's published ids (2 to 6 layers: the ids must rise) get such defaults."""
    why = []
    if max(feature_layers) >= depth:
        why.append(f"they capture only the streams entering layers 0 to {depth - 1} of the target's {depth}")
    if 0 in feature_layers:
        why.append("their Llama adds a residual stream that does not exist before layer 0")
    if why:
        logger.warning("%s reads feature layers %s, which vLLM and SGLang cannot serve (%s); specdec's eagle drafter "
                       "can", src, list(feature_layers), "; ".join(why))


def _architectures(target: str) -> list[str]:
    """The target's ``architectures`` from its config.json where ``target`` is a local checkpoint (speculators
    records them for the verifier); [] for a hub id, as speculators leaves them until it reads the hub's config."""
    config = Path(target).expanduser() / CONFIG_FILE
    try:
        found = json.loads(config.read_text()).get("architectures") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        return []
    return [str(a) for a in found] if isinstance(found, list) else []


def _export_medusa(src: Path, fmt: str, out: Path, target: str | None) -> Path:
    from specdec.drafters.medusa_heads import load_medusa

    if fmt != "vllm":
        raise InputError(f"export-head: Medusa heads are written in vLLM's layout (--format vllm), not {fmt!r}")
    raw = read_json_object(src / CONFIG_FILE, f"{src} holds Medusa heads without their {CONFIG_FILE}")
    name, _ = _target(str(raw.get("base_model_name_or_path") or ""), target, src)
    target_config = _target_config(name)
    sizes = (target_config.hidden_size, target_config.vocab_size) if target_config is not None else ()
    heads = load_medusa(src, *sizes, dtype=None)  # as stored: a half-precision head is not written twice the size
    c = heads.config
    if c.shared_lm_head:
        raise InputError("export-head: vLLM's Medusa layout needs each head's own LM head; these heads share the "
                         "target's")
    tensors = {}
    for key, value in heads.heads.state_dict().items():
        head, layer, *rest = key.split(".")
        if int(layer) == c.num_layers:  # the head's LM head
            tensors[f"lm_heads.{head}.weight"] = value
        else:  # {head}.{layer}.linear.{weight,bias}
            tensors[f"blocks.{head}.layers.{layer}.{rest[-1]}"] = value
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    if c.draft_vocab:  # vLLM scatters row j of each head's logits to token token_map[j]
        tensors["token_map"] = torch.tensor(c.draft_vocab, dtype=torch.int64)
    config = {"architectures": ["MedusaModel"], "model_type": "medusa", "hidden_size": c.hidden_size,
              "vocab_size": c.vocab_size, "truncated_vocab_size": len(c.draft_vocab) or c.vocab_size,
              "num_heads": c.num_heads,
              "num_hidden_layers": c.num_layers, "original_lm_head": False,
              "medusa_fc_bias": any(k.endswith(".bias") for k in tensors),
              "base_model_name_or_path": name}
    with _writing(out):
        out.mkdir(parents=True, exist_ok=True)
        save_tensors(out / "model.safetensors", tensors, metadata={"format": "pt"})
        write_json(out / CONFIG_FILE, config, indent=2)
    return out
