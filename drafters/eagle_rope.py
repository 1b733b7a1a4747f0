"""The draft layer's RoPE parameters: a head rotates as the config it was trained with says, scaling included.

Published EAGLE-3 heads of Llama 3.x targets carry the target's ``llama3`` scaling in their config (SpecForge's,
for one), and vLLM and SGLang build the draft layer's rotary embedding from it; a layer rotating by ``rope_theta``
alone reads other angles for most of its frequency pairs. The parameters are kept as sorted (name, value) pairs
beyond ``rope_theta`` (a frozen config's field; () is plain RoPE), and the frequencies come from transformers' own
RoPE functions, as the target's do. Only the types whose angles do not change with the sequence's length are taken,
the ones the engine runs a target with.

    params = rope_params({"rope_type": "llama3", "factor": 8.0, ...})   # (("factor", 8.0), ..., ("rope_type", ...))
    inv_freq, attention_factor = frequencies(config)                     # [head_dim / 2] float32 on the CPU
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from specdec.errors import InputError
from specdec.models.llama import STATIC_ROPE_TYPES, rope_type

logger = logging.getLogger(__name__)


def rope_params(params: Mapping | tuple | None) -> tuple[tuple[str, Any], ...]:
    """A config's RoPE parameters as sorted (name, value) pairs without ``rope_theta`` (its own field), () for plain
    RoPE; InputError for a type whose angles change with the sequence's length."""
    items = dict(params or ())
    kind = rope_type(items)
    if kind not in STATIC_ROPE_TYPES:
        raise InputError(f"an EAGLE layer's RoPE type {kind!r} changes with sequence length; supported: "
                         f"{', '.join(STATIC_ROPE_TYPES)}")
    if kind == "default":
        return ()
    items.pop("type", None)
    items.pop("rope_theta", None)
    items["rope_type"] = kind
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items.items()))


def read_rope(raw: Mapping, where: str) -> tuple[float, dict]:
    """(rope_theta, RoPE parameters) of a head's config.json: ``rope_theta`` at the top, else inside the parameters
    (``rope_parameters``, else ``rope_scaling``), else 10000. A type whose angles change with the sequence's length
    is left out with a warning: the layer then rotates by ``rope_theta`` alone (drafts stay exact, acceptance may be
    lower), as heads loaded before scaling was read."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    if rope_type(params) not in STATIC_ROPE_TYPES:
        logger.warning("%s: the head's RoPE type %r changes with sequence length, which specdec's draft layer does "
                       "not: it rotates with rope_theta alone (drafts stay exact, acceptance may be lower)", where,
                       rope_type(params))
        return theta, {}
    return theta, params


def frequencies(config) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] float32 inverse frequencies on the CPU and the factor cos / sin are scaled by, for an
    EagleConfig; plain RoPE as the layer always computed it, bit for bit."""
    c = config
    steps = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device="cpu")
    if not c.rope_scaling:
        return 1.0 / (c.rope_theta ** (steps / c.head_dim)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(c.rope_scaling)
    # with a factor given, the context length changes no frequency, and transformers warns where it is not the
    # original one times the factor, as published heads' configs often have it (SpecForge's Llama 3.1 heads: 2048
    # against 8192 x 8): the frequencies are computed for that length
    positions = c.max_position_embeddings
    factor, original = params.get("factor"), params.get("original_max_position_embeddings")
    if factor and original and float(factor) > 1:
        positions = round(float(original) * float(factor))
    llama = LlamaConfig(hidden_size=c.hidden_size, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                        head_dim=c.head_dim, max_position_embeddings=positions, rope_theta=c.rope_theta,
                        rope_scaling=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](llama, "cpu")
    return inv_freq.float(), float(factor)


def config_entries(config) -> dict[str, Any]:
    """What a written config.json says of the layer's RoPE: ``rope_theta``, and for a scaled one its parameters under
    ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5), so either reads them."""
    entries: dict[str, Any] = {"rope_theta": config.rope_theta}
    if config.rope_scaling:
        entries["rope_scaling"] = dict(config.rope_scaling)
        entries["rope_parameters"] = {**dict(config.rope_scaling), "rope_theta": config.rope_theta}
    return entries
