"""The ``specdec`` command line: ``specdec generate``, ``specdec train-medusa``, ``specdec eval``.

Subcommands other than ``generate`` live next to their code: a module listed in
``SUBCOMMAND_MODULES`` exposes ``add_parser(subparsers)``, which registers its parser
and sets ``func`` to the function that runs it.

    specdec generate "Write a haiku about caches."            # embedded default model
    echo "prompt" | specdec generate --drafter ngram --max-new-tokens 256
    specdec generate --prompt-file doc.txt --model ./my-llama --do-sample --temperature 0.7

The text streams to stdout; a one-line summary (tokens, tokens/s, tau) goes to stderr. With
``--json``, stdout carries exactly one JSON document (the text and the summary) and nothing else.
Errors meant for the user (bad options, unknown model or drafter, a prompt that is not UTF-8
text, a truncated .gguf, a drafter's malformed proposal, KV cache out of blocks...) print one line
``specdec <command>: error: ...``, naming the full command (``specdec eval replay run: error: ...``),
and exit with code 2; Ctrl-C keeps the text streamed so far, prints ``specdec <command>: interrupted``
and exits with code 130 (``generate`` takes SIGTERM, from ``timeout`` or a scheduler, alike: ``terminated (SIGTERM)``,
code 143). With ``--json``, a generation that the KV cache, Ctrl-C or SIGTERM cuts short still writes its document,
of the text generated so far, with ``finish`` ``cache_full`` or ``interrupted``. ``-v`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Collection, Mapping
from pathlib import Path

from specdec import __version__
from specdec.errors import SpecdecError, not_utf8_at, other_unicode
from specdec.help_format import name_commands, path_arg
from specdec.models.embedded import DEFAULT_ALIAS
from specdec.sigterm import exit_code, how_stopped, sigterm_as_interrupt

SUBCOMMAND_MODULES = ("specdec.train.cli", "specdec.eval.cli", "specdec.drafters.cli")


class CLIError(SpecdecError):
    """A problem with what the user asked for on the command line."""


class StdoutError(SpecdecError, OSError):
    """stdout cannot be written (``> /dev/full``, a full disk): the output printed there is lost."""


# library errors that are the user's to fix: one line and exit code 2, no traceback. SpecdecError is every error
# specdec raises on purpose (specdec.errors: CacheFullError, DraftError, GGUFError, ...); ValueError still covers
# the builtin checks of bad input; OSError covers missing files and unknown model paths.
USER_ERRORS = (CLIError, SpecdecError, ValueError, OSError)
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices, torch attribute names
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token, as tokenizers' ByteFallback decoder reads it


class _TextStream:
    """Decodes a growing token list and prints only the new, complete characters.

    Each call decodes a window, the tokens since the last print but one: the text of the tokens before the last
    print anchors it (a leading space, a character cut in two), and what follows the anchor is new. Decoding the
    whole list at every call cost time in proportion to the text so far (quadratic in an 8k-token answer); where a
    window's text does not begin with its anchor, the whole list is decoded once.

    Text that a later token may still change is held back, so that what is printed is the final decode's text (the
    ``--json`` text): an incomplete UTF-8 sequence at the end (U+FFFD), a run of byte-fallback tokens (``<0xNN>``,
    Llama's and Mistral's), which the decoder turns into U+FFFDs *as a whole*, ASCII bytes included, where the run
    is not valid UTF-8, and a call that printed nothing (a SentencePiece decoder strips a lone "▁" at the text's end
    and at its start: the window's start moved past it lost its space)."""

    kept = "kept above"  # where the tokens of a run cut short are

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer, self.out = tokenizer, out if out is not None else sys.stdout
        self.tokens: list[int] = []
        self.printed = 0  # characters printed
        self.start = self.read = 0  # the window's first token; the tokens before read are printed

    def __call__(self, seq_index: int, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        self._print(final=False)

    def finish(self) -> None:
        """Print what is left (an incomplete UTF-8 sequence at the very end included) and a newline."""
        self._print(final=True)
        self.out.write("\n")
        self.out.flush()

    def _print(self, final: bool) -> None:
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        anchor, window = decode(self.tokens[self.start:self.read]), decode(self.tokens[self.start:])
        new = window[len(anchor):] if window.startswith(anchor) else decode(self.tokens)[self.printed:]
        if not final and (not new or new.endswith("\ufffd") or self._in_byte_run()):  # may change: wait (class doc)
            return
        self.out.write(new)
        self.out.flush()
        self.printed += len(new)
        self.start, self.read = self.read, len(self.tokens)

    def _in_byte_run(self) -> bool:
        """Whether the last token is a byte-fallback token, whose run of bytes a later one may turn into U+FFFDs."""
        to_tokens = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        return to_tokens is not None and BYTE_TOKEN.fullmatch(str(to_tokens(self.tokens[-1]))) is not None


class _Collected:
    """A streamer that keeps the tokens without printing them (--json), for a run cut short."""

    kept = "in the JSON document"

    def __init__(self, tokenizer) -> None:
        self.tokens: list[int] = []

    def __call__(self, seq_index: int, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)

    def finish(self) -> None:
        pass


def _decode(data: bytes, source: str, hint: str = "convert it first, e.g. with iconv -t UTF-8") -> str:
    """`data` as UTF-8 text with universal newlines (as a text-mode read gives it) and without a leading byte-order
    mark (as the eval prompt files are read), or a CLIError naming `source` and where the first offending byte is
    (its line and byte, as every refusal of a text file says it: :func:`specdec.errors.not_utf8_at`)."""
    if (other := other_unicode(data)) is not None:  # text, whose NUL bytes said "looks binary"
        raise CLIError(f"{source} is {other} text (by its byte-order mark); the prompt must be UTF-8 text: convert it "
                       f"first, e.g. with iconv -f {other} -t UTF-8")
    if b"\x00" in data:
        raise CLIError(f"{source} looks binary (it contains NUL bytes); the prompt must be UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CLIError(f"{source} is not UTF-8 text ({not_utf8_at(data, err)}); {hint}") from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _check_argument(value: str, source: str) -> str:
    """A command-line string as valid text. Python hands undecodable argv bytes over as surrogate escapes,
    which a tokenizer cannot encode: name the argument and the byte instead."""
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        pass
    try:
        raw = os.fsencode(value)  # the original argv bytes
    except UnicodeEncodeError:  # a lone surrogate that did not come from argv bytes
        raise CLIError(f"{source} is not valid text (it contains a lone surrogate)") from None
    return _decode(raw, source, hint="is the terminal's encoding UTF-8?")


def _read_prompt(args) -> tuple[str, str]:
    """`(prompt, where it came from)`: the argument, --prompt-file, or stdin, less the one trailing newline a file
    or `echo` ends with (the argument is taken as it is)."""
    text, where = _read_prompt_text(args)
    return (text[:-1] if where != "the prompt argument" and text.endswith("\n") else text), where


def _read_prompt_text(args) -> tuple[str, str]:
    if args.prompt_file is not None and args.prompt is not None:
        raise CLIError(f"got a prompt argument and --prompt-file {args.prompt_file!r}: give the prompt one way only")
    if args.prompt_file is not None:
        where = f"--prompt-file {args.prompt_file!r}"
        try:
            with open(args.prompt_file, "rb") as f:
                return _decode(f.read(), where), where
        except OSError as err:  # (argparse takes --prompt for an abbreviation of --prompt-file)
            raise CLIError(f"{where}: cannot read it ({err.strerror or err}); to give the prompt itself, pass it "
                           "as the argument") from None
    if args.prompt is not None and args.prompt != "-":
        return _check_argument(args.prompt, "the prompt argument"), "the prompt argument"
    stdin = sys.stdin
    if stdin is None or stdin.closed:  # `specdec generate 0<&-`: Python sets sys.stdin to None
        raise CLIError("no prompt: stdin is closed; give a prompt as an argument or with --prompt-file")
    if args.prompt is None and stdin.isatty():
        raise CLIError("give a prompt as an argument, with --prompt-file, or on stdin")
    buffer = getattr(stdin, "buffer", None)  # absent on a StringIO standing in for stdin
    return (_decode(buffer.read(), "stdin") if buffer is not None else stdin.read().removeprefix("\ufeff")), "stdin"


def _check_device(spec: str):
    """`spec` as a torch.device this torch can allocate on, checked before the (slow) model load."""
    from specdec.models.loader import check_device

    return check_device(spec, "--device")  # the meta device too is refused there, as load_model(device=) refuses it


# transformers' sampling warpers other than top_k / top_p: flag -> off value, in the order they apply
# (specdec.sampling.WARPERS, written out here: importing specdec.sampling loads torch, which the CLI defers)
WARPER_FLAGS = {"top_h": None, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0}


def flag_value(name: str, value):
    """A generation flag's value as generate() takes it: ``--top-h 0`` is ``top_h=None`` (off), the value a command
    line cannot type (no top-h setting is 0), so that it can turn off a model's own top_h."""
    return None if name == "top_h" and value == 0 else value


def add_warper_flags(p, default: str) -> None:
    """--min-p, --typical-p, --epsilon-cutoff, --eta-cutoff, --top-h; ``default`` starts each help's default."""
    helps = {"min_p": "keep probabilities >= MIN_P x the largest one",
             "typical_p": "typical sampling: the most locally typical tokens up to this mass",
             "epsilon_cutoff": "keep probabilities >= EPSILON_CUTOFF",
             "eta_cutoff": "keep probabilities >= min(ETA, sqrt(ETA) exp(-entropy))",
             "top_h": "top-h: the most likely tokens within TOP_H x the entropy (applied before top-k); 0: off"}
    for name, off in WARPER_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=None if default else off,
                       help=f"{helps[name]}; default: {default}{'off' if off is None else f'{off:g} (off)'}")


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, plainly or speculatively",
                       description="Generate text from a prompt and print it with its speed.")
    p.add_argument("prompt", nargs="?", help="the prompt ('-' or omitted: read stdin, less one trailing newline)")
    p.add_argument("--prompt-file", type=path_arg, help="read the prompt from this file (less one trailing newline)")
    p.add_argument("--model", default=DEFAULT_ALIAS, type=path_arg,
                   help=f"checkpoint directory, .gguf file or alias (default: {DEFAULT_ALIAS})")
    p.add_argument("--drafter", default=None, type=lambda name: None if name == "none" else name,  # as --json says
                   help="drafter name, e.g. ngram (default: none, plain decoding)")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option, repeatable; VALUE parsed as JSON when possible")
    # unset, these five are the model's generation_config's (as in generate()), else the defaults named here
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="new tokens at most (default: the model's generation_config, else 128)")
    p.add_argument("--do-sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of greedy decoding (default: the model's generation_config, else greedy)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config, else 1")
    p.add_argument("--top-k", type=int, default=None,
                   help="default: the model's generation_config, else transformers' 50; 0: off")
    p.add_argument("--top-p", type=float, default=None, help="default: the model's generation_config, else 1 (off)")
    add_warper_flags(p, "the model's generation_config, else ")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the sampling: one text per seed (default: none, torch's global generator)")
    p.add_argument("--stop", action="append", default=None,
                   help="stop string, repeatable; kept in the output, as in transformers; \\n, \\t, \\r and \\\\ "
                        "in it are a newline, tab, carriage return and backslash")
    p.add_argument("--no-stop", action="store_true",
                   help="no stop strings: not the model's own (its generation_config's stop_strings), which --stop "
                        "replaces")
    p.add_argument("--no-chat-template", action="store_true",
                   help="feed the prompt as raw text, with the tokenizer's own special tokens (default: as the user "
                        "message of the model's chat template, with the assistant's turn opened, where its tokenizer "
                        "has one; else raw text)")
    p.add_argument("--system", default=None,
                   help="system message for the chat template; \"\" gives an empty one (default: none given, so "
                        "the template's own, if it has one: SmolLM2's adds a default system message)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default: 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache size in blocks (default: enough for the prompt, max-new-tokens and the drafts)")
    p.add_argument("--speculation", choices=("auto", "always"), default="auto",
                   help="auto (default): verify the part of each draft that the measured cost model expects to pay, "
                        "decode plainly when none does; always: verify every proposed draft whole (measurements)")
    p.add_argument("--sampler", choices=("standard", "coupled"), default="standard",
                   help="with --do-sample: standard (default) exact rejection sampling; coupled: Gumbel-max noise "
                        "keyed by seed, prompt and position, so a --seed prints the same text with or without a "
                        "drafter (in float32, or with --invariant)")
    p.add_argument("--invariant", action="store_true",
                   help="bit-exact mode: the target computes every row as a one-row forward would, so the text is "
                        "byte-identical to plain decoding's with any drafter, in any dtype (docs/bit-exact.md)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights / activations dtype (default: float32; with --device cuda the half dtype a checkpoint "
                        "declares, else bfloat16)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay the verify forward as CUDA graphs (default: on with --device cuda, off elsewhere; "
                        "see docs/gpu/kernels.md)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (the text and the summary) to stdout instead of streaming the text")
    p.set_defaults(func=_run_generate)


# unset: the model's config
GENERATION_FLAGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", *WARPER_FLAGS)


def flagged_sampling(make, *args, **kwargs):
    """``make(*args, **kwargs)`` (a SamplingConfig, a replay's RecordConfig), a refusal of a generation flag said as
    the command line spells it: such a message begins with the field's name (specdec.sampling)."""
    try:
        return make(*args, **kwargs)
    except SpecdecError as err:
        name, _, rest = str(err).partition(" ")
        if name not in GENERATION_FLAGS:
            raise
        rest = rest.replace("use do_sample=False", "drop --do-sample").replace("be None (None disables it)",
                                                                                 "be 0 (off)")
        raise CLIError(f"--{name.replace('_', '-')} {rest}") from err


# generate()'s arguments that the flags of the same names set (--max-new-tokens): a message naming one names the flag
# where the command has it; those that are also words (speculation, sampler) only where a value follows them
NAMED_FLAGS = ("max_new_tokens", "num_blocks", "block_size", "top_k", "top_p", *WARPER_FLAGS)
VALUED_FLAGS = ("temperature", "sampler", "speculation", "seed")
ARGUMENT_FLAGS = re.compile(rf"(?<![\w/.-])(?:({'|'.join(NAMED_FLAGS)})(?:=|(?![\w/=-]|\.\w))|"
                            rf"({'|'.join(VALUED_FLAGS)})=)('([^'\s]*)')?")


# the flags whose arguments a refusal from inside generate() names as the user's: the sampling flags are checked
# before it runs (flagged_sampling), so a later one naming top_k or seed is a drafter's, about its own option
SIZE_FLAGS = ("--max-new-tokens", "--num-blocks", "--block-size")


# what generate()'s messages tell a Python caller -> (the flag it needs, or None; as the command line meets it)
API_PHRASES = {"the call may raise CacheFullError (with the tokens generated so far in its new_tokens)":
               (None, "the run may stop with the KV cache full (the text generated until then is kept)"),
               "do_sample is False (greedy decoding)": ("--do-sample", "without --do-sample (greedy decoding)"),
               "do_sample=True": ("--do-sample", "--do-sample"), "do_sample=False": ("--do-sample", "--no-do-sample"),
               "drafter=...": ("--drafter", "--drafter NAME")}


def said_as_flags(message: str, flags: Collection[str] | None = None, options: Collection[str] = (),
                  renamed: Mapping[str, str] | None = None) -> str:
    """``message`` with generate()'s argument names as the command line spells them (``num_blocks=2``:
    ``--num-blocks 2``, ``sampler='coupled'``: ``--sampler coupled``), and its words for a Python caller
    (API_PHRASES) as the command line meets them; only those of ``flags``, the command's options (None: every one,
    as ``specdec generate`` has them), and none of ``options``, the --drafter-option keys given (an EAGLE head's
    ``top_k=10`` is the KEY the user typed, not --top-k). ``renamed``: an argument -> the flag that sets it where
    that is spelt otherwise (a train command's ``--distill-max-new-tokens`` for ``max_new_tokens``)."""
    def said(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        flag = (renamed or {}).get(name) or "--" + name.replace("_", "-")
        if flags is not None and flag not in flags or name in options:
            return m.group(0)
        if m.group(3) is not None:  # a quoted value: as typed
            return f"{flag} {m.group(4)}"
        return flag + (" " if m.group(0).endswith("=") else "")

    for api, (flag, cli) in API_PHRASES.items():
        if flag is None or flags is None or flag in flags:
            message = message.replace(api, cli)
    return ARGUMENT_FLAGS.sub(said, message)


def drafter_option_keys(args) -> set[str]:
    """The keys of the --drafter-option values given, as Python names (``medusa.top-k=2``: top_k)."""
    pairs = getattr(args, "drafter_option", None) or ()  # a command without --drafter-option has none
    return {pair.partition("=")[0].rpartition(".")[2].replace("-", "_") for pair in pairs}


class _SaidAsFlags(logging.Filter):
    """A handler's filter: the text of a library record said as the command line spells it (:func:`said_as_flags`
    with ``flags``); applying it twice changes nothing (``--num-blocks`` is not matched again)."""

    def __init__(self, flags: Collection[str], options: Collection[str], renamed: Mapping[str, str] | None) -> None:
        super().__init__()
        self.flags, self.options, self.renamed = flags, options, renamed

    def filter(self, record: logging.LogRecord) -> bool:
        if (said := said_as_flags(text := record.getMessage(), self.flags, self.options, self.renamed)) != text:
            record.msg, record.args = said, None
        return True


@contextlib.contextmanager
def warnings_as_flags(flags: Collection[str], options: Collection[str] = (), renamed: Mapping[str, str] | None = None):
    """While a command runs, the library's warnings name its flags (``flags``: its options; ``options``: the
    --drafter-option keys given, left alone; ``renamed``: :func:`said_as_flags`), as its errors do: a warning read
    ``num_blocks=2 ... max_new_tokens=40`` just above the error line naming ``--num-blocks 2``. On the root logger's
    handlers and the specdec logger's (a train command's train.log)."""
    said = _SaidAsFlags(flags, options, renamed)
    handlers = list(dict.fromkeys(logging.getLogger().handlers + logging.getLogger("specdec").handlers))
    for handler in handlers:
        handler.addFilter(said)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(said)


PATH_OPTIONS = ("path", "model", "tokenizer")  # options naming a file, directory or alias: the text, never a number
# as a Python user types them (JSON: true, false, null), in any case: top_k=none was the text 'none'
LITERALS = {"true": True, "false": False, "none": None, "null": None}


def _parse_options(pairs: list[str]) -> dict:
    """``KEY=VALUE`` pairs -> drafter options: VALUE parsed as JSON (or true / false / none in any case) when
    possible, except for paths (a directory named 2024 stays "2024"; ``path="DIR"``, the JSON string, is DIR), also
    after a drafter's prefix (``medusa.path=DIR``). A key given twice (``max-nodes`` and ``max_nodes`` are one key) is
    refused: the last value would win without a word."""
    options, texts = {}, {}
    for pair in pairs:
        typed, sep, value = pair.partition("=")
        if not sep:
            raise CLIError(f"--drafter-option needs KEY=VALUE, got {pair!r}")
        key = typed.replace("-", "_")
        if key in options:
            raise CLIError(f"--drafter-option {typed} given twice ({texts[key]} and {value}); give it once")
        texts[key] = value
        options[key] = _path_text(value) if key.rpartition(".")[2] in PATH_OPTIONS else _json_or_text(value)
    return options


def _json_or_text(value: str):
    if value.lower() in LITERALS:
        return LITERALS[value.lower()]
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _path_text(value: str) -> str:
    quoted = len(value) >= 2 and value[0] == value[-1] == '"'
    text = _json_or_text(value) if quoted else value
    return text if isinstance(text, str) else value


def _run_generate(args) -> int:
    with sigterm_as_interrupt():  # `timeout`, a scheduler, `kill`: SIGTERM takes Ctrl-C's path (the text is kept)
        return _generate_to_stdout(args)


def _generate_to_stdout(args) -> int:
    if not args.json:
        _, summary = _generate(args, _TextStream)
        _print_summary(summary)
        return 0
    # stdout carries the one JSON document and nothing else: anything else printed meanwhile goes to stderr
    stdout = sys.stdout

    def write(text: str, summary: dict) -> None:
        stdout.write(json.dumps({"text": text, **summary}) + "\n")
        stdout.flush()

    with contextlib.redirect_stdout(sys.stderr):
        text, summary = _generate(args, _Collected, cut_short=write)
    write(text, summary)
    return 0


def _generate(args, stream_class, cut_short=None) -> tuple[str, dict]:
    """Check the arguments, load the model, generate; `(text, summary)`. `stream_class`: streams the text to
    stdout as it is generated. `cut_short(text, summary)`: called, before the error goes on, when a KV cache out
    of blocks or Ctrl-C stops the run after it generated tokens."""
    import torch

    from specdec.models.loader import load_model

    # check what needs no model before the (slow) model load
    text, system, stop = _checked_texts(args)
    settings = _generation_settings(args)
    drafter = _cli_drafter(args)
    device = _check_device(args.device)
    if args.cuda_graphs and device.type != "cuda":
        raise CLIError("--cuda-graphs needs --device cuda")
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=device)
    load_seconds = time.perf_counter() - t0
    tok = loaded.tokenizer
    ids = _prompt_ids(tok, args, text, system)
    prompt = {"chat_template": _chat_template_used(tok, args), "system": system}  # how the prompt was fed, for --json
    vocab = loaded.runner.shape.vocab_size
    if ids and max(ids) >= vocab:  # the tokenizer is not the model's: say so, not "input_ids outside the vocabulary"
        raise CLIError(f"the tokenizer of model {args.model!r} gave the prompt token id {max(ids)}, outside the "
                       f"model's vocabulary of {vocab} (config.vocab_size): the tokenizer and the model do not match")
    stream = stream_class(tok)
    t0 = time.perf_counter()
    try:
        out = _generate_streamed(loaded, ids, drafter, settings, stop, args, stream)
    except BaseException as err:
        ending = _ending(err)
        if cut_short is not None and ending is not None and stream.tokens:
            cut_short(tok.decode(stream.tokens, skip_special_tokens=True),
                      _cut_summary(loaded, args, prompt, len(ids), len(stream.tokens), time.perf_counter() - t0,
                                   ending, load_seconds))
        raise
    summary = _summary(loaded, args, prompt, out, load_seconds)
    return tok.decode(out.new_tokens[0], skip_special_tokens=True), summary


def _ending(err: BaseException) -> str | None:
    """The `finish` of a run that `err` cut short: "cache_full", "interrupted" (None: an error of another kind)."""
    from specdec.kv_cache import CacheFullError

    if isinstance(err, KeyboardInterrupt):
        return "interrupted"
    if isinstance(err, CacheFullError) or isinstance(err.__cause__, CacheFullError):
        return "cache_full"
    return None


def _checked_texts(args) -> tuple[str, str | None, list[str] | None]:
    """`(prompt, --system, --stop)` as valid text (the stop strings [] for --no-stop, None where neither is given: the
    model's own); an empty prompt, or --system without a chat template, refused."""
    text, source = _read_prompt(args)
    if not text.strip():
        what = "only whitespace" if text else "empty"  # "   " said "empty": the user typed something
        raise CLIError(f"the prompt is {what} (read from {source}); give the text to generate from")
    system = _check_argument(args.system, "--system") if args.system is not None else None
    if system is not None and args.no_chat_template:
        raise CLIError("--system goes into the chat template, which --no-chat-template turns off; drop one of them "
                       "(or put the system text at the start of the prompt)")
    if args.stop and "" in args.stop:  # (generate() names it stop[i], the API's spelling)
        raise CLIError("--stop '' is empty: it would stop at once; give the text to stop at")
    if args.stop and args.no_stop:
        raise CLIError("--no-stop drops every stop string, --stop gives some; drop one of them")
    stop = [_unescaped(_check_argument(s, "--stop")) for s in args.stop] if args.stop else args.stop
    return text, system, [] if args.no_stop else stop


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}


def _unescaped(stop: str) -> str:
    """``--stop '\\n'`` as the newline it means (a shell passes the two characters); any other backslash is kept."""
    return re.sub(r"\\([ntr\\])", lambda m: _ESCAPES[m.group(1)], stop)


def _generation_settings(args) -> dict:
    """The generation flags given (GENERATION_FLAGS; the others are the model's generation_config's), checked."""
    from specdec.sampling import SamplingConfig

    settings = {k: flag_value(k, getattr(args, k)) for k in GENERATION_FLAGS if getattr(args, k) is not None}
    flagged_sampling(SamplingConfig.from_kwargs, {**settings, "do_sample": bool(args.do_sample)})
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--block-size", args.block_size),
                        ("--num-blocks", args.num_blocks)):
        if value is not None and value < 1:  # refused before the model loads, by the flag's name
            raise CLIError(f"{flag} must be >= 1, got {value}")
    return settings


def _cli_drafter(args):
    """The drafter --drafter and --drafter-option ask for (None: plain decoding)."""
    from specdec.drafters.registry import check_options, get_drafter

    options = _parse_options(args.drafter_option)
    if options and not args.drafter:
        raise CLIError("--drafter-option needs --drafter NAME: without a drafter the options would be ignored")
    if options:  # named as the command line spells them, not as Python passes them
        check_options(args.drafter, options, command_line=True)
    try:
        return get_drafter(args.drafter, **options)
    except TypeError as err:
        if not options:
            raise
        raise CLIError(f"drafter {args.drafter!r} does not accept these --drafter-option values: {err}") from err


def _prompt_ids(tok, args, text: str, system: str | None) -> list[int]:
    """The prompt's token ids, through the tokenizer's chat template unless --no-chat-template (or it has none)."""
    from specdec.generate_inputs import check_encoded
    from specdec.models.loader import holds_tokenizer_files

    if tok is None:
        if str(args.model).lower().endswith(".gguf"):  # nothing to save next to a file
            raise CLIError(f"model {args.model!r} holds no vocabulary (tokenizer.ggml.tokens), and the CLI needs a "
                           "tokenizer: use a GGUF file with its vocabulary, or pass token ids to specdec.generate()")
        if Path(args.model).is_dir() and holds_tokenizer_files(Path(args.model)):  # the files are there
            raise CLIError(f"the tokenizer of model {args.model!r} could not be loaded (the warning above says why); "
                           "the CLI needs one")
        raise CLIError(f"model {args.model!r} has no tokenizer; the CLI needs one (save it next to the checkpoint)")
    if system is not None and not getattr(tok, "chat_template", None):
        raise CLIError(f"--system goes into the chat template, and the tokenizer of model {args.model!r} has none; "
                       "drop --system (or put the system text at the start of the prompt)")
    if _chat_template_used(tok, args):
        messages = [{"role": "system", "content": system}] if system is not None else []  # "": an empty one
        messages.append({"role": "user", "content": text})
        try:
            return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        except Exception as err:  # jinja2's TemplateError: the template refuses these messages (raise_exception)
            if not type(err).__module__.startswith("jinja2"):
                raise
            advice = "drop --system, or pass --no-chat-template instead" if system is not None else \
                "pass --no-chat-template"
            raise CLIError(f"the chat template of model {args.model!r} refuses the messages: {err}; {advice} to feed "
                           "the prompt as raw text") from err
    return check_encoded(text, tok(text)["input_ids"])


def _chat_template_used(tok, args) -> bool:
    """Whether the prompt goes through the tokenizer's chat template: it has one, and no --no-chat-template."""
    return not args.no_chat_template and bool(getattr(tok, "chat_template", None))


def _generate_streamed(loaded, ids: list[int], drafter, settings: dict, stop: list[str] | None, args, stream):
    """generate() with the CLI's options, streaming into `stream`. On an error or Ctrl-C the text streamed so far, if
    any, is ended with a newline; a full KV cache under --num-blocks names the option, and where the tokens
    generated until then are (`stream.kept`)."""
    import torch

    from specdec.generate import generate
    from specdec.kv_cache import CacheFullError

    try:
        with torch.no_grad():
            out = generate(
                loaded, [ids], drafter=drafter, **settings, seed=args.seed, streamer=stream,
                **({} if stop is None else {"stop": stop or None}),  # None (--no-stop) clears the model's stop_strings
                return_dict=True, block_size=args.block_size, num_blocks=args.num_blocks,
                speculation=args.speculation, sampler=args.sampler,
                cuda_graphs="auto" if args.cuda_graphs is None else args.cuda_graphs,
                invariant=args.invariant,
            )
    except BaseException as err:  # Ctrl-C, or an error mid-generation (the KV cache full, ...)
        if stream.tokens:  # keep what was generated: the rest of the text and its newline, then main's line
            # (nothing streamed: nothing to end, stdout stays empty)
            with contextlib.suppress(OSError, ValueError):  # stdout gone (a closed pipe, a full disk): nothing to end
                stream.finish()
        if isinstance(err, CacheFullError) and args.num_blocks is not None:  # its advice names generate()'s argument
            kept = f" ({stream.kept})" if stream.tokens else ""
            when = ("the KV cache cannot hold the prompt" if err.new_tokens is None else
                    f"the KV cache ran out of blocks after {sum(map(len, err.new_tokens))} new tokens{kept}")
            raise CLIError(f"{when}: --num-blocks {args.num_blocks} is too few for this prompt and --max-new-tokens; "
                           "pass a larger --num-blocks, or leave it out to size the cache to fit") from err
        if isinstance(err, SpecdecError) and (said := said_as_flags(str(err), SIZE_FLAGS)) != str(err):
            raise CLIError(said) from err  # "lower max_new_tokens": the flag is --max-new-tokens
        raise
    stream.finish()
    return out


def _cut_summary(loaded, args, prompt: dict, prompt_tokens: int, new_tokens: int, seconds: float, ending: str,
                 load_seconds: float) -> dict:
    """The summary of a run cut short (`ending`: its `finish`): the fields of :func:`_summary`, those only the
    finished run's statistics hold (tau, steps, acceptance_per_depth) null."""
    return {
        **_what_ran(loaded, args), **prompt, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "seconds": round(seconds, 3), "tokens_per_s": round(new_tokens / max(seconds, 1e-9), 2), "tau": None,
        "steps": None, "finish": ending, "load_seconds": round(load_seconds, 2), "acceptance_per_depth": None,
    }


def _what_ran(loaded, args) -> dict:
    return {"model": loaded.name, "dtype": str(loaded.runner.dtype).removeprefix("torch."),
            "device": str(loaded.runner.device), "drafter": args.drafter or "none"}


def _summary(loaded, args, prompt: dict, out, load_seconds: float) -> dict:
    """What the summary line (or --json) reports of the run; `prompt`: whether the chat template was applied, and
    the --system message."""
    s = out.stats[0]
    return {
        **_what_ran(loaded, args), **prompt, "prompt_tokens": s.prompt_tokens, "new_tokens": s.new_tokens,
        "seconds": round(out.seconds, 3), "tokens_per_s": round(s.tokens_per_second, 2),
        "tau": round(s.tau, 3), "steps": s.steps, "finish": s.finish_reason, "load_seconds": round(load_seconds, 2),
        "acceptance_per_depth": [round(a, 3) for a in s.acceptance_per_depth],
    }


def _print_summary(summary: dict) -> None:
    acc = " ".join(f"{a:.2f}" for a in summary["acceptance_per_depth"])
    print(
        f"[specdec] {summary['new_tokens']} tokens in {summary['seconds']:.2f}s = {summary['tokens_per_s']:.1f} tok/s"
        f" | tau {summary['tau']:.2f} over {summary['steps']} steps | drafter {summary['drafter']}"
        + (f" | acceptance/depth {acc}" if acc else "")
        + f" | prompt {summary['prompt_tokens']} tok, finish={summary['finish']}",
        file=sys.stderr,
    )


# the extra that brings what a command imports (README's "What each command needs"; tests/test_packaging.py)
EXTRA_OF_COMMAND = {"generate": "gguf", "train-medusa": "train", "train-eagle": "train", "eval": "eval"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before a command runs (the imports of torch and transformers take seconds)
        if "-v" in argv or "--verbose" in argv:
            raise
        print("specdec: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT


class _Parser(argparse.ArgumentParser):
    """argparse with its mistakes in one line, as every other mistake is (no usage block before it)."""

    def error(self, message: str):
        line = None if another_process_says_it() else f"{self.prog}: error: {' '.join(message.split())} (see " \
            f"{self.prog} --help)\n"
        self.exit(2, line)

    def _print_message(self, message: str, file=None) -> None:
        """--help and --version: argparse drops a failed write, so ``specdec --help > /dev/full`` exited 0 having
        written nothing; a failed stdout is said in one line, as a command's is. A reader that left (``| head``)
        stays silent, as argparse has it."""
        if file is not None and file is not sys.stdout:
            return super()._print_message(message, file)
        stdout = _NamedStdout(sys.stdout)
        try:
            stdout.write(message)
            stdout.flush()
        except BrokenPipeError:
            _silence_stdout()
        except StdoutError as err:
            self.exit(2, f"{self.prog}: error: {err}\n")


def _verbose_everywhere(parser: argparse.ArgumentParser) -> None:
    """-v after the command as before it (specdec generate -v ...): every subcommand's parser takes it too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="log progress; on errors show the traceback (as specdec -v)")
                _verbose_everywhere(sub)


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command ``args`` ran: ``specdec eval lossless``'s for ``specdec eval lossless ...``."""
    while subs := [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]:
        parser = subs[0].choices[getattr(args, subs[0].dest)]
    return parser


def _main(argv: list[str]) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's parser: "specdec generate: error: unrecognized arguments: ..."
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    command = _command_parser(parser, args)
    name = command.prog  # "specdec eval replay run": the one the user typed
    if sys.stdout is None:  # `specdec ... >&-`: Python sets sys.stdout to None
        print(f"{name}: error: stdout is closed, so the output would be lost; redirect it to a "
              "file or to /dev/null instead", file=sys.stderr)
        return 2
    _escape_what_stdout_cannot_encode()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    stdout = sys.stdout
    sys.stdout = _NamedStdout(stdout)
    try:
        with transformers_bars(shown=args.verbose), \
                warnings_as_flags(command._option_string_actions, drafter_option_keys(args)):
            return _run_command(args, name)
    finally:
        if isinstance(sys.stdout, _NamedStdout):
            sys.stdout = stdout


class _NamedStdout:
    """sys.stdout while a command runs: a write or flush that fails (``> /dev/full``, a full disk) raises a
    StdoutError saying it was stdout, where the bare ``[Errno 28] No space left on device`` read as the failure of
    the command's own files (an export or a report written whole). A closed pipe stays a BrokenPipeError."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with self._named():
            return self._stream.write(text)

    def flush(self) -> None:
        with self._named():
            self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    @staticmethod
    @contextlib.contextmanager
    def _named():
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as err:
            raise StdoutError(f"cannot write to stdout ({err.strerror or err}): the output printed there is lost") \
                from err


def _escape_what_stdout_cannot_encode() -> None:
    """On a stdout whose encoding cannot write every character (``PYTHONIOENCODING=ascii``, a Windows code page),
    the text of a character it cannot write is its escape (``\\xe9``), as on stderr: the first such character of
    a generated text stopped the command there with a UnicodeEncodeError, and the rest of the output was lost."""
    import codecs

    encoding = getattr(sys.stdout, "encoding", None)
    with contextlib.suppress(LookupError, TypeError):
        if codecs.lookup(encoding).name == "utf-8":
            return
    with contextlib.suppress(AttributeError, ValueError):  # not a text stream Python made (a caller's own object)
        sys.stdout.reconfigure(errors="backslashreplace")


def _parser() -> argparse.ArgumentParser:
    """The ``specdec`` parser: generate, the command of every module in SUBCOMMAND_MODULES that is installed, and
    -v on each."""
    parser = _Parser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress (model conversion etc.); on errors show the traceback (same exit code)")
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:  # the module exists but a dependency of it is missing
                raise
            continue
        module.add_parser(sub)
    name_commands(sub)
    _verbose_everywhere(parser)
    return parser


@contextlib.contextmanager
def transformers_bars(shown: bool):
    """transformers' own progress bars (loading weights, GGUF tensors) are -v detail, not output: off unless
    `shown`, and back as they were afterwards."""
    from transformers.utils import logging as hf_logging

    hf_bars = hf_logging.is_progress_bar_enabled()
    if not shown:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if hf_bars:
            hf_logging.enable_progress_bar()


def _run_command(args, name: str) -> int:
    """Run the command `name`; the errors meant for the user, a missing extra and Ctrl-C become one line and an exit
    code (with -v the traceback comes first: the exit code stays, so that a script tells a mistake, 2, from a failed
    certificate, 1)."""
    try:
        code = args.func(args)
        sys.stdout.flush()  # the last output too: a failed write said here, not as "Exception ignored" at exit
        return code
    except USER_ERRORS as err:
        traceback_if(args.verbose)
        return _user_error(err, name, args.command)
    except ModuleNotFoundError as err:  # an extra was not installed (README: "What each command needs")
        if not err.name or err.name.split(".")[0] in ("specdec",):
            raise
        traceback_if(args.verbose)
        return _missing_package(err, name, args.command)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM inside sigterm_as_interrupt()
        traceback_if(args.verbose)
        _flush_stdout()
        print(f"{name}: {how_stopped(err)}", file=sys.stderr)
        return exit_code(err)  # 130, or 143 for SIGTERM


def another_process_says_it() -> bool:
    """Whether this process is one of a launch (torchrun, accelerate launch: WORLD_SIZE > 1) other than its first
    (RANK 0): every process parses the same command line, so the first alone says what is wrong with it."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0
    except ValueError:  # not a launcher's
        return False


def traceback_if(verbose: bool) -> None:
    """-v: the traceback of the exception being handled, on stderr, before its one line."""
    if verbose:
        import traceback

        _flush_stdout()
        traceback.print_exc()


def _user_error(err: Exception, name: str, command: str) -> int:
    """`err` as one line ``specdec <command>: error: ...`` after the text streamed so far; its exit code."""
    if isinstance(err, BrokenPipeError):  # `specdec generate ... | head`: the reader left, nothing to say
        _silence_stdout()
        return 141  # 128 + SIGPIPE, what the shell reports for `yes | head`
    _flush_stdout()  # streamed text first, then the error on its own line
    message = (" ".join(str(err).split()) or type(err).__name__).removeprefix(f"{command}: ")
    print(f"{name}: error: {message}", file=sys.stderr)
    return 2


def _missing_package(err: ModuleNotFoundError, name: str, command: str) -> int:
    """The package `err` misses, and the extra of `command` that installs it, as one line; its exit code."""
    _flush_stdout()
    extra = EXTRA_OF_COMMAND.get(command)
    hint = f"pip install 'specdec[{extra}]'" if extra else f"pip install {err.name.split('.')[0]}"
    print(f"{name}: error: the Python package {err.name.split('.')[0]!r} is missing; "
          f"install it with {hint}", file=sys.stderr)
    return 2


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):  # the reader is gone / stdout closed or full: the error line still goes out
        _silence_stdout()


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of a broken pipe does not print a traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no real file (captured in a test): nothing to flush
        pass


if __name__ == "__main__":
    sys.exit(main())
