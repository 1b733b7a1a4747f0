"""`specdec convert-medusa`: published Medusa heads (medusa_lm_head.pt read weights-only, legacy safetensors heads
sharing the base LM head, Medusa-2 / axolotl heads inside a model's weights) become specdec heads whose logits
equal an independent re-implementation of Medusa's head forward; what cannot be converted exactly is refused by
name; the base model is recorded as a reference other tools resolve (also by train-medusa)."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import safetensors.torch
import specdec.drafters.medusa_heads
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from specdec.drafters.medusa_convert import convert_published, read_published
from specdec.drafters.medusa_heads import MedusaCheckpointError, load_medusa
from torch import nn

import specdec
from specdec.cli import main
from specdec.errors import InputError
from specdec.models.loader import EMBEDDED_HUB_ID, load_model, model_reference
from specdec.testing import build_tiny_model

HIDDEN, VOCAB = 64, 96


class _Block(nn.Module):  # Medusa's ResBlock as published: x + SiLU(Linear(x)), the Linear with a bias
    def __init__(self, hidden):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def medusa_module(num_heads, num_layers, own_lm_head=True, seed=0):
    """Heads built the way FasterDecoding/Medusa builds them: one block repeated num_layers times per head
    (`[ResBlock] * num_layers`, shared weights), then a bias-free LM head; random values."""
    torch.manual_seed(seed)
    heads = []
    for _ in range(num_heads):
        block = _Block(HIDDEN)
        with torch.no_grad():
            block.linear.weight.mul_(3.0)
        layers = [block] * num_layers + ([nn.Linear(HIDDEN, VOCAB, bias=False)] if own_lm_head else [])
        heads.append(nn.Sequential(*layers))
    return nn.ModuleList(heads)


def reference_logits(module, hidden, lm_head=None):
    """[num_heads, rows, vocab], computed from the tensors alone (not through any specdec code)."""
    out = []
    for head in module:
        x = hidden
        blocks = [m for m in head if isinstance(m, _Block)]
        for block in blocks:
            w, b = block.linear.weight.detach(), block.linear.bias.detach()
            x = x + torch.nn.functional.silu(x @ w.T + b)
        lm = head[-1].weight.detach() if lm_head is None else lm_head
        out.append(x @ lm.T)
    return torch.stack(out)


def write_medusa1(path, module, num_layers, fmt="pt", base="lmsys/vicuna-7b-v1.3", config=True):
    """A Medusa-1 head checkpoint: config.json as MedusaConfig.save_pretrained writes it + the heads' state dict."""
    path.mkdir(parents=True, exist_ok=True)
    state = module.state_dict()
    if fmt == "pt":
        torch.save(state, path / "medusa_lm_head.pt")
    else:  # Medusa's later training saves safetensors (one copy per tensor)
        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(path / "medusa_lm_head.safetensors"))
    if config:
        (path / "config.json").write_text(json.dumps({
            "medusa_num_heads": len(module), "medusa_num_layers": num_layers, "base_model_name_or_path": base,
            "transformers_version": "4.34.0"}))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model("llama-mha-untied", vocab_size=VOCAB).save_pretrained(path)
    return path


@pytest.mark.parametrize("num_layers, fmt", [(1, "pt"), (2, "pt"), (1, "safetensors"), (0, "pt")])
def test_converted_heads_give_the_published_forward(tmp_path, num_layers, fmt):
    module = medusa_module(3, num_layers).to(torch.float16)
    src = write_medusa1(tmp_path / "src", module, num_layers, fmt)
    out = convert_published(src, tmp_path / "out")
    assert load_file(str(out / "medusa_lm_head.safetensors"))["0.0.weight" if num_layers == 0 else
                                                              "0.0.linear.weight"].dtype == torch.float16
    heads = load_medusa(out, HIDDEN, VOCAB, dtype=torch.float32)
    assert heads.config.num_heads == 3 and heads.config.num_layers == num_layers
    assert not heads.config.shared_lm_head
    hidden = torch.randn(5, HIDDEN)
    ref = reference_logits(module.float(), hidden)
    torch.testing.assert_close(heads(hidden), ref, rtol=1e-5, atol=1e-5)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == "lmsys/vicuna-7b-v1.3"  # a hub id stays a hub id


def test_a_changed_block_changes_the_logits(tmp_path):
    """The comparison above can fail: converting the heads of another seed gives other logits."""
    module, other = medusa_module(2, 1, seed=0), medusa_module(2, 1, seed=1)
    heads = load_medusa(convert_published(write_medusa1(tmp_path / "a", other, 1), tmp_path / "out"), HIDDEN, VOCAB)
    hidden = torch.randn(4, HIDDEN)
    assert not torch.allclose(heads(hidden), reference_logits(module, hidden), atol=1e-3)


def test_converted_heads_draft_for_the_target_and_keep_greedy_identity(tmp_path, tiny_dir):
    model = load_model(tiny_dir).model
    module = medusa_module(3, 1)
    with torch.no_grad():  # heads that guess like the target's LM head, so drafts get accepted
        for head in module:
            head[-1].weight.copy_(model.lm_head.weight)
    out = convert_published(write_medusa1(tmp_path / "src", module, 1), tmp_path / "out", base_model=str(tiny_dir))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 8, 9]]
    plain = specdec.generate(model, prompts, max_new_tokens=12)
    spec = specdec.generate(model, prompts, max_new_tokens=12, drafter="medusa", speculation="always",
                            drafter_options={"path": str(out)}, return_dict=True)
    assert spec.sequences == plain
    assert sum(s.steps for s in spec.stats) < sum(s.new_tokens for s in spec.stats)  # drafts were accepted


def test_legacy_heads_sharing_the_base_lm_head(tmp_path, tiny_dir):
    """Medusa's legacy "medusa2" heads: blocks only, the base model's LM head scores them; safetensors."""
    module = medusa_module(2, 1, own_lm_head=False)
    src = write_medusa1(tmp_path / "src", module, 1, "safetensors", base=str(tiny_dir))
    lm_head = load_model(tiny_dir).model.lm_head.weight.detach()
    hidden = torch.randn(3, HIDDEN)
    ref = reference_logits(module, hidden, lm_head)
    heads = load_medusa(convert_published(src, tmp_path / "out"), HIDDEN, VOCAB)
    assert heads.config.shared_lm_head and heads.config.vocab_size == VOCAB  # vocabulary from the base's config
    torch.testing.assert_close(heads(hidden, lm_head), ref, rtol=1e-5, atol=1e-5)
    direct = load_medusa(src, HIDDEN, VOCAB)  # the published safetensors folder also loads as it is
    assert direct.config.shared_lm_head
    torch.testing.assert_close(direct(hidden, lm_head), ref, rtol=1e-5, atol=1e-5)
    bare = write_medusa1(tmp_path / "bare", module, 1, "safetensors", base="some-org/unknown-model")
    with pytest.raises(MedusaCheckpointError, match="vocabulary size.*--base-model"):
        convert_published(bare, tmp_path / "out2")


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin"])
def test_medusa2_heads_inside_the_model_weights(tmp_path, layout):
    """Medusa-1.0 / axolotl: the model's config.json has medusa_num_heads, its weights hold medusa_head.*; the
    target to use is that checkpoint itself, and transformers loads it ignoring the heads (a pickled one is converted
    for its heads, and refused as a target)."""
    model = build_tiny_model("llama-mha-untied", vocab_size=VOCAB)
    model.config.medusa_num_heads, model.config.medusa_num_layers = 2, 1
    src = tmp_path / "medusa-1.0-tiny"
    model.save_pretrained(src)
    module = medusa_module(2, 1)
    with torch.no_grad():
        for head in module:
            head[-1].weight.copy_(model.lm_head.weight)
    base = load_file(str(src / "model.safetensors"))
    heads = {f"medusa_head.{k}": v.clone() for k, v in module.state_dict().items()}
    (src / "model.safetensors").unlink()
    if layout == "safetensors":
        save_file({**base, **heads}, str(src / "model.safetensors"), metadata={"format": "pt"})
    elif layout == "sharded":
        save_file(base, str(src / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
        save_file(heads, str(src / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
        weight_map = {**{k: "model-00001-of-00002.safetensors" for k in base},
                      **{k: "model-00002-of-00002.safetensors" for k in heads}}
        (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        torch.save({**base, **heads}, src / "pytorch_model.bin")
    out = convert_published(src, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(src.resolve())
    hidden = torch.randn(4, HIDDEN)
    torch.testing.assert_close(load_medusa(out, HIDDEN, VOCAB)(hidden), reference_logits(module, hidden),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(MedusaCheckpointError, match="inside the model's weights.*convert-medusa"):
        load_medusa(src, HIDDEN, VOCAB)  # the hint names the command
    if layout == "bin":  # the heads convert; the target itself is a pickle, which specdec never loads
        with pytest.raises(InputError, match="pickles.*never loads"):
            load_model(cfg["base_model_name_or_path"])
        target = model
    else:
        target = load_model(cfg["base_model_name_or_path"]).model
    prompts = [[5, 6, 7, 8, 5, 6]]
    spec = specdec.generate(target, prompts, max_new_tokens=8, drafter="medusa", speculation="always",
                            drafter_options={"path": str(out)})
    assert spec == specdec.generate(target, prompts, max_new_tokens=8)


def test_a_pickle_that_is_not_weights_only_is_refused_unexecuted(tmp_path):
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    src = tmp_path / "src"
    src.mkdir()
    state = medusa_module(1, 1).state_dict()
    torch.save({**state, "extra": Payload()}, src / "medusa_lm_head.pt")
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1,
                                                 "base_model_name_or_path": "x/y"}))
    with pytest.raises(MedusaCheckpointError, match="holds more than tensors.*weights_only=True.*never unpickles"):
        convert_published(src, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(MedusaCheckpointError, match="pickles are not loaded here.*convert-medusa"):
        load_medusa(src, HIDDEN, VOCAB)  # the drafter never reads the pickle itself


def test_a_file_that_is_no_torch_checkpoint_is_one_line_naming_it(tmp_path, capsys):
    """A .pt of other bytes raised the weights-only unpickler's IndexError as a traceback; it is now one line naming
    the file and what was expected (read weights-only or not at all), as is a damaged archive, while the legacy
    (pre-zip) format still converts."""
    (tmp_path / "garbage.pt").write_bytes(b"this is not a torch file at all\n" * 10)
    assert main(["convert-medusa", str(tmp_path / "garbage.pt"), "--output-dir", str(tmp_path / "o"),
                 "--base-model", "a/b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"specdec convert-medusa: error: {tmp_path / 'garbage.pt'} is not a torch checkpoint (neither "
                   "torch.save's zip archive nor its legacy format); expected a torch.save'd state dict of Medusa "
                   "head tensors (medusa_lm_head.pt)"]
    state = medusa_module(2, 1).state_dict()
    torch.save(state, tmp_path / "whole.pt")
    (tmp_path / "cut.pt").write_bytes((tmp_path / "whole.pt").read_bytes()[:300])
    with pytest.raises(MedusaCheckpointError, match=r"cut\.pt is a damaged torch checkpoint \(RuntimeError: "):
        read_published(tmp_path / "cut.pt", base_model="a/b")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert read_published(tmp_path / "legacy.pt", base_model="a/b")[0].num_heads == 2


def _edit(state, problem):
    if problem == "lm-bias":
        state["0.1.bias"] = torch.zeros(VOCAB)
    elif problem == "no-block-bias":
        del state["1.0.linear.bias"]
    elif problem == "other-layout":
        state["0.0.mlp.weight"] = state.pop("0.0.linear.weight")
    elif problem == "missing-head":
        for k in [k for k in state if k.startswith("1.")]:
            del state[k]
    elif problem == "shape":
        state["1.1.weight"] = torch.zeros(VOCAB + 1, HIDDEN)
    elif problem == "mixed-lm-heads":
        del state["2.1.weight"]
    return state


@pytest.mark.parametrize("problem, match", [
    ("lm-bias", r"0\.1\.bias: this LM head has a bias"),
    ("no-block-bias", r"block 1\.0 has a linear\.weight but no linear\.bias"),
    ("other-layout", r"keys of another layout, e\.g\. 0\.0\.mlp\.weight"),
    ("missing-head", r"heads \[1\] are missing"),
    ("shape", r"1\.1\.weight has shape \[97, 64\], expected \[96, 64\]"),
    ("mixed-lm-heads", r"some heads have their own LM head \(\{head\}\.1\.weight\) and some do not \(head 2\)"),
    ("fewer-than-promised", "promises medusa_num_heads=5 but .* stores 3 heads"),
    ("one-fewer-than-promised", "promises medusa_num_heads=4 but .* stores 3 heads"),
    ("differing-copies", "stores blocks 0 and 1 with different weights"),
    ("no-base", "no base_model_name_or_path.*--base-model"),
    ("missing", "does not exist; convert-medusa reads local files only"),
    ("nothing", "no Medusa weights found"),
])
def test_what_cannot_be_converted_exactly_is_refused_by_name(tmp_path, problem, match):
    src = tmp_path / "src"
    module = medusa_module(3, 2 if problem == "differing-copies" else 1)
    state = {k: v.clone() for k, v in module.state_dict().items()}  # separate copies, editable
    if problem == "differing-copies":
        state["2.1.linear.bias"] += 1.0
    src.mkdir()
    torch.save(_edit(state, problem), src / "medusa_lm_head.pt")
    config = {"medusa_num_heads": {"fewer-than-promised": 5, "one-fewer-than-promised": 4}.get(problem, 3),
              "medusa_num_layers": 2 if problem == "differing-copies" else 1, "base_model_name_or_path": "a/b"}
    if problem == "no-base":
        del config["base_model_name_or_path"]
    (src / "config.json").write_text(json.dumps(config))
    if problem == "nothing":
        (src / "medusa_lm_head.pt").unlink()
    with pytest.raises(MedusaCheckpointError, match=match):
        convert_published(tmp_path / "gone" if problem == "missing" else src, tmp_path / "out")


def test_blocks_stored_once_are_repeated_as_medusa_runs_them(tmp_path):
    """A saver that drops tensors sharing memory keeps one copy of a head's repeated block."""
    module = medusa_module(2, 3)
    state = {k: v.clone() for k, v in module.state_dict().items() if ".1.linear" not in k and ".2.linear" not in k}
    src = tmp_path / "src"
    src.mkdir()
    save_file(state, str(src / "medusa_lm_head.safetensors"))
    (src / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 3,
                                                 "base_model_name_or_path": "a/b"}))
    with pytest.raises(MedusaCheckpointError, match=r"fewer residual blocks than config\.json's medusa_num_layers=3 "
                       r"\(no 0\.1\.linear\.bias\).*`specdec convert-medusa .*src --output-dir DIR`$"):
        load_medusa(src)  # a one-line pointer to the conversion, not torch's "Missing key(s)" dump
    heads = load_medusa(convert_published(src, tmp_path / "out"), HIDDEN, VOCAB)
    hidden = torch.randn(3, HIDDEN)
    torch.testing.assert_close(heads(hidden), reference_logits(module, hidden), rtol=1e-5, atol=1e-5)


def test_specdecs_own_layout_keeps_its_distinct_blocks(tmp_path):
    """train-medusa --num-layers 2 trains each block on its own; convert-medusa refused its output as "ambiguous"
    (copies of FasterDecoding's one repeated block that differ). Read as specdec's, the blocks are kept as stored."""
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads, save_medusa

    heads = MedusaHeads(MedusaConfig(2, 2, HIDDEN, VOCAB, medusa_choices=((0,), (1,))))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    save_medusa(heads, tmp_path / "src")
    out = convert_published(tmp_path / "src", tmp_path / "out", base_model="a/b", medusa_choices=[[0], [0, 0]])
    hidden = torch.randn(3, HIDDEN)
    torch.testing.assert_close(load_medusa(out)(hidden), heads(hidden), rtol=0, atol=0)
    assert json.loads((out / "config.json").read_text())["medusa_choices"] == [[0], [0, 0]]
    state = load_file(str(tmp_path / "src" / "medusa_lm_head.safetensors"))
    del state["1.1.linear.weight"], state["1.1.linear.bias"]  # distinct blocks: a missing one cannot be repeated
    save_file(state, str(tmp_path / "src" / "medusa_lm_head.safetensors"))
    with pytest.raises(MedusaCheckpointError, match="head 1 stores 1 of its 2 residual blocks"):
        read_published(tmp_path / "src")


def test_cli_converts_and_refuses_to_overwrite(tmp_path, capsys):

    src = write_medusa1(tmp_path / "src", medusa_module(2, 1), 1)
    out = tmp_path / "out"
    rc = main(["convert-medusa", str(src), "--output-dir", str(out), "--medusa-choices", "[[0],[1],[0,0]]"])
    assert rc == 0 and "2 heads, 1 residual block each" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["medusa_choices"] == [[0], [1], [0, 0]] and cfg["medusa_num_heads"] == 2
    assert main(["convert-medusa", str(src), "--output-dir", str(out)]) == 2
    assert "already holds config.json" in capsys.readouterr().err
    assert main(["convert-medusa", str(src), "--output-dir", str(out), "--overwrite"]) == 0
    assert main(["convert-medusa", str(src), "--output-dir", str(src)]) == 2  # would replace the source's config
    assert "source's own directory" in capsys.readouterr().err
    assert main(["convert-medusa", str(tmp_path / "nope"), "--output-dir", str(out)]) == 2  # the missing source first
    assert "nope does not exist" in capsys.readouterr().err


def test_cli_names_an_output_dir_that_is_a_file(tmp_path, capsys):
    """`--output-dir` naming a file said only "[Errno 17] File exists: 'FILE'", after reading the heads."""
    src = write_medusa1(tmp_path / "src", medusa_module(2, 1), 1)
    (tmp_path / "file").write_text("a file")
    for out in ("file", "file/heads"):
        assert main(["convert-medusa", str(src), "--output-dir", str(tmp_path / out)]) == 2
        line = capsys.readouterr().err.strip()
        assert line == (f"specdec convert-medusa: error: --output-dir {tmp_path / out}: cannot create it "
                        f"({tmp_path / 'file'} is a file, not a folder)"), line


def test_cli_names_a_full_disk_in_one_line(tmp_path, capsys, monkeypatch):
    """A full disk under --output-dir ended in safetensors' SafetensorError traceback."""
    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    src = write_medusa1(tmp_path / "src", medusa_module(2, 1), 1)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    assert main(["convert-medusa", str(src), "--output-dir", str(tmp_path / "out")]) == 2
    line = capsys.readouterr().err.strip()
    assert line == ("specdec convert-medusa: error: [Errno 28] No space left on device: "
                    f"'{tmp_path / 'out' / 'medusa_lm_head.safetensors'}'"), line


@pytest.mark.parametrize("choices, match", [
    ("[[5,0]]", r"the medusa_choices given: medusa_choices path \[5, 0\] lacks its prefix \[5\]"),
    (json.dumps([[i] for i in range(3)] + [[i, j] for i in range(3) for j in range(30)]), "93 paths; .* at most 64"),
    ("[[0],[96]]", "rank 96, but the vocabulary has 96 tokens"),
    ("[[0],[0],[0,0]]", r"the medusa_choices given: medusa_choices lists path \[0\] more than once"),
    ("[]", "the medusa_choices given: medusa_choices is empty"),
], ids=["prefix", "size", "rank", "repeat", "empty"])
def test_cli_refuses_a_tree_the_drafter_would_refuse(tmp_path, capsys, choices, match):
    """A tree the Medusa drafter refuses on attach is refused when converting, before anything is written."""
    src = write_medusa1(tmp_path / "src", medusa_module(2, 1), 1)
    assert main(["convert-medusa", str(src), "--output-dir", str(tmp_path / "out"), "--medusa-choices", choices]) == 2
    assert re.search(match, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


# ---- base_model_name_or_path: something other tools resolve -----------------------------------------------------
def test_base_model_is_recorded_as_an_absolute_path_or_a_hub_id(tmp_path, tiny_dir, monkeypatch):
    src = write_medusa1(tmp_path / "src", medusa_module(1, 1), 1, base="../model")
    (tmp_path / "model").mkdir()  # the published config names a folder relative to the checkpoint
    config, _ = read_published(src)
    assert config.base_model_name_or_path == str((tmp_path / "model").resolve())
    monkeypatch.chdir(tiny_dir.parent)
    config, _ = read_published(src, base_model="model")  # --base-model relative to the working directory
    assert config.base_model_name_or_path == str(tiny_dir.resolve())
    assert read_published(src, base_model="org/name")[0].base_model_name_or_path == "org/name"
    assert model_reference("default") == model_reference("smollm2-135m-instruct") == EMBEDDED_HUB_ID
    assert load_model("model").source == str(tiny_dir.resolve())
    hf = load_model(tiny_dir).model
    assert load_model(hf).source == str(tiny_dir.resolve())


def test_train_medusa_records_the_model_as_an_absolute_path(tmp_path, tiny_dir, monkeypatch):
    pytest.importorskip("accelerate")
    from specdec.train.config import TrainConfig
    from specdec.train.pipeline import run_training

    from specdec.testing import build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(tiny_dir)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"the cat {i} sings {i * 7}"}) + "\n"
                                                 for i in range(8)))
    monkeypatch.chdir(tiny_dir.parent)
    run_training(TrainConfig(model="model", output_dir=str(tmp_path / "heads"), data=str(tmp_path / "data.jsonl"),
                             num_heads=1, seq_len=16, batch_size=2, max_steps=1, save_every=1, progress=False,
                             eval_tau=False, held_out_fraction=0.0))
    cfg = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_dir.resolve()) and os.path.isabs(cfg["base_model_name_or_path"])


@pytest.mark.parametrize("holds", ["model", "config-only", "training-run"])
def test_overwrite_replaces_only_a_previous_conversion(tmp_path, holds):
    """--overwrite replaced a model checkpoint's config.json, after which the model no longer loaded."""
    src = write_medusa1(tmp_path / "src", medusa_module(2, 1), 1)
    out = tmp_path / "out"
    out.mkdir()
    model_config = json.dumps({"model_type": "llama", "hidden_size": HIDDEN})
    (out / "config.json").write_text(model_config)
    if holds == "model":
        (out / "model.safetensors").write_bytes(b"weights")
    if holds == "training-run":  # heads of a training run: config.json is a Medusa one, but run.json is beside it
        (out / "config.json").unlink()
        convert_published(src, out)
        (out / "run.json").write_text("{}")
    before = (out / "config.json").read_text()
    with pytest.raises(MedusaCheckpointError, match="--overwrite will not"):
        convert_published(src, out, overwrite=True)
    assert (out / "config.json").read_text() == before
    if holds == "config-only":
        assert before == model_config
    convert_published(src, tmp_path / "fresh")  # a previous conversion is replaced
    out = tmp_path / "fresh"
    assert load_medusa(convert_published(src, out, overwrite=True), HIDDEN, VOCAB).config.num_heads == 2


@pytest.mark.skipif(sys.platform == "win32", reason="the sticky bit is POSIX's")
def test_overwrite_of_another_users_conversion_in_a_sticky_folder_is_refused(tmp_path, monkeypatch,
                                                                              another_users_sticky):
    """An --output-dir with the sticky bit (as /tmp), writable by all, holding another user's conversion: the
    source was read, then --overwrite stopped at its first deletion ("Operation not permitted"). It is refused before
    anything is read or changed; this user's own conversion there is replaced as before."""
    src = write_medusa1(tmp_path / "src", medusa_module(2, 1), 1)
    out = convert_published(src, tmp_path / "shared")
    owner = another_users_sticky(out)  # this user owns neither the folder nor the conversion
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(MedusaCheckpointError, match=f"^--overwrite cannot replace the previous conversion in {out}: "
                                                    "it has the sticky bit"):
        convert_published(src, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.setattr(os, "geteuid", lambda: owner)
    assert load_medusa(convert_published(src, out, overwrite=True), HIDDEN, VOCAB).config.num_heads == 2


def test_an_overwrite_stopped_between_its_two_files_leaves_no_old_config_beside_new_weights(tmp_path, monkeypatch):
    """--overwrite wrote the new weights, then config.json: a stop in between left new weights read by the old
    config (three heads' config over a two-head checkpoint's weights here, or a silent mix where shapes agree).
    The folder is refused as no checkpoint instead, and the next --overwrite replaces it."""
    out = convert_published(write_medusa1(tmp_path / "three", medusa_module(3, 1), 1), tmp_path / "out")
    src = write_medusa1(tmp_path / "two", medusa_module(2, 1), 1)

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(specdec.drafters.medusa_heads, "write_json", stopped)
    with pytest.raises(KeyboardInterrupt):
        convert_published(src, out, overwrite=True)
    with pytest.raises(MedusaCheckpointError, match="config.json is missing"):
        load_medusa(out, HIDDEN, VOCAB)
    monkeypatch.undo()
    assert load_medusa(convert_published(src, out, overwrite=True), HIDDEN, VOCAB).config.num_heads == 2


def test_a_bin_file_named_alone_converts(tmp_path):
    """Medusa's heads saved as medusa_lm_head.bin, named as a file (no config.json): its layers are read from the LM
    head's index."""
    module = medusa_module(2, 1)
    (tmp_path / "src").mkdir()
    torch.save(module.state_dict(), tmp_path / "src" / "medusa_lm_head.bin")
    config, state = read_published(tmp_path / "src" / "medusa_lm_head.bin", base_model="a/b")
    assert (config.num_heads, config.num_layers, config.shared_lm_head) == (2, 1, False)
    assert torch.equal(state["1.1.weight"], module[1][1].weight)


def test_heads_without_config_or_lm_heads_count_their_stored_blocks(tmp_path):
    """No config.json and no LM head index: blocks 0 and 1 stored are medusa_num_layers = 1 + 1 = 2."""
    module = medusa_module(2, 2, own_lm_head=False)
    file = tmp_path / "medusa_lm_head.safetensors"
    save_file({k: v.clone().contiguous() for k, v in module.state_dict().items()}, str(file))
    config, _ = read_published(file, base_model="a/b", vocab_size=VOCAB)
    assert (config.num_heads, config.num_layers, config.shared_lm_head) == (2, 2, True)


def test_a_block_at_the_lm_heads_index_is_refused_as_beyond_the_configs_layers(tmp_path):
    """Heads sharing the base LM head store blocks 0 and 1 but config.json says medusa_num_layers=1: block 1 is
    refused, not dropped (the heads ran both)."""
    src = write_medusa1(tmp_path / "src", medusa_module(2, 2, own_lm_head=False), 1, "safetensors", base="a/b")
    with pytest.raises(MedusaCheckpointError, match=r"0\.1\.linear\.(weight|bias) is a block beyond medusa_num_layers"):
        read_published(src, vocab_size=VOCAB)


def test_a_medusa2_checkpoint_named_relatively_is_recorded_as_its_absolute_path(tmp_path, monkeypatch):
    """The heads go with the fine-tuned checkpoint holding them: recorded as "m2", the converted heads named a base
    model only their conversion's working directory could find."""
    module = medusa_module(2, 1)
    (tmp_path / "m2").mkdir()
    save_file({f"medusa_head.{k}": v.clone() for k, v in module.state_dict().items()},
              str(tmp_path / "m2" / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    config, _ = read_published("m2")
    assert config.base_model_name_or_path == str((tmp_path / "m2").resolve())
