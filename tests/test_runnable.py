"""A transformers model passed in whose output specdec's own forward would not reproduce is refused in one line:
adapter layers injected into its projections, forward hooks, quantized layers, weights on the meta device or
offloaded. What changes nothing (gradient checkpointing, train mode, torch.compile) runs, token-identical to
transformers' greedy generate()."""
from __future__ import annotations

import pytest
import torch

import specdec
from specdec.models.llama import UnsupportedModelError
from specdec.testing import build_tiny_model

PROMPTS = [[1, 5, 9, 3], [7, 2]]


def transformers_greedy(model, n: int = 8) -> list[list[int]]:
    return [model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0].tolist() for p in PROMPTS]


def specdec_greedy(model, n: int = 8) -> list[list[int]]:
    return [list(specdec.generate(model, [p], max_new_tokens=n, eos_token_id=None)[0]) for p in PROMPTS]


class LoraLinear(torch.nn.Module):
    """What peft injects: the base layer's weight is still there (``.weight``), its output is not the base's."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, 2, bias=False)
        self.lora_B = torch.nn.Linear(2, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_B.weight)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def _lora(model):
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj)
    return "layers.1.self_attn.q_proj is a .*LoraLinear.*merge_and_unload"


def _hook(model):
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out * 2)  # a steering-style edit
    return "model.layers.0.mlp has a forward hook.*handle.remove"


def _forward(model):
    model.model.norm.forward = lambda x: x
    return "model.norm has its forward replaced"


def _quantized(model):
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    return "quantized models are not supported.*'bitsandbytes'"


@pytest.mark.parametrize("change", [_lora, _hook, _forward, _quantized], ids=lambda f: f.__name__.strip("_"))
def test_a_model_whose_output_specdec_would_not_reproduce_is_refused(change):
    """Each of these ran, and every token came from another model than the one passed (the runner reads the
    weights and leaves out what the modules add)."""
    model = build_tiny_model()
    loaded = specdec.load_model(model)  # changed after loading: a LoadedModel reused for the next call
    match = change(model)
    with pytest.raises(UnsupportedModelError, match=match) as err:
        specdec.generate(model, PROMPTS, max_new_tokens=2)
    assert "\n" not in str(err.value)
    with pytest.raises(UnsupportedModelError, match=match):
        specdec.generate(loaded, PROMPTS, max_new_tokens=2)


def _lm_head_bias(model, monkeypatch):
    model.lm_head.bias = torch.nn.Parameter(torch.randn(model.config.vocab_size))  # a logit bias
    return "lm_head is not a Linear without bias"


def _activation_identity(model, monkeypatch):
    model.model.layers[1].mlp.act_fn = torch.nn.Identity()  # a plain module, allowed elsewhere
    return r"model.layers.1.mlp.act_fn is not a SiLU \(found Identity\)"


def _norm_identity(model, monkeypatch):
    model.model.layers[0].input_layernorm = torch.nn.Identity()  # was an AttributeError traceback
    return "model.layers.0.input_layernorm is not the family's RMSNorm"


def _not_causal(model, monkeypatch):
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    return r"model.layers.0.self_attn is not causal .*is_causal=False"


def _embedding_max_norm(model, monkeypatch):
    model.model.embed_tokens.max_norm = 0.2  # transformers' lookup renormalises the rows it reads
    return "model.embed_tokens is not an nn.Embedding without max_norm"


def _longrope_rotary_module(model, monkeypatch):
    """A rotary module of another RoPE built in, the config left as it was."""
    import copy

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = copy.deepcopy(model.config)
    half = config.hidden_size // config.num_attention_heads // 2
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
                              "long_factor": [2.0] * half, "original_max_position_embeddings": 64}
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    return "RoPE type 'longrope' is not supported"


def _global_hook(model, monkeypatch):
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    _UNDO.append(handle.remove)
    return "a global forward hook is registered"


def _attention_function(model, monkeypatch):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def scaled(module, query, key, value, attention_mask, **kwargs):  # a user's attention: another softmax scale
        return sdpa_attention_forward(module, query * 4, key, value, attention_mask, **kwargs)

    AttentionInterface.register("scaled_for_test", scaled)
    _UNDO.append(lambda: AttentionInterface._global_mapping.pop("scaled_for_test", None))
    model.set_attn_implementation("scaled_for_test")
    return "attention implementation 'scaled_for_test' is not one of transformers' own"


def _patched_class(model, monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: x)
    return r"modeling_llama.LlamaMLP.forward was replaced \(by tests.test_runnable"


def _patched_helper(model, monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", lambda q, k, cos, sin, **kw: (q, k))  # NoPE
    return "modeling_llama.apply_rotary_pos_emb was replaced"


_UNDO: list = []


@pytest.mark.parametrize("change", [_lm_head_bias, _activation_identity, _norm_identity, _not_causal,
                                    _embedding_max_norm, _longrope_rotary_module, _global_hook, _attention_function,
                                    _patched_class, _patched_helper], ids=lambda f: f.__name__.strip("_"))
def test_what_the_runner_takes_as_given_is_checked(change, monkeypatch):
    """Each ran without a refusal (most with other tokens than transformers' from the first one): a plain module
    in a role of another kind, an LM head bias, a global hook, a user's attention function, transformers' family
    code patched, a rotary module of a RoPE that changes with the length."""
    model = build_tiny_model()
    loaded = specdec.load_model(model)
    try:
        match = change(model, monkeypatch)
        with pytest.raises(UnsupportedModelError, match=match) as err:
            specdec.generate(model, PROMPTS, max_new_tokens=2)
        assert "\n" not in str(err.value)
        with pytest.raises(UnsupportedModelError, match=match):
            specdec.generate(loaded, PROMPTS, max_new_tokens=2)
    finally:
        while _UNDO:
            _UNDO.pop()()


def test_a_q_norm_llama_never_calls_is_not_applied():
    """The runner applied any attention's ``q_norm`` / ``k_norm`` it found; transformers' Llama never calls them."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = build_tiny_model()
    expected = transformers_greedy(model)
    for layer in model.model.layers:
        layer.self_attn.q_norm = LlamaRMSNorm(model.config.head_dim)
        layer.self_attn.k_norm = LlamaRMSNorm(model.config.head_dim)
        torch.nn.init.normal_(layer.self_attn.q_norm.weight)
    assert transformers_greedy(model) == expected
    assert specdec_greedy(model) == expected


def test_a_loaded_model_reads_norm_epsilon_and_rope_scaling_edited_since():
    """A LoadedModel's runner kept the final norm's epsilon and the rotary attention_scaling it was built with."""
    model = build_tiny_model()
    loaded = specdec.load_model(model)
    specdec.generate(loaded, PROMPTS, max_new_tokens=2)
    model.model.rotary_emb.attention_scaling = 3.0
    expected = transformers_greedy(model)
    assert [list(s) for s in specdec.generate(loaded, PROMPTS, max_new_tokens=8, eos_token_id=None)] == expected
    model.model.norm.variance_epsilon = 10.0  # greedy tokens may stay, their probabilities do not
    out = specdec.generate(loaded, [PROMPTS[0]], max_new_tokens=3, eos_token_id=None, return_dict=True,
                           output_logprobs=True)
    seq, n = torch.tensor([list(out.sequences[0])]), len(PROMPTS[0])
    with torch.no_grad():
        want = torch.log_softmax(model(seq[:, :-1]).logits[0, n - 1:].float(), -1).gather(1, seq[0, n:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs[0]), want, rtol=1e-4, atol=1e-4)


def test_weights_in_two_dtypes_or_dynamically_quantized_are_one_line():
    """A float32 model with a bfloat16 embedding (transformers runs it) failed in index_copy_; torch's dynamic
    quantization failed in the runner ("'function' object has no attribute 'shape'") before the module check."""
    model = build_tiny_model()
    model.model.embed_tokens.to(torch.bfloat16)
    with pytest.raises(UnsupportedModelError, match=r"weights are in 2 dtypes \(bfloat16, float32\)"):
        specdec.generate(model, PROMPTS, max_new_tokens=2)
    quantized = torch.ao.quantization.quantize_dynamic(build_tiny_model(), {torch.nn.Linear})
    with pytest.raises(UnsupportedModelError, match=r"is a torch\.ao\.nn\.quantized\.dynamic"):
        specdec.generate(quantized, PROMPTS, max_new_tokens=2)


def test_weights_not_there_are_one_line_not_a_tensor_error():
    """A model built on the meta device, or with layers offloaded by accelerate (their weights on meta, moved in
    by hooks at forward time), failed deep in the forward: "Tensor.item() cannot be called on meta tensors"."""
    from accelerate import cpu_offload

    with torch.device("meta"):
        empty = build_tiny_model()
    offloaded = build_tiny_model()
    cpu_offload(offloaded, execution_device=torch.device("cpu"))
    # load_model(empty) first: its runner's staleness check compared meta tensors (NotImplementedError, aten::equal)
    for model in (empty, offloaded, specdec.load_model(empty)):
        with pytest.raises(UnsupportedModelError, match="weights are not loaded.*meta device.*no offloading"):
            specdec.generate(model, PROMPTS, max_new_tokens=2)


def test_what_changes_no_output_runs_and_matches_transformers():
    """Gradient checkpointing (transformers' input-grad hook) and train mode with dropout: the model's own greedy
    tokens."""
    model = build_tiny_model(attention_dropout=0.5)
    expected = transformers_greedy(model)
    # transformers 5.25 renamed it (the old name warns it goes in v6); older releases have only the old one
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()
    assert specdec_greedy(model) == expected
    # a training loop's rollouts: the model stays in train mode (generate() switched it to eval, which also turns
    # gradient checkpointing off), and specdec's own transformers forwards run it in eval mode for their call only
    assert model.training and all(m.training for m in model.modules())
    from specdec.eval.end_to_end import sequence_logprobs

    model.eval()
    reference = sequence_logprobs(model, [1, 2, 3], [(4, 5)])
    model.train()
    assert sequence_logprobs(model, [1, 2, 3], [(4, 5)]) == reference and model.training


class Doubled(torch.nn.Module):
    def forward(self, weight):
        return weight * 2


def _subclassed(forward_changed: bool):
    """The tiny model as an instance of a user's subclass (transformers imported here, not at collection: a test
    module that imports it first would import triton before test_cuda_graphs sets TRITON_INTERPRET)."""
    from transformers import LlamaForCausalLM

    class WithHelper(LlamaForCausalLM):
        """Only adds a method: it computes what LlamaForCausalLM computes."""

        def num_weights(self) -> int:
            return sum(p.numel() for p in self.parameters())

    class ScaledLogits(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = build_tiny_model()
    mine = (ScaledLogits if forward_changed else WithHelper)(model.config).eval()
    mine.load_state_dict(model.state_dict())
    mine.generation_config = model.generation_config
    return mine


def test_a_subclass_that_only_adds_a_method_runs_as_its_base():
    """It was refused as "not transformers' own code of the Llama family"."""
    model = _subclassed(forward_changed=False)
    assert specdec_greedy(model) == transformers_greedy(model)


def test_a_forward_compiled_in_place_runs_as_the_forward_it_compiles():
    """``model.forward = torch.compile(model.forward)``, transformers' recipe for static caches, was refused as
    "forward replaced"."""
    model = build_tiny_model()
    expected = transformers_greedy(model)
    model.forward = torch.compile(model.forward)  # compiled lazily: never run here
    model.model.layers[0].mlp.forward = torch.compile(model.model.layers[0].mlp.forward)
    assert specdec_greedy(model) == expected


def test_a_subclass_a_compiled_function_or_a_parametrization_that_changes_the_forward_is_refused():
    with pytest.raises(UnsupportedModelError, match="the model is a .*ScaledLogits, not transformers' own code"):
        specdec.generate(_subclassed(forward_changed=True), PROMPTS, max_new_tokens=2)
    model = build_tiny_model()
    model.model.norm.forward = torch.compile(lambda x: x)
    with pytest.raises(UnsupportedModelError, match="model.norm has its forward replaced"):
        specdec.generate(model, PROMPTS, max_new_tokens=2)
    model = build_tiny_model()  # a parametrized weight: its class gains a weight property, computed at each read
    torch.nn.utils.parametrize.register_parametrization(model.model.layers[0].mlp.up_proj, "weight", Doubled())
    with pytest.raises(UnsupportedModelError, match="layers.0.mlp.up_proj is a .*ParametrizedLinear"):
        specdec.generate(model, PROMPTS, max_new_tokens=2)


def test_a_model_once_asked_for_its_hidden_states_runs():
    """transformers 5 records ``output_hidden_states`` / ``output_attentions`` with forward hooks that the first such
    call leaves on the layers for good (no handle to remove them): the model was refused as "has a forward hook"
    ever after, and so was EAGLE-3 training's evaluation, whose target features ask for hidden states."""
    model = build_tiny_model(attn_implementation="eager")
    expected = transformers_greedy(model)
    model(torch.tensor([PROMPTS[0]]), output_hidden_states=True, output_attentions=True)
    if not any(m._forward_hooks for m in model.modules()):
        pytest.skip("this transformers records hidden states without hooks")
    assert specdec_greedy(model) == expected


def write_tiny_gguf(path, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    ffn: int = 128) -> None:
    """A float32 Llama .gguf file of random weights (the gguf package writes it in milliseconds)."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    rng = np.random.default_rng(0)
    kv = kv_heads * hidden // heads
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,), "output": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm": (hidden,), f"blk.{i}.attn_q": (hidden, hidden),
                       f"blk.{i}.attn_k": (kv, hidden), f"blk.{i}.attn_v": (kv, hidden),
                       f"blk.{i}.attn_output": (hidden, hidden), f"blk.{i}.ffn_norm": (hidden,),
                       f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden),
                       f"blk.{i}.ffn_down": (hidden, ffn)})
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (rng.standard_normal(shape) * 0.5 + (len(shape) == 1)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_transformers_dequantized_at_load_runs(tmp_path):
    """``from_pretrained(dir, gguf_file=...)`` dequantizes into plain float layers but marks the config with
    ``quantization_config`` (quant_method gguf): it was refused as a quantized model, though specdec runs its own
    .gguf files through that very load."""
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(tmp_path / "tiny.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert getattr(model.config, "quantization_config", None) is not None  # what was refused
    assert specdec_greedy(model) == transformers_greedy(model)


def test_a_compiled_model_runs_as_the_model_it_compiles():
    """torch.compile(model) was refused as "got OptimizedModule"; specdec runs its own forward on the same weights."""
    model = build_tiny_model()
    assert specdec_greedy(torch.compile(model)) == specdec_greedy(model)  # compiled lazily: never run here


def test_a_peft_style_wrapper_is_told_to_merge():
    class PeftLike(torch.nn.Module):
        def __init__(self, model) -> None:
            super().__init__()
            self.base_model = model

        def get_base_model(self):
            return self.base_model

    with pytest.raises(TypeError, match="got PeftLike.*merge_and_unload"):
        specdec.generate(PeftLike(build_tiny_model()), PROMPTS, max_new_tokens=2)
    # prompt tuning (peft's is_prompt_learning configs): no merge removes virtual tokens, which that advice missed
    prompt_tuned = PeftLike(build_tiny_model())
    prompt_tuned.active_peft_config = type("PromptTuningConfig", (), {"is_prompt_learning": True})()
    with pytest.raises(TypeError, match="prompt-learning model: its virtual tokens .* pass the base model") as info:
        specdec.generate(prompt_tuned, PROMPTS, max_new_tokens=2)
    assert "merge_and_unload" not in str(info.value)
