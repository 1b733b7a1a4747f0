"""``specdec eval lossless``, ``specdec eval acceptance`` and ``specdec eval replay`` (registered by specdec/cli.py).

    specdec eval lossless --drafter ngram --temperature 0.8 --out runs/cert
    specdec eval acceptance --drafters ngram,self-draft --categories chat,code --prompts 5 --out runs/acc
    specdec eval acceptance --drafters ngram,eagle --prompts-file question.jsonl --out runs/spec-bench
    specdec eval replay record --out run.json; specdec eval replay run --record run.json --drafter ngram
    accelerate launch --multi_gpu --num_processes 2 -m specdec.cli eval acceptance ...  # shard prompts
    (on a CPU-only machine too: processes use gloo; `accelerate launch --cpu` starts only one process)
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

from specdec.eval.prompts import CATEGORIES as DEFAULT_CATEGORIES
from specdec.eval.report import PLOT_FILES

from specdec.atomic_write import leftover_of, remove_leftovers, write_text
from specdec.errors import require_package
from specdec.folder_lock import launch_writer, only_writer
from specdec.help_format import name_commands, path_arg
from specdec.models.embedded import DEFAULT_ALIAS
from specdec.output_dirs import check_creatable, first_undeletable, make_dir, sticky_for_others, why_uncreatable
from specdec.sigterm import exit_code, how_stopped, sigterm_as_interrupt

DEFAULT_PROMPTS = 20
CERTIFICATE_FILES = ("certificate.json", "certificate.md")
# what a run writes into --out
ACCEPTANCE_FILES = ("report.json", "report.md", *PLOT_FILES, "settings.json", "conversations.json", "cells")


def add_parser(sub) -> None:
    """Register ``specdec eval`` with its subcommands lossless, acceptance and replay."""
    ev = sub.add_parser("eval", help="losslessness certificate and acceptance / speed suite",
                        description="Prove a configuration lossless, or measure what it buys.")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True)
    _add_lossless(ev_sub)
    _add_acceptance(ev_sub)
    from specdec.eval.replay_cli import add_parser as add_replay

    add_replay(ev_sub, _inference)  # specdec eval replay record / run
    name_commands(ev_sub)


def _add_lossless(ev_sub) -> None:
    """``specdec eval lossless``: the losslessness certificate."""
    p = ev_sub.add_parser("lossless", help="losslessness certificate (JSON + Markdown)",
                          description="Exact law, sampler statistics and end-to-end checks, each with negative "
                                      "controls that must fail. Exit code 0 = passed, 1 = failed or void.")
    _common(p, "seed of the run's random draws; another seed repeats a certificate's statistics and end-to-end "
               "sampling independently (default: 0)")
    p.add_argument("--drafter", default="ngram", help="drafter name (default: ngram)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the TOP_K most likely tokens; default: 0 (off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="keep the most likely tokens up to this probability mass; default: 1 (off)")
    from specdec.cli import add_warper_flags  # specdec.cli registers these parsers: loaded by now

    add_warper_flags(p, "")
    p.add_argument("--levels", default="exact,stats,e2e",
                   help="comma list of exact, stats, e2e, coupled, bitwise (default: %(default)s; coupled sampling: "
                        "its law, and speculative == plain token for token; bitwise: the bit-exact mode, speculative "
                        "== plain bit for bit in the model's dtype, see docs/bit-exact.md)")
    p.add_argument("--device", default="auto",
                   help="where the model runs, for every level that runs it (end to end, coupled, bitwise; exact and "
                        "stats run on the CPU): auto (default: the GPU, else cpu), cpu, cuda, cuda:1, ...; the "
                        "certificate records it (its CUDA path is not yet run on a GPU by any test)")
    _add_dtype(p, "weights / activations dtype (default: float32 on every device: the greedy identity's near-tie "
                  "margin is float32's)")
    p.add_argument("--full", action="store_true",
                   help="sample sizes that detect TV 0.01 in the sampler statistics, 0.025 end to end (hours on a "
                        "CPU: run it with a GPU, --device auto or cuda)")
    p.add_argument("--stat-samples", type=int, help="draws per synthetic case (default 50000)")
    p.add_argument("--identity-prompts", type=int, help="prompts for greedy identity (default 8)")
    p.add_argument("--identity-tokens", type=int, help="new tokens per prompt for greedy identity (default 64)")
    p.add_argument("--sample-sequences", type=int, help="sampled sequences per side end to end (default 600)")
    p.set_defaults(func=_inference(run_lossless))


def _add_acceptance(ev_sub) -> None:
    """``specdec eval acceptance``: the acceptance and speed suite."""
    a = ev_sub.add_parser("acceptance", help="tau, acceptance per depth and speed per drafter x category",
                          description="Runs drafters over prompt categories against plain decoding and "
                                      "transformers' generate(), same run; writes JSON, Markdown and PNG plots.")
    _common(a, "seed of the sampling with --temperature > 0: every generate() call of the run is seeded with it, "
               "so a rerun samples the same texts (default: 0)")
    a.add_argument("--drafters", default="ngram",
                   help="comma list of drafter names (default: ngram); LABEL=NAME names a row, to run one drafter "
                        "twice with other options: eagle1=eagle,eagle3=eagle --drafter-option eagle3.path=DIR")
    a.add_argument("--categories", default=None,
                   help=f"built-in prompt categories (default: {','.join(DEFAULT_CATEGORIES)}; none with "
                        "--prompts-file unless given)")
    a.add_argument("--prompts", type=int, default=None,
                   help=f"prompts per category (default {DEFAULT_PROMPTS}; a --prompts-file runs whole unless given)")
    a.add_argument("--prompts-file", type=path_arg,
                   help="your own prompts, each record in its own category: a Spec-Bench / MT-bench "
                        "question.jsonl (every turn), JSONL with 'prompt' or 'messages', CSV, Parquet or a saved "
                        "datasets directory (docs/benchmark-files.md)")
    a.add_argument("--prompt-column", default=None,
                   help="the field or column holding the prompt (default: the first of turns, prompt, text, messages)")
    a.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    a.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); above 0, sampling at it over the full distribution (no top-k)")
    a.add_argument("--sampler", choices=("standard", "coupled"), default="standard",
                   help="when sampling: standard rejection sampling (default) or coupled (specdec.coupling)")
    a.add_argument("--batch-size", type=int, default=1, help="prompts per generate() call (default 1)")
    a.add_argument("--device", default="auto",
                   help="where the model runs: auto (default: this process's GPU, one per process under accelerate, "
                        "else cpu), cpu, cuda, cuda:1, ...")
    _add_dtype(a)
    a.add_argument("--calibration-repeats", type=int, default=5,
                   help="timed verify steps per query size for the predicted speedup (default 5; 0 = no prediction)")
    a.add_argument("--no-hf-baseline", action="store_true", help="skip transformers' generate() baseline")
    a.add_argument("--speculation", choices=("always", "auto"), default="always",
                   help="always (default): every draft verified whole, so acceptance depends on no timing; auto: "
                        "generate()'s default policy, sized and guarded by this machine's costs (a rerun may differ)")
    a.add_argument("--no-plots", action="store_true",
                   help="write no PNG plots (report.json and report.md are written all the same); an earlier run's "
                        "plots in --out are removed")
    a.add_argument("--resume", action="store_true",
                   help="keep finished cells found in --out; each is checked first (schema, checksum, settings), "
                        "and one that is damaged, edited or measured with other settings or on another device, "
                        "thread count or torch is an error naming it")
    a.set_defaults(func=_inference(run_acceptance, sigterm=True))


def _inference(command, sigterm: bool = False):
    """Run `command` with autograd off, restoring the caller's grad mode afterwards; with ``sigterm``, SIGTERM
    takes Ctrl-C's path from the start (loading the model, the drafters), a line and exit 143 as for Ctrl-C's 130."""

    def run(args) -> int:
        import torch

        with torch.no_grad(), sigterm_as_interrupt() if sigterm else contextlib.nullcontext():
            return command(args)

    return run


def _common(p, seed_help: str) -> None:
    p.add_argument("--model", default=DEFAULT_ALIAS, type=path_arg, help=f"model (default: {DEFAULT_ALIAS})")
    p.add_argument("--drafter-option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option, repeatable; VALUE parsed as JSON when possible; with several "
                        "drafters prefix the name: medusa.path=DIR")
    p.add_argument("--out", default=None, type=path_arg, help="output directory (default: runs/eval-<command>)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier run found in --out (without it such a directory is refused)")
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def _add_dtype(p, text: str = "weights / activations dtype (default: float32; on CUDA the half dtype a checkpoint "
                                 "declares, else bfloat16)") -> None:
    from specdec.cli import DTYPES  # specdec.cli registers these parsers: loaded by now

    p.add_argument("--dtype", choices=DTYPES, default=None, help=text)


def _options(pairs: list[str], drafter: str | None = None) -> dict:
    """``--drafter-option`` pairs -> options; given the drafter's name, those it does not take are refused as the
    command line spells them."""
    from specdec.drafters.registry import check_options

    from specdec.cli import _parse_options

    options = _parse_options(pairs)
    if drafter is not None and options:
        check_options(drafter, options, command_line=True)
    return options


def _suite_device(spec: str):
    """``--device``: "auto" is this process's GPU (accelerate's local rank: one per process), or the CPU without
    one; any other value is checked as ``specdec generate --device`` checks it."""
    import torch

    from specdec.cli import _check_device

    if spec != "auto":
        return _check_device(spec)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    from specdec.eval.acceptance import process_state

    return torch.device("cuda", process_state().local_process_index % torch.cuda.device_count())


def _encoder(loaded):
    """One user message -> prompt ids, through the model's chat template (specdec.eval.conversations)."""
    from specdec.eval.conversations import chat_codec

    codec = chat_codec(loaded)
    return lambda text: codec.encode([{"role": "user", "content": text}])


def select_conversations(categories: str | None, prompts: int | None, prompts_file: str | None,
                         column: str | None) -> list:
    """What a run measures: a prompts file whole and alone, unless ``categories`` (built-in ones added) or
    ``prompts`` (the first N of each category) are given; without a file, the built-in categories."""
    from specdec.eval.prompt_files import Conversation, per_category, read_prompt_file
    from specdec.eval.prompts import CATEGORIES, load_prompts

    if prompts is not None:
        check_at_least(("--prompts", prompts, 1))
    names = [c.strip() for c in (categories or "").split(",") if c.strip()]
    if categories is None and not prompts_file:
        names = list(DEFAULT_CATEGORIES)
    unknown = [c for c in names if c not in CATEGORIES]
    if unknown:
        raise ValueError(f"unknown categories {', '.join(unknown)}; available: {', '.join(CATEGORIES)}")
    if not names and not prompts_file:
        raise ValueError("--categories names no category")
    built_in = [Conversation(c, (text,), where=f"built-in {c}") for c in names
                for text in load_prompts(c, prompts or DEFAULT_PROMPTS)]
    from_file = per_category(read_prompt_file(prompts_file, column), prompts) if prompts_file else []
    clash = sorted({c.category for c in from_file} & set(names))
    if clash:
        raise ValueError(f"{prompts_file} has categories {', '.join(clash)}, also asked for as built-in ones: "
                         f"leave them out of --categories")
    if os.environ.get("RANK", "0") == "0":  # once, under accelerate launch too
        for category, (n, asked) in short_categories(built_in + from_file, prompts).items():
            print(f"note: {category} has {counted(n, 'prompt')}, fewer than the {asked} per category asked for; "
                  "all of them run", file=sys.stderr)
    return built_in + from_file


def check_at_least(*counts: tuple[str, int, int]) -> None:
    """Refuse, by its flag's name, each ``(flag, value, least)`` whose value is below ``least``: before the model
    loads, and not as the settings' fields spell them."""
    for flag, value, least in counts:
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")


def counted(n: int, noun: str) -> str:
    """``1 prompt``, ``2 prompts``: the CLI's counts in words."""
    return f"{n} {noun}{'s' * (n != 1)}"


def short_categories(conversations: list, prompts: int | None) -> dict[str, tuple[int, int]]:
    """The categories holding fewer prompts than asked for (``prompts``, a built-in one's default without it), each
    with (prompts it runs, prompts asked for)."""
    counts = Counter(c.category for c in conversations)
    asked = {c.category: (prompts or DEFAULT_PROMPTS) if c.where.startswith("built-in") else prompts
             for c in conversations}
    return {c: (counts[c], n) for c, n in asked.items() if n is not None and counts[c] < n}


def check_out_dir(out: Path) -> None:
    """Refuse an output directory that is the working directory or holds it: a run writes cells/, settings.json
    and reports into it, among the user's own files."""
    where = out.resolve()
    if where == Path.cwd().resolve() or where in Path.cwd().resolve().parents:
        raise ValueError(f"--out {out}: the working directory (or one holding it); give the run a directory of its "
                         f"own, e.g. --out runs/acceptance")
    if where.exists() and not where.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    check_creatable(out, "--out")  # a folder that cannot be made fails before the model loads


def make_out_dir(out: Path) -> None:
    """Create --out before any work: a directory that cannot be made fails now, not after the run."""
    make_dir(out, "--out")


def check_earlier_run(out: Path, names: tuple[str, ...], overwrite: bool, resumable: bool = False) -> list[Path]:
    """Refuse, before any work, an --out holding an earlier run's ``names`` unless ``overwrite``: its results would be
    replaced (or, for the acceptance suite, mixed with this run's). Returns what is there, for --overwrite to clear."""
    check_out_dir(out)
    found = [out / n for n in names if (out / n).exists()]
    if found and not overwrite:
        resume = "pass --resume to continue it, " if resumable else ""
        raise ValueError(f"--out {out} holds an earlier run ({', '.join(p.name for p in found)}); {resume}pass "
                         "--overwrite to replace it, or name another directory")
    # another user's run in a shared folder: its files this user could delete went, then a PermissionError on its cells;
    # in an --out with the sticky bit (as /tmp) its reports too, whatever the folder's write permission
    folder = first_undeletable(p for p in found if p.is_dir())
    if folder is None and sticky_for_others(out, {p.name for p in found if not p.is_dir()}):
        folder = out
    if folder is not None:
        raise ValueError(f"--out {out}: --overwrite cannot replace the earlier run: this user may not delete what "
                         f"{folder} holds (another user's run?); ask its owner to delete it, or name another directory")
    return found


def check_cells_writable(out: Path) -> None:
    """Refuse, before the model loads, a --resume of another user's run in a shared --out that this user cannot carry
    on writing: a cells folder it cannot add to (the first cell measured failed to be written, minutes into the run),
    or, in an --out with the sticky bit, their settings.json and reports (the first write, replacing settings.json,
    failed with "Operation not permitted")."""
    if sticky_for_others(out, set(ACCEPTANCE_FILES) - {"cells"}):  # settings.json and the reports are replaced
        raise ValueError(f"--out {out}: --resume cannot replace the earlier run's settings.json and reports: --out has "
                         "the sticky bit (as /tmp) and they are another user's, which only their owner may replace "
                         f"there; copy the run to a folder of your own (cp -r {out} NEW) and resume with --out NEW")
    cells = out / "cells"
    why = why_uncreatable(cells) if cells.is_dir() else None
    if why is not None:
        raise ValueError(f"--out {out}: --resume cannot add cells: {why} (another user's run?); ask its owner to let "
                         f"you write it (chmod -R g+w {out}), or copy the run to a folder of your own (cp -r {out} "
                         "NEW) and resume with --out NEW")


def check_own_report(out: Path) -> None:
    """Refuse an --out whose report.json no acceptance run wrote (train-medusa / train-eagle write one beside their
    heads): --overwrite would replace another command's report, and the refusal called it an earlier run."""
    report = out / "report.json"
    if not report.is_file():
        return
    try:
        data = json.loads(report.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        data = None
    if not (isinstance(data, dict) and {"meta", "rows"} <= data.keys()):
        raise ValueError(f"--out {out} holds a report.json that no acceptance run wrote (train-medusa and train-eagle "
                         "write one beside their heads); name another directory")


def run_lossless(args) -> int:
    from dataclasses import replace

    from specdec.drafters.registry import available, check_options, get_drafter
    from specdec.eval.certificate import CertificateSizes

    from specdec.sampling import SamplingConfig

    if args.drafter not in available():
        raise ValueError(f"unknown drafter {args.drafter!r}; available: {', '.join(available())}")
    levels = tuple(dict.fromkeys(x.strip() for x in args.levels.split(",") if x.strip()))  # a level runs once
    bad = [lv for lv in levels if lv not in ("exact", "stats", "e2e", "coupled", "bitwise")]
    if bad or not levels:
        raise ValueError(f"--levels takes exact, stats, e2e, coupled, bitwise; got {args.levels!r}")
    sizes = CertificateSizes.full() if args.full else CertificateSizes()
    sizes = replace(sizes, **_size_overrides(args))
    from specdec.cli import WARPER_FLAGS, flag_value, flagged_sampling

    sampling = flagged_sampling(SamplingConfig, args.temperature > 0, args.temperature or 1.0, args.top_k,
                                args.top_p, **{name: flag_value(name, getattr(args, name)) for name in WARPER_FLAGS})
    off = {"top_k": 0, "top_p": 1.0, **WARPER_FLAGS}  # each warper flag's value that changes nothing
    unused = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, v in off.items()
              if flag_value(k, getattr(args, k)) != v]
    if not sampling.do_sample and unused:  # greedy takes the argmax: the certificate records what ran
        print(f"[specdec eval lossless] note: {', '.join(unused)} left out: at --temperature 0 (greedy) the warpers "
              "change nothing, and the certificate checks and records greedy decoding", file=sys.stderr)
        sampling = SamplingConfig(False)
    device = _suite_device(args.device)
    out = Path(args.out or "runs/eval-lossless")
    # one row: medusa.path=DIR as the help says and eval acceptance takes it; another drafter's prefix refused
    options = _options_per_row(args.drafter_option, [args.drafter])[args.drafter]
    check_options(args.drafter, options, command_line=True)
    get_drafter(args.drafter, **options)  # a missing path= and the like, before any work (it loads nothing yet)
    check_earlier_run(out, CERTIFICATE_FILES, args.overwrite)  # before minutes of work, not after
    # the model and the drafter's checkpoint are read before --out is made: a refused run leaves no empty folder
    loaded, make_prompts, drafter = _lossless_inputs(args, levels, sizes, device, options)
    make_out_dir(out)
    with only_writer(out, "--out"):  # to the certificate's writing: another run's verdict never lands under this one
        return _lossless_held(args, out, levels, sizes, sampling, options, loaded, make_prompts, drafter)


def _lossless_inputs(args, levels: tuple[str, ...], sizes, device, options: dict) -> tuple:
    """The model, the certificate's prompt maker and (for the levels that run it on the model) the drafter loaded
    for it: (loaded, make_prompts, drafter or None)."""
    import torch
    from specdec.drafters.registry import get_drafter
    from specdec.eval.end_to_end import sampled_tokens
    from specdec.eval.prompts import load_prompts
    from specdec.eval.sampled_start import check_room

    from specdec.models.loader import load_model

    torch.manual_seed(args.seed)
    # float32 on a GPU too (not the half dtype eval acceptance takes there): greedy identity is defined in float32,
    # and its near-tie margin (specdec.eval.divergence.NEAR_TIE) is too narrow for half-precision rounding
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype or "float32"), device=device)
    encode = _encoder(loaded)
    make_prompts = lambda n: [encode(t) for t in load_prompts("chat", n)]  # noqa: E731
    drafter = None
    if {"e2e", "coupled", "bitwise"} & set(levels):  # the levels that run the drafter on the model
        # every prompt with its new tokens fits, and the drafter's checkpoint or draft model is read and checked for
        # the model (as eval acceptance does), before any work: held through the run, the levels' drafters take
        # what it loaded (the process-wide caches), not read again
        prompts = make_prompts(sizes.identity_prompts)
        _check_identity_fits(loaded, prompts, sizes.identity_tokens)
        if "e2e" in levels:  # and the tokens its sampled check draws after a start (eval.sampled_start)
            check_room(loaded.runner.shape, prompts, sampled_tokens(sizes))
        drafter = get_drafter(args.drafter, **options)
        drafter.load_for_target(loaded.runner, loaded.tokenizer, loaded.name)
    return loaded, make_prompts, drafter


def _lossless_held(args, out: Path, levels: tuple[str, ...], sizes, sampling, options: dict, loaded, make_prompts,
                   drafter) -> int:
    """run_lossless once it holds --out: the certificate, written there."""
    from specdec.eval.certificate import run_certificate, where_it_ran

    earlier = check_earlier_run(out, CERTIFICATE_FILES, args.overwrite)  # again, now held: one may have come since
    # --overwrite clears the earlier certificate only now that this run's options, model and sizes are known to be
    # good, and before the long work: a run stopped in mid-way leaves no earlier verdict that reads as this one's
    _clear_earlier_run(earlier)
    ran = where_it_ran(loaded)
    print(f"[specdec eval lossless] {loaded.name} + {args.drafter}, levels {','.join(levels)}, on {ran['device']} "
          f"({ran['dtype']})", file=sys.stderr)
    cert = run_certificate(loaded, args.drafter, options, sampling, sizes, make_prompts, levels,
                           progress=lambda msg: print(f"  ... {msg}", file=sys.stderr), seed=args.seed)
    if drafter is not None:
        drafter.unload_for_target()
    out.mkdir(parents=True, exist_ok=True)
    for name, text in zip(CERTIFICATE_FILES, (certificate_json(cert), cert.to_markdown()), strict=True):
        write_text(out / name, text)
    for w in cert.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if cert.void:
        print(f"note: {void_advice(cert)}", file=sys.stderr)
    print(f"certificate {cert.verdict} in {cert.seconds:.0f} s: {out / 'certificate.md'}")
    return 0 if cert.passed else 1


def certificate_json(cert) -> str:
    """certificate.json's text: strict JSON, which has no Infinity or NaN (JSON.parse and other strict readers refuse
    them); a number that is not finite is a bug, said as such rather than written."""
    try:
        return json.dumps(cert.to_json(), indent=2, default=str, allow_nan=False)
    except ValueError as err:
        raise RuntimeError(f"certificate.json would hold a number that is not finite ({err}); please report this "
                           f"bug") from err


def _size_overrides(args) -> dict:
    """The sample sizes given on the command line, each refused by its flag's name where it cannot be run."""
    from specdec.eval.prompts import CHAT

    sizes = {k: getattr(args, k) for k in ("stat_samples", "identity_prompts", "identity_tokens", "sample_sequences")
             if getattr(args, k) is not None}
    check_at_least(*((f"--{key.replace('_', '-')}", value, 1) for key, value in sizes.items()))
    for key, value in sizes.items():  # a count no list can hold ended the run in an OverflowError traceback
        if value > sys.maxsize:
            raise ValueError(f"--{key.replace('_', '-')} {value}: more than a run can count (at most {sys.maxsize})")
    if sizes.get("identity_prompts", 0) > len(CHAT):
        raise ValueError(f"--identity-prompts {sizes['identity_prompts']}: there are {len(CHAT)} built-in chat "
                         f"prompts; give at most {len(CHAT)}")
    return sizes


def _check_identity_fits(loaded, prompts: list[list[int]], tokens: int) -> None:
    """Refuse, naming --identity-tokens, a size whose greedy answers would run past the model's context."""
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    loaded.runner.shape.check_answer_fits(f"identity prompt {longest}", len(prompts[longest]), "--identity-tokens",
                                          tokens)


def _size_flags(check) -> str | None:
    """The options that size the check a negative control passed (None: the exact law, which no size changes)."""
    from specdec.eval.engine_law import ENGINE_LAW_CHECKS

    if check.level == "exact-law":
        return None
    if check.name in ENGINE_LAW_CHECKS.values():  # sequences sampled through the engine, as end to end
        return "--sample-sequences"
    if check.level == "sampler-statistics" or "target law" in check.name:
        return "--stat-samples"
    if check.level == "end-to-end" and check.name.startswith("sampled"):
        return "--sample-sequences"
    return "--identity-prompts / --identity-tokens"


def void_advice(cert) -> str:
    """What to do about a VOID certificate: a check too small to catch a broken rule certifies nothing."""
    flags = list(dict.fromkeys(f for f in map(_size_flags, cert.uncaught) if f is not None))
    if len(flags) < len({_size_flags(c) for c in cert.uncaught}):  # an exact-law check missed a broken rule
        return ("the exact law let a broken rule through, which no sample size changes: report it with "
                "certificate.json")
    return (f"a check let a deliberately broken rule through, so its pass says nothing: it was too small to catch it "
            f"(or the drafter's drafts were barely accepted); rerun with more {', '.join(flags)} than this run's")


def run_acceptance(args) -> int:
    import torch

    from specdec.models.loader import load_model

    names, renamed = _drafter_rows(args.drafters)
    if not math.isfinite(args.temperature) or args.temperature < 0:  # before the model loads
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    # greedy: no sampler, no seed; the report says what ran, and a resume with another --seed is the same run
    for flag, default in (("sampler", "standard"), ("seed", 0)):
        if args.temperature == 0 and getattr(args, flag) != default:
            print(f"note: --{flag} {getattr(args, flag)} left out: at --temperature 0 (greedy) no token is sampled",
                  file=sys.stderr)
            setattr(args, flag, default)
    check_at_least(("--max-new-tokens", args.max_new_tokens, 1), ("--batch-size", args.batch_size, 1),
                   ("--calibration-repeats", args.calibration_repeats, 0))
    out = Path(args.out or "runs/eval-acceptance")
    if args.resume and args.overwrite:
        raise ValueError("--resume keeps an earlier run's cells and --overwrite replaces them: pass one")
    # accelerate shards the cells over processes, and the plots come after every cell: without either, say so before
    # the model loads and --out is made, not after
    require_package("accelerate", "eval")
    if not args.no_plots:
        require_package("matplotlib", "eval")
    check_own_report(out)
    if args.resume:  # an --out it cannot write into fails now, naming --out, not at its first file
        check_out_dir(out)
        check_cells_writable(out)
    earlier = [] if args.resume else check_earlier_run(out, ACCEPTANCE_FILES, args.overwrite, resumable=True)
    conversations = select_conversations(args.categories, args.prompts, args.prompts_file, args.prompt_column)
    config = _suite_config(args, names, renamed, conversations)
    loaded = load_model(args.model, dtype=getattr(torch, args.dtype) if args.dtype else None,
                        device=_suite_device(args.device))
    from specdec.eval.acceptance import finished_cells, load_drafters
    from specdec.eval.conversations import chat_codec, check_first_turns_fit

    check_first_turns_fit(loaded, conversations, chat_codec(loaded), config.max_new_tokens)  # not in mid-run
    # every row's checkpoint read and checked for this target (a mistyped path=, a head of another vocabulary);
    # held through the run, so the cells take what was loaded here
    held = load_drafters(loaded, config)
    # said once the run is known to go ahead (a refusal stays one line), once under accelerate launch too
    nothing_to_resume = not (out / "settings.json").exists() and not finished_cells(out)
    if args.resume and nothing_to_resume and os.environ.get("RANK", "0") == "0":
        print(f"note: --resume: {out} holds no earlier run (no settings.json, no cells), so every cell is measured; "
              "is it the --out of the run to continue?", file=sys.stderr)
    # --overwrite clears the earlier run only now that this one's prompts, options, model and drafters are known to
    # be good (a resume checks the earlier run's settings and cells itself), and once --out is held: never the files
    # of a run still writing there
    make_out_dir(out)
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # the processes of one launch share --out and one hold
    # no other run's cells under this report
    with launch_writer(out, "--out", os.environ.get("RANK", "0") == "0", _from_main if several else None):
        if not args.resume:  # checked again, now held: another run may have written here since
            earlier = check_earlier_run(out, ACCEPTANCE_FILES, args.overwrite, resumable=True)
        _clear_earlier_run(earlier)
        return _acceptance_held(args, loaded, conversations, config, held, out)


def _from_main(value):
    """The main process's ``value`` on every process of the launch: a broadcast over accelerate's process group
    (gloo on the CPU)."""
    from accelerate.utils import broadcast_object_list
    from specdec.eval.acceptance import process_state

    process_state()  # the process group, made once
    return broadcast_object_list([value])[0]


def _acceptance_held(args, loaded, conversations: list, config, held: list, out: Path) -> int:
    """run_acceptance once --out is its own: the cells, then the report. Ctrl-C or SIGTERM during either (the plots
    take seconds) ends the run with one line naming the finished cells that --resume keeps."""
    from accelerate import PartialState

    t0 = time.perf_counter()
    try:  # SIGTERM is taken as Ctrl-C here (_inference)
        cells = _run_cells(loaded, conversations, config, out, args.resume)
        held.clear()  # the drafters' checkpoints: let go before the report
        state = PartialState()
        if not state.is_main_process:
            return 0
        if args.no_plots:  # plots not drawn again are an earlier run's (a resume's too: its report may show more)
            for name in PLOT_FILES:
                (out / name).unlink(missing_ok=True)
        _report(args, loaded, conversations, config, cells, out, state.num_processes, t0)
    except KeyboardInterrupt as err:  # Ctrl-C or SIGTERM: the finished cells are kept, a resume measures the rest
        if os.environ.get("RANK", "0") == "0":  # once, under accelerate launch too
            print(f"specdec eval acceptance: {how_stopped(err)}; {_what_is_left(out)}", file=sys.stderr)
        return exit_code(err)
    return 0


def _what_is_left(out: Path) -> str:
    """After Ctrl-C or SIGTERM: the finished cells in ``out`` and that --resume continues from them; where the run
    left nothing (it removes its settings.json when no cell was finished), that a rerun starts again."""
    from specdec.eval.acceptance import finished_cells  # loaded by the run this line reports on

    done = len(finished_cells(out))
    if not done and not (out / "settings.json").exists():
        return "no cell was finished yet, so a rerun starts again"
    kept = f"{done} finished cell(s) kept in {out / 'cells'}" if done else "no cell was finished yet"
    return f"{kept} (continue with --resume)"


def _drafter_rows(drafters: str) -> tuple[list[str], tuple[tuple[str, str], ...]]:
    """``--drafters`` -> (row labels, (label, drafter name) of the rows named LABEL=NAME); unknown drafters refused."""
    from specdec.drafters.registry import available

    rows = [d.strip() for d in drafters.split(",") if d.strip()]
    renamed = tuple((label.strip(), name.strip()) for label, eq, name in (r.partition("=") for r in rows) if eq)
    names = [r.partition("=")[0].strip() for r in rows]  # row labels
    spelled = {}
    for label in names:  # --drafter-option keys arrive with - turned into _: LABEL.KEY would reach either row
        other = spelled.setdefault(label.replace("-", "_"), label)
        if other != label:
            raise ValueError(f"--drafters: the row labels {other!r} and {label!r} differ only in - and _, which "
                             "--drafter-option does not tell apart; rename one")
    kinds = dict(renamed)
    unknown = [kinds.get(d, d) for d in names if kinds.get(d, d) not in available()]
    if unknown:
        raise ValueError(f"unknown drafter(s) {', '.join(unknown)}; available: {', '.join(available())}")
    return names, renamed


def _suite_config(args, names: list[str], renamed: tuple[tuple[str, str], ...], conversations: list):
    """The suite's SuiteConfig, each row with its own --drafter-option values (checked before the model loads)."""
    from specdec.drafters.registry import check_options, get_drafter
    from specdec.eval.acceptance import SuiteConfig

    per_drafter = _options_per_row(args.drafter_option, names)
    kinds = dict(renamed)
    for d in names:  # options a drafter does not take, as the command line spells them, before the model loads
        check_options(kinds.get(d, d), per_drafter[d], command_line=True)
        get_drafter(kinds.get(d, d), **per_drafter[d])  # and those it cannot run without (medusa's path=)
    categories = list(dict.fromkeys(c.category for c in conversations))
    return SuiteConfig(tuple((d, per_drafter[d]) for d in names), tuple(categories),
                       args.prompts or DEFAULT_PROMPTS, args.max_new_tokens, args.temperature, args.batch_size,
                       not args.no_hf_baseline, args.seed, args.calibration_repeats, args.sampler, renamed,
                       args.speculation)


def _options_per_row(pairs: list[str], names: list[str]) -> dict[str, dict]:
    """``--drafter-option`` pairs -> each row's options: ``LABEL.KEY=VALUE`` goes to that row, a bare ``KEY=VALUE``
    to the only row (with several rows it is refused). One option of a row given twice (a key repeated, or the only
    row's ``ngram.max_nodes`` and a bare ``max_nodes``) is refused: the last value would win without a word."""
    per_drafter: dict[str, dict] = {d: {} for d in names}
    texts: dict[tuple[str, str], str] = {}  # (row, option) -> the value as given
    by_key = {d.replace("-", "_"): d for d in names}  # option keys arrive with - turned into _
    _options(pairs)  # malformed pairs and keys repeated as such, refused first
    for pair in pairs:
        typed, _, text = pair.partition("=")
        [(key, value)] = _options([pair]).items()
        target, dot, name = key.partition(".")
        if dot and target in by_key:  # medusa.path=DIR -> option "path" of medusa
            row = by_key[target]
        elif dot:  # a prefix, but no row's label (as typed: the key's - are _ by now); no option's name has a dot
            raise ValueError(f"--drafter-option {typed}: {typed.partition('.')[0]!r} is not one of the drafters "
                             f"({', '.join(names)})")
        elif len(names) == 1:
            row, name = names[0], key
        else:
            raise ValueError(f"--drafter-option {typed}: with several drafters, prefix the drafter name "
                             f"(e.g. {names[0]}.{typed}=...)")
        if name in per_drafter[row]:
            raise ValueError(f"--drafter-option {typed}: option {name} of {row} given twice ({texts[row, name]} and "
                             f"{text}); give it once")
        per_drafter[row][name], texts[row, name] = value, text
    return per_drafter


def _clear_earlier_run(earlier: list[Path]) -> None:
    """Delete what ``check_earlier_run`` found (--overwrite), with the cells of rows this run may not have, which it
    would report, and the temporary files a kill left of the earlier run's writes of them (specdec.atomic_write)."""
    if os.environ.get("RANK", "0") != "0":  # once, under accelerate launch too
        return
    for found in earlier:
        paths = [found]
        if found.is_dir():  # the cells, those a kill left as temporary files alone included
            names = {leftover_of(p.name) or p.name for p in found.glob("*__*.json*")}
            paths = sorted(found / name for name in names if name.endswith(".json"))
        for path in paths:
            path.unlink(missing_ok=True)
            remove_leftovers(path)


def _run_cells(loaded, conversations: list, config, out: Path, resume: bool) -> dict:
    """Measure every cell (specdec.eval.conversations) under a progress bar of the new tokens."""
    from specdec.eval.conversations import chat_codec, run_conversations
    from tqdm.auto import tqdm

    turns = sum(len(c.turns) for c in conversations)
    total = turns * (len(config.drafters) + 1) * config.max_new_tokens
    bar = tqdm(total=total, unit="tok", desc="acceptance", disable=None)
    shown: dict[tuple[str, str], int] = {}  # new tokens of each cell already counted by the bar

    def progress(category, cell):
        key = (cell.drafter, category)
        bar.update(max(0, cell.new_tokens - shown.get(key, 0)))
        shown[key] = cell.new_tokens
        bar.set_postfix(cell=f"{cell.drafter}/{category}", tau=f"{cell.tau:.2f}",
                        tok_s=f"{cell.tokens_per_second:.1f}")

    def answering(turn, count):
        bar.set_postfix_str(f"the model answers turn {turn} of {count} conversations (plain) for the next turn")

    try:
        return run_conversations(loaded, conversations, chat_codec(loaded), config, out, resume=resume,
                                 on_progress=progress, on_turn=answering)
    finally:  # an interrupt's line goes below the bar, not onto it
        bar.close()


def _report(args, loaded, conversations: list, config, cells: dict, out: Path, processes: int, t0: float) -> None:
    """Write the reports into ``out`` and print one line per drafter row and category, then where the reports are."""
    from specdec.eval.conversations import cell_turns
    from specdec.eval.report import write_reports
    from specdec.eval.spec_bench import report_rows

    from_file = {c.category for c in conversations if not c.where.startswith("built-in")}
    rows = report_rows(cells, cell_turns(conversations), mt_bench=from_file)
    meta = _report_meta(args, loaded, conversations, config, processes, t0)
    written = write_reports(rows, out, meta, with_plots=not args.no_plots)
    _print_rows(rows, greedy=config.temperature == 0)
    print("reports:", ", ".join(str(p) for p in written))


def _report_meta(args, loaded, conversations: list, config, processes: int, t0: float) -> dict:
    renamed = config.renamed
    short = short_categories(conversations, args.prompts)  # categories that ran fewer prompts than asked for
    given = {d: options for d, options in config.drafters if options}  # each row's --drafter-option values
    return {"model": loaded.name, "drafters": [d for d, _ in config.drafters],
            **({"drafter_options": given} if given else {}), **({"renamed": dict(renamed)} if renamed else {}),
            "temperature": args.temperature, "sampler": args.sampler, "max_new_tokens": args.max_new_tokens,
            "prompts_file": args.prompts_file,
            "prompts_per_category": ("all" if args.prompts is None and args.prompts_file
                                     else config.prompts_per_category),
            **({"categories_with_fewer_prompts": {c: n for c, (n, _) in short.items()}} if short else {}),
            "conversations": len(conversations), "turns": sum(len(c.turns) for c in conversations),
            "batch_size": args.batch_size, "calibration_repeats": args.calibration_repeats,
            "speculation": args.speculation, "processes": processes,
            "device": str(loaded.runner.device), "dtype": str(loaded.runner.dtype).removeprefix("torch."),
            "seconds": round(time.perf_counter() - t0, 1),
            **({"resumed": True} if args.resume else {}),  # the seconds are then this run's, not the kept cells'
            "date": time.strftime("%Y-%m-%d")}


def _print_rows(rows: list[dict], greedy: bool) -> None:
    """One line per drafter row and category: tau, speed, speedup vs plain (measured, predicted); greedy runs flag
    output that differs from plain decoding's."""
    from specdec.eval.acceptance import BASELINES

    fmt = lambda x: "-" if x is None else f"x{x:.2f}"  # noqa: E731
    same = lambda x: "" if x is None else ("" if x else "  OUTPUT DIFFERS FROM PLAIN")  # noqa: E731
    for r in rows:
        if r["drafter"] not in BASELINES and r["level"] != "turn":
            print(f"{r['drafter']:>14} {r['category']:<14} tau {r['tau']:.2f}  {r['tokens_per_s']:.1f} tok/s  "
                  f"{fmt(r['speedup_vs_plain'])} vs plain, predicted {fmt(r['predicted_speedup'])}"
                  f"{same(r['identical_to_plain'] if greedy else None)}")
