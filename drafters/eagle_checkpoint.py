"""EAGLE checkpoints: a directory with ``config.json`` + ``model.safetensors``, checked against the target.

    save_eagle(model, "eagle-smollm2/")
    model = load_eagle("eagle-smollm2/", target_hf_config)

The weights use the published EAGLE-1 key layout (``fc.*``, ``layers.0.*``; an ``embed_tokens.weight``
in a published checkpoint is ignored: the target's embedding is used) plus, for a reduced draft
vocabulary, ``lm_head.weight`` [N, H] and EAGLE-3's ``d2t`` map (token id = index + d2t[index]).
``config.json`` is a Llama-style config (``hidden_size``, ``num_attention_heads``, ...) as published
EAGLE checkpoints have, plus a ``specdec_eagle`` section with what specdec adds (tree shape, feature
count, base model). Pickled weights (``pytorch_model.bin``) are refused, with how to convert them.
EAGLE-3 heads in the layouts of EAGLE, SGLang, speculators and vLLM load too
(:mod:`specdec.drafters.head_layouts`).
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from specdec.drafters.eagle_model import UNRECORDED_CONTEXT, EagleConfig, EagleModel
from specdec.drafters.eagle_rope import config_entries, read_rope

from specdec.atomic_write import save_tensors, write_json
from specdec.errors import SpecdecError

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PICKLES = ("pytorch_model.bin", "pytorch_model.pt", "model.pt", "model.bin")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


class EagleCheckpointError(SpecdecError, ValueError):
    """An EAGLE checkpoint is missing, unreadable, or made for another target."""


def save_eagle(model: EagleModel, directory: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write config.json + model.safetensors (atomically, file by file)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_tensors(path / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    eagle3 = {"arch": "eagle3", "feature_layers": list(c.feature_layers),
              "norm_before_residual": c.norm_before_residual} if c.arch == "eagle3" else {}
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps, **config_entries(c),
        "max_position_embeddings": c.max_position_embeddings, "draft_vocab_size": len(c.draft_vocab) or c.vocab_size,
        "specdec_eagle": {"num_features": c.num_features, "depth": c.depth, "top_k": c.top_k,
                          "max_nodes": c.max_nodes, "base_model_name_or_path": c.base_model_name_or_path,
                          **eagle3, **(extra or {})},
    }
    write_json(path / CONFIG_FILE, config, indent=2)
    return path


def _read_config(path: Path) -> dict:
    return read_json_object(path / CONFIG_FILE, f"{path} is not an EAGLE checkpoint: {CONFIG_FILE} is missing")


def read_json_object(file: Path, missing: str) -> dict:
    """The JSON object in ``file``; ``missing``: the message when there is no such file."""
    if not file.is_file():
        raise EagleCheckpointError(missing)
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise EagleCheckpointError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise EagleCheckpointError(f"{file} must hold a JSON object")
    return raw


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickled = [n for n in PICKLES if (path / n).exists()]
        if pickled:
            raise EagleCheckpointError(
                f"{path}: only {pickled[0]} (a pickle) is there, and pickles are never loaded (they can run code); "
                f"convert it once in a trusted environment: python -c \"import torch; from safetensors.torch import "
                f"save_file; save_file(torch.load('{pickled[0]}', weights_only=True), '{WEIGHTS_FILE}')\"")
        from specdec.drafters.medusa_heads import WEIGHTS_FILE as MEDUSA_WEIGHTS

        medusa = (f" ({path} holds Medusa heads: --drafter medusa --drafter-option path={path})"
                  if (path / MEDUSA_WEIGHTS).is_file() else "")
        raise EagleCheckpointError(f"{path}: {WEIGHTS_FILE} is missing{medusa}")
    try:
        # owned copies, not views of the file's memory map: a checkpoint overwritten in place (or truncated) while a
        # drafter holds it must not change its weights, or crash the process (the model takes these tensors as
        # its parameters: EagleModel.from_state)
        state = {name: tensor.clone() for name, tensor in load_file(str(file)).items()}
    except (SafetensorError, OSError, ValueError) as err:
        raise EagleCheckpointError(f"{file} is not a readable safetensors file: {err}") from err
    # a damaged or diverged checkpoint: its drafts would be garbage (NaN draft logits), so say so at load
    broken = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if broken:
        raise EagleCheckpointError(f"{file}: weights hold NaN or infinite values ({', '.join(sorted(broken)[:5])}); "
                                   "the checkpoint is damaged or its training diverged")
    return state


def _num_features(raw: dict, state: dict[str, torch.Tensor], hidden: int) -> int:
    fc = state.get("fc.weight")
    if any(k.startswith("midlayer.") for k in state) and fc is not None:
        return max(1, int(fc.shape[1]) // hidden)  # EAGLE-3: fc fuses low / middle / high features [H, 3H]
    extra = raw.get("specdec_eagle") or {}
    return int(extra.get("num_features", 1))


def config_from_checkpoint(raw: dict, state: dict[str, torch.Tensor], where: str) -> EagleConfig:
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        extra = raw.get("specdec_eagle") or {}
        theta, rope = read_rope(raw, where)
        ids: tuple[int, ...] = ()
        if "d2t" in state:
            d2t = state["d2t"].long()
            ids = tuple((d2t + torch.arange(d2t.numel())).tolist())
        return EagleConfig(
            hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads), vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=theta, rope_scaling=rope,
            num_features=_num_features(raw, state, hidden), draft_vocab=ids, norms="norm.weight" in state,
            base_model_name_or_path=str(extra.get("base_model_name_or_path", "")),
            max_position_embeddings=int(raw.get("max_position_embeddings") or UNRECORDED_CONTEXT),
            **{k: int(extra[k]) for k in ("depth", "top_k", "max_nodes") if k in extra})
    except KeyError as err:
        raise EagleCheckpointError(f"{where}: config.json lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise EagleCheckpointError(f"{where}: {err}") from None


def check_fits_target(c: EagleConfig, target_config, where: str, model_type: str | None = None) -> None:
    """Refuse a draft layer made for another target, naming both sides."""
    want = EagleConfig.for_target(target_config)
    if model_type is not None and model_type not in LLAMA_FAMILY:
        raise EagleCheckpointError(f"{where}: the draft layer is of type {model_type!r} but the target is a "
                                   f"{getattr(target_config, 'model_type', '?')!r} (Llama-family) model")
    if c.arch == "eagle3":
        depth = int(target_config.num_hidden_layers)
        if max(c.feature_layers) > depth:
            raise EagleCheckpointError(f"{where}: the head reads target layers {list(c.feature_layers)} but the "
                                       f"target model has {depth} layers: it was made for another target")
    elif c.num_features != 1:
        raise EagleCheckpointError(f"{where}: the checkpoint fuses {c.num_features} target features per position "
                                   "(EAGLE-3) but names no feature layers")
    for name in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
        mine, theirs = getattr(c, name), getattr(want, name)
        if mine != theirs:
            raise EagleCheckpointError(f"{where}: the checkpoint has {name}={mine} but the target model has "
                                       f"{name}={theirs}: it was made for another target")


def _what_it_holds(path: Path, raw: dict, state: dict[str, torch.Tensor]) -> str:
    """What a directory given as an EAGLE head holds instead of one, as far as its config and tensor names tell."""
    from specdec.drafters.head_layouts import layer_model_type

    if raw.get("model_type") == "medusa" or any(name.startswith(("blocks.", "lm_heads.")) for name in state):
        return (f"{path} holds vLLM's Medusa serving layout (as `specdec export-head --format vllm` writes it), which "
                "specdec does not read back: pass the directory it was exported from to --drafter medusa")
    kind = layer_model_type(raw)
    return f"it looks like a {kind} model's weights, not a draft head" if kind else "it is not a draft head"


def load_eagle(directory: str | os.PathLike, target_config, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu") -> EagleModel:
    """Load and check a checkpoint against ``target_config`` (the target's transformers config)."""
    path = Path(directory)
    if not path.is_dir():
        raise EagleCheckpointError(f"EAGLE checkpoint directory not found: {path}")
    from specdec.drafters.head_layouts import is_eagle3, is_eagle_layer, layer_model_type, read_eagle3

    raw = _read_config(path)
    state = _read_weights(path)
    if is_eagle3(raw, state):
        config, state = read_eagle3(raw, state, str(path), target_config)
    elif not is_eagle_layer(raw, state):  # as export-head refuses it
        raise EagleCheckpointError(f"{path}: {WEIGHTS_FILE} holds no EAGLE draft layer (no fc.* tensors): "
                                   f"{_what_it_holds(path, raw, state)}")
    else:
        config = config_from_checkpoint(raw, state, str(path))
        state = {k: v for k, v in state.items() if k != "embed_tokens.weight"}  # the target's embedding is used
    check_fits_target(config, target_config, str(path), layer_model_type(raw))
    try:
        model = EagleModel.from_state(config, state)
    except RuntimeError as err:
        first = str(err).splitlines()[0]
        raise EagleCheckpointError(f"{path}: the weights do not match config.json ({first})") from err
    logger.info("loaded an EAGLE draft layer from %s (draft vocabulary %d)", path,
                len(config.draft_vocab) or config.vocab_size)
    return model.to(device=device, dtype=dtype).eval()
