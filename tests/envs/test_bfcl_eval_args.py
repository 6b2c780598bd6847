"""`trl-agentic eval`: bad arguments, and an output path it cannot write, fail before any model loads, naming the
field (a missing folder failed at load, a NaN temperature and an unknown dtype in torch, an unusable `--output` after
the whole evaluation)."""

import pytest

from trl_agentic.cli import main
from trl_agentic.envs.bfcl.evaluate import BFCLEvalArguments


@pytest.fixture
def no_model_loading(monkeypatch):
    import trl_agentic.envs.bfcl.evaluate as evaluate

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(evaluate, "load_policy", forbidden)


@pytest.mark.parametrize(
    "flags,field",
    [
        (["--temperature", "nan"], "temperature"),
        (["--temperature", "inf"], "temperature"),
        (["--dtype", "foo"], "dtype"),
        (["--dtype", "int64"], "dtype"),
        (["--adapter_path", "/nonexistent/adapter"], "adapter_path"),
        (["--model_name_or_path", "/nonexistent/model"], "model_name_or_path"),
    ],
)
def test_bad_arguments_fail_before_a_model_loads(no_model_loading, flags, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        main(["eval", "--progress", "false", *flags])


def test_an_adapter_path_without_an_adapter_is_refused(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="`adapter_path`"):
        BFCLEvalArguments(model_name_or_path=tiny_model_dir, adapter_path=str(tmp_path))


def test_local_folders_and_builtin_names_are_accepted(tiny_model_dir):
    assert BFCLEvalArguments(model_name_or_path=tiny_model_dir, dtype="bfloat16").dtype == "bfloat16"
    assert BFCLEvalArguments(model_name_or_path="smollm2-135m").model_name_or_path == "smollm2-135m"


@pytest.mark.parametrize("where", ["below a file", "a folder"])
def test_an_output_it_cannot_write_fails_before_a_model_loads(no_model_loading, tmp_path, where):
    (tmp_path / "afile").write_text("")
    output = tmp_path / "afile" / "results.json" if where == "below a file" else tmp_path
    with pytest.raises(ValueError, match="`output`"):
        main(["eval", "--categories", "base", "--limit", "1", "--progress", "false", "--output", str(output)])
    assert (tmp_path / "afile").read_text() == ""
