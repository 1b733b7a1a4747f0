"""Model resolution: cached GGUF conversion is reused, clear errors for bad specs."""
from __future__ import annotations

import pytest

from specdec.models import embedded
from specdec.models.loader import load_model


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

    def convert_into(gguf_path, out):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"weights" * 1000)
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "tokenizer.json").write_text("{}")

    monkeypatch.setattr(embedded, "_convert_into", convert_into)
    return calls


@pytest.mark.parametrize("damage", ["truncated weights", "edited config", "missing tokenizer", "no manifest"])
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
    else:
        (out / embedded.MANIFEST).unlink()
    assert not embedded.is_intact(out)
    with caplog.at_level("WARNING"):
        assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out
    assert len(calls) == 2 and embedded.is_intact(out) and "converting again" in caplog.text
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no temporary or stale copy left behind


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


@pytest.mark.parametrize("spec, err", [("/no/such/dir", FileNotFoundError), ("/no/such/file.gguf", FileNotFoundError),
                                       (42, TypeError)])
def test_bad_model_specs(spec, err):
    with pytest.raises(err):
        load_model(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
