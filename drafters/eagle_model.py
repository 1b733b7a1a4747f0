"""The EAGLE draft model: one decoder layer of the target's own type over the target's features (EAGLE-1 or -3).

At position ``j + 1`` it reads the target's final-norm hidden state ``f_j`` (the feature whose
logits chose token ``t_{j+1}``) and the embedding of ``t_{j+1}``, and predicts the next feature
``f_{j+1}``; the draft logits over ``t_{j+2}`` are that prediction through an LM head::

    x   = fc(cat(embed(t_{j+1}), f_j))                     # [.., 2H] -> [.., H]
    h   = x + attn(rms_norm(x))  (RoPE, GQA; keys: the earlier pairs and, in a tree, the node's ancestors)
    f^  = rms_norm(h + mlp(rms_norm(h)))                    # SwiGLU; the last norm: the target's feature space
    logits = lm_head(f^)     # the target's LM head, or N rows of it (reduced draft vocabulary)

Deeper draft steps feed ``f^`` back in place of the target's feature (EAGLE-1/2). Parameter names follow the
published EAGLE-1 layout plus ``lm_head.weight`` and the draft-to-target map ``d2t`` (token id = index +
d2t[index]) for a reduced vocabulary; published EAGLE-1 checkpoints have neither norm (``norms=False``).

**EAGLE-3** (``arch="eagle3"``): the features are the target's residual
streams entering ``feature_layers`` (low / middle / high), fused once by ``fc`` [kH -> H]; the first layer's
attention reads ``cat(input_layernorm(embed), hidden_norm(hidden))`` [2H]; deeper steps feed back the layer's
pre-norm output ``h``; logits are ``lm_head(norm(h))``.

    model = EagleModel(EagleConfig.for_target(hf_config, draft_vocab=ids))
    hidden = model.fuse(features)                        # EAGLE-3: [.., kH] -> [.., H]; EAGLE-1: unchanged
    out, k, v = model(embeds, hidden, positions, mask, past_k, past_v)

**MTP** (``arch="mtp"``, a target's own multi-token-prediction layer, :mod:`specdec.drafters.mtp`): the
target's final-norm feature and the embedding are normed apart (``enorm``, ``hnorm``), projected by ``fc``
[2H -> H] without bias, then one Llama layer; deeper steps feed back its pre-norm output; logits are the
target's LM head over ``norm(h)``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import torch
from specdec.drafters.eagle_rope import frequencies, rope_params
from torch import nn
from torch.nn import functional as F

from specdec.errors import InputError, InputTypeError
from specdec.models.fused_projections import LayerProjections, pack_layers
from specdec.models.llama import Linear, linear, rope_parameters

INIT_OUTPUT_SCALE = 0.1  # init_from_target: attention / MLP outputs start small next to the passed-through feature
ARCHS = ("eagle1", "eagle3", "mtp")
UNRECORDED_CONTEXT = 4096  # max_position_embeddings of a head whose target's context was not recorded


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's published low / middle / high layer ids (2, L // 2, L - 3); a target too shallow for rising ids
    takes (0, L // 2, L) (id L: the last residual stream, before the final norm)."""
    ids = (2, num_layers // 2, num_layers - 3)
    return ids if ids[0] < ids[1] < ids[2] else (0, num_layers // 2, num_layers)


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    num_features: int = 1  # target feature vectors per position (1: EAGLE-1/2's last hidden state; eagle3: derived)
    norms: bool = True  # input and output RMSNorm (specdec's layers); False: the published EAGLE-1 layer
    draft_vocab: tuple[int, ...] = ()  # token ids of a reduced LM head; () or None = the target's full LM head
    base_model_name_or_path: str = ""
    # the draft tree chosen by training (drafter options override): depth, candidates per expansion, node budget
    depth: int = 5
    top_k: int = 8
    max_nodes: int = 16
    arch: str = "eagle1"  # "eagle3": fused features, 2H attention input, own norm and LM head (module doc)
    feature_layers: tuple[int, ...] = ()  # eagle3: target layer ids whose input residual streams are fused, ascending
    norm_before_residual: bool = False  # eagle3: the residual around attention is hidden_norm(hidden)
    own_lm_head: bool = False  # eagle3 over the full vocabulary: its own [V, H] head instead of the target's
    # the target's context, written into exported configs (serving engines size the draft's positions by it)
    max_position_embeddings: int = UNRECORDED_CONTEXT
    # RoPE scaling beyond rope_theta, as sorted (name, value) pairs with its rope_type; () = plain (eagle_rope.py)
    rope_scaling: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise InputError(f"EagleConfig.arch must be one of {ARCHS}, got {self.arch!r}")
        layers = tuple(int(i) for i in self.feature_layers)
        object.__setattr__(self, "feature_layers", layers)
        if self.arch == "eagle3":
            # ascending: vLLM and SGLang capture and concatenate the streams in layer order, whatever a list says
            if not layers or min(layers) < 0 or list(layers) != sorted(set(layers)):
                raise InputError(f"EagleConfig.feature_layers must hold distinct layer ids >= 0 in ascending order "
                                 f"for EAGLE-3 (vLLM and SGLang concatenate the streams in layer order), got "
                                 f"{list(layers)}")
            object.__setattr__(self, "num_features", len(layers))
            object.__setattr__(self, "norms", True)
        elif self.arch == "mtp":
            object.__setattr__(self, "norms", True)
        if self.arch != "eagle3" and (layers or self.norm_before_residual or self.own_lm_head):
            raise InputError("EagleConfig: feature_layers, norm_before_residual and own_lm_head are EAGLE-3 options "
                             "(arch='eagle3')")
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "num_features", "depth", "top_k", "max_nodes", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"EagleConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"EagleConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        object.__setattr__(self, "rope_scaling", rope_params(self.rope_scaling))
        if self.draft_vocab is None:  # the full vocabulary, as the drafters' draft_vocab=None means
            object.__setattr__(self, "draft_vocab", ())
        if isinstance(self.draft_vocab, (str, bytes)) or not hasattr(self.draft_vocab, "__iter__"):
            raise InputTypeError(f"EagleConfig.draft_vocab must be a list of token ids, got {self.draft_vocab!r}")
        vocab = tuple(int(t) for t in self.draft_vocab)
        object.__setattr__(self, "draft_vocab", vocab)
        if vocab and (min(vocab) < 0 or max(vocab) >= self.vocab_size or len(set(vocab)) != len(vocab)):
            raise InputError(f"EagleConfig.draft_vocab must hold distinct ids in [0, {self.vocab_size})")

    @classmethod
    def for_target(cls, hf_config, **overrides) -> "EagleConfig":
        """The draft layer shaped like one layer of ``hf_config`` (a transformers Llama-family config)."""
        heads = hf_config.num_attention_heads
        params = rope_parameters(hf_config)
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        fields = dict(
            hidden_size=hf_config.hidden_size, intermediate_size=hf_config.intermediate_size, num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", heads) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            vocab_size=hf_config.vocab_size, rms_norm_eps=float(hf_config.rms_norm_eps), rope_theta=float(theta),
            base_model_name_or_path=str(getattr(hf_config, "_name_or_path", "") or ""),
            max_position_embeddings=int(getattr(hf_config, "max_position_embeddings", None) or UNRECORDED_CONTEXT),
            rope_scaling=params)  # the target's own scaling: the layer's positions are the target's
        fields.update(overrides)
        if fields.get("arch") == "eagle3" and not fields.get("feature_layers"):
            if hf_config.num_hidden_layers < 2:
                raise InputError("EAGLE-3 fuses three of the target's residual streams, and a 1-layer target has "
                                 "two: give feature_layers=(0, 1)")
            fields["feature_layers"] = default_feature_layers(hf_config.num_hidden_layers)
        return cls(**fields)

    def to_json(self) -> dict:
        d = asdict(self)
        d["draft_vocab"] = list(self.draft_vocab)
        d["feature_layers"] = list(self.feature_layers)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d


class EagleAttention(nn.Module):
    def __init__(self, c: EagleConfig, in_size: int | None = None) -> None:
        super().__init__()
        self.c = c
        in_size = in_size or c.hidden_size
        self.q_proj = Linear(in_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = Linear(in_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = Linear(in_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class EagleMLP(nn.Module):
    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleLayer(nn.Module):
    """A Llama decoder layer (without the input norm in the published EAGLE-1 layout); EAGLE-3's first layer
    reads 2H (embedding and hidden state) and has a second input norm, ``hidden_norm``."""

    def __init__(self, c: EagleConfig) -> None:
        super().__init__()
        eagle3 = c.arch == "eagle3"
        self.self_attn = EagleAttention(c, 2 * c.hidden_size if eagle3 else None)
        if eagle3:
            self.hidden_norm = _Norm(c.hidden_size)
        if c.norms:
            self.input_layernorm = _Norm(c.hidden_size)
        self.post_attention_layernorm = _Norm(c.hidden_size)
        self.mlp = EagleMLP(c)


class _Norm(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused) -> torch.Tensor:
    """:func:`_rms_norm`, or with ``fused`` (kernels.fused_ops, inference on the Triton backend) one launch for it."""
    if fused is None:
        return _rms_norm(x, weight, eps)
    return fused.add_rms_norm(x.reshape(-1, x.shape[-1]), None, weight, eps)[1].view(x.shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _mismatch(want: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str:
    """What keeps ``state`` from loading into a model whose tensors are ``want`` (names and shapes), in one line;
    "" when it loads."""
    def names(keys: list[str]) -> str:
        return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")

    missing = [k for k in want if k not in state]
    unexpected = sorted(k for k in state if k not in want)
    shapes = [f"{k} is {list(state[k].shape)} where the config makes {list(want[k].shape)}"
              for k in want if k in state and state[k].shape != want[k].shape]
    parts = ([f"tensors the config expects are missing: {names(missing)}"] if missing else []) + (
        [f"tensors the config does not make: {names(unexpected)}"] if unexpected else []) + shapes[:2]
    return "; ".join(parts)


class EagleModel(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = self.config = config
        self.eagle3 = c.arch == "eagle3"
        if not self.eagle3 and c.num_features != 1:
            raise InputError(f"an EAGLE-1 layer reads 1 target feature per position (the last hidden state); "
                             f"the config asks for {c.num_features} (EAGLE-3 fuses several: arch='eagle3')")
        self.mtp = c.arch == "mtp"
        if self.eagle3:  # fc fuses the target's features only; deeper steps feed back H-wide hidden states
            self.fc = Linear(c.num_features * c.hidden_size, c.hidden_size, bias=False)
        elif self.mtp:
            self.enorm, self.hnorm = _Norm(c.hidden_size), _Norm(c.hidden_size)
            self.fc = Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        else:
            self.fc = Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([EagleLayer(c)])
        self.norm = _Norm(c.hidden_size) if c.norms else None
        # buffers are built on the CPU by name, parameters wherever the caller's device context says: a loader
        # builds on the meta device and assigns the checkpoint's tensors (EagleModel.from_state)
        if c.draft_vocab:
            ids = torch.tensor(c.draft_vocab, dtype=torch.long, device="cpu")
            self.lm_head = Linear(c.hidden_size, len(ids), bias=False)
            self.register_buffer("d2t", ids - torch.arange(len(ids), device="cpu"), persistent=True)  # [N] EAGLE-3
        elif c.own_lm_head:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, bias=False)
            self.d2t = None
        else:
            self.lm_head = None  # the target's own LM head
        self._inv_freqs: dict[torch.device, torch.Tensor] = {}  # RoPE frequencies per device (_inv_freq)

    @classmethod
    def from_state(cls, config: EagleConfig, state: dict[str, torch.Tensor]) -> "EagleModel":
        """The model holding ``state``'s tensors (strict): built on the meta device, so no random initialisation
        is computed only to be overwritten (28 ms per load on 2 CPU cores, paid by every generate() call)."""
        with torch.device("meta"):
            model = cls(config)
        mismatch = _mismatch(model.state_dict(), state)
        if mismatch:  # one line naming the tensors (torch's own message names none on its first line)
            raise RuntimeError(mismatch)
        model.load_state_dict(state, strict=True, assign=True)
        return model

    @property
    def draft_ids(self) -> torch.Tensor | None:  # [N] token id of each reduced logit, None = full vocabulary
        """One tensor per ``d2t`` buffer, kept on the model: a captured CUDA graph reads it by address, and later
        drafters over this model replay that graph (drafters/eagle_graphs.py), so they must not each make their own
        (the first drafter's was freed with it, under a graph that still read it)."""
        if self.lm_head is None or self.d2t is None:
            return None
        made_from, version, ids = self.__dict__.get("_draft_ids", (None, None, None))
        if made_from is not self.d2t:  # first use, or d2t was moved or replaced
            ids = self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)
        elif version != self.d2t._version:  # d2t changed in place (load_state_dict): so are they, at their address
            ids.copy_(self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device))
        self.__dict__["_draft_ids"] = (self.d2t, self.d2t._version, ids)
        return ids

    def init_from_target(self, hf_model) -> None:
        """Start from the target's last decoder layer (its output projections scaled down, so the layer starts near
        the identity), its final norm and its LM head rows; fc starts as [0 | I] (the feature passes through)."""
        if self.mtp:
            raise InputError("an MTP layer comes with its target's checkpoint; it is not initialised from the target")
        if self.eagle3:
            return self._init_eagle3_from_target(hf_model)
        last = hf_model.model.layers[-1]
        with torch.no_grad():
            mine = self.layers[0]
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(mine.self_attn, name).weight.copy_(getattr(last.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mine.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            mine.self_attn.o_proj.weight.mul_(INIT_OUTPUT_SCALE)
            mine.mlp.down_proj.weight.mul_(INIT_OUTPUT_SCALE)
            mine.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            if self.config.norms:
                mine.input_layernorm.weight.copy_(last.input_layernorm.weight)
                self.norm.weight.copy_(hf_model.model.norm.weight)
            H = self.config.hidden_size
            self.fc.weight.zero_()
            self.fc.weight[:, H:] = torch.eye(H)
            self.fc.bias.zero_()
            if self.lm_head is not None:
                self.lm_head.weight.copy_(hf_model.get_output_embeddings().weight[self.draft_ids])

    def _init_eagle3_from_target(self, hf_model) -> None:
        """EAGLE-3 start: the target's last layer with q/k/v reading only the hidden half ([0 | W]), its norms and
        LM head rows; fc starts as the highest feature layer's stream passed through ([0 | .. | I])."""
        last, c, H = hf_model.model.layers[-1], self.config, self.config.hidden_size
        with torch.no_grad():
            mine = self.layers[0]
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(mine.self_attn, name).weight
                w.zero_()
                w[:, H:] = getattr(last.self_attn, name).weight
            mine.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight * INIT_OUTPUT_SCALE)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mine.mlp, name).weight.copy_(getattr(last.mlp, name).weight)
            mine.mlp.down_proj.weight.mul_(INIT_OUTPUT_SCALE)
            mine.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
            mine.input_layernorm.weight.copy_(hf_model.model.layers[0].input_layernorm.weight)
            mine.hidden_norm.weight.copy_(last.input_layernorm.weight)
            self.norm.weight.copy_(hf_model.model.norm.weight)
            self.fc.weight.zero_()
            top = max(range(c.num_features), key=lambda i: c.feature_layers[i])
            self.fc.weight[:, top * H:(top + 1) * H] = torch.eye(H)
            if self.lm_head is not None:
                head = hf_model.get_output_embeddings().weight
                self.lm_head.weight.copy_(head if self.draft_ids is None else head[self.draft_ids])

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[.., num_features * H] target features -> [.., H] the hidden state the layer reads (EAGLE-3's fc);
        EAGLE-1 reads the feature itself (its fc runs inside ``forward``, over the embedding too)."""
        if not self.eagle3:
            return features
        if features.shape[-1] != self.fc.in_features:
            raise InputError(f"EAGLE-3 head: expected {self.config.num_features} fused target features per "
                             f"position ({self.fc.in_features} values), got {features.shape[-1]}")
        return self.fc(features)

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE frequencies in float32 on ``device`` whatever the module's dtype: as a buffer, ``Module.to(bfloat16)``
        rounded them (by up to 0.4%: about a radian of angle 256 positions apart) away from the float32 rotation the
        layer was trained with. Computed on the CPU, as they always were, once per device."""
        if device not in self._inv_freqs:
            self._inv_freqs[device] = self._frequencies[0].to(device)
        return self._inv_freqs[device]

    @cached_property
    def _frequencies(self) -> tuple[torch.Tensor, float]:
        """The config's RoPE frequencies on the CPU and its cos / sin scale (yarn's attention factor; else 1)."""
        return frequencies(self.config)

    def pack_on_cuda(self) -> "EagleModel":
        """On CUDA, its q/k/v and gate/up weights re-laid side by side (specdec.models.fused_projections), as specdec
        lays out the layers it loads or builds; elsewhere, and for a layer passed in as an object, as built."""
        if self.layers[0].mlp.up_proj.weight.device.type == "cuda":
            pack_layers(self.layers)
        return self

    def projections(self) -> LayerProjections:
        """The layer's QKV and gate/up products as one each where its weights lie side by side (packed on CUDA,
        specdec.models.fused_projections), found again when any of those weights is replaced or moves; the fused-op
        forward multiplies so."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        parts = [m.weight for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)]
        parts += [m.bias for m in (attn.q_proj, attn.k_proj, attn.v_proj) if m.bias is not None]
        key = tuple((id(t), t.data_ptr()) for t in parts)
        found = self.__dict__.get("_projections")
        if found is None or found[0] != key:
            found = self.__dict__["_projections"] = key, LayerProjections.of(self.layers[0])
        return found[1]

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() ...: the products found over the old weights would keep their memory alive
        self.__dict__.pop("_projections", None)
        return super()._apply(fn, *args, **kwargs)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self._inv_freq(positions.device)  # [..., L, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        scale = self._frequencies[1]
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)  # [..., L, head_dim] each

    def rope_table(self, positions: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[2, positions, head_dim]: :meth:`rope` of positions 0 .. ``positions`` - 1 (cos, then sin), whose rows are
        the values :meth:`rope` gives those positions anywhere (it is element-wise): a CUDA graph gathers them."""
        return torch.stack(self.rope(torch.arange(positions, device=device), dtype))

    def forward(
        self,
        embeds: torch.Tensor,  # [B, L, H] target embeddings of the tokens t_{j+1}
        features: torch.Tensor,  # [B, L, H] target (or predicted) features f_j
        positions: torch.Tensor | None,  # [B, L] or [L] position ids (of t_{j+1}); None when ``rope`` is given
        # [B or 1, L, P + L] bool, True = may attend (P = past keys); or an additive bias in the layer's dtype
        # (0: may attend, -inf: may not), which CUDA's attention takes without converting it
        mask: torch.Tensor,
        past_k: torch.Tensor | None = None,  # [B, kv_heads, P, head_dim]
        past_v: torch.Tensor | None = None,
        # kernels.fused_ops (inference, Triton): each norm with its residual add, RoPE and SiLU-mul one launch, and the
        # QKV and gate/up products one each where the weights are packed (projections)
        fused=None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,  # this call's rope(positions), computed ahead
        # (keys, values [B, kv_heads or heads, S, head_dim], start) in place of past_k / past_v: the past is columns
        # [0, start), and this call's keys / values are written at start .. start + L - 1 (no copy of the past);
        # buffers of ``num_heads`` rows hold each key repeated for its query heads (no repeat per call)
        into: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predicted features [B, L, H] and this call's keys / values [B, kv_heads, L, head_dim] (EAGLE-3:
        ``features`` is the fused or fed-back hidden state and the prediction is the pre-norm output)."""
        if fused is not None and torch.is_grad_enabled():
            raise InputError("EagleModel.forward: the fused ops have no gradients; train without fused=")
        c = self.config
        B, L, _ = embeds.shape
        layer = self.layers[0]
        attn = layer.self_attn
        eps = c.rms_norm_eps
        if self.eagle3:
            hidden = _norm(features, layer.hidden_norm.weight, eps, fused)
            x = hidden if c.norm_before_residual else features  # the residual around attention
            a = torch.cat([_norm(embeds, layer.input_layernorm.weight, eps, fused), hidden], dim=-1)
        elif self.mtp:
            x = self.fc(torch.cat([_norm(embeds, self.enorm.weight, eps, fused),
                                   _norm(features, self.hnorm.weight, eps, fused)], dim=-1))
            a = _norm(x, layer.input_layernorm.weight, eps, fused)
        else:
            x = self.fc(torch.cat([embeds, features], dim=-1))
            a = _norm(x, layer.input_layernorm.weight, eps, fused) if c.norms else x
        cos, sin = rope if rope is not None else self.rope(positions, x.dtype)  # [B or 1 or none, L, head_dim]
        proj = self.projections() if fused is not None else None
        if fused is not None:  # rotated in place over [B * L, heads, head_dim] rows, before the heads move forward
            cos, sin = (t.expand(B, L, c.head_dim).reshape(B * L, 1, c.head_dim) for t in (cos, sin))
        if proj is not None and proj.qkv is not None:  # one product; q and k rotated in one launch
            width = c.num_heads + c.num_kv_heads  # the product's columns: q and k heads side by side, then v
            out = linear(a.reshape(B * L, -1), proj.qkv.weight, proj.qkv.bias)
            qk = fused.rope_(out[:, : width * c.head_dim].view(B * L, width, c.head_dim), cos, sin)
            q, k, v = qk[:, : c.num_heads], qk[:, c.num_heads :], out[:, width * c.head_dim :]
        else:
            q, k, v = attn.q_proj(a), attn.k_proj(a), attn.v_proj(a)
            if fused is not None:
                q = fused.rope_(q.view(B * L, c.num_heads, c.head_dim), cos, sin)
                k = fused.rope_(k.view(B * L, c.num_kv_heads, c.head_dim), cos, sin)
        q = q.reshape(B, L, c.num_heads, c.head_dim).transpose(1, 2)  # views: [B, heads, L, head_dim]
        k = k.reshape(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, L, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if fused is None:
            if cos.dim() == 2:
                cos, sin = cos[None], sin[None]
            cos, sin = cos[:, None], sin[:, None]  # [B or 1, 1, L, head_dim]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = c.num_heads // c.num_kv_heads
        if into is not None:
            buf_k, buf_v, start = into
            repeated = buf_k.shape[1] == c.num_heads and groups > 1
            for buf, new in ((buf_k, k), (buf_v, v)):
                if repeated:  # head h of the buffer is kv head h // groups, as repeat_interleave lays them out
                    buf[:, :, start : start + L].unflatten(1, (c.num_kv_heads, groups)).copy_(new[:, :, None].expand(
                        B, c.num_kv_heads, groups, L, c.head_dim))
                else:
                    buf[:, :, start : start + L] = new
            keys, values = buf_k[:, :, : start + L], buf_v[:, :, : start + L]
        else:
            keys = k if past_k is None else torch.cat([past_k, k], dim=2)
            values = v if past_v is None else torch.cat([past_v, v], dim=2)
            repeated = False
        if not repeated and groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
        o = attn.o_proj(o.transpose(1, 2).reshape(B, L, c.num_heads * c.head_dim))
        final_norm = self.norm is not None and not (self.eagle3 or self.mtp)  # EAGLE-1's output norm
        if fused is None:
            h = x + o
            h = h + layer.mlp(_rms_norm(h, layer.post_attention_layernorm.weight, eps))
            return (_rms_norm(h, self.norm.weight, eps) if final_norm else h), k, v
        # each residual add in its norm's launch, into the block's fresh output (x + o == o + x, bit for bit)
        H = c.hidden_size
        h, m = fused.add_rms_norm(o.view(B * L, H), x.reshape(B * L, H), layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        if proj.gate_up is not None:
            gate, up = linear(m, proj.gate_up.weight, proj.gate_up.bias).split(proj.gate_up.sizes, dim=-1)
        else:
            gate, up = mlp.gate_proj(m), mlp.up_proj(m)
        down = mlp.down_proj(fused.silu_mul(gate, up))
        if final_norm:
            return fused.add_rms_norm(down, h, self.norm.weight, eps)[1].view(B, L, H), k, v
        return down.add_(h).view(B, L, H), k, v

    def logits(self, features: torch.Tensor, target_lm_head: torch.Tensor, fused=None) -> torch.Tensor:
        """[.., H] predicted features -> [.., N] draft logits (N = the draft vocabulary, or the target's);
        ``fused`` as in :meth:`forward` (EAGLE-3's and MTP's output norm in one launch)."""
        if self.eagle3 or self.mtp:
            features = _norm(features, self.norm.weight, self.config.rms_norm_eps, fused)
        if self.lm_head is not None:
            return self.lm_head(features)
        flat = linear(features.reshape(-1, features.shape[-1]), target_lm_head)
        return flat.view(*features.shape[:-1], target_lm_head.shape[0])
