"""run_training (the Python API of train-medusa / train-eagle) leaves the caller's process as it found it: torch's
global RNG state (the run seeds it, and --resume restores a checkpoint's), whether the run ends, raises or is
interrupted; and the caller's logging: train.log gets the INFO lines, the caller's handlers only what they got
before, during the run and after it."""
from __future__ import annotations

import io
import logging

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("datasets")

from specdec.train import checkpoint as ckpt_io  # noqa: E402
from specdec.train import medusa_recipe  # noqa: E402
from specdec.train.pipeline import run_training  # noqa: E402

from tests.test_train_data import training_dir  # noqa: E402
from tests.test_train_loop import _cfg as _loop_cfg  # noqa: E402

EAGLE = dict(drafter="eagle", draft_vocab=24, eagle_steps=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return training_dir(tmp_path_factory.mktemp("tiny_state"))


def _cfg(tiny, out, **kw):
    return _loop_cfg(tiny, out, **{"max_steps": 2, "save_every": 1, "eval_tau": False, **kw})


def _heads(out) -> dict:
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize("kw", [{}, EAGLE], ids=["medusa", "eagle"])
def test_the_global_rng_is_the_callers_after_a_run(tiny, tmp_path, kw):
    states, heads = [], []
    for i, seed in enumerate((111, 222)):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        run_training(_cfg(tiny, tmp_path / str(i), **kw))
        states.append(torch.get_rng_state())
        assert torch.equal(states[-1], before)
        heads.append(_heads(tmp_path / str(i)))
    assert not torch.equal(states[0], states[1])
    a, b = heads  # the run's own seed decides the result, not the caller's state
    assert a.keys() == b.keys() and all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])


def test_the_global_rng_is_the_callers_after_an_interrupt_and_a_resume(tiny, tmp_path, monkeypatch):
    real_accumulate, calls = medusa_recipe.MedusaRecipe.accumulate, []

    def interrupted_in_step_2(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_accumulate(self, *args)

    monkeypatch.setattr(medusa_recipe.MedusaRecipe, "accumulate", interrupted_in_step_2)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with pytest.raises(KeyboardInterrupt):
        run_training(_cfg(tiny, tmp_path / "run"))
    assert torch.equal(torch.get_rng_state(), before)
    monkeypatch.undo()
    assert ckpt_io.read_state(ckpt_io.find_checkpoint(tmp_path / "run"))["step"] == 1
    torch.manual_seed(6)
    before = torch.get_rng_state()
    run_training(_cfg(tiny, tmp_path / "run", resume=True))  # restores the checkpoint's RNG state inside the run
    assert torch.equal(torch.get_rng_state(), before)
    assert "resumed from" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize("kw", [{}, EAGLE], ids=["medusa", "eagle"])
def test_the_callers_logging_gets_only_what_it_got_before(tiny, tmp_path, kw):
    specdec, root = logging.getLogger("specdec"), logging.getLogger()
    mine = logging.StreamHandler(io.StringIO())
    mine.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = specdec.level, specdec.propagate, list(specdec.handlers), root.level
    specdec.setLevel(logging.NOTSET)
    root.setLevel(logging.WARNING)
    root.addHandler(mine)
    try:
        # --num-layers 2 warns (Medusa); the EAGLE run's warnings come from its own checks
        run_training(_cfg(tiny, tmp_path / "run", **(kw or dict(num_layers=2))))
        after = specdec.level, specdec.propagate, list(specdec.handlers), specdec.getEffectiveLevel()
        logging.getLogger("specdec.drafters.medusa").info("after the run")
    finally:
        root.removeHandler(mine)
        specdec.setLevel(saved[0])
        specdec.propagate = saved[1]
        specdec.handlers[:] = saved[2]
        root.setLevel(saved[3])
    assert after == (logging.NOTSET, True, saved[2], logging.WARNING)
    seen, log = mine.stream.getvalue(), (tmp_path / "run" / "train.log").read_text()
    assert "INFO specdec" not in seen and "training / " not in seen and "after the run" not in seen
    assert " INFO specdec.train" in log and "training / " in log
    if not kw:  # a warning still reaches the caller's handler, once, and train.log
        assert seen.count("WARNING specdec.train.medusa_recipe: --num-layers 2") == 1
        assert "--num-layers 2" in log


def test_the_train_log_redirection_keeps_a_child_loggers_own_level_and_handlers(tmp_path, capsys):
    """While train.log takes the specdec loggers' INFO lines, a child logger the caller opened to INFO still
    reaches the caller's handler (they were cut at the specdec logger's level), and a warning a handler on a
    child logger took is not written again by Python's last-resort handler."""
    from specdec.train.pipeline import _logged_to_file

    root, loop, train = logging.getLogger(), logging.getLogger("specdec.train.loop"), logging.getLogger("specdec.train")
    mine, child = logging.StreamHandler(io.StringIO()), logging.StreamHandler(io.StringIO())
    saved = root.level, loop.level, list(root.handlers)
    root.setLevel(logging.WARNING)
    root.handlers[:] = [mine]
    loop.setLevel(logging.INFO)
    try:
        with _logged_to_file(tmp_path):
            loop.info("a step line the caller asked for")
        root.handlers[:] = []
        train.addHandler(child)
        with _logged_to_file(tmp_path):
            loop.warning("a warning for the child's handler")
    finally:
        train.removeHandler(child)
        root.setLevel(saved[0])
        loop.setLevel(saved[1])
        root.handlers[:] = saved[2]
    assert mine.stream.getvalue() == "a step line the caller asked for\n"
    assert child.stream.getvalue() == "a warning for the child's handler\n"
    assert "a warning" not in capsys.readouterr().err
    assert "a step line" in (tmp_path / "train.log").read_text()
