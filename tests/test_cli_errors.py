"""What a user sees when ``specdec generate`` cannot run or is stopped: one line ``specdec generate: ...`` on
stderr and a fixed exit code (2 for errors, 130 for Ctrl-C), never a traceback; and ``--json`` leaves exactly one
JSON document on stdout. Covers closed / non-UTF-8 stdin, binary or non-UTF-8 prompt files and arguments, a prompt
given twice, unusable devices, truncated .gguf files, Ctrl-C (in-process and a real SIGINT) and a closed pipe."""
from __future__ import annotations

import errno
import importlib
import io
import json
import logging
import os
import signal
import struct
import subprocess
import sys

import pytest

import specdec
import specdec.cli
from specdec.cli import main
from specdec.models.embedded import GGUFError, check_gguf
from specdec.testing import save_tiny_checkpoint

PROMPT = "the cat sat on the mat, the cat sat on the hat. "
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def greedy_text(ckpt: str, n: int) -> str:
    loaded = specdec.load_model(ckpt)
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    out = specdec.generate(loaded, [ids], max_new_tokens=n, return_dict=True)
    return loaded.tokenizer.decode(out.new_tokens[0], skip_special_tokens=True)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        rc = main(["generate", *argv])
    except KeyboardInterrupt:  # escaping, it would end the whole pytest session
        pytest.fail("KeyboardInterrupt escaped main()")
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def error_line(err: str) -> str:
    """The one `specdec generate: error: ...` line; no traceback, nothing else but library warnings."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("specdec generate: error: ")]
    assert len(lines) == 1, err
    return lines[0]


# --- where the prompt comes from --------------------------------------------------------------------------------


def test_closed_stdin_is_one_line():
    """`specdec generate 0<&-`: Python sets sys.stdin to None, which used to end in an AttributeError traceback."""
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", "/unused"],
                          capture_output=True, text=True, preexec_fn=lambda: os.close(0), env=ENV, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "stdin is closed" in error_line(proc.stderr)


def test_empty_stdin_says_where_the_prompt_came_from(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))  # `< /dev/null`
    rc, _, err = run(capsys, "--model", ckpt)
    assert rc == 2 and "the prompt is empty (read from stdin)" in error_line(err)


@pytest.mark.parametrize("content, what", [
    (b"\x7fELF\x02\x01\x01\x00\x00\x00", "looks binary"),        # an executable
    (b"\xff\xfeh\x00i\x00", "is UTF-16 text (by its byte-order mark); the prompt must be UTF-8 text: convert it "
                           "first, e.g. with iconv -f UTF-16 -t UTF-8"),  # UTF-16, Notepad's "Unicode": not binary
    (b"\xff\xfe\x00\x00h\x00\x00\x00", "is UTF-32 text"),                    # UTF-32
    ("café au lait".encode("latin-1"), "is not UTF-8 text (line 1, byte 3: invalid continuation byte)"),  # Latin-1
    ("tea\ncafé au lait".encode("latin-1"), "(line 2, byte 3: invalid continuation byte)"),  # where a file says it
])
def test_prompt_file_that_is_not_utf8_text_is_named(content, what, ckpt, capsys, tmp_path):
    path = tmp_path / "prompt.bin"
    path.write_bytes(content)
    rc, out, err = run(capsys, "--prompt-file", str(path), "--model", ckpt)
    line = error_line(err)
    assert rc == 2 and out == ""
    assert f"--prompt-file {str(path)!r}" in line and what in line, line


def test_stdin_that_is_not_utf8_text_is_named(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("café".encode("latin-1")), encoding="utf-8"))
    rc, _, err = run(capsys, "--model", ckpt)
    line = error_line(err)
    assert rc == 2 and "stdin is not UTF-8 text (line 1, byte 3: unexpected end of data)" in line, line


@pytest.mark.parametrize("make_argv, source", [
    (lambda bad: [bad], "the prompt argument"),
    (lambda bad: ["hi", "--system", bad], "--system"),
    (lambda bad: ["hi", "--stop", bad], "--stop"),
])
def test_non_utf8_arguments_are_named(make_argv, source, ckpt, capsys):
    """Python hands argv bytes that are not UTF-8 over as surrogate escapes (os.fsdecode); the tokenizer used to
    fail on them with a TypeError traceback."""
    bad = os.fsdecode(b"caf\xe9")
    rc, _, err = run(capsys, *make_argv(bad), "--model", ckpt)
    line = error_line(err)
    assert rc == 2 and f"{source} is not UTF-8 text (line 1, byte 3: unexpected end of data)" in line, line


@pytest.mark.parametrize("prompt", ["hello", "-"])
def test_prompt_argument_and_prompt_file_together_are_refused(prompt, ckpt, capsys, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("from the file", encoding="utf-8")
    rc, out, err = run(capsys, prompt, "--prompt-file", str(path), "--model", ckpt)
    line = error_line(err)
    assert rc == 2 and out == "" and "prompt argument and --prompt-file" in line and str(path) in line, line


def test_prompt_file_keeps_reading_as_text_mode_did(ckpt, capsys, tmp_path):
    """Read as bytes now (to name the file on bad bytes), the file still gets universal newlines."""
    crlf, lf = tmp_path / "crlf.txt", tmp_path / "lf.txt"
    crlf.write_bytes(PROMPT.encode() + b"\r\nsecond line\r\n")
    lf.write_bytes(PROMPT.encode() + b"\nsecond line\n")
    outputs = [run(capsys, "--prompt-file", str(p), "--model", ckpt, "--max-new-tokens", "8", "--json")[1]
               for p in (crlf, lf)]
    assert json.loads(outputs[0])["prompt_tokens"] == json.loads(outputs[1])["prompt_tokens"]
    assert json.loads(outputs[0])["text"] == json.loads(outputs[1])["text"]


def test_a_byte_order_mark_is_not_part_of_the_prompt(ckpt, capsys, monkeypatch, tmp_path):
    """A UTF-8 byte-order mark (Notepad's) before the prompt of a file or of stdin is skipped, as the eval prompt files
    skip it: the prompt is the same as without it, not one token longer."""
    argv = ["--model", ckpt, "--max-new-tokens", "4", "--json"]
    plain = json.loads(run(capsys, PROMPT, *argv)[1])
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf" + PROMPT.encode() + b"\n")
    from_file = json.loads(run(capsys, "--prompt-file", str(path), *argv)[1])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(path.read_bytes()), encoding="utf-8"))
    from_stdin = json.loads(run(capsys, *argv)[1])
    for doc in (from_file, from_stdin):
        assert (doc["prompt_tokens"], doc["text"]) == (plain["prompt_tokens"], plain["text"])
    assert plain["prompt_tokens"] == len(PROMPT)  # character tokenizer, no chat template


REFUSING_TEMPLATE = ("{% for m in messages %}{% if m['role'] != 'user' %}{{ raise_exception('Only user and assistant "
                     "roles are supported!') }}{% endif %}{{ m['content'] }} {% endfor %}")


def test_a_chat_template_that_refuses_the_messages_is_one_line(capsys, tmp_path):
    """Mistral-7B-Instruct v0.1's template raises on a system message (jinja2's TemplateError): one line quoting it
    and naming --system, exit code 2, no traceback."""
    from specdec.testing import build_tiny_tokenizer

    path = save_tiny_checkpoint(tmp_path / "refusing", tokenizer=False)
    tok = build_tiny_tokenizer()
    tok.chat_template = REFUSING_TEMPLATE
    tok.save_pretrained(path)
    rc, out, err = run(capsys, PROMPT, "--model", path, "--max-new-tokens", "2", "--system", "be brief")
    line = error_line(err)
    assert (rc, out) == (2, "") and "Only user and assistant roles are supported!" in line, line
    assert "drop --system" in line and "--no-chat-template" in line, line
    rc, out, _ = run(capsys, PROMPT, "--model", path, "--max-new-tokens", "2")  # the messages it takes: runs
    assert rc == 0 and out


# --- devices and model files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device, what", [
    ("tpu", "is not a device torch knows"),
    ("cuda:x", "is not a device torch knows"),
    ("meta", "holds no weights"),
    ("cuda:99", "cuda:99"),  # no CUDA here, or no 100th GPU there
])
def test_unusable_device_is_one_line_before_the_model_loads(device, what, ckpt, capsys, monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --device was checked")

    monkeypatch.setattr("specdec.models.loader.load_model", load_model)
    rc, _, err = run(capsys, "hi", "--model", ckpt, "--device", device)
    line = error_line(err)
    assert rc == 2 and "--device" in line and what in line, line


def test_a_tokenizer_that_is_not_the_models_is_named(capsys, tmp_path):
    """A tokenizer with more ids than the model's vocabulary (40 here, 70 characters) was reported as
    "input_ids: ... outside the vocabulary", of ids the user never gave; the line now names the mismatch."""
    from specdec.testing import build_tiny_model, build_tiny_tokenizer

    build_tiny_model(vocab_size=40).save_pretrained(tmp_path)
    build_tiny_tokenizer().save_pretrained(tmp_path)
    rc, _, err = run(capsys, "hello ZZZ", "--model", str(tmp_path), "--max-new-tokens", "2")
    line = error_line(err)
    assert rc == 2 and "the tokenizer and the model do not match" in line and "vocabulary of 40" in line, line


def test_a_prompt_token_id_equal_to_the_vocabulary_size_names_the_mismatch(capsys, tmp_path):
    """The model's vocabulary is exactly the prompt's largest id: ids 0..v-1 exist, so id v is outside it."""
    from specdec.testing import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    top = max(tok("hello world")["input_ids"])
    build_tiny_model(vocab_size=top).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    rc, _, err = run(capsys, "hello world", "--model", str(tmp_path), "--no-chat-template", "--max-new-tokens", "2")
    line = error_line(err)
    assert rc == 2 and "the tokenizer and the model do not match" in line, line
    assert f"prompt token id {top}, outside the model's vocabulary of {top}" in line, line


def gguf_bytes() -> tuple[bytes, int]:
    """A small but complete GGUF v3 file (metadata incl. a string array, two tensors), and where its data starts."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s.encode())) + s.encode()

    kv = [("general.architecture", 8, string("llama")),
          ("general.alignment", 4, struct.pack("<I", 64)),
          ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + string("a") + string("b") + string("c")),
          ("llama.rope.dimension_sections", 9, struct.pack("<IQ", 5, 4) + struct.pack("<4i", 1, 2, 3, 4))]
    tensors = [("token_embd.weight", (16, 4), 0, 256), ("blk.0.attn_q.weight", (64,), 1, 128)]  # f32, f16
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for key, value_type, value in kv:
        head += string(key) + struct.pack("<I", value_type) + value
    offset = 0
    for name, dims, ggml_type, nbytes in tensors:
        head += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        head += struct.pack("<IQ", ggml_type, offset)
        offset += nbytes
    head += b"\0" * (-len(head) % 64)
    return head + bytes(i % 256 for i in range(offset)), len(head)


def test_check_gguf_passes_a_complete_file_and_names_a_truncated_one(tmp_path):
    data, data_start = gguf_bytes()
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    check_gguf(path)  # complete: no error
    try:  # the file really is GGUF, as the reference reader sees it
        from gguf import GGUFReader
    except ImportError:
        pass
    else:
        reader = GGUFReader(path)
        assert [t.name for t in reader.tensors] == ["token_embd.weight", "blk.0.attn_q.weight"]
        assert reader.data_offset == data_start
    for cut in (3, 20, 60, data_start - 5, data_start + 10, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=rf"^{path} is truncated: .* \(an interrupted download or copy\?\)$|"
                                            rf"^{path} is truncated: {cut} bytes, less than a GGUF header$"):
            check_gguf(path)
    path.write_bytes(b"PK\x03\x04" + data[4:])
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        check_gguf(path)


@pytest.mark.parametrize("cut", ["header", "tensor table", "tensor data", "complete"])
def test_truncated_gguf_model_is_one_line_naming_the_file(cut, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    data, data_start = gguf_bytes()
    size = {"header": 40, "tensor table": data_start - 5, "tensor data": len(data) - 1, "complete": len(data)}[cut]
    path = tmp_path / "broken.gguf"
    path.write_bytes(data[:size])
    rc, out, err = run(capsys, "hi", "--model", str(path))
    line = error_line(err)
    assert rc == 2 and out == "" and str(path) in line, line
    # a complete file that is no model transformers can convert is named too (this one: by its missing tokenizer type)
    assert ("no tokenizer type (tokenizer.ggml.model)" if cut == "complete" else "is truncated") in line, line
    assert not any((tmp_path / "cache").rglob("*.safetensors"))  # nothing half-converted left behind


def test_a_prompt_the_tokenizer_makes_nothing_of_is_one_line_naming_it(capsys, tmp_path, monkeypatch):
    """A GGUF whose vocabulary holds no piece of the prompt (and no chat template) said "prompt 0 is empty: every
    prompt needs at least one token" of a prompt the user gave whole: the line now names the prompt and why."""
    pytest.importorskip("gguf")
    from tests.test_gguf_llama import write_llama_gguf

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf")  # tokens t0 .. t47
    rc, out, err = run(capsys, "hello", "--model", str(path))
    assert rc == 2 and out == "" and error_line(err) == (
        "specdec generate: error: the model's tokenizer encodes the prompt 'hello' to no token (no chat template "
        "applied, and no piece of the text in its vocabulary): give a model whose tokenizer encodes text")
    rc, out, err = run(capsys, "t1t5", "--model", str(path), "--max-new-tokens", "2")
    assert rc == 0 and out.startswith("t"), err


# --- Ctrl-C -------------------------------------------------------------------------------------------------------


def test_ctrl_c_keeps_the_streamed_text_and_exits_130(ckpt, capsys, monkeypatch):
    from specdec.cli import _TextStream

    stream_call = _TextStream.__call__

    def interrupted_after_three_tokens(self, seq_index, new_tokens):
        stream_call(self, seq_index, new_tokens)
        if len(self.tokens) >= 3:
            raise KeyboardInterrupt  # what Python's SIGINT handler raises

    monkeypatch.setattr(_TextStream, "__call__", interrupted_after_three_tokens)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "50")
    assert rc == 130
    assert out == greedy_text(ckpt, 3) + "\n"  # the three streamed tokens, kept, and the line ended
    assert "Traceback" not in err and err.splitlines()[-1] == "specdec generate: interrupted"


def test_an_error_mid_generation_ends_the_streamed_line_first(ckpt, capsys, monkeypatch):
    """A KV cache that fills after three streamed tokens: the text is kept and its line ended, and the error is a
    line of its own (it was printed right after the text, on the same terminal line)."""
    from specdec.cli import _TextStream
    from specdec.kv_cache import CacheFullError

    stream_call = _TextStream.__call__

    def full_after_three_tokens(self, seq_index, new_tokens):
        stream_call(self, seq_index, new_tokens)
        if len(self.tokens) >= 3:
            raise CacheFullError("KV cache out of blocks")

    monkeypatch.setattr(_TextStream, "__call__", full_after_three_tokens)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "50")
    assert rc == 2 and out == greedy_text(ckpt, 3) + "\n"
    assert err.splitlines()[-1].startswith("specdec generate: error: KV cache out of blocks")


def test_an_error_or_ctrl_c_before_the_first_token_leaves_stdout_empty(ckpt, capsys, monkeypatch):
    """Nothing streamed, no line to end: stdout stays empty (it used to get a lone newline, so `> out.txt` of a
    failed call held an empty line)."""
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--num-blocks", "1")  # the prompt's prefill runs out
    assert (rc, out) == (2, "") and "--num-blocks" in error_line(err), err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", interrupted)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt)
    assert (rc, out) == (130, "") and err.splitlines()[-1] == "specdec generate: interrupted"


def test_ctrl_c_with_json_leaves_stdout_empty(ckpt, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", interrupted)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--json")
    assert (rc, out) == (130, "") and err.splitlines()[-1] == "specdec generate: interrupted"


def test_ctrl_c_in_another_subcommand_is_one_line_too(capsys, monkeypatch, tmp_path):
    """main() handles Ctrl-C for every subcommand it dispatches: `specdec eval lossless` interrupted in its load."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("specdec.models.loader.load_model", interrupted)
    try:
        rc = main(["eval", "lossless", "--model", "whatever", "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main()")
    err = capsys.readouterr().err
    assert rc == 130 and "Traceback" not in err and err.splitlines()[-1] == "specdec eval lossless: interrupted"


SIGINT_AFTER_THREE_TOKENS = """
import os, signal, sys
import specdec.cli as cli
stream_call = cli._TextStream.__call__
def call(self, seq_index, new_tokens):
    stream_call(self, seq_index, new_tokens)
    if len(self.tokens) == 3:
        os.kill(os.getpid(), signal.SIGINT)
cli._TextStream.__call__ = call
sys.exit(cli.main(sys.argv[1:]))
"""


def test_real_sigint_exits_130_with_one_line(ckpt):
    """A real SIGINT (sent by the process to itself after the third streamed token, so no timing is involved)."""
    proc = subprocess.run(
        [sys.executable, "-c", SIGINT_AFTER_THREE_TOKENS, "generate", PROMPT, "--model", ckpt, "--max-new-tokens",
         "50"], capture_output=True, text=True, env=ENV, timeout=300,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal, not a `&` job
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stdout == greedy_text(ckpt, 3) + "\n"
    assert "Traceback" not in proc.stderr and proc.stderr.splitlines()[-1] == "specdec generate: interrupted"


SIGTERM_AFTER_THREE_STEPS = """
import os, signal, sys
import specdec.cli as cli
from specdec.engine import Engine
step, calls = Engine.step, []
def terminated_after_three_steps(self):
    calls.append(1)
    if len(calls) > 3:  # plain greedy decoding: one token a step
        os.kill(os.getpid(), signal.SIGTERM)
    return step(self)
Engine.step = terminated_after_three_steps
sys.exit(cli.main(sys.argv[1:]))
"""


def test_sigterm_with_json_writes_the_tokens_generated_so_far(ckpt):
    """`timeout`, a scheduler or `kill` send SIGTERM, which ended `specdec generate --json` with an empty stdout and
    no line: the tokens generated were lost. It takes Ctrl-C's path now (exit 143, as the shell reports SIGTERM)."""
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_AFTER_THREE_STEPS, "generate", PROMPT, "--model", ckpt, "--max-new-tokens",
         "50", "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 143, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["finish"], doc["new_tokens"], doc["text"]) == ("interrupted", 3, greedy_text(ckpt, 3))
    assert "Traceback" not in proc.stderr and proc.stderr.splitlines()[-1] == "specdec generate: terminated (SIGTERM)"


def test_json_cut_short_by_a_full_kv_cache_keeps_the_tokens(ckpt, capsys):
    """Under --json the tokens generated before the KV cache ran out are the document's (they were not printed
    "above"), with finish "cache_full"; the error line and exit code 2 follow as without --json."""
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "40", "--block-size", "4",
                       "--num-blocks", "14", "--json")
    line = error_line(err)
    assert rc == 2 and out.count("\n") == 1, (out, err)
    doc = json.loads(out)
    assert doc["finish"] == "cache_full" and 0 < doc["new_tokens"] < 40
    assert doc["text"] == greedy_text(ckpt, doc["new_tokens"])
    assert doc["tau"] is doc["steps"] is doc["acceptance_per_depth"] is None
    full = json.loads(run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "2", "--json")[1])
    assert list(doc) == list(full)  # the same fields, in the same order
    assert f"after {doc['new_tokens']} new tokens (in the JSON document)" in line and "kept above" not in line, line


def test_ctrl_c_with_json_writes_the_tokens_generated_so_far(ckpt, capsys, monkeypatch):
    from specdec.engine import Engine

    expected = greedy_text(ckpt, 3)
    step = Engine.step
    calls = []

    def interrupted_after_three_steps(self):
        calls.append(1)
        if len(calls) > 3:  # plain greedy decoding: one token a step
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_after_three_steps)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "50", "--json")
    assert rc == 130 and err.splitlines()[-1] == "specdec generate: interrupted", err
    doc = json.loads(out)
    assert (doc["finish"], doc["new_tokens"], doc["text"]) == ("interrupted", 3, expected)


# --- stdout -------------------------------------------------------------------------------------------------------


def test_json_stdout_is_exactly_one_document(ckpt, capsys, monkeypatch):
    generate_module = importlib.import_module("specdec.generate")  # `specdec.generate` is also the function
    real_generate = generate_module.generate

    def noisy_generate(*args, **kwargs):  # a library print during the run must not reach stdout
        print("noise from a library")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(generate_module, "generate", noisy_generate)
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "12", "--json")
    assert rc == 0
    doc = json.loads(out)  # the whole of stdout is one JSON document
    assert out.count("\n") == 1 and out.endswith("}\n")
    assert doc["text"] == greedy_text(ckpt, 12)
    assert doc["new_tokens"] == 12 and doc["finish"] == "length" and doc["drafter"] == "none"
    assert "noise from a library" in err and not err.lstrip().startswith("{")


def test_closed_pipe_is_silent(ckpt):
    """`specdec generate ... | head -c 5`: the reader leaves; no `error: [Errno 32] Broken pipe`, no traceback,
    exit code 141 as for a process killed by SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", PROMPT, "--model", ckpt,
                             "--max-new-tokens", "8"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                            text=True)
    proc.stdout.close()  # before the child writes anything: its first write of the text fails
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141, err
    assert "error" not in err and "Traceback" not in err and "Exception ignored" not in err, err


class _FullStdout(io.StringIO):
    """stdout on a full disk (``> /dev/full``): `fails` ("write" or "flush") raises ENOSPC."""

    def __init__(self, fails: str) -> None:
        super().__init__()
        self.fails = fails

    def write(self, text: str) -> int:
        return self._full() if self.fails == "write" else super().write(text)

    def flush(self) -> None:
        return self._full() if self.fails == "flush" else super().flush()

    @staticmethod
    def _full():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_stdout_is_one_line_naming_stdout(ckpt, capsys, monkeypatch):
    """`specdec generate ... > /dev/full`: the line said only "[Errno 28] No space left on device", which reads as
    the failure of the command's own files (export-head's export, eval's report, written whole); it names stdout."""
    monkeypatch.setattr(sys, "stdout", _FullStdout("write"))
    assert main(["generate", PROMPT, "--model", ckpt, "--max-new-tokens", "4"]) == 2
    assert error_line(capsys.readouterr().err) == ("specdec generate: error: cannot write to stdout (No space left on "
                                                   "device): the output printed there is lost")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["eval", "replay", "--help"]])
def test_help_and_version_on_a_full_stdout_say_so(argv, capsys, monkeypatch):
    """argparse drops a failed write of --help / --version: ``specdec --help > /dev/full`` exited 0 having written
    nothing; it is one line naming stdout, as a command's output is."""
    monkeypatch.setattr(sys, "stdout", _FullStdout("write"))
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    name = " ".join(["specdec"] + argv[:-1])
    assert capsys.readouterr().err == (f"{name}: error: cannot write to stdout (No space left on device): the output "
                                       "printed there is lost\n")


def test_output_still_buffered_when_the_command_ends_is_flushed_and_its_failure_said(capsys, monkeypatch):
    """A command's last lines, printed but not yet flushed when it returned 0, failed on a full stdout only at exit,
    as Python's "Exception ignored ... OSError" (exit code 120); the command flushes them and says so in one line."""
    def printed(args):
        print("wrote the result")
        return 0

    monkeypatch.setattr(specdec.cli, "_run_generate", printed)
    monkeypatch.setattr(sys, "stdout", _FullStdout("flush"))
    assert main(["generate", "hello"]) == 2
    assert "error: cannot write to stdout (No space left on device)" in error_line(capsys.readouterr().err)


@pytest.mark.parametrize("command, extra", [(["eval", "acceptance"], "eval"), (["train-medusa"], "train")])
def test_a_missing_extra_is_one_line_naming_the_install(command, extra, capsys, monkeypatch):
    """A package of an extra that is not installed (here: made to look missing) is a one-line error saying which
    extra to install, not a traceback."""
    import specdec.eval.cli as eval_cli
    import specdec.train.cli as train_cli

    def missing(args):
        raise ModuleNotFoundError("No module named 'scipy'", name="scipy")

    monkeypatch.setattr(eval_cli, "run_acceptance", missing)
    monkeypatch.setattr(train_cli, "run", missing)
    code = main(command + (["--drafters", "ngram"] if command[0] == "eval" else ["--output-dir", "x"]))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "'scipy' is missing" in err and f"specdec[{extra}]" in err


def test_an_error_names_the_full_subcommand(capsys, tmp_path):
    """`specdec eval replay run` fails as itself, not as `specdec eval`: the line names the command typed."""
    record = tmp_path / "record.json"
    record.write_text("{}")
    assert main(["eval", "replay", "run", "--record", str(record)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("specdec eval replay run: error: ") and str(record) in line, line


def test_a_kv_cache_full_mid_generation_speaks_of_the_cli_options(ckpt, capsys):
    """The library's CacheFullError says "pass a larger num_blocks ... in this error's new_tokens": on the command
    line the tokens are the text printed above, and the option is --num-blocks."""
    rc, out, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "40", "--block-size", "4",
                       "--num-blocks", "14")
    line = err.splitlines()[-1]
    assert rc == 2 and out.strip() and out.endswith("\n"), (out, err)
    assert line.startswith("specdec generate: error: the KV cache ran out of blocks after ") and "kept above" in line
    assert "--num-blocks 14 is too few" in line and "new_tokens" not in line and "num_blocks" not in line, line


def test_a_kv_cache_warning_names_the_cli_options(ckpt, capsys, caplog):
    """The library's warning that --num-blocks may run short, just above the error line, named generate()'s
    arguments (num_blocks=14, max_new_tokens=40, CacheFullError's new_tokens): it names the flags, as the error does."""
    with caplog.at_level(logging.WARNING, logger="specdec.engine_setup"):
        rc, _, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "40", "--block-size", "4",
                       "--num-blocks", "14")
    warning = next(r.getMessage() for r in caplog.records if r.name == "specdec.engine_setup")
    assert rc == 2 and "--num-blocks 14 is below the " in warning and "--max-new-tokens 40 can need" in warning
    assert "the run may stop with the KV cache full" in warning and "_" not in warning, warning


def test_warnings_of_ignored_flags_name_the_flags(ckpt, capsys, caplog):
    """Sampling and speculation flags that change nothing were warned about as generate()'s arguments ("do_sample is
    False ... top_k=5, sampler='coupled'; pass do_sample=True (the CLI's --do-sample)"): they are said as typed."""
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        rc, out, _ = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "2", "--top-k", "5", "--sampler",
                         "coupled", "--speculation", "always")
    warnings = [r.getMessage() for r in caplog.records if r.name == "specdec.generate"]
    assert rc == 0 and out and warnings == [
        "without --do-sample (greedy decoding), so these sampling options are ignored: --top-k 5, --sampler coupled; "
        "pass --do-sample to sample",
        "no drafter, so these speculation options are ignored: --speculation always; pass --drafter NAME to speculate"]


def test_a_drafters_refusal_inside_generate_keeps_its_options_name(ckpt, capsys, monkeypatch):
    """A refusal from inside generate() names --max-new-tokens for max_new_tokens, but its top_k is a drafter's
    option (the sampling flags are checked before): "--top-k" would send the user to the wrong flag."""
    from specdec.errors import InputError

    def refuse(*args, **kwargs):
        raise InputError("eagle: top_k=10 exceeds the draft vocabulary of 8 tokens; lower max_new_tokens")

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", refuse)
    rc, _, err = run(capsys, PROMPT, "--model", ckpt, "--max-new-tokens", "2")
    assert (rc, err.strip()) == (2, "specdec generate: error: eagle: top_k=10 exceeds the draft vocabulary of 8 "
                                    "tokens; lower --max-new-tokens"), err


@pytest.mark.parametrize("command, option", [
    (["train-medusa", "--num-prompts", "2"], "--output-dir"),
    (["train-eagle", "--num-prompts", "2"], "--output-dir"),
    (["export-head", "HEAD", "--format", "vllm"], "--output-dir"),
    (["convert-medusa", "HEAD"], "--output-dir"),
    (["eval", "lossless", "--levels", "exact"], "--out"),
    (["eval", "acceptance", "--prompts", "1"], "--out"),
])
def test_an_output_folder_behind_a_file_is_one_line_before_any_work(command, option, capsys, monkeypatch, tmp_path):
    """`--output-dir results/heads` where `results` is a file: train-* and export-head said only
    "[Errno 20] Not a directory: 'results/heads'" (train-* after loading the model), naming no option."""
    import specdec.models.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    (tmp_path / "HEAD").mkdir()
    (tmp_path / "results").write_text("a file")
    monkeypatch.chdir(tmp_path)
    assert main([*command, option, "results/heads"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.endswith(
        f": error: {option} results/heads: cannot create it (results is a file, not a folder)"), line


def test_a_record_folder_behind_a_file_is_named_as_such(capsys, monkeypatch, tmp_path):
    """It said "cannot create its folder results (File exists)", as if the folder existed."""
    (tmp_path / "results").write_text("a file")
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "replay", "record", "--out", "results/run.json"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.endswith("--out results/run.json: cannot create its folder results (results is a file, not a "
                         "folder)"), line


@pytest.mark.parametrize("command, option", [
    (["generate", "hi"], "--model"),
    (["generate"], "--prompt-file"),
    (["train-medusa", "--output-dir", "heads"], "--model"),
    (["train-medusa"], "--output-dir"),
    (["train-eagle"], "--output-dir"),
    (["train-medusa", "--output-dir", "heads"], "--data"),
    (["train-eagle", "--output-dir", "heads"], "--prompts-file"),
    (["convert-medusa", "HEAD"], "--output-dir"),
    (["convert-medusa", "HEAD", "--output-dir", "out"], "--base-model"),
    (["export-head", "HEAD", "--format", "vllm"], "--output-dir"),
    (["export-head", "HEAD", "--format", "vllm", "--output-dir", "out"], "--target"),
    (["eval", "lossless"], "--out"),
    (["eval", "acceptance"], "--out"),
    (["eval", "acceptance"], "--model"),
    (["eval", "acceptance"], "--prompts-file"),
    (["eval", "replay", "record"], "--out"),
    (["eval", "replay", "record", "--out", "run.json"], "--prompts-file"),
    (["eval", "replay", "run"], "--record"),
    (["eval", "replay", "bound"], "--record"),
    (["eval", "replay", "run", "--record", "run.json"], "--verify-costs"),
])
def test_an_empty_path_is_refused_by_the_options_name(command, option, capsys, monkeypatch, tmp_path):
    """`--output-dir "$OUT"` with OUT unset: train-*, convert-medusa and export-head wrote into the working folder,
    eval --out '' and --prompts-file '' ran as if the option were left out (runs/eval-*, the built-in prompts)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main([*command, option, ""])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and f"error: argument {option}: the empty string names no file or folder" in line, line
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_before_a_command_runs_is_one_line_and_exit_130(capsys, monkeypatch):
    """Ctrl-C during the seconds of imports, before any command's handler: 130 (128 + SIGINT), as within one."""
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(specdec.cli, "_main", interrupted)
    assert main(["generate", "hello"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def test_a_closed_stdout_is_a_usage_error_with_exit_code_2(capsys, monkeypatch):
    """`specdec generate ... >&-`: Python sets sys.stdout to None; the text would be lost, so refuse, exit code 2."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["generate", "hello"]) == 2
    assert "stdout is closed" in capsys.readouterr().err
