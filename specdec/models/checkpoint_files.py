"""What a checkpoint directory must hold for specdec to load it, checked around transformers' ``from_pretrained``.

Before the weights are read (:func:`check_before_load`, from config.json alone, so a 50 GB model of an unsupported
kind is refused in milliseconds):

* config.json is a JSON object whose ``model_type`` specdec runs (:data:`specdec.models.llama.SUPPORTED_MODEL_TYPES`)
  and that declares no ``quantization_config``;
* the weights are safetensors: pickles (``pytorch_model.bin``, ``*.pt``) are never loaded, since unpickling a file
  can run code (``torch.load(weights_only=True)`` narrows that, it does not remove it); a one-line refusal says how
  to convert them once, where the file is trusted.

After (:func:`check_loaded`, from transformers' loading info): every tensor the model needs came from the files, in
its shape. transformers fills a missing one (a tensor the index names but its shard lacks, an untied ``lm_head``
saved tied) with random values and only warns; specdec would then run another model than the checkpoint's, so it
refuses. Extra tensors (an MTP layer, Medusa heads kept in the model's weights) are the model's to ignore and a
drafter's to read: one INFO line. transformers' own many-line LOAD REPORT of the same facts is left out while
specdec loads (:func:`own_load_report`), so a refusal is one line and a checkpoint with extra tensors loads quietly.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specdec.errors import InputError, ModelNotFoundError
from specdec.models.installed_versions import check_written_by
from specdec.models.llama import SUPPORTED_MODEL_TYPES, UnsupportedModelError, check_rope_type, rope_type
from specdec.models.runnable import quant_method, quantized_refusal

logger = logging.getLogger(__name__)

CONFIG = "config.json"
HF_LOADING_LOGGER = "transformers.modeling_utils"  # where transformers logs its LOAD REPORT
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
SHARD_INDEX = "model.safetensors.index.json"


def check_before_load(path: Path) -> dict[str, Any]:
    """The parsed config.json of the checkpoint directory ``path``, or a one-line error naming what is wrong."""
    file = path / CONFIG
    if not file.is_file():
        raise ModelNotFoundError(f"{path} is not a transformers checkpoint directory (looked for {file.resolve()})")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(f"{file} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise InputError(f"{file} must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type is None:
        raise InputError(f"{file} has no model_type; specdec runs the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(f"model type {model_type!r} is not supported; specdec runs the Llama family: "
                                    f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    check_written_by(file, config.get("transformers_version"))
    # the RoPE transformers builds: a non-empty rope_scaling replaces rope_parameters whole (an untyped one is the
    # default RoPE); its rotary init fails on a type it does not know with a bare KeyError
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if isinstance(config.get(key), dict):
        check_rope_type(rope_type(config[key]), f" ({file.name} {key})")
    quantization = config.get("quantization_config")
    if quantization is not None:
        raise quantized_refusal(quant_method(quantization), f"{file} quantization_config")
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
        if pickles:
            raise InputError(
                f"{path}: its weights are pickles ({', '.join(pickles[:3])}), which specdec never loads (unpickling "
                "can run code); convert them to safetensors once, where the file is trusted: python -c \"from "
                "transformers import AutoModelForCausalLM as M; "
                f"M.from_pretrained('{path}').save_pretrained('{path}')\"")
        raise InputError(f"{path} holds no weights (no *.safetensors file next to {CONFIG})")
    index = path / SHARD_INDEX
    if not (path / "model.safetensors").is_file() and index.is_file():  # what transformers reads the shards by
        try:
            json.loads(index.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as err:  # else json's message alone, naming no file
            raise InputError(f"{index} is not valid JSON ({err})") from None
    return config


class _LoadReportFilter(logging.Filter):
    """Drops transformers' LOAD REPORT, except one of conversion errors (which transformers raises on, pointing at
    the report, and check_loaded does not read)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return "LOAD REPORT" not in message or "CONVERSION" in message


@contextmanager
def own_load_report() -> Iterator[None]:
    """transformers' LOAD REPORT left out of the logs while this block loads: :func:`check_loaded` says what it
    says (a table of many lines on stderr that called a refused checkpoint's missing tensors "newly initialized",
    and every extra tensor of an MTP checkpoint "UNEXPECTED ... not ok")."""
    report_filter = _LoadReportFilter()
    hf_logger = logging.getLogger(HF_LOADING_LOGGER)
    hf_logger.addFilter(report_filter)
    try:
        yield
    finally:
        hf_logger.removeFilter(report_filter)


def check_loaded(path: Path, info: dict[str, Any]) -> None:
    """A one-line InputError when transformers' loading ``info`` (``output_loading_info=True``, loaded with
    ``ignore_mismatched_sizes=True`` so that a wrong shape reaches here) shows a tensor the model needs that the
    files did not provide, or provided in another shape; extra tensors are logged (INFO)."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k[0]) if isinstance(k, tuple) else str(k) for k in info.get("mismatched_keys") or ())
    bad = missing + mismatched
    if bad:
        what = "lack" if missing else "have the wrong shape for"
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise InputError(f"{path}: the weights {what} {len(bad)} tensor(s) the model needs ({shown}); transformers "
                         "would fill them with random values, so specdec refuses: the checkpoint is incomplete (a "
                         "missing shard entry?) or does not match its config.json (e.g. tie_word_embeddings)")
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        logger.info("%s: %d tensor(s) of the files are not the model's and stay unused by it (%s%s); a drafter may "
                    "read them (an MTP layer, Medusa heads)", path, len(unexpected), ", ".join(unexpected[:3]),
                    f" and {len(unexpected) - 3} more" if len(unexpected) > 3 else "")
