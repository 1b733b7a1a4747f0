"""``specdec generate`` on a tiny checkpoint: where the prompt comes from, what is printed (text, summary
line, JSON, tau), and that errors meant for the user are one line with exit code 2, never a traceback."""
from __future__ import annotations

import importlib
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import specdec
from specdec.cli import main
from specdec.testing import build_tiny_tokenizer, save_tiny_checkpoint

PROMPT = "the cat sat on the mat, the cat sat on the hat. "
N = 24
SUMMARY = re.compile(
    r"^\[specdec\] (\d+) tokens in [\d.]+s = [\d.]+ tok/s \| tau ([\d.]+) over (\d+) steps \| drafter (\S+)"
)


def expected_text(ckpt: str, prompt: str, n: int = N, **kwargs) -> str:
    loaded = specdec.load_model(ckpt)
    ids = loaded.tokenizer(prompt)["input_ids"]
    out = specdec.generate(loaded, [ids], max_new_tokens=n, return_dict=True, **kwargs)
    return loaded.tokenizer.decode(out.new_tokens[0], skip_special_tokens=True)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["generate", *argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def summary_of(err: str) -> re.Match:
    lines = [line for line in err.splitlines() if line.startswith("[specdec]")]
    assert len(lines) == 1, err
    match = SUMMARY.match(lines[0])
    assert match, lines[0]
    return match


def test_prompt_from_argument_prints_the_text_and_a_summary_line(ckpt, capsys):
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N))
    assert rc == 0
    text = expected_text(ckpt, PROMPT)
    assert text.strip() and out == text + "\n"  # the streamed text is exactly the decoded greedy tokens
    m = summary_of(err)
    assert (int(m[1]), float(m[2]), int(m[3]), m[4]) == (N, 1.0, N, "none")  # plain decoding: one token per step


def test_prompt_file_stdin_and_dash_give_the_same_output(ckpt, capsys, monkeypatch, tmp_path):
    _, reference, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT + "\n", encoding="utf-8")  # a file's, or echo's, last newline is not the prompt's
    rc, out, _ = run(capsys, "--prompt-file", str(prompt_file), "--model", ckpt, "--max-new-tokens", str(N))
    assert rc == 0 and out == reference
    for argv in ([], ["-"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO(PROMPT + "\n"))
        rc, out, _ = run(capsys, *argv, "--model", ckpt, "--max-new-tokens", str(N))
        assert rc == 0 and out == reference, argv
    # a different prompt gives a different text: the prompt really is read from where it is given
    prompt_file.write_text("0123456789 9876543210", encoding="utf-8")
    _, out, _ = run(capsys, "--prompt-file", str(prompt_file), "--model", ckpt, "--max-new-tokens", str(N))
    assert out != reference


def test_the_prompt_argument_keeps_its_trailing_newline(ckpt, capsys):
    """Only a file's or stdin's last newline is dropped: "hello\\n" as the argument is 6 tokens, one a character."""
    rc, out, err = run(capsys, "hello\n", "--model", ckpt, "--max-new-tokens", "2", "--json")
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == len("hello\n")


def test_json_summary(ckpt, capsys):
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N), "--json")
    assert rc == 0
    summary = json.loads(out)  # stdout is the one JSON document: the text and the summary
    assert summary["text"] == expected_text(ckpt, PROMPT)
    assert summary["new_tokens"] == N and summary["steps"] == N and summary["tau"] == 1.0
    assert summary["prompt_tokens"] == len(PROMPT)  # character tokenizer, no chat template
    assert summary["drafter"] == "none" and summary["finish"] == "length"
    assert summary["chat_template"] is False and summary["system"] is None  # the tiny tokenizer has no template
    assert summary["tokens_per_s"] > 0 and summary["seconds"] > 0
    assert not SUMMARY.match(err)  # --json replaces the plain line
    page = (Path(__file__).parents[1] / "docs" / "command-line.md").read_text()
    table = page[page.index("| `--json` field |"):].split("\n\n")[0].splitlines()[2:]
    documented = {f for row in table for f in re.findall(r"`(\w+)`", row.split(" | ")[0])}
    assert documented == set(summary), "the command line page's table of --json fields lists every field, and no other"


def test_sampling_warper_flags_reach_generate(ckpt, capsys):
    """--min-p, --typical-p, --epsilon-cutoff, --eta-cutoff and --top-h are generate()'s; --min-p 1 keeps only the
    argmax, so sampling with it prints the greedy text."""
    argv = [PROMPT, "--model", ckpt, "--max-new-tokens", str(N), "--do-sample", "--seed", "0"]
    _, greedy, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N))
    rc, out, err = run(capsys, *argv, "--min-p", "1")
    assert rc == 0 and out == greedy, err
    flags = ["--typical-p", "0.9", "--epsilon-cutoff", "0.001", "--eta-cutoff", "0.002", "--top-h", "0.9"]
    rc, out, err = run(capsys, *argv, *flags, "--drafter", "ngram")
    kw = dict(do_sample=True, seed=0, typical_p=0.9, epsilon_cutoff=0.001, eta_cutoff=0.002, top_h=0.9)
    assert rc == 0 and out == expected_text(ckpt, PROMPT, drafter="ngram", **kw) + "\n", err


def test_top_h_0_turns_off_the_models_own_top_h(tmp_path, capsys):
    """--top-h 0 is top_h=None, as --top-k 0 is top_k=0: a model whose generation_config sets top_h samples without
    it (--top-h 1 still keeps at most 100 tokens, and None is no number to type)."""
    ckpt = save_tiny_checkpoint(tmp_path / "top-h", seed=3)
    transformers.GenerationConfig(do_sample=True, top_h=0.3).save_pretrained(ckpt)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N), "--seed", "0", "--top-h", "0")
    assert rc == 0, err
    off = expected_text(ckpt, PROMPT, seed=0, top_h=None)
    assert out == off + "\n" and off != expected_text(ckpt, PROMPT, seed=0)  # the model's top_h changes the text
    rc, _, err = run(capsys, PROMPT, "--model", ckpt, "--top-h", "-0.5")
    assert rc == 2 and "--top-h must lie in (0, 1] or be 0 (off), got -0.5" in err, err


def test_drafter_none_decodes_plainly_as_the_json_names_it(ckpt, capsys):
    """--json names plain decoding's drafter "none", which --drafter refused as an unknown drafter whose hint spoke
    Python (drafter=None)."""
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "4", "--drafter", "none", "--json")
    assert rc == 0 and json.loads(out)["drafter"] == "none", err
    assert json.loads(out)["text"] == expected_text(ckpt, PROMPT, n=4)


def test_no_stop_turns_off_the_models_own_stop_strings(tmp_path, capsys):
    """A model whose generation_config sets stop_strings stopped at them whatever the flags: --stop replaces them
    and --stop '' is refused, so nothing turned them off. --no-stop does; with --stop it is refused."""
    ckpt = save_tiny_checkpoint(tmp_path / "stops", seed=3)
    whole = expected_text(ckpt, PROMPT)
    transformers.GenerationConfig(stop_strings=[whole[3:5]]).save_pretrained(ckpt)
    assert expected_text(ckpt, PROMPT) != whole  # the model's stop string ends it early
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N), "--no-stop")
    assert rc == 0 and out == whole + "\n", err
    rc, _, err = run(capsys, PROMPT, "--model", ckpt, "--no-stop", "--stop", "x")
    assert rc == 2 and err.strip() == ("specdec generate: error: --no-stop drops every stop string, --stop gives some; "
                                       "drop one of them"), err


def test_sampler_speculation_and_invariant_flags_reach_generate(ckpt, capsys, monkeypatch):
    """Each at its non-default value (defaults: standard, auto, off) is what generate() is called with."""
    module = importlib.import_module("specdec.generate")
    real, seen = module.generate, {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "generate", spy)
    rc, _, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "4", "--do-sample", "--seed", "1",
                     "--drafter", "ngram", "--sampler", "coupled", "--speculation", "always", "--invariant")
    assert rc == 0, err
    assert (seen["sampler"], seen["speculation"], seen["invariant"]) == ("coupled", "always", True)


def test_a_sampling_flag_without_do_sample_warns_in_the_clis_spelling(ckpt, capsys, caplog):
    """Greedy decoding ignores --temperature; the warning names the flag that turns sampling on."""
    _, greedy, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N))
    with caplog.at_level(logging.WARNING, logger="specdec"):
        rc, out, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N), "--temperature", "0.5")
    assert rc == 0 and out == greedy
    assert "ignored: --temperature 0.5" in caplog.text and "--do-sample" in caplog.text, caplog.text


def test_the_warper_flags_are_the_sampling_warpers_with_their_off_values():
    """The CLI writes its warper flags out (importing specdec.sampling loads torch): they must stay the sampler's."""
    from specdec.cli import WARPER_FLAGS
    from specdec.sampling import WARPERS

    assert WARPER_FLAGS == {k: v for k, v in WARPERS.items() if k not in ("top_k", "top_p")}


def test_ngram_drafter_prints_tau_and_the_same_text(ckpt, capsys):
    n = 64
    _, plain, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(n))
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(n), "--drafter", "ngram",
                       "--drafter-option", "min_ngram=1", "--speculation", "always")  # tau: the drafts, not the guard
    assert rc == 0 and out == plain  # greedy speculative decoding is lossless
    m = summary_of(err)
    new_tokens, tau, steps, drafter = int(m[1]), float(m[2]), int(m[3]), m[4]
    assert drafter == "ngram" and new_tokens == n
    assert tau == pytest.approx(n / steps, abs=0.01) and tau > 1.0  # drafts were accepted
    assert "acceptance/depth" in err


def test_chat_template_is_applied_unless_disabled(chat_ckpt, capsys):
    """--json says whether it was, and with which --system message: two runs' documents did not say why their
    prompt_tokens differed."""
    def prompt(*extra):
        rc, out, err = run(capsys, "hello", "--model", chat_ckpt, "--max-new-tokens", "4", "--json", *extra)
        assert rc == 0, err
        summary = json.loads(out)
        return summary["prompt_tokens"], summary["chat_template"], summary["system"]

    assert prompt("--no-chat-template") == (len("hello"), False, None)
    assert prompt() == (len("user: hello. assistant: "), True, None)
    assert prompt("--system", "be brief") == (len("system: be brief. user: hello. assistant: "), True, "be brief")


def test_an_empty_system_message_is_an_empty_system_turn(chat_ckpt, capsys):
    """--system "" is a system message with no text, as transformers renders it, not the template's default one."""
    rc, out, err = run(capsys, "hello", "--model", chat_ckpt, "--max-new-tokens", "4", "--json", "--system", "")
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == len("system: . user: hello. assistant: ")


def test_the_chat_template_is_asked_for_the_generation_prompt(capsys, tmp_path):
    """A template that writes "assistant: " only under add_generation_prompt: the prompt ends with it."""
    save_tiny_checkpoint(tmp_path, tokenizer=False)
    tok = build_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    tok.save_pretrained(tmp_path)
    rc, out, err = run(capsys, "hello", "--model", str(tmp_path), "--max-new-tokens", "2", "--json")
    assert rc == 0, err
    assert json.loads(out)["prompt_tokens"] == len("user: hello. assistant: ")  # one token a character


@pytest.fixture(scope="module")
def no_tokenizer_ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-notok"), tokenizer=False)


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    import transformers

    path = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=69)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "argv, match",
    [
        ([" \n", "--model", "{ckpt}"], r"the prompt is only whitespace \(read from the prompt argument\)"),
        (["", "--model", "{ckpt}"], r"the prompt is empty \(read from the prompt argument\)"),
        (["hi", "--model", "/no/such/model"], "unknown model '/no/such/model'"),
        (["hi", "--model", "{ckpt}", "--drafter", "no-such-drafter"], "unknown drafter 'no-such-drafter'"),
        (["hi", "--model", "{ckpt}", "--do-sample", "--temperature", "0"],
         "--temperature must be > 0 when sampling, got 0.0; drop --do-sample"),
        (["hi", "--model", "{ckpt}", "--top-p", "1.5"], r"--top-p must lie in \[0, 1\]"),
        (["hi", "--model", "{ckpt}", "--top-k", "-3"], r"--top-k must be an integer >= 0 \(0 disables it\), got -3"),
        (["hi", "--model", "{ckpt}", "--min-p", "1.5"], r"--min-p must lie in \[0, 1\]"),
        (["hi", "--model", "{ckpt}", "--typical-p", "0"], r"--typical-p must lie in \(0, 1\]"),
        (["hi", "--model", "{ckpt}", "--eta-cutoff", "-0.1"], r"--eta-cutoff must lie in \[0, 1\)"),
        (["hi", "--model", "{ckpt}", "--drafter", "ngram", "--drafter-option", "bogus=1"],
         "has no --drafter-option 'bogus'"),
        (["hi", "--model", "{ckpt}", "--drafter", "ngram", "--drafter-option", "bogus"], "KEY=VALUE"),
        (["hi", "--model", "{ckpt}", "--drafter-option", "num_draft_tokens=3"], "needs --drafter NAME"),
        (["hi", "--model", "{ckpt}", "--num-blocks", "1"], "KV cache .*: --num-blocks 1 is too few"),
        (["hi", "--model", "{ckpt}", "--max-new-tokens", "600"],
         r"\+ --max-new-tokens \(600\) exceeds the model's context .*; shorten the prompt or lower --max-new-tokens$"),
        (["the cat sat on the mat. " * 60, "--model", "{ckpt}"],  # no --max-new-tokens would fit: not advised
         r"exceeds the model's context of 512 tokens; the prompt alone fills it: shorten the prompt$"),
        (["hi", "--model", "{ckpt}", "--num-blocks", str(10**12)],
         r"the KV cache of --num-blocks 1000000000000 .*pass --num-blocks <="),
        (["--prompt-file", "/no/such/prompt.txt", "--model", "{ckpt}"], "--prompt-file '/no/such/prompt.txt': "
                                                                          "cannot read it \\(No such file"),
        (["hi", "--model", "{ckpt}", "--drafter", "self-draft"], "give num_layers=1 \\(on the command line "
                                                                   "--drafter-option num_layers=1\\)$"),
        (["hi", "--model", "{ckpt}", "--drafter", "eagle"], "on the command line --drafter-option path=DIR"),
        (["hi", "--model", "{ckpt}", "--drafter", "medusa"], "on the command line --drafter-option path=DIR"),
        (["hi", "--model", "{ckpt}", "--drafter", "draft-model"], "on the command line --drafter-option model="),
        (["hi", "--model", "{no_tokenizer_ckpt}"], "has no tokenizer"),
        (["hi", "--model", "{gpt2_ckpt}"], "supported"),  # UnsupportedModelError
        (["hi", "--model", "{ckpt}", "--cuda-graphs"], "needs --device cuda"),
        (["hi", "--model", "{ckpt}", "--stop", "x", "--stop", ""], "error: --stop '' is empty: it would stop at once"),
        pytest.param(["hi", "--model", "{ckpt}", "--device", "cuda"], "no CUDA device is available",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")),
    ],
)
def test_user_errors_are_one_line_and_exit_code_2(argv, match, ckpt, no_tokenizer_ckpt, gpt2_ckpt, capsys):
    paths = dict(ckpt=ckpt, no_tokenizer_ckpt=no_tokenizer_ckpt, gpt2_ckpt=gpt2_ckpt)
    rc, _, err = run(capsys, *[a.format(**paths) for a in argv])
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("specdec generate: error: ")]
    assert len(lines) == 1 and re.search(match, lines[0]), err


def test_a_tokenizer_that_does_not_load_is_not_called_missing(tmp_path, capsys):
    """A checkpoint whose tokenizer files are there but do not load (damaged, or needing a package not installed):
    "has no tokenizer ... (save it next to the checkpoint)" told the user to save what is there already."""
    path = tmp_path / "ckpt"
    save_tiny_checkpoint(path)
    (path / "tokenizer.json").write_text("{not json")
    rc, _, err = run(capsys, "hi", "--model", str(path))
    assert rc == 2, err
    assert err.splitlines()[-1] == (f"specdec generate: error: the tokenizer of model {str(path)!r} could not be "
                                    "loaded (the warning above says why); the CLI needs one")


def test_dtype_and_device_reach_the_model(ckpt, capsys):
    """--dtype bfloat16 runs the model in bf16 (its own greedy text, as the API gives it in bf16)."""
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", str(N), "--dtype", "bfloat16",
                       "--device", "cpu", "--json")
    assert rc == 0
    summary = json.loads(out)
    assert (summary["dtype"], summary["device"]) == ("bfloat16", "cpu")
    _, plain, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "2", "--json")
    assert json.loads(plain)["dtype"] == "float32"  # the default
    loaded = specdec.load_model(ckpt, dtype=torch.bfloat16)
    assert loaded.runner.dtype == torch.bfloat16
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    new = specdec.generate(loaded, [ids], max_new_tokens=N, return_dict=True).new_tokens[0]
    assert summary["text"] == loaded.tokenizer.decode(new, skip_special_tokens=True)
    with pytest.raises(SystemExit) as exc:
        main(["generate", PROMPT, "--model", ckpt, "--dtype", "float64"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_no_prompt_on_a_terminal_is_a_usage_error(ckpt, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal())
    rc, _, err = run(capsys, "--model", ckpt)
    assert rc == 2 and "give a prompt" in err and "Traceback" not in err


def test_bad_option_type_is_argparse_exit_code_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "hi", "--temperature", "warm"])
    assert exc.value.code == 2 and "--temperature" in capsys.readouterr().err


def _commands(parser, name: str = "specdec"):
    """(command name, its parser) for ``parser`` and every subcommand under it."""
    import argparse

    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


def test_every_option_with_a_default_says_it_in_help():
    """The README: "Every command's --help lists all its options with their defaults". An option whose default is a
    value (not None, off or an empty list) names it in its --help line, by its help text or by the formatter: the
    word "default" alone is not enough (--levels said "neither in the default", --prompt-source "default 1000" of
    --num-prompts, and the formatter then added nothing)."""
    import argparse

    from specdec.cli import _parser

    silent = []
    for command, parser in _commands(_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            off = action.default is None or action.default is False or action.default == []  # (0 is a value)
            if action.help == argparse.SUPPRESS or action.default == argparse.SUPPRESS or off:
                continue
            shown = formatter._expand_help(action) if action.help else ""
            value = action.default
            spellings = {str(value), f"{value:g}" if isinstance(value, float) else str(value)}  # 1.0 or 1
            if "default" not in shown.lower() or not any(s in shown for s in spellings):
                silent.append(f"{command} {'/'.join(action.option_strings) or action.dest}={action.default!r}")
    assert silent == [], f"--help does not say these defaults: {silent}"


def test_every_option_has_a_help_text():
    """`specdec eval acceptance --help` listed --no-plots bare, saying nothing of what it does."""
    import argparse

    from specdec.cli import _parser

    bare = [f"{command} {'/'.join(a.option_strings) or a.dest}" for command, parser in _commands(_parser())
            for a in parser._actions if not isinstance(a, argparse._SubParsersAction) and not a.help]
    assert bare == [], f"options without a help text: {bare}"


def test_generate_help_says_the_prompt_goes_through_the_chat_template_by_default():
    """--no-chat-template's help said only "feed the prompt as raw text": nothing said that without it the prompt is
    the user message of the model's chat template, which changes the tokens the model is given."""
    from specdec.cli import _parser

    generate = next(parser for command, parser in _commands(_parser()) if command.endswith(" generate"))
    flag = next(a for a in generate._actions if "--no-chat-template" in a.option_strings)
    assert "default: as the user message of the model's chat template" in flag.help


def test_verbose_shows_the_traceback_and_keeps_the_exit_code(capsys):
    """-v raised the error, so its exit code was 1, a failed certificate's: a script could not tell them apart."""
    capsys.readouterr()
    assert main(["-v", "generate", "hi", "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ModelNotFoundError" in err and "unknown model" in err
    assert err.rstrip().splitlines()[-1].startswith("specdec generate: error: ")


def test_real_process_exit_code_and_no_traceback(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "hi", "--model", "/no/such/model"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("specdec generate: error: unknown model")


def test_acceptance_per_depth_lists_only_the_depths_tried():
    """A tree 16 deep once verified leaves 16 depth slots; the ones no step reached have no rate (not 0.00)."""
    from specdec.output import acceptance_rates

    assert acceptance_rates((28, 14, 0, 0), (100, 28, 5, 0)) == (0.28, 0.5, 0.0)
    assert acceptance_rates((0, 0), (0, 0)) == ()


def test_stop_reads_backslash_escapes_as_the_characters_they_name():
    """--stop '\\n' reached generate() as a backslash and an n, a stop no text holds: a shell passes the two
    characters, so a newline stop needed bash's $'\\n'."""
    from specdec.cli import _checked_texts, _parser

    args = _parser().parse_args(["generate", "hi", "--stop", "\\n", "--stop", "a\\tb\\\\n\\q"])
    assert _checked_texts(args)[2] == ["\n", "a\tb\\n\\q"]


def test_version(capsys):
    """`specdec --version` was "the following arguments are required: command"."""
    import specdec

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"specdec {specdec.__version__}"


@pytest.mark.parametrize("argv, commands", [([], "{generate,train-medusa,train-eagle,eval,convert-medusa,"
                                                 "export-head}"),
                                             (["eval"], "{lossless,acceptance,replay}"),
                                             (["eval", "replay"], "{record,run,bound}")])
def test_a_missing_command_is_named_by_the_commands_to_choose_from(capsys, argv, commands):
    """`specdec eval` said "the following arguments are required: eval_command", a name from the code."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"the following arguments are required: {commands} (see specdec " in capsys.readouterr().err


def test_the_text_stream_decodes_a_window_not_the_whole_answer():
    """Each streamed step decoded every token so far: quadratic host time over a long answer (an 8k-token answer
    spent milliseconds per token re-decoding printed text). The printed pieces still join to the whole text,
    a character cut across steps (byte-level tokens) and a leading space a window alone would lose included."""
    import io

    from specdec.cli import _TextStream

    class Bytes:  # token i is byte i; a first token's leading space is dropped, as a SentencePiece decoder does
        def __init__(self):
            self.longest = 0

        def decode(self, ids, skip_special_tokens=False):
            self.longest = max(self.longest, len(ids))
            return bytes(ids).decode("utf-8", errors="replace").removeprefix(" ")

    text = " Hello 🌍 café, 你好! " * 40
    ids = list(text.encode())
    tok, out = Bytes(), io.StringIO()
    stream = _TextStream(tok, out)
    for i in range(0, len(ids), 3):
        stream(0, ids[i : i + 3])
    stream.finish()
    assert out.getvalue() == text.removeprefix(" ") + "\n"
    assert tok.longest <= 12, tok.longest  # a few steps' tokens, not the whole answer's


def test_the_text_stream_prints_a_character_cut_at_the_end_when_it_finishes():
    """A step ending inside a UTF-8 sequence waits for the next token; at the end there is none, and what is left
    (its replacement character) must still be printed, not dropped with the rest of the step."""
    import io

    from specdec.cli import _TextStream

    class Bytes:  # token i is byte i
        def decode(self, ids, skip_special_tokens=False):
            return bytes(ids).decode("utf-8", errors="replace")

    out = io.StringIO()
    stream = _TextStream(Bytes(), out)
    stream(0, list(b"caf") + [0xC3])  # "café" without the last byte of its é (0xC3 0xA9)
    assert out.getvalue() == ""  # held back: the é may yet be completed
    stream.finish()
    assert out.getvalue() == "caf\ufffd\n"  # b"caf\xc3" decodes to "caf" and one replacement character


def test_the_text_stream_prints_a_byte_fallback_run_as_the_final_decode_shows_it():
    """A byte-fallback decoder (Llama's, Mistral's) turns a run of ``<0xNN>`` tokens that is not valid UTF-8 into
    U+FFFDs as a whole, its ASCII bytes included: the stream printed "a" before the 0x80 after it garbled it, and the
    text on the screen ("a\ufffdb") was not the --json text ("\ufffd\ufffdb")."""
    import io

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from specdec.cli import _TextStream

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({c: 256 + i for i, c in enumerate(" abcdefghijklmnopqrstuvwxyz")})
    fallback = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    fallback.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=fallback)
    for ids in ([0x61, 0x80, 256 + 2], tok("ab 你好")["input_ids"] + [0x80, 256 + 3, 0xC3, 0xA9]):
        out = io.StringIO()
        stream = _TextStream(tok, out)
        for i in ids:
            stream(0, [i])
        stream.finish()
        assert out.getvalue() == tok.decode(ids) + "\n"


def test_the_text_stream_keeps_the_space_of_a_lone_sentencepiece_token_its_decoder_strips():
    """A SentencePiece decoder that strips the text's ends (transformers' SentencePieceBackend) decodes a lone "▁"
    to nothing at either end of a window: "hello world" streamed as "hellow" + "orld"."""
    import io

    from specdec.cli import _TextStream

    pieces = ["▁he", "ll", "o", "▁", "w", "orld"]

    class Pieces:  # token i is pieces[i]
        def decode(self, ids, skip_special_tokens=False):
            return "".join(pieces[i] for i in ids).replace("▁", " ").strip()

    out = io.StringIO()
    stream = _TextStream(Pieces(), out)
    for i in range(len(pieces)):
        stream(0, [i])
    stream.finish()
    assert out.getvalue() == "hello world\n"


def _summary(**fields) -> dict:
    return {"new_tokens": 24, "seconds": 2.0, "tokens_per_s": 12.0, "tau": 1.0, "steps": 24, "drafter": "none",
            "acceptance_per_depth": [], "prompt_tokens": 10, "finish": "length", **fields}


def test_the_summary_line_names_acceptance_per_depth_only_when_a_drafter_tried_some(capsys):
    """Plain decoding tries no depth: its line has no empty "acceptance/depth" field."""
    from specdec.cli import _print_summary

    _print_summary(_summary())
    out, err = capsys.readouterr()
    assert out == ""  # the summary is stderr's; stdout holds the text only
    assert err == ("[specdec] 24 tokens in 2.00s = 12.0 tok/s | tau 1.00 over 24 steps | drafter none"
                   " | prompt 10 tok, finish=length\n")
    _print_summary(_summary(drafter="ngram", tau=2.5, steps=10, acceptance_per_depth=[0.8, 0.25]))
    assert " | drafter ngram | acceptance/depth 0.80 0.25 | prompt 10 tok" in capsys.readouterr().err


def test_a_run_cut_short_reports_its_tokens_per_second():
    """--json of a run stopped by Ctrl-C or a full KV cache: 6 tokens in 2 s are 3 tok/s; the statistics only a
    finished run has are null."""
    from types import SimpleNamespace

    from specdec.cli import _cut_summary

    loaded = SimpleNamespace(name="tiny", runner=SimpleNamespace(dtype=torch.float32, device=torch.device("cpu")))
    prompt = {"chat_template": False, "system": None}
    got = _cut_summary(loaded, SimpleNamespace(drafter=None), prompt, 10, 6, 2.0, "interrupted", 0.5)
    assert got["tokens_per_s"] == 3.0 and got["new_tokens"] == 6 and got["seconds"] == 2.0
    assert (got["tau"], got["steps"], got["finish"], got["drafter"]) == (None, None, "interrupted", "none")
