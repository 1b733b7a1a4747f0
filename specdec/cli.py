"""The ``specdec`` command line: ``specdec generate``, ``specdec train-medusa``, ``specdec eval``.

Subcommands other than ``generate`` live next to their code: a module listed in
``SUBCOMMAND_MODULES`` exposes ``add_parser(subparsers)``, which registers its parser
and sets ``func`` to the function that runs it.

    specdec generate "Write a haiku about caches."            # embedded default model
    echo "prompt" | specdec generate --drafter ngram --max-new-tokens 256
    specdec generate --prompt-file doc.txt --model ./my-llama --do-sample --temperature 0.7

The text streams to stdout; a one-line summary (tokens, tokens/s, tau) goes to stderr.
Errors meant for the user (bad options, unknown model or drafter, a drafter's malformed
proposal, KV cache out of blocks...) print one line ``specdec <command>: error: ...`` and
exit with code 2; ``-v`` shows the traceback instead.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time

from specdec.errors import SpecdecError
from specdec.kv_cache import CacheFullError
from specdec.models.embedded import DEFAULT_ALIAS

SUBCOMMAND_MODULES = ("specdec.train.cli", "specdec.eval.cli")


class CLIError(Exception):
    """A problem with what the user asked for on the command line."""


# library errors that are the user's to fix: one line and exit code 2, no traceback.
# SpecdecError is every error specdec raises on purpose (specdec.errors); ValueError still covers
# the builtin checks of bad input; OSError covers missing files and unknown model paths.
USER_ERRORS = (CLIError, SpecdecError, ValueError, OSError, CacheFullError)
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices, torch attribute names


class _TextStream:
    """Decodes a growing token list and prints only the new, complete characters."""

    def __init__(self, tokenizer, out=None) -> None:
        self.tokenizer, self.out = tokenizer, out if out is not None else sys.stdout
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, seq_index: int, new_tokens: list[int]) -> None:
        self.tokens.extend(new_tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self.out.write(text[self.printed :])
        self.out.flush()
        self.printed = len(text)

    def finish(self) -> None:
        """Print what is left (an incomplete UTF-8 sequence at the very end included) and a newline."""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.out.write(text[self.printed :] + "\n")
        self.out.flush()
        self.printed = len(text)


def _read_prompt(args) -> str:
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin.isatty() and args.prompt is None:
        raise CLIError("give a prompt as an argument, with --prompt-file, or on stdin")
    return sys.stdin.read()


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text, plainly or speculatively",
                       description="Generate text from a prompt and print it with its speed.")
    p.add_argument("prompt", nargs="?", help="the prompt ('-' or omitted: read stdin)")
    p.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--model", default=DEFAULT_ALIAS,
                   help=f"checkpoint directory, .gguf file or alias (default: {DEFAULT_ALIAS})")
    p.add_argument("--drafter", default=None, help="drafter name, e.g. ngram (default: plain decoding)")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option, repeatable; VALUE parsed as JSON when possible")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string, repeatable")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--system", default=None, help="system message for the chat template")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV cache size in blocks (default: enough for the prompt, max-new-tokens and the drafts)")
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights / activations dtype (default: float32)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the verify forward as CUDA graphs (needs --device cuda; see docs/kernels.md)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_run_generate)


def _parse_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise CLIError(f"--drafter-option needs KEY=VALUE, got {pair!r}")
        try:
            options[key.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            options[key.replace("-", "_")] = value
    return options


def _run_generate(args) -> int:
    import torch

    from specdec.drafters.registry import get_drafter
    from specdec.generate import generate
    from specdec.models.loader import load_model
    from specdec.sampling import SamplingConfig

    text = _read_prompt(args)
    if not text.strip():
        raise CLIError("the prompt is empty")
    # check what needs no model before the (slow) model load
    SamplingConfig(args.do_sample, args.temperature, args.top_k, args.top_p)
    options = _parse_options(args.drafter_option)
    if options and not args.drafter:
        raise CLIError("--drafter-option needs --drafter NAME: without a drafter the options would be ignored")
    try:
        drafter = get_drafter(args.drafter, **options)
    except TypeError as err:
        if not options:
            raise
        raise CLIError(f"drafter {args.drafter!r} does not accept these --drafter-option values: {err}") from err
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: no CUDA device is available (torch {torch.__version__})")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise CLIError("--cuda-graphs needs --device cuda")
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device)
    load_seconds = time.perf_counter() - t0
    tok = loaded.tokenizer
    if tok is None:
        raise CLIError(f"model {args.model!r} has no tokenizer; the CLI needs one (save it next to the checkpoint)")
    if not args.no_chat_template and getattr(tok, "chat_template", None):
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    else:
        ids = tok(text)["input_ids"]
    stream = _TextStream(tok)
    with torch.no_grad():
        out = generate(
            loaded, [ids], drafter=drafter,
            max_new_tokens=args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop, streamer=stream,
            return_dict=True, block_size=args.block_size, num_blocks=args.num_blocks, cuda_graphs=args.cuda_graphs,
        )
    stream.finish()
    s = out.stats[0]
    summary = {
        "model": loaded.name, "dtype": str(loaded.runner.dtype).removeprefix("torch."),
        "device": str(loaded.runner.device), "drafter": args.drafter or "none", "prompt_tokens": s.prompt_tokens,
        "new_tokens": s.new_tokens, "seconds": round(out.seconds, 3), "tokens_per_s": round(s.tokens_per_second, 2),
        "tau": round(s.tau, 3), "steps": s.steps, "finish": s.finish_reason, "load_seconds": round(load_seconds, 2),
        "acceptance_per_depth": [round(a, 3) for a in s.acceptance_per_depth],
    }
    if args.json:
        print(json.dumps(summary), file=sys.stderr)
    else:
        acc = " ".join(f"{a:.2f}" for a in s.acceptance_per_depth)
        print(
            f"[specdec] {s.new_tokens} tokens in {out.seconds:.2f}s = {s.tokens_per_second:.1f} tok/s | "
            f"tau {s.tau:.2f} over {s.steps} steps | drafter {summary['drafter']}"
            + (f" | acceptance/depth {acc}" if acc else "")
            + f" | prompt {s.prompt_tokens} tok, finish={s.finish_reason}",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log progress (model conversion etc.); on errors show the traceback")
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except USER_ERRORS as err:
        if args.verbose:
            raise
        sys.stdout.flush()  # streamed text first, then the error on its own line
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"specdec {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
