"""The first errors a user meets are specdec's one-line errors: a misspelt GenerationConfig field, a model that is
not there (in Python and on the command line), an object that cannot draft; and the error classes a caller
catches are importable from ``specdec`` itself, without importing torch."""
from __future__ import annotations

import subprocess
import sys

import pytest
from specdec.drafters.base import as_drafter

import specdec
from specdec.cli import main
from specdec.errors import InputTypeError, ModelNotFoundError, SpecdecError
from specdec.generation_config import GenerationConfig
from specdec.models.loader import load_model
from specdec.testing import build_tiny_model


def test_a_misspelt_generation_config_field_names_the_field_and_the_one_meant():
    """GenerationConfig(max_new_token=5) was the dataclass's bare TypeError, saying nothing of max_new_tokens."""
    with pytest.raises(InputTypeError, match=r"^GenerationConfig: unknown generation argument max_new_token "
                                             r"\(did you mean max_new_tokens\?\); known: ") as err:
        GenerationConfig(max_new_token=5)
    assert "\n" not in str(err.value)
    with pytest.raises(InputTypeError, match=r"temprature \(did you mean temperature\?\)"):
        GenerationConfig(do_sample=True, temprature=0.7)
    with pytest.raises(InputTypeError, match=r"argument max_new_token \(did you mean max_new_tokens"):
        specdec.generate(build_tiny_model(), [[1, 2, 3]], max_new_token=5)
    count = len(GenerationConfig.__dataclass_fields__)
    with pytest.raises(InputTypeError, match=f"takes at most {count} positional arguments, got {count + 1}"):
        GenerationConfig(*[None] * (count + 1))
    with pytest.raises(InputTypeError, match="max_new_tokens both by position and by name"):
        GenerationConfig(5, max_new_tokens=6)
    config = GenerationConfig(8, top_p=0.5)  # what was given still counts as set
    assert config.max_new_tokens == 8 and config.fields_set == {"max_new_tokens", "top_p"}


@pytest.mark.parametrize("spec, looked_for", [
    ("no-such-model", "no checkpoint directory or file at {cwd}/no-such-model and no alias of that name"),
    ("weights/missing.gguf", "GGUF file not found: 'weights/missing.gguf' \\(looked for the file "
                             "{cwd}/weights/missing.gguf\\)"),
    ("empty", "empty is not a transformers checkpoint directory \\(looked for {cwd}/empty/config.json\\)"),
])
def test_a_missing_model_is_a_model_not_found_error_saying_where_it_was_looked_for(tmp_path, monkeypatch, spec,
                                                                                     looked_for):
    """A relative name is resolved against the working directory: the message names the absolute path looked at.
    It was a builtin FileNotFoundError (outside SpecdecError) that did not say where it looked."""
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelNotFoundError, match=looked_for.format(cwd=tmp_path)) as err:
        load_model(spec)
    assert isinstance(err.value, SpecdecError) and isinstance(err.value, FileNotFoundError)
    with pytest.raises(ModelNotFoundError, match="no-such-model"):  # generate() resolves the model the same way
        specdec.generate("no-such-model", [[1, 2, 3]], max_new_tokens=2)


def test_the_command_line_says_a_missing_model_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "hi", "--model", "my-model"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"specdec generate: error: unknown model 'my-model': no checkpoint directory or file at "
                          f"{tmp_path}/my-model")


def test_an_object_that_cannot_draft_is_an_input_type_error_saying_what_is_accepted():
    with pytest.raises(InputTypeError, match=r"^drafter must be None, a Drafter or an object with a "
                                             r"propose\(sequences\) method; object has no propose\(\)$"):
        as_drafter(object())


ERRORS = ["SpecdecError", "InputError", "InputTypeError", "ModelNotFoundError", "CacheFullError",
          "InvalidLogitsError", "UnsupportedModelError", "DraftError", "GGUFError", "BackendError",
          "VocabularyMismatchError", "EagleCheckpointError", "MedusaCheckpointError"]  # what generate() can raise


def test_every_error_class_is_exported_by_specdec_without_importing_torch():
    from specdec.kv_cache import CacheFullError
    from specdec.models.llama import UnsupportedModelError
    from specdec.sampling import InvalidLogitsError

    assert specdec.CacheFullError is CacheFullError and specdec.InvalidLogitsError is InvalidLogitsError
    assert specdec.UnsupportedModelError is UnsupportedModelError and specdec.ModelNotFoundError is ModelNotFoundError
    for name in ERRORS:
        assert name in specdec.__all__ and issubclass(getattr(specdec, name), SpecdecError), name
    code = ("import sys, specdec; from specdec import SpecdecError, ModelNotFoundError, InputError; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            f"names = {ERRORS!r}; assert all(n in dir(specdec) for n in names); "
            "assert issubclass(specdec.CacheFullError, SpecdecError)")
    subprocess.run([sys.executable, "-c", code], check=True)
