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
    assert embedded.convert_gguf(tmp_path / "m.gguf", out) == out


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
