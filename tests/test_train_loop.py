"""train-medusa on a tiny random model: a step lowers the loss, the saved layout loads, resume is exact,
the output dir and configuration guards refuse, and the tree chooser keeps its invariants."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads, load_medusa  # noqa: E402
from specdec.train import checkpoint as ckpt_io  # noqa: E402
from specdec.train import features, interrupt_saves, loop, medusa_loss, medusa_recipe, output_dir  # noqa: E402
from specdec.train.agreed_interrupts import InterruptsHeld  # noqa: E402
from specdec.train.choices import choose_tree  # noqa: E402
from specdec.train.config import TrainConfig  # noqa: E402
from specdec.train.deferred_interrupts import interrupts_deferred  # noqa: E402
from specdec.train.eagle_recipe import EagleRecipe  # noqa: E402
from specdec.train.output_dir import OutputDirError  # noqa: E402
from specdec.train.pipeline import run_training  # noqa: E402
from specdec.train.process_failures import FailureNotes, PeerFailed  # noqa: E402

from specdec.errors import InputError  # noqa: E402
from specdec.sigterm import Terminated, sigterm_as_interrupt  # noqa: E402

CHARS = list("abcdefghijklmnopqrstuvwxyz .,?!'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")
TEXTS = [f"the {w} number {i} likes {w[::-1]} and sings, {i * 7}" for i, w in
         enumerate(["cat", "dog", "bird", "fish", "frog", "bee", "owl", "fox", "cow", "yak", "eel", "ant"] * 2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specdec.testing import build_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    build_tiny_model("llama-mha-untied", vocab_size=96).save_pretrained(root / "model")
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]")),
                                  unk_token="[UNK]", pad_token="[UNK]")
    tok.save_pretrained(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root


def _cfg(tiny, out, **kw):
    base = dict(model=str(tiny / "model"), output_dir=str(out), data=str(tiny / "data.jsonl"), num_heads=2,
                seq_len=32, batch_size=4, max_steps=6, save_every=2, lr=3e-3, eval_prompts=2,
                eval_max_new_tokens=8, progress=False, held_out_fraction=0.2)
    base.update(kw)
    if base.get("drafter") == "eagle":  # heads are Medusa's
        base.pop("num_heads")
    return TrainConfig(**base)


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_one_step_lowers_loss_on_a_fixed_batch(loss):
    from specdec.testing import build_tiny_model

    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, 64))
    lm_w = model.get_output_embeddings().weight.detach()
    heads.init_lm_heads_from(lm_w)
    ids, mask = features.collate([[1, 5, 9, 2, 7, 3, 3, 8], [4, 4, 6, 1, 2]], "cpu")
    hidden, labels = features.target_features(model, ids, mask)
    opt = torch.optim.AdamW(heads.parameters(), lr=1e-2)

    def total():
        return sum(0.8**i * medusa_loss.head_loss(heads, i, hidden, labels, mask, lm_w, loss)[0] for i in range(3))

    before = total()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = total()
    assert after < before - 1e-3


def test_a_batch_too_short_for_a_head_trains_the_others():
    """A micro-batch whose sequences all end before head 2's target: that head's loss is 0 and still backpropagates
    (a zero with no graph raised an autograd error mid-run)."""
    from specdec.testing import build_tiny_model

    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, 64))
    lm_w = model.get_output_embeddings().weight.detach()
    ids, mask = features.collate([[1, 5, 9], [4, 4]], "cpu")
    hidden, labels = features.target_features(model, ids, mask)
    loss, correct, count = medusa_loss.head_loss(heads, 2, hidden, labels, mask, lm_w, "ce")
    loss.backward()
    assert loss.item() == 0.0 and (correct, count) == (0, 0)
    assert all(p.grad is not None and not p.grad.any() for p in heads.heads[2].parameters())


def test_history_has_no_top1_for_a_head_no_position_reaches(tiny, tmp_path, caplog):
    """Texts of 3-5 tokens and 5 heads: heads 3-5 meet no position in any step. history.jsonl and the log say so
    (null / n/a), as report.json does, where a 0.0 would read as a measured miss. The run's last line read its
    numbers raw ("top1 [0.23809523809523808, None, ...], tau None"); it reads them as the step lines do."""
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("abc", "xyz", "hello", "abd", "cat")))
    out = tmp_path / "run"
    with caplog.at_level("INFO", logger="specdec.train"):
        run_training(_cfg(tiny, out, data=str(data), num_heads=5, seq_len=16, batch_size=2, max_steps=2,
                          eval_tau=False, held_out_fraction=0.0))
    history = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert len(history) == 2
    for rec in history:
        assert rec["top1"][0] is not None and rec["top1"][2:] == [None, None, None]
    assert "n/a n/a n/a lr" in caplog.text
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]  # as the step lines read
    assert len(done) == 1 and re.fullmatch(r"done: top1( (\d\.\d{3}|n/a)){5}, tau n/a", done[0]), done


def test_more_eval_prompts_than_there_are_is_said_once(tiny, tmp_path, caplog):
    """--eval-prompts beyond the held-out chat prompts was said twice: by the up-front check of the prompts (with no
    chat template) and again by the measurement after training. Once, before the work, is enough."""
    from specdec.eval.prompts import CHAT

    with caplog.at_level("WARNING", logger="specdec.train"):
        report = run_training(_cfg(tiny, tmp_path / "run", max_steps=1, save_every=1, eval_prompts=1000,
                                   eval_max_new_tokens=2))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--eval-prompts 1000:")]
    assert said == [f"--eval-prompts 1000: there are {len(CHAT)} held-out chat prompts; using all {len(CHAT)}"]
    assert report["tau"] is not None


def test_kl_loss_is_zero_only_for_the_target_distribution():
    """KL vs the target's distribution at t+1+i: 0 when the head reproduces it, > 0 otherwise."""
    from specdec.testing import build_tiny_model

    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    lm_w = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(MedusaConfig(1, 1, model.config.hidden_size, 64, shared_lm_head=True))
    ids, mask = features.collate([[1, 5, 9, 2, 7, 3]], "cpu")
    hidden, labels = features.target_features(model, ids, mask)
    # the same hidden state at every position: the head (identity ResBlock at init, shared LM head)
    # then outputs exactly the target's distribution at t+1
    same = hidden[:, :1].expand_as(hidden).contiguous()
    exact, _, _ = medusa_loss.head_loss(heads, 0, same, labels, mask, lm_w, "kl")
    assert abs(exact.item()) < 1e-5
    wrong, _, _ = medusa_loss.head_loss(heads, 0, hidden, labels, mask, lm_w, "kl")
    assert wrong.item() > 1e-3
    with pytest.raises(ValueError, match="loss must be one of"):
        TrainConfig(model="default", output_dir="unused", loss="mse")


def test_kl_loss_is_kl_from_the_target_to_the_head_and_one_position_is_its_own_mean():
    """2-token vocabulary, identity LM head, identity head at init: the logits are the hidden states. Head 0 at t=0
    sees logits (0, 0), i.e. (1/2, 1/2); the target at t=1 has logits (ln 3, 0), i.e. (3/4, 1/4)."""
    import math

    heads = MedusaHeads(MedusaConfig(1, 1, 2, 2, shared_lm_head=True))
    hidden = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0]]])
    labels, mask = torch.tensor([[0, 0]]), torch.ones(1, 2, dtype=torch.long)
    kl, correct, count = medusa_loss.head_loss(heads, 0, hidden, labels, mask, torch.eye(2), "kl")
    # KL(target || head) = 3/4 ln(3/4 / 1/2) + 1/4 ln(1/4 / 1/2) = 0.75 ln 1.5 - 0.25 ln 2 = 0.130812
    # (the reverse, KL(head || target) = 0.5 ln(2/3) + 0.5 ln 2 = 0.143841); one position: divided by 1
    assert kl.item() == pytest.approx(0.75 * math.log(1.5) - 0.25 * math.log(2), abs=1e-6)
    assert (correct, count) == (1, 1)  # argmax of (0, 0) is 0, the label at t=1
    ce, _, _ = medusa_loss.head_loss(heads, 0, hidden, labels, mask, torch.eye(2), "ce")
    assert ce.item() == pytest.approx(math.log(2), abs=1e-6)  # -ln(1/2) at the one position


def test_feature_cache_matches_per_batch_features():
    """Cached per-sequence features, re-padded for any batch, equal a direct forward of that batch."""
    from specdec.testing import build_tiny_model

    model = build_tiny_model("llama-mha-untied", vocab_size=64)
    seqs = [[1, 5, 9, 2, 7, 3, 3, 8], [4, 4, 6, 1, 2], [7, 7, 1], [2, 9, 9, 9, 4, 1, 6]]
    cache = features.FeatureCache.build(model, seqs, "cpu", batch_size=3)
    for rows in ([2, 0], [1, 3, 0], [3]):
        hidden, labels, mask = cache.batch(rows)
        ids, want_mask = features.collate([seqs[r] for r in rows], "cpu")
        want_hidden, want_labels = features.target_features(model, ids, want_mask)
        valid = want_mask.bool()
        assert torch.equal(mask, want_mask)
        torch.testing.assert_close(hidden[valid], want_hidden[valid], rtol=1e-5, atol=1e-5)
        assert torch.equal(labels[valid], want_labels[valid])
        assert not hidden[~valid].any() and not labels[~valid].any()  # padding is inert zeros


def test_cached_and_uncached_training_follow_the_same_curve(tiny, tmp_path):
    def run(name, cache):
        (tmp_path / name).mkdir()
        cfg = _cfg(tiny, tmp_path / name, cache_features=cache)
        return medusa_recipe.train_heads(cfg, *_model_and_seqs(tiny), _accelerator(), None)[1]

    cached, direct = run("cached", True), run("direct", False)
    assert [h["step"] for h in cached] == [h["step"] for h in direct] == list(range(1, 7))  # max_steps=6
    for a, b in zip(cached, direct, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a, b)


def test_max_grad_norm_clips_every_step_and_zero_means_off(tiny, tmp_path, monkeypatch):
    """--max-grad-norm: every optimizer step sees a gradient of at most that norm; 0 leaves gradients alone."""
    seen = []
    step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    for name, clip in (("free", 0.0), ("clipped", 1e-3)):
        seen.clear()
        (tmp_path / name).mkdir()
        medusa_recipe.train_heads(_cfg(tiny, tmp_path / name, max_grad_norm=clip), *_model_and_seqs(tiny),
                                  _accelerator(), None)
        assert len(seen) == 6
        if clip:
            assert max(seen) <= clip * (1 + 1e-4), seen
        else:
            assert min(seen) > 1e-2, seen  # what a 1e-3 clip would have cut
    with pytest.raises(ValueError, match="max_grad_norm"):
        _cfg(tiny, tmp_path, max_grad_norm=-1.0)


def test_logged_lr_is_the_one_each_step_used(tiny, tmp_path, monkeypatch):
    """history.jsonl's lr is the rate the optimizer stepped with, not the scheduler's next one: with 3 warmup steps
    the first step uses lr / 4."""
    used, real_step = [], torch.optim.AdamW.step

    def step(self, *a, **k):
        used.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = _cfg(tiny, tmp_path, warmup_steps=3, schedule="cosine")
    history = medusa_recipe.train_heads(cfg, *_model_and_seqs(tiny), _accelerator(), None)[1]
    assert [h["lr"] for h in history] == used
    assert used[0] == pytest.approx(cfg.lr / 4) and used[3] == pytest.approx(cfg.lr)


class _Threads:
    """``n`` training processes as threads of this one, for what the loop asks of accelerate: ``reduce`` adds the
    ranks' tensors (in rank order, the same sum on every rank) through shared slots."""
    def __init__(self, n: int) -> None:
        import threading

        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=120), [None] * n

    def rank(self, r: int):
        import contextlib
        from types import SimpleNamespace

        def reduce(tensor, reduction="sum"):
            self.slots[r] = tensor.clone()
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)
            self.barrier.wait()  # everyone has read the slots before anyone writes the next
            return total / self.n if reduction == "mean" else total

        return SimpleNamespace(num_processes=self.n, process_index=r, is_main_process=r == 0,
                               device=torch.device("cpu"), autocast=contextlib.nullcontext, reduce=reduce,
                               wait_for_everyone=self.barrier.wait)


def _first_step_gradient(tiny, out, drafter, seqs, monkeypatch, processes=1, **kw):
    """The gradient the first optimizer step uses (every rank's: they must agree) and its logged loss."""
    import threading

    grads, real_step = [], torch.optim.AdamW.step

    def step(self, *a, **k):
        grads.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    out.mkdir()
    cfg = _cfg(tiny, out, max_steps=1, drafter=drafter, **({"eagle_steps": 2} if drafter == "eagle" else {}), **kw)
    model = _model_and_seqs(tiny)[0]
    vocab = tuple(range(1, 40))  # a reduced draft vocabulary: the other tokens' positions carry no token loss
    recipes = []
    for _ in range(processes):  # built here, one after the other: they seed the global generator
        torch.manual_seed(cfg.seed)
        recipes.append(EagleRecipe(cfg, model, "cpu", draft_vocab=vocab) if drafter == "eagle" else
                       medusa_recipe.MedusaRecipe(cfg, model, "cpu", draft_vocab=vocab if cfg.loss == "ce" else ()))
    if processes == 1:
        history = loop.train_drafter(cfg, recipes[0], model, seqs, _accelerator(), None)
        return grads, history[0]["loss"]
    group, histories, errors = _Threads(processes), [None] * processes, []

    def run(r):
        try:
            histories[r] = loop.train_drafter(cfg, recipes[r], model, seqs, group.rank(r), None)
        except BaseException as err:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(err)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(processes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return grads, histories[0][0]["loss"]


# lengths 3, 4, 5 and 20: however the rows pair up, the two micro-batches hold different numbers of loss tokens
RAGGED = [[(7 * i + 3 * j) % 90 + 1 for j in range(n)] for i, n in enumerate((3, 4, 5, 20))]


@pytest.mark.parametrize("drafter,loss", [("medusa", "ce"), ("medusa", "kl"), ("eagle", "ce")])
def test_gradient_accumulation_and_processes_equal_one_larger_batch(tiny, tmp_path, monkeypatch, drafter, loss):
    """--grad-accum 2 over two micro-batches of different token counts, or two processes each holding half of a
    batch, take the gradient of one batch of both: the step's loss is each term's mean over all the step's loss
    tokens (it was the mean of the micro-batches' (processes') means)."""
    (big,), big_loss = _first_step_gradient(tiny, tmp_path / "big", drafter, RAGGED, monkeypatch, loss=loss,
                                            batch_size=4)
    (acc,), acc_loss = _first_step_gradient(tiny, tmp_path / "acc", drafter, RAGGED, monkeypatch, loss=loss,
                                            batch_size=2, grad_accum=2)
    two, two_loss = _first_step_gradient(tiny, tmp_path / "two", drafter, RAGGED, monkeypatch, processes=2,
                                         loss=loss, batch_size=4)
    assert len(two) == 2  # each rank stepped
    for grads in (acc, *two):
        assert len(grads) == len(big)
        for a, b in zip(grads, big, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert acc_loss == pytest.approx(big_loss, rel=1e-6) and two_loss == pytest.approx(big_loss, rel=1e-6)


def _model_and_seqs(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    seqs = [[(i * 7 + j * 3) % 90 + 1 for j in range(10 + i % 7)] for i in range(16)]
    return model, seqs


def _accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_more_than_one_block_per_head_warns_that_fasterdecoding_cannot_load_them(num_layers, monkeypatch, caplog):
    """FasterDecoding's MedusaModel repeats one block, so it would load such heads with every block the last one."""
    from specdec.testing import build_tiny_model

    monkeypatch.setattr(medusa_recipe, "train_drafter", lambda *args: [])  # the recipe only: no training
    cfg = TrainConfig(model="m", output_dir="out", num_heads=2, num_layers=num_layers)
    with caplog.at_level("WARNING", logger="specdec.train.medusa_recipe"):
        medusa_recipe.train_heads(cfg, build_tiny_model(), [], SimpleNamespace(device="cpu", is_main_process=True),
                                  None)
    warned = [r.getMessage() for r in caplog.records if "FasterDecoding" in r.getMessage()]
    assert len(warned) == (num_layers > 1) and all("--num-layers 2" in w and "export-head" in w for w in warned)


def test_run_writes_loadable_layout_and_report(tiny, tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "run"
    rc = main(["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
               "--output-dir", str(out), "--num-heads", "2", "--seq-len", "32", "--batch-size", "4",
               "--max-steps", "4", "--eval-prompts", "2", "--eval-max-new-tokens", "8", "--tree-budget", "5",
               "--no-progress"])
    assert rc == 0
    # stdout is the report's JSON alone; stderr ends saying where the heads are and how to draft with them
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)) == {"top1", "top5", "estimated_tau", "tau", "seconds"}
    assert captured.err.splitlines()[-1] == (
        f"wrote Medusa heads to {out} (report: {out / 'report.md'}); draft with them: specdec generate --model "
        f"{tiny / 'model'} --drafter medusa --drafter-option path={out} PROMPT")
    heads = load_medusa(out, hidden_size=64, vocab_size=96)
    assert heads.config.num_heads == 2 and 1 <= len(heads.config.medusa_choices) <= 5
    report = json.loads((out / "report.json").read_text())
    assert len(report["top1"]) == 2
    assert all(0 <= a <= b <= 1 for a, b in zip(report["top1"], report["top5"], strict=True))
    assert report["tau"]["tau"] >= 1.0 and report["steps"] == 4
    assert (out / "report.md").is_file() and "step 4/4" in (out / "train.log").read_text()
    # a second run into the same dir is refused; the CLI says how to proceed
    assert main(["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
                 "--output-dir", str(out), "--no-progress"]) == 2


def test_a_run_stopped_while_writing_its_report_leaves_the_earlier_one_whole(tiny, tmp_path, monkeypatch):
    """A resume that evaluates a finished run again (another --tree-budget), stopped halfway through writing
    report.json, leaves the earlier report as it was: not a file cut short, and no temporary file."""
    out = tmp_path / "run"
    run_training(_cfg(tiny, out, max_steps=2, eval_tau=False))
    before = {name: (out / name).read_text() for name in ("report.json", "report.md")}
    write_text = Path.write_text

    def cut_short(self, data, *args, **kwargs):  # a kill halfway through the write
        if self.name.startswith("report.json"):
            write_text(self, data[: len(data) // 2])
            raise KeyboardInterrupt
        return write_text(self, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(tiny, out, max_steps=2, eval_tau=False, resume=True, tree_budget=3))
    assert {name: (out / name).read_text() for name in before} == before
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def _launch_two(*script: str) -> list[str]:
    """`accelerate launch` of ``script`` as two processes on this machine (gloo on a CPU). Port 0: the launcher's
    store takes a free port. On the default port (29500) two launches starting together (other pytest-xdist workers,
    other test runs on the machine) both found it free and one failed with EADDRINUSE."""
    import sys

    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
            *script]


def _what_the_ranks_said(stderr: str, lines: int = 30) -> str:
    """A failed two-process launch's output, for an assertion: each rank's last ``lines`` lines of its traceback (the
    launcher prefixes them with ``[rankN]:``), its CLI lines, then the output's end. The end alone held the main
    process's error at its last collective ("Connection closed by peer") and not the other's, which came first."""
    out = stderr.splitlines()
    parts = [f"--- rank {r}:\n" + "\n".join([x for x in out if x.startswith(f"[rank{r}]:")][-lines:]) for r in (0, 1)]
    parts.append("--- CLI lines:\n" + "\n".join(x for x in out if x.startswith("specdec ")))
    # a rank killed by a signal (SIGABRT: a C++ exception, gloo's checks) says why in lines of no rank prefix
    native = [x for x in out if not x.startswith("[rank") and re.search(r"terminate|what\(\)|abort|gloo", x, re.I)]
    parts.append("--- native lines:\n" + "\n".join(native[-lines:]))
    return "\n".join(parts) + "\n--- the end:\n" + stderr[-1500:]


@pytest.mark.slow
def test_two_processes_follow_the_single_process_curve(tiny, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a CPU-only machine: two real processes (gloo),
    each taking half of every global batch, give the loss curve of one process, also where the halves hold
    different numbers of tokens (each process's mean loss averaged over the processes did not). What the data gives
    to warn about (an empty record) is said once, not once per process."""
    import os
    import subprocess
    import sys

    data = tmp_path / "ragged.jsonl"  # 39 to 79 characters, a token each: ragged under --seq-len 64
    data.write_text("".join(json.dumps({"text": t + " la" * 3 * (i % 5)}) + "\n" for i, t in enumerate(TEXTS))
                    + json.dumps({"text": ""}) + "\n")
    args = ["train-medusa", "--model", str(tiny / "model"), "--data", str(data), "--num-heads", "2",
            "--seq-len", "64", "--batch-size", "4", "--max-steps", "6", "--lr", "3e-3", "--no-eval-tau",
            "--no-progress", "--held-out-fraction", "0.2"]
    launch = _launch_two("-m", "specdec.cli")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, cmd in (("one", [sys.executable, "-m", "specdec.cli"]), ("two", launch)):
        proc = subprocess.run(cmd + args + ["--output-dir", str(tmp_path / name)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, _what_the_ranks_said(proc.stderr)
        assert proc.stderr.count("hold an empty text and are skipped") == 1, (name, proc.stderr[-3000:])
    one, two = ([json.loads(x) for x in (tmp_path / n / "history.jsonl").read_text().splitlines()]
                for n in ("one", "two"))
    assert json.loads((tmp_path / "two" / "report.json").read_text())["processes"] == 2
    assert [h["step"] for h in one] == [h["step"] for h in two] == list(range(1, 7))
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 and a["top1"] == pytest.approx(b["top1"], abs=1e-6), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]


GROUP_OUTLIVES_DESTROY = """
import os, sys, torch, torch.distributed as dist
from specdec.train.pipeline import import_before_the_process_group
if sys.argv[1] == "fixed":
    import_before_the_process_group()
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
from specdec.testing import build_tiny_model
build_tiny_model("llama-mha-untied", vocab_size=96)  # transformers imports torch.distributed.checkpoint here
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
print(sum(open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo") for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the process's threads in /proc")
def test_the_process_group_ends_with_destroy_process_group(tmp_path):
    """A training run's process group is gone (its gloo threads joined) once it is destroyed, even after
    transformers built a model: imported after the group started, torch.distributed.nn held it in default
    arguments, and its threads then let go of the last collective during interpreter shutdown, which aborted a
    process of a two-process run now and then after it had succeeded. The control shows the test sees that."""
    import subprocess

    def gloo_threads(how: str) -> int:
        proc = subprocess.run([sys.executable, "-c", GROUP_OUTLIVES_DESTROY, how, str(tmp_path / how)],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        # the control keeps the group, which may abort the process as it exits (the bug itself: "terminate called
        # without an active exception"), after it printed its count; the fixed process must exit cleanly
        assert proc.returncode == 0 or (how == "control" and proc.stdout.strip()), proc.stderr[-2000:]
        return int(proc.stdout.split()[-1])

    assert gloo_threads("fixed") == 0
    assert gloo_threads("control") > 0, "torch no longer keeps the group: import_before_the_process_group can go"


def test_kl_run_measures_tau_with_a_dynamic_tree(tiny, tmp_path):
    report = run_training(_cfg(tiny, tmp_path / "kl", loss="kl", eval_tree="dynamic", max_steps=2, tree_budget=4))
    tau = report["tau"]
    assert tau["tree"] == "dynamic" and tau["tree_nodes"] == len(report["medusa_choices"]) <= 4
    assert tau["tau"] >= 1.0 and report["config"]["loss"] == "kl"
    assert "dynamic tree of" in (tmp_path / "kl" / "report.md").read_text()
    with pytest.raises(ValueError, match="eval_tree must be one of"):
        _cfg(tiny, tmp_path / "bad", eval_tree="beam")


def test_the_dynamic_tau_tree_has_tree_budget_nodes_where_the_chosen_tree_has_fewer(tiny, tmp_path, monkeypatch):
    """--eval-tree dynamic drafts the --tree-budget most probable paths (max_nodes=B top_k=min(20, B), as the help
    says): one head ranks at most 10 tokens in the chosen tree, and the dynamic tree was cut to that tree's size too,
    a smaller tree than asked for and than the drafter options the help gives reproduce."""
    from specdec.drafters import medusa

    asked = []
    real = medusa.MedusaDrafter.__init__

    def recorded(self, *args, **kwargs):
        real(self, *args, **kwargs)
        asked.append((self.config.max_nodes, self.config.top_k))

    monkeypatch.setattr(medusa.MedusaDrafter, "__init__", recorded)
    report = run_training(_cfg(tiny, tmp_path / "one", num_heads=1, eval_tree="dynamic", max_steps=2, tree_budget=16))
    assert len(report["medusa_choices"]) <= 10 and report["tau"]["tree_nodes"] == 16
    assert asked and set(asked) == {(16, 16)}


def test_the_tau_measurement_draws_no_bar_off_a_terminal(tiny, tmp_path, capsys):
    """With progress on (the CLI's default), a run into a pipe or a log file drew no bar but the tau measurement's:
    generate()'s bar, shown whenever asked for, wrote its every redraw there."""
    run_training(_cfg(tiny, tmp_path / "run", max_steps=1, save_every=1, progress=True))
    err = capsys.readouterr().err
    assert "generate:" not in err, err


def test_output_dir_refusal_and_overwrite(tiny, tmp_path, monkeypatch):
    from specdec.train.data import TrainDataError

    out = tmp_path / "o"
    out.mkdir()
    (out / "something").write_text("the user's file")
    with pytest.raises(OutputDirError, match="--overwrite"):
        run_training(_cfg(tiny, out, eval_tau=False))
    with pytest.raises(OutputDirError, match="no checkpoint"):
        run_training(_cfg(tiny, out, eval_tau=False, resume=True))
    with pytest.raises(OutputDirError, match=r"/typo does not exist, so there is no run to resume; check the path"):
        run_training(_cfg(tiny, tmp_path / "typo", eval_tau=False, resume=True))  # it said "holds no checkpoint"
    # --overwrite deletes only what is recognisably a specdec run (issue 24 #5): here nothing is deleted
    with pytest.raises(OutputDirError, match="not a specdec training run"):
        run_training(_cfg(tiny, out, eval_tau=False, overwrite=True, max_steps=2))
    assert (out / "something").read_text() == "the user's file"
    run = tmp_path / "run"
    run_training(_cfg(tiny, run, eval_tau=False, max_steps=2))
    (run / "notes.txt").write_text("mine")  # a run's directory holding a file of the user's
    with pytest.raises(OutputDirError, match="notes.txt"):
        run_training(_cfg(tiny, run, eval_tau=False, overwrite=True, max_steps=2))
    (run / "notes.txt").unlink()
    before = sorted(p.name for p in run.iterdir())
    # inputs are checked before anything is deleted: a mistyped --data leaves the old run whole
    with pytest.raises(TrainDataError, match="not found"):
        run_training(_cfg(tiny, run, eval_tau=False, overwrite=True, data=str(tmp_path / "typo.jsonl")))
    assert sorted(p.name for p in run.iterdir()) == before and (run / "config.json").is_file()
    # so are what the data holds and the context: a wrong field or a seq_len past the model's context too
    with pytest.raises(TrainDataError, match="neither a 'content'"):
        run_training(_cfg(tiny, run, eval_tau=False, overwrite=True, text_field="content"))
    with pytest.raises(ValueError, match=r"^--seq-len 100000 exceeds the model's context of 512 tokens; pass "
                                         r"--seq-len 512 or less$"):
        run_training(_cfg(tiny, run, eval_tau=False, overwrite=True, seq_len=100_000))
    assert sorted(p.name for p in run.iterdir()) == before
    monkeypatch.chdir(run)  # never the working directory, even when it is a run
    with pytest.raises(OutputDirError, match="working directory"):
        run_training(_cfg(tiny, ".", eval_tau=False, overwrite=True, max_steps=2))
    monkeypatch.chdir(tmp_path)
    (run / "report.md.123.tmp").write_text("")  # the leftover of an interrupted atomic write belongs to the run
    (run / "history.jsonl.123.456.tmp").write_text("")  # so does one of a thread's (pid.thread)
    run_training(_cfg(tiny, run, eval_tau=False, overwrite=True, max_steps=2))
    assert (run / "config.json").is_file() and not (run / "report.md.123.tmp").exists()
    assert not (run / "history.jsonl.123.456.tmp").exists()


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory):
    """A 6-step run, saved every 2 steps, that nothing interrupts: what an interrupted and resumed one must equal."""
    full = tmp_path_factory.mktemp("uninterrupted") / "full"
    run_training(_cfg(tiny, full, eval_tau=False))
    return full


def _same_run(full, part) -> None:
    from safetensors.torch import load_file

    a, b = load_file(str(full / "medusa_lm_head.safetensors")), load_file(str(part / "medusa_lm_head.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ha = [json.loads(x) for x in (full / "history.jsonl").read_text().splitlines()]
    hb = [json.loads(x) for x in (part / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in hb] == list(range(1, 7)) and [h["loss"] for h in ha] == [h["loss"] for h in hb]
    assert [h["lr"] for h in ha] == [h["lr"] for h in hb]  # the schedule resumed where it was


def test_resume_after_kill_matches_uninterrupted_run(tiny, uninterrupted, tmp_path, monkeypatch):
    """Ctrl-C in step 6, its gradient accumulated but not applied: the 5 steps done are saved (the checkpoint of
    step 4 was all an interrupt left), and --resume from them ends as the uninterrupted run."""
    real_accumulate, calls = medusa_recipe.MedusaRecipe.accumulate, []

    def interrupted_in_step_6(self, *args):
        out = real_accumulate(self, *args)
        calls.append(1)
        if len(calls) == 6:  # after the backward, before the optimizer step
            raise KeyboardInterrupt
        return out

    part = tmp_path / "part"
    monkeypatch.setattr(medusa_recipe.MedusaRecipe, "accumulate", interrupted_in_step_6)
    with pytest.raises(KeyboardInterrupt) as interrupt:
        run_training(_cfg(tiny, part, eval_tau=False))
    monkeypatch.undo()
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(part))["step"] == 5 and interrupt.value.saved_step == 5
    with pytest.raises(OutputDirError, match="different configuration.*num_heads"):
        run_training(_cfg(tiny, part, eval_tau=False, resume=True, num_heads=3))
    with pytest.raises(OutputDirError, match=r"different configuration \(max_steps: checkpoint 6 vs now 8\)"):
        run_training(_cfg(tiny, part, eval_tau=False, resume=True, max_steps=8))
    # --epochs is ignored under --max-steps: resuming with another value is the same run (it was refused)
    run_training(_cfg(tiny, part, eval_tau=False, resume=True, epochs=7))
    _same_run(uninterrupted, part)


def test_a_resumed_run_whose_first_loss_is_nan_does_not_blame_the_lr(tiny, tmp_path, monkeypatch):
    """A resumed run's first step starts from the checkpoint's weights, which no update of this run made: a NaN loss
    there names the weights or the hidden states, not --lr (which the run's later steps would be blamed on)."""
    real_accumulate, calls = medusa_recipe.MedusaRecipe.accumulate, []

    def interrupted_in_step_3(self, *args):
        out = real_accumulate(self, *args)
        calls.append(1)
        if len(calls) == 3:  # the first two steps are done and saved
            raise KeyboardInterrupt
        return out

    part = tmp_path / "part"
    monkeypatch.setattr(medusa_recipe.MedusaRecipe, "accumulate", interrupted_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(tiny, part, eval_tau=False))
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(part))["step"] == 2

    def nan_loss(self, *args):
        loss, correct, count = real_accumulate(self, *args)
        return loss * float("nan"), correct, count

    monkeypatch.setattr(medusa_recipe.MedusaRecipe, "accumulate", nan_loss)
    with pytest.raises(loop.TrainingDiverged, match=re.escape(
            "the loss of step 3, the first of this run, is nan before any update")):
        run_training(_cfg(tiny, part, eval_tau=False, resume=True))


def test_a_sigterm_inside_an_optimizer_step_saves_that_step_whole(tiny, uninterrupted, tmp_path, monkeypatch):
    """SIGTERM between the optimizer's step and the scheduler's (a scheduler's time limit lands anywhere): it takes
    effect once step 5 is complete, which is saved and named, and --resume ends as the uninterrupted run. Saved where
    it landed, the checkpoint would hold step 5's weights under step 4's schedule and data position."""
    import os
    import signal

    from specdec.train.cli import _what_is_left

    from specdec.sigterm import Terminated, sigterm_as_interrupt

    real_step, calls = torch.optim.AdamW.step, []

    def step_then_sigterm(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    part = tmp_path / "part"
    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_sigterm)
    with sigterm_as_interrupt(), pytest.raises(Terminated) as interrupt:
        run_training(_cfg(tiny, part, eval_tau=False))
    monkeypatch.undo()
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(part))["step"] == 5
    assert _what_is_left(part, interrupt.value) == "saved the checkpoint of step 5 (continue with --resume)"
    run_training(_cfg(tiny, part, eval_tau=False, resume=True))
    _same_run(uninterrupted, part)


def test_an_interrupt_several_processes_could_not_save_names_the_steps_lost(tmp_path):
    """Several processes save on an interrupt only where all of them agreed on the step (a save alone could wait on
    a process that stopped); one that ends otherwise (the save failed) says the steps since the checkpoint are lost."""
    from specdec.train.cli import _what_is_left

    err, saves = KeyboardInterrupt(), []
    interrupt_saves._keep_on_interrupt(err, 7, 4, 2, lambda: saves.append(1))
    assert saves == [] and err.unsaved_steps == 3
    heads, optimizer, scheduler = _tiny_training_state()
    ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 4, {}, "fp")
    assert _what_is_left(tmp_path, err) == ("the checkpoint of step 4 is intact (continue with --resume); the 3 "
                                            "step(s) after it are lost (not saved on this interrupt)")


def test_a_checkpoint_the_full_disk_refuses_is_not_saved_and_leaves_the_last_one(tmp_path, monkeypatch):
    """A full disk refuses the heads' safetensors file, the first file of a checkpoint: safetensors said it as its
    own SafetensorError, which the interrupt's save did not take for "not saved" (an OSError): it escaped instead."""
    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    heads, optimizer, scheduler = _tiny_training_state()
    ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 4, {}, "fp")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    save = lambda: ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 6, {}, "fp")  # noqa: E731
    assert interrupt_saves._saved(save, 6) is False
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(tmp_path))["step"] == 4


def test_held_interrupts_stop_as_their_own_signal_else_as_the_peers():
    """After the processes agree to stop, each stops as its own signal would have stopped it; one that got none
    stops as its peers' (SIGTERM before SIGINT), and a signal that came after the last agreement is handled when
    the block ends."""
    import contextlib
    import os
    import signal

    from specdec.train.agreed_interrupts import InterruptsHeld

    from specdec.sigterm import Terminated, sigterm_as_interrupt

    # Python's own SIGINT handler, as in a training process (an xdist worker may run with SIGINT ignored, and an
    # ignored signal of its own rightly stops a process as its peers' instead)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with sigterm_as_interrupt(), contextlib.ExitStack() as undo:
        undo.callback(signal.signal, signal.SIGINT, before)
        ctrl_c = signal.getsignal(signal.SIGINT)  # sigterm_as_interrupt's, in Python's own stead
        for own, seen, raised in (([], [1, 1], Terminated), ([], [1, 0], KeyboardInterrupt),
                                  ([signal.SIGINT], [1, 1], KeyboardInterrupt), ([signal.SIGTERM], [0, 1], Terminated)):
            with pytest.raises(KeyboardInterrupt) as stopped, InterruptsHeld() as held:
                for s in own:
                    os.kill(os.getpid(), s)  # recorded, not raised
                assert held.recorded().tolist() == [float(signal.SIGINT in own), float(signal.SIGTERM in own)]
                held.stop(torch.tensor(seen, dtype=torch.float))
            assert type(stopped.value) is raised, (own, seen)
        with pytest.raises(Terminated), InterruptsHeld():
            os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is ctrl_c


class _SignalsItself:
    """An object whose finalizer sends ``signum`` to this process and runs on while the handler is called in it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __del__(self) -> None:
        os.kill(os.getpid(), self.signum)
        for _ in range(1000):  # the handler runs at one of these steps, inside the finalizer
            pass


def _run_on() -> None:
    for _ in range(500):  # after the finalizer, where the signal may raise (it is sent again 10 ms later)
        time.sleep(0.01)


def test_a_signal_that_lands_in_a_finalizer_stops_the_run_after_it():
    """SIGTERM or Ctrl-C that arrived while the garbage collector ran a ``__del__`` raised there: Python printed
    "Exception ignored in ..." and a traceback, and dropped the stop. It now stops the run once the finalizer has
    returned, without a traceback. A Ctrl-C the caller ignores (``nohup``, a background job) stays ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for signum, raised in ((signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)):  # one process
            with sigterm_as_interrupt(), pytest.raises(raised) as stopped:
                _SignalsItself(signum)
                _run_on()
            assert type(stopped.value) is raised
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with sigterm_as_interrupt():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for signum, raised in ((signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)):
            with sigterm_as_interrupt(), pytest.raises(raised), InterruptsHeld(hold=False):
                _SignalsItself(signum)
                _run_on()
    finally:
        signal.signal(signal.SIGINT, before)


def _meeting(peers=(0, 0), during=None, fails=False):
    """A meeting's collective as this process sees it: (an accelerator whose reduce adds the others' ``peers`` flags,
    sends a signal ``during`` it or fails as a lost connection, the list of what this process sent)."""
    def reduce(flags, reduction):
        sent.append(flags.tolist())
        if during is not None:
            os.kill(os.getpid(), during)  # while the processes meet
        if fails:
            raise RuntimeError("Connection closed by peer")
        return flags + torch.tensor(peers, dtype=torch.float)

    sent = []
    return SimpleNamespace(device=None, reduce=reduce), sent


def test_outside_the_loop_a_signal_acts_at_once_and_the_meetings_carry_it():
    """Outside the training loop (``hold=False``) a signal acts where it lands, as in one process, and is recorded;
    the process that stopped makes the others' next meeting with it (they stop there as its signal: SIGTERM), and a
    signal that comes while the processes meet is held until the meeting is over. A sketch of the others' side: the
    collective gives what they add."""
    import contextlib

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    with sigterm_as_interrupt(), contextlib.ExitStack() as undo:
        undo.callback(signal.signal, signal.SIGINT, before)
        ctrl_c = signal.getsignal(signal.SIGINT)  # sigterm_as_interrupt's, in Python's own stead
        # this process stops at once, then meets the others with its signal; they stop, so it marks the interrupt
        accelerator, sent = _meeting([0, 0])
        with pytest.raises(Terminated) as stopped, InterruptsHeld(hold=False) as agreed:
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                raise AssertionError("SIGTERM did not act")
            except KeyboardInterrupt as err:
                agreed.meet_after(accelerator, err)
                raise
        assert sent == [[0, 1]] and stopped.value.processes_stopped_together
        # the others gone already: it stops all the same, unmarked
        accelerator, sent = _meeting([0, 0], fails=True)
        with pytest.raises(KeyboardInterrupt) as stopped, InterruptsHeld(hold=False) as agreed:
            try:
                os.kill(os.getpid(), signal.SIGINT)
            except KeyboardInterrupt as err:
                agreed.meet_after(accelerator, err)
                raise
        assert sent == [[1, 0]] and not hasattr(stopped.value, "processes_stopped_together")
        # the others' side: a peer's signal at the meeting stops this process as that signal
        accelerator, sent = _meeting([0, 1])
        with pytest.raises(Terminated) as stopped, InterruptsHeld(hold=False) as agreed:
            agreed.meet(accelerator)
        assert sent == [[0, 0]] and stopped.value.processes_stopped_together
        # a signal during a meeting is handled after it (the others learn it at the next), and during the last one
        # when the block ends
        for last in (False, True):
            accelerator, sent = _meeting([0, 0], during=signal.SIGINT)
            with pytest.raises(KeyboardInterrupt) as stopped, InterruptsHeld(hold=False) as agreed:
                agreed.meet(accelerator, last=last)
                assert last, "the signal during the meeting was not handled after it"
            assert sent == [[0, 0]] and not hasattr(stopped.value, "processes_stopped_together")
        # an exchange is a meeting: what the processes then do together runs only where none stops, and a signal
        # during it is held until it is over too
        together = []

        def gather(during=None):
            if during is not None:
                os.kill(os.getpid(), during)
            together.append(1)
            return "everyone's"

        accelerator, sent = _meeting([0, 0])
        with InterruptsHeld(hold=False) as agreed:
            assert agreed.meet(accelerator, then=gather) == "everyone's" and together == [1]
        accelerator, sent = _meeting([0, 1])
        with pytest.raises(Terminated), InterruptsHeld(hold=False) as agreed:
            agreed.meet(accelerator, then=gather)
        assert together == [1]
        accelerator, sent = _meeting([0, 0])
        with pytest.raises(KeyboardInterrupt) as stopped, InterruptsHeld(hold=False) as agreed:
            agreed.meet(accelerator, then=lambda: gather(signal.SIGINT))
        assert together == [1, 1] and not hasattr(stopped.value, "processes_stopped_together")
        assert signal.getsignal(signal.SIGINT) is ctrl_c


@pytest.mark.parametrize("disk_full", [False, True])
def test_after_an_agreed_interrupt_every_process_learns_whether_the_main_one_saved(disk_full):
    """The main process saves once; every process learns whether it could (a full disk leaves the last checkpoint,
    and each process's line then names the steps lost, not a checkpoint that is not there)."""
    import threading

    group, saves, answers = _Threads(2), [], [None, None]

    def save():
        saves.append(1)
        if disk_full:
            raise OSError(28, "No space left on device")

    def run(r):
        answers[r] = interrupt_saves._saved_by_main(group.rank(r), save, 3)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert saves == [1] and answers == [not disk_full] * 2


# run by `accelerate launch` in each of two processes: an uninterrupted run, the same run interrupted (rank 0 gets
# SIGINT as step 3 starts, before its collective; rank 1 SIGTERM as step 3's update is applied, after it) and
# resumed; the CLI's exit codes, and how many of the runs closed the process group, go to rank<r>.json
TWO_PROCESS_DRIVER = """
import json, os, signal, sys
import torch, accelerate
from specdec.cli import main
from specdec.train import loop

rank, args, out = int(os.environ["RANK"]), json.loads(sys.argv[1]), sys.argv[2]
ended = []
accelerate.Accelerator.end_training = lambda self: ended.append(1)  # the three runs share one process group
armed, calls, real_rows, real_step = [False], [], loop.batch_rows, torch.optim.AdamW.step

def rows(num, micro, *a):
    if armed[0] and rank == 0 and micro == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real_rows(num, micro, *a)

def step(self, *a, **k):
    done = real_step(self, *a, **k)
    calls.append(1)
    if armed[0] and rank == 1 and len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    return done

loop.batch_rows, torch.optim.AdamW.step = rows, step
codes = [main(args + ["--output-dir", out + "/full"])]
armed[0], calls[:] = True, []
codes.append(main(args + ["--output-dir", out + "/part"]))
armed[0] = False
codes.append(main(args + ["--output-dir", out + "/part", "--resume"]))
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump([codes, len(ended)], f)
torch.distributed.barrier()  # both leave the group together (see OUTSIDE_THE_LOOP_DRIVER)
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_interrupted_at_different_points_save_the_step_they_agree_on(tiny, tmp_path):
    """Two real processes (gloo), each signalled at another point of step 3 (one before the step's collective, one
    after it): both finish step 3 and stop there, the main process saves it (they kept only the last --save-every
    checkpoint, here none), each exits with its own signal's code (130, 143) having closed the process group, and
    --resume ends as the uninterrupted run: the same weights, bit for bit, and the same losses."""
    import os
    import subprocess

    from safetensors.torch import load_file

    driver = tmp_path / "driver.py"
    driver.write_text(TWO_PROCESS_DRIVER)
    args = ["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"), "--num-heads", "2",
            "--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--save-every", "100", "--lr", "3e-3",
            "--no-eval-tau", "--no-progress", "--held-out-fraction", "0.2"]
    launch = _launch_two(str(driver))
    proc = subprocess.run(launch + [json.dumps(args), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, _what_the_ranks_said(proc.stderr)
    # the interrupted run closes its process group as a finished one does (left to exit, a rank can abort)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [[[0, 130, 0], 3],
                                                                                      [[0, 143, 0], 3]]
    assert "specdec train-medusa: interrupted; saved the checkpoint of step 3 (continue with --resume)" in proc.stderr
    assert "specdec train-medusa: terminated (SIGTERM); saved the checkpoint of step 3" in proc.stderr
    full, part = tmp_path / "full", tmp_path / "part"
    a, b = load_file(str(full / "medusa_lm_head.safetensors")), load_file(str(part / "medusa_lm_head.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ha, hb = ([json.loads(x) for x in (d / "history.jsonl").read_text().splitlines()] for d in (full, part))
    assert [h["step"] for h in hb] == list(range(1, 7)) and [h["loss"] for h in ha] == [h["loss"] for h in hb]
    assert "resumed from" in (part / "train.log").read_text()


# run by `accelerate launch` in each of two processes, self-distilling (4 batches: the processes take every other
# one): an uninterrupted run (its own distillation cache), then into another directory and cache: rank 0 gets SIGINT
# as its second batch starts (rank 1 is generating its own); the rerun, SIGTERM on rank 1 as it builds its feature
# cache (rank 0 goes on to the first step); the next rerun, SIGTERM on rank 0 as it evaluates, after training; then
# --resume. Exit codes, the batches each process kept after the first interrupt and the batches each generated in
# every run go to rank<r>.json
OUTSIDE_THE_LOOP_DRIVER = """
import importlib, json, os, signal, sys
from datetime import timedelta
from pathlib import Path
import torch, accelerate
from specdec.cli import main
from specdec.train import evaluate, features
from specdec.train.pipeline import import_before_the_process_group

generate = importlib.import_module("specdec.generate")  # the module (the package exports the function by its name)
signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's process has it (a test worker may not)
# the runs share one process group; where processes fall out of step inside a run, a collective fails in four
# minutes, not thirty (one minute was too short on a loaded 2-core CI machine: a process reached its run's first
# meeting more than a minute after its peer). Between runs they wait longer (below): the main process evaluates alone
import_before_the_process_group()  # as run_training does before its group: else the group outlives its destroy
torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=240))
between_runs = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=300))
accelerate.Accelerator.end_training = lambda self: None
rank, args, out = int(os.environ["RANK"]), json.loads(sys.argv[1]), Path(sys.argv[2])
armed, batches = [None], []
real_generate, real_build, real_accuracies = generate.generate, features.FeatureCache.build, \
    evaluate.scoped_head_accuracies

def distilling(*a, **k):
    batches.append(1)
    if armed[0] == "distill" and rank == 0 and len(batches) == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return real_generate(*a, **k)

def building(*a, **k):
    if armed[0] == "features" and rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_build(*a, **k)

def evaluating(*a, **k):
    if armed[0] == "evaluation" and rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)
    return real_accuracies(*a, **k)

generate.generate, evaluate.scoped_head_accuracies = distilling, evaluating
features.FeatureCache.build = staticmethod(building)
codes, kept, generated = [], None, []
for name, phase, extra in (("full", None, []), ("part", "distill", []), ("part", "features", []),
                           ("part", "evaluation", []), ("part", None, ["--resume"])):
    os.environ["SPECDEC_CACHE_DIR"] = str(out / ("cache-" + name))
    armed[0], batches[:] = phase, []
    codes.append(main(args + ["--output-dir", str(out / name)] + extra))
    # as separate launches would: the next run starts when both are done with this one. Going on at once, the other
    # process waits for the main one's evaluation in the next run's first collective, under the minute's timeout
    torch.distributed.barrier(group=between_runs)
    generated.append(len(batches))
    if phase == "distill":
        kept = {p.name.split(".", 1)[1]: [json.loads(x)["start"] for x in p.read_text().splitlines()]
                for p in (out / "cache-part").rglob("*.partial*.jsonl")}
with open(out / f"rank{rank}.json", "w") as f:
    json.dump([codes, kept, generated], f)
# both leave the group together (they met after the last run): a process tearing gloo down while its peer still
# ran once aborted ("terminate called without an active exception", exit -6)
torch.distributed.barrier()
torch.distributed.destroy_process_group()
"""


@pytest.mark.slow
def test_two_processes_interrupted_outside_the_training_loop_stop_together(tiny, tmp_path, monkeypatch):
    """Two real processes (gloo), each interrupt outside the training loop: one process stopped where the signal
    landed and the other crashed at its next collective ("Connection closed by peer", a traceback) or waited on.
    Now both stop, each with its line and exit code (one that got no signal takes its peer's), at the next point
    where they wait for each other: during self-distillation, which they share (each keeps the batches it
    finished), before the first step; an interrupt of the evaluation, which the main process runs alone after
    training, stops it only. The reruns go on from what was kept, and --resume ends as the uninterrupted run: the
    same heads, bit for bit. The self-distilled data are those of one process."""
    import os
    import subprocess

    from safetensors.torch import load_file

    from specdec.cli import main

    driver = tmp_path / "driver.py"
    driver.write_text(OUTSIDE_THE_LOOP_DRIVER)
    # --seq-len 96: the built-in prompts (up to 66 tokens) keep their answers
    args = ["train-medusa", "--model", str(tiny / "model"), "--num-heads", "2", "--seq-len", "96", "--batch-size",
            "4", "--max-steps", "4", "--num-prompts", "8", "--distill-max-new-tokens", "8", "--distill-batch-size",
            "2", "--no-eval-tau", "--no-progress", "--held-out-fraction", "0.25"]
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache-one"))  # first: it measures the CPU for both runs
    assert main(args + ["--output-dir", str(tmp_path / "one")]) == 0
    proc = subprocess.run(_launch_two(str(driver)) + [json.dumps(args), str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=400)
    assert proc.returncode == 0, _what_the_ranks_said(proc.stderr)
    assert "Traceback" not in proc.stderr, _what_the_ranks_said(proc.stderr)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    kept = {"partial.jsonl": [0], "partial.1.jsonl": [2, 6]}  # the batch each was generating when they stopped: 6
    assert ranks == [[[0, 130, 143, 143, 0], kept, [2, 2, 1, 0, 0]], [[0, 130, 143, 0, 0], kept, [2, 2, 0, 0, 0]]]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("specdec train-medusa:")]
    none = "it saved no checkpoint yet (see --save-every), so a rerun starts again"
    assert sorted(lines) == sorted([f"specdec train-medusa: interrupted; self-distillation kept the answers its "
                                    f"processes finished (at least {n} of 8 prompts), so a rerun generates only the "
                                    "rest" for n in (4, 6)]
                                   + [f"specdec train-medusa: terminated (SIGTERM); {none}"] * 2
                                   + ["specdec train-medusa: terminated (SIGTERM); the checkpoint of step 4 is intact "
                                      "(continue with --resume)"])
    full, part = tmp_path / "full", tmp_path / "part"
    a, b = load_file(str(full / "medusa_lm_head.safetensors")), load_file(str(part / "medusa_lm_head.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((part / "report.json").read_text())["top1"] == json.loads((full / "report.json").read_text())[
        "top1"]
    data = [[json.loads(f.read_text()) for f in (tmp_path / f"cache-{n}").rglob("distill/*.json")]
            for n in ("one", "full", "part")]
    assert data[0] == data[1] == data[2] and len(data[0]) == 1 and len(data[0][0]["sequences"]) == 8


# run by `accelerate launch` in each of two processes: rank 1's third step fails (a bad batch) while rank 0 waits in
# that step's all-reduce; each process's CLI exit code goes to rank<r>.json
FAILING_PROCESS_DRIVER = """
import json, os, sys
from specdec.cli import main
from specdec.train import loop

rank, args, out = int(os.environ["RANK"]), json.loads(sys.argv[1]), sys.argv[2]
real_rows = loop.batch_rows

def rows(num, micro, *a):
    if rank == 1 and micro == 2:
        raise ValueError("a bad batch")
    return real_rows(num, micro, *a)

loop.batch_rows = rows
code = main(args + ["--output-dir", out + "/run"])
with open(f"{out}/rank{rank}.json", "w") as f:
    json.dump(code, f)
sys.exit(code)
"""


@pytest.mark.slow
def test_an_error_on_one_process_stops_the_others_with_one_line(tiny, tmp_path):
    """Two real processes (gloo): an error on one (here in its third step, while the other waits in that step's
    all-reduce) gave the other a gloo traceback ("Connection closed by peer"). Now the failing process prints its
    line as one process would (exit 2) and the other one line naming it (exit 1), no traceback from either; the
    checkpoint of step 2 is left, as one process leaves it."""
    import os
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(FAILING_PROCESS_DRIVER)
    args = ["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"), "--num-heads", "2",
            "--seq-len", "32", "--batch-size", "4", "--max-steps", "6", "--save-every", "2", "--no-eval-tau",
            "--no-progress", "--held-out-fraction", "0.2"]
    proc = subprocess.run(_launch_two(str(driver)) + [json.dumps(args), str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode != 0
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)] == [1, 2], proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("specdec train-medusa:")]
    assert sorted(lines) == ["specdec train-medusa: error: a bad batch",
                             "specdec train-medusa: stopped: process 1 failed (its error is above)"], proc.stderr

    # the launcher's own report of the exit codes aside, no process printed a traceback
    assert "Connection closed" not in proc.stderr and not any(
        x.startswith("[rank") and "Traceback" in x for x in proc.stderr.splitlines()), proc.stderr[-3000:]
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(tmp_path / "run"))["step"] == 2


def test_sigterm_ends_the_process_at_once_while_the_process_group_forms(tiny, tmp_path, monkeypatch):
    """Forming the process group (accelerate's Accelerator) waits in C++ for every process, where the Ctrl-C path's
    handler cannot run: SIGTERM keeps its default action there, and the handler is back after."""
    import accelerate

    seen = []

    class Formed(Exception):
        pass

    def forming(*args, **kwargs):
        seen.append(signal.getsignal(signal.SIGTERM))
        raise Formed

    monkeypatch.setattr(accelerate, "Accelerator", forming)
    with sigterm_as_interrupt():
        handler = signal.getsignal(signal.SIGTERM)
        with pytest.raises(Formed):
            run_training(_cfg(tiny, tmp_path / "out"))
        assert signal.getsignal(signal.SIGTERM) is handler
    assert seen == [signal.SIG_DFL]


# run by `accelerate launch` in each of two processes: rank 0 exits once rank 1 waits for it in the process group's
# forming (the launcher then sends rank 1 SIGTERM)
UNJOINED_PROCESS_DRIVER = """
import json, os, pathlib, sys, time
import torch.distributed
from specdec.cli import main

rank, args, out = int(os.environ["RANK"]), json.loads(sys.argv[1]), pathlib.Path(sys.argv[2])
if rank == 0:
    while not (out / "forming").exists():
        time.sleep(0.05)
    time.sleep(0.5)
    os._exit(3)
real_init = torch.distributed.init_process_group

def init(*a, **kw):
    (out / "forming").touch()
    return real_init(*a, **kw)

torch.distributed.init_process_group = init
sys.exit(main(args + ["--output-dir", str(out / "run")]))
"""


@pytest.mark.slow
def test_a_process_waiting_for_a_peer_that_never_joins_ends_at_the_launchers_sigterm(tiny, tmp_path):
    """Two real processes: the first exits before it joins the process group, the other waits for it there. The
    launcher's SIGTERM to the other was held until the wait ended, which it never does: after the launcher's
    shutdown timeout (30 s) it SIGKILLed the process. Now SIGTERM ends it at once."""
    import os
    import subprocess

    driver = tmp_path / "driver.py"
    driver.write_text(UNJOINED_PROCESS_DRIVER)
    args = ["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"), "--num-heads", "2",
            "--seq-len", "32", "--batch-size", "4", "--max-steps", "2", "--no-eval-tau", "--no-progress"]
    proc = subprocess.run(_launch_two(str(driver)) + [json.dumps(args), str(tmp_path)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode != 0 and (tmp_path / "forming").exists(), proc.stderr[-3000:]
    assert "Unable to shutdown" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"rank\s*: 1 .*\n\s*exitcode\s*: -15", proc.stderr), proc.stderr[-3000:]


class _Store(dict):
    """A process group's key-value store: what FailureNotes reads and writes."""

    def set(self, key, value):
        self[key] = value

    def check(self, keys):
        return all(k in self for k in keys)


def test_a_process_tells_its_own_error_from_another_ones(monkeypatch):
    """What each process makes of the error that stops it: its own leaves a note naming it; a collective that failed
    while another process's note is there, or on a lost connection (then after a bounded wait for a note), and a
    signal after another process failed (the launcher's SIGTERM), become PeerFailed naming that process. A stopping
    process ignores SIGTERM (the launcher's must not cut its line)."""
    from specdec.train import process_failures

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(process_failures, "NOTE_WAIT_S", 0.05)
    try:
        store = _Store()
        one, zero = FailureNotes(store, 1, 2, 7), FailureNotes(store, 0, 2, 7)
        assert zero.interrupted() is None  # no note: a signal is a signal
        zero.stop(RuntimeError("CUDA out of memory"))  # no note of another process's, no lost connection: its own
        assert store == {"specdec/run7/failed/0": "failed RuntimeError: CUDA out of memory"}
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        store.clear()
        lost = (r"another process stopped without a word "
                r"\(\[pair.cc:553\] Connection closed by peer \[127.0.0.1\]:4242\)$")
        with pytest.raises(PeerFailed, match=lost):
            zero.stop(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4242\nmore"))
        one.stop(ValueError("a bad batch"))
        assert store == {"specdec/run7/failed/1": "refused ValueError: a bad batch"}
        for stop in (lambda: zero.stop(RuntimeError("[pair.cc:553] Connection closed by peer")),
                     lambda: zero.stop(RuntimeError("any message a collective gives")), zero.interrupted):
            with pytest.raises(PeerFailed, match=r"^process 1 failed \(its error is above\)$") as stopped:
                stop()
            assert stopped.value.process == 1
        assert FailureNotes(store, 0, 2, 8).failed() is None  # another run's notes are its own
        zero.stop(ValueError("this process's own error, the other's note there or not"))
        assert "specdec/run7/failed/0" in store
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_line_of_an_interrupt_or_error_is_one_write(tmp_path, monkeypatch):
    """The processes of a run stop together and each writes its line to the same stderr; print() wrote the text and
    its newline in two writes where Python runs unbuffered (PYTHONUNBUFFERED, as under pytest-xdist), and two
    processes' lines came out as one ("...starts againspecdec train-medusa: ..."). Each line is now one write."""
    import sys

    from specdec.train import cli, pipeline
    from specdec.train.data import TrainDataError

    class Stderr:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)

        def flush(self):
            pass

    stderr = Stderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.setattr(cli, "config_from_args", lambda args: None)
    args = SimpleNamespace(drafter="medusa", output_dir=str(tmp_path), verbose=False)
    from specdec.train.process_failures import PeerFailed

    from specdec.sigterm import Terminated

    for stop, code in ((KeyboardInterrupt(), 130), (Terminated(), 143), (TrainDataError("no data"), 2),
                       (PeerFailed(1), 1)):
        def run_training(cfg, stop=stop):
            raise stop

        monkeypatch.setattr(pipeline, "run_training", run_training)
        assert cli.run(args) == code
    assert [w.count("\n") for w in stderr.writes] == [1, 1, 1, 1] and all(w.endswith("\n") for w in stderr.writes)
    assert stderr.writes[2] == "specdec train-medusa: error: no data\n"
    assert stderr.writes[3] == "specdec train-medusa: stopped: process 1 failed (its error is above)\n"


def test_sigterm_takes_the_path_of_ctrl_c(tiny, tmp_path, monkeypatch, capsys):
    """SIGTERM (schedulers, `timeout`) ended training unannounced; it now stops it as Ctrl-C does: one line naming
    the checkpoint a --resume continues from, exit 143, and the caller's own SIGTERM handler back afterwards."""
    import os
    import signal

    from specdec.cli import main

    class CallersHandler(Exception):
        pass

    def callers_handler(signum, frame):
        raise CallersHandler  # what the old code let through (instead of the process dying)

    real_rows = loop.batch_rows

    def terminated_at_step_5(num, micro, bs, seed):
        if micro == 4:  # step 5 starts after the step-4 checkpoint
            os.kill(os.getpid(), signal.SIGTERM)
        return real_rows(num, micro, bs, seed)

    monkeypatch.setattr(loop, "batch_rows", terminated_at_step_5)
    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        rc = main(["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
                   "--output-dir", str(tmp_path / "run"), "--num-heads", "2", "--seq-len", "32", "--batch-size",
                   "4", "--max-steps", "6", "--save-every", "2", "--no-eval-tau", "--no-progress"])
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 143 and err[-1] == ("specdec train-medusa: terminated (SIGTERM); the checkpoint of step 4 is intact "
                                     "(continue with --resume)")


def test_an_interrupt_during_self_distillation_names_the_answers_kept(tiny, tmp_path, monkeypatch, capsys):
    """Ctrl-C during self-distillation said "it saved no checkpoint yet, so a rerun starts again", though its
    finished batches of answers are kept and a rerun generates only the rest; the line now says so (and names the
    checkpoint as before where one is left)."""
    import importlib

    from specdec.cli import main

    generate_module = importlib.import_module("specdec.generate")
    real, calls = generate_module.generate, []

    def interrupted_at_the_third_batch(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(generate_module, "generate", interrupted_at_the_third_batch)
    args = ["train-medusa", "--model", str(tiny / "model"), "--output-dir", str(tmp_path / "run"), "--num-heads",
            "2", "--seq-len", "96", "--batch-size", "4", "--max-steps", "2", "--num-prompts", "8",
            "--distill-max-new-tokens", "4", "--distill-batch-size", "2", "--no-eval-tau", "--no-progress"]
    assert main(args) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "specdec train-medusa: interrupted; self-distillation kept its answers to 4 of 8 prompts, so a rerun "
        "generates only the rest")
    from specdec.train.cli import _what_is_left

    err = KeyboardInterrupt()  # a resumed run distilling again (its cache deleted) leaves its checkpoint
    err.distilled = (4, 8, 1)
    ckpt_io.save_checkpoint(tmp_path / "run", *_tiny_training_state(), 4, {}, "fp")
    assert _what_is_left(tmp_path / "run", err) == ("self-distillation kept its answers to 4 of 8 prompts, so a rerun "
                                                    "generates only the rest; the checkpoint of step 4 is intact "
                                                    "(continue with --resume)")
    # several processes share the distillation: each knows the others' batches up to their last exchange
    for known, said in ((4, " (at least 4 of 8 prompts)"), (0, "")):
        err.distilled = (known, 8, 2)
        assert _what_is_left(tmp_path / "run", err).startswith(
            f"self-distillation kept the answers its processes finished{said}, so a rerun generates only the rest; ")


@pytest.mark.parametrize("verbose", [False, True])
def test_training_logs_info_to_the_console_with_v_only(tiny, tmp_path, verbose):
    """train-medusa printed its INFO lines without -v (the pipeline lowers the specdec logger to INFO for
    train.log, and the console's handler had no level of its own); now with -v only, as every other command."""
    import io
    import logging

    from specdec.cli import main

    root, console = logging.getLogger(), logging.StreamHandler(io.StringIO())  # what specdec.cli's basicConfig adds
    level = root.level
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    root.addHandler(console)
    try:
        assert main(["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
                     "--output-dir", str(tmp_path / "run"), "--num-heads", "2", "--seq-len", "32", "--batch-size",
                     "4", "--max-steps", "2", "--no-eval-tau", "--no-progress", *(["-v"] if verbose else [])]) == 0
    finally:
        root.removeHandler(console)
        root.setLevel(level)
    assert ("step 2/2" in console.stream.getvalue()) == verbose and console.level == logging.NOTSET
    assert "step 2/2" in (tmp_path / "run" / "train.log").read_text()


def test_no_progress_bar_is_drawn_off_a_terminal(tiny, tmp_path, capsys):
    """Into a pipe or a log file (nohup, a scheduler) the training bars wrote their carriage-return redraws and
    cursor moves; only --no-progress stopped them. Off a terminal they are off, as the other commands' are."""
    from specdec.cli import main

    capsys.readouterr()
    assert main(["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"), "--output-dir",
                 str(tmp_path / "run"), "--num-heads", "2", "--seq-len", "32", "--batch-size", "4", "--max-steps",
                 "3", "--no-eval-tau"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b[" not in err, err


def test_checkpoint_swap_survives_a_kill_between_renames(tmp_path):
    (tmp_path / "checkpoint.tmp").mkdir()  # half-written: ignored
    assert ckpt_io.find_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint.old").mkdir()
    (tmp_path / "checkpoint.old" / "state.json").write_text('{"step": 3}')
    assert ckpt_io.find_checkpoint(tmp_path) == tmp_path / "checkpoint.old"


def test_seq_len_beyond_context_is_refused(tiny, tmp_path):
    with pytest.raises(ValueError, match="context"):
        run_training(_cfg(tiny, tmp_path / "s", seq_len=100_000, eval_tau=False))


@pytest.mark.parametrize("drafter", ["medusa", "eagle"])
def test_draft_vocab_beyond_the_vocabulary_is_refused_not_cut_to_the_training_tokens(tiny, tmp_path, drafter):
    """A head over --draft-vocab N > the vocabulary would hold only the tokens the data holds, not the whole
    vocabulary the user may think N means: refused before the output directory exists, naming 'full'."""
    vocab = json.loads((tiny / "model" / "config.json").read_text())["vocab_size"]
    with pytest.raises(InputError, match=rf"^--draft-vocab 100000 exceeds the model's vocabulary of {vocab} tokens; "
                                         rf"pass --draft-vocab {vocab} or less, or --draft-vocab full for its whole "
                                         r"LM head$"):
        run_training(_cfg(tiny, tmp_path / "v", drafter=drafter, draft_vocab=100_000, eval_tau=False))
    assert not (tmp_path / "v").exists()


def test_choose_tree_budget_prefixes_and_order():
    rank_acc = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]
    paths, est = choose_tree(rank_acc, budget=6)
    assert len(paths) == 6 and all(p[:-1] in paths for p in paths if len(p) > 1)
    # path probabilities: (0,) .6, (0,0) .24, (1,) .2, (0,1) .12, (2,) .1, (1,0) .08, then (0,0,0) .072
    assert paths == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
    expected = 1 + 0.6 + 0.24 + 0.2 + 0.12 + 0.1 + 0.08
    assert est == pytest.approx(expected)
    with pytest.raises(ValueError):
        choose_tree(rank_acc, budget=0)


def test_choose_tree_leaves_out_a_rank_never_right_even_with_budget_to_spare():
    """A rank whose accuracy is 0 adds nothing to tau but a verified node: with a budget of 4 and two paths worth
    anything ((0,) .6 and (0, 0) .3), the tree is those two, not padded with (1,) or (0, 1) at 0."""
    paths, est = choose_tree([[0.6, 0.0], [0.5, 0.0]], budget=4)
    assert paths == [(0,), (0, 0)] and est == pytest.approx(1 + 0.6 + 0.3)


def _tiny_training_state():
    heads = MedusaHeads(MedusaConfig(2, 1, 16, 32))
    optimizer = torch.optim.AdamW(heads.parameters(), lr=1e-3)
    heads(torch.randn(3, 16))[0].sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return heads, optimizer, scheduler


@pytest.mark.parametrize("crash", ["writing a file", "between the renames"])
def test_a_crash_during_a_checkpoint_save_leaves_the_previous_one_usable(tmp_path, monkeypatch, crash):
    """(issue 24 #6) The new checkpoint is written beside the old one and swapped in by renames."""
    import os

    heads, optimizer, scheduler = _tiny_training_state()
    ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 4, {}, "fp")
    if crash == "writing a file":
        def dying_save(obj, path, *a, **k):
            raise OSError("disk full")

        monkeypatch.setattr(ckpt_io.torch, "save", dying_save)
    else:
        real_replace, calls = os.replace, []

        def dying_replace(src, dst):
            calls.append(src)
            if len(calls) == 2:  # the old checkpoint moved aside, the new one not yet in place
                raise OSError("killed")
            real_replace(src, dst)

        monkeypatch.setattr(ckpt_io.os, "replace", dying_replace)
    with pytest.raises(OSError):
        ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 6, {}, "fp")
    monkeypatch.undo()
    ckpt = ckpt_io.find_checkpoint(tmp_path)
    ckpt_io.check_readable(ckpt)
    fresh = _tiny_training_state()
    assert ckpt_io.load_checkpoint(ckpt, *fresh) == 4
    got, want = fresh[0].state_dict(), heads.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    if crash == "between the renames":  # the resumed run's next save dies before its new one is in place: the
        # only complete checkpoint (checkpoint.old) used to be deleted first, leaving nothing to resume from
        def dying(src, dst):
            raise OSError("killed")

        monkeypatch.setattr(ckpt_io.os, "replace", dying)
        with pytest.raises(OSError):
            ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 8, {}, "fp")
        monkeypatch.undo()
        assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), *_tiny_training_state()) == 4
        ckpt_io.save_checkpoint(tmp_path, heads, optimizer, scheduler, 8, {}, "fp")  # and a save then succeeds
        assert ckpt_io.find_checkpoint(tmp_path) == tmp_path / ckpt_io.CKPT and not (tmp_path / ckpt_io.OLD).exists()
        assert ckpt_io.load_checkpoint(ckpt_io.find_checkpoint(tmp_path), *_tiny_training_state()) == 8


@pytest.mark.parametrize("name", ["heads.safetensors", "optimizer.pt", "state.json"])
def test_a_truncated_checkpoint_file_is_named_not_a_traceback(tiny, tmp_path, name):
    out = tmp_path / "run"
    run_training(_cfg(tiny, out, eval_tau=False, max_steps=2, save_every=2))
    damaged = out / ckpt_io.CKPT / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with pytest.raises(ckpt_io.CheckpointError, match=name.replace(".", r"\.")):
        run_training(_cfg(tiny, out, eval_tau=False, max_steps=4, save_every=2, resume=True))


def test_distillation_through_cuda_graphs_needs_the_triton_backend(tiny, tmp_path, monkeypatch):
    """--distill-cuda-graphs on with the reference backend: one line naming the backend, before any decoding."""
    from specdec.errors import InputError

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPECDEC_ATTENTION", "reference")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sings\nthe dog likes fish\n")
    with pytest.raises(InputError, match="Triton backend"):
        run_training(_cfg(tiny, tmp_path / "g", data=None, prompts_file=str(prompts), distill_cuda_graphs="on",
                          eval_tau=False))
    assert not list((tmp_path / "cache").glob("distill/*.json")) and not (tmp_path / "g").exists()  # untouched
    with pytest.raises(ValueError, match="distill_cuda_graphs"):
        _cfg(tiny, tmp_path / "h", distill_cuda_graphs="yes")


def _fake_run(path, eagle=False):
    """The files a finished run leaves (the checkpoint directory included), without training."""
    (path / "checkpoint").mkdir(parents=True)
    for name in ("run.json", "train.log", "history.jsonl", "report.json", "report.md", "config.json",
                 "model.safetensors" if eagle else "medusa_lm_head.safetensors"):
        (path / name).write_text("{}")
    for name in ("state.json", "heads.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt"):
        (path / "checkpoint" / name).write_text("{}")
    return path


@pytest.mark.parametrize("mine", ["checkpoint/notes.txt", "checkpoint/deep/er/data.bin", "data/corpus.jsonl",
                                  "checkpoint.old/state.json/oops.txt"])
def test_overwrite_refuses_user_files_at_any_depth(tmp_path, mine):
    """Only the top-level names were checked: a user's file inside <out>/checkpoint/ was deleted."""
    run = _fake_run(tmp_path / "run")
    (run / mine).parent.mkdir(parents=True, exist_ok=True)
    (run / mine).write_text("the user's")
    cfg = SimpleNamespace(output_dir=str(run), resume=False, overwrite=True)
    with pytest.raises(OutputDirError, match=f"does not write .*{mine.split('/')[0]}"):
        output_dir.prepare_output_dir(cfg)
    assert (run / mine).read_text() == "the user's"
    for eagle in (False, True):  # what a Medusa or an EAGLE run writes is deleted
        run = _fake_run(tmp_path / f"clean-{eagle}", eagle)
        assert output_dir.prepare_output_dir(SimpleNamespace(output_dir=str(run), resume=False, overwrite=True)) is None
        assert list(run.iterdir()) == []  # emptied (the run holds its lock on the folder itself)


@pytest.mark.skipif(sys.platform == "win32" or os.geteuid() == 0, reason="POSIX modes, which root is not refused by")
def test_overwrite_of_a_run_this_user_cannot_delete_leaves_it_whole(tmp_path):
    """Another user's run in a shared folder: --overwrite deleted the files this user could delete (the heads, the
    report), then stopped at the checkpoint's with "[Errno 13] Permission denied: 'state.json'". It is refused
    first, in one line naming the folder, and nothing is deleted."""
    run = _fake_run(tmp_path / "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    os.chmod(run / "checkpoint", 0o555)
    try:
        with pytest.raises(OutputDirError, match=f"cannot delete {run}: this user may not delete what "
                                                 f"{run / 'checkpoint'} holds"):
            output_dir.prepare_output_dir(SimpleNamespace(output_dir=str(run), resume=False, overwrite=True))
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    finally:
        os.chmod(run / "checkpoint", 0o755)


@pytest.mark.parametrize("theirs", ["checkpoint", "checkpoint.old", "train.log"])
def test_resume_of_a_run_this_user_cannot_write_is_refused_before_the_model_loads(tiny, tmp_path, monkeypatch, theirs):
    """Another user's run in a group-writable folder: --resume trained, then stopped at its first save with a bare
    "[Errno 39] Directory not empty" (their checkpoint left renamed to checkpoint.old), or at train.log with
    "[Errno 13] Permission denied". It is refused in one line naming what this user cannot write, before the model
    loads, and nothing in the folder changes."""
    import specdec.models.loader

    run = _fake_run(tmp_path / "run")
    (run / "checkpoint.old").mkdir()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs: (
        False if mode & os.W_OK and os.path.realpath(path) == os.path.realpath(run / theirs)
        else access(path, mode, *args, **kwargs)))
    monkeypatch.setattr(specdec.models.loader, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(OutputDirError, match=f"--resume: this user cannot write {re.escape(str(run / theirs))} "
                                             r"\(another user's run\?\).*cp -r"):
        run_training(_cfg(tiny, run, resume=True))
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


@pytest.mark.skipif(sys.platform == "win32", reason="the sticky bit is POSIX's")
def test_another_users_run_in_a_sticky_folder_is_refused_before_anything_changes(tiny, tmp_path, monkeypatch,
                                                                                   another_users_sticky):
    """An --output-dir with the sticky bit (as /tmp), writable by all, holding another user's run: its write
    permission passed the checks, then --overwrite stopped at the first file it deleted ("[Errno 1] Operation not
    permitted"), and --resume at its first save (the checkpoint renamed) or its report. Both are refused before
    anything changes; the same folder of this user's own run is emptied as before."""
    import specdec.models.loader

    run = _fake_run(tmp_path / "run")
    owner = another_users_sticky(run)  # this user owns neither the folder nor its files
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    monkeypatch.setattr(specdec.models.loader, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    overwrite = SimpleNamespace(output_dir=str(run), resume=False, overwrite=True)
    with pytest.raises(OutputDirError, match=f"cannot delete {run}: this user may not delete what {run} holds"):
        output_dir.prepare_output_dir(overwrite)
    with pytest.raises(OutputDirError, match=f"--resume: {run} has the sticky bit .*cp -r"):
        run_training(_cfg(tiny, run, resume=True))
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    monkeypatch.setattr(os, "geteuid", lambda: owner)
    (run / "notes.txt").write_text("another user's file beside this user's run")
    os.chown(run / "notes.txt", owner + 1, -1)
    output_dir.check_resume_writable(run)  # a file the run never replaces: resumed as before
    (run / "notes.txt").unlink()
    assert output_dir.prepare_output_dir(overwrite) is None and list(run.iterdir()) == []


def test_measured_tau_verifies_every_tree_whole(monkeypatch):
    """tau measures the heads: every proposal verified (speculation="always"). Under the default guard, on a CPU
    where the quick recipe's heads do not pay, the report's tau was the guard leaving them out (1.06, not ~1.6)."""
    import importlib

    from specdec.train import evaluate

    asked = []

    def fake_generate(loaded, ids, **kwargs):
        asked.append(kwargs)
        return SimpleNamespace(stats=[SimpleNamespace(new_tokens=6, steps=3) for _ in ids])

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", fake_generate)
    monkeypatch.setattr(evaluate, "DYNAMIC_TOP_K", 2)
    loaded = SimpleNamespace(tokenizer=lambda text, add_special_tokens: {"input_ids": [1, 2, 3]})
    heads = MedusaHeads(MedusaConfig(2, 1, 8, 16))
    tau = evaluate.measure_tau(loaded, heads, [[0], [0, 0]], ["a", "b"], max_new_tokens=6, tree="dynamic")
    assert tau["tau"] == 2.0 and asked and all(k.get("speculation") == "always" for k in asked)


def test_a_run_that_ended_before_its_first_checkpoint_does_not_block_its_rerun(tiny, tmp_path):
    """A run failing on its data (after its run.json and log were written) left a directory the corrected rerun
    refused as "another run"; there is nothing to resume or lose in it (a --resume there says so). One with a
    checkpoint is still refused, and Ctrl-C says which of the two it left."""
    from specdec.train.cli import _what_is_left

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text("{}")
    (out / "train.log").write_text("ERROR the data had no text field")
    assert "saved no checkpoint yet" in _what_is_left(out)
    # a --resume after a kill there (no Ctrl-C line said what was left) says how to go on
    with pytest.raises(OutputDirError, match=r"stopped before its first one \(see --save-every\); rerun without "
                                             r"--resume to start it again$"):
        output_dir.prepare_output_dir(_cfg(tiny, out, resume=True))
    assert output_dir.prepare_output_dir(_cfg(tiny, out)) is None and list(out.iterdir()) == []  # emptied
    (out / "run.json").write_text("{}")
    heads, optimizer, scheduler = _tiny_training_state()
    ckpt_io.save_checkpoint(out, heads, optimizer, scheduler, 4, {}, "fp")
    with pytest.raises(OutputDirError, match="is not empty"):
        output_dir.prepare_output_dir(_cfg(tiny, out))
    assert _what_is_left(out) == "the checkpoint of step 4 is intact (continue with --resume)"
    (out / "notes.txt").write_text("the user's")
    (out / ckpt_io.CKPT).rename(tmp_path / "elsewhere")
    with pytest.raises(OutputDirError, match="is not empty"):  # a file the run did not write: never replaced unasked
        output_dir.prepare_output_dir(_cfg(tiny, out))


@pytest.mark.skipif(sys.platform == "win32", reason="no flock: nothing is held")
def test_a_run_still_going_is_never_taken_for_one_that_ended(tiny, tmp_path):
    """A second run given the folder of a run still before its first checkpoint took it for one that had ended and
    deleted it under the running one (both then wrote there, and both exited 0). The running one holds the folder:
    the second is refused in one line, and the first one's files stay."""
    from specdec.train.pipeline import run_training

    from specdec.folder_lock import FolderInUse, only_writer

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text('{"the running one": 1}')
    with only_writer(out, "--output-dir"):  # the running one's hold
        with pytest.raises(FolderInUse, match=f"--output-dir {out}: another run is writing there now"):
            run_training(_cfg(tiny, out))
    assert [p.name for p in out.iterdir()] == ["run.json"] and "running one" in (out / "run.json").read_text()
    with only_writer(out, "--output-dir"):  # the refused run holds nothing after it
        pass


def test_a_resume_names_input_files_that_changed_since_the_checkpoint(tiny, tmp_path, caplog):
    """The same --data path with other contents resumed silently (the fingerprint holds the path only); each
    checkpoint records its inputs' sizes and times, and a resume names those that changed."""
    data = tmp_path / "data.jsonl"
    shutil.copyfile(tiny / "data.jsonl", data)
    out = tmp_path / "run"
    run_training(_cfg(tiny, out, data=str(data), eval_tau=False, max_steps=2, save_every=2))
    cfg = _cfg(tiny, out, data=str(data), eval_tau=False, max_steps=2, save_every=2, resume=True)
    with caplog.at_level("WARNING", logger="specdec.train.output_dir"):
        output_dir.prepare_output_dir(cfg)
    assert "changed since the checkpoint" not in caplog.text
    with open(data, "a") as f:
        f.write(json.dumps({"text": "one more record"}) + "\n")
    with caplog.at_level("WARNING", logger="specdec.train.output_dir"):
        assert output_dir.prepare_output_dir(cfg) is not None  # resumed, with a warning naming the file
    assert f"--resume: {data} changed since the checkpoint was saved" in caplog.text
    # the resumed run's train.log holds it too (it was logged before the log file was opened: stderr only)
    run_training(cfg)
    assert (out / "train.log").read_text().count(f"WARNING specdec.train.output_dir: --resume: {data} changed") == 1


def test_a_resume_by_another_number_of_processes_says_it_is_not_bit_exact(tiny, tmp_path, caplog):
    """A checkpoint of a two-process run resumed by one process was taken silently, though its sums are taken in
    another order (the weights then differ from an uninterrupted run's in the last bits): each checkpoint records
    its processes, and a resume by another number says so; the same number, or a checkpoint that recorded none,
    says nothing."""
    out = tmp_path / "run"
    run_training(_cfg(tiny, out, eval_tau=False, max_steps=4, save_every=2))
    state_file = out / ckpt_io.CKPT / "state.json"
    state = json.loads(state_file.read_text())
    assert state["config"]["processes"] == 1
    cfg = _cfg(tiny, out, eval_tau=False, max_steps=4, save_every=2, resume=True)
    for processes, warned in ((1, False), (None, False), (2, True)):
        state["config"]["processes"] = processes
        state_file.write_text(json.dumps(state))
        caplog.clear()
        with caplog.at_level("WARNING", logger="specdec.train.loop"):
            run_training(cfg)
        said = "was saved by a run of 2 process(es), this one has 1" in caplog.text
        assert said == warned and ("not bit for bit" in caplog.text) == warned, (processes, caplog.text)
        state = json.loads(state_file.read_text())


def test_the_warnings_kept_for_train_log_still_reach_stderr_without_handlers(monkeypatch):
    """Without logging configured, a warning reaches stderr through Python's last resort; the handler that keeps the
    run's first warnings for train.log must not take that away (any handler found stops the last resort)."""
    import io
    import logging

    from specdec.train.pipeline import _warnings_kept

    stream = io.StringIO()
    monkeypatch.setattr(logging, "lastResort", logging.StreamHandler(stream))
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    with _warnings_kept() as kept:
        logging.getLogger("specdec.train.output_dir").warning("an input changed")
        logging.getLogger("specdec.train.output_dir").info("not kept")
    assert [r.getMessage() for r in kept] == ["an input changed"] and stream.getvalue() == "an input changed\n"
    handler = logging.StreamHandler(io.StringIO())
    root.addHandler(handler)  # a caller's handler: it takes the record, the last resort does not
    with _warnings_kept():
        logging.getLogger("specdec.train.output_dir").warning("once more")
    assert stream.getvalue() == "an input changed\n" and handler.stream.getvalue() == "once more\n"


def test_a_history_line_cut_short_by_a_kill_does_not_block_resume(tmp_path):
    """A kill mid-append left a torn last line in history.jsonl, and every --resume then failed on it (the
    checkpoint was whole); it is dropped now. A bad line elsewhere is an error naming the file and the line."""
    from specdec.train.output_dir import read_history

    path = tmp_path / "history.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n{"step": 3, "lo')
    assert [h["step"] for h in read_history(path)] == [1, 2]
    path.write_text('{"step": 1, "loss": 2.5}\n{"st\n{"step": 3, "loss": 2.3}\n')
    with pytest.raises(OutputDirError, match="line 2 is not JSON"):
        read_history(path)


def _copied_run(tiny, tmp_path, monkeypatch):
    shutil.copytree(tiny / "model", tmp_path / "model")
    shutil.copyfile(tiny / "data.jsonl", tmp_path / "data.jsonl")
    monkeypatch.chdir(tmp_path)
    run_training(_cfg(tiny, tmp_path / "run", model="model", data="data.jsonl", eval_tau=False, max_steps=2,
                      save_every=2))


def test_resume_compares_paths_resolved(tiny, tmp_path, monkeypatch):
    """--resume refused `./model` after `model` (another spelling of one directory) as "a different
    configuration"; another directory is still refused, also under the same spelling from elsewhere."""
    _copied_run(tiny, tmp_path, monkeypatch)
    again = dict(eval_tau=False, max_steps=2, save_every=2, resume=True)
    assert run_training(_cfg(tiny, tmp_path / "run", model="./model", data=str(tmp_path / "data.jsonl"),
                             **again))["steps"] == 2  # resumed at its last step: nothing left to train
    was = f"model: checkpoint '{tmp_path / 'model'}' vs now '{tiny / 'model'}'"
    with pytest.raises(OutputDirError, match=f"different configuration.*{was}"):
        run_training(_cfg(tiny, tmp_path / "run", model=str(tiny / "model"), data="data.jsonl", **again))
    monkeypatch.chdir(tiny)  # the same spelling in another working directory: another directory
    with pytest.raises(OutputDirError, match=f"different configuration.*{was}"):
        run_training(_cfg(tiny, tmp_path / "run", model="model", data="data.jsonl", **again))


def test_resume_refuses_a_target_retrained_into_the_same_directory(tiny, tmp_path, monkeypatch):
    """The checkpoint recorded the target's path only, so a model retrained into the same directory resumed
    silently; its content identity (config and sampled weights) is recorded and compared now."""
    from transformers import AutoModelForCausalLM

    _copied_run(tiny, tmp_path, monkeypatch)
    retrained = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        retrained.model.layers[0].mlp.up_proj.weight.add_(0.01)  # a middle weight, the config unchanged
    retrained.save_pretrained(tmp_path / "model")
    with pytest.raises(OutputDirError, match=r"--resume: the target model model is not the one the checkpoint"):
        run_training(_cfg(tiny, tmp_path / "run", model="model", data="data.jsonl", eval_tau=False, max_steps=2,
                          save_every=2, resume=True))


def test_accumulated_micro_batches_take_each_sequence_once_an_epoch_and_reshuffle_each_epoch():
    """8 sequences, batch 2, --grad-accum 2: an epoch is 8 / 2 = 4 micro-batches = 2 optimizer steps. Steps 0-1 take
    every sequence exactly once, steps 2-3 (the second epoch) take each once again, in another order."""
    seqs = [[r + 1, 90, 91] for r in range(8)]  # a row's first token is its index + 1
    run = SimpleNamespace(cfg=SimpleNamespace(grad_accum=2, batch_size=2, seed=0), train_seqs=seqs,
                          accelerator=SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu")),
                          features=SimpleNamespace(batch=lambda rows: (None, None, None)))

    def rows(step):
        return [int(t) - 1 for ids, *_ in loop._micro_batches(run, step) for t in ids[:, 0]]

    first, second = rows(0) + rows(1), rows(2) + rows(3)
    assert sorted(first) == list(range(8)) and sorted(second) == list(range(8))
    assert first != second


def test_an_epoch_of_accumulated_steps_runs_its_steps_and_checkpoints_the_last(tiny, tmp_path):
    """16 sequences, batch 4, --grad-accum 2, one epoch: 16 / 4 = 4 micro-batches = 2 optimizer steps; the last
    step is checkpointed although --save-every 5 never falls due."""
    cfg = _cfg(tiny, tmp_path, max_steps=None, epochs=1, grad_accum=2, save_every=5)
    history = medusa_recipe.train_heads(cfg, *_model_and_seqs(tiny), _accelerator(), None)[1]
    assert [h["step"] for h in history] == [1, 2]
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(tmp_path))["step"] == 2


def test_a_kill_after_the_new_checkpoint_is_in_place_resumes_from_the_new_one(tmp_path):
    """A kill between the second rename and the removal of checkpoint.old leaves both complete: the new one
    (checkpoint, step 4) is the one to resume, not the one it replaced (step 2)."""
    for name, step in ((ckpt_io.OLD, 2), (ckpt_io.CKPT, 4)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "state.json").write_text(json.dumps({"step": step}))
    assert ckpt_io.find_checkpoint(tmp_path) == tmp_path / ckpt_io.CKPT
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(tmp_path))["step"] == 4


def test_a_resume_removes_what_a_save_killed_after_its_renames_left(tiny, tmp_path):
    """A run killed during its last save, after the new checkpoint was renamed in and before checkpoint.old was
    removed, resumed at its last step and saved no more: the earlier checkpoint (optimizer state and all) stayed for
    good. The resume removes it, and a checkpoint.tmp a kill left half-written."""
    out = tmp_path / "run"
    cfg = _cfg(tiny, out, max_steps=2, save_every=2, eval_tau=False)
    run_training(cfg)
    shutil.copytree(out / ckpt_io.CKPT, out / ckpt_io.OLD)
    (out / ckpt_io.TMP).mkdir()
    (out / ckpt_io.TMP / "heads.safetensors").write_bytes(b"half")
    assert output_dir.prepare_output_dir(_cfg(tiny, out, max_steps=2, save_every=2, eval_tau=False, resume=True)) \
        == out / ckpt_io.CKPT
    assert not (out / ckpt_io.OLD).exists() and not (out / ckpt_io.TMP).exists()


@pytest.mark.parametrize("state", ['{"fingerprint": "fp", "config": {}}', '{"step": null}', '{"step": "four"}'])
def test_a_state_file_without_a_step_is_a_checkpoint_error(tmp_path, state):
    (tmp_path / "state.json").write_text(state)
    with pytest.raises(ckpt_io.CheckpointError, match=r"state\.json"):
        ckpt_io.read_state(tmp_path)


def _hand_checkpoint(out, config: dict, step: int = 2):
    """A complete checkpoint of a 2x2 linear layer (every file opens), recording ``config``."""
    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return ckpt_io.save_checkpoint(out, layer, opt, sched, step, config, "fp")


def test_a_folder_holding_every_file_of_a_run_that_never_checkpointed_is_replaced(tmp_path):
    """run.json, train.log and history.jsonl together are still a run stopped before its first checkpoint: nothing to
    resume, nothing lost, so a fresh run empties the folder rather than asking for --overwrite."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("run.json", "train.log", "history.jsonl"):
        (out / name).write_text("{}")
    assert output_dir.prepare_output_dir(TrainConfig(model="m", output_dir=str(out))) is None
    assert list(out.iterdir()) == []


def test_a_run_killed_while_writing_run_json_is_replaced_by_the_rerun(tmp_path):
    """run.json is written atomically: a kill during its write leaves its temporary file and no run.json. The rerun
    refused that folder ("is not empty"), and --overwrite too ("holds no run.json"): the user had to empty it by
    hand. It is a run stopped before its first checkpoint, replaced as one; --overwrite takes it too."""
    out = tmp_path / "run"
    for overwrite in (False, True):
        out.mkdir()
        (out / "run.json.123.456.tmp").write_text('{"con')
        (out / "train.log").write_text("")
        assert output_dir.prepare_output_dir(TrainConfig(model="m", output_dir=str(out), overwrite=overwrite)) is None
        assert list(out.iterdir()) == []
        out.rmdir()


def test_overwrite_stopped_while_emptying_the_folder_leaves_one_the_next_overwrite_takes(tmp_path, monkeypatch):
    """Ctrl-C while --overwrite emptied a run's folder, just after run.json went, left the rest, which the next
    --overwrite refused as "not a specdec training run" (no run.json): run.json is deleted last."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("config.json", "report.json", "run.json", "train.log"):
        (out / name).write_text("{}")
    _hand_checkpoint(out, {}, step=2)
    unlink = Path.unlink

    def interrupted_after_run_json(self, *args, **kwargs):
        unlink(self, *args, **kwargs)
        if self.name == "run.json":
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "unlink", interrupted_after_run_json)
    cfg = TrainConfig(model="m", output_dir=str(out), overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        output_dir.prepare_output_dir(cfg)
    monkeypatch.undo()
    assert output_dir.prepare_output_dir(cfg) is None and list(out.iterdir()) == []


def test_overwrite_never_deletes_a_parent_of_the_working_directory(tmp_path, monkeypatch):
    """A run folder whose (empty) checkpoint directory is the working directory: --overwrite would otherwise pass the
    run-files check and delete the folder the user stands in."""
    out = tmp_path / "run"
    (out / "checkpoint").mkdir(parents=True)
    (out / "run.json").write_text("{}")
    monkeypatch.chdir(out / "checkpoint")
    with pytest.raises(OutputDirError, match="one of its parents"):
        output_dir.prepare_output_dir(TrainConfig(model="m", output_dir=str(out), overwrite=True))
    assert (out / "run.json").is_file() and (out / "checkpoint").is_dir()


def test_a_resume_with_a_relative_data_path_left_unchanged_warns_nothing(tmp_path, monkeypatch, caplog):
    """The checkpoint keys its input stamps by the path as given ("data.jsonl"); they are compared resolved, so an
    unchanged file given by a relative path is not reported as changed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(model="m", output_dir=str(out), data="data.jsonl", resume=True)
    ckpt = _hand_checkpoint(out, {**cfg.to_json(), "inputs": cfg.input_stamps()})
    with caplog.at_level("WARNING", logger="specdec.train.output_dir"):
        assert output_dir.prepare_output_dir(cfg) == ckpt
    assert "changed since the checkpoint" not in caplog.text


def test_a_resume_accepts_a_checkpoint_that_recorded_no_target(tmp_path):
    """A checkpoint saved before targets were recorded has nothing to compare: it resumes whatever the model's
    fingerprint now; one that recorded another target is refused."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = TrainConfig(model="m", output_dir=str(out), resume=True)
    ckpt = _hand_checkpoint(out, cfg.to_json())
    assert output_dir.prepare_output_dir(cfg, "fingerprint-now") == ckpt
    _hand_checkpoint(out, {**cfg.to_json(), "target": "fingerprint-then"})
    with pytest.raises(OutputDirError, match="is not the one the checkpoint"):
        output_dir.prepare_output_dir(cfg, "fingerprint-now")


def test_a_save_replaces_a_checkpoint_left_beside_a_stale_old_one(tmp_path):
    """A kill after the new checkpoint was renamed in but before checkpoint.old was deleted leaves both; the next
    save must still swap (renaming onto a non-empty checkpoint.old fails) and leave only the new step."""
    _hand_checkpoint(tmp_path, {}, step=2)
    shutil.copytree(tmp_path / ckpt_io.CKPT, tmp_path / ckpt_io.OLD)  # the stale one, not yet deleted
    final = _hand_checkpoint(tmp_path, {}, step=6)
    assert ckpt_io.checkpoint_step(final) == 6 and not (tmp_path / ckpt_io.OLD).exists()
    assert ckpt_io.find_checkpoint(tmp_path) == tmp_path / ckpt_io.CKPT


def test_medusa_head_i_loss_is_weighted_by_head_decay_to_the_power_i(tmp_path):
    """--head-decay 0.5 over 3 heads: weights 0.5**0, 0.5**1, 0.5**2 = 1, 0.5, 0.25 (the first head at full weight)."""
    lm = torch.nn.Linear(4, 8, bias=False)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=4, vocab_size=8), get_output_embeddings=lambda: lm)
    cfg = TrainConfig(model="m", output_dir=str(tmp_path), num_heads=3, head_decay=0.5)
    assert medusa_recipe.MedusaRecipe(cfg, model, "cpu").weights == [1.0, 0.5, 0.25]


@pytest.mark.parametrize("extra", [{}, dict(draft_vocab=tuple(range(0, 96, 2))), dict(shared_lm_head=True)],
                         ids=["full", "draft-vocab", "shared"])
def test_the_heads_are_trained_and_scored_on_what_the_drafter_drafts(extra):
    """Training (head_loss), evaluation (head_accuracies, which picks the tree) and the drafter each shift positions
    on their own: an off-by-one in one of them trains or scores heads for another position than the one they draft
    (acceptance lost, unsaid). Along a greedy run of the drafter: at each step its head i's log-probabilities are
    the training forward's at the row of the token before the root, whose training target is the token the target
    committed at depth i + 1 of that step's tree; the evaluation's top-1 is the training's, head by head."""
    from specdec.drafters.medusa import MedusaDrafter
    from specdec.train.evaluate import head_accuracies

    import specdec
    from specdec.testing import build_tiny_model

    model = build_tiny_model()
    lm_w = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads.from_lm_head(MedusaConfig(3, 1, 64, 96, **extra), lm_w)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.05 * torch.randn_like(p))
    steps = []

    class Recorder(MedusaDrafter):
        def _head_logits(self, hidden, depth):
            out = super()._head_logits(hidden, depth)
            steps.append((len(self.views[0].token_ids), out[:, 0].float().log_softmax(-1)))
            return out

        def propose(self, seqs):
            self.views = seqs
            return super().propose(seqs)

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = specdec.generate(model, [prompt], drafter=Recorder(heads=heads, tree="dynamic", max_nodes=8),
                           max_new_tokens=16, return_dict=True, speculation="always")
    full = prompt + list(out.new_tokens[0])
    ids, mask = features.collate([full], "cpu")
    hidden, labels = features.target_features(model, ids, mask)
    assert len(steps) > 3 and out.tau > 1
    with torch.no_grad():
        for n, drafted in steps:
            t = n - 2  # the row of the token before the root (token_ids[-2])
            for i in range(3):
                x = heads.heads[i](hidden[0, t])
                trained = (torch.nn.functional.linear(x, heads.lm_rows(lm_w)) if extra.get("shared_lm_head")
                           else x).log_softmax(-1)
                assert torch.allclose(trained, drafted[i], atol=1e-5), (n, i)
                _, target = medusa_loss._head_targets(heads, i, labels, mask)
                if t + 2 + i < len(full):  # the token committed at depth i + 1 of this step's tree
                    want = torch.tensor([full[t + 2 + i]])
                    want = want if heads.vocab() is None else heads.vocab().to_reduced(want)
                    assert int(target[t]) == int(want), (n, i)
        top1 = head_accuracies(model, heads, [full])["top1"]
        for i in range(3):
            _, correct, count = medusa_loss.head_loss(heads, i, hidden, labels, mask, lm_w)
            assert top1[i] == pytest.approx(correct / count), i


def test_an_eagle3_layer_has_its_own_lm_head_only_over_the_full_vocabulary(tiny, tmp_path):
    """EAGLE-3 over the full vocabulary has its own [V, H] LM head instead of the target's; over a reduced draft
    vocabulary its head is the draft vocabulary's, so no full-vocabulary one."""
    model = _model_and_seqs(tiny)[0]
    cfg = TrainConfig(model="m", output_dir=str(tmp_path), drafter="eagle", eagle_arch="eagle3")
    assert EagleRecipe(cfg, model, "cpu").module.config.own_lm_head is True
    assert EagleRecipe(cfg, model, "cpu", draft_vocab=tuple(range(1, 40))).module.config.own_lm_head is False


def test_a_lost_connection_names_the_process_whose_note_comes_during_the_wait(monkeypatch):
    """A peer's note can land after this process's collective failed: the bounded wait for it reads it, so the line
    names process 1 rather than a process that stopped without a word."""
    class LateStore(_Store):
        def check(self, keys):
            self.checks = getattr(self, "checks", 0) + 1
            if self.checks == 3:  # the note arrives while this process waits for it
                self["specdec/run7/failed/1"] = "ValueError: a bad batch"
            return super().check(keys)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("specdec.train.process_failures.NOTE_WAIT_S", 5.0)
    try:
        with pytest.raises(PeerFailed, match=r"^process 1 failed") as stopped:
            FailureNotes(LateStore(), 0, 2, 7).stop(RuntimeError("[pair.cc:553] Connection closed by peer"))
        assert stopped.value.process == 1
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_process_never_blames_itself_or_notes_a_peers_failure_as_its_own():
    """A process's own note is not another's failure (a Ctrl-C after it is a plain interrupt), and a PeerFailed it
    stops with leaves no note: the others would name it as the process that failed."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        store = _Store()
        zero = FailureNotes(store, 0, 2, 7)
        zero.stop(PeerFailed(1))
        assert store == {}
        zero.stop(ValueError("a bad batch"))
        assert list(store) == ["specdec/run7/failed/0"]
        assert zero.failed() is None and zero.interrupted() is None
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_refusal_every_process_makes_is_said_by_process_0_alone(monkeypatch):
    """Under a launcher every process refused a missing model (or a folder process 0 alone checks stopped the
    others, which said "stopped: process 0 failed"): the user read the line once per process. Another process's
    refusal the same as process 0's is marked said by it, and a peer stopped by process 0's refusal knows it was
    one; a refusal of its own, or a failure, is not."""
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr("specdec.train.process_failures.NOTE_WAIT_S", 0.05)
    try:
        store = _Store()
        zero, one = FailureNotes(store, 0, 2, 7), FailureNotes(store, 1, 2, 7)
        zero.stop(OutputDirError("o3 is not empty"))
        with pytest.raises(PeerFailed) as stopped:
            one.interrupted()  # the launcher's SIGTERM once process 0 exited
        assert (stopped.value.process, stopped.value.refused) == (0, True)
        same, other = OutputDirError("o3 is not empty"), InputError("unknown model 'm'")
        for err in (same, other):
            one.stop(err)
        assert same.said_by_process_0 is True and other.said_by_process_0 is False
        store.clear()
        zero.stop(RuntimeError("CUDA out of memory"))  # a failure: the others say that they stopped
        with pytest.raises(PeerFailed) as stopped:
            one.interrupted()
        assert (stopped.value.process, stopped.value.refused) == (0, False)
        alone = InputError("unknown model 'm'")
        FailureNotes(_Store(), 1, 2, 7).stop(alone)  # process 0 refused nothing: this process says its refusal
        assert alone.said_by_process_0 is False
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_refusal_under_a_launcher_is_one_line(tmp_path, monkeypatch, capsys):
    """What each process of a launch prints: process 0 its refusal; another process nothing where process 0 says the
    same (the command line's options, checked alike by every process, or a refusal marked said by process 0) or
    where process 0's refusal stopped it, exit status 2 as process 0's; its own refusal, and a failure, as before."""
    from specdec.train import cli, pipeline
    from specdec.train.data import TrainDataError

    args = SimpleNamespace(drafter="medusa", output_dir=str(tmp_path), verbose=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    said = TrainDataError("no data")
    said.said_by_process_0 = True
    cases = ((0, "options", 2, "error: --lr must be > 0"), (1, "options", 2, ""), (1, said, 2, ""),
             (1, TrainDataError("no data"), 2, "error: no data"), (1, PeerFailed(0, refused=True), 2, ""),
             (1, PeerFailed(0), 1, "stopped: process 0 failed"), (1, PeerFailed(1, refused=True), 1, "stopped"))
    for rank, stop, code, line in cases:
        monkeypatch.setenv("RANK", str(rank))
        if stop == "options":
            monkeypatch.setattr(cli, "config_from_args", lambda args: (_ for _ in ()).throw(
                ValueError("--lr must be > 0, got -1.0")))
        else:
            monkeypatch.setattr(cli, "config_from_args", lambda args: None)

            def run_training(cfg, stop=stop):
                raise stop

            monkeypatch.setattr(pipeline, "run_training", run_training)
        assert cli.run(args) == code, (rank, stop)
        err = capsys.readouterr().err
        assert (err.startswith(f"specdec train-medusa: {line}") and err.count("\n") == 1) if line else err == "", \
            (rank, stop, err)


@pytest.mark.slow
def test_a_launch_of_two_processes_says_each_refusal_once(tiny, tmp_path):
    """Two real processes (gloo): a refusal both make (an option's value, a missing model) and one process 0 alone
    makes (its output folder's rules: a folder of another run, a --resume of a run stopped before its first
    checkpoint) were said once per process, or followed by "stopped: process 0 failed"; one line now, as one process
    says it."""
    import subprocess

    theirs, early = tmp_path / "theirs", tmp_path / "early"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("x")
    early.mkdir()
    (early / "run.json").write_text("{}")
    args = ["-m", "specdec.cli", "train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
            "--num-heads", "2", "--seq-len", "32", "--batch-size", "4", "--max-steps", "2", "--no-eval-tau",
            "--no-progress"]
    for extra, said in ((["--lr", "-1"], "--lr must be > 0"), (["--model", str(tmp_path / "none")], "unknown model"),
                        (["--output-dir", str(theirs)], "is not empty"),
                        (["--resume", "--output-dir", str(early)], "stopped before its first one")):
        cmd = _launch_two(*args, "--output-dir", str(tmp_path / "out"), *extra)  # a second --output-dir wins
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        lines = [x for x in proc.stderr.splitlines() if x.startswith("specdec train-medusa:")]
        assert proc.returncode != 0 and len(lines) == 1 and said in lines[0], _what_the_ranks_said(proc.stderr)
        assert not any(x.startswith("[rank") and "Traceback" in x for x in proc.stderr.splitlines()), proc.stderr


def test_a_signal_after_a_peer_failed_ignores_the_launchers_sigterm_from_then_on():
    """interrupted() with another process's note raises PeerFailed and ignores SIGTERM: the launcher's (sent when the
    failed process exits) must not cut this process's line."""
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        store = _Store({"specdec/run7/failed/1": "ValueError: a bad batch"})
        with pytest.raises(PeerFailed):
            FailureNotes(store, 0, 2, 7).interrupted()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_signal_during_the_last_meeting_waits_for_the_end_of_the_block():
    """After the ``last`` meeting signals are held: one during it is handled when the block ends, so what follows
    the meeting inside the block still runs."""
    (accelerator, sent), after = _meeting(during=signal.SIGTERM), []
    with sigterm_as_interrupt(), pytest.raises(Terminated), InterruptsHeld(hold=False) as agreed:
        agreed.meet(accelerator, last=True)
        after.append("ran")
    assert sent == [[0.0, 0.0]] and after == ["ran"]


def test_meet_after_makes_no_meeting_for_an_interrupt_no_signal_caused_or_one_already_agreed():
    """meet_after() meets the others only for a signal this block recorded, once: a KeyboardInterrupt raised by code
    (the others' meeting could be another collective) or one already stopped together makes no collective."""
    accelerator, sent = _meeting()
    with InterruptsHeld(hold=False) as agreed:
        agreed.meet_after(accelerator, KeyboardInterrupt())
    assert sent == []
    with sigterm_as_interrupt(), pytest.raises(Terminated) as stopped, InterruptsHeld(hold=False) as agreed:
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except KeyboardInterrupt as err:
            agreed.meet_after(accelerator, err)
            agreed.meet_after(accelerator, err)  # already agreed: no second meeting
            raise
    assert sent == [[0.0, 1.0]] and stopped.value.processes_stopped_together


def test_signals_deferred_past_a_step_are_handled_in_the_order_they_came():
    """SIGINT then SIGTERM inside a deferred step: the first that came (Ctrl-C) stops the run, as a KeyboardInterrupt,
    not a Terminated."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt) as stopped:
            with interrupts_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
        assert type(stopped.value) is KeyboardInterrupt
    finally:
        signal.signal(signal.SIGINT, before)


def test_an_agreed_interrupt_records_the_steps_the_main_process_could_not_save():
    """Processes that agreed on step 7 while the last checkpoint is step 4 (the main process could not save): 7 - 4 =
    3 steps lost, and the interrupt is marked as stopped together (the group closes as at a run's end)."""
    err = KeyboardInterrupt()
    interrupt_saves.record_interrupt(err, SimpleNamespace(), SimpleNamespace(step=7, saved=4, agreed=7))
    assert err.unsaved_steps == 3 and err.processes_stopped_together and not hasattr(err, "saved_step")
    err = KeyboardInterrupt()
    interrupt_saves.record_interrupt(err, SimpleNamespace(), SimpleNamespace(step=7, saved=7, agreed=7))
    assert err.saved_step == 7 and err.processes_stopped_together


def test_processes_that_agree_on_the_step_just_saved_do_not_save_it_again():
    """An agreed interrupt right after a checkpoint (step 6, saved at 6) writes nothing more; after step 7 the main
    process saves it once and every process stops."""
    saves = []
    run = SimpleNamespace(accelerator=SimpleNamespace(is_main_process=True, device=None,
                                                      reduce=lambda flags, reduction: flags),
                          save=lambda at: saves.append(at.step))
    for step, want in ((6, []), (7, [7])):
        at = SimpleNamespace(step=step, saved=6, agreed=None)
        with pytest.raises(KeyboardInterrupt), InterruptsHeld() as held:
            interrupt_saves.stop_together(run, at, torch.tensor([1.0, 0.0]), held)
        assert saves == want and at.saved == at.agreed == step
