"""One ``train-medusa`` / ``train-eagle`` run end to end: data -> training -> evaluation -> checkpoint + report.

    report = run_training(TrainConfig(model="default", output_dir="heads/", max_steps=100))
    report = run_training(TrainConfig(model="default", output_dir="eagle/", drafter="eagle", draft_vocab="auto"))

Writes into the output dir: ``config.json`` + ``medusa_lm_head.safetensors`` (Medusa's file layout,
FasterDecoding's with one block per head, with the chosen ``medusa_choices``), ``report.json``, ``report.md``,
``train.log``, ``history.jsonl``, ``run.json`` and the resumable ``checkpoint/``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import io
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from specdec.drafters.medusa_heads import save_medusa
from specdec.train.accuracy_table import ALL_POSITIONS_NOTE, accuracy_cells, accuracy_scopes
from specdec.train.agreed_interrupts import InterruptsHeld
from specdec.train.checkpoint import checkpoint_step, find_checkpoint
from specdec.train.config import SELF_PROMPTS, TrainConfig
from specdec.train.data import TrainDataError, load_texts, split_held_out, tokenize_texts
from specdec.train.distill import encode_prompt
from specdec.train.evaluate import eval_prompts, say_few_eval_prompts
from specdec.train.loop import number
from specdec.train.medusa_recipe import train_heads
from specdec.train.output_dir import RUN_FILE, check_resume_writable, prepare_output_dir
from specdec.train.process_failures import FailureNotes
from specdec.train.process_team import Team
from specdec.train.prompts import builtin_prompts
from specdec.train.run_seconds import run_seconds, wall_time_line

from specdec.atomic_write import write_json, write_text
from specdec.errors import InputError, not_utf8_at
from specdec.folder_lock import only_writer
from specdec.log_levels import logger_at
from specdec.models.fingerprint import model_fingerprint
from specdec.output_dirs import check_creatable, make_dir
from specdec.sigterm import sigterm_ends_at_once

logger = logging.getLogger(__name__)


def distill_graphs(cfg: TrainConfig, loaded) -> bool:
    """Whether self-distillation decodes through CUDA graphs (``--distill-cuda-graphs``; a one-line InputError for
    ``on`` without the Triton backend)."""
    from specdec.train.distill import use_graphs

    return use_graphs(loaded, {"auto": None, "on": True, "off": False}[cfg.distill_cuda_graphs])


def read_inputs(cfg: TrainConfig, loaded) -> list:
    """What the run reads, read (and refused) before ``--overwrite`` deletes anything: the tokenized training
    sequences of ``--data``, the prompts of ``--prompts-file`` or the built-in set, or [] (self-written prompts)."""
    if cfg.data is not None:
        texts = load_texts(cfg.data, cfg.text_field, cfg.messages_field, loaded.tokenizer)
        return tokenize_texts(loaded.tokenizer, texts, cfg.seq_len, f"training data {cfg.data}")
    if cfg.prompt_source == "self":  # the target writes them, once loaded and its graphs chosen
        return []
    if not cfg.prompts_file:
        prompts = builtin_prompts(cfg.num_prompts, seed=cfg.seed)
        _few_prompts(cfg.num_prompts, len(prompts), "the built-in set")
        return prompts
    path = Path(cfg.prompts_file)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a BOM (Windows editors write one) is no prompt's
    except UnicodeDecodeError as err:  # its line and the byte in it, as --data's refusal says them
        raise TrainDataError(f"prompts file {path} is not UTF-8 text ({not_utf8_at(data, err)})") from err
    # one prompt per line, lines ending at \n, \r\n or \r: splitlines() also cut a prompt at U+2028, U+0085, a form feed
    prompts = [x.strip() for x in io.StringIO(text, newline=None) if x.strip()]
    if not prompts:
        raise TrainDataError(f"prompts file {path} is empty")
    _few_prompts(cfg.num_prompts, len(prompts), f"prompts file {path}")
    return prompts[: cfg.num_prompts]


def check_prompts_encode(cfg: TrainConfig, loaded, inputs: list) -> None:
    """The prompts self-distillation answers once the output folder is made (``inputs``: of --prompts-file or the
    built-in set), encoded now: one the tokenizer makes nothing of is refused in one line naming it, before any work
    (the tau measurement's, by :func:`_check_tau_prompts`). Through a chat template every prompt has tokens."""
    if getattr(loaded.tokenizer, "chat_template", None):
        return
    if cfg.data is None and cfg.prompt_source == "builtin":  # not self-written: the target writes those
        where = f"prompts file {cfg.prompts_file}" if cfg.prompts_file else "the built-in set"
        for n, prompt in enumerate(inputs, 1):
            encode_prompt(loaded.tokenizer, prompt, f"prompt {n} of {where}")


def _check_tau_prompts(cfg: TrainConfig, loaded) -> None:
    """The tau measurement's held-out prompts, measured after training, checked now, each encoded once: one the
    tokenizer makes nothing of, or whose answers of --eval-max-new-tokens run past the model's context, is refused
    before any work."""
    ids = [encode_prompt(loaded.tokenizer, p, "the tau measurement's built-in prompt")
           for p in eval_prompts(cfg.eval_prompts)]
    _check_answers_fit(loaded.runner.shape, list(map(len, ids)), cfg.eval_max_new_tokens, "--eval-max-new-tokens",
                       "tau-measurement prompt", "pass --no-eval-tau")


def _few_prompts(asked: int | None, available: int, where: str) -> None:
    """Say so when --num-prompts asks for more prompts than ``where`` holds (the run uses them all)."""
    if asked is not None and asked > available:
        logger.warning("--num-prompts %d: %s holds %d prompts; using all %d", asked, where, available, available)


def _sequences(cfg: TrainConfig, loaded, inputs: list,
               team: Team) -> tuple[list[list[int]], dict[tuple[int, ...], int]]:
    """Training sequences (``inputs``: :func:`read_inputs`), and for self-distilled ones the length of each one's
    prompt (keyed by the sequence): the accuracies that predict drafting speed are those on the responses, not on
    the chat template. Several processes (``team``) self-distil together, each its share of the batches, and all
    get the sequences one process would have made."""
    if cfg.data is not None:
        return inputs, {}
    from specdec.train.distill import self_distill
    from specdec.train.self_prompts import self_written_prompts

    prompts = inputs
    graphs = distill_graphs(cfg, loaded)
    if cfg.prompt_source == "self":
        prompts = self_written_prompts(loaded, cfg.num_prompts or SELF_PROMPTS, seed=cfg.seed,
                                       batch_size=cfg.distill_batch_size, progress=cfg.progress, cuda_graphs=graphs,
                                       team=team)
    lengths = [len(encode_prompt(loaded.tokenizer, p)) for p in prompts]
    if lengths and min(lengths) >= cfg.seq_len:  # refused before the target answers
        raise TrainDataError(f"--seq-len {cfg.seq_len} is too short for the prompts: sequences are cut from their "
                             f"start, so no answer token would be kept (the longest prompt has {max(lengths)} tokens)")
    _check_answers_fit(loaded.runner.shape, lengths, cfg.distill_max_new_tokens)
    with warnings_naming("--distill-max-new-tokens"):
        seqs = self_distill(loaded, prompts, max_new_tokens=cfg.distill_max_new_tokens,
                            batch_size=cfg.distill_batch_size, progress=cfg.progress, cuda_graphs=graphs, team=team)
    cut = sum(len(s) > n >= cfg.seq_len for s, n in zip(seqs, lengths, strict=True))
    if cut and team.index == 0:  # every process has every sequence: one says it
        logger.warning("%d of %d self-distilled sequences keep no answer token: their prompts are at least --seq-len "
                       "(%d) tokens long (the longest has %d) and sequences are cut from their start", cut, len(seqs),
                       cfg.seq_len, max(lengths))
    seqs = [s[: cfg.seq_len] for s in seqs]
    return seqs, {tuple(s): n for s, n in zip(seqs, lengths, strict=True)}


def warnings_naming(flag: str) -> contextlib.AbstractContextManager:
    """While the target answers in ``flag`` new tokens (--distill-max-new-tokens, --eval-max-new-tokens), the warnings
    of generate() name that option, where they said its argument (``max_new_tokens=4``)."""
    from specdec.cli import warnings_as_flags

    return warnings_as_flags((flag,), renamed={"max_new_tokens": flag})


def _check_answers_fit(shape, lengths: list[int], max_new_tokens: int, flag: str = "--distill-max-new-tokens",
                       prompts: str = "prompt", instead: str = "") -> None:
    """Refuse, naming ``flag``, answers of ``max_new_tokens`` to prompts of ``lengths`` tokens that would run past the
    model's context (or its sliding window + 1: ``shape.max_positions``), before the target answers: generate()
    refuses them when it gets there (the tau measurement's, after training). ``instead``: another way out, said last."""
    shape.check_answer_fits(f"the longest {prompts}", max(lengths, default=0), flag, max_new_tokens,
                            instead=instead)


def choose_draft_vocab(cfg: TrainConfig, train_seqs: list[list[int]], model) -> tuple[tuple[int, ...], dict]:
    """The reduced draft vocabulary's token ids (() = full) and what it covers of the training tokens."""
    from specdec.drafters.draft_vocab import choose_size, coverage, frequent_tokens

    if cfg.draft_vocab is None:
        return (), {"size": None}
    table = {}
    if cfg.draft_vocab == "auto":
        size, table = choose_size(train_seqs, cfg.draft_vocab_coverage)
    else:
        size = cfg.draft_vocab  # at most the vocabulary: _load_and_prepare refused more
    eos = model.config.eos_token_id
    always = [eos] if isinstance(eos, int) else list(eos or [])
    ids = tuple(frequent_tokens(train_seqs, size, always=always))
    info = {"size": len(ids), "coverage": coverage(train_seqs, ids), "coverage_by_size": table}
    logger.info("draft vocabulary: %d tokens covering %.1f%% of the training tokens", len(ids), 100 * info["coverage"])
    return ids, info


class _AsBefore(logging.Handler):
    """Passes on a specdec record as logging passed it before :func:`_logged_to_file` took the specdec logger's
    handlers aside: where its own logger's level then (``level``: the specdec logger's, unless a logger between
    them set one) lets it through, to those handlers and, where it propagated, up its ancestors' (Python's
    last-resort handler where no logger on its way had one)."""

    def __init__(self, logger: logging.Logger, level: int):
        super().__init__()  # every record reaches handle(), which applies the levels of before
        self.before = level
        self.handlers, self.propagate, self.parent = list(logger.handlers), logger.propagate, logger.parent
        self.levels = {name: child.level for name, child in logging.Logger.manager.loggerDict.items()
                       if name.startswith("specdec.") and isinstance(child, logging.Logger)}

    def _below(self, record: logging.LogRecord) -> tuple[int, int]:
        """(the level of ``record``'s logger before the block, the handlers of the loggers below specdec that
        Python's walk passed it to already)."""
        level, passed, name = 0, 0, record.name
        while name.startswith("specdec."):
            child = logging.Logger.manager.loggerDict.get(name)
            passed += len(child.handlers) if isinstance(child, logging.Logger) else 0
            level = level or self.levels.get(name, 0)
            name = name.rpartition(".")[0]
        return level or self.before, passed

    def handle(self, record: logging.LogRecord) -> bool:
        level, found = self._below(record)
        if record.levelno < level:
            return False
        handlers, parent = self.handlers, self.parent if self.propagate else None
        while True:  # as Logger.callHandlers walks
            for handler in handlers:
                found += 1
                if record.levelno >= handler.level:
                    handler.handle(record)
            if parent is None:
                break
            handlers, parent = parent.handlers, parent.parent if parent.propagate else None
        if not found and logging.lastResort is not None and record.levelno >= logging.lastResort.level:
            logging.lastResort.handle(record)
        return True


class _Kept(logging.Handler):
    """Keeps the records it is given (:func:`_warnings_kept`). Where no other handler takes a record, Python's last
    resort (stderr) still does, as it would without this one."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:  # as Logger.callHandlers walks
            if any(h is not self for h in logger.handlers):
                return
            logger = logger.parent if logger.propagate else None
        if logging.lastResort is not None and record.levelno >= logging.lastResort.level:
            logging.lastResort.handle(record)


@contextlib.contextmanager
def _warnings_kept() -> Iterator[list[logging.LogRecord]]:
    """The specdec loggers' warnings of the block (the run's start, before train.log can be opened: --overwrite
    empties its folder), for :func:`_logged_to_file` to write first. They reach the caller's handlers as usual."""
    specdec, kept = logging.getLogger("specdec"), _Kept()
    specdec.addHandler(kept)
    try:
        yield kept.records
    finally:
        specdec.removeHandler(kept)


@contextlib.contextmanager
def _logged_to_file(out: Path, earlier: list[logging.LogRecord] = ()) -> Iterator[None]:
    """train.log gets ``earlier`` (the warnings of the run's start) and the specdec loggers' INFO records and up.
    Where the caller's logging lets fewer through (the usual WARNING), the specdec logger's level is lowered to INFO
    while the block runs, and its records reach the caller's handlers as before (:class:`_AsBefore`): none of the
    extra INFO lines, except on a handler the caller put on a logger below specdec's (``specdec.train``), which
    sees them first. All is restored at the end."""
    specdec = logging.getLogger("specdec")
    handler = logging.FileHandler(out / "train.log")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for record in earlier:
        handler.handle(record)
    level, propagate, before = specdec.level, specdec.propagate, specdec.getEffectiveLevel()
    aside = _AsBefore(specdec, before) if before > logging.INFO else None
    if aside is not None:
        for other in aside.handlers:
            specdec.removeHandler(other)
        specdec.addHandler(aside)
        specdec.propagate = False
        specdec.setLevel(logging.INFO)
    specdec.addHandler(handler)
    try:
        yield
    finally:
        specdec.removeHandler(handler)
        handler.close()
        if aside is not None:
            specdec.removeHandler(aside)
            for other in aside.handlers:
                specdec.addHandler(other)
            specdec.propagate = propagate
            specdec.setLevel(level)


@contextlib.contextmanager
def _processes_together(accelerator) -> Iterator[Team]:
    """Several processes, up to the end of training: yields their :class:`Team`, whose ``meet`` (the barrier where
    they wait for each other) and ``exchange`` (of what each made, e.g. its share of the self-distillation) also
    carry Ctrl-C and SIGTERM (train/agreed_interrupts.py). Outside the training loop a signal stops its process
    where it lands, as in one process (self-distillation keeps its finished batches), and the others at their next
    meeting. At the block's end they meet a last time and close the process group (left to exit, a rank could abort
    in teardown); a signal during that meeting stops its process after it. The main process then evaluates alone.
    An error on one process stops the others at once with :class:`PeerFailed` (train/process_failures.py).
    One process: ``Team.alone()``."""
    if accelerator.num_processes == 1:
        yield Team.alone()
        return
    from accelerate.utils import gather_object

    notes = FailureNotes.of(accelerator)
    try:
        with InterruptsHeld(hold=False) as agreed:
            try:
                yield Team(accelerator.process_index, accelerator.num_processes,
                           meet=functools.partial(agreed.meet, accelerator),
                           exchange=lambda made: agreed.meet(accelerator, then=lambda: gather_object([made])))
                agreed.meet(accelerator, last=True)  # a signal during it is handled at the end of the block
            except KeyboardInterrupt as err:
                notes.interrupted()  # the launcher's SIGTERM after another process failed: PeerFailed
                agreed.meet_after(accelerator, err)
                if getattr(err, "processes_stopped_together", False):  # only then does no process wait in the group
                    accelerator.end_training()
                raise
            accelerator.end_training()
    except Exception as err:  # an error on this process or another (train/process_failures.py)
        notes.stop(err)
        raise


def check_inputs(cfg: TrainConfig) -> None:
    """The training inputs exist (cheap checks, before anything is deleted or computed)."""
    if cfg.data is not None and not Path(cfg.data).expanduser().exists():
        raise TrainDataError(f"training data not found: {cfg.data}")
    if cfg.data is None and cfg.prompts_file and Path(cfg.prompts_file).is_dir():
        raise TrainDataError(f"prompts file {cfg.prompts_file} is a directory; give the file that holds the prompts, "
                             "one per line")
    if cfg.data is None and cfg.prompts_file and not Path(cfg.prompts_file).is_file():
        raise TrainDataError(f"prompts file not found: {cfg.prompts_file}")
    check_creatable(cfg.output_dir, "--output-dir")
    if cfg.resume:
        check_resume_writable(Path(cfg.output_dir))


def _load_and_prepare(cfg: TrainConfig, accelerator, meet: Callable[[], None], hold: contextlib.ExitStack) -> tuple:
    """What can fail without training, failed before the output directory is touched (--overwrite deletes it):
    the inputs, the model and its context; then the output directory's rules (the main process, which ``hold``s the
    folder until the run ends: another run writing there is refused; the others ``meet`` it after). Returns (the
    loaded model, what :func:`read_inputs` read, the checkpoint to resume from or None)."""
    from specdec.models.loader import load_model

    check_inputs(cfg)
    loaded = load_model(cfg.model)
    max_pos = getattr(loaded.model.config, "max_position_embeddings", None)
    if max_pos is not None and cfg.seq_len > max_pos:
        raise InputError(f"--seq-len {cfg.seq_len} exceeds the model's context of {max_pos} tokens; pass --seq-len "
                         f"{max_pos} or less")
    vocab = loaded.model.config.vocab_size
    if isinstance(cfg.draft_vocab, int) and cfg.draft_vocab > vocab:
        raise InputError(f"--draft-vocab {cfg.draft_vocab} exceeds the model's vocabulary of {vocab} tokens; pass "
                         f"--draft-vocab {vocab} or less, or --draft-vocab full for its whole LM head")
    if loaded.tokenizer is None:  # --data, --prompts-file, the built-in and self-written prompts: all text
        raise TrainDataError(f"model {cfg.model} has no tokenizer, and training reads text (its data or the prompts "
                             "the target answers): save the model's tokenizer files beside it")
    if cfg.data is None:
        distill_graphs(cfg, loaded)
    # every process reads the same inputs: the main process alone says their warnings (not each of N processes)
    with contextlib.nullcontext() if accelerator.is_main_process else logger_at("specdec", logging.ERROR):
        inputs = read_inputs(cfg, loaded)
        if cfg.eval_tau:
            say_few_eval_prompts(cfg.eval_prompts)
    check_prompts_encode(cfg, loaded, inputs)
    if cfg.eval_tau:  # measured after training: refused now, not once the training is done
        _check_tau_prompts(cfg, loaded)
    resume_from = None
    if accelerator.is_main_process:
        out = Path(cfg.output_dir)
        if not cfg.resume:  # a resume needs the folder with its checkpoint: none there is refused, nothing made
            make_dir(out, "--output-dir")
        if out.is_dir():
            hold.enter_context(only_writer(out, "--output-dir"))
        resume_from = prepare_output_dir(cfg, model_fingerprint(loaded.model))
    meet()
    if not accelerator.is_main_process and cfg.resume:
        resume_from = find_checkpoint(Path(cfg.output_dir))
    return loaded, inputs, resume_from


def _train(cfg: TrainConfig, loaded, model, train_seqs: list[list[int]], accelerator,
           resume_from: Path | None) -> tuple:
    """The drafter ``cfg`` names, trained (over a draft vocabulary chosen here); returns (its module, the history,
    what the draft vocabulary covers)."""
    draft_vocab, vocab_info = choose_draft_vocab(cfg, train_seqs, model)
    if cfg.drafter == "eagle":
        from specdec.train.eagle_recipe import EagleRecipe
        from specdec.train.loop import train_drafter

        recipe = EagleRecipe(cfg, model, accelerator.device, loaded.source, draft_vocab)
        history = train_drafter(cfg, recipe, model, train_seqs, accelerator, resume_from)
        return recipe.module, history, vocab_info
    heads, history = train_heads(cfg, model, train_seqs, accelerator, resume_from, loaded.source, draft_vocab)
    return heads, history, vocab_info


def _finish_medusa(cfg: TrainConfig, loaded, model, heads, history: list[dict], held_out: list, train_seqs: list,
                   accelerator, times: dict, prompt_lengths: dict | None = None) -> dict:
    """The main process, after training Medusa heads: their accuracies, the tree they choose, saved with it, tau
    measured (unless --no-eval-tau); writes and returns the report. ``times``: perf_counter at start, data and train.
    Self-distilled (``prompt_lengths``), the tree is chosen from the accuracies on the responses: the chat template
    repeats in every sequence and is easy to predict, so all positions promised more than drafting a reply gets."""
    from specdec.train.choices import choose_tree
    from specdec.train.evaluate import measure_tau, scoped_head_accuracies

    out = Path(cfg.output_dir)
    # --held-out-fraction 0: accuracies on training data, and the report says so
    data = held_out or train_seqs
    scopes = accuracy_scopes(data, prompt_lengths)
    acc, *responses_or_none = scoped_head_accuracies(model, heads, data, scopes, device=accelerator.device)
    responses = responses_or_none[0] if responses_or_none else None
    if responses is not None and not responses["positions"][0]:  # no response position reached (warned earlier)
        responses = None
    choices, est_tau = choose_tree((responses or acc)["rank_acc"], cfg.tree_budget)
    heads.config = dataclasses.replace(heads.config, medusa_choices=tuple(choices))
    save_medusa(heads, out)
    tau = None
    if cfg.eval_tau:
        with warnings_naming("--eval-max-new-tokens"):
            tau = measure_tau(loaded, heads, choices, eval_prompts(cfg.eval_prompts),
                              cfg.eval_max_new_tokens, progress=cfg.progress, tree=cfg.eval_tree,
                              budget=cfg.tree_budget)
    report = {
        "config": cfg.to_json(), "model": loaded.name, "train_sequences": len(train_seqs),
        "held_out_sequences": len(held_out), "accuracy_data": "held-out" if held_out else "training",
        "steps": trained_steps(out, history),
        "final_loss": history[-1]["loss"] if history else None,
        # a head no held-out position reaches has no accuracy (rank_acc keeps 0.0: the tree leaves it out)
        "top1": measured(acc["top1"], acc["positions"]), "top5": measured(acc["top5"], acc["positions"]),
        "response_top1": responses and measured(responses["top1"], responses["positions"]),
        "response_top5": responses and measured(responses["top5"], responses["positions"]),
        "rank_acc": (responses or acc)["rank_acc"], "tree_accuracies": "responses" if responses else "all positions",
        "medusa_choices": [list(c) for c in choices], "estimated_tau": est_tau, "tau": tau,
        "seconds": run_seconds(times, time.perf_counter()),
        "processes": accelerator.num_processes,
    }
    write_report(out, report, render_markdown(report))
    logger.info("done: top1 %s, tau %s", " ".join(number(t) for t in acc["top1"]), number(tau and tau["tau"]))
    return report


def write_report(out: Path, report: dict, markdown: str) -> None:
    """``report.json`` and ``report.md`` (``markdown``: rendered before either is written), each atomically: a run
    stopped while writing them (Ctrl-C, a kill) leaves the earlier report whole, as a resume that evaluates again
    replaces one, never a file cut short."""
    write_json(out / "report.json", report, indent=2)
    write_text(out / "report.md", markdown)


def import_before_the_process_group() -> None:
    """Imports ``torch.distributed.nn`` before a process group starts. Its functions take the default group as a
    default argument, evaluated at import: imported later (transformers does, building a model, through
    ``torch.distributed.checkpoint``), they keep the group alive past ``destroy_process_group``, and its gloo
    threads let go of the last collective during interpreter shutdown, which aborts the process now and then
    ("terminate called without an active exception") after a run that succeeded."""
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.nn")


def run_training(cfg: TrainConfig, accelerator=None) -> dict:
    from accelerate import Accelerator

    if accelerator is None:  # cpu=True on a CPU-only box: a multi-process launch then uses gloo (MULTI_CPU)
        import_before_the_process_group()
        with sigterm_ends_at_once():  # the process group forms: it waits for every process in C++
            accelerator = Accelerator(mixed_precision=cfg.precision, cpu=not torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != accelerator.num_processes:
        raise RuntimeError(f"launched as {world} processes but accelerate set up {accelerator.num_processes}: on a "
                           "CPU-only machine use `accelerate launch --multi_gpu --num_processes N` or torchrun")
    t0 = time.perf_counter()
    # the run seeds torch's global RNG (cfg.seed) and --resume restores a checkpoint's: the caller's comes back after
    cuda = [accelerator.device] if accelerator.device.type == "cuda" else []
    # log: train.log, to the report, and the output folder held until the run ends
    with torch.random.fork_rng(devices=cuda), contextlib.ExitStack() as log:
        with _processes_together(accelerator) as team:
            with _warnings_kept() as early:  # before train.log: an unread prompt, a resume's changed input, ...
                loaded, inputs, resume_from = _load_and_prepare(cfg, accelerator, team.meet, log)
                out = make_dir(cfg.output_dir, "--output-dir")
            if accelerator.is_main_process:
                log.enter_context(_logged_to_file(out, early))
            model = loaded.model.to(accelerator.device)
            model.requires_grad_(False)
            if accelerator.is_main_process:
                write_json(out / RUN_FILE, {"config": cfg.to_json(), "fingerprint": cfg.fingerprint()}, indent=2)
            seqs, prompt_lengths = _sequences(cfg, loaded, inputs, team)
            train_seqs, held_out = split_held_out(seqs, cfg.held_out_fraction)
            logger.info("%d training / %d held-out sequences (%d / %d tokens)", len(train_seqs), len(held_out),
                        sum(map(len, train_seqs)), sum(map(len, held_out)))
            t_data = time.perf_counter()
            # read before training replaces that checkpoint
            resumed_at = None if resume_from is None else checkpoint_step(resume_from)
            heads, history, vocab_info = _train(cfg, loaded, model, train_seqs, accelerator, resume_from)
        times = {"start": t0, "data": t_data, "train": time.perf_counter(), "resumed_from_step": resumed_at}
        if not accelerator.is_main_process:
            return {}
        if cfg.drafter == "eagle":
            from specdec.train.eagle_report import finish_eagle

            return finish_eagle(cfg, loaded, heads, history, held_out, train_seqs, vocab_info, times, accelerator,
                                prompt_lengths)
        return _finish_medusa(cfg, loaded, model, heads, history, held_out, train_seqs, accelerator, times,
                              prompt_lengths)


def trained_steps(out: Path, history: list[dict]) -> int:
    """The steps the drafter was trained for: the history's last record, else (a resumed run whose history.jsonl
    was gone, and which had no step left) the step of the checkpoint the run's last step saved."""
    if history:
        return history[-1]["step"]
    ckpt = find_checkpoint(out)
    return checkpoint_step(ckpt) if ckpt is not None else 0


def measured(rates: list[float], positions: list[float]) -> list[float | None]:
    """``rates`` with None where they were measured over no position (a 0.0 there would read as a measurement)."""
    return [rate if n else None for rate, n in zip(rates, positions, strict=True)]


def render_markdown(r: dict) -> str:
    lines = [f"# Medusa training report: {r['model']}", "",
             f"{r['config']['num_heads']} heads x {r['config']['num_layers']} layers, "
             f"{'shared' if r['config']['shared_lm_head'] else 'own'} LM head; {r['steps']} steps on "
             f"{r['train_sequences']} sequences ({r['processes']} process(es)); final loss "
             f"{number(r['final_loss'], 4)}", "",
             f"Accuracies on {r['held_out_sequences']} held-out sequences:" if r["held_out_sequences"]
             else "Accuracies on the TRAINING data (--held-out-fraction 0): optimistic.", "",
             "| head | predicts | top-1 | top-5 | top-1, responses only | top-5, responses only |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {i} | t+{i + 2} | {cells} |" for i, cells in enumerate(accuracy_cells(r))]
    lines += ["", ALL_POSITIONS_NOTE, "",
              f"Tree: {len(r['medusa_choices'])} nodes, from the {r.get('tree_accuracies', 'all positions')} "
              f"accuracies; estimated tau {r['estimated_tau']:.3f}"]
    if r["tau"]:
        t = r["tau"]
        lines.append(f"Measured tau (greedy, {t['prompts']} held-out chat prompts, {t['max_new_tokens']} new tokens, "
                     f"{t['tree']} tree of {t['tree_nodes']} nodes): **{t['tau']:.3f}**")
    lines += ["", wall_time_line(r["seconds"]), ""]
    return "\n".join(lines)
