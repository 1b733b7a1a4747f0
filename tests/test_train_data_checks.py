"""Training inputs that were dropped, ignored or cut without a word: mixed and malformed records, a key twice on a
JSON Lines line, options a run does nothing with, prompts --seq-len cuts the answers off, and reports of rates
measured over no position or of a run whose history is gone."""
from __future__ import annotations

import json
import logging
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from specdec.train.config import TrainConfig  # noqa: E402
from specdec.train.data import TrainDataError, load_texts  # noqa: E402
from specdec.train.pipeline import read_inputs, run_training  # noqa: E402

from specdec.cli import main  # noqa: E402
from specdec.errors import InputError  # noqa: E402
from specdec.testing import build_tiny_model  # noqa: E402
from tests.test_train_data import ChatTok, _jsonl, training_dir  # noqa: E402

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return training_dir(tmp_path_factory.mktemp("tiny_checks"))


def test_a_file_may_mix_texts_and_chat_messages(tmp_path):
    """The text column was taken for every record as soon as one record had it: records holding messages were
    dropped without a word. Each record is now read as what it holds, in file order."""
    f = _jsonl(tmp_path / "d.jsonl", [{"text": "plain one"}, {"messages": CHAT}, {"text": "  "}, {"text": "two"}])
    assert load_texts(f, tokenizer=ChatTok()) == ["plain one", "<user>hi<assistant>yo", "two"]
    with pytest.raises(TrainDataError, match="holds chat messages but the model's tokenizer has no chat template"):
        load_texts(f)


@pytest.mark.parametrize("rows,match", [
    ([{"text": "fine"}, {"text": 1000}], "line 2: 'text' must be a string, got int"),
    ([{"text": "fine"}, {"text": None}], "line 2 has neither a 'text' string nor 'messages'"),
    ([{"text": "fine"}, {"other": "typo"}], "line 2 has neither a 'text' string nor 'messages'"),
    ([{"text": "fine"}, {"messages": "hi"}], "line 2: 'messages' must be a list of {role, content} (or "
     "ShareGPT's {from, value})"),
    ([{"text": "fine"}, {"messages": [{"role": None, "content": "hi"}]}], "line 2: message 0's role must be a "
     "string, got NoneType"),
    ([{"text": "fine"}, {"messages": [*CHAT, {"role": 3, "content": "hi"}]}], "line 2: message 2's role must be a "
     "string, got int"),
])
def test_a_record_that_is_neither_a_text_nor_messages_is_named(tmp_path, rows, match):
    """A record whose text was a number or null, or that held neither field, was dropped (rc 0); now it is one
    line naming the file and the record. A message whose role is not a string failed in the chat template
    ("'dict object' has no attribute 'role'" for null), naming no message."""
    f = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(TrainDataError) as err:
        load_texts(f, tokenizer=ChatTok())
    assert str(err.value) == f"{f} {match}"


def test_a_bad_jsonl_record_is_named_by_its_line_and_a_datasets_record_by_its_index(tmp_path):
    """A .jsonl record was named by its index from 0 among the non-blank lines ("record 1" for the third line below)
    while the same file's other errors name lines from 1 ("line 2 holds the key 'text' twice"): the user opened the
    wrong line. A .jsonl record is named by its line now; a .json / .parquet record keeps datasets' index."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n\n{"text": 5}\n')
    with pytest.raises(TrainDataError) as err:
        load_texts(str(f))
    assert str(err.value) == f"{f} line 3: 'text' must be a string, got int"
    g = tmp_path / "d.json"
    g.write_text(json.dumps([{"text": "fine"}, {"text": None}]))
    with pytest.raises(TrainDataError) as err:
        load_texts(str(g))
    assert str(err.value) == f"{g} record 1 has neither a 'text' string nor 'messages'"


def test_a_key_twice_on_a_jsonl_line_names_the_line_and_the_key(tmp_path):
    """datasets refuses a record holding a key twice with "Trailing data at position 47", naming neither."""
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "other"}\n{"text": "first value", "text": "second value"}\n')
    with pytest.raises(TrainDataError) as err:
        load_texts(str(f))
    assert str(err.value) == f"cannot read training data {f}: line 2 holds the key 'text' twice in one object"


@pytest.mark.parametrize("argv,settings,match", [
    (["--loss", "kl"], dict(loss="kl"), r"loss 'kl' \(--loss\) is train-medusa's"),
    (["--arch", "eagle3", "--reg-weight", "5"], dict(eagle_arch="eagle3", reg_weight=5.0),
     r"reg_weight \(--reg-weight\) weighs EAGLE-1's feature regression and --arch eagle3 has none"),
    (["--num-prompts", "3"], dict(num_prompts=3), r"num_prompts \(--num-prompts\) limits the self-distillation"),
])
def test_options_a_run_ignores_are_refused(tiny, tmp_path, capsys, argv, settings, match):
    """train-eagle --loss kl trained the same weights as --loss ce, --reg-weight did nothing under --arch eagle3,
    and --num-prompts did nothing with --data; each is refused in one line (exit 2), by the CLI and the config."""
    rc = main(["train-eagle", "--model", str(tiny / "model"), "--data", str(tiny / "data.jsonl"), "--output-dir",
               str(tmp_path / "run"), "--seq-len", "16", "--max-steps", "1", "--no-eval-tau", "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("specdec train-eagle: error: ")
    with pytest.raises(ValueError, match=match):
        TrainConfig(model="m", output_dir=str(tmp_path), drafter="eagle", data="d.jsonl", **settings)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["train-medusa", "train-eagle"])
def test_prompts_the_tokenizer_makes_nothing_of_are_refused_before_training(tmp_path, capsys, monkeypatch, command):
    """A GGUF target whose vocabulary holds no piece of the built-in tau prompts trained, then failed with "prompt 0 is
    empty", a prompt the user never gave, and no report: now refused in one line naming the prompt, before the
    output folder is made; --no-eval-tau trains on it. Self-distillation's prompts (a --prompts-file's, the built-in
    set) were refused only once the output folder was made (--overwrite had cleared the earlier run): now before."""
    pytest.importorskip("gguf")
    from tests.test_gguf_llama import write_llama_gguf

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "m.gguf")  # tokens t0 .. t47
    _jsonl(tmp_path / "data.jsonl", [{"text": "".join(f"t{(7 * i + j) % 45 + 3}" for j in range(30))}
                                     for i in range(12)])
    args = [command, "--model", str(path), "--data", str(tmp_path / "data.jsonl"), "--seq-len", "16", "--batch-size",
            "4", "--max-steps", "1", "--no-progress"]
    rc = main([*args, "--output-dir", str(tmp_path / "run"), "--eval-prompts", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith(f"specdec {command}: error: the model's tokenizer encodes the tau measurement's "
                                      "built-in prompt '") and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    assert main([*args, "--output-dir", str(tmp_path / "quiet"), "--no-eval-tau"]) == 0
    capsys.readouterr()
    (tmp_path / "prompts.txt").write_text("hello\nworld\n")
    distilled = [command, "--model", str(path), "--seq-len", "16", "--max-steps", "1", "--no-progress", "--no-eval-tau",
                 "--output-dir", str(tmp_path / "run")]
    for source, what in ((["--prompts-file", str(tmp_path / "prompts.txt")],
                          f"prompt 1 of prompts file {tmp_path / 'prompts.txt'} 'hello'"),
                         ([], "prompt 1 of the built-in set '")):
        assert main([*distilled, *source]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"specdec {command}: error: the model's tokenizer encodes {what}") and \
            len(err.splitlines()) == 1, err
        assert not (tmp_path / "run").exists()


def test_options_that_act_are_still_accepted(tmp_path):
    TrainConfig(model="m", output_dir=str(tmp_path), loss="kl")  # Medusa
    TrainConfig(model="m", output_dir=str(tmp_path), drafter="eagle", reg_weight=5.0)  # EAGLE-1
    TrainConfig(model="m", output_dir=str(tmp_path), prompts_file="p.txt", num_prompts=3)
    TrainConfig(model="m", output_dir=str(tmp_path), num_prompts=3)  # the built-in prompts


@pytest.mark.parametrize("command", ["train-medusa", "train-eagle"])
def test_a_model_without_a_tokenizer_is_refused_in_one_line(tiny, tmp_path, capsys, command):
    """A checkpoint saved without its tokenizer files failed in the middle of reading --data with a TypeError
    traceback ('NoneType' object is not callable): every source of training text needs the tokenizer."""
    build_tiny_model(vocab_size=64).save_pretrained(tmp_path / "bare")
    rc = main([command, "--model", str(tmp_path / "bare"), "--data", str(tiny / "data.jsonl"), "--seq-len", "16",
               "--max-steps", "1", "--output-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err == (f"specdec {command}: error: model {tmp_path / 'bare'} has no tokenizer, and training "
                               "reads text (its data or the prompts the target answers): save the model's tokenizer "
                               "files beside it"), err
    assert not (tmp_path / "run").exists()


def test_a_prompts_file_that_is_a_directory_is_named_as_such(tiny, tmp_path, capsys):
    """`--prompts-file DIR` said "prompts file not found: DIR" of a directory that is there."""
    (tmp_path / "prompts").mkdir()
    rc = main(["train-medusa", "--model", str(tiny / "model"), "--prompts-file", str(tmp_path / "prompts"),
               "--output-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"specdec train-medusa: error: prompts file {tmp_path / 'prompts'} is a directory; "
                               "give the file that holds the prompts, one per line"), err
    assert not (tmp_path / "run").exists()


def test_a_prompts_file_that_is_not_utf8_names_the_line(tiny, tmp_path, capsys):
    """A --prompts-file byte that is no UTF-8 was said as an offset into the file ("byte 12"), with no line; --data
    names the line and the byte in it."""
    (tmp_path / "prompts.txt").write_bytes("write a poem\ncaf\xe9 time\n".encode("latin-1"))
    rc = main(["train-medusa", "--model", str(tiny / "model"), "--prompts-file", str(tmp_path / "prompts.txt"),
               "--output-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err == (f"specdec train-medusa: error: prompts file {tmp_path / 'prompts.txt'} is not UTF-8 "
                               "text (line 2, byte 3: invalid continuation byte)"), err


def test_a_prompts_file_with_a_byte_order_mark_names_the_line_of_a_non_utf8_byte(tiny, tmp_path, capsys):
    """Counted from after the mark, the place was 3 bytes short: a byte 1 of line 2 was said as line 1, byte 10."""
    (tmp_path / "prompts.txt").write_bytes(b"\xef\xbb\xbfwrite a poem\nc\xe9 time\n")
    rc = main(["train-medusa", "--model", str(tiny / "model"), "--prompts-file", str(tmp_path / "prompts.txt"),
               "--output-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.endswith("is not UTF-8 text (line 2, byte 1: invalid continuation byte)"), err


def _distil_cfg(tiny, tmp_path, prompts: list[str], **kw) -> TrainConfig:
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    base = dict(model=str(tiny / "model"), output_dir=str(tmp_path / "run"), prompts_file=str(tmp_path / "prompts.txt"),
                drafter="eagle", draft_vocab=None, eagle_steps=2, seq_len=12, batch_size=4, max_steps=1,
                distill_max_new_tokens=4, distill_batch_size=8, eval_tau=False, progress=False, held_out_fraction=0.0)
    return TrainConfig(**{**base, **kw})


def test_prompts_as_long_as_seq_len_are_refused_before_distilling(tiny, tmp_path, monkeypatch):
    """Sequences are cut from their start: with every prompt at least --seq-len tokens long no answer token was
    kept, and the report gave a response top-1 of 0.0 over no position. Refused before the target answers."""
    from specdec.train import distill

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(distill, "self_distill", lambda *a, **k: pytest.fail("distilled"))
    with pytest.raises(TrainDataError) as err:
        run_training(_distil_cfg(tiny, tmp_path, ["a" * 12, "b" * 20]))  # one token per character
    assert str(err.value) == ("--seq-len 12 is too short for the prompts: sequences are cut from their start, so no "
                              "answer token would be kept (the longest prompt has 20 tokens)")


def test_answers_past_the_context_are_refused_naming_the_flag_before_distilling(tiny, tmp_path, monkeypatch):
    """--distill-max-new-tokens that carried the answers past the model's context ended in generate()'s refusal at
    the first batch, naming max_new_tokens, a name the command line does not have. Refused before the target
    answers, naming the flag and the most it may be."""
    from specdec.train import distill

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(distill, "self_distill", lambda *a, **k: pytest.fail("distilled"))
    with pytest.raises(InputError) as err:
        run_training(_distil_cfg(tiny, tmp_path, ["abc", "defgh"], distill_max_new_tokens=600))
    assert str(err.value) == ("the longest prompt: its 5 tokens + --distill-max-new-tokens 600 exceed the model's "
                              "context of 512 tokens; lower --distill-max-new-tokens to 507 or less")


def test_tau_answers_past_the_context_are_refused_before_training(tiny, tmp_path):
    """The tau measurement after training answers its built-in prompts in --eval-max-new-tokens: past the model's
    context it ended a finished training in generate()'s refusal, without a report. Refused before the output
    folder is made, naming the flag."""
    cfg = _distil_cfg(tiny, tmp_path, ["abc"], eval_tau=True, eval_prompts=2, eval_max_new_tokens=600)
    with pytest.raises(InputError, match=r"^the longest tau-measurement prompt: its \d+ tokens \+ "
                                         r"--eval-max-new-tokens 600 exceed the model's context of 512 tokens; "
                                         r"lower --eval-max-new-tokens to \d+ or less, or pass --no-eval-tau$"):
        run_training(cfg)
    assert not (tmp_path / "run").exists()


def test_prompts_that_lose_their_answers_are_counted_in_a_warning(tiny, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="specdec.train.pipeline"):
        run_training(_distil_cfg(tiny, tmp_path, ["abc", "defg", "h" * 12, "i" * 15]))
    assert ("2 of 4 self-distilled sequences keep no answer token: their prompts are at least --seq-len (12) tokens "
            "long (the longest has 15)") in caplog.text


def test_a_rate_over_no_position_is_none_and_the_tree_comes_from_what_was_measured(tmp_path):
    """Held-out sequences that are all prompt (the answers cut off) gave response top-1 0.0 per depth, and the tree
    without timing came from those zeros. Now those rates are None ("n/a" in report.md) and the tree comes from the
    all-position top-1."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.train.eagle_evaluate import tree_from_accuracies
    from specdec.train.eagle_report import finish_eagle

    torch.manual_seed(0)
    model = build_tiny_model()
    eagle = EagleModel(EagleConfig.for_target(model.config))
    seqs = [[(i * 5 + j) % 90 + 1 for j in range(10)] for i in range(3)]
    cfg = TrainConfig(model="m", output_dir=str(tmp_path), drafter="eagle", eagle_steps=2, eval_tau=False)
    loaded = SimpleNamespace(model=model, tokenizer=None, name="tiny")
    times = {"start": 0, "data": 0, "train": 0}
    all_prompt = {tuple(s): len(s) + 5 for s in seqs}  # prompts longer than the (cut) sequences
    report = finish_eagle(cfg, loaded, eagle, [{"step": 1, "loss": 2.5}], seqs, seqs, {"size": None}, times,
                          SimpleNamespace(device="cpu", num_processes=1), all_prompt)
    assert report["response_top1"] == [None, None] and report["response_top5"] == [None, None]
    assert None not in report["top1"] and report["tree_choice"]["accuracies"] == "top1"
    tree = tree_from_accuracies(report["top1"], 2)[0]
    assert (report["tree"]["depth"], report["tree"]["top_k"], report["tree"]["max_nodes"]) == tree
    md = (tmp_path / "report.md").read_text()
    assert "final loss 2.5000" in md and "| n/a | n/a |" in md
    assert json.loads((tmp_path / "report.json").read_text())["response_top1"] == [None, None]


def test_resuming_a_finished_run_whose_history_is_gone_writes_its_report(tiny, tmp_path):
    """render_markdown formatted the final loss of a resumed run without history.jsonl (None) as a float: a
    TypeError after report.json, and no report.md. A Medusa head no held-out position reaches (sequences of 3
    tokens, head 2 predicts the 4th) has no accuracy either: None, not 0.0."""
    cfg = dict(model=str(tiny / "model"), output_dir=str(tmp_path / "run"), data=str(tiny / "data.jsonl"),
               num_heads=3, seq_len=3, batch_size=4, max_steps=2, save_every=2, eval_tau=False, progress=False,
               held_out_fraction=0.2)
    first = run_training(TrainConfig(**cfg))
    assert first["seconds"]["resumed_from_step"] is None
    assert "resumed" not in (tmp_path / "run" / "report.md").read_text()
    (tmp_path / "run" / "history.jsonl").unlink()
    (tmp_path / "run" / "report.md").unlink()
    report = run_training(TrainConfig(**cfg, resume=True))
    assert report["final_loss"] is None and report["top1"][2] is None and report["top1"][0] is not None
    md = (tmp_path / "run" / "report.md").read_text()
    assert "final loss n/a" in md and "| 2 | t+4 | n/a | n/a |" in md
    assert report["steps"] == 2 and "2 steps on" in md  # the checkpoint's: "0 steps" for heads trained 2
    # its training seconds are this run's (none of the 2 steps), and the report says so rather than pass them for all
    # (a second on a loaded machine: the wall time is no test's to pin)
    assert report["seconds"]["resumed_from_step"] == 2
    assert re.search(r"training \d+ s \(this run's, resumed at step 2\)", md), md


def test_an_eagle_report_without_a_final_loss_renders():
    from specdec.train.eagle_report import render_markdown

    report = {"config": {"eagle_steps": 1}, "draft_vocab": {}, "model": "m", "steps": 3, "train_sequences": 1,
              "processes": 1, "final_loss": None, "held_out_sequences": 1, "top1": [0.5], "top5": [0.7],
              "tree_measurements": [], "tree": {"depth": 1, "top_k": 1, "max_nodes": 1},
              "seconds": {"data": 1, "train": 1, "eval": 1, "total": 3}}
    assert "3 steps on 1 sequences (1 process(es)); final loss n/a" in render_markdown(report)


def test_content_given_as_text_parts_is_trained_on_as_its_text(tmp_path):
    """Content as a list of parts (OpenAI's and transformers' ``[{"type": "text", "text": ...}]``) reached the chat
    template as a list, which rendered its Python repr, trained on without a word. The text parts are joined now;
    a part that is not text, or content of another type, is one line naming the record."""
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]
    f = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": [{"role": "user", "content": parts}, CHAT[1]]}])
    assert load_texts(f, tokenizer=ChatTok()) == ["<user>hi<assistant>yo", "<user>hi there<assistant>yo"]
    for content, match in (
            ([parts[0], {"type": "image_url", "image_url": {"url": "x.png"}}],
             "line 2: message 0's content part 1 is of type 'image_url': only text parts"),
            ([{"type": "text", "text": 5}], "line 2: message 0's content part 0 has no 'text' string"),
            ({"text": "hi"}, "line 2: message 0's content must be a string, null or a list of text parts")):
        f = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": [{"role": "user", "content": content}]}])
        with pytest.raises(TrainDataError, match=match):
            load_texts(f, tokenizer=ChatTok())


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")


@pytest.mark.parametrize("messages,cause", [
    ([{"role": "system", "content": "be brief"}, *CHAT],
     "TemplateError: Conversation roles must alternate user/assistant/user/assistant/..."),
    ([], "ValueError: Cannot apply chat template to an empty conversation"),
])
def test_a_record_the_chat_template_cannot_render_is_named(tmp_path, messages, cause):
    """A record the model's chat template refuses (roles that do not alternate, no message) gave jinja2's traceback
    or transformers' message naming no record; now one line naming the file, the record and the template's error."""
    from tests.test_train_data import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = ALTERNATING
    f = _jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": messages}])
    with pytest.raises(TrainDataError) as err:
        load_texts(f, tokenizer=tok)
    assert str(err.value).startswith(f"{f} line 2: the tokenizer's chat template cannot render its 'messages' "
                                     f"({cause}") and len(str(err.value).splitlines()) == 1


def test_chat_records_after_the_first_ten_megabytes_of_texts_load(tmp_path):
    """datasets' JSON reader fixes the columns from the file's first 10 MB: a file mixing texts and chat messages
    (documented as legal) failed with "CastError: Couldn't cast" once a chat record, or a message with a key more,
    came after that. JSON Lines files are read record by record now; a .json file says what to do."""
    filler = "lorem ipsum dolor sit amet " * 16
    rows = [{"text": f"record {i} {filler}"} for i in range(24_000)]  # about 11 MB
    rows += [{"messages": CHAT}, {"messages": [{"role": "user", "content": "late", "name": "bob"}]}]
    f = _jsonl(tmp_path / "d.jsonl", rows)
    texts = load_texts(f, tokenizer=ChatTok())
    assert len(texts) == len(rows) and texts[-2:] == ["<user>hi<assistant>yo", "<user>late"]
    (tmp_path / "d.json").write_text((tmp_path / "d.jsonl").read_text())
    with pytest.raises(TrainDataError, match=r"CastError: .* name the file \.jsonl, which is read record by record"):
        load_texts(str(tmp_path / "d.json"), tokenizer=ChatTok())


@pytest.mark.parametrize("rows,match", [
    ([{"body": "x"}, {"other": 1}], r"has neither a 'text' nor a 'messages' field \(columns: \['body', 'other'\]\)"),
    ([{"body": "x"}, {"text": "fine"}], "line 1 has neither a 'text' string nor 'messages'"),
    ([{"text": "fine"}, ["not", "an", "object"]], "line 2 is a JSON list, not an object"),
])
def test_jsonl_records_without_the_fields_are_named_as_before(tmp_path, rows, match):
    f = _jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(TrainDataError, match=match):
        load_texts(f, tokenizer=ChatTok())


def test_more_prompts_asked_for_than_there_are_are_said(tmp_path, caplog):
    """--num-prompts beyond a --prompts-file's lines, and --eval-prompts beyond the held-out chat prompts, ran on
    fewer with no word (report.json's config records the number asked for, its counts the number used)."""
    from specdec.eval.prompts import CHAT
    from specdec.train.config import TrainConfig
    from specdec.train.evaluate import eval_prompts, say_few_eval_prompts
    from specdec.train.pipeline import read_inputs

    (tmp_path / "prompts.txt").write_text("one\n\ntwo\nthree\n")
    cfg = TrainConfig(model="m", output_dir=str(tmp_path / "run"), prompts_file=str(tmp_path / "prompts.txt"),
                      num_prompts=10)
    with caplog.at_level(logging.WARNING):
        assert read_inputs(cfg, None) == ["one", "two", "three"]
        assert eval_prompts(1000) == list(CHAT)
        say_few_eval_prompts(1000)
    assert f"--num-prompts 10: prompts file {tmp_path / 'prompts.txt'} holds 3 prompts; using all 3" in caplog.text
    assert f"--eval-prompts 1000: there are {len(CHAT)} held-out chat prompts; using all {len(CHAT)}" in caplog.text


def test_a_prompts_file_that_starts_with_a_byte_order_mark_gives_its_first_prompt_without_it(tmp_path):
    """Editors on Windows write UTF-8 with a BOM (--data reads past it): the first prompt reached the target with
    U+FEFF in front of it, which str.strip() keeps."""
    (tmp_path / "prompts.txt").write_bytes(b"\xef\xbb\xbfwrite a poem\r\n\r\nname a river\r\n")
    cfg = TrainConfig(model="m", output_dir=str(tmp_path / "run"), prompts_file=str(tmp_path / "prompts.txt"))
    assert read_inputs(cfg, None) == ["write a poem", "name a river"]


def test_a_prompt_holding_a_unicode_line_separator_or_a_form_feed_stays_one_prompt(tmp_path):
    """str.splitlines() cut a line at U+2028, U+2029, U+0085 or a form feed too: one prompt trained on as two; a
    line ends at \\n, \\r\\n or \\r."""
    prompts = ["one\u2028two", "three\x0cfour", "five\x85six", "seven"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts[:2]) + "\r\n" + "\r".join(prompts[2:]), encoding="utf-8",
                                          newline="")
    cfg = TrainConfig(model="m", output_dir=str(tmp_path / "run"), prompts_file=str(tmp_path / "prompts.txt"))
    assert read_inputs(cfg, None) == prompts


def test_medusa_scores_responses_alone_and_chooses_its_tree_from_them(tmp_path):
    """Self-distilled Medusa heads were scored, and their saved tree chosen, over every position: the chat template,
    which repeats in every sequence and is easy to predict, promised more than drafting a reply gets (EAGLE's
    report already kept the responses apart)."""
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
    from specdec.train.choices import choose_tree
    from specdec.train.evaluate import head_accuracies
    from specdec.train.pipeline import _finish_medusa

    torch.manual_seed(0)
    model = build_tiny_model()
    heads = MedusaHeads(MedusaConfig(2, 1, model.config.hidden_size, model.config.vocab_size))
    seqs = [[(i * 5 + j) % 90 + 1 for j in range(12)] for i in range(3)]
    whole = head_accuracies(model, heads, seqs)
    assert head_accuracies(model, heads, seqs, starts=[0, 0, 0]) == whole
    part = head_accuracies(model, heads, seqs, starts=[6, 6, 6])
    # head 0 scores the target's tokens at 2..12 of each sequence (12: the one after it); from the response on, 6..12
    assert (whole["positions"], part["positions"]) == ([33.0, 30.0], [21.0, 21.0])
    assert part["rank_acc"] != whole["rank_acc"]
    cfg = TrainConfig(model="m", output_dir=str(tmp_path), tree_budget=6, eval_tau=False)
    loaded = SimpleNamespace(model=model, tokenizer=None, name="tiny")
    report = _finish_medusa(cfg, loaded, model, heads, [{"step": 1, "loss": 2.5}], seqs, seqs,
                            SimpleNamespace(device="cpu", num_processes=1), {"start": 0, "data": 0, "train": 0},
                            {tuple(s): 6 for s in seqs})
    assert report["tree_accuracies"] == "responses" and report["rank_acc"] == part["rank_acc"]
    assert report["medusa_choices"] == [list(c) for c in choose_tree(part["rank_acc"], 6)[0]]
    assert report["response_top1"] == pytest.approx(part["top1"]) and report["top1"] == pytest.approx(whole["top1"])
    md = (tmp_path / "report.md").read_text()
    assert "| top-1, responses only |" in md and "from the responses accuracies" in md


def test_reports_score_all_positions_and_the_responses_in_one_forward_of_the_target(tmp_path, monkeypatch):
    """train-medusa and train-eagle scored the held-out data twice (all positions, then the responses alone), each
    time running the target (and Medusa's heads) over all of it. One forward now gives both tallies, and each equals
    its own pass."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads
    from specdec.train import eagle_evaluate, evaluate
    from specdec.train.eagle_report import finish_eagle
    from specdec.train.pipeline import _finish_medusa

    torch.manual_seed(0)
    model = build_tiny_model()
    heads = MedusaHeads(MedusaConfig(2, 1, model.config.hidden_size, model.config.vocab_size))
    eagle = EagleModel(EagleConfig.for_target(model.config))
    seqs = [[(i * 5 + j) % 90 + 1 for j in range(12)] for i in range(3)]  # one batch of the default 4
    starts = {tuple(s): 6 for s in seqs}
    apart = (evaluate.head_accuracies(model, heads, seqs), evaluate.head_accuracies(model, heads, seqs, starts=[6] * 3),
             eagle_evaluate.eagle_accuracies(model, eagle, seqs, 2),
             eagle_evaluate.eagle_accuracies(model, eagle, seqs, 2, starts=[6] * 3))
    forwards = []
    for module in (evaluate, eagle_evaluate):
        real = module.target_features
        monkeypatch.setattr(module, "target_features", lambda *a, _real=real, **k: forwards.append(1) or _real(*a, **k))
    head_calls = []  # head 0's forward: once a batch too, whatever the scopes
    real_head = heads.heads[0].forward
    monkeypatch.setattr(heads.heads[0], "forward", lambda x: head_calls.append(1) or real_head(x))
    layer_calls = []  # the EAGLE layer's passes: once a batch and depth too
    real_layer = eagle.forward
    monkeypatch.setattr(eagle, "forward", lambda *a, **k: layer_calls.append(1) or real_layer(*a, **k))
    loaded = SimpleNamespace(model=model, tokenizer=None, name="tiny")
    accelerator, times = SimpleNamespace(device="cpu", num_processes=1), {"start": 0, "data": 0, "train": 0}
    medusa = _finish_medusa(TrainConfig(model="m", output_dir=str(tmp_path / "m"), tree_budget=6, eval_tau=False),
                            loaded, model, heads, [{"step": 1, "loss": 2.5}], seqs, seqs, accelerator, times, starts)
    assert len(forwards) == 1 and len(head_calls) == 1
    cfg = TrainConfig(model="m", output_dir=str(tmp_path / "e"), drafter="eagle", eagle_steps=2, eval_tau=False)
    eagle_out = finish_eagle(cfg, loaded, eagle, [{"step": 1, "loss": 2.5}], seqs, seqs, {"size": None}, times,
                             accelerator, starts)
    assert len(forwards) == 2 and len(layer_calls) == 2  # eagle_steps=2, one batch, two scopes
    got = (medusa["top1"], medusa["response_top1"], eagle_out["top1"], eagle_out["response_top1"])
    assert list(got) == [r["top1"] for r in apart]
    assert evaluate.scoped_head_accuracies(model, heads, seqs, [None, [6] * 3]) == list(apart[:2])
    assert eagle_evaluate.scoped_eagle_accuracies(model, eagle, seqs, 2, [None, [6] * 3]) == list(apart[2:])


def test_generates_warnings_name_the_train_option_that_set_the_count_of_new_tokens(tiny, tmp_path, monkeypatch,
                                                                                     caplog):
    """A model whose generation_config asks more new tokens (min_new_tokens) than a train run's answers hold: the
    warning said "max_new_tokens=4", generate()'s argument, where the user typed --distill-max-new-tokens (and
    --eval-max-new-tokens for the tau measurement)."""
    import shutil

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny / "model", model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "min_new_tokens": 50}))
    cfg = _distil_cfg(tiny, tmp_path, ["abc", "defg"], model=str(model), drafter="medusa", num_heads=2, eagle_steps=3,
                      eval_tau=True, eval_prompts=2, eval_max_new_tokens=6)
    with caplog.at_level(logging.WARNING):
        run_training(cfg)
    said = {r.getMessage() for r in caplog.records if "min_new_tokens" in r.getMessage()}
    assert said == {f"min_new_tokens=50 is more than {flag} allows, so EOS is never allowed: every sequence runs to "
                    f"{flag.split()[0]}" for flag in ("--distill-max-new-tokens 4", "--eval-max-new-tokens 6")}


def test_the_tree_choices_warm_up_leaves_generates_warnings_to_the_timed_runs(monkeypatch, caplog):
    """The warm-up asks fewer new tokens than --eval-max-new-tokens: its own warning about them ("max_new_tokens=8")
    named a count the user never gave, before the timed runs' warnings of theirs."""
    from specdec.train import eagle_evaluate

    def run(loaded, ids, max_new_tokens, drafter=None, **config):
        logging.getLogger("specdec.generate").warning("max_new_tokens=%d", max_new_tokens)
        return 1.0, 1.0

    monkeypatch.setattr(eagle_evaluate, "_run", run)
    monkeypatch.setattr("specdec.drafters.eagle.EagleDrafter", lambda **options: options)
    with caplog.at_level(logging.WARNING, logger="specdec.generate"):
        eagle_evaluate.choose_tree_by_speed(None, None, [[1]], 20, candidates=((1, 1, 1),))
    assert [r.getMessage() for r in caplog.records if r.name == "specdec.generate"] == ["max_new_tokens=20"] * 2


def test_the_tau_prompts_are_encoded_once_before_training(tiny, tmp_path, monkeypatch):
    """Before training the held-out tau prompts were encoded twice: to refuse one of no token, then again to check
    that their answers fit the context. Once now, for both checks."""
    from specdec.train import pipeline
    from specdec.train.evaluate import eval_prompts

    real, encoded = pipeline.encode_prompt, []

    def encode(tokenizer, prompt, *args):
        encoded.append(prompt)
        return real(tokenizer, prompt, *args)

    class Made(Exception):
        pass

    def made(path, flag):  # the checks are done when the output folder is made
        raise Made

    monkeypatch.setattr(pipeline, "encode_prompt", encode)
    monkeypatch.setattr(pipeline, "make_dir", made)
    with pytest.raises(Made):
        run_training(_distil_cfg(tiny, tmp_path, ["abc"], eval_tau=True, eval_prompts=3))
    tau = eval_prompts(3)
    assert [p for p in encoded if p in tau] == tau
