"""export-head and the target it names: a head made for another target is refused where the target is on this machine,
a local target is recorded as an absolute path, a write the output folder refuses is one line, and a feature layer
vLLM / SGLang never capture (the last residual stream of a shallow target) is exported with a warning."""
from __future__ import annotations

import json
import logging
import os
import sys

import pytest
import torch
from specdec.drafters.export_head import export_head
from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads, save_medusa

from specdec.cli import main
from specdec.testing import build_tiny_model
from tests.test_head_layouts import H, V, write_sglang_checkpoint


def _target_dir(path, **overrides):
    """A local target's checkpoint directory (its config.json is what export-head reads)."""
    config = build_tiny_model(**overrides).config
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(path)
    return path


def _medusa(path, base="org/tiny-target"):
    torch.manual_seed(0)
    path.mkdir()
    save_medusa(MedusaHeads(MedusaConfig(2, 1, H, V, base_model_name_or_path=base)), path)
    return path


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
@pytest.mark.parametrize("overrides, field, mine, theirs", [
    ({"hidden_size": 32, "intermediate_size": 64}, "hidden_size", H, 32),
    ({"vocab_size": 80}, "vocab_size", V, 80),
])
def test_an_eagle3_head_for_another_target_is_refused_naming_both_sides(tmp_path, capsys, fmt, overrides, field,
                                                                        mine, theirs):
    """export-head --target wrote a head of hidden size 64 for a target of 32 (exit 0); speculators and vLLM then
    failed to load it (size mismatch)."""
    write_sglang_checkpoint(tmp_path / "src")
    other = _target_dir(tmp_path / "other", **overrides)
    out = tmp_path / "out"
    argv = ["export-head", str(tmp_path / "src"), "--format", fmt, "--output-dir", str(out)]
    assert main([*argv, "--target", str(other)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"does not fit --target {other}" in err[0], err
    assert f"{field}={mine} but the target model has {field}={theirs}" in err[0]
    assert not out.exists()
    assert main([*argv, "--target", str(_target_dir(tmp_path / "same"))]) == 0  # the head's own shape: written


def test_a_head_whose_recorded_target_does_not_fit_is_refused(tmp_path, capsys):
    other = _target_dir(tmp_path / "other", hidden_size=32, intermediate_size=64)
    write_sglang_checkpoint(tmp_path / "src")
    raw = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**raw, "target_model": str(other)}))
    assert main(["export-head", str(tmp_path / "src"), "--format", "speculators", "--output-dir",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"does not fit its recorded target {other}" in err and "hidden_size=64" in err and err.count("\n") == 1


def test_medusa_heads_for_another_target_are_refused(tmp_path, capsys):
    other = _target_dir(tmp_path / "other", hidden_size=32, intermediate_size=64)
    argv = ["export-head", str(_medusa(tmp_path / "m")), "--format", "vllm", "--output-dir", str(tmp_path / "v")]
    assert main([*argv, "--target", str(other)]) == 2
    err = capsys.readouterr().err
    assert "Medusa heads have hidden_size=64 but the target model has 32" in err and err.count("\n") == 1
    assert not (tmp_path / "v").exists()


def test_a_relative_local_target_is_recorded_as_an_absolute_path(tmp_path, monkeypatch):
    """--target tiny was written as "tiny": the export then loaded only from that working directory (speculators
    took it for a hub id). A hub id stays as given."""
    monkeypatch.chdir(tmp_path)
    tiny = str(_target_dir(tmp_path / "tiny").resolve())
    write_sglang_checkpoint(tmp_path / "src")
    export_head("src", "speculators", "spec", target="tiny")
    raw = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert raw["speculators_config"]["verifier"] == {"name_or_path": tiny, "architectures": ["LlamaForCausalLM"]}
    export_head("src", "sglang", "sgl", target="./tiny")
    assert json.loads((tmp_path / "sgl" / "config.json").read_text())["target_model"] == tiny
    export_head(_medusa(tmp_path / "m"), "vllm", "v", target="tiny")
    assert json.loads((tmp_path / "v" / "config.json").read_text())["base_model_name_or_path"] == tiny
    export_head("src", "speculators", "hub", target="org/tiny")
    assert json.loads((tmp_path / "hub" / "config.json").read_text())[
        "speculators_config"]["verifier"]["name_or_path"] == "org/tiny"


@pytest.mark.parametrize("given", ["./tiny-typo", "~/no-such-target", "runs/2024/tiny"])
def test_a_target_path_that_does_not_exist_is_refused(tmp_path, monkeypatch, capsys, given):
    """--target ./tiny-typo, which no hub id can be, was exported with a warning that it went unchecked, into a
    config naming a target no engine finds (and relative, so found from no other directory either)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    write_sglang_checkpoint(tmp_path / "src")
    _medusa(tmp_path / "m")
    for src, fmt in (("src", "speculators"), ("m", "vllm")):
        assert main(["export-head", src, "--format", fmt, "--output-dir", "out", "--target", given]) == 2
        assert capsys.readouterr().err == (f"specdec export-head: error: --target {given} does not exist: give the "
                                           "target's checkpoint directory, or its hub id (org/name)\n")
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["speculators", "sglang", "vllm"])
def test_a_write_the_output_folder_refuses_is_one_line(tmp_path, capsys, monkeypatch, fmt):
    """An --output-dir that refuses writes (EPERM: chattr +i) gave safetensors' SafetensorError as a traceback,
    exit 1."""
    import safetensors.torch
    from safetensors import SafetensorError

    def refuse(tensors, filename, metadata=None):
        raise SafetensorError(f"Error while serializing: I/O error: Operation not permitted (os error 1) at path "
                              f"\"{filename}\"")

    src = _medusa(tmp_path / "m") if fmt == "vllm" else tmp_path / "src"
    if fmt != "vllm":
        write_sglang_checkpoint(src)
    monkeypatch.setattr(safetensors.torch, "save_file", refuse)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["export-head", str(src), "--format", fmt, "--output-dir", str(out), "--target", "t"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"cannot write into --output-dir {out}: " in err[0], err
    assert "Operation not permitted" in err[0] and list(out.iterdir()) == []


def test_a_feature_layer_past_the_targets_last_is_exported_with_a_warning(tmp_path, caplog):
    """A head of a target too shallow for three distinct published ids (2, 4, 5 or 6 layers) reads feature layers
    (0, L // 2, L): vLLM and SGLang capture the streams entering layers 0 to L - 1 only, so neither can serve layer
    L, and their Llama add a residual stream that is None before layer 0 (TypeError); the export said nothing."""
    write_sglang_checkpoint(tmp_path / "src")  # feature layers (0, 1, 2)
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.export_head"):
        export_head(tmp_path / "src", "speculators", tmp_path / "two", target=str(_target_dir(tmp_path / "t2")))
    warned = [r.getMessage() for r in caplog.records if r.name == "specdec.drafters.export_head"]
    assert len(warned) == 1 and "reads feature layers [0, 1, 2], which vLLM and SGLang cannot serve" in warned[0]
    assert "capture only the streams entering layers 0 to 1 of the target's 2" in warned[0]
    assert "residual stream that does not exist before layer 0" in warned[0]
    assert json.loads((tmp_path / "two" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.drafters.export_head"):
        export_head(tmp_path / "src", "sglang", tmp_path / "three",
                    target=str(_target_dir(tmp_path / "t3", num_hidden_layers=3)))  # layer 2 is captured there
        export_head(tmp_path / "src", "speculators", tmp_path / "hub", target="org/tiny-target")  # depth unknown
    warned = [r.getMessage() for r in caplog.records if r.name == "specdec.drafters.export_head"]
    assert len(warned) == 2 and "does not exist before layer 0" in warned[0] and "capture only" not in warned[0]
    assert "not checked against its target org/tiny-target" in warned[1], warned


def test_a_hub_target_is_checked_against_its_cached_config_else_exported_with_a_warning(tmp_path, capsys,
                                                                                          monkeypatch, caplog):
    """A hub id was never checked, even with its config in the Hugging Face cache, and said nothing: a head for
    another target was written with exit 0. The cache is read without a download; a target found nowhere is
    named in a warning."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--org--small" / "snapshots" / "0123abcd"
    _target_dir(snapshot, hidden_size=32, intermediate_size=64)
    (cache / "models--org--small" / "refs").mkdir()
    (cache / "models--org--small" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were the cache missed, no download is tried either
    write_sglang_checkpoint(tmp_path / "src")
    argv = ["export-head", str(tmp_path / "src"), "--format", "speculators"]
    assert main([*argv, "--output-dir", str(tmp_path / "a"), "--target", "org/small"]) == 2
    err = capsys.readouterr().err
    assert "does not fit --target org/small" in err and "hidden_size=64" in err and err.count("\n") == 1
    with caplog.at_level(logging.WARNING, logger="specdec"):
        assert main([*argv, "--output-dir", str(tmp_path / "b"), "--target", "org/elsewhere"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("not checked against its target org/elsewhere" in w for w in warned), warned


def test_overwrite_replaces_an_earlier_export_left_half_written(tmp_path):
    """An interrupted export leaves its atomic write's temporary file (NAME.PID.THREAD.tmp) beside it: that is still
    an earlier export, which --overwrite replaces, not a user's file it must keep; it is removed (it stayed for
    good)."""
    write_sglang_checkpoint(tmp_path / "src")
    out, _ = export_head(tmp_path / "src", "speculators", tmp_path / "out", target="org/tiny-target")
    (out / "model.safetensors.4242.1.tmp").write_bytes(b"half a file")
    export_head(tmp_path / "src", "sglang", out, target="org/tiny-target", overwrite=True)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


@pytest.mark.skipif(sys.platform == "win32", reason="the sticky bit is POSIX's")
def test_overwrite_of_another_users_export_in_a_sticky_folder_is_refused(tmp_path, monkeypatch, another_users_sticky):
    """An --output-dir with the sticky bit (as /tmp), writable by all, holding another user's export: --overwrite
    stopped at its first write ("Operation not permitted"), or, with the weights this user's and the config theirs,
    left new weights beside the old config. It is refused before anything is written; this user's own export there
    is replaced as before."""
    from specdec.errors import InputError

    write_sglang_checkpoint(tmp_path / "src")
    out, _ = export_head(tmp_path / "src", "speculators", tmp_path / "shared", target="org/tiny-target")
    owner = another_users_sticky(out)  # this user owns neither the folder nor the export
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(InputError, match=f"^export-head: --overwrite cannot replace the earlier export in {out}: it "
                                         "has the sticky bit"):
        export_head(tmp_path / "src", "sglang", out, target="org/tiny-target", overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.setattr(os, "geteuid", lambda: owner)
    export_head(tmp_path / "src", "sglang", out, target="org/tiny-target", overwrite=True)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_the_source_directory_is_refused_as_the_output_even_with_overwrite(tmp_path):
    """With --overwrite the source (config.json + model.safetensors, what an export holds) would pass as an earlier
    export and be replaced by the export of itself."""
    from specdec.errors import InputError

    src = tmp_path / "src"
    write_sglang_checkpoint(src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for out, overwrite in ((src, False), (tmp_path / "src" / ".." / "src", True)):  # the same folder, spelled apart
        with pytest.raises(InputError, match=r"--output-dir .* is the source's own directory$"):
            export_head(src, "speculators", out, target="org/tiny-target", overwrite=overwrite)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_medusa_heads_over_the_targets_lm_head_are_refused_for_vllm(tmp_path):
    """vLLM's Medusa layout has an lm_heads.{h} per head; heads sharing the target's LM head store none, so a
    written export would hold blocks only (vLLM: missing weights)."""
    from specdec.errors import InputError

    src = tmp_path / "m"
    src.mkdir()
    save_medusa(MedusaHeads(MedusaConfig(2, 1, H, V, shared_lm_head=True, base_model_name_or_path="org/t")), src)
    with pytest.raises(InputError, match="vLLM's Medusa layout needs each head's own LM head"):
        export_head(src, "vllm", tmp_path / "v", target=str(_target_dir(tmp_path / "t")))
    assert not (tmp_path / "v").exists()
