"""The "mtp" drafter: the target's own multi-token-prediction layer drafts a dynamic tree, as EAGLE's layer does.

    generate(model, ids, drafter="mtp")                       # the MTP layer stored in the target's checkpoint
    specdec generate --model ./mimo-like --drafter mtp --drafter-option depth=3

Checkpoints that ship MTP layers beside a Llama-family decoder keep them in the target's own safetensors files
(transformers ignores them when it loads the target). Two key layouts are read, the first layer found:

* MiMo-style ``model.mtp_layers.{i}.``: ``token_layernorm``, ``hidden_layernorm``, ``input_proj``,
  ``final_layernorm``, and a decoder layer (``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``,
  ``mlp.*``); ``input_proj`` reads cat(hidden, embedding) (MiMo's modeling code, vLLM's mimo_mtp.py), so its
  column halves are swapped into specdec's order;
* DeepSeek-style ``model.layers.{L + i}.`` (after the L decoder layers): ``enorm``, ``hnorm``, ``eh_proj``
  (reading cat(embedding, hidden), specdec's order), ``shared_head.norm``, and the decoder layer's tensors
  (``embed_tokens`` / ``shared_head.head``: the target's).

Both map onto :class:`~specdec.drafters.eagle_model.EagleModel` with ``arch="mtp"``, which the EAGLE drafter runs:
catch-up over committed positions, EAGLE-2 tree growth, reranking, exact verification.
"""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.eagle_checkpoint import EagleCheckpointError, read_json_object
from specdec.drafters.eagle_model import EagleConfig, EagleModel
from specdec.drafters.loaded_once import load_once

from specdec.errors import InputError, InputTypeError

if TYPE_CHECKING:
    from specdec.models.llama import LlamaRunner

logger = logging.getLogger(__name__)

MIMO = {"token_layernorm": "enorm", "hidden_layernorm": "hnorm", "input_proj": "fc", "final_layernorm": "norm"}
DEEPSEEK = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "fc", "shared_head.norm": "norm"}
LAYER_PARTS = ("input_layernorm.", "self_attn.", "post_attention_layernorm.", "mlp.")
# config.json fields a path= checkpoint must share with the target for its MTP layer to be the target's: the layer
# reads the target's hidden states and embeddings and drafts through its LM head (DeepSeek's index is after L layers)
SAME_TARGET = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    return sorted(directory.glob("*.safetensors"))


def check_same_target(directory: Path, target_config) -> None:
    """Refuse a ``path=`` checkpoint of another model: its config.json must agree with the target on SAME_TARGET
    (a layer of another model with the same hidden size loads and drafts, uselessly), naming both sides."""
    try:
        raw = read_json_object(directory / "config.json", f"{directory} has no config.json to tell whether its MTP "
                               "layer was made for the target")
    except EagleCheckpointError as err:
        raise EagleCheckpointError(f"mtp: {err}") from None
    for name in SAME_TARGET:
        mine, theirs = raw.get(name), getattr(target_config, name, None)
        if mine is not None and theirs is not None and mine != theirs:
            raise EagleCheckpointError(f"mtp: {directory}: the checkpoint has {name}={mine} but the target model has "
                                       f"{name}={theirs}: it was made for another target")


def _held_layers(files: list[Path], num_layers: int) -> list[int]:
    """The indices of the MTP layers ``files`` hold, in either layout (by their input_proj / eh_proj weight)."""
    held = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if m := re.fullmatch(r"model\.mtp_layers\.(\d+)\.input_proj\.weight", key):
                    held.add(int(m[1]))
                elif (m := re.fullmatch(r"model\.layers\.(\d+)\.eh_proj\.weight", key)) and int(m[1]) >= num_layers:
                    held.add(int(m[1]) - num_layers)
    return sorted(held)


def read_mtp_layer(directory: str | Path, num_layers: int, index: int = 0, target: str | None = None
                   ) -> tuple[dict[str, torch.Tensor], str]:
    """The MTP layer ``index`` of a target checkpoint as EagleModel tensors (arch "mtp"), and its layout's name.
    ``target``: the directory is that target model's own checkpoint (named so in the refusal of one without)."""
    path = Path(directory)
    if not path.exists():
        raise EagleCheckpointError(f"mtp: {path} does not exist: give the checkpoint directory whose safetensors hold "
                                   "the MTP layers")
    files = _weight_files(path) if path.is_dir() else []  # a file: refused as path= (check_path_option)
    if not files:
        raise EagleCheckpointError(f"mtp: {path} holds no safetensors weights to read MTP layers from")
    layouts = ((f"model.mtp_layers.{index}.", MIMO, "MiMo"), (f"model.layers.{num_layers + index}.", DEEPSEEK,
                                                                   "DeepSeek"))
    for prefix, names, layout in layouts:
        state: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if not key.startswith(prefix):
                        continue
                    rest = key[len(prefix):]
                    stem = rest.rsplit(".", 1)[0]
                    if stem in names:
                        state[f"{names[stem]}.weight"] = f.get_tensor(key).clone()
                    elif rest.startswith(LAYER_PARTS):
                        state["layers.0." + rest] = f.get_tensor(key).clone()
        if "fc.weight" in state:
            if layout == "MiMo":  # input_proj reads cat(hidden, embedding); specdec's fc, as eh_proj, the reverse
                state["fc.weight"] = torch.cat(state["fc.weight"].chunk(2, dim=1)[::-1], dim=1).contiguous()
            return state, layout
    held = _held_layers(files, num_layers)
    if held:  # a layer= past the ones it has: not a checkpoint without MTP layers
        raise EagleCheckpointError(f"mtp: {path if target is None else f'the target model {target}'} has no MTP layer "
                                   f"{index}: its checkpoint holds MTP layer {', '.join(map(str, held))}; give layer= "
                                   "one of them")
    weights = (f"model.mtp_layers.{index}.input_proj (MiMo-style) or model.layers.{num_layers + index}.eh_proj "
               "(DeepSeek-style) weights")
    if target is None:
        raise EagleCheckpointError(f"mtp: {path} has no MTP layer {index} (no {weights})")
    raise EagleCheckpointError(
        f"mtp: the target model {target} has no MTP layer {index} (its checkpoint, {path}, holds no {weights}): the "
        "mtp drafter needs a model trained with multi-token-prediction layers that ships them in its safetensors "
        "(MiMo's or DeepSeek's layout, beside a Llama-type decoder). For this model choose another drafter (ngram, "
        "self-draft, or medusa / eagle heads trained for it), or give path= to the directory that holds its MTP "
        "layers")


class MtpDrafter(EagleDrafter):
    name = "mtp"
    layer_from_target = True
    python_only_options = frozenset()  # no model=: a layer given as an EagleModel is EagleDrafter(model=...)'s

    def __init__(self, path: str | None = None, layer: int = 0, **options) -> None:
        """``path``: the checkpoint directory holding the MTP weights (default: the target's own); ``layer``: which
        MTP layer; ``options``: the tree (EagleDraftConfig; default depth 3, top-k 4, 8 nodes)."""
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise InputError(f"mtp: layer must be an integer >= 0, got {layer!r}")
        if "model" in options:
            raise InputTypeError("mtp: it reads its layer from a checkpoint (path=, default the target's) and takes "
                                 "no model=; a layer built as an EagleModel drafts as EagleDrafter(model=...)")
        super().__init__(path=path, **options)
        self.layer, self.source = layer, self.path  # path= with ~ expanded (check_path_option)

    def cost_key(self) -> str:  # the checkpoint (None: the target's own) and the layer; the target is keyed apart
        return f"{type(self).__qualname__}|{self.name}|{self.source!r}|{self.layer}|{self.options!r}"

    def load_for_target(self, runner: "LlamaRunner", tokenizer: Any = None, name: str | None = None) -> None:
        """The MTP layer read for this target from its checkpoint (or path=), once per process while the files stay
        as they are (drafters/loaded_once.py): a drafter reused on another target reads that one's layer."""
        hf = runner.hf_model
        source = self.source or getattr(hf.config, "_name_or_path", "") or ""
        if not self.source and not (source and Path(source).is_dir()):
            raise InputError("mtp: the target was not loaded from a directory, so its MTP layers cannot be read "
                             "from its checkpoint: give path= (the directory whose safetensors hold them)")
        if self.source and Path(source).is_dir():
            check_same_target(Path(source), hf.config)
        own = None if self.source else repr(name) if name else str(source)  # the target's own checkpoint
        request = (hf.config.to_json_string(), self.layer, str(runner.dtype), str(runner.device))
        self.model = load_once("mtp", source, request, lambda: self._read(source, hf.config, own, runner))
        self.check_top_k()

    def _read(self, source: str, target_config: Any, own: str | None, runner: "LlamaRunner") -> EagleModel:
        state, layout = read_mtp_layer(source, target_config.num_hidden_layers, self.layer, own)
        config = EagleConfig.for_target(target_config, arch="mtp", depth=3, top_k=4, max_nodes=8,
                                        base_model_name_or_path=str(source))
        try:
            model = EagleModel.from_state(config, state)
        except RuntimeError as err:
            raise EagleCheckpointError(f"mtp: the {layout}-style MTP layer in {source} does not fit the target "
                                       f"({str(err).splitlines()[0]})") from err
        logger.info("mtp: the %s-style MTP layer %d of %s", layout, self.layer, source)
        return model.to(device=runner.device, dtype=runner.dtype)
