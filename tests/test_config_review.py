"""What a review of the config layer found, each checked on real files, real runs and real backends:

- an empty ``backends/`` or ``tables/`` folder in the working directory (``python -m`` puts it on sys.path, where
  it imports as a namespace package) broke every shipped config with a raw TypeError from gin's package reader;
- an ``include`` resolved from the working directory before the including file's own folder, and a nested
  include relative to an included file in a subfolder was not found;
- ``cli.main`` called twice in one process (a sweep) carried the first call's bindings into the second;
- a value bound through a macro was logged as the text ``'%LR'`` (and the macro as a key ``'LR.'``);
- a parse error on a secret-looking line printed the secret;
- a config without ``run.experiment`` left its run started (lock, run.json, MLflow FINISHED);
- ``train_nca.lr = 1e999`` (infinity) was accepted.
"""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import gin
import pytest

import instrument
from instrument import cli, config

REPO = Path(__file__).resolve().parent.parent
TINY = ["--bind", "train_nca.steps = 1", "--bind", "train_nca.batch_size = 2", "--bind", "train_nca.size = 12",
        "--bind", "train_nca.n_iter_min = 2", "--bind", "train_nca.n_iter_max = 3",
        "--bind", "Instrumentation.observers = []"]


def _hyperparameters(run_dir: Path) -> dict:
    (line,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if "hyperparameters" in x]
    return line["hyperparameters"]


# ------------------------------------------------------------------------------ includes and empty folders
def test_an_empty_backends_or_tables_folder_in_the_working_directory_breaks_no_shipped_config(tmp_path):
    """`make demo` is `python -m instrument run nca`: the working directory is on sys.path there."""
    (tmp_path / "backends").mkdir()
    (tmp_path / "tables").mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "instrument", "run", "nca", *TINY, "--bind",
                          "Instrumentation.run_name = 'empty_dirs'"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "TypeError" not in out.stderr and "NoneType" not in out.stderr
    assert (tmp_path / "runs" / "empty_dirs" / "metrics.jsonl").is_file()


def test_a_file_of_your_own_includes_shipped_fragments_past_an_empty_folder_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "backends").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))  # as `python -m` or a script in this folder has it
    (tmp_path / "mine.gin").write_text("include 'backends/jsonl.gin'\ninclude 'backends/console.gin'\n"
                                       "Instrumentation.backends = @backend_set()\n")
    instrument.parse_config(["mine.gin"])
    assert [type(b).__name__ for b in config.backend_set()] == ["ConsoleBackend", "JsonlBackend"]


def test_an_include_looks_beside_the_including_file_before_the_working_directory(tmp_path):
    (tmp_path / "base.gin").write_text("Instrumentation.run_name = 'from_the_working_directory'\n")
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "base.gin").write_text("Instrumentation.run_name = 'beside_the_file'\n")
    (exp / "my.gin").write_text("include 'base.gin'\n")
    instrument.parse_config(["exp/my.gin"])
    assert gin.query_parameter("Instrumentation.run_name") == "beside_the_file"


def test_a_nested_include_looks_beside_its_own_file_in_a_subfolder(tmp_path):
    sub = tmp_path / "exp" / "sub"
    sub.mkdir(parents=True)
    (sub / "leaf.gin").write_text("Instrumentation.run_name = 'leaf'\n")
    (sub / "mid.gin").write_text("include 'backends/jsonl.gin'\ninclude 'leaf.gin'\n")
    (tmp_path / "exp" / "nested.gin").write_text("include 'sub/mid.gin'\nInstrumentation.log_interval = 3\n")
    instrument.parse_config([str(tmp_path / "exp" / "nested.gin")])
    assert gin.query_parameter("Instrumentation.run_name") == "leaf"
    assert gin.query_parameter("Instrumentation.log_interval") == 3
    # ...and gin's own search list is as it was: nothing of this parse leaks into a later one
    assert str(sub) not in gin.config._LOCATION_PREFIXES and "exp/sub" not in gin.config._LOCATION_PREFIXES


# ---------------------------------------------------------------------------------------- cli.main twice
def test_cli_main_called_twice_starts_each_run_from_a_clean_config(tmp_path, capsys):
    first = cli.main(["run", "nca", *TINY, "--bind", "train_nca.lr = 0.5", "--bind", "Instrumentation.log_interval = 7",
                      "--bind", "backend_set.console = None", "--bind", "Instrumentation.run_name = 'sweep1'"])
    second = cli.main(["run", "nca", *TINY, "--bind", "Instrumentation.run_name = 'sweep2'"])
    capsys.readouterr()
    assert (first, second) == (0, 0)
    params = _hyperparameters(tmp_path / "runs" / "sweep1")
    assert (params["train_nca.lr"], params["Instrumentation.log_interval"]) == (0.5, 7)
    params = _hyperparameters(tmp_path / "runs" / "sweep2")  # nca.gin's and train_nca's own values again
    assert (params["train_nca.lr"], params["Instrumentation.log_interval"]) == (2e-3, 25), params
    assert params["backend_set.console"] == "@ConsoleBackend()"


# ------------------------------------------------------------------------------------------------ macros
def test_a_value_bound_through_a_macro_is_logged_as_its_value_in_jsonl_and_mlflow(tmp_path, capsys):
    pytest.importorskip("mlflow")
    (tmp_path / "macro.gin").write_text(
        "include 'nca.gin'\ninclude 'backends/mlflow.gin'\n"
        "LR = 0.001\nSTEPS = 1\nSIZE = %SMALL\nSMALL = 12\n"
        "train_nca.lr = %LR\ntrain_nca.steps = %STEPS\ntrain_nca.size = %SIZE\n"
        "Instrumentation.run_name = 'macro'\n"
    )
    assert cli.main(["run", "macro.gin", *TINY[2:]]) == 0, capsys.readouterr().err
    params = _hyperparameters(tmp_path / "runs" / "macro")
    assert params["train_nca.lr"] == 0.001 and params["train_nca.steps"] == 1 and params["train_nca.size"] == 12
    assert not [k for k in params if k.endswith(".") or k in ("LR", "STEPS", "SIZE", "SMALL")], params
    assert not [v for v in params.values() if isinstance(v, str) and v.startswith("%")], params

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "instrument"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["train_nca.lr"] == "0.001" and run.data.params["train_nca.size"] == "12"
    assert not [k for k in run.data.params if k.endswith(".")], run.data.params


# ------------------------------------------------------------------------------- secrets in parse errors
@gin.configurable
def review_train(instrumentation=None, steps: int = 2, api_token: str = "", env=None):
    """A user's experiment with a secret among its parameters (only its bindings are parsed here)."""
    return {}


def test_a_macro_is_resolved_but_a_secret_one_stays_redacted_even_under_a_plain_name(tmp_path):
    (tmp_path / "s.gin").write_text("API_TOKEN = 'sk_live_MACROSECRET1'\nreview_train.env = %API_TOKEN\n"
                                    "STEPS = 4\nreview_train.steps = %STEPS\n")
    instrument.parse_config(["s.gin"])
    review_train()  # gin's operative config holds what was called
    params, text = config.operative_config()
    assert "sk_live_MACROSECRET1" not in json.dumps(params) + (text or "")
    assert params["review_train.env"] == "<redacted>" and params["review_train.steps"] == 4, params


@pytest.mark.parametrize(
    "line, secret",
    [
        ("review_train.api_token = sk_live_SECRETBARE111", "SECRETBARE111"),  # unquoted
        ("review_train.api_token = 'SECRETUNCLOSED222\nreview_train.steps = 2", "SECRETUNCLOSED222"),  # unclosed quote
        ("review_train.api_tokn = 'SECRETMISSPELT444'", "SECRETMISSPELT444"),  # meant api_token
        ("review_train.password = 'SECRETNOPARAM555'", "SECRETNOPARAM555"),  # no such parameter
        ("WandbBackend.api_key = 'SECRETWB666'", "SECRETWB666"),  # no such parameter of a backend
        ("review_train.env = {'WANDB_API_KEY': 'SECRETDICT777', 'HOME': }", "SECRETDICT777"),  # a secret dict key
    ],
)
def test_a_parse_error_on_a_secret_line_never_prints_the_secret(tmp_path, capsys, line, secret):
    (tmp_path / "bad.gin").write_text(f"Instrumentation.log_interval = 1\n{line}\n")
    with pytest.raises(config.GinConfigError) as caught:
        instrument.parse_config(["bad.gin"])
    assert secret not in str(caught.value) and "<redacted>" in caught.value.statement, str(caught.value)
    assert "bad.gin, line 2" in caught.value.where
    assert cli.main(["run", "bad.gin"]) == 2
    err = capsys.readouterr().err
    assert secret not in err and "configuration error in bad.gin, line 2" in err, err
    # ...while a value under a plain name is still shown: it is what the user has to correct
    plain = line.replace("api_token", "label").replace("api_tokn", "labl").replace("password", "label")
    plain = plain.replace("api_key", "label").replace("WANDB_API_KEY", "LABEL")
    (tmp_path / "bad.gin").write_text(f"Instrumentation.log_interval = 1\n{plain}\n")
    with pytest.raises(config.GinConfigError) as caught:
        instrument.parse_config(["bad.gin"])
    assert secret in str(caught.value), str(caught.value)


# --------------------------------------------------------------------------------------- no experiment
def test_a_config_without_an_experiment_starts_no_run_and_its_name_stays_free(tmp_path, capsys):
    pytest.importorskip("mlflow")
    (tmp_path / "noexp.gin").write_text(
        "include 'backends/tensorboard.gin'\ninclude 'backends/mlflow.gin'\ninclude 'backends/jsonl.gin'\n"
        "run.instrumentation = @Instrumentation()\nInstrumentation.backends = @backend_set()\n"
        "Instrumentation.run_name = 'noexp'\n"
    )
    assert cli.main(["run", "noexp.gin"]) == 2
    err = capsys.readouterr().err
    assert "run has no experiment" in err and "run.experiment = @train_nca" in err, err
    assert not (tmp_path / "runs" / "noexp").exists()
    (tmp_path / "withexp.gin").write_text("import instrument.demos.nca\ninclude 'noexp.gin'\n"
                                          "run.experiment = @train_nca\n")
    assert cli.main(["run", "withexp.gin", *TINY]) == 0, capsys.readouterr().err  # the name is free
    assert (tmp_path / "runs" / "noexp" / "metrics.jsonl").is_file()


def test_run_without_an_experiment_closes_the_started_instrumentation_as_failed(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from instrument.backends.mlflow import MlflowBackend

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    inst = instrument.Instrumentation(log_dir=str(tmp_path / "runs"), run_name="bare",
                                      backends=[MlflowBackend(tracking_uri=uri, experiment_name="e")])
    with pytest.raises(config.MissingExperimentError, match="run has no experiment"):
        config.run(instrumentation=inst)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FAILED"
    with pytest.raises(instrument.ConfigurationError, match="is closed"):
        inst.step(0)


# --------------------------------------------------------------------------------------- infinite lr
@pytest.mark.parametrize("module, fn", [("instrument.demos.nca", "train_nca"),
                                        ("instrument.demos.cartpole", "train_cartpole")])
def test_an_infinite_learning_rate_is_refused_with_a_fix(module, fn, caplog):
    import importlib

    train = getattr(importlib.import_module(module), fn)
    with caplog.at_level(logging.WARNING), pytest.raises(instrument.ConfigurationError) as caught:
        train(lr=1e999)
    message = str(caught.value)
    assert f"{fn} lr must be a finite number > 0, got inf" in message and f"{fn}.lr = " in message


# --------------------------------------------------------------------------------- the shipped PPO table
def test_the_shipped_torchrl_table_shows_the_evaluation_and_iteration_time_it_declares(caplog):
    """The evaluation's first value comes at a later step than the first row; the iteration time is a timing
    (kept for the summary unless a column declares it). Both must show, and no column go unmatched."""
    import io

    instrument.parse_config(["rl_torchrl_ppo"])
    stream = io.StringIO()
    console = instrument.ConsoleBackend(stream=stream)
    logger = instrument.Logger([console], instrument.RunInfo("ppo"))
    with caplog.at_level(logging.WARNING, logger="instrument"):
        for step in range(3):
            metrics = {"counters/frames": 512 * (step + 1), "collection/main/episode/return/mean": 20.0 + step,
                       "train/main/loss_objective": 0.01}
            if step == 1:  # the first evaluation, after the table's layout was fixed
                metrics["eval/deterministic/return"] = 163.0
            logger.log_metrics(metrics, step=step)
            with logger.timer("iteration"):
                pass
            logger.commit(step)
        logger.close()
    lines = stream.getvalue().splitlines()
    (header,) = {line for line in lines if line.split()[:2] == ["step", "frames"]}
    assert header.split() == ["step", "frames", "return↑", "eval↑", "loss", "iter", "s"], header
    row = next(line.split() for line in lines if line.split()[:2] == ["1", "1,024"])
    assert row[3] == "163" and float(row[5]) >= 0, row
    assert not [r for r in caplog.records if "console table" in r.getMessage()]


def test_an_error_in_an_included_file_points_at_the_file_beside_the_including_one(tmp_path):
    (tmp_path / "base.gin").write_text("train_nca.steps = 'ten'\n")  # same name, in the working directory
    exp = tmp_path / "exp"
    exp.mkdir()
    (exp / "base.gin").write_text("import instrument.demos.nca\n\ntrain_nca.steps = 'eleven'\n")
    (exp / "my.gin").write_text("include 'base.gin'\n")
    with pytest.raises(config.GinConfigError) as caught:
        instrument.parse_config(["exp/my.gin"])
    assert caught.value.where == "exp/base.gin, line 3 (included from exp/my.gin, line 1)", caught.value.where
    assert "'eleven'" in caught.value.statement


def test_the_shipped_configs_parse_beside_a_user_module_that_registers_its_own_run_and_backend_set(tmp_path):
    """In a child process: a configurable registered here would stay registered for every later test."""
    (tmp_path / "review_user_mod.py").write_text(
        "import gin\n\n@gin.configurable\ndef run(experiment=None):\n    return experiment\n\n"
        "@gin.configurable\ndef backend_set(x=None):\n    return x\n"
    )
    (tmp_path / "mine.gin").write_text("import review_user_mod\ninclude 'nca.gin'\ninclude 'backends/mlflow.gin'\n"
                                       "review_user_mod.run.experiment = 'their own'\n")
    probe = (
        "import gin, instrument\nfrom instrument import config\nfrom instrument.demos.nca import train_nca\n"
        "instrument.parse_config(['mine.gin'])\n"
        "assert gin.query_parameter('instrument.run.experiment').configurable.wrapped is train_nca\n"
        "print([type(b).__name__ for b in config.backend_set()])\n"
        "print([c.name for c in config.shipped_configs() if c.runnable])\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    backends, runnable = out.stdout.splitlines()
    assert backends == "['TensorBoardBackend', 'ConsoleBackend', 'JsonlBackend', 'MlflowBackend']"
    assert runnable.startswith("['nca', 'nca_checkpointed', 'nca_diagnostics', 'rl_cartpole'"), runnable


def test_gins_own_parse_functions_get_past_an_empty_backends_folder_on_sys_path(tmp_path, monkeypatch):
    """docs/quickstart.md names gin's own parse functions beside `instrument.parse_config`: they too must read an
    empty ``backends/`` folder on sys.path (as `python -m` in that folder has it) as "not found"."""
    (tmp_path / "backends").mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.gin").write_text("include 'backends/jsonl.gin'\nInstrumentation.backends = @backend_set()\n")
    try:
        gin.parse_config_files_and_bindings(["mine.gin"], [])
        assert [type(b).__name__ for b in config.backend_set()] == ["JsonlBackend"]
    finally:
        gin.clear_config()


# ----------------------------------------------------------------------------------- a review of the CLI's errors
@pytest.mark.parametrize("body", ["train_nca.steps = 1\ntrain_nca.steps = [1,\n",
                                  "train_nca.steps = 1\nInstrumentation.run_name = '''abc\n"])
def test_an_included_file_ending_inside_a_bracket_or_quote_is_named_with_its_line(tmp_path, capsys, body):
    """gin re-raises an included file's TokenError without args: the CLI crashed with an IndexError."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "top.gin").write_text("include 'nca.gin'\ninclude 'inner.gin'\n")
    (tmp_path / "sub" / "inner.gin").write_text(body)
    with pytest.raises(config.ConfigSyntaxError) as caught:
        instrument.parse_config(["sub/top.gin"])
    assert caught.value.where == "sub/inner.gin, line 2 (included from sub/top.gin, line 2)", caught.value.where
    assert caught.value.statement == body.splitlines()[1] and "never closed" in caught.value.problem
    assert cli.main(["run", "sub/top.gin"]) == 2
    err = capsys.readouterr().err
    assert "configuration error in sub/inner.gin, line 2 (included from sub/top.gin, line 2)" in err, err


@pytest.mark.parametrize("line", ["train_nca.steps = = 2", "train_nca.stepz = 2", "train_nca.steps = 'x'",
                                  "train_nca.steps = [1,\ntrain_nca.size = 3"])
def test_an_included_file_is_named_one_way_whatever_the_error(tmp_path, line):
    """A review found one included file named three ways: gin's errors ``sub/inner.gin, line 2 (included from
    top.gin, line 2)``, a type error found after parsing ``inner.gin, ...``, a syntax error without the include."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "top.gin").write_text("include 'nca.gin'\ninclude 'sub/inner.gin'\n")
    (tmp_path / "sub" / "inner.gin").write_text(f"train_nca.steps = 1\n{line}\n")
    with pytest.raises(config.GinConfigError) as caught:
        instrument.parse_config(["top.gin"])
    assert caught.value.where == "sub/inner.gin, line 2 (included from top.gin, line 2)", caught.value.where


def test_the_secret_keys_pre_scan_reads_a_long_list_ending_in_a_macro_in_one_pass(tmp_path, monkeypatch):
    """A review found the pre-scan evaluating the text up to every bracket, quote and line end of its first 20,000
    characters (2,000 patterns before a macro: 3.7 s, and none read); brackets are now paired once."""
    from instrument.config import located

    calls = []
    real = located.ast.literal_eval
    monkeypatch.setattr(located.ast, "literal_eval", lambda text: calls.append(1) or real(text))
    items = ", ".join(f"'k{i}_*'" for i in range(2000))
    (tmp_path / "long.gin").write_text(f"MORE = 'x'\nInstrumentation.secret_keys = [{items}, %MORE]\n")
    keys = located.declared_secret_keys([str(tmp_path / "long.gin")], [])
    assert len(calls) < 10 and keys[0] == "k0_*" and keys[1999] == "k1999_*" and "x" in keys


def test_a_tilde_include_and_a_bracket_left_open_are_told_plainly(tmp_path, monkeypatch):
    """A review found ``include '~/x.gin'`` of an existing file answered with the shipped configs (gin does not
    expand ``~``), and ``<ast.Name object at 0x...>`` in the message about a bracket left open."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.gin").write_text("Instrumentation.log_interval = 3\n")
    (tmp_path / "tilde.gin").write_text("include '~/mine.gin'\n")
    with pytest.raises(instrument.ConfigurationError) as raised:
        instrument.parse_config(["tilde.gin"])
    assert "gin does not expand '~'" in str(raised.value) and str(tmp_path / "mine.gin") in str(raised.value)
    (tmp_path / "open.gin").write_text("import instrument\nmy.p = (1,\nother.q = 2\n")
    with pytest.raises(instrument.ConfigurationError) as raised:
        instrument.parse_config(["open.gin"])
    assert "never closed" in str(raised.value) and "object at 0x" not in str(raised.value), raised.value
    assert "it cannot read 'other' there" in str(raised.value), raised.value


def test_the_secret_keys_pre_scan_copies_no_text_per_macro_line(tmp_path):
    """A review found the pre-scan's macro table holding a copy of the rest of the file for every macro line
    (20,000 macro lines: 3 GB and 3.1 s); it now holds where each value starts. 5,000 lines copied ~110 MB."""
    import tracemalloc

    from instrument.config import located

    lines = "".join(f"M{i} = {i}\n" for i in range(5000))
    (tmp_path / "many.gin").write_text(f"Instrumentation.secret_keys = %KEYS\n{lines}KEYS = ['zzz', %MORE]\n"
                                       "MORE = 'other'\n")
    tracemalloc.start()
    try:
        keys = located.declared_secret_keys([str(tmp_path / "many.gin")], [])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert keys == ["zzz", "other"] and peak < 10_000_000, (keys, peak)
