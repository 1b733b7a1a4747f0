"""The commands and calls the documentation shows are ones the code takes: every ``--flag`` after ``specdec
<command>`` (code blocks, indented blocks, inline code; README and docs/, not the reports scripts write) is an option
of that command's parser, a value given to an option with choices (``--dtype bfloat16``, ``--format
speculators|sglang|vllm``) is one of them, every ``--drafter-option KEY=VALUE`` is an option of its drafter; the
same for ``python benchmarks/X.py`` and the modules run with ``python -m``; and every keyword of a ``generate()`` call
in a Python block is a parameter of ``specdec.generate`` or a field of ``specdec.GenerationConfig``, its
``drafter_options`` options of the named drafter. Every ```bash block is a command a reader can run from the repo
root (docs/doc_commands.py: a program, a file or module of the repo; no prose, no script that is not in the repo),
its ``specdec`` commands ones the CLI has. Static (no model runs): about a second."""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import shlex
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.script_loading import load_file, load_script

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

COMMAND = re.compile(r"\bspecdec(?:\.cli)?((?: (?:generate|train-medusa|train-eagle|eval|lossless|acceptance|replay"
                     r"|record|run|bound|convert-medusa|export-head)(?=\s|$))+)(.*)")
SCRIPT = re.compile(r"\bpython3? (?:-P )?(?:(benchmarks/\w+)\.py|-m (specdec\.kernels\.compile_check))\b(.*)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*$|^<.*>$|^\$")  # F, DIR, <layer>, $OUT: a value the reader fills in
BASH_BLOCK = re.compile(r"^([ \t]*)```(?:bash|sh|shell)[ \t]*\n(.*?)^\1```", re.S | re.M)  # a list item's too


def pages() -> list[Path]:
    """README and the docs pages people read (not the run reports under docs/gpu/RUN/ or docs/eval/)."""
    found = [REPO / "README.md"]
    for page in sorted(DOCS.rglob("*.md")):
        parts = page.relative_to(DOCS).parts
        if parts[0] in ("eval", "results") or (parts[0] == "gpu" and len(parts) > 2):
            continue
        found.append(page)
    return found


def segments(line: str) -> list[str]:
    """The parts of ``line`` that can each hold one command: inline code spans and shell commands apart, comments
    cut."""
    return [part.split(" #")[0] for part in re.split(r"`|&&|;|\|\|", line)]


def words(text: str) -> list[str]:
    """``text`` split as a shell would, a synopsis' brackets and braces dropped (``[--top-k K]`` -> ``--top-k``,
    ``K``; ``{greedy|coupled}`` -> ``greedy|coupled``), not those of a JSON value."""
    try:
        split = shlex.split(text)
    except ValueError:  # an unbalanced quote of a synopsis: split on blanks
        split = text.split()
    out = []
    for word in split:
        word = word.lstrip("[") if word.startswith("[-") else word
        word = word.rstrip("]") if not re.search(r"[\[{]", word) else word
        word = word.strip("{}") if re.fullmatch(r"\{[\w|-]+\}", word) else word
        if word:
            out.append(word)
    return out


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> dict[str, argparse.ArgumentParser]:
    found = {prefix: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_subcommands(sub, f"{prefix} {name}"))
    return found


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _grab(self, *args, **kwargs):
    raise _Parsed(self)


def script_parser(name: str) -> argparse.ArgumentParser:
    """The parser a benchmark script or ``python -m`` module builds, caught as its main() parses (nothing runs)."""
    if name.startswith("benchmarks/"):
        module = load_script(name.removeprefix("benchmarks/"), "_doc_examples")
    else:
        module = __import__(name, fromlist=["main"])
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _grab), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", _grab):
        try:
            if hasattr(module, "parse_args"):
                module.parse_args([])
            elif "argv" in inspect.signature(module.main).parameters:
                module.main([])
            else:
                module.main()
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError(f"{name} parsed no arguments")


def flag_problems(argv: list[str], parser: argparse.ArgumentParser, command: str) -> list[str]:
    """What is wrong with the words ``argv`` given to ``parser``: an option it does not have, a value outside an
    option's choices (each of ``a|b`` alternatives), a drafter option the drafter does not take."""
    from specdec.drafters.registry import check_options

    options = {s: a for a in parser._actions for s in a.option_strings}
    problems, drafter, drafters = [], None, {}
    for i, word in enumerate(argv):
        flag, _, inline = word.partition("=")
        if not FLAG.fullmatch(flag):
            continue
        if flag not in options:
            problems.append(f"{command}: no option {flag}")
            continue
        action = options[flag]
        value = inline or (argv[i + 1] if i + 1 < len(argv) and action.nargs != 0 else "")
        if action.choices and value and not PLACEHOLDER.match(value):
            bad = [v for v in value.split("|") if v and v not in action.choices and not PLACEHOLDER.match(v)]
            problems += [f"{command}: {flag} {v!r} is not one of {sorted(action.choices)}" for v in bad]
        if flag == "--drafter" and value:
            drafter = value
        if flag == "--drafters" and value:
            drafters = dict(d.split("=", 1) if "=" in d else (d, d) for d in value.split(","))
        if flag == "--drafter-option" and "=" in value:
            key, _, raw = value.partition("=")
            label, _, key = key.rpartition(".")
            name = drafters.get(label, label) if drafters else drafter
            if name is None or PLACEHOLDER.match(name) or "|" in name:
                continue
            from specdec.cli import _json_or_text

            try:
                check_options(name, {key: _json_or_text(raw)}, command_line=True)
            except (ValueError, TypeError) as err:
                problems.append(f"{command}: --drafter-option {value}: {err}")
    return problems


def command_problems() -> list[str]:
    from specdec.cli import _parser

    parsers, logical_lines = _subcommands(_parser(), "specdec"), doc_commands().logical_lines
    scripts: dict[str, argparse.ArgumentParser] = {}
    problems = []
    for page in pages():
        where = page.relative_to(REPO)
        for n, line in logical_lines(page.read_text()):
            for segment in segments(line):
                if m := COMMAND.search(segment):
                    command = "specdec"
                    for word in m.group(1).split():
                        if f"{command} {word}" not in parsers:
                            break
                        command = f"{command} {word}"
                    if command == "specdec":  # "specdec run ...": a word, no command
                        continue
                    problems += [f"{where}:{n}: {p}" for p in flag_problems(words(m.group(2)), parsers[command],
                                                                            command)]
                if m := SCRIPT.search(segment):
                    name = m.group(1) or m.group(2)
                    if name not in scripts:
                        scripts[name] = script_parser(name)
                    problems += [f"{where}:{n}: {p}" for p in flag_problems(words(m.group(3)), scripts[name], name)]
    return problems


def doc_commands():
    """docs/doc_commands.py (docs/ is no package): what a runnable command of the docs is."""
    return load_file(DOCS / "doc_commands.py")


def bash_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the fence, body) of every ```bash block of ``text``."""
    return [(text[:m.start()].count("\n") + 1, m.group(2)) for m in BASH_BLOCK.finditer(text)]


def bash_block_problems() -> list[str]:
    """Why a ```bash block of the docs is no command a reader can run: what docs/doc_commands.py finds (prose, a
    script or module not in the repo, a synopsis), and a ``specdec`` command the CLI does not have."""
    from specdec.cli import _parser

    parsers, rule = _subcommands(_parser(), "specdec"), doc_commands()
    problems = []
    for page in pages():
        for start, block in bash_blocks(page.read_text()):
            commands, found = rule.parse(block)
            for words in (w for w in commands if w[0] == "specdec"):
                command = "specdec"
                for word in words[1:]:
                    subs = sorted(name.rpartition(" ")[2] for name in parsers if name.rpartition(" ")[0] == command)
                    if not subs or word.startswith("-"):
                        break
                    if f"{command} {word}" not in parsers:
                        found.append(f"{command} has no command {word!r} (it has: {', '.join(subs)})")
                        break
                    command += f" {word}"
            problems += [f"{page.relative_to(REPO)}:{start}: {p}" for p in found]
    return problems


def _python_blocks(text: str) -> list[tuple[int, str]]:
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def generate_call_problems() -> list[str]:
    """Keywords of the ``generate(...)`` calls of the Python blocks that generate() does not take."""
    from specdec.drafters.registry import check_options

    import specdec
    from specdec.generate import generate

    known = {p.name for p in inspect.signature(generate).parameters.values() if p.kind is p.KEYWORD_ONLY or
             p.kind is p.POSITIONAL_OR_KEYWORD} | {f.name for f in dataclasses.fields(specdec.GenerationConfig)}
    problems = []
    for page in pages():
        for start, block in _python_blocks(page.read_text()):
            where = f"{page.relative_to(REPO)}:{start}"
            tree = ast.parse(block)  # a block that is no Python is a problem of its own
            for call in (c for c in ast.walk(tree) if isinstance(c, ast.Call)):
                if getattr(call.func, "attr", getattr(call.func, "id", None)) != "generate":
                    continue
                keywords = {k.arg: k.value for k in call.keywords if k.arg}
                problems += [f"{where}: generate() has no keyword {k!r}" for k in sorted(set(keywords) - known)]
                drafter, options = keywords.get("drafter"), keywords.get("drafter_options")
                if isinstance(drafter, ast.Constant) and isinstance(options, ast.Dict):
                    try:
                        check_options(drafter.value, ast.literal_eval(options))
                    except (ValueError, TypeError) as err:
                        problems.append(f"{where}: {err}")
    return problems


def test_every_command_the_docs_show_takes_its_flags_and_drafter_options():
    problems = command_problems()
    assert not problems, "commands in the docs that their parsers refuse:\n" + "\n".join(problems)


def test_every_bash_block_in_the_docs_is_a_command_a_reader_can_run():
    problems = bash_block_problems()
    assert not problems, "bash blocks in the docs that are no command to run from the repo root:\n" + \
        "\n".join(problems)


def test_every_generate_call_in_the_docs_uses_generates_keywords():
    problems = generate_call_problems()
    assert not problems, "generate() calls in the docs with keywords it does not take:\n" + "\n".join(problems)


@pytest.fixture
def page(tmp_path, monkeypatch):
    """A README.md of the test's own in an empty repo root: the only page the docs checks read."""
    page = tmp_path / "README.md"
    monkeypatch.setattr(sys.modules[__name__], "pages", lambda: [page])
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    return page


@pytest.mark.parametrize("line, problem", [
    ("specdec generate --drafter ngram --max-new-token 64 \"hi\"", "specdec generate: no option --max-new-token"),
    ("`specdec eval acceptance --drafters ngram --prompt 3`", "specdec eval acceptance: no option --prompt"),
    ("specdec generate [--dtype float32|bf16]", "--dtype 'bf16' is not one of"),
    ("specdec export-head SRC --format vllm2 --output-dir DIR", "--format 'vllm2' is not one of"),
    ("specdec generate --drafter ngram --drafter-option max_ngrams=4", "has no --drafter-option 'max_ngrams'"),
    ("specdec eval acceptance --drafters a=eagle,ngram --drafter-option a.paths=x", "has no --drafter-option 'paths'"),
    ("accelerate launch -m specdec.cli train-medusa --output-dir h --num-head 2", "no option --num-head"),
    ("python benchmarks/bench_plain_cpu.py --prompt 2", "benchmarks/bench_plain_cpu: no option --prompt"),
])
def test_a_doc_naming_a_flag_or_option_that_does_not_exist_is_caught(page, line, problem):
    page.write_text(f"Text.\n\n```bash\n{line}\n```\n")
    problems = command_problems()
    assert len(problems) == 1 and problem in problems[0], problems
    page.write_text("`specdec generate` takes `--seed S`: `specdec generate --dtype bfloat16 --drafter ngram` "
                    "and `specdec eval lossless [--drafter NAME] [--device auto|cpu|cuda]`.\n")
    assert command_problems() == []


def test_a_generate_call_with_a_keyword_generate_does_not_take_is_caught(page):
    page.write_text('```python\nout = specdec.generate(model, ids, drafter="ngram", max_tokens=8,\n'
                    '                       drafter_options={"max_ngram": 4, "nodes": 3})\n```\n')
    problems = generate_call_problems()
    assert len(problems) == 2 and "no keyword 'max_tokens'" in problems[0] and "'nodes'" in problems[1], problems


@pytest.mark.parametrize("block, problem", [
    ("python eagle_batch.py 3 ['{\"depth\": 3}']: generate() at batch 8, the per-sequence drafter (db76367)",
     "eagle_batch.py is not a file of the repo"),
    ("python benchmarks/bench_policy_host.py, run by the interpreter of a checkout (before), twice",
     "benchmarks/bench_policy_host.py, is not a file of the repo"),
    ("python benchmarks/bench_drafters_cpu.py --grid --lengths 16 ; the same with --lengths 128",
     "'the' is not a program"),
    ("python benchmarks/bench_invariant_cpu.py --setting greedy (and --setting coupled)", "'(' outside quotes"),
    ("the cost model's calibration, context 128", "No closing quotation"),
    ("python benchmarks/no_such_bench.py --prompts 2", "benchmarks/no_such_bench.py is not a file of the repo"),
    ("python -m specdec.no_such_module", "python -m specdec.no_such_module: no such module"),
    ("specdec eval losless --drafter ngram", "specdec eval has no command 'losless'"),
    ("specdec eval lossless [--model M] [--drafter NAME]", "a synopsis"),
])
def test_a_bash_block_that_is_no_runnable_command_is_caught(page, block, problem):
    page.write_text(f"Text.\n\n1. A step:\n\n    ```bash\n    {block}\n    ```\n")
    problems = bash_block_problems()
    assert len(problems) >= 1 and problem in problems[0] and problems[0].startswith("README.md:5: "), problems
    page.write_text(
        "```bash\n"
        "for arch in eagle1 eagle3; do specdec train-eagle --arch $arch --output-dir $arch-smollm2; done\n"
        "SPECDEC_CACHE_DIR=<empty but for the model> /usr/bin/time -v specdec eval replay bound --record run.json\n"
        "python3 -P benchmarks/bench_invariant_cpu.py --setting {greedy|coupled} --eagle-path <layer>  # it's a note\n"
        "python -m specdec.kernels.compile_check && python docs/gen_benchmarks.py --check\n"
        "vllm serve serve/eagle3 --speculative-config '{\"method\": \"eagle3\"}' \\\n"
        "  --tensor-parallel-size 1\n"
        "python -m sglang.launch_server --model-path M; pip install -e '.[dev]' && pytest -n 0\n"
        "```\n\n```text\n" + block + "\n```\n")
    assert bash_block_problems() == []
