"""replaced_atomically / write_json: the whole file or the old one, never a partial write or a stray temp file."""
from __future__ import annotations

import errno
import json
import os

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from specdec.atomic_write import leftover_of, replaced_atomically, save_tensors, write_json


def test_writes_creates_parents_and_overwrites(tmp_path):
    path = tmp_path / "a" / "b" / "x.json"
    write_json(path, {"v": 1})
    write_json(path, {"v": [2, 3]}, indent=2)
    assert json.loads(path.read_text()) == {"v": [2, 3]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]


def test_unserialisable_data_leaves_the_old_file(tmp_path):
    path = tmp_path / "x.json"
    write_json(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json(path, {"v": object()})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_failed_rename_leaves_no_temp_file(tmp_path, monkeypatch):
    def fail(*_):
        raise OSError("disk full")

    monkeypatch.setattr("specdec.atomic_write.os.replace", fail)
    with pytest.raises(OSError, match="disk full"):
        write_json(tmp_path / "x.json", {"v": 1})
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_fails_midway_leaves_the_old_file(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="crashed"):
        with replaced_atomically(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer crashed")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["w.bin"]


def test_a_full_disk_names_the_file_meant(tmp_path):
    """A write that fails for want of space names no file ("[Errno 28] No space left on device"): `specdec eval`
    said only that, not which of its outputs; the error names the file meant (not its temporary file) and keeps
    its errno."""
    path = tmp_path / "report.json"
    with pytest.raises(OSError) as raised:
        with replaced_atomically(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert str(raised.value) == f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: '{path}'"
    assert list(tmp_path.iterdir()) == []


def test_safetensors_refused_by_the_disk_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    """safetensors says a full disk as its own SafetensorError ("... (os error 28)"), which no OSError handler took:
    convert-medusa ended in a traceback, an interrupted training run's save was not said as "not saved"."""
    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    path = tmp_path / "heads.safetensors"
    save_tensors(path, {"w": torch.ones(2)}, metadata={"format": "pt"})
    assert safetensors.torch.load_file(path)["w"].tolist() == [1.0, 1.0]
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError) as raised:
        save_tensors(path, {"w": torch.zeros(2)})
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert safetensors.torch.load_file(path)["w"].tolist() == [1.0, 1.0]  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["heads.safetensors"]


def test_two_threads_writing_one_file_never_share_a_temporary_file(tmp_path):
    """Concurrent generate() calls in one process may write one cache file at once: the temporary file was named by
    the process alone, so two threads wrote into (and renamed) the same one."""
    import threading

    path, names = tmp_path / "x.json", []
    with replaced_atomically(path) as mine:
        thread = threading.Thread(target=lambda: names.append(_temporary_name(path)))
        thread.start()
        thread.join()
        assert names and names[0] != mine.name, (names, mine.name)
        mine.write_text("{}")
    assert leftover_of(mine.name) == "x.json" and leftover_of(names[0]) == "x.json"
    assert leftover_of("x.json.123.tmp") == "x.json"  # an earlier version's leftover
    assert leftover_of("x.json") is None and leftover_of("x.json.tmp") is None


def _temporary_name(path) -> str:
    with replaced_atomically(path) as tmp:
        tmp.write_text("{}")
        return tmp.name
