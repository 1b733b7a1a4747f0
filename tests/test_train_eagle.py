"""train-eagle on a tiny random model: the CLI writes a loadable checkpoint with its report, resume after
a kill is bit-exact, a checkpoint for another target is refused, and the draft vocabulary covers the data."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from specdec.drafters.eagle_checkpoint import EagleCheckpointError, load_eagle  # noqa: E402
from specdec.train import checkpoint as ckpt_io  # noqa: E402
from specdec.train import eagle_report, loop  # noqa: E402
from specdec.train.accuracy_table import accuracy_cells  # noqa: E402
from specdec.train.config import TrainConfig  # noqa: E402
from specdec.train.output_dir import OutputDirError  # noqa: E402
from specdec.train.pipeline import run_training  # noqa: E402
from specdec.train.run_seconds import run_seconds  # noqa: E402

from tests.test_train_data import training_dir  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return training_dir(tmp_path_factory.mktemp("tiny_eagle"))


def _cfg(tiny, out, **kw):
    base = dict(model=str(tiny / "model"), output_dir=str(out), data=str(tiny / "data.jsonl"), drafter="eagle",
                draft_vocab=24, seq_len=32, batch_size=4, max_steps=6, save_every=2, lr=3e-3, eval_prompts=2,
                eval_max_new_tokens=8, progress=False, held_out_fraction=0.2, eagle_steps=2, eval_tau=False)
    base.update(kw)
    return TrainConfig(**base)


def test_cli_run_writes_loadable_checkpoint_and_report(tiny, tmp_path):
    from transformers import AutoConfig

    from specdec.cli import main

    out = tmp_path / "run"
    rc = main(["train-eagle", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
               "--output-dir", str(out), "--seq-len", "32", "--batch-size", "4", "--max-steps", "3",
               "--eval-prompts", "1", "--eval-max-new-tokens", "6", "--draft-vocab", "auto", "--train-depth", "2",
               "--no-progress"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert len(report["top1"]) == 2 and report["draft_vocab"]["coverage"] >= 0.97
    assert report["tree_measurements"] and report["tree"] in [
        {k: m[k] for k in ("depth", "top_k", "max_nodes")} for m in report["tree_measurements"]]
    eagle = load_eagle(out, AutoConfig.from_pretrained(tiny / "model"))
    assert eagle.config.max_nodes == report["tree"]["max_nodes"]  # the measured choice is what loads
    assert len(eagle.config.draft_vocab) == report["draft_vocab"]["size"]
    assert "EAGLE training report" in (out / "report.md").read_text()


@pytest.mark.parametrize("option", [["--tree-budget", "8"], ["--eval-tree", "dynamic"]])
def test_medusa_tree_options_are_refused_not_ignored(tiny, tmp_path, capsys, option):
    """train-eagle accepted --tree-budget / --eval-tree (Medusa's medusa_choices tree) and did nothing with them:
    an EAGLE run times its candidate trees. Refused in one line, by the CLI and by the config."""
    from specdec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train-eagle", "--model", str(tiny / "model"), "--data", str(tmp_path / "none.jsonl"),
              "--output-dir", str(tmp_path / "run"), *option])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1
    assert f"{option[0]} is a train-medusa option" in err
    with pytest.raises(ValueError, match="tree_budget and eval_tree choose Medusa's"):
        _cfg(tiny, tmp_path / "run", **{option[0][2:].replace("-", "_"): 8 if option[1] == "8" else option[1]})


def test_one_run_lowers_the_loss(tiny, tmp_path):
    report = run_training(_cfg(tiny, tmp_path / "r", max_steps=8, save_every=8))
    hist = [json.loads(x) for x in (tmp_path / "r" / "history.jsonl").read_text().splitlines()]
    assert hist[-1]["loss"] < hist[0]["loss"] and report["steps"] == 8


def test_resume_after_kill_matches_uninterrupted_run(tiny, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    full = tmp_path / "full"
    run_training(_cfg(tiny, full))
    real_rows = loop.batch_rows

    def dying_rows(num, micro, bs, seed):
        if micro == 5:
            raise KeyboardInterrupt
        return real_rows(num, micro, bs, seed)

    part = tmp_path / "part"
    monkeypatch.setattr(loop, "batch_rows", dying_rows)
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(tiny, part))
    monkeypatch.setattr(loop, "batch_rows", real_rows)
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(part))["step"] == 5  # step 5: saved by the interrupt
    with pytest.raises(OutputDirError, match="different configuration.*eagle_steps"):
        run_training(_cfg(tiny, part, resume=True, eagle_steps=3))
    run_training(_cfg(tiny, part, resume=True))
    a, b = load_file(str(full / "model.safetensors")), load_file(str(part / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_for_another_target_is_refused(tiny, tmp_path):
    from specdec.testing import build_tiny_model

    run_training(_cfg(tiny, tmp_path / "r", max_steps=1))
    other = build_tiny_model(vocab_size=tiny_vocab(tiny) + 8)
    with pytest.raises(EagleCheckpointError, match=r"vocab_size=\d+ but the target model has vocab_size="):
        load_eagle(tmp_path / "r", other.config)


def tiny_vocab(tiny) -> int:
    return json.loads((tiny / "model" / "config.json").read_text())["vocab_size"]


def test_bad_settings_are_refused_before_anything_runs(tiny, tmp_path):
    with pytest.raises(ValueError, match="draft_vocab must be"):
        _cfg(tiny, tmp_path, draft_vocab=0)
    with pytest.raises(ValueError, match="drafter must be one of"):
        _cfg(tiny, tmp_path, drafter="eagle3")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    with pytest.raises(OutputDirError, match="not empty"):
        run_training(_cfg(tiny, tmp_path / "busy"))


def test_response_only_accuracies_skip_the_prompt():
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train.eagle_evaluate import eagle_accuracies

    from specdec.testing import build_tiny_model

    model = build_tiny_model()
    eagle = EagleModel(EagleConfig.for_target(model.config))
    seqs = [[(i * 5 + j) % 90 + 1 for j in range(12)] for i in range(3)]
    whole = eagle_accuracies(model, eagle, seqs, steps=2)
    assert eagle_accuracies(model, eagle, seqs, steps=2, starts=[0, 0, 0]) == whole
    part = eagle_accuracies(model, eagle, seqs, steps=2, starts=[6, 6, 6])
    assert part["positions"][0] == whole["positions"][0] - 3 * 4  # targets at positions 2..5 of each are skipped


def test_held_out_accuracies_count_what_the_training_loss_counts_in_each_scope():
    """The report's top-1 / top-5 per depth are the training loss's own tallies over the scope's positions (a target
    token outside the draft vocabulary a miss): one pass of the layer serves every scope, each counting its subset."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train.eagle_evaluate import scoped_eagle_accuracies
    from specdec.train.eagle_loss import eagle_loss
    from specdec.train.features import collate, target_features

    from specdec.testing import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model()
    eagle = EagleModel(EagleConfig.for_target(model.config, draft_vocab=tuple(range(1, 12))))
    seqs = [[(i * 7 + j * 3) % 13 + 1 for j in range(9 + 3 * i)] for i in range(4)]  # one batch; tokens 12, 13 OOV
    starts = [3, 6, 2, 8]
    got = scoped_eagle_accuracies(model, eagle, seqs, 3, [None, starts])
    ids, mask = collate(seqs, "cpu")
    hidden, labels = target_features(model, ids, mask)
    scoped = mask.clone()
    for b, first in enumerate(starts):
        scoped[b, : first - 1] = 0
    for acc, scored in zip(got, (mask, scoped), strict=True):
        top5: list[int] = []
        _, correct, count = eagle_loss(eagle, ids, hidden, labels, scored, model.get_input_embeddings().weight,
                                       model.get_output_embeddings().weight, steps=3, top5=top5)
        assert acc["positions"] == count and min(count) > 0
        assert acc["top1"] == [c / n for c, n in zip(correct, count, strict=True)]
        assert acc["top5"] == [t / n for t, n in zip(top5, count, strict=True)]
    assert got[0]["top5"] != got[1]["top5"] and sum(got[0]["top1"]) > 0  # the scopes differ; some hits to count


def test_a_batch_of_one_token_sequences_scores_nothing_at_any_depth():
    """One token predicts nothing: a zero loss, and zero counts (top-5's too) at each of the 3 depths."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train.eagle_loss import eagle_loss

    from specdec.testing import build_tiny_model

    model = build_tiny_model()
    eagle = EagleModel(EagleConfig.for_target(model.config))
    top5: list[int] = []
    loss, correct, count = eagle_loss(eagle, torch.tensor([[3], [4]]), torch.zeros(2, 1, model.config.hidden_size),
                                      torch.tensor([[1], [2]]), torch.ones(2, 1), model.get_input_embeddings().weight,
                                      model.get_output_embeddings().weight, steps=3, top5=top5)
    assert float(loss) == 0.0 and correct == count == top5 == [0, 0, 0]


def test_tree_choice_loads_the_cost_model_before_timing_anything(tmp_path, monkeypatch):
    """The first drafting call of a process loads the cost model (on a fresh machine: a calibration of ~10 s);
    inside the first candidate's timing it once made the best tree (depth 1, 1.17x of plain) measure 0.90x."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train import eagle_evaluate

    from specdec import cost_model
    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    monkeypatch.setenv("SPECDEC_COST_DIR", str(tmp_path))  # nothing cached: the first drafting call calibrates
    monkeypatch.setattr(cost_model, "_MEMO", {})
    loaded = load_model(build_tiny_model(vocab_size=64, seed=5))
    eagle = EagleModel(EagleConfig.for_target(loaded.model.config, draft_vocab=tuple(range(32))))
    eagle.init_from_target(loaded.model)
    real, seen = eagle_evaluate._run, []

    def run(loaded, ids, max_new_tokens, drafter=None, **config):
        out = real(loaded, ids, max_new_tokens, drafter, **config)
        seen.append(cost_model.CALIBRATIONS["verify"])
        return out

    monkeypatch.setattr(eagle_evaluate, "_run", run)
    eagle_evaluate.choose_tree_by_speed(loaded, eagle, [[1, 2, 3], [4, 5]], 4, candidates=((1, 1, 1), (2, 1, 2)))
    assert len(seen) == 1 + 2 * 2 * 2 and seen[0] >= 1  # warm-up, then 2 candidates x 2 prompts x (plain, tree)
    assert len(set(seen)) == 1  # every calibration happened in the warm-up


def test_tree_choice_warms_up_within_the_answers_that_fit_the_context(monkeypatch):
    """The warm-up asked 8 new tokens whatever --eval-max-new-tokens was: a first prompt within 8 tokens of the
    model's context, answered in 4, ended the run after training in generate()'s refusal of the warm-up."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train import eagle_evaluate

    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    loaded = load_model(build_tiny_model(vocab_size=64, seed=5, max_position_embeddings=24))
    eagle = EagleModel(EagleConfig.for_target(loaded.model.config))
    eagle.init_from_target(loaded.model)
    real, asked = eagle_evaluate._run, []

    def run(loaded, ids, max_new_tokens, drafter=None, **config):
        asked.append(max_new_tokens)
        return real(loaded, ids, max_new_tokens, drafter, **config)

    monkeypatch.setattr(eagle_evaluate, "_run", run)
    eagle_evaluate.choose_tree_by_speed(loaded, eagle, [list(range(1, 21))], 4, candidates=((1, 1, 1),))
    assert asked == [4, 4, 4]  # warm-up, then plain and the tree


def test_tree_choice_pairs_each_candidate_with_plain_decoding(monkeypatch):
    """A machine that slows down while the candidates are timed: the first candidate runs at 0.9x of plain while
    the machine is fast, the second at 1.2x once it is slow. Compared with one plain run at the start (the old
    rule), the first looked faster (9 against 6 tokens/s); paired, the second wins. The report says so when no
    tree beats plain decoding."""
    from specdec.train import eagle_evaluate
    from specdec.train.eagle_report import render_markdown

    speeds = iter([(50.0, 1.0),  # warm-up
                   (10.0, 1.0), (9.0, 1.1), (10.0, 1.0), (9.0, 1.1),  # candidate 1: plain, tree per prompt
                   (5.0, 1.0), (6.0, 1.4), (5.0, 1.0), (6.0, 1.4)])  # candidate 2, the machine at half speed
    monkeypatch.setattr(eagle_evaluate, "_run", lambda *a, **k: next(speeds))
    monkeypatch.setattr("specdec.drafters.eagle.EagleDrafter", lambda **options: options)  # no layer needed
    best, table = eagle_evaluate.choose_tree_by_speed(None, None, [[1], [2]], 4, candidates=((1, 1, 1), (2, 1, 2)))
    assert best == (2, 1, 2)
    assert [round(r["speedup_vs_plain"], 3) for r in table] == [0.9, 1.2]
    assert [r["plain_tokens_per_s"] for r in table] == [10.0, 5.0]
    report = {"config": {"eagle_steps": 2}, "draft_vocab": {}, "model": "m", "steps": 1, "train_sequences": 1,
              "processes": 1, "final_loss": 1.0, "held_out_sequences": 1, "top1": [0.5], "top5": [0.7],
              "tree_measurements": table, "tree": {"depth": 2, "top_k": 1, "max_nodes": 2},
              "seconds": {"data": 1, "train": 1, "eval": 1, "total": 3}}
    assert "No tree beat plain decoding" not in render_markdown(report)
    table[1]["speedup_vs_plain"] = 0.95
    assert "No tree beat plain decoding on this machine** (the best: 0.95x at tau 1.40" in render_markdown(report)


def test_tree_choice_verifies_every_candidate_whole_and_stops_when_larger_trees_keep_losing(monkeypatch):
    """Under the default guard a tree that does not pay is left out, and its candidate times plain decoding: each
    candidate must run with speculation="always" (plain decoding without a drafter). Speedups 1.1, 1.3, 1.2, 1.0:
    after two in a row below the best (1.3), the fifth candidate is never run."""
    from specdec.train import eagle_evaluate

    calls, tree_speed = [], iter([1.1, 1.1, 1.3, 1.3, 1.2, 1.2, 1.0, 1.0, 5.0, 5.0])

    def run(loaded, ids, max_new_tokens, drafter=None, **config):
        calls.append((drafter is not None, config.get("speculation")))
        tree = drafter is not None and len(calls) > 1
        return (next(tree_speed) if tree else 1.0), (1.5 if tree else 1.0)

    monkeypatch.setattr(eagle_evaluate, "_run", run)
    monkeypatch.setattr("specdec.drafters.eagle.EagleDrafter", lambda **options: options)
    candidates = ((1, 1, 1), (2, 1, 2), (3, 1, 3), (3, 2, 4), (4, 4, 10))
    best, table = eagle_evaluate.choose_tree_by_speed(None, None, [[1], [2]], 4, candidates=candidates)
    assert best == (2, 1, 2) and len(table) == 4
    assert [round(r["speedup_vs_plain"], 3) for r in table] == [1.1, 1.3, 1.2, 1.0]
    timed = calls[1:]  # after the warm-up: (plain, tree) per prompt per candidate
    assert timed[0::2] == [(False, None)] * 8 and timed[1::2] == [(True, "always")] * 8


def test_without_timing_the_saved_tree_comes_from_the_accuracies_and_stays_within_the_trained_depth(tiny, tmp_path):
    """eval_tau off: the saved tree is the deepest depth (up to the trained one) whose chain-acceptance estimate,
    the product of the per-depth top-1, is >= 0.1, not EagleConfig's default depth-5 tree; the report says so."""
    from transformers import AutoConfig

    report = run_training(_cfg(tiny, tmp_path / "r", max_steps=2, save_every=2))
    assert report["tree"]["depth"] <= 2 and report["tree_choice"]["by"] == "accuracies"
    assert "**not timed** (--no-eval-tau)" in (tmp_path / "r" / "report.md").read_text()
    from specdec.train.eagle_evaluate import tree_from_accuracies

    expected = tree_from_accuracies(report["top1"], 2)[0]
    assert (report["tree"]["depth"], report["tree"]["top_k"], report["tree"]["max_nodes"]) == expected
    eagle = load_eagle(tmp_path / "r", AutoConfig.from_pretrained(tiny / "model"))
    assert (eagle.config.depth, eagle.config.top_k, eagle.config.max_nodes) == expected
    assert tree_from_accuracies([0.6, 0.5, 0.4, 0.3], train_depth=4) == ((3, 3, 6), pytest.approx([0.6, 0.3, 0.12,
                                                                                                    0.036]))
    assert tree_from_accuracies([0.6, 0.5, 0.4, 0.3], train_depth=2)[0] == (2, 1, 2)
    assert tree_from_accuracies([0.05, 0.9], train_depth=2)[0] == (1, 1, 1)  # nothing pays: the smallest tree


def test_a_tree_that_accepted_nothing_does_not_win_by_timing_noise(monkeypatch, caplog):
    """Every candidate at tau 1.00 (nothing accepted), one timed at 1.01x of plain: noise, not a win. The smallest
    tree is saved, the log warns and the report says no tree beat plain decoding."""
    from specdec.train import eagle_evaluate
    from specdec.train.eagle_report import render_markdown

    speeds = iter([(50.0, 1.0),  # warm-up
                   (10.0, 1.0), (10.0, 1.0), (10.0, 1.0), (10.0, 1.0),  # candidate 1: plain, tree per prompt
                   (10.0, 1.0), (10.1, 1.0), (10.0, 1.0), (10.1, 1.0)])  # candidate 2: 1.01x, tau 1
    monkeypatch.setattr(eagle_evaluate, "_run", lambda *a, **k: next(speeds))
    monkeypatch.setattr("specdec.drafters.eagle.EagleDrafter", lambda **options: options)
    with caplog.at_level("WARNING", logger="specdec.train.eagle_evaluate"):
        best, table = eagle_evaluate.choose_tree_by_speed(None, None, [[1], [2]], 4,
                                                          candidates=((1, 1, 1), (2, 1, 2)))
    assert best == (1, 1, 1) and round(table[1]["speedup_vs_plain"], 3) == 1.01
    assert "no tree beat plain decoding" in caplog.text
    report = {"config": {"eagle_steps": 2}, "draft_vocab": {}, "model": "m", "steps": 1, "train_sequences": 1,
              "processes": 1, "final_loss": 1.0, "held_out_sequences": 1, "top1": [0.5], "top5": [0.7],
              "tree_measurements": table, "tree": {"depth": 1, "top_k": 1, "max_nodes": 1},
              "seconds": {"data": 1, "train": 1, "eval": 1, "total": 3}}
    assert "No tree beat plain decoding on this machine** (the best: 1.01x at tau 1.00" in render_markdown(report)
    table[1]["tau"] = 1.3  # drafts accepted, but 1.01x is still within noise
    assert not eagle_evaluate.tree_pays(table[1])
    table[1]["speedup_vs_plain"] = 1.1
    assert eagle_evaluate.tree_pays(table[1]) and "No tree beat" not in render_markdown(report)


def test_tree_choice_shows_a_progress_bar_when_the_run_does(tiny, tmp_path, monkeypatch):
    """The tree choice (minutes in the quick recipe) drives a bar over the timed prompts; cfg.progress reaches it."""
    import tqdm.auto
    from specdec.train import eagle_evaluate, eagle_report

    bars = []

    class Bar:
        def __init__(self, total=None, **kw):
            self.total, self.n, self.kw = total, 0, kw
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def close(self):
            pass

    with monkeypatch.context() as m:
        m.setattr(tqdm.auto, "tqdm", Bar)
        m.setattr(eagle_evaluate, "_run", lambda *a, **k: (10.0, 1.5))
        m.setattr("specdec.drafters.eagle.EagleDrafter", lambda **options: options)
        eagle_evaluate.choose_tree_by_speed(None, None, [[1], [2], [3]], 4, candidates=((1, 1, 1), (2, 1, 2)),
                                            progress=True)
    assert [(b.total, b.n, b.kw.get("desc")) for b in bars] == [(6, 6, "tree choice")]
    seen = []

    def choose(loaded, eagle, prompts, max_new_tokens, **kw):
        seen.append(kw.get("progress"))
        return (1, 1, 1), [{"depth": 1, "top_k": 1, "max_nodes": 1, "tau": 1.5, "tokens_per_s": 10.0,
                            "plain_tokens_per_s": 8.0, "speedup_vs_plain": 1.25}]

    monkeypatch.setattr(eagle_report, "choose_tree_by_speed", choose)
    run_training(_cfg(tiny, tmp_path / "on", max_steps=1, save_every=1, eval_tau=True, progress=True))
    run_training(_cfg(tiny, tmp_path / "off", max_steps=1, save_every=1, eval_tau=True, progress=False))
    assert seen == [True, False]


# ---- EAGLE-3 ------------------------------------------------------------------------------------------------------
def test_eagle3_training_features_are_the_ones_the_engine_passes():
    """What the layer is trained on (train/features.py, transformers' forward) is what it drafts from (the engine's
    runner): the residual streams entering the feature layers, the last one before the final norm."""
    from specdec.train.features import target_features

    from specdec.testing import build_tiny_model
    from tests.test_eagle3 import engine_features

    model = build_tiny_model(num_hidden_layers=3)
    ids = [5, 8, 13, 21, 34, 55]
    layers = (3, 1, 0)
    feats, labels = target_features(model, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), layers)
    out = engine_features(model, ids, layers)
    torch.testing.assert_close(feats[0], out.features, rtol=1e-5, atol=1e-5)
    assert labels[0].tolist() == out.logits.argmax(-1).tolist()


@pytest.mark.parametrize("arch, reduced", [("eagle1", False), ("eagle3", False), ("eagle1", True), ("eagle3", True)])
def test_the_training_passes_predict_what_the_drafter_drafts(arch, reduced):
    """A layer is trained on what its unrolled passes compute and drafts with catch-up and tree growth: both must
    see the same features, tokens and positions at every depth, else a trained head drafts another position's token
    (acceptance lost, unsaid). Along the drafter's greedy chain after a prompt, each training pass's log-probability
    of the drafted token equals the drafter's and is its argmax, for EAGLE-1 and EAGLE-3, full and reduced
    vocabulary."""
    import torch.nn.functional as F
    from specdec.drafters.eagle_catch_up import CatchUpInputs, catch_up
    from specdec.drafters.eagle_grow import GrowInputs, TreeGrower
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train.eagle_loss import unrolled_passes
    from specdec.train.features import target_features

    from specdec.sampling import SamplingConfig
    from specdec.testing import build_tiny_model

    model = build_tiny_model(num_hidden_layers=3)
    torch.manual_seed(0)
    vocab = tuple(range(0, 96, 2)) if reduced else ()
    eagle = EagleModel(EagleConfig.for_target(model.config, draft_vocab=vocab, **({"arch": "eagle3"} if arch ==
                                                                                    "eagle3" else {})))
    eagle.init_from_target(model)
    with torch.no_grad():
        for p in eagle.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eagle.eval()
    embed, lm = model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()
    prompt, depth = [5, 8, 13, 21, 34, 55, 3, 7], 3
    n = len(prompt)
    with torch.no_grad():
        feats, _ = target_features(model, torch.tensor([prompt]), torch.ones(1, n, dtype=torch.long),
                                   eagle.config.feature_layers)
        # the drafter: catch up on rows j = 0..n-2 (feature j, token j + 1, position j + 1), then a greedy chain
        rows = CatchUpInputs(feats[:, : n - 1], torch.tensor([prompt[1:]]), torch.arange(1, n)[None],
                             torch.tensor([n - 1]))
        h_root, k, v = catch_up(eagle, embed, rows, None, None, torch.zeros(1, 0, dtype=torch.bool))
        grower = TreeGrower(eagle, embed, lm, SamplingConfig(), None, 1, lm.shape[0], depth)
        pool = grower.pool(GrowInputs(h_root, k, v, torch.ones(1, n - 1, dtype=torch.bool), torch.tensor([n - 1]),
                                      torch.zeros(1, dtype=torch.long)), depth)
        drafted, drafted_logp = pool[0, 0].long().tolist(), pool[0, 3].tolist()  # draft-vocabulary ids
        ids = drafted if eagle.draft_ids is None else eagle.draft_ids[torch.tensor(drafted)].tolist()
        # the training passes over the prompt and the chain's first depth - 1 tokens
        hidden = torch.cat([feats, torch.zeros(1, depth - 1, feats.shape[-1])], 1)
        passes = list(unrolled_passes(eagle, torch.tensor([prompt + ids[: depth - 1]]), hidden, embed, depth))
        logps = [F.log_softmax(eagle.logits(out[0, n - 3 + s], lm).float(), -1) for s, out in enumerate(passes, 1)]
    for s, logp in enumerate(logps, 1):
        assert int(logp.argmax()) == drafted[s - 1], (s, int(logp.argmax()), drafted)
        assert float(logp[drafted[s - 1]]) == pytest.approx(drafted_logp[s - 1], abs=1e-4), s


def test_train_eagle_arch_eagle3_lowers_the_loss_and_exports(tiny, tmp_path):
    from specdec.drafters.export_head import export_head
    from transformers import AutoConfig

    from specdec.cli import main

    out = tmp_path / "e3"
    rc = main(["train-eagle", "--arch", "eagle3", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"),
               "--output-dir", str(out), "--seq-len", "32", "--batch-size", "4", "--max-steps", "8", "--lr", "3e-3",
               "--draft-vocab", "24", "--train-depth", "2", "--no-eval-tau", "--no-progress"])
    assert rc == 0
    hist = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert hist[-1]["loss"] < hist[0]["loss"]
    target = AutoConfig.from_pretrained(tiny / "model")
    eagle = load_eagle(out, target)
    assert eagle.config.arch == "eagle3" and len(eagle.config.draft_vocab) == 24
    assert eagle.config.feature_layers == (0, 1, 2)  # the tiny target's 2 layers: (0, L // 2, L)
    export_head(out, "speculators", tmp_path / "served")
    raw = json.loads((tmp_path / "served" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(tiny / "model")
    assert load_eagle(tmp_path / "served", target).config.draft_vocab == tuple(sorted(eagle.config.draft_vocab))


@dataclasses.dataclass
class _TreeConfig:
    depth: int = 0
    top_k: int = 0
    max_nodes: int = 0


def _finished(tmp_path, monkeypatch, held_out, history):
    """finish_eagle over hand-made accuracies (depth 1: 0.9, depth 2: 0.8 top-1), nothing timed or saved."""
    acc = {"top1": [0.9, 0.8], "top5": [0.95, 0.9], "positions": [10, 8]}
    monkeypatch.setattr(eagle_report, "scoped_eagle_accuracies", lambda *a, **k: [acc])
    monkeypatch.setattr(eagle_report, "save_eagle", lambda *a, **k: None)
    cfg = TrainConfig(model="m", output_dir=str(tmp_path), drafter="eagle", eagle_steps=2, eval_tau=False)
    times = {"start": 0.0, "data": 1.0, "train": 2.0}
    return eagle_report.finish_eagle(cfg, SimpleNamespace(model=None, name="m"), SimpleNamespace(config=_TreeConfig()),
                                     history, held_out, [[1, 2, 3]], {}, times, SimpleNamespace(device="cpu",
                                                                                                 num_processes=1))


def test_the_eagle_report_says_which_data_it_scored_and_the_last_loss(tmp_path, monkeypatch):
    """Held-out sequences given: the accuracies are "held-out"; none: "training". The final loss is the last
    record's (2.0 after 3.0), not the first's."""
    history = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    report = _finished(tmp_path, monkeypatch, [[4, 5, 6]], history)
    assert report["accuracy_data"] == "held-out" and report["final_loss"] == 2.0 and report["steps"] == 2
    assert _finished(tmp_path, monkeypatch, [], history)["accuracy_data"] == "training"


def test_an_untimed_tree_report_names_the_responses_only_accuracies_it_chose_from(tmp_path, monkeypatch):
    report = _finished(tmp_path, monkeypatch, [[4, 5, 6]], [{"step": 1, "loss": 3.0}])
    report["tree_choice"] = {**report["tree_choice"], "accuracies": "response_top1"}
    assert "chosen from the responses-only top-1 accuracies above" in eagle_report.render_markdown(report)
    report["tree_choice"]["accuracies"] = "top1"
    assert "chosen from the top-1 accuracies above" in eagle_report.render_markdown(report)


def test_accuracy_cells_read_top1_then_top5_for_all_positions_and_for_responses():
    report = {"top1": [0.5, None], "top5": [0.75, 0.25], "response_top1": [0.125, None], "response_top5": [0.375, 0.0]}
    assert accuracy_cells(report) == ["0.500 | 0.750 | 0.125 | 0.375", "n/a | 0.250 | n/a | 0.000"]
    assert accuracy_cells({"top1": [0.5], "top5": [0.75]}) == ["0.500 | 0.750 | - | -"]


def test_run_seconds_splits_the_clock_readings_into_data_training_and_evaluation():
    # start 10, data read at 12, trained at 20, ended at 25: data 2, training 8, evaluation 5, total 15
    assert run_seconds({"start": 10.0, "data": 12.0, "train": 20.0}, 25.0) == {
        "data": 2.0, "train": 8.0, "eval": 5.0, "total": 15.0, "resumed_from_step": None}
