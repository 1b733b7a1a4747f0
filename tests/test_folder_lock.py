"""One run at a time writes an output folder (specdec.folder_lock): a second run given it while the first writes
is refused in one line before it writes anything, and a killed run leaves no lock behind."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

import pytest
from specdec.eval.acceptance import cell_path

from specdec.folder_lock import FolderInUse, launch_writer, only_writer
from specdec.testing import save_tiny_checkpoint
from tests.cli_runs import run_main

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no flock: nothing is held")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def test_a_folder_is_held_once_and_let_go(tmp_path):
    with only_writer(tmp_path, "--out"):
        with pytest.raises(FolderInUse, match=f"^--out {tmp_path}: another run is writing there now"):
            with only_writer(tmp_path, "--out"):
                pass
    with only_writer(tmp_path, "--out"):  # after the body: free again
        pass


def test_a_waiting_hold_takes_the_folder_once_it_is_let_go(tmp_path):
    """``wait`` (the model cache's conversions) waits for the other holder instead of refusing."""
    outcome = []

    def waiting() -> None:
        try:
            with only_writer(tmp_path, "the model cache", wait=True) as held:
                outcome.append(held)
        except FolderInUse as err:
            outcome.append(str(err))

    thread = threading.Thread(target=waiting)
    with only_writer(tmp_path, "--out"):
        thread.start()
        thread.join(0.2)  # time to reach the hold (and be refused, were it not waiting)
    thread.join()
    assert outcome == [True]


def test_only_the_main_process_of_a_launch_holds_its_folder(tmp_path):
    """The other processes of a launch write into the folder the main one holds: one that enters first does not
    hold it, so the main process is not refused."""
    with launch_writer(tmp_path, "--out", False, lambda value: None):  # the main process's outcome: not refused
        with launch_writer(tmp_path, "--out", True, lambda value: value):
            pass


def test_a_killed_holder_leaves_no_lock(tmp_path):
    code = (f"import sys, time; from specdec.folder_lock import only_writer\n"
            f"with only_writer({str(tmp_path)!r}, '--out'):\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderInUse):
            with only_writer(tmp_path, "--out"):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with only_writer(tmp_path, "--out"):
        pass


def test_a_certificate_run_is_refused_while_another_writes_its_out(model, tmp_path, capsys, monkeypatch):
    """A second `eval lossless` given the --out of one still running replaced its verdict minutes later (a FAILED
    certificate covered by another drafter's PASSED, both runs exiting as if alone)."""
    import specdec.eval.certificate as certificate

    monkeypatch.setattr(certificate, "run_certificate", lambda *a, **k: pytest.fail("the refused run ran"))
    out = tmp_path / "cert"
    out.mkdir()
    with only_writer(out, "--out"):  # the running one's hold
        code, captured = run_main(["eval", "lossless", "--model", model, "--levels", "exact", "--out", str(out)],
                                  capsys)
    assert code == 2 and "another run is writing there now" in captured.err
    assert list(out.iterdir()) == []


def test_an_acceptance_run_is_refused_while_another_writes_its_out(model, tmp_path, capsys):
    """Two `eval acceptance` runs started together into one --out both passed the first check and wrote their
    cells and settings into one folder: the report showed one run, the other's results were lost."""
    out = tmp_path / "run"
    argv = ["eval", "acceptance", "--model", model, "--categories", "qa", "--prompts", "1", "--drafters", "ngram",
            "--max-new-tokens", "2", "--calibration-repeats", "0", "--no-hf-baseline", "--no-plots", "--out",
            str(out)]
    out.mkdir()
    with only_writer(out, "--out"):
        code, captured = run_main(argv, capsys)
    assert code == 2 and "another run is writing there now" in captured.err
    assert not (out / "settings.json").exists() and not cell_path(out, "ngram", "qa").exists()
    assert run_main(argv, capsys)[0] == 0 and cell_path(out, "ngram", "qa").exists()  # once the other has ended
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with only_writer(out, "--out"):  # --overwrite deleted the running one's files, then was refused
        code, captured = run_main([*argv, "--overwrite"], capsys)
    assert code == 2 and "another run is writing there now" in captured.err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def _launch(folder, body) -> list:
    """Two processes of one launch (threads here), each entering :func:`launch_writer` on ``folder`` and running
    ``body(rank)`` inside it, with a broadcast from rank 0; returns each one's outcome: its body's, or its refusal."""
    slot, meet = [], threading.Barrier(2, timeout=60)
    outcomes: list = [None, None]

    def broadcast(rank: int, value):
        if rank == 0:
            slot.append(value)
        meet.wait()
        return slot[0]

    def process(rank: int) -> None:
        try:
            with launch_writer(folder, "--out", rank == 0, lambda value: broadcast(rank, value)):
                outcomes[rank] = body(rank)
        except FolderInUse as err:
            outcomes[rank] = str(err)

    processes = [threading.Thread(target=process, args=(rank,)) for rank in (0, 1)]
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    return outcomes


def test_every_process_of_a_launch_stops_on_the_main_ones_refusal(tmp_path):
    """Under `accelerate launch --num_processes 2` --out was not held at all (the main process alone could hold it,
    and the others would not have seen its refusal): two launches into one --out measured cells together."""
    with only_writer(tmp_path, "--out"):  # the other launch's hold
        outcomes = _launch(tmp_path, lambda rank: "ran")
    assert outcomes[0] == outcomes[1]
    assert outcomes[0].startswith(f"--out {tmp_path}: another run is writing there now")

    def held(rank: int) -> bool | None:  # while the main process runs, another run is refused
        if rank == 1:
            return None
        try:
            with only_writer(tmp_path, "--out"):
                return False
        except FolderInUse:
            return True

    assert _launch(tmp_path, held) == [True, None]


def test_a_launch_of_several_processes_is_refused_while_another_writes_its_out(model, tmp_path, capsys,
                                                                              monkeypatch):
    """The main process of `accelerate launch --num_processes 2 ... eval acceptance` into an --out another run
    writes: refused in one line (here one process stands for the launch, its broadcast handing back its own
    outcome)."""
    import specdec.eval.cli as eval_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(eval_cli, "_from_main", lambda value: value, raising=False)
    monkeypatch.setattr(eval_cli, "_acceptance_held", lambda *a, **k: pytest.fail("the refused run ran"))
    out = tmp_path / "run"
    out.mkdir()
    with only_writer(out, "--out"):
        code, captured = run_main(["eval", "acceptance", "--model", model, "--categories", "qa", "--prompts", "1",
                                   "--drafters", "ngram", "--max-new-tokens", "2", "--no-hf-baseline", "--no-plots",
                                   "--out", str(out)], capsys)
    assert code == 2 and captured.err.count("\n") == 1 and "another run is writing there now" in captured.err
    assert list(out.iterdir()) == []


def test_a_file_system_without_flock_holds_nothing_and_refuses_nothing(tmp_path, monkeypatch, caplog):
    """flock failing with ENOSYS (Lustre mounted without flock, some network mounts) refused every run with a bare
    "[Errno 38] Function not implemented"; there the folder is simply not held."""
    import errno

    from specdec import folder_lock

    def no_flock(fd, how):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_flock)
    with caplog.at_level("DEBUG", logger="specdec.folder_lock"), only_writer(tmp_path, "--out") as held:
        assert held is False
    assert "not held (Function not implemented)" in caplog.text
