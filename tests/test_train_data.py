"""Training data loading: JSONL text, chat messages, Parquet, saved datasets dirs, and clear errors."""
from __future__ import annotations

import importlib
import json
import logging
import os
import signal
from types import SimpleNamespace

import pytest
from specdec.train.data import TrainDataError, load_texts, split_held_out, tokenize_texts
from specdec.train.distill import kept_answers, partial_file, self_distill, what_is_left
from specdec.train.process_team import Team
from specdec.train.prompts import builtin_prompts

from specdec.errors import InputError
from specdec.models.loader import load_model
from specdec.testing import build_tiny_model

pytest.importorskip("datasets")

CHARS = list("abcdefghijklmnopqrstuvwxyz .,?!'0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]")


TEXTS = [f"the {w} number {i} likes {w[::-1]} and sings, {i * 7}" for i, w in
         enumerate(["cat", "dog", "bird", "fish", "frog", "bee", "owl", "fox", "cow", "yak", "eel", "ant"] * 2)]


class ChatTok:
    chat_template = "x"

    def apply_chat_template(self, msgs, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in msgs)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def training_dir(root):
    """``root`` with a tiny checkpoint (``model/``) and TEXTS as JSON Lines (``data.jsonl``): what the training
    tests train on."""
    from specdec.testing import save_tiny_checkpoint

    save_tiny_checkpoint(root / "model")
    _jsonl(root / "data.jsonl", [{"text": t} for t in TEXTS])
    return root


def test_a_team_refuses_a_process_index_outside_its_size():
    """Processes 0..size-1 make a team of ``size``: index 2 of 2 (or -1) is no member, and is refused at once rather
    than taking no piece and waiting at exchanges that never pair up."""
    for index in (2, -1):
        with pytest.raises(ValueError, match=f"process index {index} is not one of 2 processes"):
            Team(index, 2, lambda: None, lambda made: [made])
    assert Team(1, 2, lambda: None, lambda made: [made]).index == 1


def test_jsonl_text(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"text": "hello there"}, {"text": "general kenobi"}, {"text": ""}])
    assert load_texts(f) == ["hello there", "general kenobi"]


def test_jsonl_custom_field_and_chat_messages(tmp_path):
    f = _jsonl(tmp_path / "d.jsonl", [{"body": "abc"}])
    assert load_texts(f, text_field="body") == ["abc"]
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    f = _jsonl(tmp_path / "c.jsonl", rows)
    assert load_texts(f, tokenizer=ChatTok()) == ["<user>hi<assistant>yo"]
    with pytest.raises(TrainDataError, match="chat template"):
        load_texts(f, tokenizer=None)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_sharegpt_conversations_are_read_as_chat_messages(tmp_path, suffix, caplog):
    """ShareGPT's form (the data Medusa and EAGLE train on: ``{"from": "human" | "gpt", "value": ...}``) was refused
    as not {role, content}; it is read, its human / gpt as user / assistant, through datasets (.json) as by line."""
    rows = [{"id": "a", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "yo"}]}]
    f = tmp_path / f"d{suffix}"
    f.write_text(json.dumps(rows) if suffix == ".json" else json.dumps(rows[0]) + "\n")
    with caplog.at_level(logging.WARNING, logger="specdec.train.data"):
        texts = load_texts(str(f), messages_field="conversations", tokenizer=ChatTok())
    assert texts == ["<system>be brief<user>hi<assistant>yo"]
    assert "roles" not in caplog.text


def test_roles_no_chat_template_knows_are_counted_in_a_warning(tmp_path, caplog):
    """ShareGPT's human / gpt kept as {role, content} roles (a half-converted file) were rendered as written, a chat
    format the model never answers in, without a word; a warning counts them and names the roles."""
    rows = [{"messages": [{"role": "human", "content": "hi"}, {"role": "gpt", "content": "yo"}]},
            {"messages": [{"from": "bing", "value": "hi"}]}, {"messages": [{"role": "user", "content": "x"}]}]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="specdec.train.data"):
        texts = load_texts(f, tokenizer=ChatTok())
    assert texts == ["<human>hi<gpt>yo", "<bing>hi", "<user>x"]
    assert (f"3 messages of {f} have roles chat templates do not know ('human', 'gpt', 'bing'; they know system, "
            "developer, user, assistant, tool, ipython, function): the template renders them as written") in caplog.text


def test_parquet_and_saved_dataset(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"text": ["one two", "three four"]})
    ds.to_parquet(str(tmp_path / "d.parquet"))
    assert load_texts(str(tmp_path / "d.parquet")) == ["one two", "three four"]
    ds.save_to_disk(str(tmp_path / "saved"))
    assert load_texts(str(tmp_path / "saved")) == ["one two", "three four"]
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dd"))
    assert load_texts(str(tmp_path / "dd")) == ["one two", "three four"]


def test_a_saved_dataset_dict_trains_on_its_train_split_whichever_split_comes_first(tmp_path):
    import datasets

    splits = {"test": datasets.Dataset.from_dict({"text": ["held back"]}),
              "train": datasets.Dataset.from_dict({"text": ["one two", "three four"]})}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "dd"))
    assert load_texts(str(tmp_path / "dd")) == ["one two", "three four"]


def test_a_jsonl_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    """Editors on Windows write UTF-8 with a BOM; it is not part of the first record's JSON."""
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "first"}\n{"text": "second"}\n')
    assert load_texts(str(f)) == ["first", "second"]


def test_a_text_holding_a_lone_surrogate_is_refused_naming_its_line(tmp_path):
    """JSON's "\\udc00" escape without its pair reads as a lone surrogate, which the tokenizer then failed on in a
    TypeError traceback naming no record."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok fine"}\n{"text": "a\\udc00b c"}\n')
    with pytest.raises(TrainDataError, match=r"d.jsonl line 2: its text holds a lone surrogate \(U\+DC00 at "
                                             r"character 1, "):
        load_texts(str(f))


def test_a_non_utf8_byte_on_a_first_line_after_a_byte_order_mark_is_named_where_it_is(tmp_path):
    """The byte was counted from after the mark: "byte 13" for the file's byte 16, 3 short of where it is."""
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"text": "caf\xe9"}\n')
    with pytest.raises(TrainDataError, match=r"is not UTF-8 text \(line 1, byte 16: invalid continuation byte\)"):
        load_texts(str(f))


@pytest.mark.parametrize("case,match", [
    ("missing", "not found"), ("unknown", "unknown data format"), ("empty", "d.jsonl is empty"),
    ("nofield", "neither"), ("corrupt", "cannot read"), ("plain_dir", "not a dataset"),
    ("latin1", "d.jsonl is not UTF-8 text"),
])
def test_data_errors(tmp_path, case, match):
    if case == "missing":
        f = tmp_path / "nope.jsonl"
    elif case == "unknown":
        f = tmp_path / "d.csv"
        f.write_text("a,b\n1,2\n")
    elif case == "empty":
        f = tmp_path / "d.jsonl"
        f.write_text("")
    elif case == "nofield":
        f = tmp_path / "d.jsonl"
        _jsonl(f, [{"content": "x"}])
    elif case == "latin1":
        f = tmp_path / "d.jsonl"
        f.write_bytes('{"text": "caf\u00e9 au lait"}\n'.encode("latin-1"))
    elif case == "corrupt":
        f = tmp_path / "d.parquet"
        f.write_bytes(b"not parquet at all")
    else:
        f = tmp_path / "dir"
        f.mkdir()
    with pytest.raises(TrainDataError, match=match):
        load_texts(str(f))


@pytest.mark.parametrize("name, match", [
    ("d.csv", "unknown data format 'd.csv'"), ("dir", "not a dataset saved with"), ("d.json", "needs 'datasets'")])
def test_without_datasets_only_a_file_it_reads_asks_for_it(tmp_path, monkeypatch, name, match):
    """Without datasets (no train extra), a .csv or a plain folder was told to install it, then refused once it was;
    what datasets reads asks for the extra, naming the file; a .jsonl file needs nothing."""
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    f = tmp_path / name
    f.mkdir() if name == "dir" else f.write_text('[{"text": "one two"}]')
    with pytest.raises(TrainDataError, match=match) as err:
        load_texts(str(f))
    assert (str(f) in str(err.value) and "specdec[train]" in str(err.value)) == (name == "d.json"), err.value
    _jsonl(tmp_path / "d.jsonl", [{"text": "one two"}])
    assert load_texts(str(tmp_path / "d.jsonl")) == ["one two"]


def test_tokenize_and_split():
    seqs = tokenize_texts(tiny_tokenizer(), TEXTS + ["a"], seq_len=20)
    assert len(seqs) == len(TEXTS) and max(map(len, seqs)) == 20  # "a" is too short to train on
    train, held = split_held_out(seqs, 0.25)
    assert sorted(map(tuple, train + held)) == sorted(map(tuple, seqs)) and held
    assert set(map(tuple, split_held_out(seqs[::-1], 0.25)[1])) == set(map(tuple, held))  # by content, not order
    with pytest.raises(TrainDataError):
        tokenize_texts(tiny_tokenizer(), ["a"], seq_len=20)


def test_records_that_give_no_training_sequence_are_counted_in_a_warning(tmp_path, caplog):
    """Empty texts and texts of fewer than 3 tokens were dropped without a word: a file of 5 records trained on 2."""
    f = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in ["hello there", "", " \n ", "ab", "general kenobi"]])
    with caplog.at_level(logging.WARNING, logger="specdec.train.data"):
        assert len(tokenize_texts(tiny_tokenizer(), load_texts(f), seq_len=20, source=f"training data {f}")) == 2
    assert f"2 of 5 records of {f} hold an empty text and are skipped" in caplog.text
    assert f"1 of 3 texts of training data {f} tokenize to fewer than 3 tokens and are not trained on" in caplog.text
    # none left: the error names the file too (it said "no training sequence has at least 3 tokens")
    with pytest.raises(TrainDataError, match=f"^no text of training data {f} has at least 3 tokens: there is nothing"):
        tokenize_texts(tiny_tokenizer(), ["ab"], seq_len=20, source=f"training data {f}")


def test_training_texts_start_as_prompts_do_with_one_bos():
    """Plain --data texts were tokenized without special tokens: for a tokenizer that adds a BOS (Llama's), heads
    trained on sequences without the BOS that every prompt they draft for starts with (self-distilled prompts had
    it). A chat template's rendering writes the BOS itself: it keeps one, not two."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "[BOS]"})
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[
        ("[BOS]", bos)])
    plain, rendered = tokenize_texts(tok, ["the cat sings", "[BOS]the cat sings"], seq_len=8)
    assert plain == rendered == [bos] + tok("the cat", add_special_tokens=False)["input_ids"], (plain, rendered)
    assert tokenize_texts(tiny_tokenizer(), ["the cat"], seq_len=20) == [tok("the cat", add_special_tokens=False)[
        "input_ids"]]  # a tokenizer without a BOS: the text's tokens alone


def test_held_out_split_never_leaks_into_training():
    seqs = [[i, i + 1, i + 2] for i in range(0, 30, 3)]
    for fraction in (1e-9, 0.1, 0.5):  # 1e-9: no hash falls under it, one sequence is moved out
        train, held = split_held_out(seqs, fraction)
        assert held and not set(map(tuple, train)) & set(map(tuple, held))
        assert sorted(map(tuple, train + held)) == sorted(map(tuple, seqs))
    assert split_held_out(seqs, 0.0) == (seqs, [])
    with pytest.raises(TrainDataError, match="held-out"):
        split_held_out(seqs[:1], 0.1)


def test_builtin_prompts_disjoint_from_held_out_chat():
    from specdec.eval.prompts import CHAT

    prompts = builtin_prompts()
    assert len(prompts) >= 300 and len(set(prompts)) == len(prompts)
    assert not set(prompts) & set(CHAT)
    assert builtin_prompts(10, seed=1) == builtin_prompts(10, seed=1) != builtin_prompts(10, seed=2)


def test_builtin_prompts_n_is_the_first_n_of_the_full_seeded_order():
    everything = builtin_prompts(seed=3)
    assert builtin_prompts(5, seed=3) == everything[:5]
    assert builtin_prompts(1, seed=3) == everything[:1] and builtin_prompts(0, seed=3) == []


def test_a_subject_of_a_held_out_chat_prompt_is_refused(monkeypatch):
    from specdec.train import prompts as builtin

    builtin._check_disjoint()  # the shipped set passes
    monkeypatch.setattr(builtin, "SUBJECTS", builtin.SUBJECTS + ("the water cycle",))
    with pytest.raises(RuntimeError, match="water cycle"):
        builtin._check_disjoint()


def test_a_bad_jsonl_line_is_named_once(tmp_path, caplog):
    """A line that is not JSON gave datasets' ERROR log twice (its handler and the root's) and then "cannot read
    ...: DatasetGenerationError: An error occurred while generating the dataset"; now one error naming the line."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n{not json}\n')
    with caplog.at_level("INFO"), pytest.raises(TrainDataError) as err:
        load_texts(str(f))
    assert str(err.value) == (f"cannot read training data {f}: line 2 is not JSON (Expecting property name enclosed "
                              "in double quotes, column 2)")
    assert not [r for r in caplog.records if r.name.startswith("datasets") and r.levelname == "ERROR"]


CUT_SHORT = '{"text": "fine"}\n{"text": "cut short"\n'  # the second line lacks its closing brace


@pytest.mark.parametrize("name, content, said", [
    ("d.jsonl", CUT_SHORT, ": line 2 is not JSON (Expecting ',' delimiter, column 21)"),
    ("d.json", CUT_SHORT, ": line 2 is not JSON (Expecting ',' delimiter, column 21)"),
    ("d.json", "\n  \n\n", " is empty"),
    ("d.json", "[]\n", " holds no records (it is [])"),
    ("d.json", '[\n {"text": "a"},\n {"text": "b"\n]\n', ": it is not JSON (Expecting ',' delimiter, line 4, "
     "column 1)"),
    ("d.json", '"one string"', ": it is a JSON str, not a list of records or one record per line"),
])
def test_a_bad_json_file_is_named_with_where_it_breaks(tmp_path, name, content, said):
    """datasets refused a .json file of blank lines or [] with "Instruction "train" corresponds to no data!" and a
    JSON Lines line that is not JSON with "Trailing data at position 17"; a line cut short was said to break at
    column 1 (of the line after it)."""
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(TrainDataError) as err:
        load_texts(str(f))
    assert str(err.value).endswith(f"{f}{said}")


def test_an_interrupted_self_distillation_continues_from_its_finished_batches(tmp_path, monkeypatch):
    """Self-distillation kept nothing until its last batch, so a Ctrl-C or SIGTERM lost every generated answer;
    finished batches are kept now and a rerun generates only the rest: the same sequences as one whole run."""
    generate_module = importlib.import_module("specdec.generate")
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[(7 * i + j) % 60 + 2 for j in range(3 + i % 4)] for i in range(7)]
    kwargs = dict(max_new_tokens=4, batch_size=3, progress=False, do_sample=True, seed=5)
    whole = self_distill(loaded, prompts, cache_dir=tmp_path / "whole", **kwargs)
    real, calls = generate_module.generate, []

    def interrupted_at_the_third_batch(model, chunk, **kw):
        calls.append(len(chunk))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, chunk, **kw)

    monkeypatch.setattr(generate_module, "generate", interrupted_at_the_third_batch)
    with pytest.raises(KeyboardInterrupt):
        self_distill(loaded, prompts, cache_dir=tmp_path / "part", **kwargs)
    (partial,) = (tmp_path / "part").glob("*.partial.jsonl")
    with open(partial, "a") as f:
        f.write('{"start": 6, "sequ')  # a line cut short by a kill mid-append: dropped
    calls.clear()
    assert self_distill(loaded, prompts, cache_dir=tmp_path / "part", **kwargs) == whole
    assert calls == [1] and not partial.exists()  # only the last prompt was generated again


def test_an_interrupt_while_a_batch_is_kept_counts_that_batch(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while a finished batch was written to the partial file (here: as it reaches the disk) was
    raised before the batch was counted, so the CLI's last line named one batch fewer than were kept (2 of 10
    prompts, with 4 in the file). The interrupt now waits until the batch is written and counted."""
    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate",
                        lambda model, chunk, **kw: SimpleNamespace(new_tokens=[[1, 1]] * len(chunk)))
    real_fsync, sent = os.fsync, []

    def interrupted(fd):  # the signal arrives as the first batch's line is synced
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGINT))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(4)]
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's process has it (an xdist worker
    try:                                                                # ignores SIGINT: nothing was raised there)
        with pytest.raises(KeyboardInterrupt) as err:
            self_distill(loaded, prompts, max_new_tokens=2, batch_size=2, progress=False, cache_dir=tmp_path)
    finally:
        signal.signal(signal.SIGINT, before)
    assert err.value.distilled == (2, 4, 1)
    (partial,) = tmp_path.glob("*.partial.jsonl")
    assert [json.loads(line)["start"] for line in partial.read_text().splitlines()] == [0]


def _distilled_once(tmp_path, monkeypatch):
    """Two prompts self-distilled once into the cache ``tmp_path`` by a fake generate() that counts its calls' rows:
    (those counts, a function distilling the same again, the sequences, the cache file)."""
    calls = []
    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", lambda model, chunk, **kw:
                        calls.append(len(chunk)) or SimpleNamespace(new_tokens=[[1, 1]] * len(chunk)))
    loaded = load_model(build_tiny_model(vocab_size=64))

    def again():
        return self_distill(loaded, [[5, 6, 7], [8, 9]], max_new_tokens=2, batch_size=2, progress=False,
                            cache_dir=tmp_path)

    first = again()
    (file,) = tmp_path.glob("*.json")
    return calls, again, first, file


@pytest.mark.parametrize("damage", ["", '{"sequences": [[5, 6, 7, 1', "fewer", "other prompts"])
def test_a_damaged_self_distillation_cache_file_is_made_again(tmp_path, monkeypatch, caplog, damage):
    """A cache file left empty (a machine that went down just after the write), cut short or holding other answers
    stopped the run with "Expecting value: line 1 column 1 (char 0)", naming no file, or "zip() argument 2 is longer
    than argument 1". It is generated again now, with a warning naming it."""
    calls, again, first, file = _distilled_once(tmp_path, monkeypatch)
    file.write_text({"fewer": json.dumps({"sequences": first[:1]}),
                     "other prompts": json.dumps({"sequences": [[9, 9, 9, 1, 1], [8, 9, 1, 1]]})}.get(damage, damage))
    with caplog.at_level(logging.WARNING, logger="specdec.train.distill"):
        assert again() == first
    assert calls == [2, 2] and json.loads(file.read_text())["sequences"] == first
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"the cache file {file} is damaged"]


def test_partial_files_left_beside_a_whole_self_distillation_cache_entry_are_removed(tmp_path, monkeypatch):
    """A run killed after writing the whole cache entry, before removing its partial files, left them on disk for
    good: the next run served the entry and never read them again. It removes them now, the entry kept."""
    calls, again, first, file = _distilled_once(tmp_path, monkeypatch)
    key = file.name.removesuffix(".json")
    left = [tmp_path / f"{key}.partial.jsonl", tmp_path / f"{key}.partial.1.jsonl"]
    for partial in left:
        partial.write_text(json.dumps({"start": 0, "sequences": first}) + "\n")
    other = tmp_path / "0123456789abcdef01234567.partial.jsonl"  # another entry's, which may be under way
    other.write_text("")
    assert again() == first and calls == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([file.name, other.name])


def test_a_read_only_self_distillation_cache_is_read_and_a_missing_entry_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                                                  read_only):
    """A cache on a read-only folder (a team's shared one, mounted read-only): an entry it holds is read without a
    write; one it lacks stopped the run with a bare "[Errno 30] Read-only file system" (or after the first batch,
    where the folder existed). It is refused in one line naming the folder and SPECDEC_CACHE_DIR, nothing
    generated."""
    calls, again, first, file = _distilled_once(tmp_path, monkeypatch)
    read_only(tmp_path)
    assert again() == first and calls == [2]
    loaded = load_model(build_tiny_model(vocab_size=64))
    with pytest.raises(InputError, match=f"cannot write the cache {tmp_path} .*not writable.*set SPECDEC_CACHE_DIR"):
        self_distill(loaded, [[5, 6, 7], [8, 9]], max_new_tokens=3, batch_size=2, progress=False, cache_dir=tmp_path)
    assert calls == [2] and [p.name for p in tmp_path.iterdir()] == [file.name]


def test_a_continued_self_distillation_counts_a_short_last_batch_as_its_prompts(tmp_path, caplog):
    """The log line of a continued run counts the prompts done: the last batch holds fewer than batch_size."""
    with caplog.at_level(logging.INFO, logger="specdec.train.distill"):
        todo = what_is_left({}, [{0, 4}], 6, 4, Team.alone(), tmp_path)
    assert todo == [] and "continues an interrupted run: 6 of 6 prompts were done" in caplog.text


def test_a_partial_line_of_a_batch_before_the_first_prompt_is_dropped(tmp_path):
    """A damaged line starting at a negative index is no batch of this run: dropped with what follows it, not read
    against the prompts counted from the end."""
    ids = [[1, 2], [3, 4]]
    own = partial_file(tmp_path, "k", 0)
    own.write_text(json.dumps({"start": 0, "sequences": [[1, 2, 9]]}) + "\n"
                   + json.dumps({"start": -1, "sequences": [[3, 4, 9]]}) + "\n")
    assert kept_answers(tmp_path, "k", ids, 0) == {0: [1, 2, 9]}
    assert own.read_text() == json.dumps({"start": 0, "sequences": [[1, 2, 9]]}) + "\n"


def _shared_distillation(cache_dir):
    """The shared self-distillation tests' data: a tiny model, 7 prompts (4 batches of 2), sampled with one seed,
    and one process's sequences for them (cached in ``cache_dir``)."""
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[(7 * i + j) % 60 + 2 for j in range(3 + i % 4)] for i in range(7)]
    kwargs = dict(max_new_tokens=4, batch_size=2, progress=False, do_sample=True, seed=5)
    return loaded, prompts, kwargs, self_distill(loaded, prompts, cache_dir=cache_dir, **kwargs)


def test_processes_share_the_self_distillation_and_all_get_the_data_of_one(tmp_path, monkeypatch):
    """Several processes waited for the main one to self-distil alone, inside a collective that times out (10 min on
    NCCL). Each now generates every N-th batch, they exchange them round by round, and every process returns the
    sequences of one process: the same batches, a sampled one with the same seed, whoever generates it."""
    import threading

    from tests.thread_teams import run_as_team

    generate_module = importlib.import_module("specdec.generate")
    loaded, prompts, kwargs, whole = _shared_distillation(tmp_path / "one")
    real, lock, calls = generate_module.generate, threading.Lock(), []

    def one_at_a_time(model, chunk, **kw):  # the threads share one model
        with lock:
            calls.append((threading.current_thread().name, prompts.index(chunk[0])))
            return real(model, chunk, **kw)

    monkeypatch.setattr(generate_module, "generate", one_at_a_time)
    got = run_as_team(3, lambda team: self_distill(loaded, prompts, cache_dir=tmp_path / "three", team=team, **kwargs))
    assert got == [whole] * 3
    by_thread = {}
    for name, start in calls:
        by_thread.setdefault(name, []).append(start)
    assert sorted(by_thread.values()) == [[0, 6], [2], [4]]  # batch k on process k % 3
    files = [sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("one", "three")]
    assert files[0] == files[1] and len(files[0]) == 1  # the same cache file, no partial file left


def test_an_interrupted_shared_self_distillation_keeps_every_process_batches(tmp_path, monkeypatch):
    """An interrupt of a self-distillation several processes share keeps the batches each of them finished (each in
    its own partial file); a rerun with another number of processes generates only the rest, and processes whose
    caches are not one directory get the answers they lack from the others instead of generating them."""
    import threading

    from tests.thread_teams import run_as_team

    generate_module = importlib.import_module("specdec.generate")
    loaded, prompts, kwargs, whole = _shared_distillation(tmp_path / "one")
    real, lock, calls = generate_module.generate, threading.Lock(), []

    def interrupted_at_the_last_batch(model, chunk, **kw):
        with lock:
            calls.append(prompts.index(chunk[0]))
            if chunk[0] == prompts[6]:
                raise KeyboardInterrupt
            return real(model, chunk, **kw)

    monkeypatch.setattr(generate_module, "generate", interrupted_at_the_last_batch)
    part = tmp_path / "part"
    got = run_as_team(2, lambda team: self_distill(loaded, prompts, cache_dir=part, team=team, **kwargs))
    # each knows of the first round's batches and its own: process 0 finished its second, and stopped at the exchange
    assert [err.distilled for err in got] == [(6, 7, 2), (4, 7, 2)]
    kept = {p.name.split(".", 1)[1]: [json.loads(x)["start"] for x in p.read_text().splitlines()]
            for p in part.glob("*.partial*.jsonl")}
    assert kept == {"partial.jsonl": [0, 4], "partial.1.jsonl": [2]}
    calls.clear()
    monkeypatch.setattr(generate_module, "generate", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    got = run_as_team(3, lambda team: self_distill(loaded, prompts, cache_dir=part, team=team, **kwargs))
    assert got == [whole] * 3
    assert calls == [[prompts[6]]] and not list(part.glob("*.partial*"))  # only the missing batch, files removed
    calls.clear()  # a cache directory each: the one that holds the answers sends them
    assert run_as_team(2, lambda team: self_distill(loaded, prompts, cache_dir=[part, tmp_path / "own"][team.index],
                                                    team=team, **kwargs)) == [whole] * 2
    assert calls == [] and json.loads(next((tmp_path / "own").glob("*.json")).read_text())["sequences"] == whole


def test_processes_that_distil_at_once_decode_with_the_main_ones_row_policy(tmp_path, monkeypatch):
    """On an empty cost cache each process measured linear()'s CPU row policy as its first batch began, side by side,
    and could choose another one (another rounding: greedy answers that part from one process's at near-ties). The
    first process now decides (measured here, or read from the cache) and the others take its policy. Threads stand
    in for processes, each with its own memory of policies, and a fake measurement differs by process."""
    import threading

    from specdec import cost_model
    from specdec.models import row_policy
    from tests.thread_teams import run_as_team

    class PerProcess:  # a module-level dict, one per thread: what each process holds on its own
        def __init__(self):
            self.local = threading.local()

        def _d(self) -> dict:
            if not hasattr(self.local, "d"):
                self.local.d = {}
            return self.local.d

        def get(self, key, default=None):
            return self._d().get(key, default)

        def __getitem__(self, key):
            return self._d()[key]

        def __setitem__(self, key, value):
            self._d()[key] = value

        def __contains__(self, key):
            return key in self._d()

    for module, name in ((cost_model, "_ROWS_DONE"), (cost_model, "_PACKING"), (row_policy, "_ACTIVE")):
        monkeypatch.setattr(module, name, PerProcess())
    monkeypatch.setattr(cost_model, "read_cache", lambda file: None)  # an empty cache, written by neither
    monkeypatch.setattr(cost_model, "write_cache", lambda file, data: None)
    monkeypatch.setattr(cost_model, "streamed_weights", lambda runner: ([], []))  # what the fake times: nothing
    who, measured = threading.local(), []
    monkeypatch.setattr(row_policy, "measure_row_policy",
                        lambda *a, **k: measured.append(who.rank) or {1: 2 + who.rank})  # a near-tie timed apart
    generate_module = importlib.import_module("specdec.generate")
    real, lock = generate_module.generate, threading.Lock()

    def one_at_a_time(*a, **kw):  # the threads share one model
        with lock:
            return real(*a, **kw)

    monkeypatch.setattr(generate_module, "generate", one_at_a_time)
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[(7 * i + j) % 60 + 2 for j in range(3 + i % 4)] for i in range(4)]

    def process(team):
        who.rank = team.index
        self_distill(loaded, prompts, max_new_tokens=3, batch_size=2, progress=False, cache_dir=tmp_path, team=team)
        return row_policy.active_cols(loaded.runner.dtype)

    assert run_as_team(2, process) == [{1: 2}, {1: 2}] and measured == [0]


def test_a_retrained_middle_layer_is_not_served_from_the_distillation_cache(tmp_path):
    """The self-distillation cache was keyed by sums of the first three and last two weights only: a target retrained
    in a middle layer got the old model's text back. Its key is now the model's content fingerprint."""
    import torch

    loaded = load_model(build_tiny_model(vocab_size=64))
    kwargs = dict(max_new_tokens=3, batch_size=2, progress=False, cache_dir=tmp_path)
    self_distill(loaded, [[5, 6, 7], [8, 9]], **kwargs)
    with torch.no_grad():
        loaded.model.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
    self_distill(loaded, [[5, 6, 7], [8, 9]], **kwargs)
    assert len(list(tmp_path.glob("*.json"))) == 2  # generated anew under a key of its own, not a cache hit


def test_with_no_hash_under_the_fraction_the_smallest_hash_is_held_out():
    """The fallback holds out the sequence a larger fraction would hold out first: the smallest content hash
    (sha256 of the sequence's repr, first 8 hex digits over 0xFFFFFFFF), whatever the order."""
    import hashlib

    seqs = [[i, i + 1, i + 2] for i in range(0, 30, 3)]
    smallest = min(seqs, key=lambda s: hashlib.sha256(str(s).encode()).hexdigest()[:8])
    for order in (seqs, seqs[::-1]):
        train, held = split_held_out(order, 1e-9)
        assert held == [smallest] and smallest not in train and len(train) == len(seqs) - 1


def test_sampled_self_distillation_is_cached_per_batch_size_and_seeds_each_batch_by_its_start(tmp_path, monkeypatch):
    """Sampled, a batch's seed is seed + its first prompt's index (5 prompts, batch 2, seed 5: batches at 0, 2, 4
    draw with seeds 5, 7, 9), so another batch size samples other answers: its own cache entry, not the first
    one's. Greedy answers do not depend on the batch: one entry serves every size."""
    generate_module = importlib.import_module("specdec.generate")
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(5)]
    seeds = []

    def fake_generate(model, chunk, **kw):
        seeds.append(kw["seed"])
        return SimpleNamespace(new_tokens=[[1, 1]] * len(chunk))

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    common = dict(max_new_tokens=2, progress=False, cache_dir=tmp_path)
    self_distill(loaded, prompts, batch_size=2, do_sample=True, seed=5, **common)
    assert seeds == [5, 7, 9]
    self_distill(loaded, prompts, batch_size=3, do_sample=True, seed=5, **common)
    assert seeds == [5, 7, 9, 5, 8]  # batches at 0 and 3
    self_distill(loaded, prompts, batch_size=2, **common)
    assert seeds[5:] == [None] * 3
    self_distill(loaded, prompts, batch_size=3, **common)
    assert len(seeds) == 8  # greedy, batch 3: the batch-2 entry's answers


def test_a_kept_batch_whose_answers_do_not_continue_their_prompts_is_generated_again(tmp_path, monkeypatch):
    """An interrupted run's partial file is trusted only where each sequence starts with its own prompt: a
    record that does not (a damaged line that still parses) and everything after it is generated again."""
    generate_module = importlib.import_module("specdec.generate")
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(4)]
    calls = []

    def fake_generate(model, chunk, **kw):
        calls.append(len(calls))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return SimpleNamespace(new_tokens=[[1, 1]] * len(chunk))

    monkeypatch.setattr(generate_module, "generate", fake_generate)
    common = dict(max_new_tokens=2, batch_size=2, progress=False, cache_dir=tmp_path)
    with pytest.raises(KeyboardInterrupt):
        self_distill(loaded, prompts, **common)
    (partial,) = tmp_path.glob("*.partial.jsonl")
    partial.write_text(json.dumps({"start": 0, "sequences": [[9, 9, 9, 1, 1], [3, 4, 5, 1, 1]]}) + "\n")
    calls.clear()

    def answering(model, chunk, **kw):
        calls.append(len(chunk))
        return SimpleNamespace(new_tokens=[[1, 1]] * len(chunk))

    monkeypatch.setattr(generate_module, "generate", answering)
    assert self_distill(loaded, prompts, **common) == [p + [1, 1] for p in prompts]
    assert calls == [2, 2]  # both batches generated again


def _interrupted_in_its_second_batch(tmp_path, monkeypatch, prompts):
    """A run (batch 2) stopped in its second batch: the cache key's partial file (its first batch's line, for the test
    to overwrite), and a generate() that answers [1, 1] to every prompt from now on, recording each batch's size."""
    generate_module = importlib.import_module("specdec.generate")
    loaded = load_model(build_tiny_model(vocab_size=64))
    common = dict(max_new_tokens=2, batch_size=2, progress=False, cache_dir=tmp_path)

    def stopped(model, chunk, **kw):
        if chunk[0] != prompts[0]:
            raise KeyboardInterrupt
        return SimpleNamespace(new_tokens=[[7, 7]] * len(chunk))

    monkeypatch.setattr(generate_module, "generate", stopped)
    with pytest.raises(KeyboardInterrupt):
        self_distill(loaded, prompts, **common)
    (partial,) = tmp_path.glob("*.partial.jsonl")
    calls = []
    monkeypatch.setattr(generate_module, "generate", lambda model, chunk, **kw: calls.append(len(chunk))
                        or SimpleNamespace(new_tokens=[[1, 1]] * len(chunk)))
    return lambda: self_distill(loaded, prompts, **common), partial, calls, generate_module


def test_a_kept_last_batch_that_ends_at_the_last_prompt_is_not_generated_again(tmp_path, monkeypatch):
    """5 prompts, batch 2: batches at 0, 2 and 4 (one prompt, 4 + 1 = 5 = the prompt count). Kept batches 0 and 4
    are used; only batch 2 is generated."""
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(5)]
    run, partial, calls, _ = _interrupted_in_its_second_batch(tmp_path, monkeypatch, prompts)
    partial.write_text("".join(json.dumps(dict(start=s, sequences=[p + [7, 7] for p in prompts[s : s + 2]])) + "\n"
                               for s in (0, 4)))
    assert run() == [p + [7, 7] for p in prompts[:2]] + [p + [1, 1] for p in prompts[2:4]] + [prompts[4] + [7, 7]]
    assert calls == [2]


@pytest.mark.parametrize("damaged", ["not json", json.dumps(dict(start=0, sequences=[[9, 9, 9, 1, 1]] * 2))])
def test_every_kept_batch_after_a_damaged_line_is_generated_again(tmp_path, monkeypatch, damaged):
    """A line that does not parse, or a record whose answers do not continue their prompts, is where the kept
    answers end: the whole batch at 0 kept before it is used, the one at 2 after it generated again (4 prompts)."""
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(4)]
    run, partial, calls, _ = _interrupted_in_its_second_batch(tmp_path, monkeypatch, prompts)
    kept = [json.dumps(dict(start=s, sequences=[p + [7, 7] for p in prompts[s : s + 2]])) for s in (0, 2)]
    partial.write_text("\n".join([kept[0], damaged, kept[1]]) + "\n")
    assert run() == [p + [7, 7] for p in prompts[:2]] + [p + [1, 1] for p in prompts[2:]]
    assert calls == [2]


def test_batches_appended_after_a_line_cut_short_are_kept_for_the_next_run(tmp_path, monkeypatch):
    """A kill cut the partial file's second line short; the next run rewrites the file to its whole lines before it
    appends, so the batch it finishes before its own interrupt is a line a third run reads (6 prompts, batch 2)."""
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(6)]
    run, partial, calls, generate_module = _interrupted_in_its_second_batch(tmp_path, monkeypatch, prompts)
    partial.write_text(json.dumps(dict(start=0, sequences=[p + [7, 7] for p in prompts[:2]])) + '\n{"start": 2, "se')
    answer = generate_module.generate

    def stopped_at_the_second(model, chunk, **kw):
        if calls:
            raise KeyboardInterrupt
        return answer(model, chunk, **kw)

    monkeypatch.setattr(generate_module, "generate", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        run()
    assert [json.loads(line)["start"] for line in partial.read_text().splitlines()] == [0, 2]


def test_a_process_with_a_cache_directory_of_its_own_leaves_no_partial_file_there(tmp_path, monkeypatch):
    """Two processes, each its own cache directory (each node its own disk): each ends with the whole cache file
    alone, process 1's partial file removed as process 0's is."""
    from tests.thread_teams import run_as_team

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate",
                        lambda model, chunk, **kw: SimpleNamespace(new_tokens=[[1, 1]] * len(chunk)))
    loaded = load_model(build_tiny_model(vocab_size=64))
    prompts = [[2 + i, 3 + i, 4 + i] for i in range(4)]
    got = run_as_team(2, lambda team: self_distill(loaded, prompts, max_new_tokens=2, batch_size=2, progress=False,
                                                   cache_dir=tmp_path / str(team.index), team=team))
    assert got == [[p + [1, 1] for p in prompts]] * 2
    files = [[p.name for p in (tmp_path / d).iterdir()] for d in ("0", "1")]
    assert files[0] == files[1] and len(files[0]) == 1 and files[0][0].endswith(".json")


def test_greedy_self_distillation_is_served_from_the_cache_whatever_the_temperature(tmp_path, monkeypatch):
    """Greedy answers do not depend on the temperature: a rerun with another one is a cache hit, not generated."""
    calls = []
    monkeypatch.setattr(importlib.import_module("specdec.generate"), "generate", lambda model, chunk, **kw:
                        calls.append(len(chunk)) or SimpleNamespace(new_tokens=[[1, 1]] * len(chunk)))
    loaded = load_model(build_tiny_model(vocab_size=64))
    common = dict(max_new_tokens=2, batch_size=2, progress=False, cache_dir=tmp_path)
    first = self_distill(loaded, [[5, 6, 7], [8, 9]], temperature=1.0, **common)
    assert self_distill(loaded, [[5, 6, 7], [8, 9]], temperature=0.5, **common) == first and calls == [2]


def test_a_text_prompt_is_encoded_with_special_tokens_or_through_the_chat_template_with_the_reply_opened():
    """Without a chat template: the tokenizer's ids with its special tokens (here a BOS, 1). With one: the template
    applied to one user message with the generation prompt (here 9) that opens the assistant's reply."""
    from specdec.train.distill import encode_prompt

    class Plain:
        chat_template = None

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]}

    class Chat(Plain):
        chat_template = "a template"

        def apply_chat_template(self, messages, add_generation_prompt, return_dict):
            assert messages == [{"role": "user", "content": "hi"}] and not return_dict
            return [1] + [ord(c) for c in messages[0]["content"]] + [9] * add_generation_prompt

    assert encode_prompt(Plain(), "hi") == [1, 104, 105]  # ord("h"), ord("i")
    assert encode_prompt(Chat(), "hi") == [1, 104, 105, 9]
