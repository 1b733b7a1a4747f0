"""Benchmark files in the acceptance suite: Spec-Bench / MT-bench question files, prompt and chat lines, CSV,
Parquet and saved datasets read with their categories; malformed records refused by line; multi-turn conversations
measured turn by turn on the model's own answers, grouped the way Spec-Bench's table groups them; resume of such
runs. Every file here is written by the test in the published layout (no third-party text)."""
from __future__ import annotations

import json
import shutil

import pytest
from specdec.eval.acceptance import Cell, SuiteConfig, cell_path
from specdec.eval.conversations import cell_turns, chat_codec, run_conversations
from specdec.eval.prompt_files import Conversation, per_category, read_prompt_file
from specdec.eval.report import markdown
from specdec.eval.spec_bench import report_rows

from specdec.errors import InputError, SpecdecError
from specdec.generate import generate

# the published layout: {"question_id", "category", "turns": [...]}; MT-bench's questions have two turns
QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["abcabcabc", "Rewrite it: abc abc"]},
    {"question_id": 2, "category": "roleplay", "turns": ["xyzxyz", "once more"], "reference": ["not used"]},
    {"question_id": 3, "category": "translation", "turns": ["hello hello"]},
    {"question_id": 4, "category": "math_reasoning", "turns": ["1+1=2, 2+2=4, 3+3="]},
]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_a_question_file_keeps_categories_and_every_turn(tmp_path):
    convs = read_prompt_file(_jsonl(tmp_path / "question.jsonl", QUESTIONS))
    assert [(c.category, c.turns) for c in convs] == [(q["category"], tuple(q["turns"])) for q in QUESTIONS]
    assert convs[0].where == f"{tmp_path / 'question.jsonl'}:1"
    assert [c.category for c in per_category(convs + convs, 1)] == [q["category"] for q in QUESTIONS]


def test_prompt_and_chat_lines(tmp_path):
    lines = [{"prompt": "one"}, {"text": "two", "category": "Open QA/1"},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "given answer"}, {"role": "user", "content": "and?"}],
              "category": "chat"}]
    convs = read_prompt_file(_jsonl(tmp_path / "p.jsonl", lines))
    assert [(c.category, c.turns, c.system) for c in convs] == [
        ("custom", ("one",), ()), ("Open_QA_1", ("two",), ()), ("chat", ("hi", "and?"), ("Be brief.",))]


def test_tables_and_saved_datasets(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "p.csv").write_text('category,question\nqa,"What is 2+2?"\nrag,"Read, then answer."\n')
    convs = read_prompt_file(tmp_path / "p.csv", column="question")
    assert [(c.category, c.turns) for c in convs] == [("qa", ("What is 2+2?",)), ("rag", ("Read, then answer.",))]
    assert convs[1].where.endswith("p.csv:3")
    with pytest.raises(InputError, match=r"p.csv:2: needs a field 'prompt'"):
        read_prompt_file(tmp_path / "p.csv", column="prompt")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(QUESTIONS[:2]), tmp_path / "q.parquet")
    assert [c.turns for c in read_prompt_file(tmp_path / "q.parquet")] == [tuple(q["turns"]) for q in QUESTIONS[:2]]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"category": "qa", "prompt": "p1"}]).save_to_disk(str(tmp_path / "saved"))
    assert [(c.category, c.turns) for c in read_prompt_file(tmp_path / "saved")] == [("qa", ("p1",))]


def test_a_csv_prompt_cut_by_an_unquoted_comma_or_an_unclosed_quote_is_refused(tmp_path):
    """A prompt holding an unquoted comma was cut there, the rest of it silently dropped ("Read, then answer." read
    as "Read"); an unclosed quote read every line after it into one prompt. Quoted, both are read whole."""
    path = tmp_path / "p.csv"
    path.write_text('prompt\nfine\nRead, then answer.\n')
    with pytest.raises(InputError, match=r"p.csv:3: 2 fields, but the header names 1; quote a field that holds a "
                                         r"comma"):
        read_prompt_file(path)
    path.write_text('prompt\nfine\n"Read, then answer.\nnext\n')
    with pytest.raises(InputError, match=r"p.csv: not valid CSV after line 2 \(unexpected end of data\)"):
        read_prompt_file(path)
    path.write_text('prompt\n"Read, then answer."\nsay "hi" now\n')
    assert [c.turns for c in read_prompt_file(path)] == [("Read, then answer.",), ('say "hi" now',)]


def test_a_folder_datasets_did_not_save_is_refused_as_such_without_datasets(tmp_path, monkeypatch):
    """Without datasets installed, any folder was answered "reading it needs datasets"; once installed, a folder it
    did not save was refused anyway."""
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "p.jsonl").write_text('{"prompt": "p1"}\n')
    with pytest.raises(InputError, match=r"prompts: not a dataset saved by datasets' save_to_disk \(no dataset_info"):
        read_prompt_file(tmp_path / "prompts")
    (tmp_path / "prompts" / "dataset_info.json").write_text("{}")
    with pytest.raises(InputError, match="prompts: reading it needs datasets: pip install datasets"):
        read_prompt_file(tmp_path / "prompts")


MALFORMED = {  # id: (line 2 of the file, what the error names)
    "not-json": ("{oops", r"q.jsonl:2: not valid JSON \(Expecting property name enclosed in double quotes\)$"),
    "plain-text": ("name a river", r"q.jsonl:2: not valid JSON \(Expecting value\); each line must be a JSON object, "
                                   r"e.g. {\"prompt\": \"...\"}"),
    "no-prompt-field": ('{"question_id": 5, "category": "qa"}', r"q.jsonl:2: needs a field one of 'turns'"),
    "turns-not-a-list": ('{"category": "qa", "turns": 5}', r"q.jsonl:2: field 'turns' must be a string or"),
    "empty-turn": ('{"category": "qa", "turns": ["ok", ""]}', r"q.jsonl:2: field 'turns\[1\]' must be a non-empty"),
    "bad-category": ('{"category": ["qa"], "turns": ["x"]}', r"q.jsonl:2: field 'category' must be a string"),
    "bad-role": ('{"messages": [{"role": "bot", "content": "x"}]}', r"q.jsonl:2: field 'messages'\[0\]"),
    "no-user": ('{"messages": [{"role": "system", "content": "x"}]}', r"q.jsonl:2: field 'messages' holds no user"),
    "an-array": ('["a list"]', r"q.jsonl:2: expected a JSON object, got list"),
    "system-after-user": ('{"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]}',
                          r"q.jsonl:2: field 'messages'\[1\]: a system message after a user turn"),
    "bool-category": ('{"category": true, "turns": ["x"]}', r"q.jsonl:2: field 'category' must be a string"),
    "key-twice": ('{"prompt": "a", "category": "qa", "prompt": "b"}', r"q.jsonl:2: holds the key 'prompt' twice in one "
                  r"object"),
    "dots-category": ('{"category": "..", "turns": ["x"]}', r"q.jsonl:2: field 'category' \"..\" has no letter"),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_a_malformed_line_is_refused_naming_file_line_and_field(tmp_path, case):
    line, match = MALFORMED[case]
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n" + line + "\n")
    with pytest.raises(InputError, match=match) as err:
        read_prompt_file(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_category_is_reduced_to_a_file_name_without_outer_dots_or_underscores():
    """" .writing. ": the spaces become "_", giving "_.writing._", whose outer "_" and "." are stripped: "writing"."""
    from specdec.eval.prompt_files import category_name

    assert category_name(" .writing. ", "q.jsonl:1") == "writing"
    assert category_name("a b/c", "q.jsonl:1") == "a_b_c" and category_name(7, "q.jsonl:1") == "7"


def test_per_category_keeps_the_first_n_of_each_and_refuses_0():
    """Categories a, b, a, a, b and n = 2: the first two a's and both b's, in file order (4 of 5)."""
    convs = [Conversation(c, (f"{c}{i}",)) for i, c in enumerate("abaab")]
    assert [c.turns[0] for c in per_category(convs, 2)] == ["a0", "b1", "a2", "b4"]
    assert per_category(convs, None) == convs
    with pytest.raises(InputError, match="prompts per category must be >= 1, got 0"):
        per_category(convs, 0)


def test_byte_order_mark_is_skipped_and_non_utf8_names_the_file(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(QUESTIONS[2]).encode() + b"\n")
    assert read_prompt_file(path)[0].turns == ("hello hello",)
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(InputError, match=f"prompt file {bad}: not UTF-8 text"):
        read_prompt_file(bad)
    with pytest.raises(InputError, match="holds no prompts"):
        read_prompt_file(_jsonl(tmp_path / "empty.jsonl", []))


def test_a_non_utf8_byte_is_named_by_its_line_and_place_in_the_file(tmp_path):
    """The offset said was counted from after a byte-order mark, 3 bytes short of the file's, and named no line."""
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'\xef\xbb\xbf{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(InputError, match=r"not UTF-8 text \(line 2, byte 15: invalid continuation byte\)"):
        read_prompt_file(bad)


def test_a_prompt_holding_a_lone_surrogate_is_refused_naming_its_line_and_field(tmp_path):
    """JSON's "\\ud800" escape without its pair reads as a lone surrogate, which the tokenizer then failed on in a
    TypeError traceback ("TextEncodeInput must be Union[...]") naming no prompt."""
    path = tmp_path / "s.jsonl"
    path.write_text('{"prompt": "fine"}\n{"turns": ["ok", "a\\ud800b"]}\n')
    with pytest.raises(InputError, match=r"s.jsonl:2: field 'turns\[1\]' holds a lone surrogate \(U\+D800 at "
                                         r"character 1, "):
        read_prompt_file(path)
    path.write_text('{"prompt": "\\ud83c\\udf19 moon"}\n')  # a pair is one character: read as it is
    assert read_prompt_file(path)[0].turns == ("\U0001f319 moon",)


def test_a_utf16_prompt_file_is_named_as_such(tmp_path):
    """Windows Notepad's "Unicode" is UTF-16: "not UTF-8 text (line 1, byte 0: invalid start byte)" said nothing of
    what the file is."""
    path = tmp_path / "q.jsonl"
    path.write_bytes('{"prompt": "hi"}\n'.encode("utf-16"))
    with pytest.raises(InputError, match=r"line 1, byte 0: invalid start byte; it is UTF-16 text, by its byte-order "
                                         r"mark: convert it to UTF-8\)$"):
        read_prompt_file(path)


def test_a_jsonl_string_holding_a_unicode_line_separator_is_one_record(tmp_path):
    """json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 as they are inside a string: the lines were
    split there too, and a valid file was refused as "not valid JSON"; lines end at \\n, \\r\\n or \\r."""
    texts = ["one\u2028two", "three\u2029four", "five\x85six", "seven"]
    path = tmp_path / "sep.jsonl"
    path.write_bytes(b"".join(json.dumps({"prompt": t}, ensure_ascii=False).encode() + end
                              for t, end in zip(texts, (b"\n", b"\r\n", b"\r", b"\n"), strict=True)))
    conversations = read_prompt_file(path)
    assert [c.turns for c in conversations] == [(t,) for t in texts]
    assert [c.where.rsplit(":", 1)[1] for c in conversations] == ["1", "2", "3", "4"]


@pytest.fixture(scope="module")
def loaded(eval_tiny_model):
    return eval_tiny_model


def _config(**kw):
    cats = tuple(dict.fromkeys(q["category"] for q in QUESTIONS))
    return SuiteConfig((("ngram", {}),), cats, max_new_tokens=kw.pop("max_new_tokens", 8), hf_baseline=False,
                       calibration_repeats=0, **kw)


CONVS = [Conversation(q["category"], tuple(q["turns"])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, loaded):
    out = tmp_path_factory.mktemp("conversations")
    return out, run_conversations(loaded, CONVS, chat_codec(loaded), _config(), out)


def test_second_turns_are_built_from_the_models_own_first_answer(loaded, finished):
    out, cells = finished
    names = cell_turns(CONVS)
    assert list(names) == ["writing.turn1", "writing.turn2", "roleplay.turn1", "roleplay.turn2", "translation",
                           "math_reasoning"]
    assert set(cells) == {(label, name) for label in ("plain", "ngram") for name in names}
    codec = chat_codec(loaded)
    shown = json.loads((out / "conversations.json").read_text())["conversations"]
    for conv, record in zip(CONVS[:2], shown[:2], strict=True):
        first = codec.encode([{"role": "user", "content": conv.turns[0]}])
        answer = generate(loaded, [first], max_new_tokens=8, return_dict=True).new_tokens[0]  # plain greedy
        assert record["turns"][0]["prompt_ids"] == first
        assert record["turns"][0]["answer"] == codec.decode(list(answer))
        # turn 2 = turn 1, the model's answer, then the new user turn
        history = [{"role": "user", "content": conv.turns[0]}, {"role": "assistant", "content": codec.decode(
            list(answer))}, {"role": "user", "content": conv.turns[1]}]
        assert record["turns"][1]["prompt_ids"] == codec.encode(history)
        assert record["turns"][1]["prompt_ids"][len(first) + 1:][: len(answer)] == list(answer)
    for name in names:  # greedy: every drafter's tokens are plain's, turn by turn
        assert cells["ngram", name].output_sha256 == cells["plain", name].output_sha256
        assert cells["plain", name].prompts == 1 and cells["plain", name].new_tokens == 8
    # a conversation's last turn has no next turn to answer for: no answer is decoded for it
    assert [[t["answer"] is None for t in r["turns"]] for r in shown] == [[False, True], [False, True], [True], [True]]


def test_report_groups_mt_bench_and_lists_its_categories(finished):
    out, cells = finished
    rows = report_rows(cells, cell_turns(CONVS))
    level = {r["category"]: r["level"] for r in rows}
    assert level == {"writing.turn1": "turn", "writing.turn2": "turn", "writing": "category", "roleplay.turn1": "turn",
                     "roleplay.turn2": "turn", "roleplay": "category", "translation": "category",
                     "math_reasoning": "category", "mt_bench": "group", "overall": "overall"}
    by = {(r["drafter"], r["category"]): r for r in rows}
    turns = [cells["ngram", n] for n in ("writing.turn1", "writing.turn2", "roleplay.turn1", "roleplay.turn2")]
    mt = by["ngram", "mt_bench"]
    assert mt["new_tokens"] == sum(c.new_tokens for c in turns) and mt["steps"] == sum(c.steps for c in turns)
    assert mt["tau"] == pytest.approx(mt["new_tokens"] / mt["steps"])
    assert by["plain", "overall"]["new_tokens"] == 6 * 8 and by["ngram", "overall"]["identical_to_plain"] is True
    text = markdown(rows, {})
    summary = text[text.index("## Summary"):text.index("## MT-bench by category")]
    assert "| drafter | mt_bench | translation | math_reasoning | overall |" in summary
    assert "| drafter | writing | roleplay |" in text and "## writing.turn2" in text
    # categories that are not MT-bench's (a built-in "math", say) form no mt_bench group
    alone = report_rows(cells, cell_turns(CONVS), mt_bench=())
    assert "mt_bench" not in {r["category"] for r in alone} and "MT-bench by category" not in markdown(alone, {})


def test_a_merged_row_lists_each_of_its_categories_once():
    """Hand-built cells: writing's two turns (10 tokens / 5 steps, 6 / 3) and a one-turn roleplay (4 / 4). writing
    merges to 16 / 8 = tau 2.0, mt_bench to 20 / 12; mt_bench and overall list writing once, not once per turn."""
    turns = {"writing.turn1": ("writing", 1), "writing.turn2": ("writing", 2), "roleplay": ("roleplay", 1)}
    sizes = {"writing.turn1": (10, 5), "writing.turn2": (6, 3), "roleplay": (4, 4)}
    cells = {("plain", n): Cell("plain", n, prompts=1, new_tokens=t, steps=s) for n, (t, s) in sizes.items()}
    by = {r["category"]: r for r in report_rows(cells, turns)}
    assert by["writing"]["tau"] == pytest.approx(2.0) and by["mt_bench"]["new_tokens"] == 20
    assert by["mt_bench"]["tau"] == pytest.approx(20 / 12)
    assert by["mt_bench"]["categories"] == by["overall"]["categories"] == ["writing", "roleplay"]


def test_mt_bench_lists_its_categories_in_mt_benchs_order_not_the_files():
    """A file with roleplay before writing: mt_bench's categories read writing, roleplay (MT-bench's order, that of
    its table), overall's keep the file's."""
    turns = {"roleplay": ("roleplay", 1), "writing": ("writing", 1)}
    cells = {("plain", n): Cell("plain", n, prompts=1, new_tokens=4, steps=4) for n in turns}
    by = {r["category"]: r for r in report_rows(cells, turns)}
    assert by["mt_bench"]["categories"] == ["writing", "roleplay"]
    assert by["overall"]["categories"] == ["roleplay", "writing"]


def test_multi_turn_runs_resume_and_refuse_other_conversations(loaded, finished, tmp_path):
    src, _ = finished
    out = tmp_path / "run"
    shutil.copytree(src, out)
    kept = cell_path(out, "ngram", "writing.turn1").read_bytes()
    cell_path(out, "ngram", "roleplay.turn2").unlink()
    cells = run_conversations(loaded, CONVS, chat_codec(loaded), _config(), out, resume=True)
    assert cell_path(out, "ngram", "writing.turn1").read_bytes() == kept  # reused, not measured again
    assert cells["ngram", "roleplay.turn2"].output_sha256 == cells["plain", "roleplay.turn2"].output_sha256
    other = [*CONVS[:1], Conversation("roleplay", ("xyzxyz", "another second turn")), *CONVS[2:]]
    with pytest.raises(SpecdecError, match="prompts_sha256"):
        run_conversations(loaded, other, chat_codec(loaded), _config(), out, resume=True)
