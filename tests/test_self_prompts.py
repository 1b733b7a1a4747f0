"""Prompts the target writes itself (specdec.train.self_prompts): only whole user turns are kept, unique,
long enough and apart from the held-out evaluation prompts; the result is cached; a tokenizer without a chat
template and a config that mixes sources are refused."""
from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
from specdec.train import self_prompts
from specdec.train.cli import _what_is_left
from specdec.train.config import TrainConfig
from specdec.train.data import TrainDataError

from specdec.models.loader import load_model
from specdec.testing import build_tiny_model, build_tiny_tokenizer

generate_module = importlib.import_module("specdec.generate")  # the module, not the function specdec exports
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} says {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant says {% endif %}")


def _loaded():
    tok = build_tiny_tokenizer()
    tok.chat_template = TEMPLATE
    model = build_tiny_model(vocab_size=len(tok))
    model.config.eos_token_id = tok.convert_tokens_to_ids("!")  # the tiny vocabulary's end-of-turn stand-in
    return load_model(model, tokenizer=tok)  # the reference backend on CPU: self-prompts decode eagerly


def test_only_whole_unique_and_held_out_free_turns_are_kept_and_cached(tmp_path, monkeypatch):
    loaded = _loaded()
    tok, end = loaded.tokenizer, loaded.model.config.eos_token_id
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turns = [
        ids("how do tides work") + [end],  # kept
        ids("tell me a story about a cat"),  # cut off: no end of turn
        ids("how do tides work") + [end],  # a duplicate
        ids("hi there") + [end],  # too short
        ids("What is photosynthesis") + [end],  # a held-out chat prompt's words
        ids("plan a trip to the sea") + [end],  # kept
    ]
    calls = []

    def fake_generate(model, prompts, **kwargs):
        calls.append((prompts, kwargs))
        return SimpleNamespace(new_tokens=turns[: len(prompts)])

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    got = self_prompts.self_written_prompts(loaded, 2, batch_size=6, cache_dir=tmp_path, progress=False)
    assert got == ["how do tides work", "plan a trip to the sea"]
    prefix = calls[0][0][0]
    assert tok.decode(prefix) == "user says " and calls[0][1]["do_sample"] and calls[0][1]["seed"] == 0
    again = self_prompts.self_written_prompts(loaded, 2, batch_size=6, cache_dir=tmp_path, progress=False)
    assert again == got and len(calls) == 1  # from the cache
    more = self_prompts.self_written_prompts(loaded, 3, batch_size=6, cache_dir=tmp_path, progress=False)
    assert more == got and len(calls) == 1 + 2  # 4 n draws at most: fewer prompts than asked, with a warning


@pytest.mark.parametrize("damage", ["", '{"prompts": ["how do', '{"prompts": [1, 2]}'])
def test_a_damaged_cache_file_of_prompts_is_made_again(tmp_path, monkeypatch, caplog, damage):
    """A cache file left empty (a machine that went down just after the write), cut short or not of prompts stopped
    the run with a JSON error naming no file (or handed numbers on as prompts); the prompts are written again now,
    with a warning naming the file."""
    loaded = _loaded()
    turn = loaded.tokenizer("plan a trip to the sea", add_special_tokens=False)["input_ids"] + [
        loaded.model.config.eos_token_id]
    calls = []
    monkeypatch.setattr(generate_module, "generate", lambda model, prompts, **kw: calls.append(1)
                        or SimpleNamespace(new_tokens=[turn] * len(prompts)))
    common = dict(batch_size=2, cache_dir=tmp_path, progress=False)
    assert self_prompts.self_written_prompts(loaded, 1, **common) == ["plan a trip to the sea"]
    (file,) = tmp_path.glob("*.json")
    file.write_text(damage)
    with caplog.at_level("WARNING"):
        assert self_prompts.self_written_prompts(loaded, 1, **common) == ["plan a trip to the sea"]
    assert len(calls) == 2 and f"the cache file {file} is damaged" in caplog.text


def test_processes_write_the_prompts_together_and_all_get_those_of_one(tmp_path, monkeypatch):
    """Several processes: each draws every N-th batch, the batches are exchanged round by round and read in order,
    so every process gets what one process writes (the same seeds, duplicates dropped in the same order; a batch
    drawn past the last one needed is not read)."""
    import threading

    from tests.thread_teams import run_as_team

    loaded = _loaded()
    tok, end = loaded.tokenizer, loaded.model.config.eos_token_id
    things, lock, calls = ["apples", "boats", "clouds", "drums"], threading.Lock(), []

    def fake_generate(model, prompts, *, seed, **kwargs):
        k = seed // 2  # the batch: its first draw
        with lock:
            calls.append(k)
        turns = [f"talk to me about {things[k % 2]}", f"please describe the {things[k]}"]  # the first repeats
        return SimpleNamespace(new_tokens=[tok(t, add_special_tokens=False)["input_ids"] + [end] for t in turns])

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    one = self_prompts.self_written_prompts(loaded, 5, batch_size=2, cache_dir=tmp_path / "one", progress=False)
    assert len(one) == 5 and sorted(calls) == [0, 1, 2]
    calls.clear()
    two = run_as_team(2, lambda team: self_prompts.self_written_prompts(loaded, 5, batch_size=2, progress=False,
                                                                        cache_dir=tmp_path / "two", team=team))
    assert two == [one, one] and sorted(calls) == [0, 1, 2, 3]  # batch 3, of the second round, is not needed


def _turns_by_batch(tok, end):
    """A stand-in for the target's draws: batch k (its first draw's number in its seed) writes two user turns, the
    first of them the same every other batch (a duplicate, dropped), so each batch gives one or two prompts."""
    things = ["apples", "boats", "clouds", "drums", "eels", "flutes", "gulls", "harps"]

    def fake_generate(model, prompts, *, seed, **kwargs):
        k = seed % 1_000_003 // 2
        turns = [f"talk to me about {things[k % 2]}", f"please describe the {things[k]}"]
        return SimpleNamespace(new_tokens=[tok(t, add_special_tokens=False)["input_ids"] + [end] for t in turns])

    return fake_generate


def test_interrupted_self_written_prompts_continue_from_the_finished_batches(tmp_path, monkeypatch):
    """`--prompt-source self` stopped part-way (Ctrl-C, SIGTERM, a kill) kept nothing: a rerun drew every prompt
    again. Finished batches of draws are kept now, and a rerun draws only the rest: the prompts of one whole run."""
    loaded = _loaded()
    fake = _turns_by_batch(loaded.tokenizer, loaded.model.config.eos_token_id)
    monkeypatch.setattr(generate_module, "generate", fake)
    common = dict(seed=3, batch_size=2, progress=False)
    whole = self_prompts.self_written_prompts(loaded, 6, cache_dir=tmp_path / "whole", **common)
    calls = []

    def interrupted_at_the_third_batch(model, prompts, *, seed, **kwargs):
        calls.append(seed % 1_000_003)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return fake(model, prompts, seed=seed, **kwargs)

    monkeypatch.setattr(generate_module, "generate", interrupted_at_the_third_batch)
    with pytest.raises(KeyboardInterrupt) as err:
        self_prompts.self_written_prompts(loaded, 6, cache_dir=tmp_path / "part", **common)
    assert _what_is_left(tmp_path / "run", err.value) == (  # the CLI's last line said that a rerun starts again
        "the target's own prompts: the batches it finished are kept (4 of 6 prompts found), so a rerun draws only "
        "the rest")
    (partial,) = (tmp_path / "part").glob("*.partial.jsonl")
    with open(partial, "a") as f:
        f.write('{"start": 4, "sequ')  # a line cut short by a kill mid-append: dropped
    calls.clear()
    assert self_prompts.self_written_prompts(loaded, 6, cache_dir=tmp_path / "part", **common) == whole
    assert calls == [4, 6] and [p.suffix for p in (tmp_path / "part").iterdir()] == [".json"]


def test_processes_continue_the_prompts_their_interrupted_runs_kept(tmp_path, monkeypatch):
    """Two processes stopped after their first round leave a batch each in their partial files; a rerun with another
    number of processes draws only the rest, and every process gets the prompts of one process's whole run."""
    from tests.thread_teams import run_as_team

    loaded = _loaded()
    fake = _turns_by_batch(loaded.tokenizer, loaded.model.config.eos_token_id)
    monkeypatch.setattr(generate_module, "generate", fake)
    common = dict(seed=0, batch_size=2, progress=False)
    whole = self_prompts.self_written_prompts(loaded, 6, cache_dir=tmp_path / "whole", **common)
    key = self_prompts._cache_file(loaded, 6, 0, 2, tmp_path, False).stem
    tmp_path.joinpath(f"{key}.partial.jsonl").write_text(
        json.dumps({"start": 0, "sequences": fake(None, None, seed=0).new_tokens}) + "\n")
    tmp_path.joinpath(f"{key}.partial.1.jsonl").write_text(
        json.dumps({"start": 2, "sequences": fake(None, None, seed=2).new_tokens}) + "\n")
    calls = []
    monkeypatch.setattr(generate_module, "generate", lambda model, prompts, *, seed, **kw: calls.append(seed)
                        or fake(model, prompts, seed=seed, **kw))
    got = run_as_team(3, lambda team: self_prompts.self_written_prompts(loaded, 6, cache_dir=tmp_path, team=team,
                                                                        **common))
    assert got == [whole] * 3 and sorted(calls) == [4, 6, 8]  # the round of batches 4, 6 and 8; 8 not needed
    assert [p.name for p in tmp_path.glob(f"{key}*")] == [f"{key}.json"]


def test_a_model_that_never_ends_its_turn_or_has_no_chat_template_is_refused(tmp_path, monkeypatch):
    loaded = _loaded()
    monkeypatch.setattr(generate_module, "generate",
                        lambda model, prompts, **kw: SimpleNamespace(new_tokens=[[5, 6, 7]] * len(prompts)))
    with pytest.raises(TrainDataError, match="no usable user prompt"):
        self_prompts.self_written_prompts(loaded, 2, batch_size=4, cache_dir=tmp_path, progress=False)
    loaded.tokenizer.chat_template = None
    with pytest.raises(TrainDataError, match="chat template"):
        self_prompts.self_written_prompts(loaded, 2, cache_dir=tmp_path, progress=False)


def test_self_written_prompts_exclude_the_other_prompt_sources():
    with pytest.raises(ValueError, match="prompt_source"):
        TrainConfig(model="m", output_dir="o", prompt_source="self", prompts_file="p.txt")
    with pytest.raises(ValueError, match="prompt_source must be one of"):
        TrainConfig(model="m", output_dir="o", prompt_source="web")
    with pytest.raises(ValueError, match="data and prompts_file are two sources"):  # --prompts-file was ignored
        TrainConfig(model="m", output_dir="o", data="d.jsonl", prompts_file="p.txt")
    assert TrainConfig(model="m", output_dir="o").fingerprint() == TrainConfig(
        model="m", output_dir="o", prompt_source="builtin").fingerprint()


def test_a_prompt_holding_exactly_the_share_of_a_held_out_prompts_words_is_too_close():
    """share 0.6 of a 5-word held-out prompt is 3 words: 3 shared words are too close, 2 are not."""
    held = [{"how", "do", "tides", "work", "today"}]
    assert self_prompts.too_close("how do tides", held)
    assert not self_prompts.too_close("how do birds", held)


def test_a_turn_of_exactly_min_words_words_is_kept(tmp_path, monkeypatch):
    """MIN_WORDS is 3: "plan a trip" (3 words) is a prompt, "hi there" (2) is not."""
    loaded = _loaded()
    tok, end = loaded.tokenizer, loaded.model.config.eos_token_id
    turns = [tok(text, add_special_tokens=False)["input_ids"] + [end] for text in ("hi there", "plan a trip")]
    monkeypatch.setattr(generate_module, "generate", lambda model, prompts, **kw: SimpleNamespace(new_tokens=turns))
    assert self_prompts.MIN_WORDS == 3
    assert self_prompts.self_written_prompts(loaded, 1, batch_size=2, cache_dir=tmp_path, progress=False) == [
        "plan a trip"]


def test_a_batch_with_more_usable_turns_than_asked_gives_the_first_n(tmp_path, monkeypatch):
    loaded = _loaded()
    tok, end = loaded.tokenizer, loaded.model.config.eos_token_id
    turns = [tok(text, add_special_tokens=False)["input_ids"] + [end]
             for text in ("plan a trip", "write a poem please", "name three rivers")]
    monkeypatch.setattr(generate_module, "generate", lambda model, prompts, **kw: SimpleNamespace(new_tokens=turns))
    assert self_prompts.self_written_prompts(loaded, 2, batch_size=3, cache_dir=tmp_path, progress=False) == [
        "plan a trip", "write a poem please"]
