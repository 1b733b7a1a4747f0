"""Packaging: the four repo folders install as specdec.* and never import as top-level packages; each extra installs
what its commands import (README's "What each command needs" table, checked statically and by running commands with
only that extra importable)."""
from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["drafters", "kernels", "train", "eval"]
# SPECDEC_TEST_INSTALLED=1 (docs/getting-started.md) runs the suite against an installed copy, not this checkout's
# editable install: the tests of that install's own layout do not apply
CHECKOUT_ONLY = pytest.mark.skipif(os.environ.get("SPECDEC_TEST_INSTALLED") == "1",
                                   reason="tests this checkout's editable install; the installed copy is tested")


@CHECKOUT_ONLY
@pytest.mark.parametrize("name", SUBPACKAGES)
def test_subpackage_installs_under_specdec(name):
    mod = importlib.import_module(f"specdec.{name}")
    assert Path(mod.__file__).resolve() == REPO / name / "__init__.py"


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_bare_import_never_resolves_into_repo(name):
    # run from the repo root, where '' (the cwd) is first on sys.path: the worst case
    code = f"import {name}; f = getattr({name}, '__file__', None); print(f); f is None and {name}.anything"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if proc.returncode == 0:  # something else named `name` may exist, but never our folder
        assert not Path(proc.stdout.strip()).resolve().is_relative_to(REPO / name), proc.stdout
    else:  # our folder answered with the inert stand-in: no file, every attribute names the real package
        assert proc.stdout.strip() == "None", proc.stdout
        assert f"import specdec.{name} instead" in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_a_bare_import_from_the_repo_root_finds_an_installed_package_of_that_name(name, tmp_path):
    # transformers >= 5.25 requires the Hugging Face `kernels` package and imports from it at its own import
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("from .part import VALUE\n")
    (tmp_path / name / "part.py").write_text("VALUE = 7\n")
    code = f"import {name}; print({name}.__file__); print({name}.VALUE)"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # after the working directory (the repo root) on sys.path
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [str(tmp_path / name / "__init__.py"), "7"]


def test_transformers_imports_from_the_repo_root():
    # transformers probes for a top-level `kernels` (the HF kernels hub) and imports what it finds
    code = "from transformers import LlamaConfig, LlamaForCausalLM; import specdec; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_console_script_declared():
    import tomllib

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["specdec"] == "specdec.cli:main"
    assert set(meta["tool"]["setuptools"]["package-dir"]) == {f"specdec.{n}" for n in SUBPACKAGES}


def test_the_transformers_floor_is_the_one_specdec_checks():
    """pyproject allowed transformers 4.56, under which a checkpoint missing a tensor loaded with random weights and
    the embedded model ran with another RoPE base; the floor pip installs and the one load_model refuses below are
    one number."""
    import tomllib

    from specdec.models.installed_versions import OLDEST

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("transformers")] == [f"transformers>={OLDEST}"]


def test_the_torch_floor_is_the_one_specdec_checks():
    """pyproject allowed torch 2.4, on which transformers runs no model; the floor pip installs and the one
    load_model refuses below are one number."""
    import tomllib

    from specdec.models.installed_versions import OLDEST_TORCH

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("torch")] == [f"torch>={OLDEST_TORCH}"]


def test_the_version_is_the_one_the_metadata_gives():
    """`specdec --version` says specdec.__version__, the wheel's metadata pyproject's version: written in both, a
    release that bumped one would say another version than the one installed."""
    import tomllib

    import specdec

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == specdec.__version__


def test_every_folder_of_the_packages_is_listed_and_holds_python_alone():
    """The wheel holds only the packages pyproject lists, and their .py files (no package data is declared), while an
    editable install, which every test runs against, finds any folder and file: a new subpackage folder or a JSON
    file read at run time would pass the suite and be missing from the installed wheel."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = {"specdec": REPO / "specdec", **{name: REPO / d for name, d in setuptools["package-dir"].items()}}
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    # in a checkout its tracked files (not an editor's backups); in an unpacked sdist every file
    files = ([REPO / f for f in tracked.stdout.split("\0") if f] if tracked.returncode == 0
             else [p for p in REPO.rglob("*") if "__pycache__" not in p.parts])
    folders, other_files = set(), []
    for name, root in roots.items():
        for path in files:
            if not path.is_relative_to(root) or not path.is_file():
                continue
            parts = path.parent.relative_to(root).parts
            if parts and ".".join((name, *parts)) in roots:  # a package mapped to a folder of its own
                continue
            folders.add(".".join((name, *parts)))
            if path.suffix != ".py":
                other_files.append(str(path.relative_to(REPO)))
    assert folders == set(setuptools["packages"]), "pyproject's [tool.setuptools] packages != the package folders"
    assert not other_files, f"files the wheel leaves out (declare them as package data): {other_files}"


def test_sdist_holds_every_tracked_file_and_the_license(tmp_path):
    """A packager runs the tests from the sdist: it must hold what they read (conftest, helpers, docs, benchmark
    scripts), and the license file the metadata names."""
    import tarfile

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = [f for f in tracked.stdout.split("\0") if f and (REPO / f).is_file()]
    src = tmp_path / "src"
    for f in files:  # a copy of the checkout, so that the build's egg-info is not written into it
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes((REPO / f).read_bytes())
    code = f"import setuptools.build_meta as b; print(b.build_sdist({str(tmp_path / 'dist')!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with tarfile.open(tmp_path / "dist" / proc.stdout.split()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        pkg_info = sdist.extractfile(next(n for n in sdist.getnames() if n.count("/") == 1
                                          and n.endswith("/PKG-INFO"))).read().decode()
    missing = sorted(set(files) - names - {".gitignore"})
    assert not missing, f"tracked files missing from the sdist: {missing[:20]}"
    assert "License-File: LICENSE" in pkg_info and "Apache License" in (REPO / "LICENSE").read_text()


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_bare_name_not_on_test_path(name):
    import importlib.util

    # our folder, not the repository: a virtual environment made inside the checkout (.venv) holds transformers'
    # own `kernels` package (the two tests failed on every such checkout)
    spec = importlib.util.find_spec(name)
    assert spec is None or not Path(spec.origin or "").resolve().is_relative_to(REPO / name), spec


def test_core_imports_need_only_core_dependencies():
    """`import specdec` and the CLI must not need an optional extra (the README's first command installs only the
    gguf extra): every module-level import of the specdec modules they load is stdlib, specdec, or a package in
    the closure of the core dependencies."""
    import ast
    import re

    import tomllib

    code = ("import sys, specdec, specdec.cli, specdec.drafters.medusa, specdec.drafters.draft_model; "
            "print(' '.join(m.__file__ for n, m in sys.modules.items() if n.startswith('specdec') and m.__file__))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=REPO.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {}  # top-level module -> a specdec file importing it at module level
    for path in proc.stdout.split():
        for node in ast.parse(Path(path).read_text()).body:  # module level only: lazy imports are allowed
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for n in names:
                imported.setdefault(n.split(".")[0], Path(path).name)
    third_party = {m: f for m, f in imported.items() if m not in sys.stdlib_module_names and m != "specdec"}

    def name(req: str) -> str:
        return re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")

    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    allowed, todo = set(), [name(r) for r in core]
    while todo:  # the closure of the core dependencies, without their extras
        dist = todo.pop()
        if dist not in allowed:
            allowed.add(dist)
            try:
                todo += [name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r]
            except metadata.PackageNotFoundError:
                pass
    owners = metadata.packages_distributions()
    outside = {m: f for m, f in third_party.items()
               if not {d.lower().replace("_", "-") for d in owners.get(m, [m])} & allowed}
    assert third_party and not outside, f"module-level imports of non-core packages (module: file): {outside}"


# ---- each extra installs what its commands import -----------------------------------------------------------------
# README's table "What each command needs" says which extra each command needs; these tests check every third-party
# module the command can import (statically: every import reachable from its handler's module, lazy ones included,
# and dynamically: the command run in a subprocess where only the packages of that extra can be imported) is
# installed by that extra. Fresh virtual environments per extra cannot be built offline, so the installed
# distributions' metadata stands for what pip would install.
EXTRAS_HEADING = "### What each command needs"
_SPECDEC_ENTRY = re.compile(r"specdec(\.\w+)+:\w+")  # "specdec.drafters.ngram:NGramDrafter": a lazy import by name


def _dist_name(req: str) -> str:
    return re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")


def _requirements(pyproject: dict, extra: str) -> list[str]:
    project = pyproject["project"]
    if extra == "core":
        return list(project["dependencies"])
    return list(project["dependencies"]) + list(project["optional-dependencies"][extra])


def _allowed(requirements: list[str]) -> set[str]:
    """The distributions those requirements install: their closure through installed metadata, without extras."""

    allowed, todo = set(), [_dist_name(r) for r in requirements]
    while todo:
        dist = todo.pop()
        if dist not in allowed:
            allowed.add(dist)
            try:
                todo += [_dist_name(r) for r in metadata.requires(dist) or [] if "extra ==" not in r]
            except metadata.PackageNotFoundError:
                pass
    return allowed


def _owners(module: str) -> set[str]:

    if not hasattr(_owners, "table"):
        _owners.table = metadata.packages_distributions()
    return {d.lower().replace("_", "-") for d in _owners.table.get(module, [module])}


def _command_extras() -> dict[str, str]:
    """README's table: command (e.g. "eval acceptance") -> extra ("core" for the base install); first row wins."""
    text = (REPO / "README.md").read_text()
    assert EXTRAS_HEADING in text, f"README.md lost its {EXTRAS_HEADING!r} table"
    section = text.split(EXTRAS_HEADING, 1)[1].split("\n#", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`specdec"):
            continue
        extra = re.search(r"specdec\[(\w+)\]", cells[1])
        for command in re.findall(r"`specdec ([a-z][a-z -]*?)`", cells[0]):
            table.setdefault(command, extra.group(1) if extra else "core")
    return table


def _leaf_parsers() -> dict:
    """Every leaf command of `specdec` (e.g. "eval replay record") -> its parser."""
    import argparse

    from specdec import cli

    parser = argparse.ArgumentParser(prog="specdec")
    sub = parser.add_subparsers(dest="command")
    cli._add_generate(sub)
    for name in cli.SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    cli._verbose_everywhere(parser)
    out = {}

    def walk(p, prefix):
        actions = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            out[prefix] = p
        for a in actions:
            for name, child in a.choices.items():
                walk(child, f"{prefix} {name}".strip())

    walk(parser, "")
    return out


def _cli_commands() -> dict[str, str]:
    """Every leaf command of `specdec` -> the module of the function that runs it."""
    return {command: p.get_default("func").__module__ for command, p in _leaf_parsers().items()}


def _synopses() -> list[tuple[str, str, str]]:
    """(page, command, its synopsis text) for every `specdec ...` line (and its indented continuation lines) in a
    ```text or ```bash block of the README and the docs pages."""
    out = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```(?:text|bash)\n(.*?)```", page.read_text(), flags=re.S):
            for entry in re.split(r"\n(?=\S)|&&|;", block):
                words = re.match(r"\s*specdec((?: [a-z][a-z-]*)+)", entry)
                if words:
                    out.append((page.name, words.group(1).strip(), entry))
    return out


def test_every_option_a_synopsis_shows_exists():
    """The README's and docs' synopses are written by hand: each option they show must be one the command takes, so
    a renamed or removed option cannot linger there."""
    parsers = _leaf_parsers()
    checked = 0
    for page, words, text in _synopses():
        command = next((c for c in sorted(parsers, key=len, reverse=True) if (words + " ").startswith(c + " ")), None)
        if command is None:  # "specdec eval replay ...": a group of commands, not one
            continue
        options = {o for a in parsers[command]._actions for o in a.option_strings}
        for option in re.findall(r"(?<![\w-])--?[a-z][a-z-]*", re.sub(r"#.*", "", text)):
            assert option in options, f"{page}: the synopsis of specdec {command} shows {option}, not an option of it"
            checked += 1
    assert checked > 40  # the synopses were found


def test_help_says_each_default_once_and_never_none():
    """argparse's defaults formatter appended "(default: None)" to options whose help says what their absence means
    ("(default: all) (default: None)"), and "(default: False)" to flags (train-medusa's, export-head's): every
    option's help names its default at most once, never as None, and a flag's never."""
    for command, parser in _leaf_parsers().items():
        for action in parser._actions:
            text = " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""
            assert "(default: None)" not in text, f"specdec {command} {action.option_strings}: {text}"
            assert "(default: False)" not in text, f"specdec {command} {action.option_strings}: {text}"
            assert text.count("(default:") <= 1, f"specdec {command} {action.option_strings}: {text}"


def _extra_of(command: str, table: dict[str, str]) -> str:
    prefixes = [c for c in table if command == c or command.startswith(c + " ")]
    assert prefixes, f"README.md's {EXTRAS_HEADING!r} table does not list `specdec {command}`"
    return table[max(prefixes, key=len)]


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def _imports_of(path: Path, package: str, module_level_only: bool) -> list[str]:
    """Modules `path` imports, unguarded (not under try/except ImportError, not under TYPE_CHECKING); with
    module_level_only, only what runs at import time (function bodies skipped)."""
    out: list[str] = []

    def visit(node, guarded):
        if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, guarded)
            return
        if isinstance(node, ast.Try):
            optional = any(_catches_import_error(h) for h in node.handlers)
            for child in node.body:
                visit(child, guarded or optional)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, guarded)
            return
        if not guarded:
            if isinstance(node, ast.Import):
                out.extend(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                out.append(base)
                out.extend(f"{base}.{a.name}" for a in node.names)  # maybe submodules
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _SPECDEC_ENTRY.fullmatch(
                    node.value) and not module_level_only:
                out.append(node.value.split(":")[0])
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(path.read_text()), False)
    return out


def _third_party_imports(roots: list[str], module_level_only: bool) -> dict[str, str]:
    """Top-level third-party modules reachable from the specdec modules `roots` -> a specdec file importing it."""
    import importlib.util

    seen, todo, found = set(), list(roots), {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # "specdec.x.attr": an attribute, not a module
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        package = name if spec.submodule_search_locations else name.rpartition(".")[0]
        for imported in _imports_of(Path(spec.origin), package, module_level_only):
            top = imported.split(".")[0]
            if top == "specdec":
                todo.append(imported)
            elif top and top not in sys.stdlib_module_names:
                found.setdefault(top, Path(spec.origin).name)
    return found


# Imported only when installed: specdec.kernels.dispatch picks the Triton backend only when
# importlib.util.find_spec("triton") finds it (the kernels extra), a run-time guard the static walk cannot see;
# the dynamic tests below run every command with triton unimportable. gguf (the gguf extra) is imported only to
# convert a .gguf model, whose tokenizer transformers' own GGUF loading (which needs gguf) reads first; without it
# specdec.models.gguf_llama gives None.
OPTIONAL_WHEN_INSTALLED = {"triton", "gguf"}


def _outside(third_party: dict[str, str], allowed: set[str]) -> dict[str, str]:
    return {m: f for m, f in third_party.items() if m not in OPTIONAL_WHEN_INSTALLED and not _owners(m) & allowed}


def test_triton_is_only_imported_when_installed():
    source = (REPO / "kernels" / "dispatch.py").read_text()
    assert 'find_spec("triton")' in source and "triton_available()" in source


def test_gguf_is_only_imported_when_installed(monkeypatch, tmp_path):
    from specdec.models import gguf_llama

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    assert gguf_llama.read_llama(tmp_path / "model.gguf") is None


def test_readme_names_an_extra_for_every_command():
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    table = _command_extras()
    assert set(table.values()) <= extras | {"core"}, table
    commands = _cli_commands()
    assert {"generate", "convert-medusa", "train-medusa", "eval acceptance", "eval replay run"} <= set(commands)
    for command in commands:
        _extra_of(command, table)  # listed


def test_every_command_imports_only_what_its_extra_installs():
    """Statically, lazy imports included: everything a command's handler module can reach."""
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    table = _command_extras()
    problems = {}
    for command, module in _cli_commands().items():
        extra = _extra_of(command, table)
        outside = _outside(_third_party_imports([module], False), _allowed(_requirements(pyproject, extra)))
        if outside:
            problems[f"specdec {command} [{extra}]"] = outside
    assert not problems, f"commands import packages their extra does not install (module: importing file): {problems}"


def test_the_static_check_catches_a_missing_package():
    """The check above can fail: with the eval extra as it was before accelerate joined it, eval acceptance
    (accelerate's PartialState shards its prompts) is caught."""
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pyproject["project"]["optional-dependencies"]["eval"] = [
        r for r in pyproject["project"]["optional-dependencies"]["eval"] if _dist_name(r) != "accelerate"]
    module = _cli_commands()["eval acceptance"]
    outside = _outside(_third_party_imports([module], False), _allowed(_requirements(pyproject, "eval")))
    assert "accelerate" in outside, outside


def test_every_command_module_imports_no_third_party_package_at_load():
    """`specdec` imports every subcommand's module at start-up, for every call (--help and argument mistakes too):
    at import time they import the standard library and specdec alone (torch took ~2 s of each call); each command
    imports its work when it runs."""
    from specdec import cli

    assert "torch" in _third_party_imports(["specdec.drafters.export_head"], True)  # the walk sees module imports
    found = _third_party_imports(["specdec.cli", *cli.SUBCOMMAND_MODULES], True)
    assert not found, found


# Run in a fresh interpreter: every import system finder is wrapped so that a module whose distributions are not
# installed by the extra is not found (importlib.util.find_spec answers None, `import` raises ModuleNotFoundError),
# as if the extra were installed alone; transformers' availability probes then see the same thing.
_BLOCKER = r"""
import contextlib, io, json, sys, importlib.util

blocked = set(json.loads(sys.argv[1]))


class _ExtraOnly:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def __getattr__(self, attr):  # find_distributions, invalidate_caches...
        return getattr(self._finder, attr)


sys.meta_path[:] = [_ExtraOnly(f) for f in sys.meta_path]
probe = json.loads(sys.argv[3])
if probe:
    assert importlib.util.find_spec(probe) is None, probe
    try:
        __import__(probe)
        raise SystemExit(f"{probe} imported although blocked")
    except ModuleNotFoundError:
        pass
from specdec.cli import main

for argv in json.loads(sys.argv[2]):
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(argv)
    except SystemExit as exit:
        code = exit.code
    if code:
        raise SystemExit(f"specdec {' '.join(argv)} exited with {code}: {out.getvalue()[-2000:]}")
    print("ok", " ".join(argv[:2]))
"""


def _run_under_extra(extra: str, argvs: list[list[str]], cwd: Path) -> subprocess.CompletedProcess:
    import json

    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    allowed = _allowed(_requirements(pyproject, extra))

    blocked = sorted(m for m, dists in metadata.packages_distributions().items()
                     if m not in sys.stdlib_module_names and m != "specdec"
                     and not {d.lower().replace("_", "-") for d in dists} & allowed)
    probe = next((m for m in ("accelerate", "scipy", "datasets", "matplotlib") if m in blocked), "")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", _BLOCKER, json.dumps(blocked), json.dumps(argvs), json.dumps(probe)],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def _help_argvs(extra: str) -> list[list[str]]:
    table = _command_extras()
    return [[*c.split(), "--help"] for c in _cli_commands() if _extra_of(c, table) == extra]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from specdec.testing import save_tiny_checkpoint

    return Path(save_tiny_checkpoint(tmp_path_factory.mktemp("pkg") / "tiny"))


@pytest.mark.parametrize("extra", ["core", "train", "eval"])
def test_commands_import_with_their_extra_alone(extra, tmp_path):
    """`specdec` starts (importing every subcommand's module) and shows each command's --help with only the
    packages of that extra importable."""
    argvs = _help_argvs(extra)
    proc = _run_under_extra(extra, argvs, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == len(argvs) > 0


@pytest.mark.slow
def test_core_commands_run_with_the_core_dependencies_alone(tiny_checkpoint, tmp_path):
    """`specdec generate` on a checkpoint directory and `specdec convert-medusa`, run (not only imported) with
    every package outside the core dependencies unimportable."""
    import torch

    state = {"0.0.linear.weight": torch.zeros(64, 64), "0.0.linear.bias": torch.zeros(64),
             "0.1.weight": torch.zeros(96, 64)}
    (tmp_path / "published").mkdir()
    torch.save(state, tmp_path / "published" / "medusa_lm_head.pt")
    (tmp_path / "published" / "config.json").write_text(
        '{"medusa_num_heads": 1, "medusa_num_layers": 1, "base_model_name_or_path": "a/b"}')
    argvs = [
        ["generate", "--model", str(tiny_checkpoint), "--no-chat-template", "--max-new-tokens", "3",
         "--drafter", "ngram", "abc abc"],
        ["convert-medusa", str(tmp_path / "published"), "--output-dir", str(tmp_path / "converted")],
    ]
    proc = _run_under_extra("core", argvs, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok") == len(argvs) and (tmp_path / "converted" / "config.json").is_file()


@pytest.mark.slow
def test_eval_acceptance_runs_with_the_eval_extra_alone(tiny_checkpoint, tmp_path):
    argv = ["eval", "acceptance", "--model", str(tiny_checkpoint), "--drafters", "ngram", "--categories", "chat",
            "--prompts", "1", "--max-new-tokens", "4", "--calibration-repeats", "0", "--no-hf-baseline",
            "--no-plots", "--out", str(tmp_path / "acc")]
    proc = _run_under_extra("eval", [argv], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "acc" / "report.json").is_file()


@CHECKOUT_ONLY
def test_the_suite_refuses_to_run_another_checkouts_code(tmp_path, request):
    """Run from a second checkout (a git worktree), an editable install made in the first maps specdec's subpackages
    there: the tests ran the other checkout's drafters, kernels, training and eval. conftest refuses such a run."""
    conftest = next(p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "foreign_packages"))
    REPO, foreign_packages = conftest.REPO, conftest.foreign_packages
    assert foreign_packages(REPO) == []
    elsewhere = foreign_packages(tmp_path, names=("specdec", "specdec.drafters"))
    assert [line.split(" from ")[0] for line in elsewhere] == ["specdec", "specdec.drafters"]
    assert str(REPO) in elsewhere[1]
