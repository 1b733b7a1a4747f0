"""User mistakes end in one line, never a traceback or a silently ignored option: --system where no chat template
applies, a path option that looks like a number, a drafter class instead of an instance, a closed stdout or one
that cannot encode the text, Ctrl-C while the command line is still importing torch, draft_probs that track
gradients, a pad id outside the vocabulary, max_new_tokens=None, sampling options given with greedy decoding, and
a minimum length beyond the maximum."""
from __future__ import annotations

import importlib
import logging
import re
import subprocess
import sys

import pytest
import torch
from specdec.drafters.base import Drafter
from specdec.drafters.ngram import NGramDrafter

import specdec
from specdec.cli import _parse_options, main
from specdec.errors import InputError, InputTypeError
from specdec.testing import build_tiny_model
from specdec.tree import DraftMode, DraftTree


def run(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, the one error line on stderr)."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line or "interrupted" in line]
    return rc, lines[0] if len(lines) == 1 else err


def test_system_without_a_chat_template_is_refused(ckpt, chat_ckpt, capsys):
    assert getattr(specdec.load_model(ckpt).tokenizer, "chat_template", None) is None
    rc, line = run(capsys, "generate", "hi", "--model", ckpt, "--system", "be brief", "--max-new-tokens", "2")
    assert rc == 2 and "--system goes into the chat template" in line and "has none" in line
    rc, line = run(capsys, "generate", "hi", "--model", chat_ckpt, "--system", "be brief", "--no-chat-template",
                   "--max-new-tokens", "2")
    assert rc == 2 and "--no-chat-template turns off" in line


def test_a_numeric_path_option_stays_a_path(capsys):
    """--drafter-option path=2024 names the directory "2024" (it was parsed as the integer 2024: a TypeError
    traceback); other values are still JSON."""
    assert _parse_options(["path=2024", "model=7", "num-draft-tokens=3"]) == {"path": "2024", "model": "7",
                                                                              "num_draft_tokens": 3}
    # a path quoted as JSON (path=\"DIR\" in a shell) is DIR, as it always was after a drafter's prefix, where a
    # number stays a path too
    assert _parse_options(['path="heads/"', 'medusa.path="A"', "eagle.path=7", 'draft-model.model=""']) == {
        "path": "heads/", "medusa.path": "A", "eagle.path": "7", "draft_model.model": ""}
    # Python's spellings, which the messages print (cuda_graphs=True read as the text 'True' was refused with
    # "must be True, False or 'auto', got 'True'"); a tokenizer directory stays a path
    assert _parse_options(["cuda_graphs=True", "adapt_depth=False", "seed=None", "tokenizer=1"]) == {
        "cuda_graphs": True, "adapt_depth": False, "seed": None, "tokenizer": "1"}
    # and in any case: top_k=none was the text 'none' ("must be a positive integer, got 'none'")
    assert _parse_options(["top_k=none", "cuda_graphs=TRUE", "adapt_depth=false", "seed=NULL", "path=none"]) == {
        "top_k": None, "cuda_graphs": True, "adapt_depth": False, "seed": None, "path": "none"}
    rc, line = run(capsys, "generate", "hi", "--model", "nowhere", "--drafter", "medusa",
                   "--drafter-option", "path=2024", "--max-new-tokens", "2")
    assert rc == 2 and line.startswith("specdec generate: error: ")


@pytest.mark.parametrize("drafter, options, match", [
    ("medusa", {"path": 5}, r"medusa: path= must be a checkpoint directory .*got int 5"),
    ("eagle", {"path": 2024}, r"eagle: path= must be a checkpoint directory .*got int 2024"),
    ("draft-model", {"model": 5}, r"draft-model: model= must be .*got int 5"),
    (NGramDrafter, {}, r"drafter must be an instance, got the class NGramDrafter: pass NGramDrafter\(...\)"),
])
def test_wrong_drafter_argument_types_are_one_line_before_the_model_loads(drafter, options, match, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the drafter argument was checked")

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "load_model", no_load)  # imported lazily
    with pytest.raises(InputTypeError, match=match):
        specdec.generate(build_tiny_model(), [[1, 2]], max_new_tokens=2, drafter=drafter, drafter_options=options)


def test_closed_stdout_is_one_line(capsys, monkeypatch):
    """`specdec generate hi >&-`: Python sets sys.stdout to None, which ended in an AttributeError traceback."""
    monkeypatch.setattr(sys, "stdout", None)
    rc, line = run(capsys, "generate", "hi", "--max-new-tokens", "2")
    assert rc == 2 and line == ("specdec generate: error: stdout is closed, so the output would be lost; redirect "
                                "it to a file or to /dev/null instead")


def test_a_stdout_that_cannot_encode_the_text_gets_escapes(tmp_path, monkeypatch, capsys):
    """On an ASCII stdout (PYTHONIOENCODING=ascii, a Windows code page) the first character it cannot write
    stopped `specdec generate` with a UnicodeEncodeError and the rest of the text was lost: such characters are
    written as escapes, as on stderr."""
    import io

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = "éüñ→ßø"  # every token but [UNK] is outside ASCII
    tok = Tokenizer(models.BPE(vocab={"[UNK]": 0, **{c: i + 1 for i, c in enumerate(chars)}}, merges=[],
                               unk_token="[UNK]"))
    tok.decoder = decoders.Fuse()
    build_tiny_model(vocab_size=len(chars) + 1).save_pretrained(tmp_path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(tmp_path)
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    rc = main(["generate", "éü", "--model", str(tmp_path), "--max-new-tokens", "8"])
    ascii_out.flush()
    out = ascii_out.buffer.getvalue().decode("ascii")
    assert rc == 0, capsys.readouterr().err
    assert len(re.findall(r"\\x[0-9a-f]{2}|\\u[0-9a-f]{4}", out)) >= 4, out


def test_ctrl_c_while_importing_exits_130(capsys, monkeypatch):
    """The console script imports specdec.cli: that import must not load torch (seconds, where Ctrl-C printed a
    traceback and exited -2), and Ctrl-C during main's own imports is the usual one line and 130."""
    code = "import sys, specdec.cli; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr("specdec.cli.importlib.import_module", interrupted)
    rc, line = run(capsys, "generate", "hi")
    assert rc == 130 and line == "specdec: interrupted"


def test_help_and_argument_mistakes_do_not_import_torch():
    """Every ``specdec`` call builds every command's parser (-v is added to each): ``specdec --help`` or a mistyped
    option took ~2 s importing torch for the drafters' commands. Each command's work imports it when it runs."""
    code = """if True:
        import contextlib, io, sys
        from specdec.cli import main
        for argv, rc in ((["--help"], 0), (["export-head", "--help"], 0), (["convert-medusa", "x"], 2),
                         (["export-head", "h", "--format", "bad", "--output-dir", "o"], 2),
                         (["train-eagle", "--epochs", "many"], 2), (["eval", "--nope"], 2)):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main(argv)
                except SystemExit as exit:
                    assert exit.code == rc, (argv, exit.code)
                else:
                    raise AssertionError(f"{argv} ran")
        assert not {'torch', 'transformers'} & set(sys.modules), 'torch or transformers imported'"""
    subprocess.run([sys.executable, "-c", code], check=True)


class GradDrafter(Drafter):
    """Honest, but its draft_probs come from a softmax that still tracks gradients."""

    name = "grad-drafter"

    def __init__(self) -> None:
        self.logits = torch.zeros(96, requires_grad=True)

    def propose(self, seqs):
        probs = torch.softmax(self.logits, -1)[None]
        return [DraftTree(torch.multinomial(probs.detach(), 1)[0], [-1], probs, DraftMode.INDEPENDENT) for _ in seqs]


def test_draft_probs_that_track_gradients_are_used_as_values():
    """They ended in an autograd error inside the audit (an out= op on a tensor that requires grad)."""
    out = specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_tokens=6, drafter=GradDrafter(), do_sample=True,
                           seed=0, speculation="always", return_dict=True)
    assert len(out.new_tokens[0]) == 6 and out.stats[0].steps < 6  # drafts were verified and some accepted


def test_pad_token_id_outside_the_vocabulary_is_refused():
    model = build_tiny_model()
    for pad in (96, -1):
        with pytest.raises(InputError, match=f"pad_token_id {pad} is outside the vocabulary \\[0, 96\\)"):
            specdec.generate(model, [[1, 2]], max_new_tokens=2, pad_token_id=pad)
    model.generation_config.pad_token_id = -1  # an old model config's own: padded with the EOS id instead
    out = specdec.generate(model, torch.tensor([[1, 2], [3, 4]]), max_new_tokens=3, eos_token_id=12)
    assert out[0].tolist() == [1, 2, 12, 12, 12]  # row 0 stops at EOS 12 at once (greedy), then -1 would pad it


def test_max_new_tokens_none_leaves_the_length_to_max_length():
    """max_new_tokens=None leaves the length to max_length, as in transformers; it was an InputTypeError."""
    model = build_tiny_model()
    assert len(specdec.generate(model, [[1, 2]], max_new_tokens=None, max_length=5)[0]) == 5
    assert len(specdec.generate(model, [[1, 2]], max_new_tokens=None)[0]) == 2 + 128  # specdec's default


def test_max_length_past_the_context_advises_lowering_max_length():
    """The count max_length set is said as its doing, and max_length is what to lower: the message read "max_new_tokens
    (597 (max_length from keyword argument))" and advised lowering max_new_tokens, which the caller never passed."""
    model = build_tiny_model()
    with pytest.raises(InputError, match=r"max_new_tokens \(597, set by max_length from keyword argument\) exceeds "
                                         r"the model's context of 512 tokens; shorten the prompt or lower max_length "
                                         r"\(or pass max_new_tokens\)$"):
        specdec.generate(model, [[1, 2, 3]], max_length=600)
    with pytest.raises(InputError, match=r"max_new_tokens \(600\) exceeds .*; shorten the prompt or lower "
                                         r"max_new_tokens$"):
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=600)


def test_sampling_options_with_greedy_decoding_warn(caplog):
    model = build_tiny_model()
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        greedy = specdec.generate(model, [[1, 2]], max_new_tokens=3, top_p=0.5, min_p=0.1, sampler="coupled")
    assert "sampling options are ignored: top_p=0.5, min_p=0.1, sampler='coupled'" in caplog.text
    assert greedy == specdec.generate(model, [[1, 2]], max_new_tokens=3)  # ignored indeed
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        specdec.generate(model, [[1, 2]], max_new_tokens=3, do_sample=True, seed=0, top_p=0.5)
        specdec.generate(model, [[1, 2]], max_new_tokens=3, temperature=1.0)  # neutral values say nothing
    assert "ignored" not in caplog.text


def test_speculation_options_without_a_drafter_warn(caplog):
    """speculation= and audit_drafts= without a drafter change nothing: said, as drafter_options are refused."""
    model = build_tiny_model()
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        plain = specdec.generate(model, [[1, 2]], max_new_tokens=3, speculation="always", audit_drafts=False)
    assert "no drafter, so these speculation options are ignored: speculation='always', audit_drafts=False" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        assert specdec.generate(model, [[1, 2]], max_new_tokens=3, speculation="auto") == plain  # neutral
        specdec.generate(model, [[1, 2]], max_new_tokens=3, drafter="ngram", speculation="always")
    assert "ignored" not in caplog.text


def test_a_minimum_length_beyond_max_new_tokens_warns(caplog):
    """min_new_tokens / min_length above what max_new_tokens allows keep EOS masked to the end: transformers warns,
    and so does specdec now (it said nothing); exactly max_new_tokens (a way to ask for that many) says nothing."""
    model = build_tiny_model()
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        specdec.generate(model, [[1, 2]], max_new_tokens=3, min_new_tokens=4)
        specdec.generate(model, [[1, 2]], max_new_tokens=3, min_length=6)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and said[0].startswith("min_new_tokens=4 is more than max_new_tokens=3 allows"), said
    assert said[1].startswith("min_length=6 (the prompt's 2 tokens included) is more than max_new_tokens=3"), said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        specdec.generate(model, [[1, 2]], max_new_tokens=3, min_new_tokens=3)
        specdec.generate(model, [[1, 2]], max_new_tokens=3, min_length=5)
    assert not caplog.records, caplog.text


@pytest.mark.parametrize("argv, said", [
    (["generate", "hi", "--dtype", "fp8"], "specdec generate: error: argument --dtype: invalid choice: 'fp8'"),
    (["generate", "hi", "--bogus"], "specdec generate: error: unrecognized arguments: --bogus"),
    (["eval", "lossless", "--bogus", "1"], "specdec eval lossless: error: unrecognized arguments: --bogus 1"),
])
def test_a_bad_option_is_one_line_from_its_command(capsys, argv, said):
    """argparse's own mistakes are one line too (no usage block before it), said by the command that was run."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith(said), err
    assert err.rstrip().endswith(f"(see specdec {' '.join(argv[:2 if argv[0] == 'eval' else 1])} --help)")


def test_a_bad_option_under_a_launcher_is_said_by_its_first_process_alone(capsys, monkeypatch):
    """`accelerate launch --num_processes 2 -m specdec.cli train-medusa --batch-size abc` printed the mistake once per
    process (every one parses the same command line): the first says it, the others exit 2 quietly."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            main(["train-medusa", "--batch-size", "abc", "--output-dir", "out"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == lines, (rank, err)
        assert not lines or err.startswith("specdec train-medusa: error: argument --batch-size: invalid int value")


def test_the_command_line_takes_the_models_generation_config_where_no_flag_is_given(tmp_path, capsys):
    """`specdec generate` passed its flags' defaults (greedy, 128 tokens) as keyword arguments, which win over a
    checkpoint's generation_config.json: a model configured to sample, or to stop at 6 tokens, did neither."""
    import json
    from pathlib import Path

    from specdec.testing import save_tiny_checkpoint

    path = Path(save_tiny_checkpoint(tmp_path / "m"))
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 5.0,
                                                             "max_new_tokens": 6}))

    def summary(*flags):
        assert main(["generate", "hello", "--model", str(path), "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)

    runs = [summary("--seed", str(seed)) for seed in range(4)]
    assert all(r["new_tokens"] == 6 for r in runs) and len({r["text"] for r in runs}) > 1  # sampled, 6 tokens
    greedy = [summary("--no-do-sample", "--max-new-tokens", "9", "--seed", str(seed)) for seed in range(2)]
    assert greedy[0]["new_tokens"] == 9 and greedy[0]["text"] == greedy[1]["text"]
    rc, line = run(capsys, "generate", "hello", "--model", str(path), "--max-new-tokens", "0")
    assert rc == 2 and "--max-new-tokens must be >= 1" in line


@pytest.mark.parametrize("flag", ["--block-size", "--num-blocks"])
def test_a_kv_cache_flag_below_one_is_refused_by_its_name_before_the_model_loads(flag, tmp_path, capsys):
    """It was refused only after the model loaded (seconds), naming generate()'s block_size / num_blocks."""
    rc, line = run(capsys, "generate", "hello", "--model", str(tmp_path / "absent"), flag, "0")
    assert rc == 2 and line.endswith(f"{flag} must be >= 1, got 0"), line


@pytest.mark.parametrize("kwargs, said", [
    (dict(device="tpu"), "device 'tpu' is not a device torch knows"),
    (dict(dtype="fp8"), "dtype must be a floating torch.dtype or one of float32, bfloat16, float16, got 'fp8'"),
    (dict(dtype=torch.int8), "dtype must be a floating torch.dtype"),
    (dict(dtype=torch.float8_e4m3fn), "dtype must be a floating torch.dtype or one of float32, bfloat16, float16, "
                                      "got torch.float8_e4m3fn (a model does not run in it"),  # a bare TypeError
])
def test_load_model_refuses_a_bad_device_or_dtype_in_one_line(kwargs, said):
    """load_model(device="tpu") raised torch's RuntimeError listing twenty backends, dtype="fp8" an AttributeError."""
    with pytest.raises(InputError) as err:
        specdec.load_model("synthetic:qwen3-0.6b@tiny", **kwargs)
    assert str(err.value).startswith(said) and "\n" not in str(err.value)
    named = specdec.load_model("synthetic:qwen3-0.6b@tiny", dtype="bfloat16", device="cpu")  # a dtype by its name
    assert named.runner.dtype == torch.bfloat16


def test_verbose_after_the_command_and_no_repeated_prefix(tmp_path, capsys):
    """-v after the command was an unrecognized argument; an error message that names its command was printed
    after the command's prefix again ("specdec export-head: error: export-head: ...")."""
    rc, line = run(capsys, "export-head", str(tmp_path / "nowhere"), "--format", "sglang", "--output-dir",
                   str(tmp_path / "o"))
    assert rc == 2 and line.startswith("specdec export-head: error: ") and line.count("export-head:") == 1
    rc = main(["export-head", str(tmp_path / "nowhere"), "--format", "sglang", "--output-dir", str(tmp_path / "o"),
               "-v"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and "InputError" in err and "does not exist" in err  # -v: the traceback
