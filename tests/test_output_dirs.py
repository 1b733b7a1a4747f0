"""specdec.output_dirs: an existing folder nothing can be written into is refused like one that cannot be made, also
for root (whom permission bits do not stop: a read-only file system does), and checking leaves nothing behind."""
from __future__ import annotations

import errno
import os
import sys
import tempfile

import pytest

from specdec.errors import InputError
from specdec.output_dirs import check_creatable, first_undeletable, make_dir, why_uncreatable


def test_a_writable_folder_passes_and_the_check_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert why_uncreatable(out) is None and why_uncreatable(out / "new" / "deeper") is None
    check_creatable(out, "--out")
    assert list(tmp_path.iterdir()) == [out] and list(out.iterdir()) == []


def test_an_existing_folder_that_os_access_calls_unwritable_is_refused(tmp_path, monkeypatch):
    """The existing folder itself was never checked, only the parents of one still to be made."""
    out = tmp_path / "out"
    out.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == os.fspath(out) and
                        mode & os.W_OK else access(p, mode, **kw))
    assert why_uncreatable(out) == f"{out} is not writable"
    assert why_uncreatable(out / "run") == f"{out} is not writable"  # its subfolder cannot be made either
    with pytest.raises(InputError, match=rf"^--out {out}: cannot write into it \({out} is not writable\)$"):
        check_creatable(out, "--out")


def test_a_folder_where_no_file_can_be_made_is_refused_for_root_too(tmp_path, monkeypatch):
    """Root passes os.access where the file system still refuses (a read-only mount, a squashed network share): a
    nameless file made and closed there tells."""
    out = tmp_path / "out"
    out.mkdir()
    temporary = tempfile.TemporaryFile

    def refusing(*args, dir=None, **kwargs):
        if dir is not None and os.fspath(dir) == os.fspath(out):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return temporary(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "TemporaryFile", refusing)
    assert why_uncreatable(out) == f"{out} is not writable: {os.strerror(errno.EROFS)}"


@pytest.mark.skipif(not os.path.isdir("/proc/self") or os.name != "posix", reason="needs Linux /proc")
def test_a_real_folder_that_takes_no_files_is_refused():
    """/proc takes no new files, whoever asks (root included)."""
    assert why_uncreatable("/proc") is not None
    with pytest.raises(InputError, match="^--out /proc: cannot write into it"):
        check_creatable("/proc", "--out")


def test_make_dir_names_the_file_in_the_way_not_the_bare_errno(tmp_path):
    """A folder made after the up-front check (a file appeared meanwhile) is refused as check_creatable says it,
    "<file> is a file, not a folder", not as mkdir's "Not a directory"."""
    blocker = tmp_path / "runs"
    blocker.write_text("not a folder")
    out = blocker / "run1"
    with pytest.raises(InputError, match=rf"^--out {out}: cannot create it \({blocker} is a file, not a folder\)$"):
        make_dir(out, "--out")


def test_a_folder_on_a_read_only_file_system_is_said_as_such(tmp_path, monkeypatch):
    """os.access refuses, and statvfs flags the file system read-only: the error says why, not only "not writable"."""
    out = tmp_path / "out"
    out.mkdir()
    access, statvfs = os.access, os.statvfs
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == os.fspath(out) else
                        access(p, mode, **kw))
    monkeypatch.setattr(os, "statvfs", lambda p: type("V", (), {"f_flag": os.ST_RDONLY})() if
                        os.fspath(p) == os.fspath(out) else statvfs(p))
    assert why_uncreatable(out) == f"{out} is on a read-only file system"


def test_the_first_folder_this_user_may_not_delete_from_is_named(tmp_path, monkeypatch):
    """--overwrite checks every folder it would empty before deleting anything (train and eval both): the first one
    without write and search permission is the one named; None where each may be emptied."""
    folders = [tmp_path / name for name in ("run", "run/checkpoint", "run/cells")]
    for folder in folders:
        folder.mkdir()
    access = os.access
    denied = {os.fspath(folders[1]), os.fspath(folders[2])}
    assert first_undeletable(folders) is None
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (os.fspath(p) not in denied or not mode & os.W_OK)
                        and access(p, mode, **kw))
    assert first_undeletable(folders) == folders[1]
    assert first_undeletable(iter(folders[2:])) == folders[2]


@pytest.mark.skipif(sys.platform == "win32", reason="the sticky bit is POSIX's")
def test_a_sticky_folder_of_another_users_files_is_undeletable(tmp_path, monkeypatch):
    """In a folder with the sticky bit (as /tmp) only an entry's owner, the folder's or root may delete it: writable
    by all, another user's run there passed as deletable, and --overwrite (train, eval) failed half-way."""
    folder = tmp_path / "shared"
    folder.mkdir()
    (folder / "theirs.json").write_text("{}")
    os.chmod(folder, 0o1777)
    owner = os.stat(folder).st_uid
    for me, undeletable in ((owner + 1, folder), (owner, None), (0, None)):
        monkeypatch.setattr(os, "geteuid", lambda me=me: me)
        assert first_undeletable([folder]) == undeletable, me
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
    os.chmod(folder, 0o777)  # no sticky bit: write permission is enough
    assert first_undeletable([folder]) is None
