"""Synthetic targets: published model shapes with random weights, built on the device, no download.

A published shape has the same weight reads, GEMM shapes and attention work as the real model, so it measures
speed at that size; it says nothing about acceptance (see the oracle drafter, ``specdec.eval.oracle_drafter``). The
random weights are arranged so that greedy decoding has wide margins (:func:`_widen_margins`): it repeats the
prompt's last token, and no rounding of a speculative run parts it from plain decoding.

    model = build("llama-3.1-8b", device="cuda", dtype=torch.bfloat16, seed=0)   # a transformers model
    load_model("synthetic:llama-3.1-8b")          # by name, wherever a model is accepted
    load_model("synthetic:qwen3-1.7b@tiny")       # the same features (GQA ratio, tying, q/k norm, RoPE) at toy size
    eagle_head(model.config)                      # a random EAGLE layer for it; draft_spec(...) a draft model's name

Invariants: weights are created on the target device in the target dtype (an 8B model never exists in fp32 on the
host); the same (name, seed, device type, dtype) gives the same weights; the caller's RNG state is left as it was.
Default dtype: bfloat16 on CUDA, float32 elsewhere. Default device: CUDA when available. A full-size shape that
cannot fit the host's memory is refused with a one-line error before anything is allocated. There is no tokenizer:
synthetic models take token ids.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from specdec.errors import InputError

PREFIX = "synthetic:"
TINY_SUFFIX = "@tiny"
EAGLE_DRAFT_VOCAB = 32768  # reduced LM head of the random EAGLE layer at full size (EAGLE-3 heads use ~32k)
RESIDUAL_WRITE_SCALE = 2.0**-12  # o_proj and down_proj weights scaled (_widen_margins); a power of two: exact in bf16

_LLAMA3_ROPE = (("rope_type", "llama3"), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                ("original_max_position_embeddings", 8192))


@dataclass(frozen=True)
class SyntheticShape:
    """A transformers config's shape fields, as the published config.json gives them."""

    name: str
    model_type: str  # "llama" or "qwen3" (Qwen3 adds RMSNorm over head_dim on q and k)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_positions: int
    rope_scaling: tuple[tuple[str, Any], ...] = ()  # () = plain RoPE

    def __post_init__(self) -> None:
        if self.model_type not in ("llama", "qwen3"):
            raise ValueError(f"model_type must be 'llama' or 'qwen3', got {self.model_type!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads {self.num_heads} is not a multiple of {self.num_kv_heads}")

    def tiny(self) -> "SyntheticShape":
        """The same features at toy size: the GQA ratio, tying, q/k norm and RoPE type kept, 2 layers."""
        ratio = self.num_heads // self.num_kv_heads
        heads = 2 * ratio
        hidden = 64 if 64 % heads == 0 else 16 * heads  # transformers wants the hidden size a multiple of the heads
        return dataclasses.replace(self, name=self.name + TINY_SUFFIX, hidden_size=hidden, num_layers=2,
                                   num_heads=heads, num_kv_heads=2, head_dim=16, intermediate_size=128,
                                   vocab_size=256)

    @property
    def num_params(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        per_layer += 2 * self.hidden_size + (2 * self.head_dim if self.model_type == "qwen3" else 0)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + self.hidden_size

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the weights in memory (a tied embedding once): what must fit the device. Not what a decode step
        reads, which leaves out all but one row of an untied input embedding (the speed command's floor)."""
        return self.num_params * torch.finfo(dtype).bits // 8

    def hf_config(self):
        """The transformers config of this shape (random weights: no tokenizer ids of the real model matter)."""
        from transformers import AutoConfig

        fields = dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                      num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                      head_dim=self.head_dim, intermediate_size=self.intermediate_size, vocab_size=self.vocab_size,
                      rms_norm_eps=self.rms_norm_eps, tie_word_embeddings=self.tie_word_embeddings,
                      max_position_embeddings=self.max_positions, hidden_act="silu", attention_bias=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None, rope_theta=self.rope_theta)
        if self.rope_scaling:
            fields["rope_scaling"] = {**dict(self.rope_scaling), "rope_theta": self.rope_theta}
        config = AutoConfig.for_model(self.model_type, **fields)
        config._name_or_path = PREFIX + self.name
        return config


# The published config.json values of each model (hidden size, layers, heads, KV heads, head dim, MLP width,
# vocabulary, RoPE base and scaling, norm epsilon, tied embeddings, context).
SHAPES: dict[str, SyntheticShape] = {s.name: s for s in (
    SyntheticShape("llama-3.2-1b", "llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0, 1e-5, True, 131072,
                   (("factor", 32.0), *_LLAMA3_ROPE)),
    SyntheticShape("llama-3.1-8b", "llama", 4096, 32, 32, 8, 128, 14336, 128256, 500000.0, 1e-5, False, 131072,
                   (("factor", 8.0), *_LLAMA3_ROPE)),
    SyntheticShape("smollm2-135m", "llama", 576, 30, 9, 3, 64, 1536, 49152, 100000.0, 1e-5, True, 8192),  # embedded
    SyntheticShape("qwen3-0.6b", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1000000.0, 1e-6, True, 40960),
    SyntheticShape("qwen3-1.7b", "qwen3", 2048, 28, 16, 8, 128, 6144, 151936, 1000000.0, 1e-6, True, 40960),
)}
# a smaller published model of the same vocabulary, the natural draft model; Llama-3.2-1B has none
DRAFT_FOR = {"llama-3.1-8b": "llama-3.2-1b", "qwen3-1.7b": "qwen3-0.6b"}


def is_synthetic(spec: Any) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse(spec: str) -> SyntheticShape:
    """``synthetic:NAME`` or ``synthetic:NAME@tiny`` (the prefix optional) -> its shape; InputError if unknown."""
    name = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    tiny = name.endswith(TINY_SUFFIX)
    base = name[: -len(TINY_SUFFIX)] if tiny else name
    if base not in SHAPES:
        raise InputError(f"unknown synthetic model {name!r}; known: {', '.join(SHAPES)} (each also as NAME@tiny)")
    return SHAPES[base].tiny() if tiny else SHAPES[base]


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _check_memory(shape: SyntheticShape, dtype: torch.dtype, device: torch.device) -> None:
    need = shape.weight_bytes(dtype)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    elif device.type == "cpu" and hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        return
    if need > 0.9 * free:
        raise InputError(f"synthetic model {shape.name} needs {need / 2**30:.1f} GiB of weights in {dtype}, but "
                         f"{device} has {free / 2**30:.1f} GiB free; use a GPU, bfloat16 or the @tiny version")


def build(spec: str | SyntheticShape, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
          seed: int = 0):
    """A transformers *ForCausalLM of the shape, random weights created on ``device`` in ``dtype`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    shape = spec if isinstance(spec, SyntheticShape) else parse(spec)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    _check_memory(shape, dtype, device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=dtype)
    _widen_margins(model)
    return model.eval()


@torch.no_grad()
def _widen_margins(model) -> None:
    """Random weights whose greedy choices no rounding flips: each layer's writes to the residual stream (o_proj,
    down_proj) scaled by RESIDUAL_WRITE_SCALE and the LM head made the embeddings (copied where untied), so the final
    hidden state stays near the last token's embedding, whose own logit leads every other by ~150 bf16 ulps (greedy
    decoding repeats the prompt's last token). With the plain random weights the top two sat a few ulps apart (median
    7, at times 1, on llama-3.2-1b in bf16), so a GPU's other kernels for other row counts parted a speculative run
    from the plain one the oracle drafter takes its reference from, after which it proposed tokens of another text.
    Each step's work (weight reads, GEMM shapes, attention) is the same."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(RESIDUAL_WRITE_SCALE)
        layer.mlp.down_proj.weight.mul_(RESIDUAL_WRITE_SCALE)
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    if head is not embed:
        head.copy_(embed)


def draft_spec(spec: str) -> str | None:
    """The ``synthetic:`` name of the draft model that goes with a target's, None when there is none."""
    shape = parse(spec)
    tiny = shape.name.endswith(TINY_SUFFIX)
    base = shape.name[: -len(TINY_SUFFIX)] if tiny else shape.name
    draft = DRAFT_FOR.get(base)
    return None if draft is None else PREFIX + draft + (TINY_SUFFIX if tiny else "")


def eagle_head(target_config, *, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
               seed: int = 0, draft_vocab: int | None = None):
    """A random EAGLE layer shaped for the target (one decoder layer of its shape), on ``device`` in ``dtype``; on CUDA
    its projections packed as the layers specdec loads are (EagleModel.pack_on_cuda).

    ``draft_vocab``: the size of its reduced LM head (ids 0..N-1); default EAGLE_DRAFT_VOCAB for vocabularies larger
    than that, else the full vocabulary (the target's own LM head, as for the @tiny shapes)."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel

    vocab = target_config.vocab_size
    if draft_vocab is None:
        draft_vocab = EAGLE_DRAFT_VOCAB if vocab > EAGLE_DRAFT_VOCAB else 0
    if not 0 <= draft_vocab <= vocab:
        raise InputError(f"draft_vocab must be in [0, {vocab}], got {draft_vocab}")
    config = EagleConfig.for_target(target_config, draft_vocab=tuple(range(draft_vocab)))
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(seed + 1)  # not the target's stream: the layer is no copy of the target's first one
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = EagleModel(config)
        finally:
            torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype).eval().pack_on_cuda()  # buffers are built on the CPU by name
