"""replaced_atomically / write_json: the whole file or the old one, never a partial write or a stray temp file."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from specdec.atomic_write import leftover_of, remove_leftovers, replaced_atomically, save_tensors, write_json

_KILLED_WRITE = """
import os, sys
from specdec.atomic_write import write_json
os.replace = lambda *_: os._exit(9)  # killed between its write and the rename
write_json(sys.argv[1], {"v": list(range(1000))})
"""


def test_writes_creates_parents_and_overwrites(tmp_path):
    path = tmp_path / "a" / "b" / "x.json"
    write_json(path, {"v": 1})
    write_json(path, {"v": [2, 3]}, indent=2)
    assert json.loads(path.read_text()) == {"v": [2, 3]}
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.json"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_tensors_are_readable_as_the_umask_allows(tmp_path, mask, mode):
    """safetensors writes its files 0600 whatever the umask: heads a training run wrote could not be read by a
    server running as another user. They get the mode any file made under the umask gets, as the JSON beside them."""
    before = os.umask(mask)
    try:
        save_tensors(tmp_path / "w.safetensors", {"a": torch.zeros(2)})
        write_json(tmp_path / "c.json", {})
    finally:
        os.umask(before)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == mode == (tmp_path / "c.json").stat().st_mode & 0o777


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


def test_a_read_only_file_system_names_the_file_meant(tmp_path, monkeypatch):
    """A cost cache on a read-only file system: the error named the temporary file ("Read-only file system:
    'rows-....json.20543.139921621117824.tmp'"): removing the temporary file that was never made raised EROFS (a
    read-only file system answers so even for a name it does not hold), in place of the error naming the file."""
    path = tmp_path / "rows.json"
    real_open, real_unlink = os.open, os.unlink

    def read_only(call):
        def refused(file, *args, **kwargs):
            if str(file).endswith(".tmp"):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(file))
            return call(file, *args, **kwargs)
        return refused

    monkeypatch.setattr(os, "open", read_only(real_open))
    monkeypatch.setattr(os, "unlink", read_only(real_unlink))
    with pytest.raises(OSError) as raised:
        write_json(path, {"a": 1})
    assert raised.value.errno == errno.EROFS and raised.value.filename == str(path)


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="POSIX modes, which root is not refused by")
def test_a_folder_this_user_may_not_write_names_the_file_meant(tmp_path):
    """Another user's folder (a shared cost cache, an --out): the error named the temporary file,
    "Permission denied: 'guard.json.4388.140208169057152.tmp'", in every line built from it."""
    path = tmp_path / "guard.json"
    path.write_text("theirs")
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(PermissionError) as raised:
            write_json(path, {"a": 1})
    finally:
        os.chmod(tmp_path, 0o755)
    assert raised.value.filename == str(path) and path.read_text() == "theirs"


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


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: a live writer's file cannot be told from a dead one's")
def test_the_next_write_of_a_name_removes_what_killed_writers_of_it_left(tmp_path, caplog):
    """A process killed between its write and the rename left NAME.PID.THREAD.tmp for good (a self-distillation's
    cache entry: hundreds of MB); no later run removed it. The next write of that name does; another name's leftover,
    and a file of another pattern, stay."""
    path = tmp_path / "entry.json"
    subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(path)], check=False)
    (killed,) = tmp_path.iterdir()
    assert leftover_of(killed.name) == "entry.json" and not path.exists()
    (tmp_path / "entry.json.123.tmp").write_text("{")  # an earlier version's leftover
    others = [tmp_path / "other.json.123.456.tmp", tmp_path / "entry.json.tmp", tmp_path / "entry.json.1.2.tmp.bak"]
    for other in others:
        other.write_text("{")
    with caplog.at_level("WARNING", logger="specdec.atomic_write"):
        write_json(path, {"v": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["entry.json", *(p.name for p in others)])
    assert sum("left by a write that was stopped" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: a live writer's file cannot be told from a dead one's")
def test_a_temporary_file_being_written_stays(tmp_path):
    """Another process (or thread, or node on a shared disk) writing the same name now holds its temporary file:
    neither a write of that name nor remove_leftovers takes it, and its write then completes."""
    path, started, done = tmp_path / "x.json", threading.Event(), threading.Event()

    def other():
        with replaced_atomically(path) as tmp:
            tmp.write_text('{"v": "other"}')
            started.set()
            done.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    started.wait(10)
    live = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    write_json(path, {"v": "mine"})
    remove_leftovers(path)
    assert live and all(p.exists() for p in live)
    done.set()
    thread.join()
    assert json.loads(path.read_text()) == {"v": "other"} and [p.name for p in tmp_path.iterdir()] == ["x.json"]
