"""Whether specdec's own forward computes what a loaded transformers model computes; a one-line refusal if not.

The runner (:mod:`specdec.models.llama`) reads the model's weights and runs its own Llama-family forward: it never
calls a module's ``forward``. So whatever changes a module's output besides its weights would be silently left out:

* a module that is not transformers' own code of a supported family, ``nn.Linear``, ``nn.Embedding`` or a SiLU
  (LoRA / adapter layers injected into the projections, remote code), or a subclass of one that redefines
  ``forward`` (a subclass adding only helper methods computes what its base does and runs);
* a forward hook or pre-hook (steering vectors, activation patching); transformers' own hooks that change no
  value (gradient checkpointing's input-grad hook, the recorders ``output_hidden_states=True`` leaves) are allowed;
* a ``forward`` replaced on the instance, unless by accelerate's device hook or by ``torch.compile`` of the
  module's own forward;
* quantized layers (``config.quantization_config``): the runner would multiply by the packed weights. A ``.gguf``
  file transformers dequantized at load (``gguf_file=``) holds plain layers and runs;
* what the runner's forward takes as given: each module of a role of the kind it computes (RMSNorms, a SiLU, causal
  attention, a plain embedding, an LM head without bias), transformers' own attention functions, no global hook,
  and the family's code as transformers wrote it (no ``forward`` or helper patched over on the class or module).

:func:`check_modules` refuses these when a model is loaded; :func:`check_weights_present` refuses weights that are
not there to read (the meta device, layers offloaded by accelerate's ``device_map`` / ``cpu_offload``) or that lie
on several devices, before the first forward.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from specdec.models.llama import SUPPORTED_MODEL_TYPES, UnsupportedModelError

_FAMILY_MODULES = tuple(f"transformers.models.{t}.modeling_{t}" for t in SUPPORTED_MODEL_TYPES)
_PLAIN = (nn.Linear, nn.Embedding, nn.ModuleList, nn.SiLU, nn.Dropout, nn.Identity)
# transformers' own hooks that change no value: gradient checkpointing's input-grad hook, and the recorders of
# output_hidden_states / output_attentions, which its first such call leaves on the layers for good (transformers 5)
_NEUTRAL_HOOKS = ("make_inputs_require_grads", "output_capturing_hook")
# what a subclass of a known class must leave to it (besides properties: a parametrized weight is one)
_CALLS = ("forward", "__call__", "_call_impl", "__getattr__", "__getattribute__")


def _is_own(cls: type) -> bool:
    if cls in _PLAIN:
        return True
    if cls.__module__ == "transformers.activations":
        return "SiLU" in cls.__name__  # hidden_act is checked to be silu; a swapped-in other activation is not
    return cls.__module__ in _FAMILY_MODULES


def _is_known(module: nn.Module) -> bool:
    """A class of transformers' own family code (or a plain torch module), or a subclass of one that adds only
    methods (a helper computes nothing in the forward): no forward, attribute lookup or property of its own."""
    for cls in type(module).__mro__:
        if _is_own(cls):
            return True
        if any(name in _CALLS or isinstance(value, property) for name, value in vars(cls).items()):
            return False
    return False


def _changing_hooks(module: nn.Module) -> list:
    hooks = [*module._forward_hooks.values(), *module._forward_pre_hooks.values()]
    return [h for h in hooks if not (str(getattr(h, "__module__", "")).startswith("transformers.")
                                     and getattr(h, "__name__", None) in _NEUTRAL_HOOKS)]


def quant_method(quantization: Any) -> Any:
    """The ``quant_method`` of a quantization config: a dict's (config.json) or a config object's, an enum's value."""
    method = quantization.get("quant_method") if isinstance(quantization, dict) else \
        getattr(quantization, "quant_method", None)
    return getattr(method, "value", method)  # transformers' QuantizationMethod enum


def quantized_refusal(method: Any, source: str) -> UnsupportedModelError:
    """The one-line refusal of a quantized model, its ``quant_method`` read from ``source`` (a checkpoint's
    config.json before loading, a loaded model's config)."""
    return UnsupportedModelError(f"quantized models are not supported ({source}, quant_method {str(method)!r}): "
                                 "specdec multiplies by the layers' plain weights; use an unquantized (float32 / "
                                 "bfloat16 / float16) copy")


def check_modules(hf_model) -> None:
    """An UnsupportedModelError naming the first module whose output specdec's forward would not reproduce. One pass
    over the modules (~0.2 ms for an 8B model's 423): it runs at every load_model(), as a module may be replaced or
    hooked between two calls."""
    quantization = getattr(hf_model.config, "quantization_config", None)
    quantizer = getattr(hf_model, "hf_quantizer", None)
    if quantization is None and quantizer is not None:
        quantization = getattr(quantizer, "quantization_config", None)
    method = quant_method(quantization)
    # a .gguf file loaded by transformers (gguf_file=...): dequantized into plain float layers at load, or kept in
    # GGUF blocks by modules of transformers' GGUF integration, which the walk below refuses
    if (quantization is not None or quantizer is not None) and method != "gguf":
        raise quantized_refusal(method, "config.quantization_config")
    _check_global_hooks()
    _check_attention_function(hf_model.config)
    types = set()
    for module, state in _walk(hf_model):
        types.add(type(module))
        if type(module) not in _KNOWN or state["_forward_hooks"] or state["_forward_pre_hooks"] or "forward" in state:
            _check_module(hf_model, module)
    _check_family_code(types)
    _check_roles(hf_model)


def _check_global_hooks() -> None:
    """torch's global forward hooks run in every module's forward, transformers' included, never in the runner's."""
    from torch.nn.modules import module as torch_module

    hooks = [*torch_module._global_forward_hooks.values(), *torch_module._global_forward_pre_hooks.values()]
    if hooks:
        raise UnsupportedModelError("a global forward hook is registered (torch.nn.modules.module.register_module_"
                                    "forward_hook / _pre_hook): it changes what every module computes in "
                                    "transformers' forward, and specdec runs its own; remove it (handle.remove()) "
                                    "first")


# transformers' exact attention functions (a hub flash kernel runs inside its flash wrapper); not its block-sparse
# msa_attention, which computes another attention
_EXACT_ATTENTION = tuple(f"transformers.integrations.{m}" for m in (
    "sdpa_attention", "flash_attention", "flex_attention", "npu_flash_attention", "eager_paged", "sdpa_paged",
    "flash_paged"))


def _check_attention_function(config) -> None:
    """``config._attn_implementation``: eager, or one of transformers' exact attention functions (SDPA, flash,
    flex, paged). A function registered by the user (``AttentionInterface.register``) may compute anything."""
    impl = getattr(config, "_attn_implementation", None)
    if impl in (None, "eager"):
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    try:
        fn = ALL_ATTENTION_FUNCTIONS[impl]
    except (KeyError, ValueError):
        fn = None
    fn = getattr(fn, "func", fn)  # a functools.partial (hub kernels in transformers' wrapper)
    if getattr(fn, "__module__", None) not in _EXACT_ATTENTION:
        raise UnsupportedModelError(f"the model's attention implementation {impl!r} is not one of transformers' own "
                                    "(config._attn_implementation): specdec computes standard causal attention, "
                                    "which it may not be; set the model's back, e.g. "
                                    "model.set_attn_implementation('sdpa')")


_HELPERS = ("apply_rotary_pos_emb", "rotate_half", "repeat_kv", "eager_attention_forward")  # what the forwards call


def _check_family_code(types: set[type]) -> None:
    """The family modules' ``forward`` methods and helpers are transformers' own: a patch over them (``LlamaMLP.forward
    = ...``, ``modeling_llama.apply_rotary_pos_emb = ...``) changes what transformers computes, not the runner."""
    import sys

    family = {cls for cls in types if cls.__module__ in _FAMILY_MODULES}
    for cls in family:
        forward = vars(cls).get("forward")
        if forward is not None and getattr(forward, "__module__", cls.__module__) != cls.__module__:
            raise UnsupportedModelError(f"{cls.__module__}.{cls.__qualname__}.forward was replaced (by "
                                        f"{getattr(forward, '__module__', '?')}.{getattr(forward, '__qualname__', '?')}"
                                        "): specdec runs its own forward on the weights and would leave out what the "
                                        "patch changes; run without it")
    for name in {cls.__module__ for cls in family}:
        code = sys.modules[name]
        for helper in _HELPERS:
            fn = getattr(code, helper, None)
            if fn is not None and getattr(fn, "__module__", name) != name:
                raise UnsupportedModelError(f"{name}.{helper} was replaced (by {getattr(fn, '__module__', '?')}."
                                            f"{getattr(fn, '__qualname__', '?')}): specdec runs its own forward on "
                                            "the weights and would leave out what the patch changes; run without it")


_RMS_NORMS: set[type] = set()  # classes _is_rms_norm / _is_silu accepted
_SILUS: set[type] = set()


def _is_rms_norm(module: Any) -> bool:
    cls = type(module)
    if cls not in _RMS_NORMS and any(c.__module__ in _FAMILY_MODULES and c.__name__.endswith("RMSNorm")
                                     for c in cls.__mro__):
        _RMS_NORMS.add(cls)
    return cls in _RMS_NORMS


def _is_silu(module: Any) -> bool:
    cls = type(module)
    if cls not in _SILUS and any(c is nn.SiLU or (c.__module__ == "transformers.activations" and "SiLU" in c.__name__)
                                 for c in cls.__mro__):
        _SILUS.add(cls)
    return cls in _SILUS


def _check_roles(hf_model) -> None:
    """Each module the runner reads by its role is of the kind the runner computes: a plain module allowed in one
    role (nn.Identity, nn.Dropout, nn.Linear) put in another would be computed as that role's kind."""
    wrong = _wrong_role(hf_model)
    if wrong is not None:
        where, kind, found = wrong
        raise UnsupportedModelError(f"{where} is not {kind} (found {found}): specdec's forward computes that role so, "
                                    "and transformers' forward would compute something else")


_RMS_NORM = "the family's RMSNorm"


def _wrong_role(hf_model) -> tuple[str, str, str] | None:
    """The first module of a role whose kind the runner does not compute: (where, the kind it computes, what the
    model has there); None when every one fits. Once per call: a few cached type lookups a layer."""
    def name(module: Any) -> str:
        return type(module).__qualname__

    base = hf_model.model
    embed = base.embed_tokens
    if not isinstance(embed, nn.Embedding) or embed.max_norm is not None:
        found = f"max_norm={embed.max_norm}" if isinstance(embed, nn.Embedding) else name(embed)
        return "model.embed_tokens", "an nn.Embedding without max_norm", found
    if not _is_rms_norm(base.norm):
        return "model.norm", _RMS_NORM, name(base.norm)
    if getattr(hf_model.lm_head, "bias", None) is not None:
        return "lm_head", "a Linear without bias", "a bias"
    qk_norms = getattr(hf_model.config, "model_type", None) == "qwen3"  # the runner applies them for Qwen3 only
    for i, layer in enumerate(base.layers):
        modules = layer._modules
        attn = modules["self_attn"]
        for role in ("input_layernorm", "post_attention_layernorm"):
            if not _is_rms_norm(modules.get(role)):
                return f"model.layers.{i}.{role}", _RMS_NORM, name(modules.get(role))
        act = modules["mlp"]._modules.get("act_fn")
        if not _is_silu(act):
            return f"model.layers.{i}.mlp.act_fn", "a SiLU", name(act)
        causal = getattr(attn, "is_causal", True)
        if causal is not True:
            return f"model.layers.{i}.self_attn", "causal (is_causal=True)", f"is_causal={causal!r}"
        for role in ("q_norm", "k_norm") if qk_norms else ():
            if not _is_rms_norm(attn._modules.get(role)):
                return f"model.layers.{i}.self_attn.{role}", _RMS_NORM, name(attn._modules.get(role))
    return None


def _walk(hf_model) -> Iterator[tuple[nn.Module, dict]]:
    """Every module of ``hf_model`` with its ``__dict__``, read from the modules' own dicts: not
    ``hf_model.modules()``, whose names cost 0.8 ms for an 8B model, 5x this walk (both checks run at every call)."""
    todo = [hf_model]
    while todo:
        module = todo.pop()
        if module is None:  # a child registered as None
            continue
        state = module.__dict__
        todo.extend(state["_modules"].values())
        yield module, state


_KNOWN: set[type] = set()  # module classes _is_known accepted


def _check_module(hf_model, module: nn.Module) -> None:
    """Refuse ``module`` in one line, unless it is acceptable after all (a known class, an allowed hook)."""
    if _is_known(module) and not _changing_hooks(module) and ("forward" not in vars(module) or
                                                             _is_device_hook(module) or _is_compiled(module)):
        _KNOWN.add(type(module))
        return
    where = next(name for name, m in hf_model.named_modules() if m is module) or "the model"
    if not _is_known(module):
        cls = type(module)
        hint = " (merge an adapter into the weights first, e.g. peft's merge_and_unload())" \
            if hasattr(module, "base_layer") else ""
        if cls.__module__.startswith("transformers.integrations."):
            hint = " (weights kept quantized: specdec multiplies by plain float32 / bfloat16 / float16 weights)"
        raise UnsupportedModelError(
            f"{where} is a {cls.__module__}.{cls.__qualname__}, not transformers' own code of the Llama family "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}) or a subclass of it that keeps its forward: specdec runs its own "
            f"forward on the weights and would leave out what this module computes{hint}")
    if _changing_hooks(module):
        raise UnsupportedModelError(f"{where} has a forward hook: specdec runs its own forward on the weights and "
                                    "would leave out what the hook changes; remove it (handle.remove()) first")
    raise UnsupportedModelError(f"{where} has its forward replaced: specdec runs its own forward on the weights and "
                                "would leave out what the replacement computes; pass the model without it")


def _is_compiled(module: nn.Module) -> bool:
    """``module.forward = torch.compile(module.forward)`` (transformers' recipe for static caches): its own forward,
    compiled, which computes what the class's forward computes (as a ``torch.compile(model)`` does)."""
    own = getattr(vars(module)["forward"], "_torchdynamo_orig_callable", None)
    return getattr(own, "__self__", None) is module and getattr(own, "__func__", None) is type(module).forward


def _is_device_hook(module: nn.Module) -> bool:
    """accelerate's AlignDevicesHook (device_map dispatch): it only moves tensors; offloaded weights are refused by
    check_weights_present."""
    hook = getattr(module, "_hf_hook", None)
    return type(hook).__name__ == "AlignDevicesHook" and type(hook).__module__.startswith("accelerate.")


def check_weights_present(hf_model) -> None:
    """An UnsupportedModelError unless every parameter holds real data, in one dtype, on one device. Once per
    generate() call, over :func:`_walk` (named_parameters() cost 0.6 ms for 32 layers)."""
    devices: set[torch.device] = set()
    dtypes: set[torch.dtype] = set()
    for _, state in _walk(hf_model):
        for param in state["_parameters"].values():
            if param is None:
                continue
            dtypes.add(param.dtype)
            if param.is_meta:
                name = next(n for n, p in hf_model.named_parameters() if p is param)
                raise UnsupportedModelError(
                    f"the model's weights are not loaded ({name} is on the meta device: built empty, or offloaded "
                    "by accelerate's device_map / cpu_offload); load it with every weight on one device (no "
                    "offloading)")
            devices.add(param.device)
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        raise UnsupportedModelError(f"the model's weights are in {len(dtypes)} dtypes ({names}): specdec runs a model "
                                    "in one dtype; convert it first, e.g. model.to(torch.bfloat16)")
    if len(devices) > 1:
        raise UnsupportedModelError(f"the model's weights lie on {len(devices)} devices "
                                    f"({', '.join(sorted(map(str, devices)))}): specdec runs a model on one device; "
                                    "load it with device_map on a single device, or move it with model.to(device)")
