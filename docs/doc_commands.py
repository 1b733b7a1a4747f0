"""What a runnable command of the docs is: a ```bash block, and a benchmark result's ``command`` that the benchmarks
page shows as one, holds only commands a reader can copy and run from the repo root.

A line (a trailing backslash continues it) is split as bash splits it: into commands at ``;``, ``&&``, ``||``, ``|``
and ``&``, a word starting with ``#`` ending it (a comment). A command, after its ``NAME=value`` assignments and a
``time`` / ``/usr/bin/time -v`` wrapper, runs one of PROGRAMS; ``python`` / ``python3`` (options such as ``-P``
first) run a file of the repo (``benchmarks/X.py``, ``docs/X.py``) or, with ``-m``, a module of the repo (the
package-dir mapping of pyproject.toml) or one of MODULES; ``for NAME in WORDS`` / ``do`` / ``done`` are bash's loop.
``<...>`` (``<layer>``) and a synopsis' alternatives (``{greedy|coupled}``, ``auto|cpu``) are values the reader fills
in. Anything else is not runnable: a first word that is no program (prose), a file not in the repo, a parenthesis
outside quotes (bash reads a subshell), an unbalanced quote, a synopsis' optional ``[--flag X]`` (a text block).

Whether a command's flags exist is tests/test_doc_examples.py's other check, against the parsers. No imports beyond
the standard library: mkdocs loads this through docs/gen_benchmarks.py.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# programs a reader has: the CLI, the dev tools `pip install -e ".[dev,docs]"` brings, and the serving engines a page
# tells the reader to install (docs/serving-heads.md)
PROGRAMS = frozenset({"specdec", "pip", "pytest", "mkdocs", "vllm"})
MODULES = frozenset({"pip", "pytest", "mkdocs", "sglang.launch_server"})
PYTHONS = frozenset({"python", "python3"})
SEPARATORS = frozenset({";", "&&", "||", "|", "&"})
PLACEHOLDER = re.compile(r"<[^<>\s][^<>]*>|\{[\w|-]+\}")  # <the H200 layer>, {greedy|coupled}
ALTERNATIVE = re.compile(r"(?<=[\w\]])\|(?=[\w\[])")  # --device auto|cpu: a synopsis, not a pipe
OPTIONAL = re.compile(r"(?:^|\s)\[-")  # [--model M]: a synopsis' optional part
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")
PYTHON_FILE = re.compile(r"[\w./-]+\.py\b")


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(number of its first line, text) of every line of ``text``, one ended by a backslash joined to the next."""
    lines, out, n = text.splitlines(), [], 0
    while n < len(lines):
        start, line = n + 1, lines[n]
        while line.rstrip().endswith("\\") and n + 1 < len(lines):
            n += 1
            line = line.rstrip()[:-1] + " " + lines[n].strip()
        out.append((start, line))
        n += 1
    return out


def _package_dirs(root: Path) -> dict[str, str]:
    """pyproject.toml's ``[tool.setuptools.package-dir]`` (read by hand: tomllib is 3.11+, the package takes 3.10)."""
    pyproject = root / "pyproject.toml"
    text = pyproject.read_text() if pyproject.is_file() else ""
    section = re.search(r"^\[tool\.setuptools\.package-dir\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    return dict(re.findall(r'^"([\w.]+)"\s*=\s*"([\w./-]+)"', section.group(1), re.M)) if section else {}


def is_repo_module(name: str, root: Path = REPO) -> bool:
    """``python -m name`` finds ``name`` in the repo: specdec.cli is specdec/cli.py, specdec.kernels.X kernels/X.py."""
    parts = name.split(".")
    for package, folder in sorted(_package_dirs(root).items(), key=lambda kv: -len(kv[0])):
        if parts[:len(package.split("."))] == package.split("."):
            parts = folder.split("/") + parts[len(package.split(".")):]
            break
    path = root.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _cut_comment(line: str) -> str:
    """``line`` without its comment: from a ``#`` that starts a word outside quotes, as bash reads it."""
    quote, escaped = None, False
    for i, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _words(line: str) -> list[str]:
    """``line`` (its comment cut) split as bash splits it, separators and parentheses words of their own."""
    line = ALTERNATIVE.sub(",", PLACEHOLDER.sub("PLACEHOLDER", line))
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split, lexer.commenters = True, ""
    return list(lexer)


def _program(words: list[str], root: Path) -> tuple[list[str], str | None]:
    """The words of one command from its program on ([] for none: bash's loop words, bare assignments), and why the
    command is not runnable (None when it is)."""
    while words and ASSIGNMENT.fullmatch(words[0]):
        words = words[1:]
    if words[:1] == ["for"]:
        return [], None if len(words) >= 3 and words[2] == "in" and words[1].isidentifier() else "a malformed for loop"
    if words[:1] == ["do"]:
        words = words[1:]
    if words[:1] in (["time"], ["/usr/bin/time"]):
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[1:]
    if words in ([], ["done"]):
        return [], None
    program, rest = words[0], words[1:]
    if program in PYTHONS:
        while rest and rest[0].startswith("-") and rest[0] != "-m":
            if rest[0] == "-c":
                return words, "python -c runs no file of the repo"
            rest = rest[1:]
        if not rest:
            return words, f"{program} runs no file"
        if rest[0] == "-m":
            module = rest[1] if len(rest) > 1 else ""
            if module in MODULES or (module and is_repo_module(module, root)):
                return words, None
            return words, f"python -m {module}: no such module in the repo"
        return words, None if (root / rest[0]).is_file() else f"{rest[0]} is not a file of the repo"
    if program not in PROGRAMS:
        return words, f"{program!r} is not a program (one of {', '.join(sorted(PROGRAMS))}, or python with a repo file)"
    return words, None


def parse(text: str, root: Path = REPO) -> tuple[list[list[str]], list[str]]:
    """The commands of ``text`` (a block, or one line), each its words from the program on, and why any of it is not
    runnable from the repo root ([] when all of it is)."""
    commands, found = [], []

    def end(words: list[str]) -> None:
        words, problem = _program(words, root)
        commands.extend([words] if words else [])
        found.extend([problem] if problem else [])

    for _, line in logical_lines(text):
        line = _cut_comment(line)
        if OPTIONAL.search(line):
            found.append(f"{line.strip()[:60]!r}: a synopsis ([--flag] optional), no command: show it in a text block")
            continue
        try:
            words = _words(line)
        except ValueError as err:  # shlex: no closing quotation
            found.append(f"{line.strip()[:60]!r}: {err}")
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in SEPARATORS or set(word) <= set(";&|()"):
                end(command)
                command = []
                if word not in SEPARATORS:
                    found.append(f"{word!r} outside quotes (bash reads a subshell, or fails on it)")
                    break
            else:
                command.append(word)
    return commands, found


def problems(text: str, root: Path = REPO) -> list[str]:
    """Why ``text`` (a block, or one line) is not a runnable command from the repo root; [] when it is."""
    return parse(text, root)[1]


def missing_files(text: str, root: Path = REPO) -> list[str]:
    """The Python files ``text`` names that are neither in the repo nor in benchmarks/ (by their bare name)."""
    return [name for name in dict.fromkeys(PYTHON_FILE.findall(text))
            if not (root / name).is_file() and not (root / "benchmarks" / name).is_file()]
