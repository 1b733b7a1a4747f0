"""The training loop every drafter shares: frozen target, accelerate, gradient accumulation, checkpoints, resume.

    history = train_drafter(cfg, recipe, model, train_seqs, accelerator, resume_from)

A recipe (``MedusaRecipe`` in train/medusa_recipe.py, ``EagleRecipe`` in train/eagle_recipe.py) owns the trained
module and its loss; the loop (data order, accumulation, cross-process reduction, schedule, checkpoints) is
shared. What an interrupt saves is train/interrupt_saves.py's.

The target's hidden states and argmax labels are computed once per sequence before the first step
(``FeatureCache``; or once per batch with ``cache_features=False``), under ``no_grad`` in float32.
Batches: ``batch_size`` is the global micro-batch; with N processes each takes rows ``p::N``.
A step's loss is, per term (a head; an EAGLE depth's token loss or feature regression), the mean over
every loss position of its ``grad_accum`` micro-batches on all processes: the recipe counts them
(``loss_counts``) before any backward, the counts are summed across processes, each micro-batch's
summed loss is divided by them, and the gradients are summed across processes by hand (no DDP).
So ``grad_accum`` N equals one batch N times larger and N processes equal one, whatever the lengths.
A step whose summed loss, or the weights its update leaves, is not finite stops every process there with
:class:`TrainingDiverged`, before anything saves those weights (earlier checkpoints stay).
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from specdec.train import checkpoint as ckpt_io
from specdec.train.agreed_interrupts import InterruptsHeld
from specdec.train.config import TrainConfig
from specdec.train.deferred_interrupts import interrupts_deferred
from specdec.train.features import FeatureCache, collate, target_features
from specdec.train.interrupt_saves import record_interrupt, stop_together
from specdec.train.output_dir import read_history

from specdec.atomic_write import write_text
from specdec.errors import SpecdecError
from specdec.models.fingerprint import model_fingerprint

logger = logging.getLogger(__name__)


class TrainingDiverged(SpecdecError, ValueError):
    """A step's loss, or the weights its update left, is not finite: the run stops at that step, on every process,
    with nothing of it saved (a diverged run wrote broken heads and exited 0)."""


def batch_rows(num_train: int, micro: int, batch_size: int, seed: int) -> list[int]:
    """Row indices of global micro-batch ``micro``: epochs are seeded permutations, so position = micro index."""
    per_epoch = max(1, num_train // batch_size)
    epoch, k = divmod(micro, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(num_train, generator=g)
    return perm[k * batch_size : (k + 1) * batch_size].tolist()


def make_scheduler(optimizer, cfg: TrainConfig, total_steps: int):
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        frac = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        if cfg.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
        if cfg.schedule == "linear":
            return max(0.0, 1 - frac)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass(frozen=True)
class Run:
    """What every step of one run reads, fixed before the first: the data, the trained parameters with their
    optimizer and schedule, and where the run writes."""

    cfg: TrainConfig
    recipe: Any
    model: Any
    train_seqs: list[list[int]]
    accelerator: Any
    features: FeatureCache | None  # None: each batch's target features are computed when it is used
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    total: int  # the optimizer steps of the whole run
    # what every checkpoint records: the configuration and the inputs as this run read them (taken once, not at
    # each save: a file edited mid-run was read before the edit)
    saved_config: dict
    fingerprint: str
    hist_file: Path
    bar: Any  # the main process's progress bar; None in the others and with --no-progress

    def save(self, at: Position) -> None:
        """The checkpoint of the last completed step; refused where its weights are not finite (the steps check
        them; an interrupt inside the step that broke them still comes here)."""
        _check_weights(self, at)
        ckpt_io.save_checkpoint(Path(self.cfg.output_dir), self.recipe.module, self.optimizer, self.scheduler,
                                at.step, self.saved_config, self.fingerprint, rng_state=at.rng)


@dataclass
class Position:
    """Where the run is: what the loop advances and what a checkpoint or an interrupt reads."""

    step: int  # the optimizer steps completed
    saved: int  # the last step saved
    rng: torch.Tensor  # the RNG state a checkpoint of `step` holds
    history: list[dict]  # the logged records (the main process's; empty on the others)
    agreed: int | None = None  # several processes: the step all of them stopped after on an interrupt
    start: int = 0  # the step this run started from (a resumed one: its checkpoint's)


def _start(cfg: TrainConfig, recipe, model, train_seqs: list[list[int]], accelerator,
           resume_from: Path | None) -> tuple[Run, Position]:
    """The run's optimizer, schedule and features, resumed from ``resume_from`` (its history cut at its step)."""
    out = Path(cfg.output_dir)
    nproc = accelerator.num_processes
    if cfg.batch_size % nproc:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the {nproc} processes")
    heads = recipe.module
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    micro_per_epoch = max(1, len(train_seqs) // cfg.batch_size)
    total = cfg.max_steps or max(1, cfg.epochs * micro_per_epoch // cfg.grad_accum)
    scheduler = make_scheduler(optimizer, cfg, total)
    saved_config = {**cfg.to_json(), "inputs": cfg.input_stamps(), "resolved": cfg.resolved_paths(),
                    "target": model_fingerprint(model), "processes": nproc}
    fingerprint = cfg.fingerprint()
    step = 0
    if resume_from is not None:
        step = ckpt_io.load_checkpoint(resume_from, heads, optimizer, scheduler)
        logger.info("resumed from %s at step %d of %d", resume_from, step, total)
        if accelerator.is_main_process:
            _other_processes(resume_from, nproc)
    history = []
    hist_file = out / "history.jsonl"
    if accelerator.is_main_process and resume_from is not None and hist_file.exists():
        history = [h for h in read_history(hist_file) if h["step"] <= step]
        write_text(hist_file, "".join(json.dumps(h) + "\n" for h in history))
    bar = None
    if cfg.progress and accelerator.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, initial=step, desc=recipe.name, unit="step", disable=None)
    features = None
    if cfg.cache_features:
        features = FeatureCache.build(model, train_seqs, accelerator.device, cfg.batch_size,
                                      progress=cfg.progress and accelerator.is_main_process,
                                      feature_layers=getattr(recipe, "feature_layers", ()))
    heads.train()
    run = Run(cfg, recipe, model, train_seqs, accelerator, features, params, optimizer, scheduler, total,
              saved_config, fingerprint, hist_file, bar)
    return run, Position(step=step, saved=step, rng=torch.get_rng_state(), history=history, start=step)


def _other_processes(resume_from: Path, nproc: int) -> None:
    """Warn where the checkpoint was saved by another number of processes than this run's ``nproc``: the steps are
    the same (N processes equal one), but each step's sums are taken in another order, so the weights are an
    uninterrupted run's up to floating-point rounding, not bit for bit."""
    before = ckpt_io.read_state(resume_from)["config"].get("processes")  # None: saved before they were recorded
    if before is not None and before != nproc:
        logger.warning("--resume: the checkpoint in %s was saved by a run of %d process(es), this one has %d: it "
                       "trains the same steps, but sums each step's gradients in another order, so the result equals "
                       "an uninterrupted run's up to floating-point rounding, not bit for bit", resume_from.parent,
                       before, nproc)


def _micro_batches(run: Run, step: int) -> list[tuple]:
    """This process's rows of the ``grad_accum`` micro-batches of the step after ``step``: (ids, hidden, labels,
    mask) each."""
    cfg, accelerator = run.cfg, run.accelerator
    nproc, rank = accelerator.num_processes, accelerator.process_index
    window = []
    for a in range(cfg.grad_accum):
        rows = batch_rows(len(run.train_seqs), step * cfg.grad_accum + a, cfg.batch_size, cfg.seed)[rank::nproc]
        ids, mask = collate([run.train_seqs[r] for r in rows], accelerator.device)
        if run.features is not None:
            hidden, labels, mask = run.features.batch(rows)
        else:
            hidden, labels = target_features(run.model, ids, mask, getattr(run.recipe, "feature_layers", ()))
        window.append((ids, hidden, labels, mask))
    return window


def _local_gradient(run: Run, step: int) -> torch.Tensor:
    """Backward of this process's share of the loss of the step after ``step``; returns its statistics
    [loss, correct per depth, count per depth]."""
    recipe, accelerator, depths = run.recipe, run.accelerator, run.recipe.depths
    window = _micro_batches(run, step)  # what the loss averages over is counted before any backward
    over = torch.tensor([recipe.loss_counts(labels, mask) for _, _, labels, mask in window],
                        dtype=torch.long, device=accelerator.device).sum(0)
    if accelerator.num_processes > 1:  # every process divides by the count of the whole global step
        over = accelerator.reduce(over, reduction="sum")
    over = over.tolist()
    stats = torch.zeros(1 + 2 * depths, device=accelerator.device)  # loss, correct[d], count[d]
    for ids, hidden, labels, mask in window:
        loss, correct, count = recipe.accumulate(ids, hidden, labels, mask, over, accelerator.autocast)
        stats[0] += loss.detach()
        stats[1 : 1 + depths] += torch.tensor(correct, dtype=stats.dtype, device=stats.device)
        stats[1 + depths :] += torch.tensor(count, dtype=stats.dtype, device=stats.device)
    return stats


def _summed_over_processes(run: Run, stats: torch.Tensor, held) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Several processes: the gradients and ``stats`` summed over them, and the interrupts they got (``held``'s
    flags, carried in the statistics' collective) summed: (stats, seen). One process: (stats, None)."""
    accelerator = run.accelerator
    if accelerator.num_processes == 1:
        return stats, None
    for p in run.params:  # each process's gradient is its share of the global step's: their sum is the step's
        p.grad = accelerator.reduce(p.grad, reduction="sum")
    stats = accelerator.reduce(torch.cat([stats, held.recorded(stats.device)]), reduction="sum")
    return stats[:-2], stats[-2:]


def _check_weights(run: Run, at: Position) -> None:
    """The weights the step after ``at.step`` left are finite; else :class:`TrainingDiverged`."""
    if run.params and not bool(torch.stack([torch.isfinite(p).all() for p in run.params]).all()):
        raise _diverged(run, at, "its update left weights that are not finite")


def _diverged(run: Run, at: Position, what: str) -> TrainingDiverged:
    """The one-line error of the step after ``at.step``, whose ``what`` (its loss, the weights it left) is not
    finite; it names what to change (AdamW's steps scale with lr whatever the gradient's norm: clipping it would
    not help) and what was kept."""
    cfg = run.cfg
    change = f"lower lr (--lr, now {cfg.lr:g})"
    if cfg.weight_decay:
        change += f" or weight_decay (--weight-decay, now {cfg.weight_decay:g})"
    return TrainingDiverged(f"training diverged at step {at.step + 1}: {what}; {change}; {_kept(at)}")


def _kept(at: Position) -> str:
    return "no head was written" + (f", the checkpoint of step {at.saved} is kept" if at.saved else "")


def _check_loss(run: Run, at: Position, stats: torch.Tensor) -> None:
    """The step's loss, summed over the processes (the same on each: all of them stop at the same step), is finite;
    else :class:`TrainingDiverged` before its update."""
    loss = float(stats[0])
    if math.isfinite(loss):
        return
    if at.step == at.start:  # no update of this run made these weights: not the learning rate's doing
        raise TrainingDiverged(f"the loss of step {at.step + 1}, the first of this run, is {loss} before any update: "
                               f"the target's hidden states or the starting weights are not finite; {_kept(at)}")
    raise _diverged(run, at, f"its loss is {loss}")


def _apply_step(run: Run, at: Position, stats: torch.Tensor) -> dict:
    """Clip the step's gradient, apply it and advance ``at``; returns the step's record (appended to the history
    on the main process)."""
    cfg, depths, scheduler = run.cfg, run.recipe.depths, run.scheduler
    if cfg.max_grad_norm > 0:  # after the summing: every process clips the same gradient
        torch.nn.utils.clip_grad_norm_(run.params, cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]  # the rate this step uses (scheduler.step() below moves to the next)
    # a head (depth) no position of the step reaches has no top-1: None, as the reports write it, not a 0.0
    top1 = [float(stats[1 + i] / n) if (n := float(stats[1 + depths + i])) else None for i in range(depths)]
    rec = {"step": at.step + 1, "loss": float(stats[0]), "top1": top1, "lr": lr}
    with interrupts_deferred():  # an interrupt lands before the step or after it, never inside
        run.optimizer.step()
        # every process applied the same summed gradient to the same weights: all of them stop here, or none
        _check_weights(run, at)
        scheduler.step()
        run.optimizer.zero_grad(set_to_none=True)
        # `at` advances inside the block: an interrupt handled at its end finds the step counted, and keeps it
        at.step, at.rng = at.step + 1, torch.get_rng_state()
        if run.accelerator.is_main_process:
            at.history.append(rec)
            with open(run.hist_file, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return rec


def number(value: float | None, digits: int = 3) -> str:
    """``value`` for a log line or a report.md table or line: "n/a" where nothing was measured."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _log_and_save(run: Run, at: Position, rec: dict) -> None:
    """After step ``at.step`` (``rec``): the progress bar, the log line, and the checkpoint when due (main process)."""
    cfg, total = run.cfg, run.total
    due = at.step % cfg.save_every == 0 or at.step == total
    if run.accelerator.is_main_process:
        if run.bar is not None:
            run.bar.update(1)
            run.bar.set_postfix(loss=f"{rec['loss']:.3f}", top1="/".join(number(t, 2) for t in rec["top1"]))
        if at.step % cfg.log_every == 0 or at.step == total:
            logger.info("step %d/%d loss %.4f top1 %s lr %.2e", at.step, total, rec["loss"],
                        " ".join(number(t) for t in rec["top1"]), rec["lr"])
        if due:
            run.save(at)
    if due:  # saved (by the main process)
        at.saved = at.step


def train_drafter(cfg: TrainConfig, recipe, model, train_seqs: list[list[int]], accelerator,
                  resume_from: Path | None) -> list[dict]:
    """Train ``recipe.module`` (Medusa heads, an EAGLE layer) against the frozen target; returns the history of
    logged {step, loss, top1 per draft depth}. Saves checkpoints; resumes bit-exactly from ``resume_from``. An
    interrupt (Ctrl-C, SIGTERM) never lands inside an optimizer step; one process then saves the last completed
    step before the interrupt goes on (train/interrupt_saves.py). Several processes record it and all stop after
    the step whose collective first carries it, once the main process has saved that step; one that stopped before
    the first step (train/agreed_interrupts.py's ``meet_after``) stops them all before it."""
    run, at = _start(cfg, recipe, model, train_seqs, accelerator, resume_from)
    held = InterruptsHeld() if accelerator.num_processes > 1 else contextlib.nullcontext()
    with held:  # its end handles a signal that came after the last step's collective: that step is saved
        if accelerator.num_processes > 1:  # they meet before the first step: one stopped before it stops them all
            held.meet(accelerator)
        try:
            while at.step < run.total:
                stats = _local_gradient(run, at.step)  # this process's share of the step: its backward is done
                stats, seen = _summed_over_processes(run, stats, held)
                _check_loss(run, at, stats)
                rec = _apply_step(run, at, stats)
                _log_and_save(run, at, rec)
                if seen is not None and bool(seen.any()):  # every process finished this step: it is the one to keep
                    stop_together(run, at, seen, held)
                accelerator.wait_for_everyone()
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM through the CLI: keep the steps since the last save
            record_interrupt(err, run, at)
            raise
    if run.bar is not None:
        run.bar.close()
    recipe.module.eval()
    return at.history
