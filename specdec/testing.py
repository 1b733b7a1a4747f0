"""Test utilities: tiny random-initialised Llama-family models built from a config.

Used by specdec's own tests and handy for drafter authors:
``build_tiny_model("qwen3-qknorm", vocab_size=8)`` gives a 2-layer model in milliseconds.
"""
from __future__ import annotations

import torch

TINY_VARIANTS = {
    # name: (config class name, extra config kwargs)
    "llama-gqa-tied": ("LlamaConfig", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "llama-mqa-bias": ("LlamaConfig", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True)),
    "llama3-rope": (
        "LlamaConfig",
        dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=64)),
    ),
    "llama-linear-rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=2.0))),
    "llama-yarn-rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                               original_max_position_embeddings=128))),
    "qwen2-bias": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3-qknorm": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=None)),
}


def build_tiny_model(variant: str = "llama-gqa-tied", vocab_size: int = 96, seed: int = 0, **overrides):
    import transformers

    cls_name, extra = TINY_VARIANTS[variant]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=0, eos_token_id=None, pad_token_id=0, rms_norm_eps=1e-6,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model_cls = {"LlamaConfig": transformers.LlamaForCausalLM, "Qwen2Config": transformers.Qwen2ForCausalLM,
                 "Qwen3Config": transformers.Qwen3ForCausalLM, "MistralConfig": transformers.MistralForCausalLM}[cls_name]
    model = model_cls(config).eval()
    with torch.no_grad():  # random init is near-uniform; sharpen it so greedy has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
