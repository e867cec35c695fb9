"""`--bind` as a user may type it: a name without a '.' (gin reads it as a macro definition, which changed
nothing), and a --bind that includes a file or holds several lines, whose errors must point at the line at fault."""

import pytest

from instrument import cli, config

TWO_LINES = "train_nca.seed = 1\ntrain_nca.steps = 'ten'"


def _main(capsys, *args):
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "binding, meant",
    [("train_nca_steps = 2", "did you mean train_nca.steps"),
     # first, and then any other configurable registered in the process (RLLogging.log_interval, once imported)
     ("log_interval = 1", "did you mean Instrumentation.log_interval"),
     ("STEPZ = 3", "bind a parameter as Name.param = value")],
)
def test_a_bind_that_only_defines_a_macro_nothing_uses_is_refused(tmp_path, capsys, binding, meant):
    """A review found `--bind 'train_nca_steps = 2'` (or `log_interval = 1`) trained the full 300 steps: gin
    read a macro nobody uses, so the binding did nothing, and no message said so."""
    code, stdout, stderr = _main(capsys, "run", "nca", "--bind", binding)
    assert code == 2 and stdout == "", stderr
    assert stderr.startswith(f"instrument: configuration error in --bind {binding!r}: ") and meant in stderr
    assert "nothing uses %" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_a_macro_bound_on_the_command_line_and_used_is_accepted(tmp_path, capsys):
    code, _, stderr = _main(capsys, "run", "nca", "--bind", "S = 2", "--bind", "train_nca.steps = %S",
                            "--bind", "train_nca.batch_size = 2", "--bind", "train_nca.size = 12")
    assert code == 0, stderr
    assert "nothing uses" not in stderr


def test_a_macro_bind_that_is_secret_is_refused_without_its_value(tmp_path, capsys):
    code, _, stderr = _main(capsys, "run", "nca", "--bind", "api_token = 'sk_live_unused1234'")
    assert code == 2 and "nothing uses %api_token" in stderr
    assert "sk_live_unused1234" not in stderr


@pytest.mark.parametrize(
    "binding, where, statement",
    [("include 'bad.gin'", "in bad.gin, line 2 (included from --bind \"include 'bad.gin'\")",
      "    train_nca.steps = 'ten'"),
     (TWO_LINES, f"in --bind {TWO_LINES!r}",
      "    train_nca.steps = 'ten'")],
)
def test_a_type_error_in_a_file_a_bind_includes_names_that_file_and_line(tmp_path, capsys, binding, where, statement):
    """A review found the error pointing at nca.gin, line 23 (`train_nca.steps = 300`, a line with nothing
    wrong), because the lines of a --bind's include were never read; a --bind of two lines named no place."""
    (tmp_path / "bad.gin").write_text("# steps\ntrain_nca.steps = 'ten'\n")
    code, _, stderr = _main(capsys, "run", "nca", "--bind", binding)
    assert code == 2
    assert stderr.startswith(f"instrument: configuration error {where}: train_nca.steps expects int"), stderr
    assert stderr.splitlines()[1] == statement


def test_a_value_refused_while_building_is_bound_at_the_line_a_bind_includes(tmp_path, capsys):
    (tmp_path / "bad.gin").write_text("Instrumentation.log_interval = -3\n")
    code, _, stderr = _main(capsys, "run", "nca", "--bind", "include 'bad.gin'")
    assert code == 2 and "log_interval must be a non-negative int" in stderr
    assert ("  bound at bad.gin, line 1 (included from --bind \"include 'bad.gin'\"): "
            "Instrumentation.log_interval = -3") in stderr.splitlines(), stderr
    assert "nca.gin" not in stderr
    config.clear_config()
