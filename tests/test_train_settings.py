"""Training settings a run cannot use are refused in one line before the model loads, and a run whose loss or
weights stop being finite stops at that step (every process at the same one) before anything saves them."""
from __future__ import annotations

import json
import re
import threading

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from specdec.train import checkpoint as ckpt_io  # noqa: E402
from specdec.train import loop, medusa_recipe  # noqa: E402
from specdec.train.config import TrainConfig  # noqa: E402
from specdec.train.pipeline import run_training  # noqa: E402

from tests.test_train_data import training_dir  # noqa: E402
from tests.test_train_loop import _cfg as _loop_cfg  # noqa: E402
from tests.test_train_loop import _Threads  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return training_dir(tmp_path_factory.mktemp("tiny_settings"))


def _cfg(tiny, out, **kw):
    return _loop_cfg(tiny, out, **{"save_every": 1, "eval_tau": False, **kw})


@pytest.mark.parametrize("settings,message", [
    (dict(lr=float("inf")), "lr must be finite and > 0, got inf"),
    (dict(lr=float("nan")), "lr must be finite and > 0, got nan"),
    (dict(lr=0.0), "lr must be > 0, got 0.0"),
    (dict(weight_decay=-1.0), "weight_decay must be >= 0, got -1.0"),
    (dict(weight_decay=float("nan")), "weight_decay must be finite and >= 0, got nan"),
    (dict(warmup_steps=-5), "warmup_steps must be >= 0, got -5"),
    (dict(drafter="eagle", reg_weight=float("nan")), "reg_weight must be finite and >= 0, got nan"),
    (dict(drafter="eagle", reg_weight=float("inf")), "reg_weight must be finite and >= 0, got inf"),
    (dict(max_grad_norm=float("inf")), "max_grad_norm must be finite and >= 0 (0: no clipping), got inf"),
    (dict(num_heads=2.5), "num_heads must be an integer, got 2.5"),
    (dict(num_heads=True), "num_heads must be an integer, got True"),
    (dict(drafter="eagle", eagle_steps=2.7), "eagle_steps (--train-depth) must be an integer, got 2.7"),
    (dict(max_steps=2.0), "max_steps must be an integer or None, got 2.0"),
    (dict(num_prompts=True), "num_prompts must be an integer or None, got True"),
    (dict(batch_size="8"), "batch_size must be an integer, got '8'"),
    (dict(draft_vocab_coverage=True), "draft_vocab_coverage must be a number in (0, 1], got True"),
    (dict(head_decay=float("nan")), "head_decay must be finite and in (0, 1], got nan"),
    (dict(seed=2**60), "seed must be <= 4398046511104 (it is scaled into torch's 64-bit seeds)"),
    (dict(tree_budget=65), "tree_budget must be <= 64 (the largest draft tree), got 65"),
    (dict(grad_accum=0), "grad_accum must be >= 1, got 0"),
    (dict(held_out_fraction=1.0), "held_out_fraction must be in [0, 1), got 1.0"),
])
def test_numeric_settings_a_run_cannot_use_are_refused_in_one_line(settings, message):
    """lr inf trained all-NaN heads and exited 0, --weight-decay -1 failed after the model load in torch's words,
    --warmup-steps -5 started the schedule part-way, num_heads 2.5 failed after the model load: each is refused
    here (no model named "m" exists, so nothing was loaded), naming the setting and its range."""
    with pytest.raises(ValueError) as err:
        TrainConfig(model="m", output_dir="o", **settings)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_defaults_and_the_edges_of_every_range_stay_valid():
    import argparse

    from specdec.train import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    for command in ("train-medusa", "train-eagle"):  # every CLI default
        cli.config_from_args(parser.parse_args([command, "--output-dir", "o"]))
    TrainConfig(model="m", output_dir="o", num_layers=0, warmup_steps=0, weight_decay=0, max_grad_norm=0, lr=1,
                head_decay=1, held_out_fraction=0, draft_vocab="auto", draft_vocab_coverage=1, seed=-1, tree_budget=64,
                max_steps=None)
    TrainConfig(model="m", output_dir="o", drafter="eagle", reg_weight=0, eagle_steps=1, seed=2**42)


def test_train_flags_at_non_default_values_reach_the_train_config():
    """Each flag given away from its default is the TrainConfig field it names."""
    import argparse

    from specdec.train import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    medusa = cli.config_from_args(parser.parse_args([
        "train-medusa", "--output-dir", "o", "--head-decay", "0.5", "--no-feature-cache", "--num-heads", "4",
        "--num-layers", "2", "--shared-lm-head", "--lr", "0.01", "--seed", "7", "--max-steps", "9", "--no-eval-tau",
        "--no-progress"]))
    assert (medusa.head_decay, medusa.cache_features, medusa.num_heads, medusa.num_layers, medusa.shared_lm_head,
            medusa.lr, medusa.seed, medusa.max_steps, medusa.eval_tau, medusa.progress) == \
        (0.5, False, 4, 2, True, 0.01, 7, 9, False, False)
    eagle = cli.config_from_args(parser.parse_args(["train-eagle", "--output-dir", "o", "--train-depth", "5",
                                                    "--reg-weight", "0.5"]))
    assert (eagle.drafter, eagle.eagle_steps, eagle.reg_weight) == ("eagle", 5, 0.5)


@pytest.mark.parametrize("settings, message", [
    (dict(draft_vocab_coverage=0.9), "draft_vocab_coverage (--draft-vocab-coverage) sizes --draft-vocab auto; with "
                                     "draft_vocab full it is unused"),
    (dict(draft_vocab=4096, draft_vocab_coverage=0.9), "draft_vocab_coverage (--draft-vocab-coverage) sizes "
                                                       "--draft-vocab auto; with draft_vocab 4096 it is unused"),
    (dict(drafter="eagle", num_heads=4), "num_heads is medusa's: training eagle does nothing with it"),
    (dict(drafter="eagle", shared_lm_head=True), "shared_lm_head is medusa's"),
    (dict(eagle_steps=2), "eagle_steps is eagle's: training medusa does nothing with it"),
    (dict(eagle_arch="eagle3"), "eagle_arch is eagle's"),
    (dict(data="d.jsonl", distill_max_new_tokens=7, distill_cuda_graphs="on"),
     "distill_max_new_tokens (--distill-max-new-tokens), distill_cuda_graphs (--distill-cuda-graphs) shape "
     "self-distillation, which a run on data (--data) does not do"),
    (dict(text_field="body"), "text_field (--text-field) names a field of the records of data (--data); without "
                              "data the run self-distils prompts"),
    (dict(prompts_file="p.txt", messages_field="conversations"), "messages_field (--messages-field) names a field"),
])
def test_settings_the_run_would_not_use_are_refused(settings, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        TrainConfig(model="m", output_dir="o", **settings)
    TrainConfig(model="m", output_dir="o", draft_vocab="auto", draft_vocab_coverage=0.9)  # where each is used
    TrainConfig(model="m", output_dir="o", drafter="eagle", eagle_steps=2, eagle_arch="eagle3")
    TrainConfig(model="m", output_dir="o", num_heads=4, shared_lm_head=True)
    TrainConfig(model="m", output_dir="o", distill_max_new_tokens=7, distill_cuda_graphs="on")
    TrainConfig(model="m", output_dir="o", data="d.jsonl", text_field="body", messages_field="conversations")


@pytest.mark.parametrize("option", [["--lr", "inf"], ["--weight-decay", "-1"], ["--warmup-steps", "-5"],
                                    ["--held-out-fraction", "1"]])
def test_the_cli_refuses_them_before_the_model_loads(tmp_path, capsys, option):
    from specdec.cli import main

    out = tmp_path / "run"
    rc = main(["train-medusa", "--model", str(tmp_path / "no-such-model"), "--output-dir", str(out), *option])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"specdec train-medusa: error: {option[0]} must be "), err  # the flag, not the field
    assert not out.exists()


def test_heads_with_no_weight_to_train_are_refused_before_the_model_loads(tmp_path, capsys):
    """--num-layers 0 --shared-lm-head makes each head the target's own LM head, with no weight of its own: the run
    loaded the model (and self-distilled) before AdamW stopped it with a traceback ("empty parameter list")."""
    from specdec.cli import main

    with pytest.raises(ValueError, match=r"^num_layers 0 \(--num-layers\) with shared_lm_head"):
        TrainConfig(model="m", output_dir="o", num_layers=0, shared_lm_head=True)
    TrainConfig(model="m", output_dir="o", num_layers=0)  # its own LM heads are trained
    TrainConfig(model="m", output_dir="o", num_layers=1, shared_lm_head=True)  # its blocks are
    out = tmp_path / "run"
    rc = main(["train-medusa", "--model", str(tmp_path / "no-such-model"), "--output-dir", str(out),
               "--num-layers", "0", "--shared-lm-head"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "leaves the heads no weight to train" in err and not out.exists()


@pytest.mark.parametrize("given, said", [
    (["--eval-prompts", "5"], "--eval-prompts sets"),
    (["--eval-max-new-tokens", "32", "--eval-tree", "dynamic"], "--eval-max-new-tokens, --eval-tree set"),
])
def test_tau_settings_beside_no_eval_tau_are_refused_before_the_model_loads(tmp_path, capsys, given, said):
    """--eval-prompts / --eval-max-new-tokens / --eval-tree with --no-eval-tau were accepted and unused."""
    from specdec.train.cli import config_from_args

    from specdec.cli import _parser, main

    out = tmp_path / "run"
    rc = main(["train-medusa", "--model", str(tmp_path / "no-such-model"), "--output-dir", str(out), *given,
               "--no-eval-tau"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"specdec train-medusa: error: {said} the tau measurement, which --no-eval-tau "
                               f"skips: leave {'it' if len(given) == 2 else 'them'} out, or measure tau")
    assert not out.exists()
    args = _parser().parse_args(["train-medusa", "--model", "m", "--output-dir", str(out), *given])
    config = config_from_args(args)  # measured: the values reach the run
    assert (config.eval_prompts, config.eval_max_new_tokens, config.eval_tree) == (
        (5, 128, "static") if len(given) == 2 else (24, 32, "dynamic"))


def test_a_diverging_run_stops_at_the_step_whose_loss_is_nan_keeping_the_good_checkpoints(tiny, tmp_path, capsys):
    """lr 1e30 is finite (accepted) and blows the heads up after one step: step 2's loss is nan. The run stopped
    there with one line and exit 2, kept step 1's checkpoint and wrote no head (it ran on and exited 0)."""
    from specdec.cli import main

    out = tmp_path / "run"
    rc = main(["train-medusa", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
               "--output-dir", str(out), "--num-heads", "2", "--seq-len", "32", "--batch-size", "4",
               "--max-steps", "6", "--save-every", "1", "--lr", "1e30", "--no-eval-tau", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err == ("specdec train-medusa: error: training diverged at step 2: its loss is nan; lower lr (--lr, now "
                   "1e+30); no head was written, the checkpoint of step 1 is kept")
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(out))["step"] == 1
    assert not (out / "medusa_lm_head.safetensors").exists()
    assert [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()] == [1]


def test_an_update_that_leaves_non_finite_weights_stops_the_run_before_they_are_saved(tiny, tmp_path):
    """lr * weight_decay overflows float32: step 1's update leaves infinite weights although its loss was finite.
    It stops at step 1, before the checkpoint due there is written."""
    out = tmp_path / "run"
    with pytest.raises(loop.TrainingDiverged, match=re.escape(
            "training diverged at step 1: its update left weights that are not finite; lower lr (--lr, now 1e+30) or "
            "weight_decay (--weight-decay, now 1e+10); no head was written")):
        run_training(_cfg(tiny, out, lr=1e30, weight_decay=1e10))
    assert ckpt_io.find_checkpoint(out) is None and not (out / "medusa_lm_head.safetensors").exists()


def test_every_process_stops_at_the_step_whose_summed_loss_is_nan(tiny, tmp_path):
    """Only process 1's share of step 3's loss is nan: the summed loss every process holds is, so both stop at step
    3 with the same error (a check of the local loss would have stopped one and left the other waiting)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    out.mkdir()
    cfg = _cfg(tiny, out, save_every=50)
    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    seqs = [[(i * 7 + j * 3) % 60 + 1 for j in range(10 + i % 7)] for i in range(16)]  # the tiny vocabulary
    recipes = []
    for _ in range(2):
        torch.manual_seed(cfg.seed)
        recipes.append(medusa_recipe.MedusaRecipe(cfg, model, "cpu"))
    real, calls = recipes[1].accumulate, []

    def poisoned(*args, **kwargs):
        loss, correct, count = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), correct, count

    recipes[1].accumulate = poisoned
    group, errors = _Threads(2), [None, None]

    def run(r):
        try:
            loop.train_drafter(cfg, recipes[r], model, seqs, group.rank(r), None)
        except BaseException as err:  # noqa: BLE001 - asserted below, in the test's thread
            errors[r] = err
            if not isinstance(err, loop.TrainingDiverged):  # the other rank may wait for this one: free it
                group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(e, loop.TrainingDiverged) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    assert str(errors[0]).startswith("training diverged at step 3: its loss is nan;"), errors


def test_a_run_saved_with_a_setting_it_did_not_use_still_resumes():
    """A run from before such settings were refused saved them in its checkpoint's config: a resume compares
    only what shaped the heads, so it does not refuse a value the run never used (nor can the value be given
    again: it is refused now)."""
    from dataclasses import asdict

    now = TrainConfig(model="m", output_dir="o")
    assert now.differences({**asdict(now), "draft_vocab_coverage": 0.9}) == []
    eagle = TrainConfig(model="m", output_dir="o", drafter="eagle")
    assert eagle.differences({**asdict(eagle), "num_heads": 5, "shared_lm_head": True}) == []
    assert now.differences({**asdict(now), "eagle_steps": 2}) == []
    used = TrainConfig(model="m", output_dir="o", draft_vocab="auto")
    assert used.differences({**asdict(used), "draft_vocab_coverage": 0.9}) == [
        "draft_vocab_coverage: checkpoint 0.9 vs now 0.97"]
    assert now.differences({**asdict(now), "num_heads": 5}) == ["num_heads: checkpoint 5 vs now 3"]
    # a run on --data saved self-distillation settings it never used; they blocked its resume at the defaults
    on_data = TrainConfig(model="m", output_dir="o", data="d.jsonl")
    assert on_data.differences({**asdict(on_data), "distill_batch_size": 3, "distill_cuda_graphs": "on"}) == []
    assert now.differences({**asdict(now), "distill_batch_size": 3}) == ["distill_batch_size: checkpoint 3 vs now 128"]
    # a refused resume names the flag of a field named otherwise (--train-depth 2 read "eagle_steps: ...")
    eagle = TrainConfig(model="m", output_dir="o", drafter="eagle", eagle_steps=2, cache_features=False)
    assert eagle.differences({**asdict(eagle), "eagle_steps": 3, "cache_features": True}) == [
        "cache_features (False: --no-feature-cache): checkpoint True vs now False",
        "eagle_steps (--train-depth): checkpoint 3 vs now 2"]


@pytest.mark.parametrize("step,saved,start,message", [
    (0, 0, 0, "the loss of step 1, the first of this run, is nan before any update: the target's hidden states or "
              "the starting weights are not finite; no head was written"),
    (4, 4, 4, "the loss of step 5, the first of this run, is nan before any update: the target's hidden states or "
              "the starting weights are not finite; no head was written, the checkpoint of step 4 is kept"),
    (4, 2, 0, "training diverged at step 5: its loss is nan; lower lr (--lr, now 0.001); no head was written, the "
              "checkpoint of step 2 is kept"),
])
def test_a_nan_loss_blames_the_lr_only_after_an_update_of_this_run(step, saved, start, message):
    """The first step of a run (a resumed one's too: its weights are the checkpoint's) has had no update to blame;
    a run that saved nothing names no checkpoint (not "step 0")."""
    from types import SimpleNamespace

    at = loop.Position(step=step, saved=saved, rng=torch.get_rng_state(), history=[], start=start)
    run = SimpleNamespace(cfg=TrainConfig(model="m", output_dir="o", lr=1e-3))
    with pytest.raises(loop.TrainingDiverged) as err:
        loop._check_loss(run, at, torch.tensor([float("nan"), 0.0, 0.0]))
    assert str(err.value) == message


def test_a_resume_refuses_another_lr_and_names_epochs_where_the_checkpoint_had_no_max_steps():
    """lr shapes the heads: another one is another run (its fingerprint too). epochs is ignored only where both
    runs set the same max_steps; a checkpoint of an epoch-based run differs in both."""
    from dataclasses import asdict

    now = TrainConfig(model="m", output_dir="o", lr=1e-3, max_steps=10, epochs=2)
    assert now.differences({**asdict(now), "lr": 3e-3}) == ["lr: checkpoint 0.003 vs now 0.001"]
    assert now.fingerprint() != TrainConfig(model="m", output_dir="o", lr=3e-3, max_steps=10, epochs=2).fingerprint()
    assert now.differences({**asdict(now), "max_steps": None, "epochs": 1}) == [
        "epochs: checkpoint 1 vs now 2", "max_steps: checkpoint None vs now 10"]
    # a checkpoint of a run on --data, resumed to self-distil: the distillation settings count again
    on_data = TrainConfig(model="m", output_dir="o", data="d.jsonl")
    assert now.differences({**asdict(now), "data": "d.jsonl", "distill_batch_size": 3}) == [
        "data: checkpoint 'd.jsonl' vs now None", "distill_batch_size: checkpoint 3 vs now 128"]
    assert on_data.differences({**asdict(on_data), "distill_batch_size": 3}) == []
