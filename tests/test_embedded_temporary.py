"""An unwritable model cache: the GGUF is converted once per process into a temporary directory, which later loads
reuse while it is intact (each conversion of the embedded model is ~6 s and a 517 MiB copy). The conversion itself is
replaced by one that writes small files."""
from __future__ import annotations

import tempfile

from specdec.models import embedded
from tests.test_gguf_llama import write_llama_gguf


def _unwritable_cache(tmp_path, monkeypatch) -> None:
    """SPECDEC_CACHE_DIR names a file (no cache folder can be made); temporary folders go under tmp_path/tmp."""
    monkeypatch.setattr(embedded, "_TEMPORARY", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker))


def _fake_conversion(monkeypatch) -> list:
    """The conversion replaced by one writing small files; returns the folders it converted into, in order."""
    calls = []

    def convert_into(gguf_path, out, **kw):
        calls.append(out)
        (out / "model.safetensors").write_bytes(b"weights" * 1000)
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(embedded, "_convert_into", convert_into)
    return calls


def test_an_unwritable_cache_converts_once_per_process(tmp_path, monkeypatch, caplog):
    calls = _fake_conversion(monkeypatch)
    _unwritable_cache(tmp_path, monkeypatch)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    with caplog.at_level("WARNING", logger="specdec.models.embedded"):
        got = [embedded.convert_gguf(gguf, embedded.converted_dir(gguf)) for _ in range(3)]
    assert got == [calls[0]] * 3 and len(calls) == 1 and embedded.is_intact(got[0])
    assert caplog.text.count("for this run only") == 1
    assert [p.name for p in (tmp_path / "tmp").iterdir()] == [got[0].name]
    (got[0] / "model.safetensors").write_bytes(b"weights")  # damaged: converted again, into another directory
    again = embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    assert len(calls) == 2 and again == calls[1] != got[0] and embedded.is_intact(again)
    assert embedded.convert_gguf(gguf, embedded.converted_dir(gguf)) == again and len(calls) == 2


def test_a_conversion_for_this_run_only_is_not_called_one_time(tmp_path, monkeypatch, caplog):
    """Its first warning said the conversion was for this run only, the next "converting m.gguf (one-time
    dequantization, ~10 s) into /tmp": it is done again by every run."""
    _unwritable_cache(tmp_path, monkeypatch)
    gguf = write_llama_gguf(tmp_path / "m.gguf")
    with caplog.at_level("WARNING", logger="specdec.models.embedded"):
        embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    converting = [r.getMessage() for r in caplog.records if r.getMessage().startswith("converting m.gguf")]
    assert len(converting) == 1 and "(dequantization for this run only, ~10 s)" in converting[0], caplog.text
    assert "one-time" not in caplog.text


def test_another_users_damaged_conversion_in_a_sticky_cache_is_left_and_converted_for_this_run(tmp_path, monkeypatch,
                                                                                               caplog,
                                                                                               another_users_sticky):
    """A shared model cache with the sticky bit (as /tmp) holding another user's damaged (or unreadable) conversion:
    the GGUF was converted, then moving their copy aside stopped with "Operation not permitted", the conversion
    deleted and the model not loaded. Their copy is left, and the conversion goes to a folder for this run only."""
    calls = _fake_conversion(monkeypatch)
    monkeypatch.setattr(embedded, "_TEMPORARY", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    theirs = embedded.converted_dir(gguf)
    theirs.mkdir(parents=True)
    (theirs / "config.json").write_text("{}")  # no manifest: damaged
    another_users_sticky(theirs.parent)  # this user owns neither the cache nor the conversion
    with caplog.at_level("WARNING", logger="specdec.models.embedded"):
        got = embedded.convert_gguf(gguf, theirs)
    assert got == calls[0] and got.parent == tmp_path / "tmp" and embedded.is_intact(got)
    assert "for this run only" in caplog.text and "only its owner may replace" in caplog.text
    assert [p.name for p in theirs.parent.iterdir()] == [theirs.name]
    assert [p.name for p in theirs.iterdir()] == ["config.json"]
