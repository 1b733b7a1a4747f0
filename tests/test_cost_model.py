"""The measured cost model: calibration once per key (cached on disk), re-measured when the key changes;
interpolation of c(n); the CPU row policy of linear() measured, installed and exact."""
from __future__ import annotations

import collections
import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch

from specdec import cost_model, verify_cost
from specdec.cost_model import CalibrationConfig, CostModel, load_cost_model
from specdec.models import row_policy
from specdec.models.llama import LlamaRunner
from specdec.sampling import SamplingConfig
from specdec.testing import build_tiny_model

SMALL = CalibrationConfig(sizes=(1, 2, 4), context=16, repeats=1, row_repeats=1)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache dir and no in-process memo (as in a new process); row policies restored after."""
    monkeypatch.setattr(cost_model, "_MEMO", {})
    monkeypatch.setattr(cost_model, "_ROWS_DONE", {})
    monkeypatch.setattr(cost_model, "_PACKING", {})
    saved = dict(row_policy._ACTIVE)
    yield tmp_path
    row_policy._ACTIVE.clear()
    row_policy._ACTIVE.update(saved)


def _calls(monkeypatch) -> list[int]:
    calls = []
    real = cost_model.calibrate

    def counting(runner, batch, config, where=None):
        calls.append(batch)
        return real(runner, batch, config, where)

    monkeypatch.setattr(cost_model, "calibrate", counting)
    return calls


def test_calibration_runs_once_per_key_and_is_reused(fresh, monkeypatch):
    calls = _calls(monkeypatch)
    runner = LlamaRunner(build_tiny_model(seed=0))
    first = load_cost_model(runner, SMALL, cache_dir=fresh)
    assert calls == [1] and sorted(first.curve(1)) == [1, 2, 4]
    again = load_cost_model(runner, SMALL, cache_dir=fresh)  # same process: the memo
    monkeypatch.setattr(cost_model, "_MEMO", {})
    from_disk = load_cost_model(runner, SMALL, cache_dir=fresh)  # a new process: the disk cache
    assert calls == [1] and again.curve(1) == first.curve(1) == from_disk.curve(1)
    # other weights of the same shapes cost the same; every part of the key re-measures: other shapes (an MLP
    # width, which the config-level shape leaves out), another workload, another thread count
    load_cost_model(LlamaRunner(build_tiny_model(seed=1)), SMALL, cache_dir=fresh)
    assert calls == [1]
    load_cost_model(LlamaRunner(build_tiny_model(seed=1, intermediate_size=96)), SMALL, cache_dir=fresh)
    assert calls == [1, 1]
    load_cost_model(runner, CalibrationConfig(sizes=(1, 3), context=16, repeats=1, row_repeats=1), cache_dir=fresh)
    assert calls == [1, 1, 1]
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if threads == 1 else 1)
    try:
        load_cost_model(runner, SMALL, cache_dir=fresh)
    finally:
        torch.set_num_threads(threads)
    assert calls == [1, 1, 1, 1]
    # another batch size is measured lazily, once, and saved with the rest
    first.relative(2, batch=3)
    first.relative(4, batch=4)
    assert calls == [1, 1, 1, 1, 4]
    monkeypatch.setattr(cost_model, "_MEMO", {})
    load_cost_model(runner, SMALL, cache_dir=fresh).relative(2, batch=4)
    assert calls == [1, 1, 1, 1, 4]


def test_processes_sharing_the_cache_measure_one_at_a_time_and_the_later_reads_the_earlier(fresh, monkeypatch):
    """Two `specdec generate` started together on an empty cost cache both measured, each timed under the other's
    load, and each cached its own curve. The second waits for the first's measurement and reads it (two threads
    stand for the two processes: the cache folder is held with flock, which threads contend for as processes do)."""
    started, go, calls = threading.Event(), threading.Event(), []

    def calibrate(runner, batch, config, where=None):
        calls.append(batch)
        if len(calls) == 1:  # the first measurement lasts until the second caller has come
            started.set()
            go.wait(30)
        return {1: 1.0, 2: 1.5}

    monkeypatch.setattr(cost_model, "calibrate", calibrate)
    models = [CostModel({"k": 1}, {}, object(), SMALL, fresh / "verify-k.json") for _ in range(2)]
    first = threading.Thread(target=models[0].curve, args=(1,))
    first.start()
    started.wait(30)
    second = threading.Thread(target=models[1].curve, args=(1,))
    second.start()
    second.join(1)  # it waits for the first (before the fix it measured at once)
    go.set()
    first.join()
    second.join()
    assert calls == [1] and models[1].curves == models[0].curves == {1: {1: 1.0, 2: 1.5}}


def test_a_call_measures_the_batch_sizes_it_meets_before_its_first_step(fresh, monkeypatch):
    """A ragged batch shrinks as rows finish: the curve of each smaller batch size was measured when the batch first
    reached it, a stall of seconds in the middle of the call (which the step's timing counted as drafting). A call
    of 4 sequences now measures 1, 2 and 4 when its engine is built, and none during its steps."""
    from specdec import engine_setup
    from specdec.engine import Engine
    from specdec.generate import generate

    calls, stepping, measuring = [], [], []
    real_calibrate, real_step = cost_model.calibrate, Engine.step

    def calibrate(runner, batch, config, where=None):
        calls.append(batch)
        measuring.append(True)  # the calibration's own engine steps are not the call's
        try:
            return real_calibrate(runner, batch, config, where)
        finally:
            measuring.pop()

    def step(self):
        if not measuring:
            stepping.append(len(calls))
        return real_step(self)

    monkeypatch.setattr(cost_model, "calibrate", calibrate)
    monkeypatch.setattr(Engine, "step", step)
    real = engine_setup.load_cost_model
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda r, c=None, **kw: real(r, SMALL, cache_dir=fresh, **kw))
    prompts = [[1, 2, 3, 1, 2, 3], [5], [7, 8, 7, 8], [9, 9, 9]]
    generate(build_tiny_model(seed=0), prompts, max_new_tokens=6, drafter="ngram", eos_token_id=[])
    assert calls == [1, 2, 4] and set(stepping) == {3}
    # a second call of 3 sequences finds them measured
    generate(build_tiny_model(seed=0), prompts[:3], max_new_tokens=3, drafter="ngram")
    assert calls == [1, 2, 4]


def test_calibration_runs_on_the_models_device(fresh, device):
    """The calibration engine samples on the model's device (a CPU generator met CUDA logits there: every
    generate() on a GPU failed before its first token)."""
    runner = LlamaRunner(build_tiny_model(seed=0).to(device))
    model = load_cost_model(runner, SMALL, cache_dir=fresh)
    curve = model.curve(1)
    assert sorted(curve) == [1, 2, 4] and all(s > 0 for s in curve.values())
    assert list(curve.values()) == sorted(curve.values())  # kept non-decreasing
    assert model.key["device"].startswith(device)


def test_an_engine_prices_verify_steps_as_it_runs_them(fresh, monkeypatch):
    """Replayed CUDA graphs calibrate through graphs, under a key of their own (an eager GPU step costs several
    times a graphed one); an eager engine (the CPU's) calibrates eagerly."""
    from specdec import engine_setup, verify_cost
    from specdec.generate import generate

    graphs = []

    def fake(runner, prompts, sizes, sampling, **kw):
        graphs.append(kw.get("graphs", False))
        return {n: 1e-3 * (1 + 0.1 * n) for n in sizes}

    monkeypatch.setattr(verify_cost, "measure_verify_costs", fake)
    runner = LlamaRunner(build_tiny_model(seed=0))
    eager = load_cost_model(runner, SMALL, cache_dir=fresh)
    graphed = load_cost_model(runner, CalibrationConfig(**{**SMALL.__dict__, "graphs": True}), cache_dir=fresh)
    assert graphs == [False, True] and eager.file != graphed.file
    configs = []
    real = engine_setup.load_cost_model
    monkeypatch.setattr(engine_setup, "load_cost_model", lambda r, c=None, **kw: configs.append(c) or real(r, SMALL))
    generate(build_tiny_model(seed=0), [[1, 2, 3, 1, 2, 3]], max_new_tokens=4, drafter="ngram")
    assert [c.graphs for c in configs] == [False]


def test_the_bit_exact_mode_prices_its_own_steps_under_its_own_key(fresh, monkeypatch):
    """invariant=True verifies in blocks of rows, whose costs are not the default path's: its calls calibrate the
    mode's runner, into a file of its own (they priced trees with the default path's curve, shared under one key)."""
    from specdec import engine_setup, verify_cost
    from specdec.generate import generate

    timed = []

    def fake(runner, prompts, sizes, sampling, **kw):
        timed.append(runner.invariant)
        return {n: 1e-3 * (1 + (0.5 if runner.invariant else 0.1) * n) for n in sizes}

    monkeypatch.setattr(verify_cost, "measure_verify_costs", fake)
    files = []
    real = engine_setup.load_cost_model

    def load(runner, config=None, **kw):
        costs = real(runner, SMALL, cache_dir=fresh)
        files.append(costs.file)
        return costs

    monkeypatch.setattr(engine_setup, "load_cost_model", load)
    model = build_tiny_model(seed=0)
    for invariant in (True, False, True):
        generate(model, [[1, 2, 3, 1, 2, 3]], max_new_tokens=4, drafter="ngram", invariant=invariant)
    assert timed == [True, False] and files[0] == files[2] != files[1]


def test_a_curve_timed_while_the_machine_was_busy_is_measured_again(fresh, monkeypatch, caplog):
    """A 2-token verify timed at 3x a 1-token step (a cached curve found on a 2-core CPU: c(2..32) = 3.02 c(1)) is
    more than decoding the 2 tokens one by one: no machine's curve. It kept speculation="auto" from drafting what
    paid; it is now measured again once, and kept (with a warning) only if the second timing says the same. The
    retry is said by "measuring again" alone: the "measuring ..., once" line came twice."""
    busy, quiet = {1: 0.38, 2: 1.15, 4: 1.15}, {1: 0.04, 2: 0.04, 4: 0.041}
    timings = [busy, quiet]
    monkeypatch.setattr(verify_cost, "measure_verify_costs", lambda *args, **kw: timings.pop(0))
    runner = LlamaRunner(build_tiny_model(seed=0))
    with caplog.at_level("WARNING", logger="specdec.cost_model"):
        costs = load_cost_model(runner, SMALL, cache_dir=fresh)
    assert costs.curve(1) == quiet and not timings
    assert "a verify step of 2 tokens was timed at 3.0x a step of 1 token" in caplog.text
    assert "measuring again" in caplog.text
    assert caplog.text.count("measuring verify steps") == 1  # the retry is not announced as a second "once"
    timings[:] = [busy, busy]  # another model (a key of its own): busy twice
    caplog.clear()
    with caplog.at_level("WARNING", logger="specdec.cost_model"):
        costs = load_cost_model(LlamaRunner(build_tiny_model(seed=0, num_hidden_layers=3)), SMALL, cache_dir=fresh)
    assert costs.curve(1) == busy and not timings and "kept, and corrected" in caplog.text


def test_an_impossible_curve_cached_before_the_check_is_measured_again(fresh, monkeypatch, caplog):
    """A curve cached before calibrations were checked, in which 2 tokens cost 6x one (this machine's cache held one
    for the embedded model), was used as it was by every later process. Such a batch's curve is now dropped with a
    warning naming its file and measured again when first needed; the file keeps the rest, and a checked file (even
    one whose dear curve two calibrations agreed on) is trusted."""
    import json

    quiet = {1: 0.04, 2: 0.04, 4: 0.041}
    timings = [quiet]
    monkeypatch.setattr(verify_cost, "measure_verify_costs", lambda *args, **kw: timings.pop(0))
    runner = LlamaRunner(build_tiny_model(seed=0))
    file = load_cost_model(runner, SMALL, cache_dir=fresh).file
    data = json.loads(file.read_text())
    assert data.pop("checked") is True and not timings
    busy = {"1": 0.5, "2": 3.0, "4": 3.1}
    data["curves"] = {"1": busy, "2": {"1": 0.05, "2": 0.06, "4": 0.08}, "4": busy}
    file.write_text(json.dumps(data))  # as an older specdec wrote it
    monkeypatch.setattr(cost_model, "_MEMO", {})
    timings[:] = [quiet]
    with caplog.at_level("WARNING", logger="specdec.cost_model"):
        costs = load_cost_model(runner, SMALL, cache_dir=fresh)
    assert costs.curve(1) == quiet and not timings and sorted(costs.curves) == [1, 2]
    said = [r.getMessage() for r in caplog.records if str(file) in r.getMessage()]
    assert len(said) == 2 and "verify step of 2 tokens at batch 1 at 6.0x" in said[0] and "batch 4" in said[1]
    saved = json.loads(file.read_text())
    assert saved["checked"] is True and sorted(saved["curves"]) == ["1", "2"]
    saved["curves"]["1"] = busy  # kept by calibrate after two busy timings, then checked: trusted as it is
    file.write_text(json.dumps(saved))
    monkeypatch.setattr(cost_model, "_MEMO", {})
    caplog.clear()
    with caplog.at_level("WARNING", logger="specdec.cost_model"):
        assert load_cost_model(runner, SMALL, cache_dir=fresh).curve(1) == {1: 0.5, 2: 3.0, 4: 3.1}
    assert not caplog.records


def test_what_the_guard_learned_on_a_curve_is_not_kept_for_the_curve_measured_again(fresh, monkeypatch):
    """The guard's memory across calls was keyed by the cost file's name alone: after its curve was measured again
    (the file deleted, as the too-steep warning advises, or an impossible one dropped), the backoffs learned on the
    old prices carried on. It is kept per measured curve now; calls on one curve still share it."""
    from specdec import engine_setup, verify_cost
    from specdec.generate import generate

    timings = [{1: 0.04, 2: 0.07, 4: 0.1}, {1: 0.04, 2: 0.045, 4: 0.05}]
    monkeypatch.setattr(verify_cost, "measure_verify_costs", lambda *args, **kw: timings.pop(0))
    monkeypatch.setattr(engine_setup, "load_cost_model",
                        lambda r, c=None, **kw: load_cost_model(r, SMALL, cache_dir=fresh))
    keys, real = [], engine_setup.TreeSizer
    monkeypatch.setattr(engine_setup, "TreeSizer",
                        lambda costs, memory, **kw: keys.append(memory) or real(costs, memory=memory, **kw))
    model = build_tiny_model(seed=0)
    for _ in range(2):
        generate(model, [[1, 2, 3, 1, 2, 3]], max_new_tokens=4, drafter="ngram")
    for file in fresh.glob("verify-*.json"):
        file.unlink()
    monkeypatch.setattr(cost_model, "_MEMO", {})
    generate(model, [[1, 2, 3, 1, 2, 3]], max_new_tokens=4, drafter="ngram")
    assert not timings and len(keys) == 3
    assert keys[0] == keys[1] and keys[2] != keys[0] and keys[2][0] == keys[0][0]  # same file, another curve


def test_weights_updated_between_calls_keep_their_costs_and_the_memo_bounded(monkeypatch, tmp_path):
    """A training loop's rollouts update the weights in place between generate() calls: every version was a new
    cost-cache key (a checksum of some weights), so each call measured the verify costs again (~20 s on the embedded
    model), added a memo entry and a guard memory file, without bound. The curves are keyed by the model's shapes now:
    measured once; models of other shapes each have their own, and the memo keeps the MEMO_LIMIT most recent."""
    monkeypatch.setattr(verify_cost, "measure_verify_costs",
                        lambda runner, prompts, sizes, sampling, **kw: {n: 1e-3 * (1 + 0.1 * (n - 1)) for n in sizes})
    monkeypatch.setattr(cost_model, "_MEMO", {})
    model = build_tiny_model(seed=4)
    runner = LlamaRunner(model)
    first = load_cost_model(runner, SMALL, cache_dir=tmp_path).file
    measured = cost_model.CALIBRATIONS["verify"]
    for _ in range(4):
        with torch.no_grad():
            model.lm_head.weight.add_(1e-3)  # an optimizer step
        assert load_cost_model(runner, SMALL, cache_dir=tmp_path).file == first
    assert cost_model.CALIBRATIONS["verify"] == measured and len(cost_model._MEMO) == 1
    files = {load_cost_model(LlamaRunner(build_tiny_model(seed=4, intermediate_size=136 + 8 * i)), SMALL,
                             cache_dir=tmp_path).file for i in range(cost_model.MEMO_LIMIT + 2)}  # other MLP widths
    assert len(files) == cost_model.MEMO_LIMIT + 2 and first not in files
    assert len(cost_model._MEMO) == cost_model.MEMO_LIMIT


def _proc_cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def test_the_cost_key_names_this_cpu_model_and_thread_count():
    """The key named the CPU by ``platform.processor() or platform.machine()``: "x86_64" on every Linux PC, so
    costs measured on one CPU were read as their own by another sharing the home directory."""
    model = _proc_cpu_model()
    if model is None:
        pytest.skip("no model name in /proc/cpuinfo")
    key = cost_model.machine_key(LlamaRunner(build_tiny_model(seed=0)))
    assert model in key["device_name"] and key["threads"] == torch.get_num_threads()


def _cpuinfo(model: str, flags: str = "fpu sse2 avx2 fma", family: int = 25) -> str:
    return "".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: 17\n"
                   f"model name\t: {model}\nflags\t\t: {flags}\n\n" for i in range(2))


def test_each_cpu_model_has_its_own_costs_and_row_policy(fresh, monkeypatch):
    """Two CPUs under one cache folder (a home directory shared between machines): each measures and keeps its own
    c(n) and row policy, and a CPU that comes back reads its own from disk."""
    from specdec import cpu_info

    calls = _calls(monkeypatch)
    runner = LlamaRunner(build_tiny_model(seed=0))
    rows = cost_model.CALIBRATIONS["rows"]
    files = {}
    for text in (_cpuinfo("AMD EPYC 9454 48-Core Processor"), _cpuinfo("Intel(R) Xeon(R) Platinum 8488C"),
                 _cpuinfo("AMD EPYC 9454 48-Core Processor", "fpu sse2 avx2 fma avx512f"),  # a VM showing AVX-512
                 _cpuinfo("AMD EPYC 9454 48-Core Processor", family=26)):  # a generic VM name, another family
        monkeypatch.setattr(cpu_info, "cpuinfo_text", lambda text=text: text)
        files[text] = load_cost_model(runner, SMALL, cache_dir=fresh).file
    assert calls == [1, 1, 1, 1] and cost_model.CALIBRATIONS["rows"] == rows + 4
    assert len(set(files.values())) == 4 and len(list(fresh.glob("verify-*.json"))) == 4
    assert len(list(fresh.glob("rows-*.json"))) == 4
    # the first CPU again, in a new process: its own measurements, from disk
    monkeypatch.setattr(cost_model, "_MEMO", {})
    monkeypatch.setattr(cost_model, "_ROWS_DONE", {})
    first = next(iter(files))
    monkeypatch.setattr(cpu_info, "cpuinfo_text", lambda: first)
    assert load_cost_model(runner, SMALL, cache_dir=fresh).file == files[first]
    assert calls == [1, 1, 1, 1] and cost_model.CALIBRATIONS["rows"] == rows + 4


def test_each_row_policy_has_its_own_verify_costs(fresh, monkeypatch):
    """A verify step runs its products under the installed row policy, so a curve timed under one is not another's:
    a draft model loaded without installing rows (install_rows=False) under a second policy is measured again."""
    monkeypatch.setattr(verify_cost, "measure_verify_costs", lambda *args, **kw: {1: 0.04, 2: 0.04, 4: 0.041})
    runner = LlamaRunner(build_tiny_model(seed=0))
    before = cost_model.CALIBRATIONS["verify"]
    files = []
    for cols in ({1: 2}, {1: 4, 2: 4}):
        row_policy.install(torch.get_num_threads(), cols, runner.dtype)
        files.append(load_cost_model(runner, SMALL, cache_dir=fresh, install_rows=False).file)
    assert files[0] != files[1] and cost_model.CALIBRATIONS["verify"] == before + 2


def test_a_cost_file_of_another_key_or_format_is_measured_again(fresh, monkeypatch):
    """A cache written under the old key (the CPU named "x86_64") is never read, and a file that is not a JSON object
    is measured again rather than failing the call."""
    calls = _calls(monkeypatch)
    runner = LlamaRunner(build_tiny_model(seed=0))
    model = load_cost_model(runner, SMALL, cache_dir=fresh)
    old = {k: v for k, v in model.key.items() if k not in ("cpu", "isa")} | {"device_name": "x86_64"}
    assert cost_model._digest(old) != cost_model._digest(model.key)
    model.file.write_text("[1, 2]")
    monkeypatch.setattr(cost_model, "_MEMO", {})
    assert load_cost_model(runner, SMALL, cache_dir=fresh).curve(1) and calls == [1, 1]


def test_cpu_info_reads_model_names_arm_parts_and_isa_flags():
    from specdec import cpu_info

    hybrid = _cpuinfo("Core A") + _cpuinfo("Core B", "avx2 avx512f amx_tile md_clear")
    assert cpu_info.cpu_model(hybrid) == "Core A + Core B"
    assert cpu_info.cpu_signature(hybrid) == "AuthenticAMD family 25 model 17"
    assert cpu_info.isa(_cpuinfo("X", "fpu md_clear avx512f amx_tile avx2")) == "amx_tile avx2 avx512f"
    arm = "processor\t: 0\nFeatures\t: fp asimd sve2 bf16\nCPU implementer\t: 0x41\nCPU part\t: 0xd4f\n"
    assert cpu_info.cpu_model(arm) == "Arm implementer 0x41 part 0xd4f"
    assert cpu_info.isa(arm) == "asimd bf16 sve2" and cpu_info.cpu_signature(arm) == ""
    assert cpu_info.cpu_model("") == cpu_info._os_cpu_name() != ""


def test_a_cpu_signature_missing_its_family_or_model_is_empty():
    """A /proc/cpuinfo with a vendor but no family or model gives no signature, not "GenuineIntel family  model "."""
    from specdec import cpu_info

    assert cpu_info.cpu_signature("processor\t: 0\nvendor_id\t: GenuineIntel\n") == ""


def test_cpu_info_splits_a_text_into_lines_once(monkeypatch):
    """A cost model's key (model name, signature, flags: five names) is read at every engine built; /proc/cpuinfo
    has some thirty lines per logical CPU, so each text is split once, and another text is read anew."""
    from specdec import cpu_info

    splits = []

    class Counted(str):
        def splitlines(self, *args):
            splits.append(1)
            return super().splitlines(*args)

    text = Counted(_cpuinfo("AMD EPYC 9454 48-Core Processor", "fpu avx2 fma avx512f"))
    monkeypatch.setattr(cpu_info, "cpuinfo_text", lambda: text)
    for _ in range(3):
        key = (cpu_info.cpu_model(), cpu_info.cpu_signature(), cpu_info.isa())
        assert key == ("AMD EPYC 9454 48-Core Processor", "AuthenticAMD family 25 model 17", "avx2 avx512f fma")
    assert len(splits) <= 6  # once per name (model name, vendor_id, cpu family, model, flags), at most
    other = _cpuinfo("Intel(R) Xeon(R) Platinum 8488C")
    monkeypatch.setattr(cpu_info, "cpuinfo_text", lambda: other)
    assert cpu_info.cpu_model() == "Intel(R) Xeon(R) Platinum 8488C"


def test_row_policy_measured_once_per_key_and_installed(fresh):
    runner = LlamaRunner(build_tiny_model(seed=0))
    before = cost_model.CALIBRATIONS["rows"]
    row_policy.uninstall()
    cost_model.ensure_row_policy(runner, SMALL, cache_dir=fresh)
    assert cost_model.CALIBRATIONS["rows"] == before + 1
    assert (torch.get_num_threads(), runner.dtype) in row_policy._ACTIVE
    row_policy.uninstall()
    cost_model._ROWS_DONE.clear()
    cost_model.ensure_row_policy(runner, SMALL, cache_dir=fresh)  # from disk
    assert cost_model.CALIBRATIONS["rows"] == before + 1
    assert (torch.get_num_threads(), runner.dtype) in row_policy._ACTIVE


def test_a_model_too_short_to_calibrate_decodes_plainly_under_auto():
    """A context of 6 tokens has no room for the calibration's steps: generate() with a drafter raised a bare
    ValueError from the calibration (plain decoding and speculation='always' worked). Now speculation='auto' decodes
    plainly (an unmeasured curve, every verified token at a decode step, and the guard off); a draft model that
    short is priced as unknown."""
    from specdec.generate import generate

    short = build_tiny_model(vocab_size=64, max_position_embeddings=6)
    prompts = [[45, 14], [9]]
    plain = generate(short, prompts, max_new_tokens=3)
    out = generate(short, prompts, max_new_tokens=3, drafter="ngram", return_dict=True)
    assert out.sequences == plain and all(s.steps == 3 for s in out.stats)  # one token per step
    costs = load_cost_model(LlamaRunner(short))
    assert not costs.measured and costs.relative(5) == 5.0
    # a layer fewer than the target (one of its size is never asked, by its shapes)
    draft = build_tiny_model(vocab_size=64, seed=3, max_position_embeddings=8, num_hidden_layers=1)
    assert generate(short, [[1, 2]], max_new_tokens=4, drafter="draft-model", drafter_options={"model": draft}) \
        == generate(short, [[1, 2]], max_new_tokens=4)
    # the guard is off from the start: a long draft model beside it is not calibrated for nothing, and sampled
    # trees (verified whole where no earlier shape sizes them) are not asked either
    calibrations = cost_model.CALIBRATIONS["verify"]
    long_draft = build_tiny_model(vocab_size=64, seed=4, num_hidden_layers=1)
    out = generate(short, [[1, 2]], max_new_tokens=4, drafter="draft-model", drafter_options={"model": long_draft},
                   return_dict=True)
    assert out.stats[0].steps == 4 and cost_model.CALIBRATIONS["verify"] == calibrations
    out = generate(short, prompts, max_new_tokens=3, drafter="ngram", do_sample=True, seed=1, sampler="coupled",
                   return_dict=True)
    assert all(s.steps == 3 for s in out.stats)


def test_each_model_runs_under_its_own_row_policy(fresh, monkeypatch):
    """A process with two models: the one whose engine is built runs under its own policy, and a dtype's weights
    never under another dtype's. The policy was per thread count only, and an engine build skipped installing a
    policy it had installed before: a float16 model built after a bfloat16 one multiplied under the bf16 policy,
    whose packed products oneDNN refuses for fp16 weights on CPUs without avx512_fp16 (a raw RuntimeError)."""
    policies = {(torch.float16, 64): {1: 2}, (torch.bfloat16, 64): {1: 4, 2: 4}, (torch.float16, 32): {1: 3}}
    monkeypatch.setattr(row_policy, "measure_row_policy",
                        lambda weights, **_: dict(policies[weights[0].dtype, weights[0].shape[1]]))
    fp16 = LlamaRunner(build_tiny_model(seed=0).to(torch.float16))
    bf16 = LlamaRunner(build_tiny_model(seed=1).to(torch.bfloat16))
    narrow = LlamaRunner(build_tiny_model(seed=2, hidden_size=32).to(torch.float16))
    row_policy.uninstall()
    for runner, expected in ((fp16, {1: 2}), (bf16, {1: 4, 2: 4}), (narrow, {1: 3}), (fp16, {1: 2})):
        cost_model.ensure_row_policy(runner, SMALL, cache_dir=fresh)
        assert row_policy.active_cols(runner.dtype) == expected
    assert row_policy.active_cols(torch.bfloat16) == {1: 4, 2: 4}  # kept beside the fp16 model's
    assert row_policy.active_cols(torch.float32) == {}  # nothing measured for float32 weights


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_a_measurement_the_user_waits_for_says_so_once_and_shows_its_progress(fresh, monkeypatch, caplog):
    """On a fresh 2-core machine the first generate() with a drafter spent ~1 min measuring the row policy and the
    verify curve in silence (the CLI printed nothing until its answer). Each one-off now says what it measures and
    where it is cached, in one warning, and steps a progress bar to its end; a cached load says nothing."""
    bars = []
    real_one_off = cost_model._one_off

    @contextlib.contextmanager
    def watched(what, total, unit, where, **kw):
        with real_one_off(what, total, unit, where, **kw) as step:
            bars.append([total, 0])
            yield lambda: (step(), bars[-1].__setitem__(1, bars[-1][1] + 1))

    monkeypatch.setattr(cost_model, "_one_off", watched)

    real_measure = verify_cost.measure_verify_costs  # timed for real (the bar steps), its values replaced: a busy
    monkeypatch.setattr(verify_cost, "measure_verify_costs",  # machine's tiny-model timing is measured again (2 bars)
                        lambda *args, **kw: {n: 1e-3 * n ** 0.5 for n in real_measure(*args, **kw)})
    runner = LlamaRunner(build_tiny_model(seed=0))
    row_policy.uninstall()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # said "on 1 threads"
    try:
        with caplog.at_level("WARNING", logger="specdec.cost_model"):
            load_cost_model(runner, SMALL, cache_dir=fresh)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "matrix products" in said[0] and "verify steps of 1-4 tokens at batch 1" in said[1]
        assert " rows on 1 thread, once" in said[0], said[0]
        assert all(f"cached in {fresh}" in line for line in said)
        assert bars == [[row_policy.SMALL_M_MAX] * 2, [2 * 3] * 2]  # every row count; (repeats + 1) x 3 sizes
        caplog.clear()
        monkeypatch.setattr(cost_model, "_MEMO", {})
        cost_model._ROWS_DONE.clear()
        with caplog.at_level("WARNING", logger="specdec.cost_model"):
            load_cost_model(runner, SMALL, cache_dir=fresh)  # a new process: both from the disk
        assert not caplog.records and len(bars) == 2
    finally:
        torch.set_num_threads(threads)


def test_a_measurement_a_read_only_cache_cannot_keep_is_not_said_to_be_cached(fresh, monkeypatch, caplog,
                                                                             read_only):
    """A cost cache on a read-only mount: each one-off said "measuring ..., once (cached in DIR)", then that it could
    not be cached. It says at once that it measures for this process only, and why."""
    monkeypatch.setattr(verify_cost, "measure_verify_costs", lambda runner, prompts, sizes, *a, **kw:
                        {n: 1e-3 * n ** 0.5 for n in sizes})
    read_only(fresh)
    row_policy.uninstall()
    with caplog.at_level("WARNING", logger="specdec.cost_model"):
        load_cost_model(LlamaRunner(build_tiny_model(seed=0)), SMALL, cache_dir=fresh)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("measuring")]
    assert len(said) == 2 and all(f"for this process only (not cached: {fresh} is not writable)" in line
                                  for line in said)


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_the_calibrations_warm_up_round_is_not_timed(monkeypatch):
    """An engine whose first round of steps takes 1 s each (a first call's one-offs) and later steps 1 ms per
    query token: with repeats=1 the median is of the one timed round alone."""
    class Timed:
        def __init__(self, runner, cache, drafter, **kw):
            self.drafter, self.steps, self.seconds = drafter, 0, {"verify": 0.0}

        def add(self, contexts):
            pass

        def step(self):
            self.seconds["verify"] += 1.0 if self.steps < 3 else 1e-3 * (self.drafter.nodes + 1)
            self.steps += 1

    monkeypatch.setattr(verify_cost, "Engine", Timed)
    runner = LlamaRunner(build_tiny_model(seed=0))
    times = verify_cost.measure_verify_costs(runner, [[5] * 16], [1, 2, 4], SamplingConfig(), repeats=1)
    assert times == pytest.approx({1: 1e-3, 2: 2e-3, 4: 4e-3})


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_every_calibration_step_commits_one_token(monkeypatch):
    """The chain drafted for the calibration is rejected at its first node, so c(n) prices verifying n tokens,
    not committing them (a chain of the root's copies, which a random-weight target repeats, was accepted)."""
    made = []

    class Kept(verify_cost.Engine):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(self)

    monkeypatch.setattr(verify_cost, "Engine", Kept)
    runner = LlamaRunner(build_tiny_model(seed=0))
    verify_cost.measure_verify_costs(runner, [[5] * 16], [1, 2, 4], SamplingConfig(), repeats=2)
    seq, = made[0].seqs
    assert seq.step_nodes == [0, 1, 3] * 3  # (repeats + 1) rounds of n - 1 nodes
    assert seq.step_lengths == [1] * 9


def _scripted_engines(monkeypatch, seconds: list[float]) -> list:
    """Stands the calibration's engine in by one whose steps' verifies take ``seconds`` in turn and which keeps the
    contexts it is given; returns the engines made, in order."""
    made, script = [], list(seconds)

    class Scripted:
        def __init__(self, runner, cache, drafter, **kw):
            self.drafter, self.seconds, self.contexts = drafter, {"verify": 0.0}, None
            made.append(self)

        def add(self, contexts):
            self.contexts = [list(c) for c in contexts]

        def step(self):
            self.seconds["verify"] += script.pop(0)

    monkeypatch.setattr(verify_cost, "Engine", Scripted)
    return made


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_calibration_takes_the_median_step_time_not_the_mean(monkeypatch):
    """One slow step among three timed ones (a busy machine) must not move c(n)."""
    # warm-up round, then 3 timed rounds of one n = 1 step each: 1, 1 and 10 ms -> median 1 ms (the mean is 4 ms)
    _scripted_engines(monkeypatch, [5.0, 1e-3, 1e-3, 10e-3])
    runner = LlamaRunner(build_tiny_model(seed=0))
    times = verify_cost.measure_verify_costs(runner, [[5] * 16], [1], SamplingConfig(), repeats=3)
    assert times == pytest.approx({1: 1e-3})


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_calibration_context_is_the_prompt_repeated_by_extra_context(monkeypatch):
    """extra_context times the steps at a longer context: each prompt is extended by its own tokens repeated."""
    made = _scripted_engines(monkeypatch, [1e-3] * 2)
    runner = LlamaRunner(build_tiny_model(seed=0))
    verify_cost.measure_verify_costs(runner, [[7, 8, 9]], [1], SamplingConfig(), extra_context=4, repeats=1)
    assert made[0].contexts == [[7, 8, 9, 7, 8, 9, 7]]  # 3 prompt tokens + 4 more


@pytest.mark.measured_verify_costs  # --verify-curve would replace what it tests
def test_calibration_refuses_query_sizes_below_one_and_a_context_with_no_room(monkeypatch):
    made = _scripted_engines(monkeypatch, [1e-3] * 100)
    runner = LlamaRunner(build_tiny_model(seed=0))
    assert runner.shape.max_positions == 512
    with pytest.raises(ValueError, match="query sizes >= 1"):
        verify_cost.measure_verify_costs(runner, [[5] * 16], [0, 2], SamplingConfig(), repeats=1)
    # growth = (repeats + 1) * (1 + 254) = 510, room = 512 - 510 - 2 = 0: no context token fits
    with pytest.raises(ValueError, match="too short"):
        verify_cost.measure_verify_costs(runner, [[5] * 16], [1, 254], SamplingConfig(), repeats=1)
    # (1 + 253) * 2 = 508: room 2, so the prompt is cut to its last 2 tokens and calibrated
    assert set(verify_cost.measure_verify_costs(runner, [[5] * 16], [1, 253], SamplingConfig(), repeats=1)) == {1, 253}
    assert made[-1].contexts == [[5, 5]]


def test_interpolation_and_relative_cost():
    costs = CostModel({}, {1: {1: 0.010, 2: 0.011, 4: 0.013, 8: 0.021}})
    assert costs.relative(1) == 1.0
    assert costs.relative(3) == pytest.approx(1.2)  # halfway between 2 and 4
    assert costs.relative(12) == pytest.approx(2.9)  # past the grid: the last segment's slope
    assert costs.relative(4, batch=8) == pytest.approx(1.3)  # nearest measured batch when none can be run


@pytest.mark.parametrize("threads", [1, 2])
def test_every_installed_row_policy_returns_f_linear(threads):
    from specdec.models.llama import linear

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    before, saved = torch.get_num_threads(), dict(row_policy._ACTIVE)
    torch.set_num_threads(threads)
    try:
        row_policy.install(threads, {1: 2, 2: 8, 3: 3, 5: 32, 31: 32})
        for m in range(1, 40):
            x = torch.randn(m, 40, generator=gen)
            for b in (None, bias):
                got = linear(x, weight, b)
                assert got.shape == (m, 48) and got.is_contiguous()
                torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError):
            row_policy.install(threads, {4: 2})  # fewer columns than rows
    finally:
        torch.set_num_threads(before)
        row_policy._ACTIVE.clear()
        row_policy._ACTIVE.update(saved)


needs_packing = pytest.mark.skipif(not row_policy.packing_available(), reason="this PyTorch has no oneDNN")


@needs_packing
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_products_return_f_linear(threads):
    """The product over oneDNN-packed weights, as linear() runs it under a policy, for every row count it may
    take, with and without bias; and a product that needs gradients goes to F.linear (packed has no autograd)."""
    from specdec.models.llama import linear

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    before, saved = torch.get_num_threads(), dict(row_policy._ACTIVE)
    torch.set_num_threads(threads)
    try:
        row_policy.install(threads, {m: row_policy.PACKED for m in range(1, 33)})
        for m in (1, 2, 3, 8, 17, 32, 33):
            x = torch.randn(m, 40, generator=gen)
            for b in (None, bias):
                got = linear(x, weight, b)
                assert got.shape == (m, 48) and got.is_contiguous()
                torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
        assert id(weight) in row_policy._PACKED
        trained = torch.nn.Parameter(weight.clone())
        out = linear(torch.randn(4, 40, generator=gen), trained)
        assert out.grad_fn is not None and id(trained) not in row_policy._PACKED
    finally:
        torch.set_num_threads(before)
        row_policy._ACTIVE.clear()
        row_policy._ACTIVE.update(saved)


@needs_packing
def test_packed_copy_follows_its_weight():
    """A weight changed in place (an optimizer step, a load) is packed again; a weight that dies takes its packed
    copy with it (the copies are the model's bytes once more)."""
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(24, 16, generator=gen), torch.randn(3, 16, generator=gen)
    first = row_policy.packed_weight(weight)
    assert row_policy.packed_weight(weight) is first  # packed once
    weight.mul_(2.0)
    torch.testing.assert_close(row_policy.packed_linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
    assert row_policy.packed_weight(weight) is not first
    key = id(weight)
    del weight, first
    assert key not in row_policy._PACKED


@needs_packing
def test_packed_copy_follows_new_storage_of_its_parameter():
    """``param.data = ...`` (and ``.half()`` then ``.float()``, which do it twice) gives a parameter new memory without
    moving its version counter: it is packed again, never multiplied as the weight it was."""
    gen = torch.Generator().manual_seed(2)
    layer, x = torch.nn.Linear(16, 24, bias=False), torch.randn(3, 16, generator=gen)
    row_policy.packed_weight(layer.weight)
    layer.weight.data = torch.randn(24, 16, generator=gen)
    torch.testing.assert_close(row_policy.packed_linear(x, layer.weight), x @ layer.weight.T, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.half().float()  # the same values, rounded, maybe at the address packed from: still packed again
    torch.testing.assert_close(row_policy.packed_linear(x, layer.weight), x @ layer.weight.T, rtol=1e-5, atol=1e-5)


@needs_packing
def test_an_edit_autograd_does_not_count_is_packed_again_at_the_next_call(monkeypatch):
    """A write through ``.data`` (a LoRA merge, a weight swap) or into an inference tensor moves neither the version
    nor the address: generate() multiplied the old packed copy, silently other tokens. forget_edited() (each call)
    sees it from a probe of the values; weights that did not change keep their copies."""
    from specdec.testing import build_tiny_model

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 40, generator=gen)
    layer = torch.nn.Linear(40, 48, bias=False)
    with torch.inference_mode():
        frozen = torch.randn(48, 40, generator=gen)
    kept = torch.randn(48, 40, generator=gen)
    first = {id(w): row_policy.packed_weight(w) for w in (layer.weight, frozen, kept)}
    layer.weight.data.add_(torch.randn(48, 40, generator=gen))  # every element
    with torch.inference_mode():
        frozen[7, 0] += 1.0  # one element, a probed one: row-major index 280, a multiple of the probe's step 7
    row_policy.forget_edited([layer.weight, frozen, kept])
    for w in (layer.weight, frozen, kept):
        torch.testing.assert_close(row_policy.packed_linear(x, w), x @ w.detach().T, rtol=1e-5, atol=1e-5)
    assert row_policy.packed_weight(kept) is first[id(kept)]
    # end to end: a model whose products run packed (this policy, not a measured one), edited through .data between
    # two calls
    import specdec.engine_setup

    monkeypatch.setattr(specdec.engine_setup, "ensure_row_policy", lambda runner: None)
    model = build_tiny_model()
    before, saved = torch.get_num_threads(), dict(row_policy._ACTIVE)
    try:
        row_policy.install(torch.get_num_threads(), {m: row_policy.PACKED for m in range(1, 33)})
        specdec.generate(model, [[1, 2, 3]], max_new_tokens=4)
        with torch.no_grad():
            for p in model.parameters():
                p.data.mul_(1.5)
        ids = torch.tensor([[1, 2, 3]])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                              pad_token_id=0)[0].tolist()
        assert specdec.generate(model, [[1, 2, 3]], max_new_tokens=8)[0] == want
    finally:
        torch.set_num_threads(before)
        row_policy._ACTIVE.clear()
        row_policy._ACTIVE.update(saved)


@needs_packing
def test_a_fused_blocks_packed_copy_follows_an_edit_of_any_of_its_parts(monkeypatch, tmp_path):
    """A checkpoint specdec lays out itself multiplies q/k/v (and gate/up) as one block, a view sharing q's version
    counter only: a k, v or up projection edited in place under no_grad moved neither the block's version nor its
    address, so packed products (verify steps, prefill) multiplied the old weights while one-row decode steps read
    the new: greedy speculative output left plain decoding's."""
    import specdec.engine_setup
    from specdec.models.fused_projections import LayerProjections
    from specdec.models.loader import load_model
    from specdec.testing import save_tiny_checkpoint

    loaded = load_model(save_tiny_checkpoint(tmp_path / "tiny", variant="llama-mha-untied"))
    layer = loaded.model.model.layers[1]
    block = LayerProjections.of(layer).qkv.weight
    first = row_policy.packed_weight(block)
    with torch.no_grad():
        layer.self_attn.v_proj.weight[0, 0] = 300.0
    assert row_policy.packed_weight(block) is not first  # packed again: its part changed
    monkeypatch.setattr(specdec.engine_setup, "ensure_row_policy", lambda runner: None)
    before, saved = torch.get_num_threads(), dict(row_policy._ACTIVE)
    try:
        row_policy.install(torch.get_num_threads(), {m: row_policy.PACKED for m in range(1, 33)})
        prompt = [5, 7, 9, 11, 3, 20, 21]
        specdec.generate(loaded, [prompt], max_new_tokens=4)  # every block packed
        with torch.no_grad():
            layer.mlp.up_proj.weight[0, 0] = 300.0
        ids = torch.tensor([prompt])
        want = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                     pad_token_id=0)[0].tolist()
        assert specdec.generate(loaded, [prompt], max_new_tokens=16)[0] == want
        assert specdec.generate(loaded, [prompt], max_new_tokens=16, drafter="ngram")[0] == want
    finally:
        torch.set_num_threads(before)
        row_policy._ACTIVE.clear()
        row_policy._ACTIVE.update(saved)


def test_packing_is_refused_where_unavailable(monkeypatch):
    monkeypatch.setattr(row_policy, "packing_available", lambda: False)
    with pytest.raises(ValueError, match="oneDNN"):
        row_policy.install(1, {4: row_policy.PACKED})
    assert row_policy.measure_row_policy([torch.randn(8, 8)], max_rows=3, repeats=1, allow_packed=True) \
        .get(1) != row_policy.PACKED


def test_packed_weights_need_memory_and_can_be_switched_off(monkeypatch):
    runner = LlamaRunner(build_tiny_model(vocab_size=64, seed=1))
    monkeypatch.setattr(row_policy, "packing_available", lambda: True)
    monkeypatch.setattr(cost_model, "available_memory_bytes", lambda device: 10**12)
    assert cost_model.packed_weights_allowed(runner)
    monkeypatch.setenv("SPECDEC_PACKED_WEIGHTS", "0")
    assert not cost_model.packed_weights_allowed(runner)
    monkeypatch.delenv("SPECDEC_PACKED_WEIGHTS")
    weight_bytes = sum(p.numel() * p.element_size() for layer in runner.layers for n, p in layer.named_parameters()
                       if p.dim() == 2 and "proj" in n) + runner.lm_head.numel() * runner.lm_head.element_size()
    monkeypatch.setattr(cost_model, "available_memory_bytes", lambda device: 2 * weight_bytes - 1)
    assert not cost_model.packed_weights_allowed(runner)  # a copy of the weights must fit twice over
    monkeypatch.setattr(cost_model, "available_memory_bytes", lambda device: 2 * weight_bytes)
    assert cost_model.packed_weights_allowed(runner)


def test_packing_is_decided_once_per_process(fresh, monkeypatch):
    """The packed copies a policy makes use up the memory the decision measured: a later engine build with less
    memory available keeps the decision (and the installed policy) instead of measuring a second policy."""
    runner = LlamaRunner(build_tiny_model(vocab_size=64, seed=1))
    monkeypatch.setattr(row_policy, "packing_available", lambda: True)
    monkeypatch.setattr(row_policy, "measure_row_policy", lambda weights, allow_packed, **kw: {2: 2} if allow_packed
                        else {})
    monkeypatch.setattr(cost_model, "available_memory_bytes", lambda device: 10**12)
    before = cost_model.CALIBRATIONS["rows"]
    cost_model.ensure_row_policy(runner, SMALL, cache_dir=fresh)
    monkeypatch.setattr(cost_model, "available_memory_bytes", lambda device: 0)
    cost_model.ensure_row_policy(runner, SMALL, cache_dir=fresh)
    assert cost_model.CALIBRATIONS["rows"] == before + 1 and row_policy.active_cols() == {2: 2}


def test_measure_row_policy_pads_only_to_faster_counts():
    w = [torch.randn(64, 32)]
    cols = row_policy.measure_row_policy(w, max_rows=6, repeats=1)
    assert all(1 <= m <= c <= 6 for m, c in cols.items())


def test_row_policy_weighs_each_matrix_by_its_scale(monkeypatch):
    """A sampled layer stands for ``scale`` layers: scripted costs where the small matrix favours F.linear and the
    big one the transposed product; unscaled, F.linear wins the sum, with the big matrix counted 10 times not. The
    products advance a scripted clock: slept, a loaded CI worker's oversleeping turned the 21 vs 14 ms around."""
    big, small = torch.zeros(8, 4), torch.zeros(4, 4)
    seconds = {("linear", 8): 0.002, ("transposed", 8): 0.001, ("linear", 4): 0.001, ("transposed", 4): 0.004}
    now = [0.0]

    def spend(kind, w):
        now[0] += seconds[kind, w.shape[0]]

    monkeypatch.setattr(row_policy, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(row_policy, "F", SimpleNamespace(linear=lambda x, w, b=None: spend("linear", w)))
    monkeypatch.setattr(row_policy, "transposed_linear", lambda x, w, cols: spend("transposed", w))
    assert row_policy.measure_row_policy([big, small], max_rows=1, repeats=3) == {}  # 3 ms vs 5 ms
    assert row_policy.measure_row_policy([big, small], max_rows=1, repeats=3, scales=[10, 1]) == {1: 1}  # 21 vs 14
    # the packed product (2 ms over both matrices): chosen only when offered, wherever it is fastest
    seconds["packed", 8], seconds["packed", 4] = 0.0005, 0.0015
    monkeypatch.setattr(row_policy, "_packs", lambda weights: list(weights))
    monkeypatch.setattr(row_policy, "packed_linear", lambda x, w, b=None, packed=None: spend("packed", w))
    assert row_policy.measure_row_policy([big, small], max_rows=1, repeats=3) == {}
    assert row_policy.measure_row_policy([big, small], max_rows=1, repeats=3,
                                         allow_packed=True) == {1: row_policy.PACKED}  # 2 ms vs 3 and 5
    assert row_policy.measure_row_policy([big, small], max_rows=1, repeats=3, scales=[10, 1],
                                         allow_packed=True) == {1: row_policy.PACKED}  # 6.5 ms vs 21 and 14
    with pytest.raises(ValueError, match="scale"):
        row_policy.measure_row_policy([big, small], scales=[1.0])


def test_a_layout_far_behind_in_its_first_pass_is_timed_once(monkeypatch):
    """Every row count times each layout ``repeats`` times, interleaved, but one that took over 1.5x the fastest's
    time in the row count's first pass is timed once there: F.linear, twice as slow at most row counts, took about
    40% of a first run's measuring. Scripted clock: F.linear 3 ms, transposed 1 ms, packed 1.4 ms (kept)."""
    w = torch.zeros(4, 4)
    seconds = {"linear": 0.003, "transposed": 0.001, "packed": 0.0014}
    now, calls = [0.0], collections.Counter()

    def spend(kind):
        now[0] += seconds[kind]
        calls[kind] += 1

    monkeypatch.setattr(row_policy, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(row_policy, "F", SimpleNamespace(linear=lambda x, w, b=None: spend("linear")))
    monkeypatch.setattr(row_policy, "transposed_linear", lambda x, w, cols: spend("transposed"))
    monkeypatch.setattr(row_policy, "_packs", lambda weights: list(weights))
    monkeypatch.setattr(row_policy, "packed_linear", lambda x, w, b=None, packed=None: spend("packed"))
    assert row_policy.measure_row_policy([w], max_rows=2, repeats=3, allow_packed=True) == {1: 1, 2: 2}
    # a warm-up pass of each, then per row count F.linear once and the other two three times
    assert calls == {"linear": 1 + 2, "transposed": 1 + 2 * 3, "packed": 1 + 2 * 3}
    seconds["packed"] = 0.0009  # now the fastest, F.linear 3.3x and the transposed product 1.1x it
    calls.clear()
    assert row_policy.measure_row_policy([w], max_rows=2, repeats=3, allow_packed=True) == {
        1: row_policy.PACKED, 2: row_policy.PACKED}
    assert calls == {"linear": 1 + 2, "transposed": 1 + 2 * 3, "packed": 1 + 2 * 3}


def test_row_policy_is_timed_over_more_weights_than_a_cache_holds():
    """Evenly spaced layers holding at least the byte budget, each standing for its share of the layers, plus
    the LM head: one cache-resident layer made single-threaded GEMV look fast (decode was 1.8x slower)."""
    runner = LlamaRunner(build_tiny_model(vocab_size=64, seed=1, num_hidden_layers=6))
    layer_bytes = sum(p.numel() * p.element_size() for n, p in runner.layers[0].named_parameters()
                      if p.dim() == 2 and "proj" in n)
    per_layer = 7  # q, k, v, o, gate, up, down
    weights, scales = cost_model.streamed_weights(runner, budget_bytes=10**12)  # more than the model: every layer
    assert len(weights) == 6 * per_layer + 1 and scales == [1.0] * len(weights)
    assert weights[-1].data_ptr() == runner.lm_head.data_ptr()
    weights, scales = cost_model.streamed_weights(runner, budget_bytes=2 * layer_bytes)  # layers 0 and 5, x3 each
    assert len(weights) == 2 * per_layer + 1 and scales == [3.0] * (2 * per_layer) + [1.0]
    assert weights[0].data_ptr() == runner.layers[0].self_attn.q_proj.weight.data_ptr()
    assert weights[per_layer].data_ptr() == runner.layers[5].self_attn.q_proj.weight.data_ptr()


def test_a_large_batch_calibrates_a_short_grid_and_extrapolates(monkeypatch):
    """Batch B times only sizes n with B * n <= BATCH_QUERY_TOKENS (and n <= 2), over a context shrunk to
    BATCH_CONTEXT_TOKENS / B: the full grid took 131 s at batch 32 on one thread. Larger n extrapolate."""
    timed = {}
    real = verify_cost.measure_verify_costs

    def spy(runner, prompts, sizes, sampling, **kw):
        timed["sizes"], timed["batch"], timed["context"] = list(sizes), len(prompts), len(prompts[0])
        return real(runner, prompts, sizes, sampling, **kw)

    monkeypatch.setattr(verify_cost, "measure_verify_costs", spy)
    runner = LlamaRunner(build_tiny_model(vocab_size=64, seed=1))
    curve = cost_model.calibrate(runner, 64, CalibrationConfig(sizes=(1, 2, 3, 4, 8), context=128, repeats=1))
    assert timed == {"sizes": [1, 2], "batch": 64, "context": 16}  # 64 x 3 > 128; 1024 / 64 = 16
    costs = CostModel({}, {64: curve})
    assert costs.seconds(4, 64) == pytest.approx(curve[2] + 2 * (curve[2] - curve[1]))
    assert cost_model.calibrate(runner, 1, CalibrationConfig(sizes=(1, 2, 3, 4, 8), context=128, repeats=1)).keys() \
        == {1, 2, 3, 4, 8}


def test_a_gpu_times_the_whole_grid_at_every_batch_size(monkeypatch):
    """On a GPU the forward stays memory-bound far past BATCH_QUERY_TOKENS, where the CPU's grid stops and
    extrapolates: batch 32 times every size up to the root and a 64-node tree, and prices them as timed."""
    from specdec.tree import MAX_TREE_NODES

    timed = {}

    def fake(runner, prompts, sizes, sampling, **kw):  # flat up to 128 query tokens, then compute-bound
        timed["sizes"] = list(sizes)
        return {n: 1e-3 * max(1.0, len(prompts) * n / 128) for n in sizes}

    monkeypatch.setattr(verify_cost, "measure_verify_costs", fake)
    gpu = SimpleNamespace(device=torch.device("cuda"), shape=SimpleNamespace(max_positions=8192, vocab_size=64))
    config = CalibrationConfig()
    curve = cost_model.calibrate(gpu, 32, config)
    assert timed["sizes"] == list(config.sizes) and max(config.sizes) == MAX_TREE_NODES + 1
    assert CostModel({}, {32: curve}).relative(MAX_TREE_NODES + 1, 32) == pytest.approx(32 * 65 / 128)
    cpu = SimpleNamespace(device=torch.device("cpu"), shape=gpu.shape)
    cost_model.calibrate(cpu, 32, config)
    assert timed["sizes"] == [1, 2, 3, 4]  # the CPU's short grid, as before


def test_drafter_layers_multiply_under_the_row_policy(monkeypatch):
    """EAGLE's and Medusa's projections go through linear() (their draft steps are a few rows, as the target's
    verify is): with a policy installed, every projection of a 1-row draft step takes the transposed product
    (which halved EAGLE's propose time on the 2-core CPU), and gives nn.Linear's values for 1-3-D inputs."""
    from specdec.drafters.eagle_model import EagleConfig, EagleModel
    from specdec.drafters.medusa_heads import MedusaConfig, MedusaHeads

    from specdec.models.llama import Linear

    gen = torch.Generator().manual_seed(0)
    layer = Linear(12, 5)
    for shape in ((3, 12), (2, 4, 12), (12,)):
        x = torch.randn(*shape, generator=gen)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert set(layer.state_dict()) == {"weight", "bias"}

    calls = []
    real = row_policy.transposed_linear
    monkeypatch.setattr(row_policy, "transposed_linear", lambda x, w, cols: calls.append(w.shape) or real(x, w, cols))
    monkeypatch.setitem(row_policy._ACTIVE, (torch.get_num_threads(), torch.float32), {1: 2})
    model = build_tiny_model(vocab_size=64, seed=1)
    eagle = EagleModel(EagleConfig.for_target(model.config, draft_vocab=tuple(range(32))))
    h = torch.randn(1, 1, 64, generator=gen)
    out, _, _ = eagle(h, h, torch.tensor([3]), torch.ones(1, 1, 1, dtype=torch.bool))
    eagle.logits(out[0], model.lm_head.weight)
    assert len(calls) == 9  # fc, q, k, v, o, gate, up, down, the reduced LM head
    calls.clear()
    heads = MedusaHeads(MedusaConfig(2, 1, 64, 64))
    heads(h[0])
    assert len(calls) == 4  # each head: its block's linear and its LM head
