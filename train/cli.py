"""``specdec train-medusa`` and ``specdec train-eagle``: train draft heads for a target model (one CPU, one GPU, or
``accelerate launch``).

    specdec train-medusa --output-dir heads/                        # quick recipe defaults, built-in prompts
    specdec train-medusa --model ./my-llama --data chats.jsonl --output-dir heads/ --epochs 2
    accelerate launch --multi_gpu --num_processes 2 -m specdec.cli train-medusa --output-dir heads/ ...
    (the same on a CPU-only machine: the processes use gloo; `--cpu` would start only one process)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from specdec.train.config import (
    EVAL_TREES,
    LOSSES,
    OTHER_FLAG_NAMES,
    PRECISIONS,
    PROMPT_SOURCES,
    SCHEDULES,
    SELF_PROMPTS,
)

from specdec.help_format import DefaultsHelpFormatter, path_arg
from specdec.models.embedded import DEFAULT_ALIAS
from specdec.sigterm import exit_code, how_stopped, sigterm_as_interrupt


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train-medusa", help="train Medusa heads for a target model",
        description="Train Medusa heads on a frozen target model (self-distillation from prompts by default), "
                    "evaluate them, choose a medusa_choices tree and write the heads in Medusa's file layout "
                    "(FasterDecoding's with one residual block per head) plus report.json / report.md. "
                    "Multi-process: accelerate launch ... -m specdec.cli train-medusa.",
        formatter_class=DefaultsHelpFormatter)
    g = p.add_argument_group("model and heads")
    g.add_argument("--model", default=DEFAULT_ALIAS, type=path_arg,
                   help="target model: alias, HF checkpoint dir or .gguf file")
    g.add_argument("--num-heads", type=int, default=3, help="number of Medusa heads (head i predicts token t+2+i)")
    g.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    g.add_argument("--shared-lm-head", action="store_true",
                   help="heads reuse the target's (frozen) LM head instead of each owning a trainable copy")
    _draft_vocab_arg(g, default=None)
    _common_args(p, "train-medusa")
    p.set_defaults(func=run, drafter="medusa")

    p = subparsers.add_parser(
        "train-eagle", help="train an EAGLE draft layer for a target model",
        description="Train an EAGLE-style draft layer (one decoder layer of the target's type over its last hidden "
                    "state, trained several draft steps deep on its own predictions) on a frozen target model "
                    "(self-distillation from prompts by default), measure per-depth accuracies, choose the draft "
                    "tree by timing it against plain decoding, and write config.json + model.safetensors plus "
                    "report.json / report.md. Load it with --drafter eagle --drafter-option path=DIR.",
        formatter_class=DefaultsHelpFormatter)
    g = p.add_argument_group("model and draft layer")
    g.add_argument("--model", default=DEFAULT_ALIAS, type=path_arg,
                   help="target model: alias, HF checkpoint dir or .gguf file")
    g.add_argument("--train-depth", type=int, default=3, dest="eagle_steps",
                   help="draft steps the layer is trained through on its own predicted features")
    g.add_argument("--reg-weight", type=float, default=1.0,
                   help="weight of the feature regression (smooth L1) next to the token cross-entropy (EAGLE-1 "
                        "only: refused with --arch eagle3, which has no regression)")
    g.add_argument("--arch", choices=("eagle1", "eagle3"), default="eagle1", dest="eagle_arch",
                   help="eagle3: fc over three target layers' features (low / middle / high), token loss only, "
                        "its own norm and LM head (exportable with specdec export-head)")
    _draft_vocab_arg(g, default="auto")
    _common_args(p, "train-eagle")
    p.set_defaults(func=run, drafter="eagle", num_heads=3, num_layers=1, shared_lm_head=False)


def _draft_vocab_arg(g, default) -> None:
    g.add_argument("--draft-vocab", default=default, type=_vocab_size,
                   help="reduced draft vocabulary: N (the N most frequent training tokens), 'auto' (the smallest of "
                        "1k..32k covering --draft-vocab-coverage of the training tokens) or 'full' "
                        f"(default: {default or 'full'})")
    g.add_argument("--draft-vocab-coverage", type=float, default=0.97,
                   help="with --draft-vocab auto: share of the training tokens the vocabulary must cover")


def _vocab_size(text: str):
    if text in ("auto", "full"):
        return None if text == "full" else "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'auto' or 'full', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _common_args(p, name: str) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data", default=None, type=path_arg,
                   help="training data: .jsonl/.json, .parquet or a datasets.save_to_disk dir; "
                        "omitted: self-distil prompts (built-in set or --prompts-file) with the target itself")
    g.add_argument("--text-field", default="text", help="record field holding plain text")
    g.add_argument("--messages-field", default="messages",
                   help="record field holding chat messages (role/content; ShareGPT's from/value: conversations)")
    g.add_argument("--prompts-file", default=None, type=path_arg, help="self-distillation prompts, one per line")
    g.add_argument("--prompt-source", choices=PROMPT_SOURCES, default="builtin",
                   help="self-distillation prompts without --data / --prompts-file: 'builtin', the built-in set, or "
                        f"'self', user turns the target writes itself (--num-prompts of them, {SELF_PROMPTS} unless "
                        "given; needs a chat template)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="use only the first N self-distillation prompts (default: all; refused with --data, whose "
                        "records are all used)")
    g.add_argument("--distill-max-new-tokens", type=int, default=128, help="response length when self-distilling")
    g.add_argument("--distill-batch-size", type=int, default=128,
                   help="prompts per batched generate() call (larger = more tokens/s, more KV memory)")
    g.add_argument("--distill-cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="decode the self-distillation through CUDA graphs (auto: on a CUDA device with the Triton "
                        "backend; several times faster on a GPU; off: eager)")
    g.add_argument("--seq-len", type=int, default=512, help="training sequences are cut to this many tokens")
    g.add_argument("--held-out-fraction", type=float, default=0.05, help="share of sequences kept for evaluation")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch (global, over processes)")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    g.add_argument("--schedule", choices=SCHEDULES, default="cosine", help="lr schedule")
    g.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    g.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the gradient norm to this before each step (0: no clipping)")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training data (ignored with --max-steps)")
    g.add_argument("--max-steps", type=int, default=None, help="optimizer steps (overrides --epochs)")
    g.add_argument("--head-decay", type=float, default=0.8,
                   help="loss weight of head i (Medusa) or draft depth i+1 (EAGLE) is head_decay**i")
    g.add_argument("--loss", choices=LOSSES, default="ce",
                   help="ce: cross-entropy vs the target's argmax; kl: KL divergence from the target's whole "
                        "next-token distribution (teaches the lower ranks a tree uses; about 50%% more time per step "
                        "on a CPU)" if name == "train-medusa" else
                        "ce: cross-entropy vs the target's own tokens, the only loss of an EAGLE layer (kl is "
                        "train-medusa's and refused here)")
    g.add_argument("--precision", choices=PRECISIONS, default="no", help="mixed precision for the heads")
    g.add_argument("--no-feature-cache", action="store_true",
                   help="recompute the target's hidden states every batch instead of once per sequence "
                        "(the cache holds hidden_size * 4 bytes per training token in memory)")
    g.add_argument("--seed", type=int, default=0, help="seed for data order and initialisation")
    g = p.add_argument_group("output, checkpoints, evaluation")
    g.add_argument("--output-dir", required=True, type=path_arg,
                   help="where heads, checkpoints, logs and the report go")
    g.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (atomic)")
    g.add_argument("--log-every", type=int, default=10, help="log a line to train.log every N steps")
    g.add_argument("--resume", action="store_true", help="continue the run in --output-dir from its checkpoint")
    g.add_argument("--overwrite", action="store_true",
                   help="delete a previous training run in --output-dir and start afresh (a directory holding "
                   "anything a run does not write is refused, not deleted)")
    # the tau measurement's settings: None where not given (the config's default), so --no-eval-tau refuses them
    g.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out chat prompts for the tau measurement (default 24)")
    g.add_argument("--eval-max-new-tokens", type=int, default=None, help="tokens per prompt for tau (default 128)")
    if name == "train-medusa":
        g.add_argument("--tree-budget", type=int, default=64, help="nodes of the chosen medusa_choices tree (<= 64)")
        g.add_argument("--eval-tree", choices=EVAL_TREES, default=None,
                       help="tree of the tau measurement: the chosen medusa_choices (static, the default), or a "
                            "per-step dynamic tree of --tree-budget nodes B from the heads' top-min(20, B) (drafter "
                            "options tree=dynamic max_nodes=B top_k=min(20, B))")
    else:  # train-eagle times candidate trees (train/eagle_evaluate.py): Medusa's tree options would do nothing
        for option in ("--tree-budget", "--eval-tree"):
            g.add_argument(option, action=_MedusaOnly, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    g.add_argument("--no-eval-tau", action="store_true", help="skip the tau measurement")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


class _MedusaOnly(argparse.Action):
    """A train-medusa option given to train-eagle: refused in one line rather than accepted and ignored."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is a train-medusa option (the medusa_choices tree); train-eagle chooses its "
                     "tree by timing candidates on the --eval-prompts (docs/training/eagle.md)")


TAU_OPTIONS = ("eval_prompts", "eval_max_new_tokens", "eval_tree")  # read by the tau measurement alone


def config_from_args(args):
    """The run's TrainConfig; a setting out of its range refused as the command line spells it (``--lr must be >
    0``), where the config names its field (``lr must be > 0``)."""
    try:
        return _config(args)
    except ValueError as err:
        name, _, rest = str(err).partition(" ")
        if name not in vars(args) or name in OTHER_FLAG_NAMES or not rest.startswith("must "):
            raise
        raise ValueError(f"--{name.replace('_', '-')} {rest}") from err


def _config(args):
    from specdec.train.config import TrainConfig

    tau = {name: getattr(args, name) for name in TAU_OPTIONS if getattr(args, name, None) is not None}
    if args.no_eval_tau and tau:
        given = ", ".join(f"--{name.replace('_', '-')}" for name in tau)
        raise ValueError(f"{given} set{'s' if len(tau) == 1 else ''} the tau measurement, which --no-eval-tau "
                         f"skips: leave {'it' if len(tau) == 1 else 'them'} out, or measure tau")
    return TrainConfig(
        drafter=args.drafter, draft_vocab=args.draft_vocab, draft_vocab_coverage=args.draft_vocab_coverage,
        eagle_steps=getattr(args, "eagle_steps", 3), reg_weight=getattr(args, "reg_weight", 1.0),
        eagle_arch=getattr(args, "eagle_arch", "eagle1"),
        model=args.model, output_dir=args.output_dir, num_heads=args.num_heads, num_layers=args.num_layers,
        shared_lm_head=args.shared_lm_head, data=args.data, text_field=args.text_field,
        messages_field=args.messages_field, num_prompts=args.num_prompts, prompts_file=args.prompts_file,
        prompt_source=args.prompt_source,
        distill_max_new_tokens=args.distill_max_new_tokens, distill_batch_size=args.distill_batch_size,
        distill_cuda_graphs=args.distill_cuda_graphs,
        seq_len=args.seq_len, batch_size=args.batch_size, grad_accum=args.grad_accum, lr=args.lr,
        schedule=args.schedule, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm, epochs=args.epochs,
        max_steps=args.max_steps, head_decay=args.head_decay, loss=args.loss, precision=args.precision,
        cache_features=not args.no_feature_cache, seed=args.seed,
        held_out_fraction=args.held_out_fraction, save_every=args.save_every, log_every=args.log_every,
        eval_tau=not args.no_eval_tau, **tau,
        **({"tree_budget": args.tree_budget} if hasattr(args, "tree_budget") else {}),  # train-medusa's only
        resume=args.resume, overwrite=args.overwrite, progress=not args.no_progress,
    )


def _what_is_left(out: Path, interrupt: KeyboardInterrupt | None = None) -> str:
    """After Ctrl-C: the checkpoint a --resume continues from (saved by the interrupt, or earlier), or that there is
    none; and the steps lost since, where the interrupt could not save them (train/interrupt_saves.py). Interrupted
    while self-distilling: the answers it kept (train/distill.py); while the target wrote its prompts: those it
    found (train/self_prompts.py)."""
    from specdec.train.checkpoint import find_checkpoint, read_state

    saved = getattr(interrupt, "saved_step", None)
    if saved is not None:
        return f"saved the checkpoint of step {saved} (continue with --resume)"
    lost = getattr(interrupt, "unsaved_steps", 0)
    lost = f"; the {lost} step(s) after it are lost (not saved on this interrupt)" if lost else ""
    ckpt = find_checkpoint(out)
    distilled = getattr(interrupt, "distilled", None)
    if distilled is not None:  # before this run's training: what is kept is the answers
        answers, prompts, processes = distilled
        if processes == 1:
            kept = f"self-distillation kept its answers to {answers} of {prompts} prompts"
        else:  # a process knows the others' batches up to their last exchange
            known = f" (at least {answers} of {prompts} prompts)" if answers else ""
            kept = f"self-distillation kept the answers its processes finished{known}"
        kept += ", so a rerun generates only the rest"
        return kept if ckpt is None else f"{kept}; {_what_is_left(out)}"
    prompted = getattr(interrupt, "self_prompted", None)
    if prompted is not None:  # the target writing its prompts (train/self_prompts.py): its finished batches are kept
        found, asked = prompted
        kept = f"the target's own prompts: the batches it finished are kept ({found} of {asked} prompts found), so " \
               "a rerun draws only the rest"
        return kept if ckpt is None else f"{kept}; {_what_is_left(out)}"
    if ckpt is None:
        return f"it saved no checkpoint yet (see --save-every), so a rerun starts again{lost}"
    try:
        step = read_state(ckpt)["step"]
    except (OSError, ValueError, KeyError):
        step = "?"
    return f"the checkpoint of step {step} is intact (continue with --resume){lost}"


@contextlib.contextmanager
def console_at_cli_level(verbose: bool):
    """The console as for every other command: INFO lines and datasets' progress bars with -v only. train.log
    records INFO (the pipeline lowers the specdec logger's level for it), and records reach the console's handlers
    whatever the root logger's level, so those handlers take the CLI's level (the root's) while training runs."""
    root = logging.getLogger()
    unset = [h for h in root.handlers if h.level == logging.NOTSET]
    for handler in unset:
        handler.setLevel(root.level)
    bars = None
    if not verbose:
        with contextlib.suppress(ImportError):  # the train extra missing: the pipeline says so
            import datasets

            bars = not datasets.are_progress_bars_disabled()
            datasets.disable_progress_bars()
    try:
        yield
    finally:
        for handler in unset:
            handler.setLevel(logging.NOTSET)
        if bars:
            datasets.enable_progress_bars()


def _say(line: str) -> None:
    """``line`` on stderr in one write: the processes of a run share the terminal (or the launcher's pipe) and stop
    together, and print() writes the text and its newline apart when Python runs unbuffered (PYTHONUNBUFFERED, -u),
    so two processes' lines came out run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run(args) -> int:
    from specdec.train.pipeline import run_training
    from specdec.train.process_failures import REFUSED, PeerFailed

    from specdec.cli import another_process_says_it, traceback_if

    options_checked = False
    try:
        with sigterm_as_interrupt(), console_at_cli_level(getattr(args, "verbose", False)):
            cfg = config_from_args(args)
            options_checked = True
            report = run_training(cfg)
    except REFUSED as err:  # TrainDataError, OutputDirError, InputError, a model not found, ...
        traceback_if(getattr(args, "verbose", False))  # -v: the traceback first, as for every other command
        # under a launcher process 0 says a refusal every process makes (its options' are the same command line's)
        if not getattr(err, "said_by_process_0", False) and (options_checked or not another_process_says_it()):
            _say(f"specdec train-{args.drafter}: error: {err}")
        return 2
    except PeerFailed as err:  # another process's error stopped this one (its own line says why)
        if err.refused and err.process == 0:  # process 0's refusal (its output folder's): the run's, said once
            return 2
        _say(f"specdec train-{args.drafter}: stopped: {err}")
        return 1
    except KeyboardInterrupt as err:
        _say(f"specdec train-{args.drafter}: {how_stopped(err)}; {_what_is_left(Path(args.output_dir), err)}")
        return exit_code(err)
    if report:
        keys = ("top1", "top5", "tree", "seconds") if args.drafter == "eagle" else \
            ("top1", "top5", "estimated_tau", "tau", "seconds")
        print(json.dumps({k: report[k] for k in keys}, indent=2))
        _say(_where_it_went(args))
    return 0


def _where_it_went(args) -> str:
    """The closing line: where the head is, and the command that drafts with it (as convert-medusa ends)."""
    import shlex

    out = args.output_dir
    model = "" if args.model == DEFAULT_ALIAS else f" --model {shlex.quote(str(args.model))}"
    what, it = ("Medusa heads", "them") if args.drafter == "medusa" else ("an EAGLE layer", "it")
    return (f"wrote {what} to {out} (report: {Path(out) / 'report.md'}); draft with {it}: specdec generate{model} "
            f"--drafter {args.drafter} --drafter-option path={shlex.quote(str(out))} PROMPT")
