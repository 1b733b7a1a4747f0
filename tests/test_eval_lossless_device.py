"""`specdec eval lossless --device`: the model runs where asked (cpu here; cuda without a GPU is one line, exit 2,
before the model loads), float32 by default on every device, and the certificate says where it ran."""
from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

from tests.cli_runs import run_main as _main

SMALL = ["--levels", "e2e", "--identity-prompts", "1", "--identity-tokens", "4", "--sample-sequences", "20"]


def test_the_certificate_records_the_device_and_dtype_it_ran_on(ckpt, tmp_path, capsys):
    out = tmp_path / "cert"
    code, captured = _main(["eval", "lossless", "--model", ckpt, "--device", "cpu", *SMALL, "--out", str(out)], capsys)
    cert = json.loads((out / "certificate.json").read_text())
    assert code == (0 if cert["passed"] else 1), captured.err
    assert (cert["config"]["device"], cert["config"]["dtype"]) == ("cpu", "float32")
    md = (out / "certificate.md").read_text()
    assert "- device: `cpu`" in md and "- dtype: `float32`" in md
    assert "on cpu (float32)" in captured.err
    assert any(c["level"] == "end-to-end" for c in cert["checks"])


def test_cuda_without_a_gpu_is_one_line_before_the_model_loads(ckpt, tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")

    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --device was checked")

    monkeypatch.setattr("specdec.models.loader.load_model", load_model)
    out = tmp_path / "cert"
    code, captured = _main(["eval", "lossless", "--model", ckpt, "--device", "cuda", "--out", str(out)], capsys)
    lines = captured.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--device" in lines[0] and "no CUDA device" in lines[0], captured.err
    assert not out.exists()  # refused before --out was made


def test_the_model_loads_in_float32_on_the_device_asked(tmp_path, capsys, monkeypatch):
    """float32 whatever the device (load_model's own default is bfloat16 on CUDA); --dtype still chooses."""
    seen = []

    def load_model(spec, **kwargs):
        seen.append((kwargs.get("dtype"), kwargs.get("device")))
        raise ValueError("stop here")

    monkeypatch.setattr("specdec.models.loader.load_model", load_model)
    for extra in ([], ["--dtype", "bfloat16"]):
        code, _ = _main(["eval", "lossless", "--device", "cpu", *extra, "--out", str(tmp_path / "c"), "--overwrite"],
                        capsys)
        assert code == 2
    assert seen == [(torch.float32, torch.device("cpu")), (torch.bfloat16, torch.device("cpu"))]


def test_half_precision_identity_is_flagged():
    """The identity checks' near-tie margins are float32's: a bf16 certificate says so."""
    from specdec.eval.certificate import CertificateSizes, run_certificate

    from specdec.models.loader import load_model
    from specdec.sampling import SamplingConfig
    from specdec.testing import build_tiny_model

    loaded = load_model(build_tiny_model(vocab_size=12, seed=3).to(torch.bfloat16))
    sizes = CertificateSizes(identity_prompts=1, identity_tokens=4, sample_sequences=20, sample_tokens=1)
    cert = run_certificate(loaded, "ngram", {}, SamplingConfig(True), sizes, lambda n: [[1, 2, 3, 1, 2]][:n],
                           levels=("e2e",))
    assert cert.config["dtype"] == "bfloat16"
    assert any("near-tie margins are float32's" in w for w in cert.warnings)


def test_negative_controls_run_on_the_model_device(monkeypatch):
    """generate_with_control (every speculative run of the certificate) makes the model's GPU the current one, as
    generate() does (in generate()'s own call frame, specdec.generate.generate_with): without it a model on cuda:1
    would get its Triton kernels and graphs on cuda:0."""
    import importlib

    import specdec.eval.negative_controls as negative_controls

    from specdec.models.loader import load_model
    from specdec.testing import build_tiny_model

    entered = []

    @contextmanager
    def recording(device):
        entered.append(device)
        yield

    monkeypatch.setattr(importlib.import_module("specdec.generate"), "on_device", recording)
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    negative_controls.generate_with_control(loaded, [[1, 2, 3]], max_new_tokens=2, drafter="ngram")
    assert entered == [loaded.runner.device]


def test_end_to_end_sampling_runs_in_chunks_that_fit(monkeypatch):
    """--full samples 40,000 sequences a side; in one generate() call the embedded model's KV cache would need
    412 GiB (float32), more than any GPU has. The sequences run in chunks, the first seeded as before."""
    import specdec.eval.end_to_end as end_to_end
    from specdec.eval.certificate import CertificateSizes

    from specdec.models.loader import load_model
    from specdec.sampling import SamplingConfig
    from specdec.testing import build_tiny_model

    calls = []
    plain, spec = end_to_end.generate, end_to_end.generate_with_control

    def counted(real, side):
        def call(loaded, prompts, *args, **kwargs):
            calls.append((side, len(prompts), kwargs["seed"]))
            return real(loaded, prompts, *args, **kwargs)
        return call

    monkeypatch.setattr(end_to_end, "CHUNK", 8, raising=False)
    monkeypatch.setattr(end_to_end, "generate", counted(plain, "plain"))
    monkeypatch.setattr(end_to_end, "generate_with_control", counted(spec, "spec"))
    loaded = load_model(build_tiny_model(vocab_size=12, seed=3))
    sizes = CertificateSizes(sample_sequences=20, sample_tokens=1)
    res = end_to_end.sampled_two_sample(loaded, [1, 2, 3, 1, 2], "ngram", {}, SamplingConfig(True), sizes)
    assert [(side, n) for side, n, _ in calls] == [("plain", 8), ("plain", 8), ("plain", 4), ("spec", 8),
                                                    ("spec", 8), ("spec", 4)]
    seeds = [seed for _, _, seed in calls]
    assert seeds[0] == 1 and seeds[3] == 2 and len(set(seeds)) == 6
    assert res["tau"] >= 1.0
