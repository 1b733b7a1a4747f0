"""The GPU speed command's CPU rehearsal: every row of the report is measured and written, tiny shape, few tokens."""
from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.script_loading import load_script

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:  # step_profile, imported by bare name as the speed script does
    sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_speed_gpu")


@pytest.fixture(autouse=True)
def _no_row_calibration(monkeypatch):
    monkeypatch.setattr("specdec.engine_setup.ensure_row_policy", lambda runner: None)  # no calibration per shape


ARGS = ["--rehearse", "--models", "synthetic:qwen3-1.7b@tiny", "--batches", "1,2", "--taus", "3", "--sizes", "1,2,65",
        "--new-tokens", "6", "--prompt-len", "5"]


def test_rehearsal_measures_and_reports_every_row(bench, tmp_path):
    assert bench.main(ARGS + ["--out", str(tmp_path), "--budget", "900"]) == 0
    model = json.loads((tmp_path / "speed.json").read_text())["models"][0]
    assert model["errors"] == [] and model["skipped"] == []
    assert sorted(model["plain"]) == ["1", "2"] and model["weight_bytes"] > 0
    # batch 1 also with each step read first (the same-run baseline of steps queued ahead), with the same text
    assert model["plain"]["1"]["read_first_same_text"] and "read_first_tokens_per_s" not in model["plain"]["2"]
    assert sorted(model["verify_cost"]["ratio"], key=int) == ["1", "2", "65"]
    products = model["products"]  # the products alone, at their own sizes, on the CPU without a cuBLAS A/B
    assert [int(n) for n in products["ms"]] == list(bench.PRODUCT_SIZES) and min(products["ms"].values()) > 0
    assert products["floor_ms"] > 0 and products["cublaslt_ms"] is None and products["cublaslt_error"] is None
    rows = {(r["shape"], r["nodes"], r["batch"], r["eagle"], r["speculation"]) for r in model["oracle"]}
    assert rows == {("chain", 6, 1, True, "always"), ("chain", 4, 1, True, "always"), ("tree", 64, 1, True, "always"),
                    ("chain", 6, 2, True, "always"), ("chain", 6, 2, False, "always"),
                    ("tree", 64, 2, False, "always"),
                    ("chain", 6, 2, False, "auto"), ("tree", 64, 2, False, "auto")}  # the policy's rows at batch > 1
    for r in model["oracle"]:  # the weight-read bound: the measured tau, less the EAGLE layer's reads per level
        assert r["bound"] == pytest.approx(r["tau"]) if not r["eagle"] else 0 < r["bound"] < r["tau"]
    chains = sorted((r for r in model["oracle"] if r["eagle"] and r["shape"] == "chain" and r["batch"] == 1),
                    key=lambda r: r["depth"])
    assert chains[0]["bound"] / chains[0]["tau"] > chains[1]["bound"] / chains[1]["tau"]  # fewer reads of the layer
    auto = [r for r in model["oracle"] if r["speculation"] == "auto"]
    assert all(0 <= r["verified_nodes"] <= r["nodes"] and 0 <= r["drafted_share"] <= 1 for r in auto)
    assert all(r["queued_share"] == 0 for r in auto)  # no graph buckets on the CPU: no step queued
    assert all(r["calibrations_timed"] == 0 for r in model["oracle"])  # the policy's rows calibrated before timing
    assert all(r["identical_to_plain"] == f"{r['batch']}/{r['batch']}" for r in model["oracle"])  # greedy exactness
    assert model["hf_static"]["new_tokens"] == 6
    assert [r["call"] for r in model["profile"]] == ["plain b1", "oracle chain tau 3.0 +eagle b1",
                                                      "oracle chain tau 3.0 +eagle eager b1", "oracle tree tau 3.0 b1",
                                                      "prefill b1", "plain b2", "oracle chain tau 3.0 auto b2"]
    plain, oracle, eager, tree, prefill, plain2, auto2 = (r["summary"] for r in model["profile"])
    # one prefill of the 5-token prompt, its eager forward's ops (per layer: norms, products, attention); no step
    assert prefill["steps"] == 1 and prefill["phases_ms_per_step"] == {}
    assert "aten::linear" in prefill["aten_ops_by_name"] and prefill["aten_ops_per_step"] > 0.5 * plain[
        "aten_ops_per_step"]
    call = model["prefill_host_python"]  # the whole one-token call under cProfile: set-up, prefill, its step
    # specdec's functions, named dir/file.py:line(name) (which ones rank by own time depends on the machine's load)
    assert call["steps"] == 1 and call["functions"]
    assert all(re.fullmatch(r"(specdec|drafters|kernels|eval|train)/[\w/]+\.py:\d+\(.+\)", f["name"])
               for f in call["functions"]), [f["name"] for f in call["functions"]]
    assert any("(add)" in f["name"] for f in call["functions"] + call["others"]) or any(
        "forward" in f["name"] for f in call["functions"])
    assert plain2["steps"] == 6 and auto2["steps"] > 0 and "propose" in auto2["phases_ms_per_step"]  # the batch's
    assert eager["steps"] == oracle["steps"] and eager["aten_ops_per_step"] > oracle["aten_ops_per_step"] * 0.5
    assert plain["steps"] == 6 and plain["aten_ops_per_step"] > 0 and "verify" in plain["phases_ms_per_step"]
    assert oracle["steps"] < plain["steps"] and oracle["phases_ms_per_step"]["propose"] > 0  # EAGLE drafted
    assert tree["steps"] < plain["steps"]  # the 64-node trees' 65-token verifies, accepted as the profile says
    assert {"plain b1", "verify cost", "profile b1", "profile prefill b1", "profile b2"} <= set(model["item_seconds"])
    assert "replay launch" in model["item_seconds"] and model["replay_launch"] is None  # nothing captured on a CPU
    assert all(r["seconds"] > 0 for r in model["profile"]) and tree["kernel_ms_by_kind"] == {}  # no kernels on a CPU
    host = model["host_python"]  # the chain's replayed drafting once more, under cProfile: the host's Python
    assert host["call"] == "oracle chain tau 3.0 +eagle b1" and host["steps"] == oracle["steps"]
    names = [f["name"] for f in host["functions"]]  # specdec's own functions (the CPU's products are "others")
    assert len(names) == 24 and all(n.split("/")[0] in ("specdec", "drafters", "eval", "kernels") for n in names)
    assert any(n.startswith("specdec/engine.py:") for n in names) and len(host["others"]) == 8
    assert any("torch" in f["name"] for f in host["others"]) and " at 0x" not in str(host["others"])
    for rows in (host["functions"], host["others"]):
        own = [f["own_us_per_step"] for f in rows]
        assert own == sorted(own, reverse=True) and all(f["cum_us_per_step"] >= f["own_us_per_step"] for f in rows)
    text = (tmp_path / "speed.md").read_text()
    assert "## synthetic:qwen3-1.7b@tiny" in text and "speedup vs plain" in text and "REHEARSAL" in text
    assert "| oracle chain tau 3.0 +eagle b1 |" in text and "| p(n) / p(1) | 1.00 |" in text
    assert "oracle chain tau 3.0 +eagle b1, host Python under cProfile (" in text and "| prefill b1 | 1 |" in text
    assert "a one-token call b1 (set-up, prefill, its step), host Python under cProfile (1 steps" in text
    assert "graph replays" not in text and "uncaptured static growths" in text  # nothing is captured on the CPU
    p1 = model["plain"]["1"]  # the plain row's prefill, beside its decode speed
    assert "| step / floor | prefill ms |" in text and f"| {p1['step_over_floor']:.2f} | " \
        f"{1e3 * p1['prefill_seconds']:.1f} |" in text and p1["prefill_seconds"] > 0
    assert "% of steps drafted, 0% queued)" in text
    from tests.test_docs import list_pitfalls

    report = json.loads((tmp_path / "speed.json").read_text())
    report["models"][0]["errors"] = ["profile b1: AttributeError: no such field"]  # a list after its label renders
    assert list_pitfalls(bench.markdown(report)) == []  # as one (the docs build refused an H200 run's report)


def test_what_does_not_fit_the_budget_is_skipped_and_reported(bench, tmp_path):
    assert bench.main(ARGS + ["--out", str(tmp_path), "--budget", "0.001", "--no-hf"]) == 0
    model = json.loads((tmp_path / "speed.json").read_text())["models"][0]
    assert model["plain"] == {} and model["oracle"] == [] and model["errors"] == []
    assert "plain b1" in model["skipped"] and "oracle tree tau 3.0 b2" in model["skipped"]
    assert "oracle chain tau 3.0 b1 +eagle" in model["skipped"]
    assert "skipped (out of time)" in (tmp_path / "speed.md").read_text()


def test_a_report_read_back_from_json_renders_its_verify_cost_curve(bench):
    """speed.json's keys are strings once written; a re-rendered report keeps the curve a live run rendered."""
    model = dict(model="synthetic:tiny", plain={}, hf_static=None, oracle=[], skipped=[], errors=[],
                 verify_cost=dict(ms={1: 2.0, 2: 2.2, 65: 3.0}, ratio={1: 1.0, 2: 1.1, 65: 1.5}))
    report = dict(date="today", rehearse=False, new_tokens=8, prompt_len=8, models=[model],
                  env=dict(device_name="GPU", dtype="bfloat16", torch="2", copy_gb_per_s=1000.0))
    want = "verify cost c(n) / c(1): 1: 1.00, 2: 1.10, 65: 1.50 (c(1) = 2.000 ms)"
    assert want in bench.markdown(report)
    assert want in bench.markdown(json.loads(json.dumps(report)))
    assert "host launch" not in bench.markdown(report)  # a report written before the launch was measured
    model["replay_launch"] = {65: dict(launch_ms=0.9, replay_ms=5.2), 1: dict(launch_ms=0.4, replay_ms=4.1)}
    want = ("a batch-1 verify graph on an idle device, host launch / replay waited for: 1 tokens 0.400 / 4.100 ms, "
            "65 tokens 0.900 / 5.200 ms")
    assert want in bench.markdown(report) and want in bench.markdown(json.loads(json.dumps(report)))


def test_launch_times_split_the_hosts_launch_from_the_replay_waited_for(bench):
    """A launch that returns after 2 ms and a device that finishes 3 ms later: 2 ms and 5 ms, medians."""
    import time as clock

    done = [0.0]

    def replay():
        clock.sleep(0.002)
        done[0] = clock.perf_counter() + 0.003

    def wait():
        clock.sleep(max(done[0] - clock.perf_counter(), 0.0))

    row = bench.launch_times(replay, wait, repeats=5)
    assert 2.0 <= row["launch_ms"] < 20.0 and row["replay_ms"] >= row["launch_ms"] + 2.5  # the wait's 3 ms after


def test_a_report_read_back_from_json_renders_its_products_beside_the_curve(bench):
    """The products-alone table: c(n) where the curve has n, p(n), its ratio to p(1), the cuBLASLt row."""
    model = dict(model="synthetic:tiny", plain={}, hf_static=None, oracle=[], skipped=[], errors=[],
                 verify_cost=dict(ms={1: 2.0, 65: 3.0}, ratio={1: 1.0, 65: 1.5}),
                 products=dict(ms={1: 1.0, 65: 1.5, 72: 1.25}, weight_bytes=2e9, floor_ms=0.8,
                               cublaslt_ms={1: 0.9, 65: 1.0, 72: 1.1}, cublaslt_error=None))
    report = dict(date="today", rehearse=False, new_tokens=8, prompt_len=8, models=[model],
                  env=dict(device_name="GPU", dtype="bfloat16", torch="2", copy_gb_per_s=1000.0))
    for text in (bench.markdown(report), bench.markdown(json.loads(json.dumps(report)))):
        assert "p(1) = 1.000 ms, 1.25x their weight-read floor (0.800 ms, 2.00 GB)" in text
        assert "| n | 1 | 65 | 72 |" in text and "| c(n) ms | 2.000 | 3.000 |  |" in text
        assert "| p(n) / p(1) | 1.00 | 1.50 | 1.25 |" in text
        assert "| p(n) ms, cuBLASLt | 0.900 | 1.000 | 1.100 |" in text
    model["products"].update(cublaslt_ms=None, cublaslt_error="this torch has no preferred_blas_library")
    assert "cuBLASLt: not measured (this torch has no preferred_blas_library)" in bench.markdown(report)


def test_products_are_every_weight_a_forward_multiplies_by(bench):
    """The products-alone chain reads each layer's projections once, fused or not, and the LM head: every weight
    a decode step reads but the norms'."""
    import products_curve

    from specdec.models import synthetic
    from specdec.models.llama import LlamaRunner
    from specdec.models.loader import load_model

    loaded = load_model("synthetic:llama-3.1-8b@tiny", device="cpu", dtype=torch.float32)  # laid out fused
    unfused = synthetic.build("llama-3.1-8b@tiny", device="cpu", dtype=torch.float32)  # as built
    norms = sum(p.numel() * 4 for name, p in loaded.model.named_parameters() if "norm" in name)
    layers = loaded.runner.shape.num_layers
    for runner, model, fused in ((LlamaRunner(unfused), unfused, False), (loaded.runner, loaded.model, True)):
        assert (runner.fused_projections() is not None) == fused
        chain = products_curve.products(runner)
        assert len(chain) == layers * (4 if fused else 7) + 1 and chain[-1][1] is runner.lm_head
        assert products_curve.product_bytes(runner) == bench.weight_bytes(model) - norms
        ms = products_curve.products_ms(runner, [1, 3], repeats=1)
        assert sorted(ms) == [1, 3] and min(ms.values()) > 0


def test_product_bytes_count_the_biases_a_row_reads():
    import products_curve

    from specdec.models.llama import LlamaRunner
    from specdec.testing import build_tiny_model

    runner = LlamaRunner(build_tiny_model("llama-mqa-bias"))  # hidden 64, MLP 128, 4 heads of 16, 1 KV head
    # per layer: q 64x64 + 64, k and v 16x64 + 16, o 64x64 + 64, gate and up 128x64 + 128, down 64x128 + 64:
    # 34,816 weights + 480 biases; 2 layers + the tied head 96x64 = 76,736 float32 numbers
    assert products_curve.product_bytes(runner) == 4 * (2 * (34816 + 480) + 96 * 64) == 306944


def test_products_ms_times_each_size_on_its_own_rows(bench, monkeypatch):
    """Every size is warmed up once and timed ``repeats`` times, each pass over the whole chain with n rows."""
    import products_curve

    from specdec.models.loader import load_model

    runner = load_model("synthetic:llama-3.1-8b@tiny", device="cpu", dtype=torch.float32).runner
    rows, linear = [], runner._linear
    monkeypatch.setattr(runner, "_linear", lambda x, w, b: rows.append(x.shape[0]) or linear(x, w, b))
    chain = len(products_curve.products(runner))
    assert sorted(products_curve.products_ms(runner, [1, 3], repeats=2)) == [1, 3]
    # 1 warm-up + 2 timed passes of the chain, per size
    assert rows.count(1) == rows.count(3) == 3 * chain and len(rows) == 6 * chain


def test_weight_read_floor_counts_what_a_decode_step_reads(bench):
    from specdec.models import synthetic

    for name in ("llama-3.1-8b@tiny", "qwen3-1.7b@tiny"):  # untied: the input embedding is only gathered; tied: read
        shape = synthetic.parse(name)
        unread = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
        assert bench.weight_bytes(synthetic.build(name, device="cpu")) == 4 * (shape.num_params - unread)


def test_profile_summary_counts_a_steps_device_time_launches_and_waits():
    """Fake trace of two steps (microseconds): the GPU's busy time is the union of its intervals, only events inside
    the steps count, and the host's waits, launches and phases are per step."""
    import sys
    from types import SimpleNamespace as E

    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_profile import summarize
    from torch.autograd import DeviceType

    ids = itertools.count(1)

    def ev(name, start, end, device=DeviceType.CPU, parent=None, annotation=False):
        return E(name=name, time_range=E(start=start, end=end), device_type=device, cpu_parent=parent,
                 is_user_annotation=annotation, id=next(ids), linked_correlation_id=0)

    step1, step2 = ev("engine.step", 0, 100), ev("engine.step", 100, 200)
    gpu = DeviceType.CUDA
    events = [step1, step2, ev("engine.verify", 10, 60, parent=step1), ev("engine.accept", 110, 130, parent=step2),
              ev("cudaGraphLaunch", 12, 14, parent=step1), ev("cudaLaunchKernel", 112, 113, parent=step2),
              ev("cudaStreamSynchronize", 60, 90), ev("cudaStreamSynchronize", 150, 160),
              ev("matmul_kernel", 20, 50, gpu), ev("attn_kernel", 40, 70, gpu),  # overlapping: 50 us busy
              ev("matmul_kernel", 120, 140, gpu), ev("Memcpy DtoH (Device -> Pinned)", 150, 151, gpu),
              ev("late_kernel", 190, 210, gpu),  # ends after the last step: not counted
              ev("engine.verify", 10, 100, gpu, annotation=True),  # a phase's range on the device: no kernel
              ev("aten::mm", 15, 16, parent=step1), ev("aten::copy_", 15.2, 15.5, parent=ev("aten::mm", 15, 16))]
    # launches by the op issuing them: the outermost aten op, else the innermost range that is no engine phase
    linear = ev("aten::linear", 120, 130, parent=ev("engine.propose", 115, 135, parent=step2))
    events += [ev("cudaLaunchKernel", 121, 122, parent=ev("aten::mm", 120, 125, parent=linear)),
               ev("cuLaunchKernel", 131, 132, parent=ev("fused_rope", 131, 133, parent=ev("engine.verify", 130, 140)))]
    s = summarize(events)
    assert s["steps"] == 2 and s["wall_ms_per_step"] == 0.1
    assert abs(s["gpu_busy_ms_per_step"] - (50 + 20 + 1) / 2 / 1e3) < 1e-12
    assert abs(s["gpu_idle_share"] - (1 - 71 / 200)) < 1e-12
    assert s["kernels_per_step"] == 1.5 and s["copies_per_step"] == {"Memcpy DtoH": 0.5}
    assert abs(s["kernel_ms_per_step"] - (30 + 30 + 20) / 2 / 1e3) < 1e-12
    assert s["graph_launches_per_step"] == 0.5 and s["host_launches_per_step"] == 1.5
    assert s["host_launches_by_op"] == {"(none)": 0.5, "aten::linear": 0.5, "fused_rope": 0.5}
    assert s["aten_ops_by_name"] == {"aten::mm": 0.5}  # the outermost ones in the trace (copy_ is inside mm)
    assert s["syncs_per_step"] == 1.0 and abs(s["sync_wait_ms_per_step"] - 0.02) < 1e-12
    assert s["phases_ms_per_step"] == {"verify": 0.025, "accept": 0.01} and s["aten_ops_per_step"] == 0.5
    assert [k["name"] for k in s["top_kernels"]] == ["matmul_kernel", "attn_kernel"]
    assert s["top_kernels"][0]["per_step"] == 1.0 and abs(s["top_kernels"][0]["share"] - 50 / 80) < 1e-12
    with pytest.raises(ValueError, match="no engine step"):
        summarize([ev("aten::mm", 0, 1)])


def test_profile_summary_splits_kernel_time_by_kind():
    """A 65-token verify's extra time against a decode's, by kind: cuBLAS's and specdec's products, the tree attention
    and SDPA's (flash's split-KV combine too), the norms, the rest (names as an H200 trace gives them; one step,
    microseconds)."""
    import sys
    from types import SimpleNamespace as E

    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_profile import markdown_rows, summarize
    from torch.autograd import DeviceType

    ids = itertools.count(1)

    def ev(name, start, end, device=DeviceType.CUDA):
        return E(name=name, time_range=E(start=start, end=end), device_type=device, cpu_parent=None,
                 is_user_annotation=False, id=next(ids), linked_correlation_id=0)

    events = [ev("engine.step", 0, 100, DeviceType.CPU), ev("nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT", 0, 30),
              ev("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn", 30, 35), ev("matmul_kernel", 35, 36),
              ev("_linear_kernel", 36, 38),
              ev("_tree_attn_kernel", 40, 48), ev("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", 48, 50),
              ev("flash_fwd_splitkv_combine_kernel", 50, 55), ev("_add_rms_norm_kernel", 55, 59),
              ev("_rope_write_kernel", 60, 63),
              ev("Memcpy HtoD (Pinned -> Device)", 63, 64)]
    s = summarize(events)
    assert s["kernel_ms_by_kind"] == pytest.approx(dict(products=0.038, attention=0.015, norms=0.004, other=0.003))
    assert list(s["kernel_ms_by_kind"]) == ["products", "attention", "norms", "other"]
    text = "\n".join(markdown_rows(dict(profile=[dict(call="oracle tree tau 3.0 b1", summary=s)])))
    assert ("oracle tree tau 3.0 b1, kernel time by kind, ms/step: products 0.038, attention 0.015, norms 0.004, "
            "other 0.003 (all 0.060; GPU busy 0.061 of 0.100 wall)") in text


def _phase_trace():
    """Fake trace of two steps (microseconds) as torch.profiler links it: an eager kernel's ``linked_correlation_id``
    is the ``id`` of the innermost op around its launch; a CUDA-graph replay's kernels link to no op and share the
    correlation ``id`` of their ``cudaGraphLaunch`` (an id the profiler's own op ids may repeat), which may sit
    under no host event."""
    import sys
    from types import SimpleNamespace as E

    sys.path.insert(0, str(REPO / "benchmarks"))
    from torch.autograd import DeviceType

    def ev(name, start, end, parent=None, device=DeviceType.CPU, id=0, linked=0):
        return E(name=name, time_range=E(start=start, end=end), device_type=device, cpu_parent=parent,
                 is_user_annotation=False, id=id, linked_correlation_id=linked)

    def kernel(name, start, end, id, linked=0):
        return ev(name, start, end, device=DeviceType.CUDA, id=id, linked=linked)

    events = []
    for s, t in enumerate((0, 100)):  # each step: a graph replay in propose, then an eager forward in verify
        step = ev("engine.step", t, t + 100, id=10 * s + 1)
        propose = ev("engine.propose", t + 5, t + 40, step, id=10 * s + 2)
        verify = ev("engine.verify", t + 40, t + 90, step, id=10 * s + 3)
        mm = ev("aten::mm", t + 41, t + 45, ev("aten::linear", t + 41, t + 46, verify, id=10 * s + 4), id=10 * s + 5)
        graph = 500 + s  # CUPTI's correlation id of the replay: also one of the profiler's op ids, in verify
        events += [step, propose, verify, mm, ev("aten::copy_", t + 47, t + 48, verify, id=graph),
                   ev("cudaGraphLaunch", t + 10, t + 12, propose if s == 0 else None, id=graph),  # else: on
                   # another thread (the profiler puts a call linked to no op on the one reading the trace)
                   ev("cudaLaunchKernel", t + 42, t + 43, mm, id=600 + s, linked=mm.id),
                   kernel("eagle_fused_layer_kernel", t + 12, t + 20, graph),
                   kernel("eagle_fused_layer_kernel", t + 20, t + 28, graph),
                   kernel("topk_kernel", t + 28, t + 30, graph),
                   ev("Memcpy DtoD (Device -> Device)", t + 30, t + 31, device=DeviceType.CUDA, id=graph),
                   kernel("nvjet_gemm_kernel", t + 50, t + 80, 600 + s, linked=mm.id)]
    events.append(kernel("orphan_kernel", 95, 97, 999))  # linked to nothing: no op, no runtime call of its id
    return events


def test_profile_summary_puts_each_kernel_under_the_engine_phase_that_launched_it():
    """An eager kernel under the aten op inside engine.verify, a graph replay's kernels (and copy) under
    engine.propose though no op is above them, an op of verify repeats their id and the second step's replay has
    no parent event (it falls in propose's range), an unlinked one apart."""
    from step_profile import summarize

    s = summarize(_phase_trace())
    assert s["steps"] == 2 and s["kernels_per_step"] == 4.5
    phases = s["kernels_by_phase"]
    assert list(phases) == ["verify", "propose", "(unattributed)"]  # by kernel time
    assert phases["propose"] == dict(kernels=3.0, kernel_ms=0.018, copies=1.0, copy_ms=0.001, graph_replays=1.0,
                                     top_kernels=[dict(name="eagle_fused_layer_kernel", per_step=2.0,
                                                       us_per_step=16.0),
                                                  dict(name="topk_kernel", per_step=1.0, us_per_step=2.0)])
    assert phases["verify"] == dict(kernels=1.0, kernel_ms=0.03, copies=0.0, copy_ms=0.0, graph_replays=0.0,
                                    top_kernels=[dict(name="nvjet_gemm_kernel", per_step=1.0, us_per_step=30.0)])
    assert phases["(unattributed)"]["kernels"] == 0.5 and phases["(unattributed)"]["graph_replays"] == 0.0
    assert sum(p["kernels"] for p in phases.values()) == s["kernels_per_step"]  # every kernel counted once


def test_profile_phases_come_from_runtime_calls_where_events_link_no_op():
    """torch 2.11's FunctionEvent has no linked_correlation_id (the H200 image's torch: the profile rows failed
    there): each kernel is found by the correlation id of its launch call, whose op leads to the same phase."""
    from step_profile import summarize

    events = _phase_trace()
    for e in events:
        del e.linked_correlation_id
    assert summarize(events)["kernels_by_phase"] == summarize(_phase_trace())["kernels_by_phase"]


def test_profile_report_names_each_phases_kernels():
    from step_profile import markdown_rows, summarize

    s = summarize(_phase_trace())
    text = "\n".join(markdown_rows(dict(profile=[dict(call="oracle chain tau 3.0 +eagle b1", summary=s)])))
    assert ("oracle chain tau 3.0 +eagle b1, kernels by the engine phase launching them, per step: **verify** 1 "
            "(0.030 ms), `nvjet_gemm_kernel` 1x 30 us; **propose** 3 (0.018 ms, graph replays 1), "
            "`eagle_fused_layer_kernel` 2x 16 us, `topk_kernel` 1x 2 us; **(unattributed)** 0.5 (0.001 ms), "
            "`orphan_kernel` 0.5x 1 us") in text
    del s["kernels_by_phase"]  # a report from before: no such line
    assert "engine phase" not in "\n".join(markdown_rows(dict(profile=[dict(call="plain b1", summary=s)])))


def test_profile_rows_name_pytorch_kernels_by_the_op_their_template_computes():
    """PyTorch's elementwise and reduce kernels share a long prefix (``void at::native::elementwise_kernel<128, 4,
    at::native::gpu_kernel_impl_nocast<a``, where the H200 report cut them at 80 characters), so two of a Qwen3
    step's extra kernels looked alike: their labels name the op and dtype from the template; other names stay."""
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from step_profile import kernel_label

    mul = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
           "c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::binary_internal::MulFunctor<float> > >(at::Tens"
           "orIteratorBase&, at::native::BinaryFunctor<c10::BFloat16, c10::BFloat16, c10::BFloat16, at::native::bina"
           "ry_internal::MulFunctor<float> > const&)::{lambda(int)#1}>(int, ...)")
    copy = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&"
            ")::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1}, std::"
            "array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1> >()")
    softmax = ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, c10::BFloat16, float, float, at::native"
               "::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, c10::BFloat16 const*, int)")
    reduce = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned "
              "int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MaxOps<float>, unsigned int, float, 4, 4>)")
    assert kernel_label(mul) == "elementwise_kernel[MulFunctor; c10::BFloat16]"
    assert kernel_label(copy) == "unrolled_elementwise_kernel[direct_copy_kernel_cuda; c10::BFloat16]"
    assert kernel_label(softmax) == "cunn_SoftMaxForward[LogSoftMaxForwardEpilogue; c10::BFloat16]"
    assert kernel_label(reduce) == "reduce_kernel[MaxOps; float]"
    for plain in ("_tree_attn_kernel", "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "Memcpy DtoH (Device -> Pinned)"):
        assert kernel_label(plain) == plain
    assert len(kernel_label("x" * 300)) == 100

