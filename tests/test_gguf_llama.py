"""A llama GGUF read directly (specdec.models.gguf_llama) gives what transformers' GGUF loading gives: the same config
and the same float32 weights, q / k rows in Hugging Face's order; a file it does not handle exactly goes through
transformers."""
from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # noqa: E402

import specdec  # noqa: E402
from specdec.models import embedded, gguf_llama  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2, 64, 128, 4, 2, 48
TYPES = {"token_embd": Q.Q4_1, "output": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.F16,
         "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.Q8_0}  # norms: F32


def write_llama_gguf(path, tied: bool = False, name: str = "tiny llama", extra: str | None = None, seed: int = 0,
                     arch: str = "llama", meta: dict | None = None, skip: tuple[str, ...] = (),
                     extra_tensors: dict[str, tuple[int, ...]] | None = None, tokens: bool = True,
                     kv_heads: int | list[int] | None = KV_HEADS, rope_dims: int = HIDDEN // HEADS,
                     tokenizer: str | None = "gpt2", scores: bool = True):
    """A small llama-architecture GGUF of random weights, quantized as llama.cpp writes them (the rows of a
    [out, in] matrix, ``in`` the fastest); ``arch`` names its architecture, ``meta`` adds metadata (a string, a
    float, an int as uint32, a list as an array), ``skip`` leaves tensors out, ``extra_tensors`` adds F32 ones, no
    ``tokens`` writes no vocabulary (``vocab_size`` instead), ``tokenizer`` is tokenizer.ggml.model (None: none), no
    ``scores`` writes no token scores (from which transformers derives the merges the file lacks), and
    ``kv_heads`` None writes no KV head count (llama.cpp's default: as many as query heads), a list writes an array
    (the tensors shaped by its first count), ``rope_dims`` the rotary dimensions (llama.rope.dimension_count, which
    transformers takes for the head size; the tensors are shaped by HIDDEN // HEADS)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(50000.0)
    w.add_head_count(HEADS)
    if kv_heads is not None:
        w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    if tokenizer is not None:
        w.add_tokenizer_model(tokenizer)
    if tokens:
        w.add_token_list([f"t{i}" for i in range(VOCAB)])
        if scores:
            w.add_token_scores([float(-i) for i in range(VOCAB)])
    else:
        w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (meta or {}).items():
        adder = {str: w.add_string, int: w.add_uint32, list: w.add_array}.get(type(value), w.add_float32)
        adder(key, value)

    def add(tensor_name: str, shape: tuple[int, ...], kind: str | None) -> None:
        data = rng.standard_normal(shape).astype(np.float32)
        if tensor_name in skip:
            return
        qtype = TYPES.get(kind, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(tensor_name, data)
        elif qtype == Q.F16:
            w.add_tensor(tensor_name, data.astype(np.float16))
        else:
            w.add_tensor(tensor_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    head_dim = HIDDEN // HEADS
    kv_heads = kv_heads[0] if isinstance(kv_heads, list) else kv_heads
    add("token_embd.weight", (VOCAB, HIDDEN), "token_embd")
    add("output_norm.weight", (HIDDEN,), None)
    if not tied:
        add("output.weight", (VOCAB, HIDDEN), "output")
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), None)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), None)
        add(f"blk.{i}.attn_q.weight", (HEADS * head_dim, HIDDEN), "attn_q")
        add(f"blk.{i}.attn_k.weight", ((kv_heads or HEADS) * head_dim, HIDDEN), "attn_k")
        add(f"blk.{i}.attn_v.weight", ((kv_heads or HEADS) * head_dim, HIDDEN), "attn_v")
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * head_dim), "attn_output")
        add(f"blk.{i}.ffn_gate.weight", (FFN, HIDDEN), "ffn_gate")
        add(f"blk.{i}.ffn_up.weight", (FFN, HIDDEN), "ffn_up")
        add(f"blk.{i}.ffn_down.weight", (HIDDEN, FFN), "ffn_down")
    if extra:
        add(extra, (head_dim // 2,), None)
    for tensor_name, shape in (extra_tensors or {}).items():
        add(tensor_name, shape, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def transformers_read(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    tied = model.config.tie_word_embeddings
    return model.config, {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}


@pytest.mark.parametrize("tied", [False, True])
def test_a_llama_file_reads_as_transformers_reads_it(tmp_path, tied):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tied=tied)
    embedded.check_gguf(path)
    config, state = gguf_llama.read_llama(path)
    ref_config, ref_state = transformers_read(path)
    assert state.keys() == ref_state.keys()
    for key, ref in ref_state.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], ref), key
    ours, theirs = config.to_dict(), ref_config.to_dict()
    for key in ("_name_or_path", "dtype", "torch_dtype", "quantization_config"):  # loading's (the conversion's own)
        ours.pop(key, None)
        theirs.pop(key, None)
    assert json.loads(json.dumps(ours)) == json.loads(json.dumps(theirs))
    assert config.tie_word_embeddings is tied and config.num_key_value_heads == KV_HEADS


def test_the_conversion_writes_a_checkpoint_transformers_loads_alike(tmp_path, monkeypatch):
    """The converted copy (read directly, the tokenizer through transformers) gives transformers' logits. Its
    weights are readable as the umask allows, as its other files (safetensors wrote them 0600: a cache shared
    between users, SPECDEC_CACHE_DIR, kept the others out)."""
    from transformers import AutoModelForCausalLM

    path = write_llama_gguf(tmp_path / "tiny.gguf", seed=1)
    called = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: called.append(a) or 1 / 0)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: _NoTokenizer())
    out = tmp_path / "out"
    out.mkdir()
    mask = os.umask(0o022)
    try:
        embedded._convert_into(path, out)
    finally:
        os.umask(mask)
    assert not called  # not through transformers' GGUF loading
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}["model.safetensors"] == 0o644
    monkeypatch.undo()
    _same_logits_as_transformers(out, path)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def _same_logits_as_transformers(out, path) -> None:
    """The conversion at ``out`` computes what transformers' own GGUF loading of ``path`` computes."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 30, 2]])
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()(ids).logits
    assert torch.equal(got, ref)


class _NoTokenizer:
    def save_pretrained(self, out):
        (out / "tokenizer.json").write_text("{}")


@pytest.mark.parametrize("case", ["extra tensor", "mistral name", "missing layer tensor", "type not dequantized"])
def test_a_file_it_does_not_handle_exactly_is_left_to_transformers(tmp_path, monkeypatch, case):
    if case == "type not dequantized":  # met mid-file (ffn_down): no view of the file is left open on the way out
        path = write_llama_gguf(tmp_path / "m.gguf")
        dequantize = gguf.quants.dequantize

        def some_not(data, qtype):
            if qtype == Q.Q8_0 and data.shape[0] == HIDDEN:
                raise NotImplementedError(qtype.name)
            return dequantize(data, qtype)

        monkeypatch.setattr(gguf.quants, "dequantize", some_not)
    elif case == "extra tensor":
        path = write_llama_gguf(tmp_path / "m.gguf", extra="rope_freqs.weight")
    elif case == "mistral name":
        path = write_llama_gguf(tmp_path / "m.gguf", name="mistral 7b")
    else:
        path = write_llama_gguf(tmp_path / "m.gguf", tied=True)
        data = path.read_bytes()
        path.write_bytes(data.replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_xx.weight"))
    assert gguf_llama.read_llama(path) is None


def _converting_fails(monkeypatch) -> None:
    """Any conversion work (the tokenizer, the weights either way) fails the test."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def converting(*args, **kwargs):
        raise AssertionError("conversion work began")

    monkeypatch.setattr(gguf_llama, "read_llama", converting)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", converting)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", converting)


def _convert(tmp_path, path):
    """convert_gguf into a fresh cache under ``tmp_path``."""
    return embedded.convert_gguf(path, tmp_path / "cache" / "models" / path.stem)


def _at(path) -> str:
    """``path`` as a regular expression."""
    return re.escape(str(path))


def _nothing_cached(tmp_path) -> bool:
    return not any((tmp_path / "cache" / "models").iterdir())


ROPE_REFUSED = {  # a file's RoPE scaling no transformers RoPE type computes as llama.cpp does -> what the line names
    "llama3 factors tensor": (dict(extra="rope_freqs.weight"), r"rope_freqs.weight: Llama-3.x's llama3 RoPE"),
    "yarn with an attention factor": (dict(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                                 "llama.rope.scaling.attn_factor": 0.5}),
                                      r"llama.rope.scaling.attn_factor 0.5: a scale of attention llama.cpp releases "
                                      r"apply differently, which no transformers RoPE type computes as this file "
                                      r"means it"),
    "yarn log multiplier": (dict(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                       "llama.rope.scaling.yarn_log_multiplier": 0.1}),
                            r"llama.rope.scaling.yarn_log_multiplier 0.1: "),
    "longrope keys": (dict(meta={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}),
                      r"llama.rope.scaling.type 'longrope': LongRoPE, whose factors llama.cpp keeps in tensors"),
    "a type llama.cpp does not know": (dict(meta={"llama.rope.scaling.type": "ntk"}),
                                       r"llama.rope.scaling.type 'ntk': a type llama.cpp does not know"),
    "an original context stored as a float": (dict(meta={"llama.rope.scaling.type": "yarn",
                                                         "llama.rope.scaling.factor": 4.0,
                                                         "llama.rope.scaling.original_context_length": 64.0}),
                                              r"llama.rope.scaling.original_context_length 64 \(a float\), where "
                                              r"llama.cpp reads a whole number of tokens and refuses the file"),
    **{f"yarn_{beta} {value:g}": (dict(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                             f"llama.rope.scaling.yarn_{beta}": value}),
                                  rf"llama.rope.scaling.yarn_{beta} {value:g}: llama.cpp does not read it for this "
                                  r"architecture \(its YaRN ramp runs between betas 32 and 1\), so no RoPE computes "
                                  r"this file as it means it")
       for beta, value in [("beta_fast", 0.0), ("beta_fast", 16.0), ("beta_fast", -32.0), ("beta_slow", 64.0)]},
}


@pytest.mark.parametrize("case", list(ROPE_REFUSED))
def test_rope_scaling_no_transformers_type_computes_is_refused_before_any_conversion(tmp_path, monkeypatch, case):
    """RoPE scaling that neither reader computes as llama.cpp does (Llama-3.x's factors tensor, an attention scale
    llama.cpp releases apply differently, LongRoPE, an unknown type) would run another model: refused in one line
    naming the key and why, before the tokenizer or a weight is read."""
    kwargs, what = ROPE_REFUSED[case]
    path = write_llama_gguf(tmp_path / "m.gguf", **kwargs)
    _converting_fails(monkeypatch)
    message = (rf"^{_at(path)} holds RoPE scaling \({what}.*\) that neither specdec's GGUF reader nor transformers' "
               r"applies; load the model's checkpoint directory instead$")
    with pytest.raises(embedded.GGUFError, match=message):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)


YARN = {"general.architecture": "llama", "llama.context_length": 256, "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0}


@pytest.mark.parametrize("meta, what", [
    ({**YARN, "llama.rope.scaling.yarn_ext_factor": 0.0},
     r"llama.rope.scaling.yarn_ext_factor 0: a YaRN ramp mixed into the angles by another share than llama.cpp's own "
     r"for type 'yarn' \(1\), which no transformers RoPE type computes$"),
    ({**YARN, "llama.rope.scaling.type": "linear", "llama.rope.scaling.yarn_ext_factor": 1.0},
     r"llama.rope.scaling.yarn_ext_factor 1: a YaRN ramp mixed into the angles by another share than llama.cpp's own "
     r"for type 'linear' \(0\)"),
    ({**YARN, "llama.rope.scaling.factor": -0.5}, r"llama.rope.scaling.factor -0.5, not a scaling factor$"),
    ({**YARN, "llama.rope.scaling.original_context_length": True},
     r"llama.rope.scaling.original_context_length True \(bool\), where llama.cpp reads a whole number"),
    ({**YARN, "llama.context_length": 0, "llama.rope.scaling.original_context_length": 0},
     r"llama.rope.scaling.type 'yarn' with factor 4 and no context length "
     r"\(llama.rope.scaling.original_context_length, llama.context_length\) to place its ramp by$"),
])
def test_rope_scaling_refuses_what_llama_cpp_does_not_run_as_written(meta, what):
    """A partial YaRN (yarn_ext_factor 0 with YaRN, where 1 is llama.cpp's own; any mix with linear scaling, where
    0 is), a negative factor, a context length that is not a number of tokens, and a ramp with no context to place
    it by (0 is unset, on both keys) are refused, naming the key; yarn_ext_factor is named for what it is (it was
    called a scale of attention)."""
    with pytest.raises(gguf_llama.RopeNotMapped, match=rf"^{what}"):
        gguf_llama.rope_scaling(meta)


def test_a_file_of_rope_scaling_no_type_computes_is_not_read_directly(tmp_path):
    """The reader's own check: it never converts such a file without its scaling (check_convertible refuses it
    first)."""
    path = write_llama_gguf(tmp_path / "m.gguf", meta={**{k: v for k, v in YARN.items() if "scaling" in k},
                                                       "llama.rope.scaling.attn_factor": 0.5})
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        tensors, _, meta = embedded.read_header(blob)
    assert not gguf_llama.reads_directly(tensors, meta)
    assert gguf_llama.reads_directly(tensors, {k: v for k, v in meta.items() if "attn_factor" not in k})


ROPE_CONVERTED = {  # llama.cpp's RoPE scaling keys -> (the transformers RoPE they convert to, llama.cpp's yarn)
    "linear keys": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                    {"rope_type": "linear", "factor": 4.0}),
    "factor alone (linear)": ({"llama.rope.scaling.factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    "old linear key": ({"llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    "yarn keys": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                   "llama.rope.scaling.original_context_length": 64},
                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                   "beta_slow": 1.0}),
    "yarn with an original context of 0 (llama.cpp: unset)": ({"llama.rope.scaling.type": "yarn",
                                                               "llama.rope.scaling.factor": 4.0,
                                                               "llama.rope.scaling.original_context_length": 0},
                                                              {"rope_type": "yarn", "factor": 4.0,
                                                               "original_max_position_embeddings": 256,
                                                               "beta_fast": 32.0, "beta_slow": 1.0}),
    "yarn with llama.cpp's betas, no original context": ({"llama.rope.scaling.type": "yarn",
                                                          "llama.rope.scaling.factor": 8.0,
                                                          "llama.rope.scaling.yarn_beta_fast": 32.0,
                                                          "llama.rope.scaling.yarn_beta_slow": 1.0},
                                                         {"rope_type": "yarn", "factor": 8.0,
                                                          "original_max_position_embeddings": 256, "beta_fast": 32.0,
                                                          "beta_slow": 1.0}),
}


def _llama_cpp_rope(scaling: dict, positions: np.ndarray, dims: int, base: float, context: int):
    """cos and sin [positions, dims // 2] of llama.cpp's RoPE for ``scaling`` (ggml's rope_yarn with
    ggml_rope_yarn_corr_dims; llama-context.cpp's yarn_attn_factor, which cancels the 1 + 0.1 ln factor that
    rope_yarn multiplies in), pair i at frequency i."""
    factor, yarn = scaling["factor"], scaling["rope_type"] == "yarn"
    original = scaling.get("original_max_position_embeddings", context)
    beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

    def corr_dim(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(corr_dim(beta_fast))), min(dims - 1, math.ceil(corr_dim(beta_slow)))
    i = np.arange(dims // 2)
    extrapolated = positions[:, None] * base ** (-2.0 * i / dims)
    interpolated = extrapolated / factor
    ramp = (1 - np.clip((i - low) / max(0.001, high - low), 0, 1)) * (1.0 if yarn else 0.0)
    theta = interpolated * (1 - ramp) + extrapolated * ramp
    mscale = 1 + 0.1 * math.log(factor) if yarn else 1.0
    return np.cos(theta) * mscale, np.sin(theta) * mscale


@pytest.mark.parametrize("case", list(ROPE_CONVERTED))
def test_linear_and_yarn_scaling_convert_to_what_llama_cpp_computes(tmp_path, monkeypatch, case):
    """llama.cpp's linear RoPE scaling (freq_scale = 1 / factor) and YaRN were refused, though transformers' linear
    and yarn types compute the same angles and magnitudes: specdec's reader writes them into the config (transformers'
    GGUF loading drops them), and the converted model decodes as transformers' model of that config and weights."""
    meta, expected = ROPE_CONVERTED[case]
    path = write_llama_gguf(tmp_path / "m.gguf", meta=meta)
    out = _convert(tmp_path, path)
    config = AutoConfig.from_pretrained(out)
    assert {k: v for k, v in config.rope_parameters.items() if k != "rope_theta"} == expected
    positions = np.arange(0, 256, 7)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.tensor(positions)[None])
    want_cos, want_sin = _llama_cpp_rope(expected, positions.astype(np.float64), HIDDEN // HEADS, 50000.0, 256)
    half = HIDDEN // HEADS // 2
    np.testing.assert_allclose(cos[0, :, :half].numpy(), want_cos, atol=1e-4)
    np.testing.assert_allclose(sin[0, :, :half].numpy(), want_sin, atol=1e-4)

    plain_config, weights = transformers_read(path)  # transformers' GGUF loading: the weights, the scaling dropped
    fields = plain_config.to_dict()
    fields["rope_parameters"] = {**fields["rope_parameters"], **expected}
    reference = LlamaForCausalLM(LlamaConfig.from_dict(fields))
    reference.load_state_dict(weights, strict=False)
    reference.tie_weights()
    prompt = [1, 5, 9, 30, 2]
    with torch.no_grad():
        want = reference.eval().generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0].tolist()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    assert specdec.generate(str(path), [prompt], max_new_tokens=24, drafter="ngram")[0] == want


@pytest.mark.parametrize("case", ["qwen2 file", "llama file with an extra tensor"])
def test_rope_scaling_in_a_file_transformers_converts_is_refused_before_any_conversion(tmp_path, monkeypatch, case):
    """Only specdec's reader of plain llama files applies the scaling; transformers' GGUF loading, which converts any
    other file, drops it: refused in one line saying so."""
    arch = "qwen2" if case == "qwen2 file" else "llama"
    meta = {f"{arch}.rope.scaling.type": "linear", f"{arch}.rope.scaling.factor": 4.0}
    if arch == "qwen2":
        head_dim = HIDDEN // HEADS
        biases = {f"blk.{i}.attn_{p}.bias": ((HEADS if p == "q" else KV_HEADS) * head_dim,)
                  for i in range(LAYERS) for p in "qkv"}
        path = write_llama_gguf(tmp_path / "m.gguf", arch=arch, extra_tensors=biases, meta=meta)
    else:
        path = write_llama_gguf(tmp_path / "m.gguf", extra_tensors={"blk.0.attn_q.bias": (HIDDEN,)}, meta=meta)
    _converting_fails(monkeypatch)
    message = (rf"^{_at(path)} holds RoPE scaling \({arch}.rope.scaling.type 'linear' with factor 4\), which "
               r"specdec's GGUF reader applies to plain llama files only; this one goes through transformers' GGUF "
               r"loading, which drops it: load the model's checkpoint directory instead$")
    with pytest.raises(embedded.GGUFError, match=message):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)


@pytest.mark.parametrize("meta", [{"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0},
                                  {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1.0},
                                  {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 1.0}])
def test_rope_scaling_keys_that_scale_nothing_are_read(tmp_path, meta):
    """llama.cpp never scales under type "none", and a factor of 1 scales nothing."""
    path = write_llama_gguf(tmp_path / "m.gguf", meta=meta)
    names, _ = embedded.check_convertible(path)
    config, _ = gguf_llama.read_llama(path)
    assert "token_embd.weight" in names and config.rope_parameters["rope_type"] == "default"


def _retyped(path, tensor: str, ggml_type: int):
    """``path`` with the ggml type of ``tensor`` in its tensor table changed to ``ggml_type`` (the data left as is)."""
    data = bytearray(path.read_bytes())
    at = data.index(tensor.encode()) + len(tensor)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, ggml_type)
    path.write_bytes(bytes(data))
    return path


TYPE_FAULTS = {  # a tensor's ggml type (ffn_up, Q4_0 as written: 64 values a row) -> the line it is refused with
    "unknown to gguf": (99, r"is of ggml type 99, which the installed gguf package does not know \(a newer file than "
                            r"it, or a damaged one\): upgrade gguf$"),
    "no dequantizer": (int(Q.Q8_1), r"is of ggml type Q8_1, which gguf cannot dequantize, so no conversion reads it$"),
    "rows not whole blocks": (int(Q.Q4_K), r"has rows of 64 values, not whole Q4_K blocks of 256: the file is damaged "
                                           r"or was written wrong$"),
}


@pytest.mark.parametrize("case", list(TYPE_FAULTS))
def test_a_tensor_gguf_cannot_dequantize_is_refused_before_any_conversion(tmp_path, monkeypatch, case):
    """Both conversions dequantize with gguf's dequantizers. Such a tensor failed transformers' conversion halfway, an
    unknown type as "cannot build the tokenizer of m.gguf from its tokenizer.ggml metadata: np.uint32(99) is not a
    valid GGMLQuantizationType": now one line naming the tensor and its type, before any conversion work."""
    ggml_type, message = TYPE_FAULTS[case]
    path = _retyped(write_llama_gguf(tmp_path / "m.gguf"), "blk.1.ffn_up.weight", ggml_type)
    embedded.check_gguf(path)
    _converting_fails(monkeypatch)
    with pytest.raises(embedded.GGUFError, match=rf"^{_at(path)}: tensor 'blk.1.ffn_up.weight' {message}"):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)


def test_an_architecture_specdec_does_not_run_is_refused_before_any_conversion(tmp_path, monkeypatch):
    from specdec.models.llama import UnsupportedModelError

    for arch in ("gemma2", "mistral"):  # llama.cpp writes no mistral files: transformers failed on it, late, as
        # "Unknown gguf model_type: mistral ... outdated version of gguf-py"
        (tmp_path / arch).mkdir()
        path = write_llama_gguf(tmp_path / arch / "m.gguf", arch=arch)
        _converting_fails(monkeypatch)
        message = rf"^{_at(path)} holds a '{arch}' model \(general.architecture\), which specdec does not run from a "
        with pytest.raises(UnsupportedModelError, match=message + r"GGUF file; it converts llama, qwen2, qwen3 files "
                                                                  r"\(llama.cpp writes Mistral models as llama\)$"):
            _convert(tmp_path, path)
        assert _nothing_cached(tmp_path)


@pytest.mark.parametrize("case", ["missing tensor", "attention biases", "rope dimensions not the head size"])
def test_a_conversion_that_fills_or_drops_a_tensor_is_refused(tmp_path, monkeypatch, case):
    """The file goes through transformers (the direct reader takes exact llamas only), which would fill a tensor
    the file lacks or has in another shape (head_dim read from llama.rope.dimension_count) with random values, or
    drop biases a llama config has no place for: refused naming the file, nothing cached."""
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: _NoTokenizer())
    if case == "missing tensor":
        path = write_llama_gguf(tmp_path / "m.gguf", skip=("blk.1.ffn_down.weight",))
        message = (rf"^{_at(path)}: 1 tensor\(s\) the model needs are missing from the file or of another shape there "
                   r"\(model.layers.1.mlp.down_proj.weight\); transformers would fill them with random values")
    elif case == "rope dimensions not the head size":  # refused from the header: transformers 5.20 converted it
        path = write_llama_gguf(tmp_path / "m.gguf", rope_dims=HIDDEN // HEADS // 2)  # with full RoPE, unsaid
        message = (rf"^{_at(path)} turns 8 of its attention heads' 16 dimensions by RoPE \(llama.rope.dimension_count"
                   r"\): partial RoPE, which specdec's Llama-family forward does not compute$")
    else:
        head_dim = HIDDEN // HEADS
        biases = {f"blk.{i}.attn_{p}.bias": ((HEADS if p == "q" else KV_HEADS) * head_dim,)
                  for i in range(LAYERS) for p in "qkv"}
        path = write_llama_gguf(tmp_path / "m.gguf", extra_tensors=biases)
        message = (rf"^{_at(path)} holds 6 tensor\(s\) that transformers' GGUF conversion puts into no parameter of "
                   r"the model \(blk.0.attn_k.bias, blk.0.attn_q.bias, blk.0.attn_v.bias and 3 more\)")
    assert gguf_llama.read_llama(path) is None
    with pytest.raises(embedded.GGUFError, match=message):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)


@pytest.mark.parametrize("case", ["llama named mistral", "qwen2 with biases"])
def test_a_complete_file_still_converts_through_transformers(tmp_path, monkeypatch, case):
    """The tensor checks refuse nothing that transformers maps whole: every file tensor used, every parameter
    filled, the result transformers' own."""

    if case == "qwen2 with biases":
        head_dim = HIDDEN // HEADS
        biases = {f"blk.{i}.attn_{p}.bias": ((HEADS if p == "q" else KV_HEADS) * head_dim,)
                  for i in range(LAYERS) for p in "qkv"}
        path = write_llama_gguf(tmp_path / "m.gguf", arch="qwen2", extra_tensors=biases)
    else:
        path = write_llama_gguf(tmp_path / "m.gguf", name="mistral 7b")
    assert gguf_llama.read_llama(path) is None
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: _NoTokenizer())
    out = _convert(tmp_path, path)
    monkeypatch.undo()
    _same_logits_as_transformers(out, path)


def test_a_file_transformers_cannot_convert_is_one_line(tmp_path, monkeypatch):
    """A llama file named exactly "mistral" is read by transformers as a Mistral, a type gguf-py does not name:
    transformers' NotImplementedError becomes a GGUFError naming the file, nothing cached."""
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: _NoTokenizer())
    path = write_llama_gguf(tmp_path / "m.gguf", name="mistral")
    with pytest.raises(embedded.GGUFError, match=rf"^cannot convert {_at(path)}: \S"):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)


def test_a_gguf_older_than_the_checked_one_is_refused_before_any_conversion(tmp_path, monkeypatch):
    """gguf 0.10 (pyproject's floor once) reads no file under numpy 2: the embedded model failed to convert with
    "cannot build the tokenizer of ... from its tokenizer.ggml metadata: 'memmap' object has no attribute
    'newbyteorder'", blaming the file. An older gguf than the checked one is refused in one line, nothing cached."""
    from specdec.models import installed_versions

    real = installed_versions.metadata.version
    monkeypatch.setattr(installed_versions.metadata, "version",
                        lambda name: "0.10.0" if name == "gguf" else real(name))
    path = write_llama_gguf(tmp_path / "m.gguf")
    with pytest.raises(installed_versions.GGUFTooOld, match=re.escape(
            f"gguf 0.10.0 is installed; converting a .gguf needs {installed_versions.OLDEST_GGUF} or later (older "
            f"ones read no file under numpy 2): pip install 'gguf>={installed_versions.OLDEST_GGUF}'")):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)


def test_a_file_without_a_vocabulary_converts_for_token_ids(tmp_path, caplog):
    """No tokenizer.ggml.tokens: converted without a tokenizer, as a checkpoint directory without one loads (token
    ids only), said in a warning; transformers' tokenizer conversion failed on it with a bare KeyError."""
    path = write_llama_gguf(tmp_path / "m.gguf", tokens=False)
    with caplog.at_level("WARNING", logger="specdec.models.embedded"):
        out = _convert(tmp_path, path)
    assert "m.gguf holds no tokenizer (tokenizer.ggml.tokens): converted without one, for token ids only" in caplog.text
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB
    assert not list(out.glob("tokenizer*"))


TOKENIZER_FAULTS = {  # a file's tokenizer metadata -> (the message it is refused with, refused before any conversion)
    "gpt2 without merges": (dict(scores=False), r": its 'gpt2' tokenizer \(tokenizer.ggml.model\) has no merges "
                            r"\(tokenizer.ggml.merges\), so no tokenizer can be built from it$", True),
    "llama without merges or scores": (dict(tokenizer="llama", scores=False),
                                       r": its 'llama' tokenizer \(tokenizer.ggml.model\) has neither merges "
                                       r"\(tokenizer.ggml.merges\) nor token scores \(tokenizer.ggml.scores\) to "
                                       r"derive them from", True),
    "no tokenizer type": (dict(tokenizer=None), r" holds a vocabulary \(tokenizer.ggml.tokens\) but no tokenizer "
                                                r"type \(tokenizer.ggml.model\)", True),
    "scores cut short": (dict(tokenizer="llama", scores=False, meta={"tokenizer.ggml.scores": [0.0, -1.0]}),
                         rf": tokenizer.ggml.scores holds 2 values for {VOCAB} tokens \(tokenizer.ggml.tokens\)",
                         True),
    "token types cut short": (dict(meta={"tokenizer.ggml.token_type": [1, 3]}),
                              rf": tokenizer.ggml.token_type holds 2 values for {VOCAB} tokens", True),
    "pad id past the vocabulary": (dict(meta={"tokenizer.ggml.padding_token_id": 500}),
                                   rf": tokenizer.ggml.padding_token_id is 500, not one of the file's {VOCAB} tokens",
                                   True),
    "eos id one past the last token": (dict(meta={"tokenizer.ggml.eos_token_id": VOCAB}),
                                       rf": tokenizer.ggml.eos_token_id is {VOCAB}, not one of the file's {VOCAB} "
                                       r"tokens", True),
    "merges of tokens not in the vocabulary": (dict(meta={"tokenizer.ggml.merges": ["t 1"]}),
                                               r" from its tokenizer.ggml metadata: Error while initializing BPE: "
                                               r"Token `t` out of vocabulary$", False),
}


@pytest.mark.parametrize("case", list(TOKENIZER_FAULTS))
def test_tokenizer_metadata_no_tokenizer_is_built_from_is_one_line(tmp_path, monkeypatch, case):
    """Tokenizer metadata transformers cannot build a tokenizer from failed as "cannot convert m.gguf: 'scores'" (no
    merges), "list index out of range" (a special token id past the vocabulary) or a bare tokenizers Exception and
    its traceback (merges of unknown tokens); per-token arrays cut short were read cut short. Each is one line naming
    the key, before any conversion work where the metadata alone tells; nothing is cached."""
    kwargs, message, early = TOKENIZER_FAULTS[case]
    path = write_llama_gguf(tmp_path / "m.gguf", **kwargs)
    if early:
        _converting_fails(monkeypatch)
    prefix = "" if early else r"cannot build the tokenizer of "
    with pytest.raises(embedded.GGUFError, match=rf"^{prefix}{_at(path)}{message}") as err:
        _convert(tmp_path, path)
    assert "\n" not in str(err.value) and _nothing_cached(tmp_path)


def test_a_sentencepiece_vocabulary_with_scores_still_converts(tmp_path):
    """Scores alone are enough for transformers to derive a llama tokenizer's merges: not refused."""
    path = write_llama_gguf(tmp_path / "m.gguf", tokenizer="llama")
    out = _convert(tmp_path, path)
    assert (out / "tokenizer.json").is_file()


def test_the_cli_says_a_file_without_a_vocabulary_needs_one(tmp_path, monkeypatch, capsys):
    """`specdec generate` on such a file said "save it next to the checkpoint", which a GGUF file has no place for."""
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf", tokens=False)
    assert main(["generate", "--model", str(path), "hello"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("holds no vocabulary (tokenizer.ggml.tokens), and the CLI needs a tokenizer: use a GGUF "
                         "file with its vocabulary, or pass token ids to specdec.generate()"), line


def test_the_cli_names_the_extra_a_gguf_conversion_needs(tmp_path, monkeypatch, capsys):
    """Without the gguf package, transformers' tokenizer conversion raised a bare ImportError: a 44-line traceback
    where the README promises one line naming the extra (the embedded model is a GGUF)."""
    import sys

    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
    assert main(["generate", "--model", str(path), "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("specdec generate: error: the Python package 'gguf' is missing; install it with pip install "
                       "'specdec[gguf]'"), err
    assert "Traceback" not in "\n".join(err) and not any((tmp_path / "cache").rglob("*.safetensors"))


def test_the_python_api_names_the_extra_a_gguf_conversion_needs(tmp_path, monkeypatch):
    """specdec.load_model / generate on a .gguf file (the embedded model is one) without the gguf package raised
    "No module named 'gguf'", naming no extra: only the CLI said which to install."""
    import sys

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # not installed
    with pytest.raises(ModuleNotFoundError) as err:
        specdec.load_model(str(path))
    assert err.value.name == "gguf"
    assert str(err.value) == "No module named 'gguf'; install it with pip install 'specdec[gguf]'"


def test_a_file_without_a_kv_head_count_reads_as_one_with_it(tmp_path):
    """llama.cpp's default KV head count is the query head count, and its q / k rows are interleaved either way:
    read without the key, the weights are those of the same file with it (transformers' reading of which is
    compared above). transformers' own GGUF loading leaves q / k interleaved when the key is absent, another model."""
    with_key = gguf_llama.read_llama(write_llama_gguf(tmp_path / "a.gguf", kv_heads=HEADS))
    without = gguf_llama.read_llama(write_llama_gguf(tmp_path / "b.gguf", kv_heads=None))
    assert without[0].num_key_value_heads == HEADS
    assert with_key[1].keys() == without[1].keys()
    assert all(torch.equal(with_key[1][k], without[1][k]) for k in with_key[1])


def test_a_kv_head_count_written_as_a_one_element_array_reads_as_that_count(tmp_path):
    """A one-element array is the count itself (transformers unwraps it alike); an array of one count per layer is
    not a plain llama: left to transformers."""
    plain = gguf_llama.read_llama(write_llama_gguf(tmp_path / "a.gguf"))
    array = gguf_llama.read_llama(write_llama_gguf(tmp_path / "b.gguf", kv_heads=[KV_HEADS]))
    assert array[0].num_key_value_heads == KV_HEADS
    assert array[1].keys() == plain[1].keys() and all(torch.equal(array[1][k], plain[1][k]) for k in plain[1])
    assert gguf_llama.read_llama(write_llama_gguf(tmp_path / "c.gguf", kv_heads=[KV_HEADS] * LAYERS)) is None


@pytest.mark.parametrize("tokens", [True, False])
def test_the_vocabulary_size_is_read_from_the_header_as_the_conversion_gives_it(tmp_path, monkeypatch, tokens):
    """A draft model's GGUF is compared with the target's vocabulary before any conversion work: the size read from
    the header is the converted config's, from the token list or, without one, from the vocab_size key."""
    path = write_llama_gguf(tmp_path / "m.gguf", tokens=tokens)
    monkeypatch.setattr(gguf_llama, "read_llama", lambda *a: pytest.fail("converted"))
    assert embedded.vocab_size(path) == VOCAB
    monkeypatch.undo()
    assert json.loads((_convert(tmp_path, path) / "config.json").read_text())["vocab_size"] == VOCAB


def _qwen3_gguf(path, head_dim: int, meta: dict | None = None):
    """A qwen3 file (q / k norms) of heads of ``head_dim``: HIDDEN // HEADS, or 128 over two heads."""
    with pytest.MonkeyPatch.context() as patch:
        if head_dim != HIDDEN // HEADS:  # write_llama_gguf shapes the tensors by these
            patch.setitem(globals(), "HEADS", 2)
            patch.setitem(globals(), "HIDDEN", 2 * head_dim)
        norms = {f"blk.{i}.attn_{p}_norm.weight": (head_dim,) for i in range(LAYERS) for p in "qk"}
        return write_llama_gguf(path, arch="qwen3", extra_tensors=norms, rope_dims=head_dim, meta=meta)


@pytest.mark.parametrize("key_length", [True, False])
def test_a_qwen3_file_of_heads_transformers_cannot_shape_is_refused_before_any_conversion(tmp_path, monkeypatch,
                                                                                           key_length):
    """transformers' GGUF loading reads no head size from a qwen3 file and builds heads of 128: a file of heads of 16
    was converted, then refused as "12 tensor(s) the model needs are missing from the file", an incomplete file to
    all appearances. Now one line before any conversion; a file of heads of 128 converts as transformers reads it."""
    meta = {"qwen3.attention.key_length": 16, "qwen3.attention.value_length": 16} if key_length else None
    path = _qwen3_gguf(tmp_path / "m.gguf", HIDDEN // HEADS, meta)
    _converting_fails(monkeypatch)
    where = "qwen3.attention.key_length" if key_length else \
        "qwen3.embedding_length over qwen3.attention.head_count"
    with pytest.raises(embedded.GGUFError, match=rf"^{_at(path)} holds attention heads of 16 dimensions \({where}\), "
                                                 r"and transformers' GGUF loading, which converts qwen3 files, reads "
                                                 r"no head size from them and would build heads of 128: load the "
                                                 r"model's checkpoint directory instead$"):
        _convert(tmp_path, path)
    assert _nothing_cached(tmp_path)
    monkeypatch.undo()
    (tmp_path / "ok").mkdir()
    path = _qwen3_gguf(tmp_path / "ok" / "m.gguf", 128)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda *a, **k: _NoTokenizer())
    out = _convert(tmp_path, path)
    monkeypatch.undo()
    _same_logits_as_transformers(out, path)
