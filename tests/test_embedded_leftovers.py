"""The folder a process killed while converting a GGUF left in the model cache (half a model, ~0.5 GB for the
embedded one) stayed there for good; the next conversion, or load of a conversion, removes it, never a folder whose
conversion still runs. The conversion itself is replaced by one that writes small files."""
from __future__ import annotations

import os
import stat
import sys
import tempfile
import threading
import time

import pytest

from specdec.atomic_write import umask
from specdec.folder_lock import only_writer
from specdec.models import embedded


def _writes_a_checkpoint(gguf_path, out, **kw):
    """A conversion's stand-in: the files an intact conversion holds."""
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "model.safetensors").write_bytes(b"weights")


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: a running conversion cannot be told from a dead one")
def test_a_conversion_removes_what_killed_ones_left_and_nothing_else(tmp_path, monkeypatch, caplog):
    def convert_into(gguf_path, out, **kw):
        (out / "model.safetensors").write_bytes(b"weights" * 1000)
        (out / "config.json").write_text('{"model_type": "llama"}')

    monkeypatch.setattr(embedded, "_convert_into", convert_into)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    out = embedded.converted_dir(gguf)
    out.parent.mkdir(parents=True)
    folders = {name: out.parent / name for name in (".tmp-killed", ".stale-killed", ".tmp-running", ".tmp-young")}
    for name, folder in folders.items():
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half" * 100)
        if name != ".tmp-young":
            os.utime(folder, (1e9, 1e9))  # made long ago
    with only_writer(folders[".tmp-running"], "a conversion"), caplog.at_level("WARNING", logger="specdec"):
        assert embedded.convert_gguf(gguf, out) == out and embedded.is_intact(out)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted([out.name, ".tmp-running", ".tmp-young"])
    assert sum("left by a conversion that was stopped" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: a running conversion cannot be told from a dead one")
def test_loading_an_intact_conversion_removes_what_a_killed_one_left(tmp_path, monkeypatch):
    """A conversion killed (SIGKILL, the OOM killer) and rerun at once: the rerun found the killed one's folder too
    young to remove and converted; every later run loaded the intact conversion, which removed nothing, so the half
    model stayed for good. Loading removes it too."""
    monkeypatch.setattr(embedded, "_convert_into", _writes_a_checkpoint)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    out = embedded.converted_dir(gguf)
    killed = out.parent / ".tmp-killed"
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"half")
    assert embedded.convert_gguf(gguf, out) == out and killed.exists()  # too young to tell from a live one
    os.utime(killed, (1e9, 1e9))
    assert embedded.convert_gguf(gguf, out) == out
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_where_no_folder_can_be_held_no_leftover_is_removed(tmp_path, monkeypatch):
    """Without flock (Windows, some network mounts) a running conversion's folder cannot be told from a dead one's:
    the removal took it all the same."""
    from specdec import folder_lock

    monkeypatch.setattr(folder_lock, "fcntl", None)
    running = tmp_path / ".tmp-running"
    running.mkdir()
    os.utime(running, (1e9, 1e9))
    embedded._remove_leftovers(tmp_path)
    assert running.exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_a_conversion_is_readable_as_the_umask_allows(tmp_path, monkeypatch):
    """The conversion folder kept mkdtemp's mode 0700: in a cache shared between users (SPECDEC_CACHE_DIR), the
    others could not read the model, nor replace it. It gets the mode a folder made under the umask gets."""
    monkeypatch.setattr(embedded, "_convert_into", _writes_a_checkpoint)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    mask = os.umask(0o027)
    try:
        out = embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    finally:
        os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o750


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_a_conversion_keeps_the_group_a_shared_cache_passes_on(tmp_path, monkeypatch):
    """A team's cache folder is setgid, so what is made there gets the team's group: the conversion folder's mode,
    set after mkdtemp, dropped the bit, and its files got the converting user's group, which a team member reading
    under umask 007 could not read."""
    monkeypatch.setattr(embedded, "_convert_into", _writes_a_checkpoint)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    models = embedded.converted_dir(gguf).parent
    models.mkdir(parents=True)
    os.chmod(models, 0o2770)
    if not models.stat().st_mode & stat.S_ISGID:
        pytest.skip("this file system keeps no setgid bit on folders")
    out = embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    assert out.stat().st_mode & (stat.S_ISGID | 0o777) == stat.S_ISGID | (0o777 & ~umask())


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="POSIX modes, which root is not refused by")
def test_a_conversion_this_user_cannot_read_is_said_as_such(tmp_path, monkeypatch, caplog):
    """Another user's conversion, made readable by its owner alone (by an earlier version), was called
    "incomplete, damaged or unverified": the user looked for damage where a chmod by its owner was due."""
    monkeypatch.setattr(embedded, "_convert_into", _writes_a_checkpoint)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    out = embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    os.chmod(out / "model.safetensors", 0)
    with caplog.at_level("WARNING", logger="specdec"):
        assert embedded.convert_gguf(gguf, out) == out and embedded.is_intact(out)
    said = [r.getMessage() for r in caplog.records if "converting again" in r.getMessage()]
    assert len(said) == 1 and "cannot read" in said[0] and "model.safetensors: permission denied" in said[0]


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: a running conversion cannot be waited for")
def test_a_conversion_another_process_runs_is_waited_for_not_done_again(tmp_path, monkeypatch):
    """Two processes started together on a file not yet converted (two `specdec generate`, a launch's processes)
    each converted it: twice the time, the memory and the disk. The second waits for the first's and loads it."""
    converted = []

    def convert_into(gguf_path, out, **kw):
        converted.append(out)
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(embedded, "_convert_into", convert_into)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    out = embedded.converted_dir(gguf)
    running = out.parent / f".tmp-{out.name}-other"
    running.mkdir(parents=True)
    held = threading.Event()

    def other_process():
        with only_writer(running, "a conversion"):
            held.set()
            time.sleep(0.5)  # converting
            convert_into(gguf, running)
            embedded._write_manifest(running)
            running.rename(out)

    other = threading.Thread(target=other_process)
    other.start()
    held.wait()
    try:
        assert embedded.convert_gguf(gguf, out) == out
    finally:
        other.join()
    assert converted == [running]


@pytest.mark.skipif(sys.platform == "win32", reason="no flock")
def test_a_conversion_whose_folder_another_process_looks_at_goes_on(tmp_path, monkeypatch):
    """Another process waiting for this file's conversions holds each one's folder for an instant: one it found just
    made, before this process held it, made this conversion fail ("the model cache's conversion folder" in use)."""
    made = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):  # the other process holds the new folder for a moment, as _wait_for_others does
        tmp = made(*args, **kwargs)
        looked = threading.Event()

        def look():
            with only_writer(tmp, "a conversion", wait=True):
                looked.set()
                time.sleep(0.3)

        threading.Thread(target=look, daemon=True).start()
        looked.wait()
        return tmp

    monkeypatch.setattr(embedded.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(embedded, "_convert_into", _writes_a_checkpoint)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"gguf")
    out = embedded.convert_gguf(gguf, embedded.converted_dir(gguf))
    assert out == embedded.converted_dir(gguf) and embedded.is_intact(out)
