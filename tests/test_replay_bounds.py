"""specdec eval replay bound: perfect-foresight bounds over a greedy record (eval/replay_bounds.py)."""
from __future__ import annotations

import json
import time

import pytest
import torch
from specdec.drafters.ngram import NGramDrafter
from specdec.eval.replay import ReplayConfig, ReplayDrafter, replay, replay_sequence
from specdec.eval.replay_bounds import replay_bounds
from specdec.eval.replay_record import RecordConfig, record_run, save_record

from specdec.cli import main
from specdec.errors import InputError

CURVE = {1: 1.0, 2: 1.0, 4: 1.5, 65: 10.0}  # c(3) = 1.25 by interpolation


def _record(prompt: list[int], new: list[int], prefill: float | None = None, budget: int = 64) -> dict:
    seq = {"category": "custom", "prompt_ids": prompt, "new_tokens": new, "finish_reason": "length",
           "topk_ids": [[t] for t in new], "topk_logprobs": [[0.0] for _ in new]}
    if prefill is not None:
        seq["prefill_seconds"] = prefill
    return {"schema": "specdec.replay-record", "version": 1, "model": "synthetic", "vocab_size": 16,
            "max_new_tokens": budget, "temperature": 0.0, "costs": {"verify_seconds": dict(CURVE)},
            "sequences": [seq], "device": "cpu", "threads": 1}


def test_copy_bound_takes_the_longest_continuation_of_an_earlier_occurrence():
    """9 never occurred: one token; then 1 occurred twice, followed by 2 3 4 7 ... and by 2 9: the first copies 3."""
    out = replay_bounds(_record([5, 1, 2, 3, 4, 7, 1, 2, 9], [1, 2, 3, 4, 8], prefill=5.0), ReplayConfig("ngram"))
    copy = out["copy"]
    assert copy["steps"] == 2 and copy["seconds"] == pytest.approx(1.0 + 1.5)  # c(1), then c(1 + 3)
    assert copy["tau"] == pytest.approx(2.5) and copy["decode_speedup"] == pytest.approx(5 * 1.0 / 2.5)
    assert copy["overall_speedup"] == pytest.approx((5.0 + 5 * 1.0) / (5.0 + 2.5))  # prefill counted once
    assert out["prefill_share"] == pytest.approx(0.5)


def test_copy_bound_copies_from_the_generated_text_and_past_its_end():
    """[3] 1 2 1 2 1 2 1 2: nothing to copy for three steps; then the generated 1 is followed by "2 1", which read on
    past the end by copying itself ("2 1 2 1 ...") gives the 4 drafted tokens before the last (bonus) one."""
    copy = replay_bounds(_record([3], [1, 2, 1, 2, 1, 2, 1, 2]), ReplayConfig("ngram"))["copy"]
    assert copy["steps"] == 4 and copy["seconds"] == pytest.approx(3 * 1.0 + (1.5 + 8.5 / 61))  # c(5)
    assert copy["overall_speedup"] is None  # no prefill time in this record


def test_copy_bound_chooses_the_cheapest_steps_not_the_longest_copies():
    """Copying "2 3" (then 5 as the bonus) leaves a 3-token copy; copying only "2" (c(2) = c(1)) lands on the 3 whose
    earlier occurrence is followed by 5 6 7 8: 1.0 + c(5) beats the longest copies' c(3) + c(4) = 2.75."""
    prompt = [9, 1, 2, 3, 4, 12, 3, 5, 6, 7, 8, 13, 1]
    copy = replay_bounds(_record(prompt, [2, 3, 5, 6, 7, 8, 14]), ReplayConfig("ngram"))["copy"]
    assert copy["steps"] == 2 and copy["seconds"] == pytest.approx(1.0 + (1.5 + 8.5 / 61))


def test_copy_bound_respects_the_token_budget():
    """A 3-token budget: the first step may draft at most 2 nodes (the bonus token is the third)."""
    copy = replay_bounds(_record([1, 2, 3, 4, 5, 1], [2, 3, 4], budget=3), ReplayConfig("ngram"))["copy"]
    assert copy["steps"] == 1 and copy["seconds"] == pytest.approx(1.25)


def test_copy_bound_holds_on_a_curve_that_is_cheaper_at_a_larger_size():
    """Measured curves are not monotone: with c(3) > c(4), n-gram's step verifying "2 3 4" (3 nodes, "2 3" accepted)
    cost c(4), below the c(3) the bound priced its best step at: the drafter beat its own bound."""
    record = _record([7, 1, 2, 3, 4, 9, 1], [2, 3, 5], budget=4)
    record["costs"]["verify_seconds"] = {1: 1.0, 2: 1.05, 3: 1.10, 4: 1.08, 5: 1.12, 65: 5.0}
    copy = replay_bounds(record, ReplayConfig("ngram"))["copy"]
    ngram = replay(record, ReplayConfig("ngram", guard=False))
    assert ngram["seconds"] - ngram["cost_draft_s"] * ngram["draft_calls"] == pytest.approx(1.08)
    assert copy["steps"] == 1 and copy["seconds"] == pytest.approx(1.08)


def test_copy_bound_prices_a_step_at_a_cheaper_larger_size_up_to_the_largest_measured():
    """Four sizes measured, the largest 8, and c(8) = 1.15 below c(3) = 1.2: the one step accepting "2 3" (bonus 5)
    may verify up to 8 tokens, so it costs 1.15 (cut at the 4th size, it cost c(4) = 1.2 - 0.05 / 5 = 1.19)."""
    record = _record([7, 1, 2, 3, 4, 9, 1], [2, 3, 5])
    record["costs"]["verify_seconds"] = {1: 1.0, 2: 1.1, 3: 1.2, 8: 1.15}
    copy = replay_bounds(record, ReplayConfig("ngram"))["copy"]
    assert copy["steps"] == 1 and copy["seconds"] == pytest.approx(1.15)


def test_oracle_prices_each_step_by_its_accepted_path_only():
    """Same text as above: n-gram drafts nothing after 9, then a tree holding both continuations of 1 ("2 9", "2 3 4
    7 1 ..."), of which "2 3 4" is accepted: the oracle pays c(1) + c(1 + 3), verifying whole trees pays more."""
    record = _record([5, 1, 2, 3, 4, 7, 1, 2, 9], [1, 2, 3, 4, 8])
    oracle = replay_bounds(record, ReplayConfig("ngram"))["oracle"]
    assert oracle["steps"] == 2
    assert oracle["seconds"] - 2 * oracle["cost_draft_s"] == pytest.approx(1.0 + 1.5)
    whole = replay(record, ReplayConfig("ngram", guard=False))
    assert whole["steps"] == 2 and whole["seconds"] - whole["cost_draft_s"] * whole["draft_calls"] > 2.5 + 1e-6


def test_oracle_prices_a_step_that_ends_the_text_by_the_tokens_it_commits():
    """The text ends (eos) after "2 3 4 5 9", all of which n-gram copies from the prompt in one step: 5 tokens
    committed, the last as the bonus, so 1 + 4 verified: c(5) = 1.5 + 8.5 / 61 (not c(6) for a sixth token)."""
    record = _record([1, 2, 3, 4, 5, 9, 1], [2, 3, 4, 5, 9])
    record["sequences"][0]["finish_reason"] = "stop"
    oracle = replay_bounds(record, ReplayConfig("ngram"))["oracle"]
    assert oracle["steps"] == 1
    assert oracle["seconds"] - oracle["cost_draft_s"] == pytest.approx(1.5 + 8.5 / 61)


def test_oracle_walk_refuses_a_guarded_config():
    record = _record([1, 2, 1], [2, 1])
    drafter = ReplayDrafter(ReplayConfig("ngram", guard=False), record)
    with pytest.raises(ValueError, match="unguarded"):
        replay_sequence(drafter, 0, record["sequences"][0], record, ReplayConfig("ngram"), CURVE, oracle=True)


@pytest.fixture(scope="module")
def tiny_record(eval_tiny_model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (6, 11)]
    record = record_run(eval_tiny_model, prompts, RecordConfig(max_new_tokens=40), with_costs=False)
    record["costs"]["verify_seconds"] = {1: 1.0, 2: 1.05, 4: 1.2, 8: 1.6, 65: 9.0}
    return record


def test_the_bounds_order_on_a_real_record(tiny_record):
    """The oracle accepts what verifying whole trees accepts, paying only for the accepted path; every n-gram path is
    a copy, so the copy bound commits at least as much per step; the prefill was recorded."""
    out = replay_bounds(tiny_record, ReplayConfig("ngram"))
    whole = replay(tiny_record, ReplayConfig("ngram", guard=False))
    assert out["oracle"]["tau"] == pytest.approx(whole["tau"]) and whole["tau"] > 1.5
    assert out["oracle"]["seconds"] < whole["seconds"]
    assert out["copy"]["tau"] >= out["oracle"]["tau"]
    assert out["copy"]["decode_speedup"] >= out["replay"]["decode_speedup"]
    assert all(s["prefill_seconds"] > 0 for s in tiny_record["sequences"])
    for name in ("copy", "oracle", "replay"):
        r = out[name]
        assert 1.0 <= r["overall_speedup"] < r["decode_speedup"]  # prefill dilutes every speedup > 1


class _StallingNGram(NGramDrafter):
    """n-gram whose one propose call stalls, as on a loaded machine."""

    def __init__(self, stall_at: int) -> None:
        super().__init__()
        self.calls, self.stall_at = 0, stall_at

    def propose(self, seqs):
        self.calls += 1
        if self.calls == self.stall_at:
            time.sleep(0.02)
        return super().propose(seqs)


def test_the_oracle_and_the_replay_price_a_draft_alike(tiny_record):
    """Each row priced the draft at the mean of its own ~9 calls: a stall among the oracle's put the bound below the
    run it bounds, one among the replay's put the run further below it."""
    record = {**tiny_record, "costs": {"verify_seconds": {1: 1e-3, 2: 1.05e-3, 4: 1.2e-3, 8: 1.6e-3, 65: 9e-3}}}
    for stall_at in (2, 15):  # in the oracle's walk, in the replay's
        out = replay_bounds(record, ReplayConfig(_StallingNGram(stall_at)))
        assert out["oracle"]["cost_draft_s"] == out["replay"]["cost_draft_s"] > 0.02 / 40


def test_bounds_refuse_sampled_records(tiny_record):
    with pytest.raises(InputError, match="greedy record"):
        replay_bounds({**tiny_record, "temperature": 0.7}, ReplayConfig("ngram"))


def test_cli_prints_the_three_rows_and_json(tiny_record, tmp_path, capsys):
    path = save_record(tiny_record, tmp_path / "run.json")
    assert main(["eval", "replay", "bound", "--record", str(path)]) == 0
    text = capsys.readouterr().out
    assert "copy bound" in text and "oracle over ngram's trees" in text and "guard on" in text
    assert main(["eval", "replay", "bound", "--record", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["copy"]["tau"] >= data["oracle"]["tau"] and data["sequences"] == 2
    for budgets in (",", " "):  # no budget at all: a one-line error, not an IndexError
        assert main(["eval", "replay", "run", "--record", str(path), "--max-nodes", budgets]) == 2
        assert "--max-nodes takes an integer" in capsys.readouterr().err


def test_counts_of_one_are_said_in_the_singular(tiny_record, tmp_path, capsys):
    """`specdec eval replay run` said "1 prompts"."""
    path = save_record({**tiny_record, "sequences": tiny_record["sequences"][:1]}, tmp_path / "one.json")
    for command in ("run", "bound"):
        assert main(["eval", "replay", command, "--record", str(path)]) == 0
        first = capsys.readouterr().out.splitlines()[0]
        assert ", 1 prompt, " in first and "prompts" not in first, first
    assert main(["eval", "replay", "run", "--record", str(save_record(tiny_record, tmp_path / "two.json"))]) == 0
    assert ", 2 prompts, " in capsys.readouterr().out


def test_overall_speedups_rescale_the_curve_to_the_recorded_decode_step():
    """The record measured 2 s per plain decode step where its curve says c(1) = 1 s: verify seconds count double
    next to the prefill. replay() reports the same overall figure for its own predicted run."""
    record = _record([5, 1, 2, 3, 4, 7, 1, 2, 9], [1, 2, 3, 4, 8], prefill=5.0)
    record["costs"]["decode_step_seconds"] = 2.0
    out = replay_bounds(record, ReplayConfig("ngram"))
    assert out["copy"]["overall_speedup"] == pytest.approx((5.0 + 5 * 2.0) / (5.0 + 2.5 * 2.0))
    assert out["prefill_share"] == pytest.approx(5.0 / (5.0 + 10.0))
    guarded = replay(record, ReplayConfig("ngram", guard=False))
    assert guarded["predicted_speedup_overall"] == pytest.approx((5.0 + 10.0) / (5.0 + 2.0 * guarded["seconds"]))
    del record["sequences"][0]["prefill_seconds"]
    assert replay(record, ReplayConfig("ngram", guard=False))["predicted_speedup_overall"] is None


def test_cli_bound_prints_the_prefill_share_and_each_rows_decode_then_overall_speedup(tmp_path, capsys):
    """The record of test_overall_speedups_rescale_the_curve_to_the_recorded_decode_step: the copy bound commits
    5 tokens in 2 steps (tau 2.5) at 2.5 c(1) against plain's 5 c(1), decode x2.00; with the 5 s prefill and 2 s
    per c(1), overall (5 + 10) / (5 + 5) = x1.50; the prefill is 5 / (5 + 10) = 33.3% of plain's time."""
    record = _record([5, 1, 2, 3, 4, 7, 1, 2, 9], [1, 2, 3, 4, 8], prefill=5.0)
    record["costs"]["decode_step_seconds"] = 2.0
    record["threads"] = 4
    path = save_record(record, tmp_path / "run.json")
    assert main(["eval", "replay", "bound", "--record", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "synthetic, 1 prompt, 5 tokens (cpu, 4 threads); prefill 33.3% of plain's time"
    assert lines[2].split() == ["copy", "bound", "(any", "lookup", "drafter)", "2.50", "x2.00", "x1.50"]


def test_cli_run_prints_c_verify_1_in_milliseconds_and_the_curve_it_priced_by(tmp_path, capsys):
    """The record's curve says c(1) = 1 s: 1000.00 ms, on the record's machine; --verify-costs gives
    milliseconds, so {"1": 2.5} is 2.50 ms, and the line says where that curve came from."""
    path = save_record({**_record([5, 1, 2, 3, 4, 7, 1, 2, 9], [1, 2, 3, 4, 8]), "threads": 4}, tmp_path / "run.json")
    assert main(["eval", "replay", "run", "--record", str(path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "synthetic, 1 prompt, 5 tokens; c_verify(1) = 1000.00 ms (cpu, 4 threads)"
    curve = '{"1": 2.5, "4": 3.0}'
    assert main(["eval", "replay", "run", "--record", str(path), "--verify-costs", curve]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"synthetic, 1 prompt, 5 tokens; c_verify(1) = 2.50 ms (from {curve})"
    assert main(["eval", "replay", "run", "--record", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["record"], data["model"], len(data["results"])) == (str(path), "synthetic", 1)
    # one recording thread is "1 thread"; a record that kept none says "?"
    for threads, said in ((1, "1 thread"), (None, "? threads")):
        path = save_record({**_record([5, 1, 2, 3, 4, 7, 1, 2, 9], [1, 2, 3, 4, 8]), "threads": threads},
                           tmp_path / f"run-{threads}.json")
        assert main(["eval", "replay", "run", "--record", str(path)]) == 0
        assert capsys.readouterr().out.splitlines()[0].endswith(f"(cpu, {said})")


def test_max_nodes_skips_empty_items_of_its_comma_list():
    """--max-nodes "4,,8," is the budgets 4 and 8 (a stray comma is no budget), not a refusal."""
    from specdec.eval.replay_cli import _budgets

    assert _budgets("4,,8,") == [4, 8] and _budgets(" 4, 8") == [4, 8] and _budgets(None) == [None]
