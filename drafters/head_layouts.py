"""EAGLE-3 head layouts of other tools, read into specdec's EagleModel and written back out.

Read (detected from config.json and the tensor names, :func:`read_eagle3`):

* EAGLE's repository and SGLang: a Llama-style config (``LlamaForCausalLMEagle3``), ``midlayer.*``, ``fc``,
  ``norm``, ``lm_head``, ``d2t``, ``t2d``; feature layers in ``eagle_config.eagle_aux_hidden_state_layer_ids``
  as layer *outputs* (SGLang reads the stream entering layer id + 1; specdec's feature layer f is id f - 1);
* speculators: ``speculators_model_type: eagle3`` with ``transformer_layer_config``, ``speculators_config``
  (the verifier) and ``eagle_aux_hidden_state_layer_ids``; ``layers.0.*``;
* vLLM configs naming ``Eagle3LlamaForCausalLM`` / ``LlamaForCausalLMEagle3`` (keys may carry ``model.``);
* specdec's own (``specdec_eagle.arch == "eagle3"``).

``d2t`` holds offsets: target id = draft id + d2t[draft id]; ``t2d`` marks the target ids in the draft
vocabulary and must agree with it. Absent layer ids mean the published default (2, L // 2, L - 3) of the
target. vLLM and SGLang capture and concatenate the streams in ascending layer order whatever the list's order, so
a published list out of order is read sorted (a warning); specdec's own heads list them ascending.
Written (:func:`write_eagle3`): the speculators layout and the EAGLE / SGLang layout (its ids in both counts:
``eagle_config``'s for SGLang, top-level ones for vLLM, which reads those first), draft vocabulary in ascending
target id, a head using the target's LM head without ``lm_head`` (the engines then take the target's), every
config naming the target model it was made for and carrying the head's draft tree (depth, top_k, max_nodes) in a
``specdec_eagle`` block that other readers pass over (speculators 0.9's config loads with it), so that export then
re-import keeps the tree.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from specdec.drafters.eagle_checkpoint import CONFIG_FILE, WEIGHTS_FILE, EagleCheckpointError
from specdec.drafters.eagle_model import UNRECORDED_CONTEXT, EagleConfig, EagleModel, default_feature_layers
from specdec.drafters.eagle_rope import config_entries, read_rope

from specdec.atomic_write import save_tensors, write_json

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
# EAGLE 3.1's (_layer_config); use_aux_norm: SGLang's older name of fc_norm (tensors aux_norm_low / _mid / _high)
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "use_aux_norm")
FORMATS = ("speculators", "sglang")

logger = logging.getLogger(__name__)


def is_eagle3(raw: dict, state: dict[str, torch.Tensor]) -> bool:
    if raw.get("speculators_model_type") == "eagle3" or (raw.get("specdec_eagle") or {}).get("arch") == "eagle3":
        return True
    if any(a in EAGLE3_ARCHITECTURES for a in raw.get("architectures") or ()):
        return True
    return any(k.startswith(("midlayer.", "model.midlayer.")) or k.endswith("hidden_norm.weight") for k in state)


def is_eagle_layer(raw: dict, state: dict[str, torch.Tensor]) -> bool:
    """An EAGLE draft layer's checkpoint: EAGLE-3's (any layout read here), or specdec's EAGLE-1 (fc.* tensors, its
    config's mark); a Medusa export or a model's weights are neither."""
    return is_eagle3(raw, state) or "fc.weight" in state or "specdec_eagle" in raw


def _layer_config(raw: dict, where: str) -> dict:
    """The draft layer's config; EAGLE 3.1's variants are refused in any layout: vLLM reads their flags from a
    speculators config and a Llama-style one alike (norm_before_fc also in eagle_config), and norm_output has no
    tensor of its own, so a head read without it would draft with another feedback, unsaid."""
    layer = dict(raw["transformer_layer_config"] or {}) if "transformer_layer_config" in raw else raw  # speculators
    for source in (raw, raw.get("eagle_config"), layer):
        for flag in UNSUPPORTED_FLAGS:
            if isinstance(source, dict) and source.get(flag):
                raise EagleCheckpointError(f"{where}: the head sets {flag}=true, an EAGLE-3 variant (EAGLE 3.1's) "
                                           "specdec does not run")
    return layer


def layer_model_type(raw: dict) -> str | None:
    """The draft layer's model type (speculators nest it in transformer_layer_config)."""
    return (raw.get("transformer_layer_config") or raw).get("model_type")


def _verifier(raw: dict) -> str:
    spec = (raw.get("speculators_config") or {}).get("verifier") or {}
    extra = raw.get("specdec_eagle") or {}
    return str(spec.get("name_or_path") or extra.get("base_model_name_or_path") or raw.get("target_model")
               or raw.get("base_model_name_or_path") or "")


def _listed_feature_layers(raw: dict, target_config, where: str) -> tuple[tuple[int, ...], bool]:
    """The head's feature layers (the streams entering them) in the order its config lists them, and whether the
    list is specdec's own (its ``specdec_eagle`` block, which only specdec reads) rather than one an engine reads."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids:  # speculators' and vLLM's ids, as specdec's: the streams entering those layers
        return tuple(int(i) for i in ids), False
    ids = (raw.get("specdec_eagle") or {}).get("feature_layers")
    if ids:
        return tuple(int(i) for i in ids), True
    outputs = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if outputs:  # EAGLE / SGLang's: layer outputs (SGLang captures the stream entering layer id + 1)
        return tuple(int(i) + 1 for i in outputs), False
    if target_config is None:
        raise EagleCheckpointError(f"{where}: the head does not name the target layers it reads, and no target "
                                   "model was given to take the published default from")
    return default_feature_layers(int(target_config.num_hidden_layers)), False


def _feature_layers(raw: dict, tensors: dict[str, torch.Tensor], target_config, where: str) -> tuple[int, ...]:
    """The feature layers in ascending order, as vLLM and SGLang capture and concatenate them (their Llama appends
    a layer's input stream as its forward reaches that layer, whatever the list's order). A published list out of
    order is read so, with a warning: the engines feed the head's ``fc`` that order. A specdec head saved with its
    layers out of order fed ``fc`` the listed order: its ``fc`` column blocks are put in layer order with them, so
    it drafts as before. A layer named twice is refused (the engines capture it once: fewer streams than ``fc``
    takes)."""
    listed, own = _listed_feature_layers(raw, target_config, where)
    layers = tuple(sorted(listed))
    if len(set(listed)) != len(listed):
        twice = next(i for i in listed if listed.count(i) > 1)
        raise EagleCheckpointError(f"{where}: the head names target layer {twice} twice in its feature layers "
                                   f"{list(listed)}; vLLM and SGLang capture each layer once, so its fc would get "
                                   f"{len(set(listed))} streams, not {len(listed)}")
    if listed == layers:
        return layers
    fc = tensors.get("fc.weight")
    if own and fc is not None:  # its fc columns were written for the listed order: reorder them with the layers
        width = fc.shape[1] // len(listed)
        blocks = fc.split(width, dim=1)
        tensors["fc.weight"] = torch.cat([blocks[listed.index(i)] for i in layers], dim=1).contiguous()
        logger.info("%s: feature layers %s put in ascending order %s, fc's columns with them (the head drafts as "
                    "before)", where, list(listed), list(layers))
    else:
        logger.warning("%s: the head lists its feature layers as %s; vLLM and SGLang capture and concatenate them "
                       "in ascending order, %s, and so does specdec", where, list(listed), list(layers))
    return layers


def _native_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        key = key.removeprefix("model.")
        if key.startswith("midlayer."):
            key = "layers.0." + key[len("midlayer."):]
        if key in ("embed_tokens.weight", "t2d") or key.startswith(("verifier_", "layers.1.")):
            continue  # the target's embedding is used; t2d is checked against d2t; a second layer is refused below
        out[key] = value
    return out


def read_eagle3(raw: dict, state: dict[str, torch.Tensor], where: str, target_config=None
                ) -> tuple[EagleConfig, dict]:
    """The EagleConfig and specdec-named tensors of an EAGLE-3 head in any layout above (``target_config``: the
    target's transformers config, for the default layer ids; None: the head must name them)."""
    layer = _layer_config(raw, where)
    if int(layer.get("num_hidden_layers", 1) or 1) != 1 or any(k.startswith(("layers.1.", "model.layers.1."))
                                                               for k in state):
        raise EagleCheckpointError(f"{where}: the head has {layer.get('num_hidden_layers')} draft layers; specdec "
                                   "runs EAGLE-3 heads of one layer")
    qk_norms = sorted(k for k in state if k.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")))
    if qk_norms:  # speculators' draft_arch qwen3 (vLLM: Eagle3Qwen3ForCausalLM); not a damaged checkpoint
        raise EagleCheckpointError(f"{where}: the draft layer norms its queries and keys ({', '.join(qk_norms)}), a "
                                   "Qwen3 decoder layer as speculators builds with draft_arch qwen3; specdec runs "
                                   "EAGLE-3 heads of a Llama layer, without q_norm / k_norm")
    tensors = _native_keys(state)
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        theta, rope = read_rope(layer, where)
        vocab = int(state["t2d"].numel()) if "t2d" in state else int(layer.get("vocab_size") or raw["vocab_size"])
    except KeyError as err:
        raise EagleCheckpointError(f"{where}: config.json lacks {err.args[0]!r}") from None
    ids: tuple[int, ...] = ()
    own_head = False
    if "d2t" in tensors:
        d2t = tensors["d2t"].long()
        ids = tuple((d2t + torch.arange(d2t.numel())).tolist())
        if len(ids) == vocab and ids == tuple(range(vocab)):  # the identity map: the full vocabulary
            ids, own_head = (), True
            tensors.pop("d2t")
        if "t2d" in state and ids:
            marked = state["t2d"].bool().nonzero().flatten().tolist()
            if marked != sorted(ids):
                raise EagleCheckpointError(f"{where}: t2d marks {len(marked)} target ids but d2t maps the draft "
                                           f"vocabulary of {len(ids)} onto others: the two maps disagree")
    elif "lm_head.weight" in tensors:
        own_head = True
    extra = raw.get("specdec_eagle") or {}
    # specdec's own checkpoints keep the flag in their specdec_eagle block (eagle_checkpoint.save_eagle)
    before = raw.get("norm_before_residual", layer.get("norm_before_residual", extra.get("norm_before_residual")))
    try:
        wide = raw.get("target_hidden_size", layer.get("target_hidden_size"))
        if wide is not None and int(wide) != hidden:  # vLLM's and SGLang's fc read target_hidden_size-wide streams
            raise EagleCheckpointError(f"{where}: the head's draft layer is {hidden} wide over target features of "
                                       f"target_hidden_size={int(wide)}; specdec runs only EAGLE-3 heads as wide as "
                                       "their target's features (target_hidden_size absent or equal to hidden_size)")
        layers = _feature_layers(raw, tensors, target_config, where)
        config = EagleConfig(
            hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads), vocab_size=vocab,
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=rope,
            arch="eagle3", feature_layers=layers,
            norm_before_residual=bool(before),
            draft_vocab=ids, own_lm_head=own_head, base_model_name_or_path=_verifier(raw),
            max_position_embeddings=int(layer.get("max_position_embeddings") or UNRECORDED_CONTEXT),
            **{k: int(extra[k]) for k in ("depth", "top_k", "max_nodes") if k in extra})
    except KeyError as err:
        raise EagleCheckpointError(f"{where}: config.json lacks {err.args[0]!r}") from None
    except EagleCheckpointError:
        raise
    except (TypeError, ValueError) as err:
        raise EagleCheckpointError(f"{where}: {err}") from None
    return config, tensors


# ---- writing ----------------------------------------------------------------------------------------------------
def _sorted_tensors(model: EagleModel) -> tuple[dict[str, torch.Tensor], int]:
    """The head's tensors with its draft vocabulary in ascending target id (lm_head rows permuted alike), plus
    d2t / t2d; and the draft vocabulary's size. A head using the target's LM head has no lm_head tensor: vLLM
    shares the target's with a draft that has none, as speculators loads its verifier's, and SGLang with a draft
    whose draft_vocab_size is null (write_eagle3)."""
    c = model.config
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items() if k != "d2t"}
    if model.draft_ids is None:
        return tensors, c.vocab_size
    ids = model.draft_ids.cpu()
    order = torch.argsort(ids)
    ids = ids[order]
    tensors["lm_head.weight"] = tensors["lm_head.weight"][order].contiguous()
    tensors["d2t"] = ids - torch.arange(ids.numel())
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors, int(ids.numel())


def _llama_layer(c: EagleConfig) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta}, **config_entries(c),
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": False}


def write_eagle3(model: EagleModel, directory: str | os.PathLike, fmt: str, target: str,
                 target_architectures: list[str] | None = None) -> Path:
    """Write ``model`` in ``fmt`` ("speculators" or "sglang") to ``directory``; ``target``: the hub id or path of
    the model it drafts for, recorded in the config."""
    if fmt not in FORMATS:
        raise EagleCheckpointError(f"EAGLE-3 heads are written as {' or '.join(FORMATS)}, not {fmt!r}")
    c = model.config
    if fmt == "sglang" and c.norm_before_residual:  # SGLang's llama_eagle3.py: residual = hidden_states, always
        raise EagleCheckpointError("this EAGLE-3 head sets norm_before_residual, which SGLang's EAGLE-3 layer does "
                                   "not read (it would draft with another residual): export it with --format "
                                   "speculators, whose readers (vLLM, speculators) apply it")
    tensors, draft_vocab = _sorted_tensors(model)
    shared = model.lm_head is None  # the target's LM head: no lm_head tensor, the full vocabulary
    tree = {"specdec_eagle": {"depth": c.depth, "top_k": c.top_k, "max_nodes": c.max_nodes}}  # read back by read_eagle3
    if fmt == "speculators":  # a shared LM head: draft_vocab_size = vocab_size, which speculators' config needs
        config = {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "transformer_layer_config": _llama_layer(c), "draft_vocab_size": draft_vocab,
            "norm_before_residual": c.norm_before_residual, "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.depth,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": target, "architectures": target_architectures or []}},
            **tree,
        }
    else:
        tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                   for k, v in tensors.items()}
        # SGLang reads only eagle_config's ids, as layer outputs (it captures the stream entering id + 1); vLLM reads
        # a top-level list first, as the streams entering those layers (gpu_model_runner.py), as specdec does
        config = {**_llama_layer(c), "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": None if shared else draft_vocab,  # null: SGLang loads the target's LM head
                  "norm_before_residual": c.norm_before_residual, "target_model": target,
                  "eagle_aux_hidden_state_layer_ids": list(c.feature_layers),
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": [f - 1 for f in c.feature_layers],  # outputs
                                   "use_aux_hidden_state": True}, **tree}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_tensors(path / WEIGHTS_FILE, tensors, metadata={"format": "pt"})
    write_json(path / CONFIG_FILE, config, indent=2)
    return path
