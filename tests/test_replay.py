"""specdec eval replay: a record of a plain run replays drafters offline; the acceptance suite prices each step by
its own tree (eval/pricing.py)."""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time

import pytest
import torch
from specdec.drafters.base import Drafter
from specdec.eval.acceptance import Cell
from specdec.eval.pricing import calibration_sizes, mean_step_verify_cost, predicted_speedup, size_chunks
from specdec.eval.replay import ReplayConfig, ReplayDrafter, replay, tempered_probs
from specdec.eval.replay_record import RecordConfig, load_record, record_run, save_record
from specdec.eval.report import DEFINITIONS

from specdec.errors import InputError
from specdec.generate import generate
from specdec.tree import DraftTree


def _prompts(vocab: int, lengths=(5, 9, 14)) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def recorded(eval_tiny_model):
    prompts = _prompts(16)
    record = record_run(eval_tiny_model, prompts, RecordConfig(max_new_tokens=40), with_costs=False)
    record["costs"]["verify_seconds"] = {1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0, 65: 9.0}  # a fixed curve: no timing
    return prompts, record


def test_record_run_refuses_categories_that_do_not_pair_with_the_prompts(eval_tiny_model):
    """One category per prompt: a shorter list dropped the prompts past it from the record, a longer one its tail,
    both silently; now refused before any prompt is run."""
    prompts = _prompts(16, lengths=(3, 4))
    for categories in (["chat"], ["chat", "code", "math"]):
        with pytest.raises(InputError, match=f"2 prompts but {len(categories)} categories"):
            record_run(eval_tiny_model, prompts, RecordConfig(max_new_tokens=2), categories, with_costs=False)


def test_greedy_replay_reproduces_the_real_ngram_run(eval_tiny_model, recorded):
    """speculation="always" (guard off): a deterministic drafter's real steps, one generate() per prompt."""
    prompts, record = recorded
    real = [generate(eval_tiny_model, [p], max_new_tokens=40, drafter="ngram", speculation="always",
                     return_dict=True) for p in prompts]
    assert [list(r.new_tokens[0]) for r in real] == [s["new_tokens"] for s in record["sequences"]]
    out = replay(record, ReplayConfig("ngram", guard=False))
    assert out["per_sequence_tau"] == [r.stats[0].tau for r in real]
    real_tau = sum(r.stats[0].new_tokens for r in real) / sum(r.stats[0].steps for r in real)
    assert out["tau"] == pytest.approx(real_tau) and out["tau"] > 1.5  # the tiny model repeats itself
    hist = [0] * 64
    for r in real:
        for n in r.stats[0].step_lengths[:-1]:  # the last step is cut at max_new_tokens
            hist[n - 1] += 1
    assert sum(out["accepted_histogram"]) == sum(r.stats[0].steps for r in real)
    # a smaller tree budget accepts less; priced by the record's curve
    small = replay(record, ReplayConfig("ngram", max_nodes=1, guard=False))
    assert 1.0 <= small["tau"] < out["tau"] and small["mean_tree_nodes"] <= 1
    assert small["predicted_speedup"] == pytest.approx(
        small["new_tokens"] / (small["seconds"]) * 1.0)


def test_record_holds_the_targets_top_k(eval_tiny_model, recorded):
    _, record = recorded
    seq = record["sequences"][0]
    assert len(seq["topk_ids"]) == len(seq["new_tokens"]) == 40 and len(seq["topk_ids"][0]) == 16
    # greedy: the committed token is the target's argmax at its position
    assert [ids[0] for ids in seq["topk_ids"]] == seq["new_tokens"]
    assert math.fsum(math.exp(x) for x in seq["topk_logprobs"][3]) == pytest.approx(1.0, abs=1e-4)


def test_record_round_trip_and_refusals(tmp_path, recorded):
    _, record = recorded
    path = save_record(record, tmp_path / "run.json")
    back = load_record(path)
    assert back["costs"]["verify_seconds"] == record["costs"]["verify_seconds"]
    assert back["sequences"] == record["sequences"]
    data = json.loads(path.read_text())
    data["version"] = 99
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(InputError, match="version 99"):
        load_record(tmp_path / "bad.json")
    with pytest.raises(InputError, match="not a specdec.replay-record"):
        (tmp_path / "other.json").write_text("{}")
        load_record(tmp_path / "other.json")
    with pytest.raises(InputError, match="greedy record"):
        replay({**record, "temperature": 0.7}, ReplayConfig("ngram"))
    # damage that reached the replay as a KeyError / TypeError traceback, or a result of 'x-5.69' / 'xnan'
    fresh = json.loads(path.read_text())
    breaks = {"no 'prompt_ids'": lambda d: d["sequences"][0].pop("prompt_ids"),
              "no verify cost of size 1": lambda d: d["costs"]["verify_seconds"].pop("1"),
              "not a positive number": lambda d: d["costs"]["verify_seconds"].update({"1": -1.0}),
              "no sequences": lambda d: d.update(sequences=[]),
              "prefill_seconds 'fast'": lambda d: d["sequences"][0].update(prefill_seconds="fast")}
    for says, damage in breaks.items():
        data = json.loads(json.dumps(fresh))
        damage(data)
        (tmp_path / "damaged.json").write_text(json.dumps(data))
        with pytest.raises(InputError, match=says):
            load_record(tmp_path / "damaged.json")


def test_a_record_with_damaged_rows_is_refused_naming_the_position(tmp_path, recorded):
    """Top-k rows cut short or empty, ids outside the vocabulary and log-probabilities above 0 got through: a
    traceback or a wrong prediction later, naming neither the record nor the position."""
    path = save_record(recorded[1], tmp_path / "run.json")

    def cut(s):
        s["topk_logprobs"][3] = s["topk_logprobs"][3][:1]

    def empty(s):
        s["topk_ids"][1], s["topk_logprobs"][1] = [], []

    def unknown(s):
        s["new_tokens"][2] = 500

    def negative(s):
        s["topk_ids"][2][0] = -1

    def positive(s):
        s["topk_logprobs"][0][0] = 0.5

    breaks = {r"sequences\[1\].topk_ids\[3\] holds \d+ tokens, topk_logprobs\[3\] 1\)": cut,
              r"sequences\[1\].topk_ids\[1\] is empty": empty,
              r"sequences\[1\].new_tokens\[2\]: token 500 is outside the vocabulary of 16": unknown,
              r"sequences\[1\].topk_ids\[2\]: token -1 is outside": negative,
              r"sequences\[1\].topk_logprobs\[0\]: 0.5 is not a log-probability": positive}
    for says, damage in breaks.items():
        data = json.loads(path.read_text())
        damage(data["sequences"][1])
        damaged = tmp_path / "damaged.json"
        damaged.write_text(json.dumps(data))
        with pytest.raises(InputError, match=f"^replay record {re.escape(str(damaged))}: malformed \\({says}"):
            load_record(damaged)


def test_a_verify_cost_of_zero_seconds_is_refused(tmp_path):
    """Zero seconds for a verify step would price a free step (a division by it gives an infinite speedup)."""
    record = _synthetic_record(2, [0.1, 0.4, 0.3, 0.2])
    record["costs"]["verify_seconds"] = {1: 1.0, 2: 0.0}
    path = save_record(record, tmp_path / "zero.json")
    with pytest.raises(InputError, match="not a positive number of seconds"):
        load_record(path)


def test_a_cost_past_the_largest_size_extrapolates_the_last_slope():
    """Sizes 1, 2, 4 at 1.0, 2.0, 3.0 s: the last slope is (3 - 2) / (4 - 2) = 0.5 s a token, so c(6) = 3 + 2 * 0.5
    = 4.0 (the slope from the first size, 2/3, gave 4.33)."""
    from specdec.eval.replay_record import verify_cost_at

    assert verify_cost_at({1: 1.0, 2: 2.0, 4: 3.0}, 6) == pytest.approx(4.0)


def test_a_record_times_its_decode_steps_without_the_prefill(monkeypatch):
    """Two prompts, each call 2.5 s of which 0.5 s prefill and 4 steps: (2 x 2.0 s) / 8 steps = 0.5 s a step
    (with the prefill left in, 0.625)."""
    from types import SimpleNamespace

    import specdec.eval.replay_record as replay_record

    from specdec.output import SequenceStats

    clock = [0.0]

    def fake_generate(loaded, prompts, max_new_tokens, return_dict=False, **kwargs):
        clock[0] += 2.5  # every call takes 2.5 s of the fake clock
        stats = SequenceStats(len(prompts[0]), 4, 4, 1.0, 2.5, 1.6, "length", ())
        return SimpleNamespace(stats=[stats], prefill_seconds=0.5, new_tokens=[[1, 2, 3, 4]])

    monkeypatch.setattr(sys.modules["specdec.generate"], "generate", fake_generate)  # record_run imports it
    monkeypatch.setattr(replay_record, "time", SimpleNamespace(perf_counter=lambda: clock[0], strftime=time.strftime))
    monkeypatch.setattr(replay_record, "teacher_forced_topk", lambda *args: ([[1]] * 4, [[0.0]] * 4))
    monkeypatch.setattr(replay_record, "model_identity",
                        lambda loaded: {"model_source": "synthetic", "model_fingerprint": "f"})
    runner = SimpleNamespace(dtype=torch.float32, device="cpu", shape=SimpleNamespace(vocab_size=16))
    loaded = SimpleNamespace(runner=runner, name="synthetic")
    record = record_run(loaded, [[5, 6], [7, 8, 9]], RecordConfig(max_new_tokens=4), with_costs=False)
    assert record["costs"]["decode_step_seconds"] == pytest.approx(0.5)


def test_measured_costs_are_timed_at_the_median_prompt_halfway_through_its_answer(monkeypatch):
    """Prompts of 2, 9 and 5 tokens: the median is the 5-token one, and max_new_tokens 10 adds half, 5: a context of
    10 tokens (the shortest prompt gave 7)."""
    from types import SimpleNamespace

    from specdec.eval.replay_record import measure_costs

    import specdec.cuda_graphs
    import specdec.verify_cost

    timed = []

    def fake_measure(runner, batch, sizes, *args, **kwargs):
        timed.append(len(batch[0]))
        return {n: 0.01 * n for n in sizes}

    monkeypatch.setattr(specdec.verify_cost, "measure_verify_costs", fake_measure)
    monkeypatch.setattr(specdec.cuda_graphs, "auto_uses_graphs", lambda runner: False)
    loaded = SimpleNamespace(runner=SimpleNamespace(shape=SimpleNamespace(max_positions=4096)))
    costs = measure_costs(loaded, [[1] * 2, [1] * 9, [1] * 5], RecordConfig(max_new_tokens=10, cost_source="measure"))
    assert costs["context_tokens"] == 10 and set(timed) == {5}


def test_measured_costs_past_the_context_are_refused_before_recording(monkeypatch):
    """cost_source "measure" times every size of the grid on one growing context: on a model whose context cannot
    hold it, every prompt was recorded first, then measure_verify_costs refused in a message naming no option."""
    import specdec.eval.replay_record as replay_record

    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    monkeypatch.setattr(replay_record, "teacher_forced_topk", lambda *a, **k: pytest.fail("recorded"))
    for context, repeats, room in ((200, 3, "lower --cost-repeats to 1, or take"), (120, 1, "take")):
        loaded = load_model(build_tiny_model(vocab_size=16, max_position_embeddings=context))
        config = RecordConfig(max_new_tokens=4, cost_source="measure", cost_repeats=repeats)
        with pytest.raises(InputError, match=rf"^--costs measure needs {(repeats + 1) * 78 + 3} tokens of context "
                                             rf"to time its verify steps \({repeats + 1} rounds of 78 query tokens on "
                                             rf"one context\), more than the model's context of {context} tokens; "
                                             rf"{room} the cost model's curve \(--costs cost-model\)$"):
            record_run(loaded, [[5, 6]], config)


class _HiddenDrafter(Drafter):
    name = "needs-hidden"
    needs_hidden_states = True

    def propose(self, seqs):
        return [DraftTree.empty() for _ in seqs]


class _ModelDrafter(Drafter):
    name = "reads-model"

    def attach(self, target) -> None:
        self.layers = target.runner.shape.num_layers  # a record has no model

    def propose(self, seqs):
        return [DraftTree.empty() for _ in seqs]


@pytest.mark.parametrize("drafter", [_HiddenDrafter(), _ModelDrafter()])
def test_drafters_that_need_the_target_are_refused_by_name(recorded, drafter):
    with pytest.raises(InputError, match=f"drafter '{drafter.name}'.*only token ids") as err:
        replay(recorded[1], ReplayConfig(drafter, guard=False))
    assert "SimpleNamespace" not in str(err.value)  # the stand-in's own error ('... has no attribute') was quoted


@pytest.mark.parametrize("name", ["draft-model", "self-draft", "medusa", "eagle"])
def test_builtin_drafters_that_need_the_target_are_refused_before_asking_for_options(recorded, name):
    """`replay run --drafter draft-model` asked for model= (and self-draft built itself), only for the replay to
    refuse the drafter once given: what a replay cannot run is said first, whatever the options."""
    with pytest.raises(InputError, match=f"drafter '{name}' reads the target's .*only token ids"):
        replay(recorded[1], ReplayConfig(name, guard=False))


class _Constant(Drafter):
    """Always proposes one node: ``token``."""

    name = "constant"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, seqs):
        return [DraftTree.chain([self.token]) for _ in seqs]


def _synthetic_record(m: int, probs: list[float]) -> dict:
    """Every recorded token is 1; the target's distribution at every position is ``probs`` (vocabulary 4)."""
    ids = sorted(range(4), key=lambda i: -probs[i])
    row = [math.log(probs[i]) for i in ids]
    seq = {"category": "custom", "prompt_ids": [0], "new_tokens": [1] * m, "finish_reason": "length",
           "topk_ids": [ids] * m, "topk_logprobs": [row] * m}
    return {"schema": "specdec.replay-record", "version": 1, "model": "synthetic", "vocab_size": 4,
            "max_new_tokens": m, "temperature": 1.0, "costs": {"verify_seconds": {1: 1.0, 2: 1.0}},
            "sequences": [seq], "device": "cpu", "threads": 1}


@pytest.mark.parametrize("token, expected", [(1, 1.5), (2, 1.3), (3, 1.0)])
def test_sampled_replay_takes_the_targets_probability_of_each_candidate(token, expected):
    """A one-node draft of token x is accepted with target_probs[x]: tau -> 1 + p(x) (renewal, long text); a
    candidate off the recorded text counts its depth and stops there, one on it goes on."""
    probs = [1e-30, 0.5, 0.3, 0.2] if token != 3 else [1e-30, 0.5, 0.5, 1e-30]  # 3: (almost) never the target's
    out = replay(_synthetic_record(600, probs), ReplayConfig(_Constant(token), temperature=1.0, guard=False))
    assert out["tau"] == pytest.approx(expected, rel=2e-3)


SURE = [1e-30, 1.0, 1e-30, 1e-30]  # the target's distribution: token 1, always


def test_greedy_replay_reports_the_mean_tree_nodes_per_step():
    """A one-node draft of 1, always right, over 40 tokens of 1: 20 steps of 2 tokens, 1 node each: 20 / 20 = 1.0
    (not 20 nodes / 40 tokens)."""
    record = {**_synthetic_record(40, SURE), "temperature": 0.0}
    out = replay(record, ReplayConfig(_Constant(1), guard=False))
    assert out["steps"] == 20 and out["mean_tree_nodes"] == pytest.approx(1.0)


def test_sampled_replay_prices_each_step_at_its_tree_size():
    """40 tokens of 1, a one-node draft of 1 always accepted: 20 steps, each verifying 1 + 1 tokens at c(2) = 2 s:
    40 tokens in 40 s where plain takes c(1) = 1 s a token: 1.0x (pricing steps at c(1) said 2.0x)."""
    record = _synthetic_record(40, SURE)
    record["costs"]["verify_seconds"] = {1: 1.0, 2: 2.0}
    out = replay(record, ReplayConfig(_Constant(1), temperature=1.0, guard=False))
    assert out["steps"] == pytest.approx(20.0)
    assert out["predicted_speedup"] == pytest.approx(1.0, rel=1e-3)  # the draft's microseconds beside 40 s


def test_tempered_probs_of_a_full_vocabulary_are_the_softmax_at_that_temperature():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    logprobs = torch.log_softmax(logits, -1).tolist()
    for t in (0.5, 1.0, 2.0):
        got = tempered_probs([0, 1, 2, 3], logprobs, t)
        want = torch.softmax(logits / t, -1).tolist()
        assert [got[i] for i in range(4)] == pytest.approx(want, rel=1e-9)
    # a truncated row: the tail keeps its mass at T = 1
    assert sum(tempered_probs([0, 1], logprobs[:2], 1.0).values()) == pytest.approx(math.exp(logprobs[0])
                                                                                      + math.exp(logprobs[1]))


class _Slow(_Constant):
    """Costs 2 ms a proposal: two decode steps of the curve below."""

    def propose(self, seqs):
        time.sleep(0.002)
        return super().propose(seqs)


def test_the_guard_prunes_and_then_stops_asking_a_drafter_that_never_pays(recorded):
    _, record = recorded
    record = {**record, "costs": {"verify_seconds": {1: 1e-3, 2: 1.1e-3, 65: 5e-3}}}
    wrong = record["sequences"][0]["new_tokens"][0] ^ 1  # rarely the next token
    off = replay(record, ReplayConfig(_Constant(wrong), guard=False))
    assert off["draft_calls"] == off["steps"] and off["mean_tree_nodes"] > 0.9  # last steps: budget cut
    cheap = replay(record, ReplayConfig(_Constant(wrong), guard=True))  # its nodes pruned
    assert cheap["mean_tree_nodes"] < 0.5
    slow = replay(record, ReplayConfig(_Slow(wrong), guard=True))  # not worth asking: skipped
    assert slow["draft_calls"] < slow["steps"] / 2


def test_sampled_replay_counts_only_the_draft_calls_the_guard_made():
    """A slow drafter of 3, never the target's token: every step commits one token (300 steps), so the expected
    draft calls are the positions it was asked at; the guard stops asking it, so they are fewer than the steps."""
    record = _synthetic_record(300, SURE)
    record["costs"]["verify_seconds"] = {1: 1e-3, 2: 1.1e-3, 65: 5e-3}
    config = ReplayConfig(_Slow(3), temperature=1.0, guard=True)
    drafter = ReplayDrafter(config, record)
    out = replay(record, config, drafter)
    assert out["steps"] == pytest.approx(300.0) and drafter.calls < 150
    assert out["draft_calls"] == pytest.approx(drafter.calls)


def _cell(histogram: list[int], curve: dict[int, float]) -> Cell:
    cell = Cell("ngram", "summarisation", prompts=1, new_tokens=20, steps=10, forward_passes=10,
                draft_seconds=0.0, step_nodes_histogram=histogram)
    mean = sum(n * c for n, c in enumerate(histogram)) / sum(histogram)
    n_mean = max(1, round(1 + mean))
    common = {"plain_seconds": curve[1], "batch": 1, "context_tokens": 10.0, "repeats": 1}
    cell.calibration = [{"query_tokens": n_mean, "verify_seconds": curve[n_mean], **common}]
    cell.size_calibration = [{"query_tokens": n, "verify_seconds": s, **common} for n, s in curve.items()]
    return cell


def test_each_step_is_priced_by_its_own_tree():
    """Half the steps verify no node, half 10: priced per step (1 + 3) / 2 = 2 decode steps, not c(6) = 1.2."""
    cell = _cell([5] + [0] * 9 + [5], {1: 1.0, 6: 1.2, 11: 3.0})
    out = predicted_speedup(cell)
    assert out["priced_per_step"] and out["cost_verify_s"] == pytest.approx(2.0)
    assert out["predicted_speedup"] == pytest.approx(2.0 * 1.0 / 2.0)  # tau 2
    assert out["predicted_speedup_mean_size"] == pytest.approx(2.0 / 1.2)
    # a cell calibrated without per-step sizes keeps the mean-size price
    cell.size_calibration = []
    assert predicted_speedup(cell)["predicted_speedup"] == pytest.approx(2.0 / 1.2)
    # the report's definition of its "predicted" column says so; it described the mean-size price
    definition = DEFINITIONS.split("- **predicted**: ")[1].split("\n- ")[0]
    assert "mean over the cell's steps of c_verify(1 + the step's tree nodes)" in definition
    assert "`predicted_speedup_mean_size` prices every step at 1 + the mean tree size" in definition


def test_calibration_sizes_and_chunks():
    assert calibration_sizes([3, 0, 2, 0, 1], 1.4) == [1, 2, 3, 5]
    many = calibration_sizes([1] * 40, 20.0)
    assert len(many) == 16 and 1 in many and 21 in many
    assert size_chunks([1, 2, 40, 41, 65]) == [[1, 2, 40], [41], [65]]


def _batched_cell(draft_seconds: float, histogram: list[int], size_calibration: list[dict]) -> Cell:
    """Two sequences a forward: 20 sequence steps in 10 forwards, 40 tokens (tau 2); c(1) = 1 s, c(2) = 1.5 s."""
    cell = Cell("ngram", "summarisation", prompts=2, new_tokens=40, steps=20, forward_passes=10,
                draft_seconds=draft_seconds, step_nodes_histogram=histogram)
    cell.calibration = [{"query_tokens": 2, "plain_seconds": 1.0, "verify_seconds": 1.5}]
    cell.size_calibration = size_calibration
    return cell


def test_draft_time_is_priced_per_forward_pass_not_per_sequence_step():
    """5 s of drafting over 10 forwards: 0.5 s a forward (not 5 / 20 steps = 0.25); 2 x 1 / (0.5 + 1.5) = 1.0."""
    out = predicted_speedup(_batched_cell(5.0, [0, 20], []))
    assert out["cost_draft_s"] == pytest.approx(0.5)
    assert out["predicted_speedup"] == pytest.approx(1.0)


def test_a_size_timed_by_several_processes_costs_their_median():
    """c(2) timed at 1, 2 and 9 s by three processes: 2 s (not the fastest, 1 s); 2 x 1 / (0 + 2) = 1.0."""
    timed = [{"query_tokens": 2, "verify_seconds": s} for s in (1.0, 2.0, 9.0)]
    out = predicted_speedup(_batched_cell(0.0, [0, 20], timed))
    assert out["priced_per_step"] and out["cost_verify_s"] == pytest.approx(2.0)
    assert out["predicted_speedup"] == pytest.approx(1.0)


def test_the_mean_size_calibration_of_several_processes_is_their_median():
    """Three processes calibrated the mean tree size at 2, 3 and 10 query tokens (each its own steps' mean), plain
    steps of 1, 2 and 7 s, verifies of 1.5, 3 and 12 s: each figure is the processes' median (3 tokens, 2 s, 3 s),
    not their mean or the slowest; tau 2 / (0 + 3) x 2 prices the mean size at 4 / 3."""
    cell = _batched_cell(0.0, [0, 20], [])
    cell.calibration = [{"query_tokens": q, "plain_seconds": p, "verify_seconds": v}
                        for q, p, v in ((10, 7.0, 12.0), (2, 1.0, 1.5), (3, 2.0, 3.0))]
    out = predicted_speedup(cell)
    assert (out["verify_query_tokens"], out["cost_plain_s"], out["cost_verify_mean_size_s"]) == (3, 2.0, 3.0)
    assert out["predicted_speedup_mean_size"] == pytest.approx(4 / 3) and not out["priced_per_step"]


def test_a_step_size_not_timed_is_priced_between_its_timed_neighbours():
    """3 nodes verify 4 tokens, timed at 3 (3 s) and 9 (6 s): 3 + (6 - 3) x (4 - 3) / (9 - 3) = 3.5 s."""
    assert mean_step_verify_cost([0, 0, 0, 2], {1: 1.0, 3: 3.0, 9: 6.0}) == pytest.approx(3.5)


def test_a_step_size_past_the_timed_ones_costs_the_nearest_timed_size():
    """11 nodes verify 12 tokens, past the largest timed size 9: c(9) = 6 s; 0 nodes (1 token), below the smallest
    timed size 3: c(3) = 3 s."""
    assert mean_step_verify_cost([0] * 11 + [1], {1: 1.0, 3: 3.0, 9: 6.0}) == pytest.approx(6.0)
    assert mean_step_verify_cost([1], {3: 3.0, 9: 6.0}) == pytest.approx(3.0)


def test_a_calibration_run_may_sum_to_exactly_the_token_limit():
    """40 + 40 = 80 query tokens is at most 80: one run; the 1 starts the next."""
    assert size_chunks([40, 40, 1], max_tokens=80) == [[40, 40], [1]]


def test_suite_cells_record_step_sizes(eval_tiny_model, tmp_path):
    from specdec.eval.acceptance import SuiteConfig, run_suite, summarise

    config = SuiteConfig((("ngram", {}),), ("rep",), 2, 12, hf_baseline=False, calibration_repeats=1)
    cells = run_suite(eval_tiny_model, {"rep": _prompts(16, (6, 8))}, config, tmp_path)
    cell = cells["ngram", "rep"]
    assert sum(cell.step_nodes_histogram) == cell.steps
    assert {e["query_tokens"] for e in cell.size_calibration} >= {1 + n for n, c in
                                                                    enumerate(cell.step_nodes_histogram) if c}
    row = next(r for r in summarise(cells) if r["drafter"] == "ngram")
    assert row["priced_per_step"] and row["predicted_speedup"] > 0


def test_queued_replay_prices_held_off_steps_as_queued_and_looks_back():
    """``queued_step``: the steps the guard holds off cost a queued step (plain decoding, all queued, is the
    baseline), and n-gram held off through text it cannot copy is asked in hindsight: once the text copies its
    prompt, it drafts again within a few steps, where probes priced at breaking the queue come ~40 steps apart."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randperm(1000, generator=g)[:60].tolist()
    fresh = (torch.randperm(1000, generator=g)[:80] + 1000).tolist()  # no token of the prompt, none repeated
    seq = {"category": "custom", "prompt_ids": prompt, "new_tokens": fresh + prompt, "finish_reason": "length"}
    record = {"schema": "specdec.replay-record", "version": 1, "model": "synthetic", "vocab_size": 2000,
              "max_new_tokens": 140, "temperature": 0.0, "costs": {"verify_seconds": {1: 9.0}},
              "sequences": [seq], "device": "cpu", "threads": 1}
    curve = {1: 1.0, 65: 1.3}  # a GPU's flat verify, in seconds: a propose call's time is nothing beside it
    out = {lb: replay(record, ReplayConfig("ngram", queued_step=0.6, verify_seconds=curve, look_budget=lb))
           for lb in (0.0, None)}
    assert out[0.0]["looks"] == 0 and out[None]["looks"] > 0
    assert out[None]["steps"] < out[0.0]["steps"] - 15  # the copy drafted from early on
    assert out[None]["predicted_speedup"] > out[0.0]["predicted_speedup"] * 1.1
    assert out[None]["predicted_speedup_overall"] is None  # the record's prefill is another machine's
    plain = replay(record, ReplayConfig("ngram", queued_step=0.6, verify_seconds={1: 1.0, 65: 99.0}))
    # nothing pays: every step plain, each stretch's first and the probes read back, the rest queued
    assert plain["tau"] == 1.0 and 0.85 < plain["predicted_speedup"] < 1.0
    with pytest.raises(InputError, match="greedily with the guard"):
        ReplayConfig("ngram", queued_step=0.6, guard=False)
    with pytest.raises(InputError, match="c\\(1\\)"):
        ReplayConfig("ngram", verify_seconds={2: 1.0})


def test_a_look_budget_without_queued_steps_is_refused():
    """It was accepted and did nothing: looks are taken on queued steps only (and with the guard on)."""
    for guard in (True, False):
        with pytest.raises(InputError, match="^look_budget is spent on queued steps only: give it with queued_step"):
            ReplayConfig("ngram", guard=guard, look_budget=0.5)
    assert ReplayConfig("ngram", queued_step=0.6, look_budget=0.5).look_budget == 0.5


def test_verify_costs_come_from_a_curve_file_or_a_gpu_speed_reports_model(tmp_path):
    """``--verify-costs``: n -> milliseconds, as given, under "ms", or a speed report's model (``FILE:MODEL``); one
    line naming the models a report has, or what a file lacks."""
    from specdec.eval.replay_cli import _verify_costs

    curve = {"1": 2.0, "65": 3.0}
    (tmp_path / "flat.json").write_text(json.dumps(curve))
    (tmp_path / "ms.json").write_text(json.dumps({"ms": curve}))
    report = {"models": [{"model": "other", "verify_cost": None}, {"model": "default", "verify_cost": {"ms": curve}}]}
    (tmp_path / "speed.json").write_text(json.dumps(report))
    want = {1: 0.002, 65: 0.003}
    for spec in ("flat.json", "ms.json", "speed.json:default"):
        assert _verify_costs(str(tmp_path / spec)) == pytest.approx(want)
    with pytest.raises(InputError, match=r"no model .nope. .*\(it has: other, default\)"):
        _verify_costs(str(tmp_path / "speed.json:nope"))
    with pytest.raises(InputError, match="needs c\\(1\\)"):
        _verify_costs(str(tmp_path / "speed.json:other"))
    # a curve file named with a model was said to hold none ("no model 'default' in flat.json (it has: none)")
    with pytest.raises(InputError, match=r"flat\.json is no GPU speed report \(it has no \"models\"\); give a curve "
                                         r"file without :MODEL$"):
        _verify_costs(str(tmp_path / "flat.json:default"))
    with pytest.raises(InputError, match="not a JSON object"):
        _verify_costs(str(tmp_path / "missing.json"))
    # the docs' "a JSON object" given on the command line: it was split at its last ':' as FILE:MODEL
    assert _verify_costs(' {"1": 2.0, "65": 3.0}') == pytest.approx(want)
    assert _verify_costs(json.dumps({"ms": curve})) == pytest.approx(want)
    # a curve file whose own name holds a ':' is that file, not FILE:MODEL split at the ':'
    (tmp_path / "gpu:a100.json").write_text(json.dumps(curve))
    assert _verify_costs(str(tmp_path / "gpu:a100.json")) == pytest.approx(want)


def test_replay_run_names_its_flags_and_their_units_in_refusals(tmp_path, recorded, capsys):
    """--queued-step -1 was refused as "queued_step must be a positive number of seconds, got -0.001", and
    --look-budget alone named the Python field queued_step."""
    from specdec.cli import main

    path = save_record(recorded[1], tmp_path / "run.json")
    for extra, says in ((["--queued-step", "-1"], "--queued-step takes the plain step's milliseconds (> 0), got -1.0"),
                        (["--look-budget", "0.5"], "--look-budget is spent on queued steps only: give it with "
                                                   "--queued-step"),
                        # these named the Python fields max_nodes, look_budget, verify_seconds and queued steps
                        (["--max-nodes", "4,999"], "--max-nodes 4,999: 999 is not a tree size in 0..64"),
                        (["--queued-step", "1", "--look-budget", "-1"],
                         "--look-budget takes a share of a step (>= 0; 0: no looks), got -1.0"),
                        (["--queued-step", "1", "--guard", "off"], "--queued-step replays greedily with the guard on "
                         "(the steps it holds off are the ones queued): drop --temperature or --guard off"),
                        (["--verify-costs", '{"1": 1, "4": -2}'],
                         '--verify-costs {"1": 1, "4": -2}: c(4) = -2 ms is not a positive number of milliseconds'),
                        (["--verify-costs", '{"0": 1, "1": 2}'],
                         '--verify-costs {"0": 1, "1": 2}: c(0): a verify queries 1 token or more')):
        assert main(["eval", "replay", "run", "--record", str(path), *extra]) == 2
        assert capsys.readouterr().err.strip().endswith(says)


def test_a_tree_size_given_twice_is_replayed_once(tmp_path, recorded, capsys):
    """--max-nodes 4,4 printed two rows of one replay that differed only by the draft's timing noise."""
    from specdec.cli import main

    path = save_record(recorded[1], tmp_path / "run.json")
    assert main(["eval", "replay", "run", "--record", str(path), "--max-nodes", "4,8,4", "--json"]) == 0
    assert [r["max_nodes"] for r in json.loads(capsys.readouterr().out)["results"]] == [4, 8]


def test_the_table_shows_the_drafters_options_beside_the_cut(tmp_path, recorded, capsys):
    """--drafter-option max_nodes=3 --max-nodes 5 showed 5 under a max_nodes column and no word of the 3 the drafter
    stopped at; a combined drafter's children's options were not shown at all."""
    from specdec.cli import main

    path = save_record(recorded[1], tmp_path / "run.json")
    assert main(["eval", "replay", "run", "--record", str(path), "--drafter-option", "max_nodes=3",
                 "--max-nodes", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "drafter options: max_nodes=3" and lines[2].split()[:2] == ["drafter", "cut"]
    assert "note: cut is --max-nodes, the first N nodes of each tree the drafter proposed (its own options cap it " \
           "first)" in lines
    assert main(["eval", "replay", "run", "--record", str(path), "--drafter", "combined", "--drafter-option",
                 'drafters=[{"name": "ngram", "max_nodes": 3}]']) == 0
    assert capsys.readouterr().out.splitlines()[1] == 'drafter options: drafters=[{"name": "ngram", "max_nodes": 3}]'


def test_an_earlier_record_is_replaced_only_with_overwrite_and_a_folder_never(tmp_path, recorded):
    """--out naming an earlier record: refused without --overwrite (a record, not only other data, is kept unasked);
    --out naming a folder: refused with --overwrite too, as a folder, before the recording."""
    from specdec.eval.replay_record import check_record_path

    path = save_record(recorded[1], tmp_path / "run.json")
    with pytest.raises(InputError, match="exists; pass --overwrite to replace it"):
        check_record_path(path, overwrite=False)
    check_record_path(path, overwrite=True)  # an earlier record: --overwrite replaces it
    folder = tmp_path / "runs"
    folder.mkdir()
    for overwrite in (False, True):
        with pytest.raises(InputError, match=f"^--out {folder} is a directory; name the record file to write$"):
            check_record_path(folder, overwrite=overwrite)


@pytest.mark.skipif(sys.platform == "win32", reason="the sticky bit is POSIX's")
def test_another_users_record_in_a_sticky_folder_is_refused_before_the_recording(tmp_path, recorded, monkeypatch,
                                                                                 another_users_sticky):
    """--out naming another user's record in a folder with the sticky bit (as /tmp): --overwrite recorded the whole
    run, then its rename over their file stopped with "Operation not permitted". It is refused before the recording;
    this user's own record there is replaced as before."""
    from specdec.eval.replay_record import check_record_path

    folder = tmp_path / "shared"
    folder.mkdir()
    path = save_record(recorded[1], folder / "run.json")
    owner = another_users_sticky(folder)  # this user owns neither the folder nor the record
    with pytest.raises(InputError, match=f"^--out {path}: --overwrite cannot replace it: {folder} has the sticky bit"):
        check_record_path(path, overwrite=True)
    check_record_path(folder / "mine.json", overwrite=True)  # a new file there: written as before
    monkeypatch.setattr(os, "geteuid", lambda: owner)
    check_record_path(path, overwrite=True)


def test_calibration_keeps_the_most_frequent_step_sizes():
    """20 tree sizes, n nodes verified by n + 1 steps (n = 0..19): past the 16-size limit the 15 beside plain's 1
    are the most frequent, 19 down to 5 nodes, query sizes 20 down to 6 (the mean, 0 nodes, is plain's 1)."""
    assert calibration_sizes([n + 1 for n in range(20)], 0.0) == [1, *range(6, 21)]


def test_a_cell_whose_steps_cost_nothing_has_no_prediction():
    """No drafting and a verify timed at 0 s: the speedup's denominator, 0 + 0, prices nothing, so no prediction
    (not a division by zero)."""
    cell = _batched_cell(0.0, [0, 20], [])
    cell.calibration = [{"query_tokens": 2, "plain_seconds": 1.0, "verify_seconds": 0.0}]
    assert predicted_speedup(cell) is None
