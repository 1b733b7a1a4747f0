"""The engine's own forward pass for the Llama family, over the paged KV cache.

Llama, Mistral, Qwen2, Qwen3 and SmolLM share it: RMSNorm, RoPE (scaling variants via the
loaded model's own ``inv_freq`` / ``attention_scaling``), GQA, SwiGLU, tied or untied
embeddings, optional q/k/v bias (Qwen2) and q/k RMSNorm (Qwen3). The runner holds
references to the loaded transformers model's parameters: no weight is copied. The backend is
chosen when the runner is built (``specdec.kernels.dispatch``; Triton on CUDA by default): on the
Triton backend each layer's element-wise steps run as fused Triton kernels, and attention follows
the KV cache's backend; otherwise everything is PyTorch ops. Attention is full attention: a sliding-window
model (Mistral, Qwen2/3 with ``use_sliding_window``) runs exactly up to its window plus the last new token,
which becomes ``shape.max_positions``; ``shape.check_fits`` refuses a longer request with a message naming the window.
``runner.invariant_mode(True)`` is the same runner in the bit-exact mode: every row's result independent of the
other rows of the forward (:mod:`specdec.models.invariant_ops`).

    runner = LlamaRunner(hf_model)
    out = runner.forward(token_ids, positions, plan, cache, logits_rows)
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention import AttentionPlan, paged_attention
from specdec.errors import InputError, SpecdecError
from specdec.kernels.dispatch import Backend, BackendError, resolve_backend
from specdec.kv_cache import PagedKVCache
from specdec.models import invariant_ops, row_policy
from specdec.models.fused_projections import LayerProjections

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE whose angles do not change with length (their frequencies: the rotary module's, as transformers built them)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# RoPE whose angles change only once a sequence passes the context (max_position_embeddings): transformers grows
# dynamic NTK's base there, and below it keeps the frequencies it built, which specdec runs (it never passes it)
CONTEXT_ROPE_TYPES = ("dynamic",)

logger = logging.getLogger(__name__)


class UnsupportedModelError(SpecdecError, ValueError):
    """The model is of a kind specdec's forward does not run (another architecture, activation or RoPE type): it
    would not be the model's own forward, so it is refused, naming what is unsupported."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    # tokens (prompt + new) specdec runs exactly: the context, or the sliding window + 1 when smaller (_shape)
    max_positions: int
    sliding_window: int | None = None  # the window of a sliding-window model (Mistral, Qwen2/3 with one)
    rope_grows: bool = False  # RoPE that transformers rescales past the context (CONTEXT_ROPE_TYPES)

    @property
    def window_bound(self) -> bool:
        """Whether ``max_positions`` is set by the sliding window (its window + 1, no more than the context)."""
        return self.sliding_window is not None and self.sliding_window + 1 == self.max_positions

    @property
    def limit_words(self) -> str:
        """``max_positions`` as messages name it: the sliding window where it is the bound, else the context."""
        if self.window_bound:
            return (f"sliding window of {self.sliding_window} tokens plus the last new token "
                    f"({self.max_positions} in all)")
        return f"context of {self.max_positions} tokens"

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, note: str = "", lower: str = "max_new_tokens",
                   name: str = "prompt", detail: str = "") -> None:
        """An InputError unless a prompt of ``prompt_tokens`` + ``max_new_tokens`` new tokens fits; for a
        sliding-window model the message names the window (full attention equals windowed attention only while
        every token sees the whole sequence, so specdec refuses to go past it). ``note`` follows the count of new
        tokens in the message, e.g. ", set by max_length from generation_config"; ``lower`` is what the advice
        says to lower (max_length where that set the count); ``name`` and ``detail`` name the prompt of a batch
        ("prompt 3", ", the longest")."""
        if prompt_tokens + max_new_tokens <= self.max_positions:
            return
        asked = f"{name} ({prompt_tokens} tokens{detail}) + max_new_tokens ({max_new_tokens}{note})"
        # a prompt that fills the limit alone leaves no count of new tokens to lower to
        advice = f"shorten the prompt or lower {lower}" if prompt_tokens < self.max_positions else \
            "the prompt alone fills it: shorten the prompt"
        if self.window_bound:
            raise InputError(
                f"{asked} exceeds the model's {self.limit_words} (config.sliding_window): specdec computes full "
                f"attention, which equals the model's windowed attention only while every token it attends from "
                f"(all but the last new one) sees the whole sequence; {advice}"
            )
        why = (": past it transformers rescales the model's dynamic RoPE, which specdec does not"
               if self.rope_grows else "")
        raise InputError(f"{asked} exceeds the model's {self.limit_words}{why}; {advice}")

    def check_answer_fits(self, prompt: str, prompt_tokens: int, flag: str, new_tokens: int, fits: int | None = None,
                          also: str = "", instead: str = "") -> None:
        """An InputError naming ``flag`` (the command's option that sets ``new_tokens``) unless an answer of
        ``new_tokens`` to a prompt of ``prompt_tokens`` (``prompt``: what the message calls it) fits: the one wording
        of the commands' checks before they run (train's answers and tau prompts, eval's identity and conversation
        prompts). ``fits``: the most ``flag`` may be (default: what the prompt leaves), advised where >= 1, followed
        by ``also``; ``instead``: another way out, said last."""
        if prompt_tokens + new_tokens <= self.max_positions:
            return
        fits = self.max_positions - prompt_tokens if fits is None else fits
        lower = f"lower {flag} to {fits} or less{also}" if fits >= 1 else ""
        advice = ", or ".join(way for way in (lower, instead) if way) or "the prompt alone fills it"
        raise InputError(f"{prompt}: its {prompt_tokens} tokens + {flag} {new_tokens} exceed the model's "
                         f"{self.limit_words}; {advice}")


@dataclass(frozen=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [num_rows, vocab] float32, rows = logits_rows; None if with_logits=False
    hidden: torch.Tensor  # [num_rows, hidden_size] final-norm hidden states of those rows
    # [num_rows, len(feature_layers) * hidden_size] the residual streams entering the asked layers (id num_layers:
    # the last one, before the final norm), concatenated in the order asked (EAGLE-3); None when none were asked
    features: torch.Tensor | None = None


def rope_parameters(config) -> dict:
    """A transformers config's RoPE parameters: ``rope_parameters`` (transformers 5), else ``rope_scaling``."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def rope_type(params) -> str:
    """The RoPE type RoPE parameters name (``rope_type``, or transformers 4's ``type``; "default" for none)."""
    params = params or {}
    return str(params.get("rope_type", params.get("type", "default")))


def sliding_window(config) -> int | None:
    """The sliding window of attention of a transformers config, None when no layer uses one.

    The engine runs full attention over the whole sequence. A query at position i of a windowed layer sees
    positions (i - window, i] (transformers' sliding-window mask), the same keys as full attention while
    i < window. The last new token is never a query (nothing is generated from it), so ``window + 1`` tokens in all
    are exact: the runner's ``shape.max_positions`` stops there.
    Mistral windows every layer whenever ``sliding_window`` is set (transformers' Mistral reads neither
    ``layer_types`` nor ``use_sliding_window``); elsewhere ``layer_types`` (transformers 5: Qwen2 / Qwen3, per
    layer) decides where present, else ``sliding_window`` counts (a Llama config's stray key too: transformers'
    cache then keeps only the window while decoding), unless a Qwen2 / Qwen3 config's ``use_sliding_window`` is
    False; a Llama config's stray ``use_sliding_window`` is read by nothing in transformers, so its window stays.
    ``sliding_attention`` layers without a window are an UnsupportedModelError: transformers runs no such layer."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window and "sliding_attention" in (layer_types or ()):  # transformers' cache and mask need the window
        raise UnsupportedModelError("config.layer_types has sliding_attention layers but config.sliding_window is "
                                    f"{window!r} (a Qwen2 / Qwen3 config sets it to None unless use_sliding_window "
                                    "is true): transformers cannot run such a layer; set sliding_window, or make "
                                    "those layers full_attention")
    if not window:
        return None
    if getattr(config, "model_type", None) == "mistral":
        return int(window)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(config, "model_type", None) in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def check_supported(hf_model) -> None:
    config = hf_model.config
    mtype = getattr(config, "model_type", type(hf_model).__name__)
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {mtype!r} is not supported; specdec runs the Llama family: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not hasattr(hf_model, "lm_head") or not hasattr(getattr(hf_model, "model", None), "layers"):
        raise UnsupportedModelError(
            f"expected a *ForCausalLM model with .model.layers and .lm_head, got {type(hf_model).__name__}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers' two names of one function
        raise UnsupportedModelError(f"only SwiGLU MLPs (hidden_act='silu') are supported, got {act!r}")
    rope = rope_type(rope_parameters(config))
    rotary = getattr(hf_model.model, "rotary_emb", None)
    if rope in STATIC_ROPE_TYPES + CONTEXT_ROPE_TYPES:  # and the rotary module's own (one built from another
        rope = getattr(rotary, "rope_type", rope)  # config), which runs
    check_rope_type(rope)
    grown, context = getattr(rotary, "max_seq_len_cached", 0), getattr(rotary, "original_max_seq_len", 0)
    if rope in CONTEXT_ROPE_TYPES and grown > context:
        raise UnsupportedModelError(f"the model's dynamic RoPE was rescaled by an earlier forward of {grown} tokens, "
                                    f"past its context of {context} (rotary_emb.max_seq_len_cached): specdec runs "
                                    "the context's frequencies, which transformers restores only at its next "
                                    "shorter forward; run the model once on a shorter input, or reload it")


def check_rope_type(rope: str, where: str = "") -> None:
    """An UnsupportedModelError for a RoPE type the runner does not compute (``where``: the config key, for the
    message)."""
    if rope not in STATIC_ROPE_TYPES + CONTEXT_ROPE_TYPES:
        why = " (it changes with the sequence length)" if rope == "longrope" else ""
        raise UnsupportedModelError(f"RoPE type {rope!r}{where} is not supported{why}; supported: "
                                    f"{', '.join(STATIC_ROPE_TYPES)}, and {', '.join(CONTEXT_ROPE_TYPES)} within "
                                    "the context")


def _attention_scale(layers, head_dim: int) -> float:
    """The scale of the attention scores, as transformers' forward reads it: each layer's ``self_attn.scaling``
    (head_dim ** -0.5 as built; an edit since is read); layers that disagree are refused."""
    scales = {float(getattr(layer.self_attn, "scaling", head_dim**-0.5)) for layer in layers} or {head_dim**-0.5}
    if len(scales) > 1:
        raise UnsupportedModelError(f"the attention layers scale their scores differently ({sorted(scales)}: "
                                    "self_attn.scaling); specdec runs one scale for every layer")
    return scales.pop()


def check_shape(hf_model, shape: ModelShape) -> None:
    """An UnsupportedModelError where the config gives another shape than the modules have (a config edited after
    the model was built): the runner sizes its cache and views by the config, transformers' forward computes with
    the modules (and runs only the first ``config.num_hidden_layers`` layers)."""
    layers = hf_model.model.layers
    attn = layers[0].self_attn if len(layers) else None
    found = {"num_hidden_layers": (shape.num_layers, len(layers)),
             "hidden_size": (shape.hidden_size, hf_model.model.embed_tokens.weight.shape[-1]),
             "vocab_size": (shape.vocab_size, hf_model.lm_head.weight.shape[0])}
    if attn is not None:
        found["num_attention_heads x head_dim"] = (shape.num_heads * shape.head_dim, attn.q_proj.weight.shape[0])
        found["num_key_value_heads x head_dim"] = (shape.num_kv_heads * shape.head_dim, attn.k_proj.weight.shape[0])
    wrong = [f"{name} gives {want}, the model has {have}" for name, (want, have) in found.items() if want != have]
    if wrong:
        hint = (" (model.model.layers = model.model.layers[:n] keeps the first n layers)"
                if found["num_hidden_layers"][0] < len(layers) else "")
        raise UnsupportedModelError(f"the model's config does not describe its modules ({'; '.join(wrong)}): was "
                                    f"the config edited after the model was built? Set it back, or change the "
                                    f"modules{hint}")
    inv_freq = getattr(getattr(hf_model.model, "rotary_emb", None), "inv_freq", None)
    if isinstance(inv_freq, torch.Tensor) and 2 * inv_freq.numel() != shape.head_dim:  # the runner rotates whole heads
        raise UnsupportedModelError(f"partial rotary embeddings (RoPE on {2 * inv_freq.numel()} of the "
                                    f"{shape.head_dim} dimensions of each head: partial_rotary_factor) are not "
                                    "supported")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, in] @ weight[out, in]^T (+ bias).

    On CPU a few rows may be faster as ``weight @ x^T`` (GEMV-like reads of the weight), some row counts
    faster padded to more rows, some over a copy of the weight packed once for oneDNN: the row policy measured
    on this machine for the current torch thread count (:mod:`specdec.models.row_policy`, installed by
    ``specdec.cost_model.ensure_row_policy`` when an engine is built) decides; without one, and on GPUs, this
    is ``F.linear``. Padding rows are copies of real ones and are dropped, so every choice returns
    ``F.linear``'s values for the rows given, up to float rounding. A product that needs gradients (training)
    never takes the packed one, which has no autograd.
    """
    if x.device.type == "cpu":
        cols = row_policy.active_cols(weight.dtype).get(x.shape[0])
        if cols == row_policy.PACKED:
            if not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
                return row_policy.packed_linear(x, weight, bias)
        elif cols is not None:
            out = row_policy.transposed_linear(x, weight, cols)
            return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` computed by :func:`linear` (any leading dims): drafter layers (EAGLE, Medusa) multiply the few
    rows of a draft step under the same measured CPU row policy as the target. Same parameters and state-dict keys
    as ``nn.Linear``; large inputs (training batches) and GPUs go through ``F.linear`` as before."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return linear(x, self.weight, self.bias)
        return linear(x.reshape(-1, x.shape[-1]), self.weight, self.bias).view(*x.shape[:-1], self.out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# The three element-wise steps of a layer: PyTorch ops (the reference, CPU), or one fused Triton
# kernel each on the Triton backend (specdec.kernels.fused_ops, the GPU path) with the same rounding.
def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight); the fused kernel updates h in place."""
    if backend.triton:
        return backend.fused.add_rms_norm(h, delta, weight, eps)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: Backend) -> torch.Tensor:
    if backend.triton and x.stride(-1) == 1:  # rows may be strided: a fused QKV product's q and k are views
        return backend.fused.rope_(x, cos, sin)
    return x * cos + _rotate_half(x) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor, backend: Backend) -> torch.Tensor:
    if backend.triton:
        return backend.fused.silu_mul(gate, up)
    return F.silu(gate) * up


def _shape(cfg) -> ModelShape:
    """The runner's shape of a transformers config."""
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    window = sliding_window(cfg)
    # the last new token is never attended from: every query stays inside a window up to window + 1 tokens
    max_pos = cfg.max_position_embeddings if window is None else min(cfg.max_position_embeddings, window + 1)
    grows = rope_type(rope_parameters(cfg)) in CONTEXT_ROPE_TYPES
    return ModelShape(cfg.num_hidden_layers, num_heads, cfg.num_key_value_heads, head_dim, cfg.hidden_size,
                      cfg.vocab_size, max_pos, window, grows)


_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _projection_parts(layers) -> tuple:
    """Where each q/k/v and gate/up weight and bias of ``layers`` is (its data address; 0: none). Read from the
    modules' ``_modules`` / ``_parameters`` dicts: nn.Module attribute lookups took 0.5 ms a call on 30 layers."""
    out = []
    for layer in layers:
        for block, names in _PROJECTIONS:
            modules = layer._modules[block]._modules
            for name in names:
                params = modules[name]._parameters
                bias = params.get("bias")
                out += (params["weight"].data_ptr(), 0 if bias is None else bias.data_ptr())
    return tuple(out)


_INTERPRETED_INVARIANCE_WARNED = False


def _warn_interpreted_invariance(runner) -> None:
    """Once a process: the bit-exact mode on the Triton interpreter rests on numpy's matmul, whose row order of
    summation within a tile varies on some CPUs (docs/bit-exact.md)."""
    global _INTERPRETED_INVARIANCE_WARNED
    if runner.backend.triton and runner.device.type != "cuda" and not _INTERPRETED_INVARIANCE_WARNED:
        _INTERPRETED_INVARIANCE_WARNED = True
        logger.warning("invariant=True on the Triton interpreter (TRITON_INTERPRET=1): its tl.dot is numpy's "
                       "matmul, which on some CPUs sums a tile's rows in different orders, so rows may differ in "
                       "their last bits; the reference backend (SPECDEC_ATTENTION=reference) is bit-exact on a CPU")


class LlamaRunner:
    invariant: bool = False  # the bit-exact mode: see invariant_mode()
    _rope_table: invariant_ops.RopeTable | None = None
    # per layer, its fused projections (specdec.models.fused_projections), for the weights' storage named by the key,
    # and the address of every projection weight and bias when any is fused (stale())
    _projections: tuple[tuple, list[LayerProjections] | None, tuple] = ((), None, ())

    def __init__(self, hf_model, backend: str | Backend | None = None, invariant: bool = False) -> None:
        """``backend``: "auto", "reference", "triton" or a resolved Backend; None reads SPECDEC_ATTENTION now.
        ``invariant``: the bit-exact mode (:meth:`invariant_mode`)."""
        check_supported(hf_model)
        self.hf_model = hf_model
        cfg = hf_model.config
        base = hf_model.model
        # the norms' own epsilon, as transformers' forward reads it (config.rms_norm_eps only built them: an edit of
        # it since changes nothing there); each layer's norms are read in the forward
        self.eps = base.norm.variance_epsilon
        self.qk_norms = getattr(cfg, "model_type", None) == "qwen3"  # transformers calls no other family's q_norm
        self.shape = _shape(cfg)
        check_shape(hf_model, self.shape)
        head_dim = self.shape.head_dim
        self.layers = base.layers
        self.scale = _attention_scale(self.layers, head_dim)
        self.embed = base.embed_tokens.weight
        self.final_norm = base.norm.weight
        self.lm_head = hf_model.lm_head.weight  # same tensor as embed when tied
        # the rotary module, not a copy of its inv_freq buffer: model.to(device) replaces buffers (parameters
        # keep their identity), so a copy taken here would stay behind and cost a host-to-device copy per forward
        self.rotary = base.rotary_emb
        self.attention_scaling = float(getattr(self.rotary, "attention_scaling", 1.0))
        # the frequencies as built: the eager forward reads them live, but the bit-exact mode's RoPE table and a
        # CUDA-graph cache's are computed once from them, so an edit since (a RoPE scaling tried in place) is stale()
        self._inv_freq = self.rotary.inv_freq.detach().clone()
        self._backend_choice = backend  # what was asked for, resolved again by rebuilt()
        self._built_on = self.embed.device.type  # the device type the backend was chosen for (stale())
        self.backend = resolve_backend(self.embed.device, backend)  # fused element-wise ops; the cache's its own
        if self.backend.triton:  # before any forward, not at the first attention
            self.backend.attention.check_head_dim(head_dim)
            if self.dtype == torch.bfloat16 and self.embed.device.type != "cuda":  # the interpreter (dispatch)
                # tree attention refuses bf16 there itself, but the bit-exact mode's kernels would run on
                raise BackendError("a bfloat16 model cannot run on the Triton backend in the Triton interpreter (its "
                                   "bf16 dot products come out wrong and its bf16 casts truncate): use float32 or "
                                   "float16 there, or the reference backend")
        if invariant:
            self.invariant = True
            _warn_interpreted_invariance(self)

    def stale(self) -> str | None:
        """What of its model changed since this runner was built such that its forward would no longer be the model's
        (None: nothing): a module it reads replaced (``resize_token_embeddings`` to fewer tokens, a new ``lm_head``),
        the shape the config gives, the device type its backend was chosen for, a fused projection's weight given
        other memory (``param.data = ...``), the final norm's epsilon, the attention or RoPE scaling, the RoPE
        frequencies (which tables are computed from). A runner holds its model's modules, so identity is a sound
        test. Weights changed in place, a dtype, a device of the same type need nothing: the forward reads them
        live.
        Once per generate() call (:func:`specdec.models.loader.load_model`), never per step."""
        base = self.hf_model.model
        for name, mine, now in (("decoder layer list", self.layers, base.layers),
                                ("token embedding", self.embed, base.embed_tokens.weight),
                                ("final norm", self.final_norm, base.norm.weight),
                                ("LM head", self.lm_head, self.hf_model.lm_head.weight),
                                ("rotary embedding", self.rotary, base.rotary_emb)):
            if mine is not now:
                return f"its {name} was replaced"
        if self.shape != _shape(self.hf_model.config):
            return "its config gives another shape"
        if any(getattr(layer.self_attn, "scaling", self.scale) != self.scale for layer in self.layers):
            return "an attention layer's scaling was changed"
        if base.norm.variance_epsilon != self.eps:
            return "the final norm's epsilon was changed"
        if float(getattr(self.rotary, "attention_scaling", 1.0)) != self.attention_scaling:
            return "the rotary embedding's attention_scaling was changed"
        if self.embed.device.type != self._built_on:
            return f"it moved from {self._built_on} to {self.embed.device.type}"
        _, found, parts = self._projections
        if found is not None and parts != _projection_parts(self.layers):
            return "a fused projection's weight was given other memory"
        inv_freq = self.rotary.inv_freq
        if inv_freq.is_meta:  # nothing to compare: generate() refuses weights not loaded (check_weights_present)
            return None
        if inv_freq.dtype != self._inv_freq.dtype or not torch.equal(inv_freq, self._inv_freq.to(inv_freq.device)):
            return "the rotary embedding's inv_freq was changed"
        return None

    def rebuilt(self) -> "LlamaRunner":
        """A new runner of this one's model, backend choice and mode: :meth:`stale`'s remedy."""
        return LlamaRunner(self.hf_model, self._backend_choice, self.invariant)

    def invariant_mode(self, on: bool = True) -> "LlamaRunner":
        """This runner (``on`` equal to its mode) or a copy sharing every weight, in which every row's hidden
        states and logits are bitwise what a one-row forward at the same position computes, whatever the other
        rows (tree nodes, other sequences, a prompt): :mod:`specdec.models.invariant_ops`."""
        if bool(on) == self.invariant:
            return self
        runner = copy.copy(self)
        runner.invariant = bool(on)
        runner._rope_table = None
        if runner.invariant:
            _warn_interpreted_invariance(runner)
        return runner

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.invariant:
            return invariant_ops.linear(x, weight, bias, self.backend)
        return linear(x, weight, bias)

    def fused_projections(self) -> list[LayerProjections] | None:
        """Each layer's fused QKV / gate-up products where its weights lie side by side (module
        specdec.models.fused_projections), None when no layer's do or in the bit-exact mode. Found again when the
        weights move (a model.to() gives every parameter new storage)."""
        if self.invariant:
            return None
        first, last = self.layers[0], self.layers[-1]
        key = (self.embed.data_ptr(), first.self_attn.q_proj.weight.data_ptr(), last.mlp.up_proj.weight.data_ptr(),
               len(self.layers))
        if self._projections[0] != key:
            found = [LayerProjections.of(layer) for layer in self.layers]
            fused = any(p.qkv or p.gate_up for p in found)
            # with the address of every part, which the views keep alive: stale() compares them once per call
            self._projections = key, found if fused else None, _projection_parts(self.layers) if fused else ()
        return self._projections[1]

    def layer_weights(self) -> list[list[torch.Tensor]]:
        """Per layer, the weight matrices a forward multiplies, in its order: q / k / v (one block where fused), o,
        gate / up (likewise), down. What the CPU's row policy times (specdec.cost_model)."""
        fused = self.fused_projections()
        out = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, gate_up = (fused[i].qkv, fused[i].gate_up) if fused else (None, None)
            out.append([*([qkv.weight] if qkv else [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj)]),
                        attn.o_proj.weight,
                        *([gate_up.weight] if gate_up else [mlp.gate_proj.weight, mlp.up_proj.weight]),
                        mlp.down_proj.weight])
        return out

    def multiplied_weights(self) -> list[torch.Tensor]:
        """Every weight matrix a forward multiplies: :meth:`layer_weights`, layer after layer, then the LM head."""
        return [w for layer in self.layer_weights() for w in layer] + [self.lm_head]

    def _attention(self, q, k_cache, v_cache, plan: AttentionPlan, backend: Backend) -> torch.Tensor:
        if self.invariant:
            return invariant_ops.attention(q, k_cache, v_cache, plan, self.scale, backend)
        return paged_attention(q, k_cache, v_cache, plan, self.scale, backend)

    def _rope_for(self, positions: torch.Tensor, plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.invariant:
            table = getattr(plan, "rope_table", None)  # a CUDA-graph bucket's: rope() of every position, computed once
            return self.rope(positions) if table is None else (table[0][positions], table[1][positions])
        table = self._rope_table
        if table is None or table.inv_freq.device != self.device:
            table = self._rope_table = invariant_ops.RopeTable(self.rotary.inv_freq, self.attention_scaling,
                                                               self.dtype)
        # a sequence's keys are its positions [0, num_keys): the largest is known on the host
        return table(positions, max(s.key_slots.numel() for s in plan.seqs) - 1)

    def truncated(self, num_layers: int) -> "LlamaRunner":
        """A runner over the first ``num_layers`` layers + the final norm + the LM head,
        sharing every weight with this one (the self-draft drafter)."""
        if not 1 <= num_layers <= self.shape.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.shape.num_layers}], got {num_layers}")
        runner = copy.copy(self)
        runner.layers = self.layers[:num_layers]
        runner.shape = dataclasses.replace(self.shape, num_layers=num_layers)
        return runner

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [T, 1, head_dim]
        inv_freq = self.rotary.inv_freq.float()  # [head_dim / 2], on the model's device (no copy when float32)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        return cos[:, None, :], sin[:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,  # [T] new tokens of all sequences, flattened
        positions: torch.Tensor,  # [T]
        plan: AttentionPlan,
        cache: PagedKVCache,
        logits_rows: torch.Tensor | None,  # [R] rows of T that need logits; None = none (prefill)
        with_logits: bool = True,  # False: final hidden states only (CUDA graphs: the LM head runs on real rows)
        feature_layers: tuple[int, ...] = (),  # layer ids whose input residual streams come back as features
    ) -> ForwardOutput | None:
        s = self.shape
        n = token_ids.numel()
        cos, sin = self._rope_for(positions, plan)
        h = F.embedding(token_ids, self.embed)
        delta = None  # the last block's output, added to the residual stream h by the next norm
        streams: dict[int, torch.Tensor] = {}  # layer id -> [R, hidden_size] (feature_layers)
        fused = self.fused_projections()
        write_slots = plan.write_slots
        if cache.backend.triton:  # the KV-write kernel's index type, converted once per forward, not per layer
            write_slots = write_slots.to(device=cache.kv.device, dtype=torch.int32)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            norm = layer.input_layernorm
            h, x = add_rms_norm(h, delta, norm.weight, norm.variance_epsilon, self.backend)
            if i in feature_layers and logits_rows is not None:
                streams[i] = h[logits_rows]
            qkv = fused[i].qkv if fused else None
            if qkv is not None:  # one product, split into row-strided views
                out = self._linear(x, qkv.weight, qkv.bias)
                q, k, v = out.split(qkv.sizes, dim=-1)
            else:
                q = self._linear(x, attn.q_proj.weight, attn.q_proj.bias)
                k = self._linear(x, attn.k_proj.weight, attn.k_proj.bias)
                v = self._linear(x, attn.v_proj.weight, attn.v_proj.bias)
            q = q.view(n, s.num_heads, s.head_dim)
            k, v = k.view(n, s.num_kv_heads, s.head_dim), v.view(n, s.num_kv_heads, s.head_dim)
            q_norm = self.qk_norms  # Qwen3: RMSNorm over head_dim before RoPE
            width = s.num_heads + s.num_kv_heads  # a fused product's rows: q and k side by side, then v
            if qkv is not None and cache.backend.triton and self.backend.triton:
                # the norm (Qwen3), RoPE and the KV store in one launch
                qk = out[:, : width * s.head_dim].view(n, width, s.head_dim)
                norms = ((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.variance_epsilon,
                          attn.k_norm.variance_epsilon) if q_norm else None)
                cache.write_rotated(i, write_slots, qk, v, cos, sin, s.num_heads, norms)
                q = qk[:, : s.num_heads]
            elif qkv is not None and not q_norm:  # RoPE of q and k in one launch
                qk = apply_rope(out[:, : width * s.head_dim].view(n, width, s.head_dim), cos, sin, self.backend)
                q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
                cache.write(i, write_slots, k, v)
            else:
                if q_norm:
                    q = rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
                    k = rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
                q, k = apply_rope(q, cos, sin, self.backend), apply_rope(k, cos, sin, self.backend)
                cache.write(i, write_slots, k, v)
            k_cache, v_cache = cache.layer(i)
            o = self._attention(q, k_cache, v_cache, plan, cache.backend)
            delta = self._linear(o.reshape(n, s.num_heads * s.head_dim), attn.o_proj.weight, attn.o_proj.bias)
            norm = layer.post_attention_layernorm
            h, x = add_rms_norm(h, delta, norm.weight, norm.variance_epsilon, self.backend)
            mlp = layer.mlp
            gate_up = fused[i].gate_up if fused else None
            if gate_up is not None:
                gate, up = self._linear(x, gate_up.weight, gate_up.bias).split(gate_up.sizes, dim=-1)
            else:
                gate = self._linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias)
                up = self._linear(x, mlp.up_proj.weight, mlp.up_proj.bias)
            delta = self._linear(silu_mul(gate, up, self.backend), mlp.down_proj.weight, mlp.down_proj.bias)
        if logits_rows is None:
            return None
        if self.backend.triton:  # the residual add and the final norm in one launch, over every row
            h, normed = add_rms_norm(h, delta, self.final_norm, self.eps, self.backend)
            hidden = normed[logits_rows]
        else:  # the norm of the rows asked for only
            h = h + delta
            hidden = rms_norm(h[logits_rows], self.final_norm, self.eps)
        if len(self.layers) in feature_layers:
            streams[len(self.layers)] = h[logits_rows]
        features = torch.cat([streams[i] for i in feature_layers], dim=-1) if feature_layers else None
        return ForwardOutput(self.logits(hidden) if with_logits else None, hidden, features)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden_size] final-norm states -> [R, vocab]
        return self._linear(hidden, self.lm_head).float()
