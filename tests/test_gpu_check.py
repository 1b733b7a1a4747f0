"""benchmarks/gpu_check.py runs the CUDA cases of every test file that has them: a device-parametrised test, or one
skipped without CUDA, left out of its lists never runs on a GPU (seven files once were, and the first GPU run after
them failed)."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.script_loading import load_script

REPO = Path(__file__).resolve().parents[1]


def _gpu_check():
    return load_script("gpu_check")


def _files_with_device_tests() -> set[str]:
    """Files with a ``device``-parametrised test, or a test that runs only where CUDA is (skipped without it)."""
    found = set()
    for path in sorted((REPO / "tests").glob("test_*.py")):
        if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", path.read_text()):
            found.add(f"tests/{path.name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                if "device" in [a.arg for a in node.args.args]:
                    found.add(f"tests/{path.name}")
                    break
    return found


def test_every_device_parametrised_test_file_is_run_by_gpu_check():
    check = _gpu_check()
    listed = set(check.KERNEL_FILES) | set(check.DEVICE_FILES)
    wanted = _files_with_device_tests()
    assert "tests/test_generate.py" in wanted  # the scan sees the fixture
    assert "tests/test_host_sync.py" in wanted  # and a test skipped without CUDA
    assert wanted <= listed, f"add to benchmarks/gpu_check.py DEVICE_FILES: {sorted(wanted - listed)}"
    assert all((REPO / f).is_file() for f in listed), "gpu_check lists a test file that does not exist"


@pytest.mark.parametrize("deadline", ["0", "-5"])
def test_a_deadline_that_is_no_time_is_refused(deadline, capsys):
    with pytest.raises(SystemExit):
        _gpu_check().parse_args(["--deadline-s", deadline])
    assert "--deadline-s must be positive" in capsys.readouterr().err


def test_carry_checks_the_budget_and_the_gguf_before_splitting_or_downloading(monkeypatch, capsys):
    """A budget too small for the second call, or a --gguf that is not there (a traceback): one line, and nothing
    split, deleted or downloaded. The module's own example budgets are accepted (700 was refused)."""
    import re
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_carry

    def touched(*args, **kwargs):
        raise AssertionError("prepared before the budget and the GGUF were checked")

    for name in ("embedded_gguf", "split"):
        monkeypatch.setattr(gpu_carry, name, touched)
    monkeypatch.setattr(gpu_carry.shutil, "rmtree", touched)
    monkeypatch.setattr(gpu_carry.subprocess, "run", touched)
    with pytest.raises(SystemExit) as exit_:
        gpu_carry.main(["--budget-s", "500", "--gguf", "x.gguf"])
    assert exit_.value.code == 2 and "the first alone needs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        gpu_carry.main(["--gguf", "/nonexistent.gguf"])
    assert exit_.value.code == 2 and "--gguf /nonexistent.gguf: no such file" in capsys.readouterr().err
    for budget in re.findall(r"--budget-s (\d+)", gpu_carry.__doc__):
        gpu_carry.check_budget(float(budget))  # raises where the example would be refused


def test_speed_and_acceptance_steps_are_opt_in_and_rehearse_alone():
    check = _gpu_check()
    default = check.parse_args([]).steps.split(",")
    assert "speed" not in default and "acceptance" not in default  # the default run keeps its length
    assert check.parse_args(["--steps", "speed", "--rehearse"]).rehearse
    assert check.parse_args(["--steps", "speed,acceptance", "--rehearse"]).rehearse
    with pytest.raises(SystemExit):
        check.parse_args(["--steps", "env,speed", "--rehearse"])  # the CPU rehearsal has no GPU steps


def _speed_report(floor=1.1, chain=2.5, batch32=(1.0, 0.96), c65=1.3, small=1200.0):
    def oracle(shape, batch, eagle, speedup, tau_target=3.0, speculation="always"):
        return dict(shape=shape, batch=batch, eagle=eagle, tau_target=tau_target, speedup=speedup, tau=2.9,
                    speculation=speculation)

    target = dict(model="synthetic:llama-3.1-8b", note=None,
                  plain={"1": dict(step_over_floor=floor, decode_tokens_per_s=150.0, floor_tokens_per_s=165.0)},
                  oracle=[oracle("chain", 1, False, 9.9), oracle("chain", 1, True, chain, 2.0),
                          dict(oracle("chain", 1, True, chain - 0.3), depth=6, bound=2.3),  # the best chain counts
                          dict(oracle("chain", 1, True, chain), depth=4, bound=2.6),
                          oracle("tree", 32, False, 0.5),  # "always": not judged
                          *(oracle(shape, 32, False, s, speculation="auto")
                            for shape, s in zip(("chain", "tree"), batch32, strict=False))],
                  verify_cost=dict(ratio={"1": 1.0, "64": 1.0, "65": c65}))
    embedded = dict(model="default", note="'default' did not load (OSError: no file): synthetic:smollm2-135m",
                    plain={"1": dict(decode_tokens_per_s=small)}, oracle=[], verify_cost=None)
    return dict(status="passed", report=dict(models=[target, embedded]))


def _acceptance(**speedups):
    """Every category's row: 1.5x plain where ``speedups`` gives none."""
    from specdec.eval.prompts import CATEGORIES

    rows = [dict(category=c, tau=1.5, speedup_vs_plain=v, decode_speedup_vs_plain=v, tokens_per_s=100.0,
                 identical_to_plain=True) for c, v in ({c: 1.5 for c in CATEGORIES} | speedups).items()]
    return dict(status="passed", rows=rows)


def test_goals_are_judged_from_the_reports_steps():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_goals import goals

    steps = dict(speed=_speed_report(), acceptance=_acceptance(chat=0.99, summarisation=1.9, rag=1.7),
                 tests=dict(status="passed", device_cuda=dict(passed=58, failed=0)))
    verdicts = [g.verdict for g in goals(steps)]
    assert verdicts == ["met", "met", "missed", "missed", "met", "missed", "met", "missed", "met", "not measured"]
    judged = {g.what: g for g in goals(steps)}
    chained = next(g for g in judged.values() if "oracle chain" in g.what)
    assert chained.measured == "2.50x (tau 2.90, a chain of 4; weight reads allow 2.60x)"
    assert next(g for g in judged.values() if "c(65)" in g.what).measured == "1.30"
    batch32 = next(g for g in judged.values() if g.what.startswith("8B shape, batch 32"))
    assert batch32.measured.startswith("0.96x lowest of 2")
    embedded = next(g for g in judged.values() if g.what.startswith("embedded model"))
    assert "synthetic:smollm2-135m stood in" in embedded.what  # the embedded model's shape, said so
    assert judged["n-gram on the embedded model over plain, every category of specdec eval acceptance"].measured \
        == "0.99x (chat) lowest of 7"
    other = dict(speed=_speed_report(floor=1.2, chain=2.3, batch32=(0.98, 1.1), c65=1.2, small=900.0),
                 acceptance=_acceptance(chat=1.0, summarisation=1.7, rag=1.8),
                 tests=dict(status="failed", device_cuda=dict(passed=57, failed=1)),
                 e2e=dict(status="passed", rc=0, divergence_bugs=0))
    # beside c(65), where the report has them, the products alone at 65 rows over one
    other["speed"]["report"]["models"][0]["products"] = dict(ms={"1": 4.0, "65": 5.0})
    assert next(g for g in goals(other) if "c(65)" in g.what).measured == "1.20 (products alone 1.25)"
    assert [g.verdict for g in goals(other)] == ["missed", "missed", "met", "met", "missed", "met", "missed", "met",
                                                "missed", "met"]
    assert {g.verdict for g in goals({})} == {"not measured"}  # nothing ran: nothing met
    # the greedy device cases alone (the identity step) judge the identity goal as every device case does
    identity = dict(identity=dict(status="failed", greedy_cuda=dict(passed=41, failed=1)))
    assert [g.verdict for g in goals(identity)][-2:] == ["missed", "not measured"]
    identity["identity"]["greedy_cuda"]["failed"] = 0
    assert goals(identity)[-2].verdict == "met" and goals(identity)[-2].measured == "41 passed, 0 failed"
    identity["identity"]["greedy_cuda"]["passed"] = 0  # cut before it ran a case: nothing measured
    assert goals(identity)[-2].verdict == "not measured"
    batch1 = _speed_report()
    batch1["report"]["models"][0]["oracle"] = batch1["report"]["models"][0]["oracle"][:5]  # no batch-32 auto row
    assert goals(dict(speed=batch1))[3].verdict == "not measured"


def _judged(steps: dict) -> dict[str, tuple[str, str]]:
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_goals import goals

    return {g.what.split(":")[0]: (g.verdict, g.measured) for g in goals(steps)}


BATCH32 = "8B shape, batch 32, default policy (speculation=\"auto\")"
EVERY_CATEGORY = "n-gram on the embedded model over plain, every category of specdec eval acceptance"


def test_a_goal_with_a_row_skipped_or_a_category_missing_is_not_measured():
    """The lowest of the rows left was judged: a batch-32 tree row skipped for time, or five categories of seven
    missing, gave "met" from what the run had time for."""
    speed = _speed_report(batch32=(1.0, 1.2))
    target = speed["report"]["models"][0]
    assert _judged(dict(speed=speed))[BATCH32] == ("met", "1.00x lowest of 2 rows")
    target["oracle"].pop()  # the tree row, skipped for time
    target["skipped"] = ["oracle tree tau 3.0 b32 auto (~5 s)"]
    assert _judged(dict(speed=speed))[BATCH32] == ("not measured",
                                                   "oracle tree tau 3.0 b32 auto skipped (the rest: 1.00x)")
    target["skipped"] = []
    target["errors"] = ["oracle tree tau 3.0 b32 auto: RuntimeError: CUDA out of memory"]
    assert _judged(dict(speed=speed))[BATCH32][0] == "not measured"
    target["errors"] = []  # absent without a word: its row is still expected
    assert _judged(dict(speed=speed))[BATCH32] == ("not measured", "no tree row (the rest: 1.00x)")
    acceptance = _acceptance()
    acceptance["rows"] = [r for r in acceptance["rows"] if r["category"] in ("summarisation", "rag")]
    judged = _judged(dict(acceptance=dict(acceptance, status="failed")))
    assert judged[EVERY_CATEGORY] == ("not measured", "no chat, code, qa, math, translation (2 of the 7 categories)")


@pytest.mark.parametrize("where", ["first", "last"])
def test_a_nan_or_none_is_not_measured_wherever_it_stands(where):
    """min() and max() over a list holding NaN answer by its position; None crashed the comparison."""
    for bad in (float("nan"), None, 0.0):  # 0: a step over floor or c(65) of 0 was "met"
        batch32 = (bad, 1.2) if where == "first" else (1.2, bad)
        judged = _judged(dict(speed=_speed_report(batch32=batch32)))
        assert judged[BATCH32][0] == "not measured", (bad, judged[BATCH32])
        speed = _speed_report()
        chains = [r for r in speed["report"]["models"][0]["oracle"] if r["eagle"] and r["tau_target"] == 3.0]
        chains[0 if where == "first" else -1]["speedup"] = bad
        assert _judged(dict(speed=speed))["8B shape, batch 1, oracle chain at tau 3 with EAGLE's drafting"][0] \
            == "not measured"
        speeds = dict(chat=1.2, code=bad) if where == "first" else dict(chat=bad, code=1.2)
        judged = _judged(dict(acceptance=_acceptance(**speeds)))
        assert judged[EVERY_CATEGORY][0] == "not measured", (bad, judged[EVERY_CATEGORY])
        judged = _judged(dict(acceptance=_acceptance(summarisation=bad),
                              speed=_speed_report(floor=bad, c65=bad, small=bad)))
        assert judged["n-gram on the embedded model over plain, summarisation"][0] == "not measured"
        assert {judged[k][0] for k in judged if k.startswith(("8B shape, batch 1, plain", "8B shape", "embedded"))
                and "oracle" not in k and "batch 32" not in k} == {"not measured"}
    speed = _speed_report()
    del speed["report"]["models"][0]["plain"]["1"]["step_over_floor"]  # a plain row without it: no KeyError
    assert _judged(dict(speed=speed))["8B shape, batch 1, plain decoding"][0] == "not measured"


def test_a_goal_measured_exactly_at_its_target_is_met():
    """Each goal is "<=" or ">=" its target (docs/gpu-speed.md): a number equal to it meets it."""
    judged = _judged(dict(speed=_speed_report(floor=1.15, chain=2.4, batch32=(0.97, 1.0), c65=1.25, small=1000.0),
                          acceptance=_acceptance(chat=1.0, summarisation=1.8, rag=1.8)))
    assert {what: verdict for what, (verdict, _) in judged.items()} == {
        "8B shape, batch 1, plain decoding": "met", "8B shape, batch 1, oracle chain at tau 3 with EAGLE's drafting":
        "met", "8B shape": "met", BATCH32: "met", "embedded model, batch 1, default settings": "met",
        EVERY_CATEGORY: "met", "n-gram on the embedded model over plain, summarisation": "met",
        "n-gram on the embedded model over plain, rag": "met",
        "greedy identity of every drafter on CUDA (the device test cases)": "not measured",
        "bf16 greedy divergences from transformers, each classified at its first token": "not measured"}


def test_only_the_goals_own_oracle_rows_are_judged():
    """The batch-1 chain goal is EAGLE's chain under speculation "always" (an "auto" row at batch 1 is another
    measurement), and the batch-32 goal is not made "not measured" by a row of another batch left out for time."""
    speed = _speed_report(chain=2.5)
    target = speed["report"]["models"][0]
    target["oracle"].append(dict(shape="chain", batch=1, eagle=True, tau_target=3.0, speedup=3.5, tau=2.9, depth=2,
                                 speculation="auto"))
    target["skipped"] = ["oracle tree tau 3.0 b8 auto (~5 s)"]
    judged = _judged(dict(speed=speed))
    # the "always" chains: 2.0 (tau 2.0, not judged), 2.2 (depth 6), 2.5 (depth 4): the best, 2.5 >= 2.4
    assert judged["8B shape, batch 1, oracle chain at tau 3 with EAGLE's drafting"] == (
        "met", "2.50x (tau 2.90, a chain of 4; weight reads allow 2.60x)")
    assert judged[BATCH32] == ("missed", "0.96x lowest of 2 rows")  # batch32=(1.0, 0.96): 0.96 < 0.97


def test_the_device_cases_and_the_e2e_step_are_judged_only_from_a_run_that_ran():
    """Cases that all failed are a missed goal, not an unmeasured one; an e2e step that failed (its rc not 0) counted
    no divergences, so its 0 bugs meets nothing."""
    judged = _judged(dict(tests=dict(status="failed", device_cuda=dict(passed=0, failed=3)),
                          e2e=dict(status="failed", rc=1, divergence_bugs=0)))
    assert judged["greedy identity of every drafter on CUDA (the device test cases)"] == (
        "missed", "0 passed, 3 failed")
    assert judged["bf16 greedy divergences from transformers, each classified at its first token"] == (
        "not measured", "")
    judged = _judged(dict(e2e=dict(status="passed", rc=0, divergence_bugs=2)))
    assert judged["bf16 greedy divergences from transformers, each classified at its first token"] == (
        "missed", "2 bugs")


def test_the_report_starts_with_the_goals_and_lists_the_acceptance_rows(tmp_path, monkeypatch):
    check = _gpu_check()
    report = dict(date="today", rehearse=False,
                  steps=dict(speed=_speed_report(), acceptance=_acceptance(chat=1.1, rag=2.0)))
    text = check.markdown(report)
    assert text.index("## Goals") < text.index("## n-gram by category")
    assert "| rag | 1.50 | 2.00x | 2.00x | True | | |" in text and "REHEARSAL" not in text
    report["steps"]["policy"] = _acceptance(rag=1.3)  # the default policy's rows, beside them
    assert "| rag | 1.50 | 2.00x | 2.00x | True | 1.50 | 1.30x |" in check.markdown(report)

    ran_on, folders, policies = ["cuda:0"], [], []

    def fake_run(cmd, log, timeout, env=None):  # the CLI's report, as specdec eval acceptance writes it
        assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--dtype") + 1] == "bfloat16"
        policies.append(cmd[cmd.index("--speculation") + 1])
        out = Path(cmd[cmd.index("--out") + 1])
        folders.append(out)
        out.mkdir(parents=True, exist_ok=True)
        rows = [dict(drafter=d, category=c, tau=1.2, speedup_vs_plain=1.1, decode_speedup_vs_plain=None,
                     tokens_per_s=9.0, identical_to_plain=True, level="category")
                for d in ("plain", "ngram") for c in CATEGORIES + ("overall",)]
        (out / "report.json").write_text(json.dumps(dict(meta=dict(device=ran_on[0]), rows=rows)))
        log.write_text("the suite's log")
        return 0, 1.0

    from specdec.eval.prompts import CATEGORIES

    monkeypatch.setattr(check, "run", fake_run)
    step = check.step_acceptance(tmp_path, rehearse=False, model="/tmp/smol.gguf", prompts=4)
    assert step["status"] == "passed" and [r["category"] for r in step["rows"]] == list(CATEGORIES)
    assert policies == ["always"]
    policy = check.step_acceptance(tmp_path, rehearse=False, model="/tmp/smol.gguf", prompts=4, speculation="auto")
    assert policy["status"] == "passed" and policies == ["always", "auto"]
    # only the goals' run's report and log come back as files: a device call brings back 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acceptance.json", "acceptance.log"]
    assert step["meta"] == dict(device="cuda:0")
    # the suite's folder stays outside the report's (a device call brings back 8 files): its report alone comes in
    assert not folders[-1].exists()  # and is removed
    ran_on[0] = "cpu"  # the suite ran on the CPU of the GPU machine: its speeds are no GPU's
    assert check.step_acceptance(tmp_path, rehearse=False, model="/tmp/smol.gguf", prompts=4)["status"] == "failed"
    failed = check.step_acceptance(tmp_path, rehearse=False, model="/tmp/smol.gguf", prompts=4, speculation="auto")
    assert failed["status"] == "failed" and failed["log_tail"] == "the suite's log"  # its log, though not kept
    monkeypatch.setattr(check, "time_left", lambda: 30.0)  # what the goals' steps left: too little for its rows
    skipped = check.starved("policy") or check.step_acceptance(  # as main() runs a step
        tmp_path, rehearse=False, model="/tmp/smol.gguf", prompts=4, speculation="auto")
    assert skipped["status"] == "skipped" and policies.count("auto") == 2
    report = dict(date="today", rehearse=False, steps=dict(acceptance=step, policy=skipped))
    assert "## What failed" not in check.markdown(report)


def test_carried_gguf_parts_join_to_the_file_and_the_calls_name_them(tmp_path, monkeypatch):
    """benchmarks/gpu_carry.py: the GGUF in two parts (one per device call, under 64 MiB each), joined by the second
    call's command and checked by MD5; each call carries the parts its command reads."""
    import hashlib
    import re
    import subprocess
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_carry

    blob = tmp_path / "model.gguf"
    blob.write_bytes(bytes(range(256)) * 1001 + b"x")  # an odd length (256,257 bytes): the parts differ by a byte
    monkeypatch.setattr(gpu_carry, "REPO", tmp_path)
    monkeypatch.setattr(gpu_carry, "WHEELS", tmp_path / ".whl")
    parts = gpu_carry.split(blob, tmp_path / ".gl")
    assert [p.name for p in parts] == ["smol.gguf.part1", "smol.gguf.part2"]
    assert b"".join(p.read_bytes() for p in parts) == blob.read_bytes()
    md5 = (tmp_path / ".gl" / "smol.gguf.md5").read_text().split()
    assert md5 == [hashlib.md5(blob.read_bytes()).hexdigest(), "/tmp/smol.gguf"]
    (first, carry1), (second, carry2) = gpu_carry.calls(parts, [tmp_path / ".whl" / "gguf.whl"])
    assert carry1 == [".gl/smol.gguf.part1", ".gl/smol.gguf.md5", ".whl"]
    assert carry2 == [".gl/smol.gguf.part2", ".gl/smol.gguf.md5", ".whl"]  # a fresh machine can install again
    # measurements first: speed needs no GGUF, the second call's steps need its weights and tokenizer
    assert "--steps env,speed --model default" in first and "--steps acceptance,identity,e2e,graphs" in second
    assert "--model $M" in second and "--quick-e2e" in second  # e2e last and short: ~90 s of ~270
    # both calls, the machine's start and their overheads inside a session's device time
    deadlines = [int(re.search(r"--deadline-s (\d+)", c).group(1)) for c in (first, second)]
    used = gpu_carry.START_S + sum(deadlines) + 2 * gpu_carry.CALL_OVERHEAD_S + gpu_carry.GAP_S
    assert used <= gpu_carry.DEVICE_BUDGET_S and min(deadlines) >= gpu_carry.MIN_SECOND_S
    less = int(re.search(r"--deadline-s (\d+)", gpu_carry.calls(parts, [], budget_s=800)[1][0]).group(1))
    assert less == deadlines[1] - 100
    with pytest.raises(ValueError, match="leave the second call .* run the first alone"):
        gpu_carry.calls(parts, [], budget_s=700)
    with pytest.raises(ValueError, match="the first alone needs"):
        gpu_carry.calls(parts, [], budget_s=500)
    join = re.search(r"cat \S+ \S+ > \S+", second).group(0)
    join = join.replace("/tmp/", f"{tmp_path}/joined/").replace(".gl/", f"{tmp_path}/.gl/")
    (tmp_path / "joined").mkdir()
    (tmp_path / "joined" / "smol.gguf.part1").write_bytes(parts[0].read_bytes())  # what the first call kept
    subprocess.run(join, shell=True, check=True)
    assert (tmp_path / "joined" / "smol.gguf").read_bytes() == blob.read_bytes()
    # a fresh machine for the second call (the first given back after ~30 s idle) installs again: whether specdec is
    # installed is not asked in the repository's root, where its source folder imports without any install (an
    # H200 call skipped the install so, and every step failed); a Python without site-packages stands in
    installed = second[:second.index(" && cp ")].replace(second[second.index("python3 -m pip"):
                                                               second.index("; }; }")], "echo install")
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    (repo / "specdec").mkdir(parents=True)
    (repo / "specdec" / "__init__.py").write_text("")
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = subprocess.run(["bash", "-c", installed], cwd=repo, env=env, capture_output=True, text=True, check=True)
    assert out.stdout == "install\n", (installed, out.stdout, out.stderr)


def test_the_second_calls_deadline_fits_one_call_and_the_least_budget_is_accepted():
    import sys

    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_carry

    # a call runs at most 600 s, 45 of them outside gpu_check: 555 however much device time is left
    assert gpu_carry.deadline_now(1000) == 555 and gpu_carry.second_deadline(3000) == 555
    assert gpu_carry.deadline_now(300) == 300 - 45 - 30
    # 770 s: 770 - 120 (start) - 410 (first) - 45 (its overhead) = 195 left, less 45 + 30 = 120, the least allowed
    assert gpu_carry.check_budget(770) == 120 == gpu_carry.MIN_SECOND_S
    with pytest.raises(ValueError, match="leave the second call 119 s"):
        gpu_carry.check_budget(769)


def test_a_deadline_shrinks_each_steps_limit_and_the_speed_budget(tmp_path, monkeypatch):
    """--deadline-s: a device call's own limit (600 s) must never cut the check, whose report is written after each
    step; every step's limit, and the speed step's measuring budget, shrink to what is left."""
    import time
    from types import SimpleNamespace

    check = _gpu_check()
    limits = []
    monkeypatch.setattr(check.subprocess, "run", lambda cmd, **kw: limits.append(kw["timeout"])
                        or SimpleNamespace(returncode=0))
    monkeypatch.setattr(check, "DEADLINE", [time.perf_counter() + 100])
    check.run(["true"], tmp_path / "log", timeout=240)
    assert 80 < limits[-1] <= 100 - check.DEADLINE_MARGIN_S
    step = check.step_speed(tmp_path, rehearse=False, model="default")  # ~85 s left: no room for its budget
    assert step["status"] == "failed" and "not run" in step["errors"][0] and len(limits) == 1
    check.DEADLINE[0] = time.perf_counter() + 400
    check.step_speed(tmp_path, rehearse=False, model="default")
    assert limits[-1] <= 400 - check.DEADLINE_MARGIN_S  # the process's limit, its budget inside it


def test_the_identity_step_runs_the_greedy_device_cases_alone(tmp_path, monkeypatch):
    check = _gpu_check()
    seen = []
    monkeypatch.setattr(check, "run", lambda cmd, log, timeout, env=None: seen.append(cmd) or (0, 1.0))
    step = check.step_tests(tmp_path, workers=8, slow=False, part="identity")
    assert list(step) == ["status", "greedy_cuda"] and len(seen) == 1
    assert seen[0][seen[0].index("-k") + 1] == "cuda and greedy" and "tests/test_eagle_drafter.py" in seen[0]
    assert "identity" in check.parse_args(["--steps", "identity"]).steps


def test_a_quick_e2e_step_leaves_out_the_static_cache(tmp_path, monkeypatch):
    """--quick-e2e: the end-to-end step without transformers' static-cache rows (torch.compile), which a short
    device call has no time for; its divergences are judged against the dynamic cache as before."""
    import sys

    check = _gpu_check()
    seen = []
    monkeypatch.setattr(check, "run", lambda cmd, log, timeout, env=None: seen.append(cmd) or log.write_text("")
                        or (1, 0.0))
    assert check.step_e2e(tmp_path, "default", 1, quick=True)["status"] == "failed"  # no JSON came back
    check.step_e2e(tmp_path, "default", 1)
    assert "--skip-static" in seen[0] and "--skip-static" not in seen[1]
    assert check.parse_args(["--steps", "e2e", "--quick-e2e"]).quick_e2e
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_e2e_gpu

    assert bench_e2e_gpu.parse_args(["--skip-static"]).skip_static
    with pytest.raises(SystemExit):  # no transformers reference left
        bench_e2e_gpu.parse_args(["--skip-static", "--skip-dynamic"])


def test_every_rehearsed_step_rehearses_alone_or_together():
    """--rehearse takes any of acceptance, policy and speed: each alone, and all three in one call."""
    check = _gpu_check()
    for steps in ("policy", "acceptance,policy,speed"):
        assert check.parse_args(["--steps", steps, "--rehearse"]).rehearse


def test_a_step_starts_with_exactly_its_least_time_left_and_is_skipped_below(monkeypatch):
    """STEP_MIN_S is the least a step starts with: graphs (35 s) runs with 35 s left, not with 20 s; env and speed
    are never skipped by it (speed sizes its own budget)."""
    check = _gpu_check()
    monkeypatch.setattr(check, "time_left", lambda: 35.0)
    assert check.starved("graphs") is None
    monkeypatch.setattr(check, "time_left", lambda: 20.0)
    assert check.starved("graphs") == dict(status="skipped", seconds=0.0,
                                           why="20 s left (--deadline-s), 35 s needed")
    assert check.starved("env") is None and check.starved("speed") is None
    monkeypatch.setattr(check, "time_left", lambda: -7.0)  # past the deadline: no negative time in the report
    assert check.starved("e2e")["why"] == "0 s left (--deadline-s), 90 s needed"


def test_a_step_past_the_deadline_still_gets_a_second(tmp_path, monkeypatch):
    """run()'s limit never falls under 1 s, however far past --deadline-s: a negative limit is no limit to run by."""
    import time
    from types import SimpleNamespace

    check = _gpu_check()
    limits = []
    monkeypatch.setattr(check.subprocess, "run", lambda cmd, **kw: limits.append(kw["timeout"])
                        or SimpleNamespace(returncode=0))
    monkeypatch.setattr(check, "DEADLINE", [time.perf_counter() - 100])
    assert check.run(["true"], tmp_path / "log", timeout=240)[0] == 0 and limits == [1.0]


def test_junit_counts_an_error_as_failed_and_a_skip_as_skipped(tmp_path):
    """A test erroring in setup is a failure of the GPU path, not a pass; its first message line is kept, cut at
    300 characters."""
    check = _gpu_check()
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite>'
                   '<testcase classname="t.a" name="ok"/>'
                   '<testcase classname="t.a" name="bad"><failure message="assert 1 == 2&#10;more"/></testcase>'
                   f'<testcase classname="t.b" name="setup"><error message="{"x" * 400}"/></testcase>'
                   '<testcase classname="t.b" name="cpu"><skipped message="no cuda"/></testcase>'
                   '</testsuite></testsuites>')
    assert check.junit_summary(xml) == dict(passed=1, failed=2, skipped=1,
                                            failures=["t.a::bad: assert 1 == 2", "t.b::setup: " + "x" * 300])
    assert check.junit_summary(tmp_path / "none.xml") == dict(passed=0, failed=0, skipped=0, failures=[])


def test_a_tests_step_fails_when_any_of_its_runs_fails_and_not_when_none_is_selected(tmp_path, monkeypatch):
    """The tests step's two pytest runs: one failing fails the step, whichever ran last; pytest's exit 5 (-k
    selected nothing) is no failure. The same for the kernels step's two sweeps."""
    check = _gpu_check()
    for codes, status in (((1, 0), "failed"), ((0, 1), "failed"), ((5, 0), "passed"), ((0, 0), "passed")):
        left = list(codes)
        monkeypatch.setattr(check, "run", lambda cmd, log, timeout, env=None, left=left: log.write_text("")
                            or (left.pop(0), 1.0))
        step = check.step_tests(tmp_path, workers=2, slow=False)
        assert (list(step), step["status"]) == (["status", "kernels_and_graphs", "device_cuda"], status), codes

    def sweep(cmd, log, timeout, env=None):
        log.write_text("")
        js = Path(cmd[cmd.index("--json") + 1])
        if "--graph" in cmd:  # the graph sweep (the first) crashed, the eager one wrote its JSON
            return 1, 1.0
        js.write_text(json.dumps(dict(points=[])))
        return 0, 1.0

    monkeypatch.setattr(check, "run", sweep)
    step = check.step_kernels(tmp_path)
    assert step["status"] == "failed" and step["graph"]["points"] is None and step["eager"]["points"] == []


def test_the_kernels_and_e2e_steps_replace_their_earlier_files_in_the_report_folder(tmp_path, monkeypatch):
    """gpu_check re-runs into its --out folder by design: the scripts it calls refuse to replace a --json result
    unless told, so its commands say --overwrite, and they parse with the earlier run's files there."""
    check = _gpu_check()
    seen = []

    def fake_run(cmd, log, timeout, env=None):
        seen.append(cmd)
        log.write_text("")
        return 1, 0.0

    monkeypatch.setattr(check, "run", fake_run)
    for name in ("kernels_graph.json", "kernels_eager.json", "e2e.json"):
        (tmp_path / name).write_text("{}")
    check.step_kernels(tmp_path)
    check.step_e2e(tmp_path, "default", 1)
    for cmd in seen:  # [python, -P, script, args...]
        load_script(Path(cmd[2]).stem).parse_args(cmd[3:])  # no SystemExit: the earlier files may be replaced


def test_an_e2e_divergence_classified_a_bug_fails_the_step(tmp_path, monkeypatch):
    """A near-tie is bf16 rounding; a bug is not: the e2e step fails on one even though its script exited 0."""
    check = _gpu_check()
    divergences = []

    def fake_run(cmd, log, timeout, env=None):
        log.write_text("")
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(dict(divergences={"specdec_plain": divergences})))
        return 0, 1.0

    monkeypatch.setattr(check, "run", fake_run)
    divergences.append(dict(prompt=0, position=3, got=1, want=2, gap=0.001, kind="near-tie"))
    assert check.step_e2e(tmp_path, "default", 1)["status"] == "passed"
    divergences.append(dict(prompt=1, position=9, got=1, want=2, gap=3.5, kind="bug"))
    step = check.step_e2e(tmp_path, "default", 1)
    assert (step["status"], step["divergence_bugs"]) == ("failed", 1)


def test_a_speed_run_whose_report_names_an_error_fails_the_step(tmp_path, monkeypatch):
    """bench_speed_gpu.py exits 0 with a model that failed recorded in its JSON: the step fails and lists it."""
    check = _gpu_check()

    def fake_run(cmd, log, timeout, env=None):
        log.write_text("")
        models = [dict(model="synthetic:llama-3.1-8b", errors=["batch 32: out of memory"]), dict(model="default")]
        (tmp_path / "speed.json").write_text(json.dumps(dict(models=models)))
        return 0, 1.0

    monkeypatch.setattr(check, "run", fake_run)
    step = check.step_speed(tmp_path, rehearse=True, model="default")
    assert (step["status"], step["errors"]) == ("failed", ["batch 32: out of memory"])


def test_slow_tests_run_only_with_slow_and_each_run_has_its_own_limit(tmp_path, monkeypatch):
    """--slow drops "-m not slow" from the device run and gives it 600 s instead of 240; the graphs step's kernel
    run has 150 s (the rest of a 600 s call is the speed step's), the tests step's 240."""
    check = _gpu_check()
    seen = []
    monkeypatch.setattr(check, "run", lambda cmd, log, timeout, env=None: seen.append((cmd, timeout)) or (0, 1.0))
    check.step_tests(tmp_path, workers=2, slow=False)
    check.step_tests(tmp_path, workers=2, slow=True)
    check.step_tests(tmp_path, workers=2, slow=False, part="graphs")
    limits = [timeout for _, timeout in seen]
    assert limits == [240, 240, 240, 600, 150]
    marks = [cmd[4:][cmd[4:].index("-m") + 1] if "-m" in cmd[4:] else None for cmd, _ in seen]  # after -m pytest
    assert marks == [None, "not slow", None, None, None]


def test_a_rehearsal_runs_small_on_the_cpu_whatever_the_deadline_leaves(tmp_path, monkeypatch):
    """--rehearse: the acceptance suite with 1 prompt of 8 tokens on the CPU, and the speed step run with
    --rehearse even where --deadline-s leaves under the 60 s a measured budget needs."""
    import time

    check = _gpu_check()
    seen = []
    monkeypatch.setattr(check, "run", lambda cmd, log, timeout, env=None: seen.append(cmd) or log.write_text("")
                        or (1, 1.0))
    check.step_acceptance(tmp_path, rehearse=True, model="default", prompts=4)
    cmd = seen[-1]
    assert [cmd[cmd.index(flag) + 1] for flag in ("--prompts", "--max-new-tokens", "--device")] == ["1", "8", "cpu"]
    monkeypatch.setattr(check, "DEADLINE", [time.perf_counter() + 50])
    check.step_speed(tmp_path, rehearse=True, model="default")
    assert len(seen) == 2 and "--rehearse" in seen[-1] and "--budget" not in seen[-1]
