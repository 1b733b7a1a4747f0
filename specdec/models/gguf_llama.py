"""A llama-architecture GGUF file read directly: its transformers config and float32 weights, one pass over the file.

transformers' GGUF loader builds gguf's reader three times (config, tokenizer, weights), each walking the
vocabulary arrays element by element, and maps the tensor names once per module: ~20 s of the embedded model's
first load, against ~2 s here. The header is read by the walker that checks every GGUF (``embedded.read_header``),
each tensor is dequantized by gguf's own numpy dequantizers, and the result is what transformers makes of the same
file: its config fields, its parameter names, llama.cpp's interleaved q / k rows put back in Hugging Face's order
(the tests compare the two on a small file). One exception: without ``llama.attention.head_count_kv`` (llama.cpp's
default: as many KV heads as query heads) transformers leaves q / k interleaved, another model; here they are put
back as in any other file. Only what transformers' llama loading keeps is handled; anything else (another
architecture, a bias, an extra or missing tensor, one of another shape than the metadata gives, a quantization gguf
cannot dequantize) gives None, and the conversion goes through transformers, which ``embedded`` refuses unless it
uses every tensor of the file and fills every parameter. RoPE scaling keys (``llama.rope.scaling.*``), which
transformers' GGUF loading drops, are written into the config where a transformers RoPE type computes what llama.cpp
computes (:func:`rope_scaling`: linear, YaRN); ``embedded.check_convertible`` refuses any other scaling, and any
scaling in a file this reader does not take (:func:`reads_directly`).
"""
from __future__ import annotations

import logging
import math
import mmap
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

# GGUF metadata key -> transformers LlamaConfig field (the GGUF spec's llama keys, as transformers maps them)
_CONFIG = {"llama.context_length": "max_position_embeddings", "llama.block_count": "num_hidden_layers",
           "llama.feed_forward_length": "intermediate_size", "llama.embedding_length": "hidden_size",
           "llama.rope.dimension_count": "head_dim", "llama.rope.freq_base": "rope_theta",
           "llama.attention.head_count": "num_attention_heads",
           "llama.attention.head_count_kv": "num_key_value_heads",
           "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps", "llama.vocab_size": "vocab_size",
           "general.name": "_model_name_or_path", "tokenizer.ggml.bos_token_id": "bos_token_id",
           "tokenizer.ggml.eos_token_id": "eos_token_id", "tokenizer.ggml.unknown_token_id": "unk_token_id",
           "tokenizer.ggml.padding_token_id": "pad_token_id"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def read_llama(path: Path):
    """``(config, state)``: the transformers ``LlamaConfig`` and float32 state dict (no ``lm_head.weight`` when
    the embeddings are tied) that transformers' own GGUF loading gives for ``path`` (but see the module doc on
    ``head_count_kv``); None when the file is not one this reader handles exactly (module doc). ``path`` has passed
    ``embedded.check_gguf`` and ``embedded.check_convertible``."""
    try:
        import gguf  # noqa: F401  (the dequantizers, in the ``gguf`` extra)
    except ImportError:
        return None
    from specdec.models.embedded import read_header

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        header = read_header(blob)
        if header is None:
            return None
        tensors, data_start, meta = header
        plan = _plan(tensors, meta)
        if plan is None:
            return None
        config, names = plan
        state = {}
        for name, ggml_type, dims, offset in tensors:
            weights = _dequantized(blob, data_start + offset, ggml_type, dims)
            if weights is None:
                return None
            if name.endswith(".attn_q.weight"):
                weights = _unpermute(weights, config.num_attention_heads)
            elif name.endswith(".attn_k.weight"):
                weights = _unpermute(weights, config.num_key_value_heads)
            state[names[name]] = weights
    return config, state


def reads_directly(tensors: list, meta: dict) -> bool:
    """Whether :func:`read_llama` converts the file of this tensor table and metadata (``embedded.read_header``'s)
    itself, short of a tensor type gguf cannot dequantize: else transformers' GGUF loading converts it."""
    return _plan(tensors, meta) is not None


def _plan(tensors: list, meta: dict):
    """``(config, GGUF tensor name -> parameter name)`` where the file holds exactly the llama its metadata
    describes; None otherwise."""
    config = _config(meta, {name for name, *_ in tensors})
    names = _parameter_names(config, [name for name, *_ in tensors]) if config is not None else None
    if names is None:
        return None
    shapes = _shapes(config)
    if any(tuple(reversed(dims)) != shapes[names[name]] for name, _, dims, _ in tensors):
        return None  # not the model its metadata describes (e.g. llama.rope.dimension_count not the head size)
    return config, names


class RopeNotMapped(ValueError):
    """RoPE scaling keys of a GGUF file that no transformers RoPE type computes as llama.cpp does (the message: the
    key, and why)."""


# llama.cpp's RoPE scaling keys that change nothing at these values (yarn_ext_factor: per type, below 0 unset)
_NEUTRAL = {"attn_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}


def rope_scaling(meta: dict) -> tuple[str, dict] | None:
    """``(what, rope_scaling)`` for the RoPE scaling keys of a GGUF file's metadata (``{arch}.rope.scaling.*``, as
    llama.cpp reads them: a factor without a type is linear, and type ``none`` or a factor of 0 or 1 scales
    nothing: None): the keys in words, and the transformers ``rope_scaling`` that computes llama.cpp's angles and
    magnitudes. Linear: llama.cpp's ``freq_scale = 1 / factor`` divides every frequency, as transformers' ``linear``
    does. YaRN: llama.cpp's ramp between the same correction dimensions (``ggml_rope_yarn_corr_dims``, from
    ``original_context_length``, else (or where it is 0) the context length, and the betas 32 and 1) mixes the scaled
    and unscaled angles as transformers' ``yarn`` mixes frequencies, and scales cos / sin by ``1 + 0.1 ln factor``,
    transformers' default attention factor. Raises :class:`RopeNotMapped` for the rest: a type llama.cpp does not
    know or LongRoPE (its factors are tensors), the attention scales llama.cpp releases apply differently
    (``attn_factor``, ``yarn_attn_factor``, ``yarn_log_multiplier``), a partial YaRN (``yarn_ext_factor``), other
    betas (``yarn_beta_fast`` / ``yarn_beta_slow``, which llama.cpp reads for other architectures only, so the file
    means a ramp llama.cpp does not run), and a context length that is not an integer (llama.cpp refuses the
    file)."""
    arch = meta.get("general.architecture")

    def key(name: str) -> str:
        return f"{arch}.rope.scaling.{name}"

    def shown(value) -> str:  # a key's value as the refusal quotes it
        return f"{value:g}" if isinstance(value, (int, float)) else repr(value)

    kind = meta.get(key("type"), "linear")
    if kind not in ("none", "linear", "yarn"):
        why = "LongRoPE, whose factors llama.cpp keeps in tensors" if kind == "longrope" else \
            "a type llama.cpp does not know"
        raise RopeNotMapped(f"{key('type')} {kind!r}: {why}")
    for name, neutral in [*_NEUTRAL.items(), ("yarn_ext_factor", 1.0 if kind == "yarn" else 0.0)]:
        value = meta.get(key(name), neutral)
        if value != neutral and not (name == "yarn_ext_factor" and isinstance(value, float) and value < 0):
            if name == "yarn_ext_factor":  # not a scale of attention: the share of YaRN's ramp in the angles
                raise RopeNotMapped(f"{key(name)} {shown(value)}: a YaRN ramp mixed into the angles by another share "
                                    f"than llama.cpp's own for type {kind!r} ({neutral:g}), which no transformers "
                                    "RoPE type computes")
            raise RopeNotMapped(f"{key(name)} {shown(value)}: a scale of attention llama.cpp releases apply "
                                "differently, which no transformers RoPE type computes as this file means it")
    factor = meta.get(key("factor"), meta.get(f"{arch}.rope.scale_linear"))
    if kind == "none" or factor in (None, 0.0, 1.0):
        return None
    if not isinstance(factor, (int, float)) or factor < 0:
        raise RopeNotMapped(f"{key('factor')} {factor!r}, not a scaling factor")
    what = f"{key('type')} {kind!r} with factor {factor:g}"
    if kind == "linear":
        return what, {"rope_type": "linear", "factor": float(factor)}
    for name, value in ((key("original_context_length"), meta.get(key("original_context_length"))),
                        (f"{arch}.context_length", meta.get(f"{arch}.context_length"))):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            typed = f"{value:g} (a float)" if isinstance(value, float) else f"{value!r} ({type(value).__name__})"
            raise RopeNotMapped(f"{name} {typed}, where llama.cpp reads a whole number of tokens and refuses the file")
    for name, ramp_end in (("yarn_beta_fast", 32.0), ("yarn_beta_slow", 1.0)):
        value = meta.get(key(name), ramp_end)
        if value != ramp_end:
            raise RopeNotMapped(f"{key(name)} {shown(value)}: llama.cpp does not read it for this architecture (its "
                                "YaRN ramp runs between betas 32 and 1), so no RoPE computes this file as it means it")
    # 0 is unset to llama.cpp (n_ctx_orig_yarn falls back to the training context), not a context of 0 tokens
    original = meta.get(key("original_context_length")) or meta.get(f"{arch}.context_length")
    if original is None or original <= 0:
        raise RopeNotMapped(f"{what} and no context length ({key('original_context_length')}, "
                            f"{arch}.context_length) to place its ramp by")
    return what, {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": original,
                  "beta_fast": 32.0, "beta_slow": 1.0}


def _dequantized(blob, start: int, ggml_type: int, dims: tuple[int, ...]) -> torch.Tensor | None:
    """The float32 tensor [dims reversed] whose data starts at byte ``start`` of ``blob`` (a copy: no view of the
    file outlives this call); None for a type gguf cannot dequantize."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(ggml_type)
        block, type_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        return None
    if dims[0] % block:
        return None
    rows, row_bytes = math.prod(dims[1:]), dims[0] // block * type_bytes
    raw = np.frombuffer(blob, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
    try:
        values = dequantize(raw, qtype)
    except NotImplementedError:
        return None
    return torch.tensor(values.reshape(tuple(reversed(dims))), dtype=torch.float32)


def _config(meta: dict, tensor_names: set[str]):
    """The LlamaConfig transformers builds from the metadata, or None for a file it would read otherwise."""
    from transformers import LlamaConfig

    name = meta.get("general.name")
    if meta.get("general.architecture") != "llama" or (isinstance(name, str) and "mistral" in name):
        return None  # transformers reads a "mistral"-named llama file as Mistral
    fields = {"model_type": "llama", "tie_word_embeddings": "output.weight" not in tensor_names}
    for key, field in _CONFIG.items():
        if key in meta:
            value = meta[key]
            fields[field] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in fields:
        if "tokenizer.ggml.tokens" not in meta:
            return None
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    if any(isinstance(fields.get(k), list) for k in ("num_attention_heads", "num_key_value_heads")):
        return None  # per-layer head counts: not a plain llama
    try:
        rope = rope_scaling(meta)
    except RopeNotMapped:
        return None
    if rope is not None:
        fields["rope_scaling"] = rope[1]
    return LlamaConfig.from_dict(fields)


def _parameter_names(config, tensor_names: list[str]) -> dict[str, str] | None:
    """GGUF tensor name -> transformers parameter name, when the file holds exactly a llama's parameters."""
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not config.tie_word_embeddings
                                                                else set())
    expected |= {f"blk.{i}.{part}.weight" for i in range(config.num_hidden_layers) for part in _LAYER}
    if set(tensor_names) != expected or len(tensor_names) != len(expected):
        return None
    names = {}
    for name in tensor_names:
        if name in _GLOBAL:
            names[name] = _GLOBAL[name]
        else:
            _, layer, part, _ = name.split(".")
            names[name] = f"model.layers.{layer}.{_LAYER[part]}.weight"
    return names


def _shapes(config) -> dict[str, tuple[int, ...]]:
    """Parameter name -> its shape in transformers' LlamaForCausalLM of ``config``, built on the meta device (no
    memory): the shapes the metadata describes (head_dim from ``llama.rope.dimension_count``)."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _unpermute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp stores each q / k head's rows with the two rotary halves interleaved; Hugging Face's order is
    the halves one after the other (what transformers' llama GGUF loading undoes the same way)."""
    rows = weights.shape[0]
    return weights.reshape(heads, rows // heads // 2, 2, *weights.shape[1:]).transpose(1, 2).reshape(weights.shape)
