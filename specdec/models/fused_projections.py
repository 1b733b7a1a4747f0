"""Fused QKV and gate/up projections: one product where a layer's weights lie side by side in memory.

A decode step multiplies a few rows by every projection of every layer, and on a GPU each product is a kernel
launch. Where a layer's q, k and v weights (and its gate and up weights) are consecutive rows of one storage,
with biases alike or absent, :class:`LayerProjections` gives the whole block as one [sum of outputs, in] view:
the runner multiplies once and splits the output into views, no copy.

:func:`pack_projections` lays a model out so: each layer's blocks become one tensor whose row slices the
parameters then are (same parameter objects, same values; the peak is one layer's block more). specdec packs the
targets it builds itself on every device (synthetic targets, checkpoints and GGUF files it loads: on a GPU fewer
launches, on a CPU wider products over oneDNN-packed weights) and the EAGLE layers it loads or builds on CUDA
(whose fused-op forward then multiplies once per block); a model passed in as an object is never re-laid, and its
products stay separate, as do all products of the bit-exact mode. A parameter given new storage
later (``param.data = ...``) ends the fusion of its layer: a LoadedModel's runner compares every part's address
once per generate() call and is built again (``LlamaRunner.stale``); replacing weights in place (``copy_``,
``load_state_dict``) keeps the fusion.

A wider product may round a column differently than the narrow ones; plain and speculative decoding use the same
products, so exactness is unaffected.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from specdec.models import row_policy


@dataclass(frozen=True)
class Fused:
    weight: torch.Tensor  # [sum(sizes), in] a view over the parts' consecutive rows
    bias: torch.Tensor | None  # [sum(sizes)] likewise, None when no part has a bias
    sizes: tuple[int, ...]  # each part's output width, in order


def fuse(weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> Fused | None:
    """One view over ``weights`` (and ``biases``) when they are consecutive rows of one storage, else None."""
    block = _block(weights)
    if block is None:
        return None
    if all(b is None for b in biases):
        bias = None
    elif any(b is None for b in biases) or (bias := _block(biases)) is None:
        return None
    return Fused(block, bias, tuple(w.shape[0] for w in weights))


def _block(parts: list[torch.Tensor]) -> torch.Tensor | None:
    first = parts[0]
    if any(p.dtype != first.dtype or p.device != first.device or not p.is_contiguous() or p.shape[1:] != first.shape[1:]
           or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for p in parts):
        return None
    offset = first.storage_offset()
    for p in parts:
        if p.storage_offset() != offset:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    block = first.detach().as_strided((rows, *first.shape[1:]), first.stride())
    row_policy.reads_parts(block, parts)  # the block shares first's version counter only
    return block


@dataclass(frozen=True)
class LayerProjections:
    qkv: Fused | None
    gate_up: Fused | None

    @classmethod
    def of(cls, layer) -> "LayerProjections":
        """The layer's blocks; the same object for every caller while one holds it and the parts stay where they
        are: the runners over one layer (a second LoadedModel of a model, self-draft's truncated runner, an EAGLE
        layer's) multiply the same views, so the CPU keeps one packed copy of each block (row_policy)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        key = (id(layer), tuple((id(t), t.data_ptr()) for m in (*qkv, *gate_up) for t in (m.weight, m.bias)
                                if t is not None))
        found = _SHARED.get(key)
        if found is None:
            found = _SHARED[key] = cls(fuse([m.weight for m in qkv], [m.bias for m in qkv]),
                                       fuse([m.weight for m in gate_up], [m.bias for m in gate_up]))
        return found


# (layer, its parts' identities and addresses) -> the LayerProjections someone holds; gone with its last holder,
# so no view here keeps a weight's old memory alive
_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def pack_projections(hf_model) -> int:
    """Re-lay each layer's q/k/v and gate/up parameters as row slices of one tensor each (module doc); the number
    of blocks packed. Parameters keep their identity, values, dtype and device."""
    return pack_layers(hf_model.model.layers)


@torch.no_grad()
def pack_layers(layers) -> int:
    """:func:`pack_projections` over decoder layers with Llama's module names (``self_attn.q_proj``, ...,
    ``mlp.up_proj``): a target's, or an EAGLE draft layer's (drafters/eagle_model.py)."""
    packed = 0
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        for modules in ([attn.q_proj, attn.k_proj, attn.v_proj], [mlp.gate_proj, mlp.up_proj]):
            weights = [m.weight for m in modules]
            if fuse(weights, [m.bias for m in modules]) is not None:
                continue  # already side by side
            if len({(w.dtype, w.device, w.shape[1:]) for w in weights}) != 1:
                continue
            _relay(weights)
            biases = [m.bias for m in modules]
            if all(b is not None for b in biases):
                _relay(biases)
            packed += 1
    return packed


def _relay(params: list[torch.Tensor]) -> None:
    block = torch.cat([p.data for p in params])
    start = 0
    for p in params:
        p.data = block[start : start + p.shape[0]]
        start += p.shape[0]
