"""The command line as a user meets it: shipped configs by name from any directory (and from an installed
wheel), `instrument list`, `--version`, plain `--help`, short configuration errors, and a closing hint that
names the viewer of every backend the run used. Real subprocesses, outputs read back from the run folder."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import instrument
from instrument import cli, config
from tests.conftest import read_scalars
from tests.wandb_reader import read_run

REPO = Path(__file__).resolve().parent.parent
TINY = ["--bind", "train_nca.steps = 3", "--bind", "train_nca.batch_size = 2", "--bind", "train_nca.size = 12",
        "--bind", "Instrumentation.log_interval = 2"]


def _cli(*args, cwd, pythonpath=str(REPO), home=None):
    env = {**os.environ, "PYTHONPATH": pythonpath, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1", **({"HOME": str(home)} if home else {})}
    return subprocess.run([sys.executable, "-m", "instrument", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=240)


def test_run_a_shipped_config_by_name_outside_the_checkout(tmp_path):
    out = _cli("run", "nca", *TINY, "--bind", "Instrumentation.run_name = 'cli'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "logs: runs/cli" in out.stdout
    assert "TensorBoard: tensorboard --logdir runs" in out.stdout
    assert "mlflow" not in out.stdout and "wandb" not in out.stdout  # only the viewers of backends used
    assert re.search(r"^ +step +loss", out.stdout, re.M) and re.search(r"^ +0 +0\.\d+ ", out.stdout, re.M)
    lines = [json.loads(x) for x in (tmp_path / "runs" / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "step" in x] == [0, 2]
    assert list((tmp_path / "runs" / "cli").glob("events.out.tfevents.*"))


def test_run_a_path_to_a_gin_file_of_your_own(tmp_path):
    (tmp_path / "my.gin").write_text(
        "import instrument.demos.nca\ninclude 'nca.gin'\nbackend_set.tensorboard = None\n"
        "backend_set.console = None\nInstrumentation.run_name = 'mine'\n"
    )
    out = _cli("run", "my.gin", *TINY, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "runs" / "mine" / "metrics.jsonl").is_file() and "view them with" not in out.stdout


def _main(capsys, *args):
    """The CLI in this process (the same `main` the script calls): return code, stdout, stderr."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse's --version / --help
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_hint_names_the_viewer_of_each_backend_used(tmp_path, capsys):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    # An absolute log_dir: W&B's service process outlives a run and resolves a relative dir against its own
    # working directory, which in this long-lived test process is an earlier test's.
    code, stdout, stderr = _main(
        capsys, "run", "nca", *TINY, "--bind", "Instrumentation.run_name = 'v'",
        "--bind", f"Instrumentation.log_dir = '{tmp_path / 'runs'}'", "--bind",
        "backend_set.mlflow = @MlflowBackend()", "--bind", "backend_set.wandb = @WandbBackend()",
        "--bind", "backend_set.console = None")
    assert code == 0, stderr
    hints = stdout.split("view them with:\n", 1)[1].splitlines()
    db = (tmp_path / "runs" / "mlflow.db").resolve()  # one store per log_dir
    assert hints[0] == f"  TensorBoard: tensorboard --logdir {tmp_path / 'runs'}"
    assert f"  MLflow: mlflow ui --backend-store-uri sqlite:///{db}" in hints and db.is_file()
    (wandb_hint,) = [h for h in hints if h.startswith("  W&B (offline): wandb sync ")]
    offline_run = Path(wandb_hint.split("wandb sync ", 1)[1])
    rows, _ = read_run(offline_run)  # the folder `wandb sync` uploads holds this run's steps
    assert [row["_step"] for row in rows if "train/loss" in row] == [0, 2]


def test_list_names_every_shipped_config_with_its_description(capsys):
    code, stdout, _ = _main(capsys, "list")
    assert code == 0
    for shipped in config.shipped_configs():
        assert re.search(rf"^  {re.escape(shipped.name)} +{re.escape(shipped.description)}$", stdout, re.M)
    assert stdout.index("rl_cartpole") < stdout.index("Fragments") < stdout.index("backends/wandb")
    assert _main(capsys, "run", "--list")[1] == stdout


def test_version_and_plain_help(tmp_path, capsys):
    out = _cli("--version", cwd=tmp_path)  # the installed entry point's module, in a fresh interpreter
    assert out.returncode == 0 and out.stdout.strip() == f"instrument {instrument.__version__}"
    for args in (["--help"], ["run", "--help"]):
        code, stdout, _ = _main(capsys, *args)
        assert code == 0 and "usage: instrument" in stdout
        assert "``" not in stdout and "`instrument" not in stdout, stdout


@pytest.mark.parametrize(
    "args, where, fix",
    [
        (["run", "nca", "--bind", "train_nca.stepz = 3"], "in --bind 'train_nca.stepz = 3'", "did you mean 'steps'?"),
        (["run", "rl.gin"], "in rl.gin, line 1", "add the line `import instrument.config.rl`"),  # a fresh interpreter
        (["run", "nca", "--bind", "train_nca.steps = %STEPZ"], "in --bind 'train_nca.steps = %STEPZ': the macro "
         "%STEPZ is used but never defined", "define it with a line `STEPZ = value`"),
    ],
)
def test_a_bad_config_exits_with_a_few_lines_and_no_traceback(tmp_path, args, where, fix):
    (tmp_path / "rl.gin").write_text("RLLogging.evaluation = None\n")
    out = _cli(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith(f"instrument: configuration error {where}") and fix in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) <= 5, out.stderr
    assert not (tmp_path / "runs").exists()  # nothing trained


@pytest.mark.parametrize(
    "args, where, fix",
    [
        (["run", "bad.gin"], "bad.gin, line 2", "did you mean 'log_interval'?"),
        (["run", "ncaa"], "no config file 'ncaa'", "did you mean 'nca'?"),
        (["run", "."], "'.' is a directory; expected a .gin file", "give the .gin file inside it"),
        (["run", "nca", "--bind", "Instrumentation.observers = ["], "--bind 'Instrumentation.observers = ['",
         "close the bracket"),
    ],
)
def test_a_bad_config_is_reported_in_a_few_lines(tmp_path, capsys, args, where, fix):
    (tmp_path / "bad.gin").write_text("include 'nca.gin'\nInstrumentation.log_intervall = 5\n")
    code, stdout, stderr = _main(capsys, *args)
    assert code == 2 and stdout == ""
    assert stderr.startswith("instrument: configuration error") and where in stderr and fix in stderr
    assert len(stderr.splitlines()) <= 5, stderr
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_debug_raises_the_error_itself(tmp_path):
    (tmp_path / "bad.gin").write_text("Instrumentation.log_intervall = 5\n")
    with pytest.raises(config.GinConfigError, match="log_intervall"):
        cli.main(["run", "bad.gin", "--debug"])
    out = _cli("run", "bad.gin", "--debug", cwd=tmp_path)
    assert out.returncode == 1 and "Traceback (most recent call last)" in out.stderr


def test_a_bad_value_found_while_building_is_reported_briefly(tmp_path, capsys):
    code, _, stderr = _main(capsys, "run", "nca", "--bind", "Instrumentation.log_interval = -1")
    assert code == 2 and "log_interval must be a non-negative int" in stderr and "ConfigurationError" in stderr
    assert len(stderr.splitlines()) <= 6, stderr


@pytest.mark.slow
def test_the_sdist_carries_a_test_suite_that_can_run(tmp_path):
    """setuptools puts instrument/ and tests/test_*.py in the sdist by itself, but not the suite's helpers
    (conftest.py, _probe_models.py, wandb_reader.py), the bench the tests import, the docs or the licence: a
    packager running the tests from the sdist got 46 collection errors (a review). MANIFEST.in adds them."""
    import tarfile

    source = tmp_path / "source"
    source.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "results", "*.egg-info")
    for folder in ("instrument", "tests", "bench", "docs"):
        shutil.copytree(REPO / folder, source / folder, ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "Makefile"):
        shutil.copy(REPO / name, source / name)
    script = f"import setuptools.build_meta as b; b.build_sdist({str(tmp_path)!r})"
    build = subprocess.run([sys.executable, "-c", script], cwd=source, capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr
    (sdist,) = tmp_path.glob("torch_instrument-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {str(path.relative_to(REPO)) for folder in ("tests", "bench") for path in (REPO / folder).glob("*.py")}
    assert wanted - names == set()
    assert {"LICENSE", "README.md", "Makefile", "docs/quickstart.md", "instrument/configs/nca.gin"} <= names


@pytest.mark.slow
def test_an_installed_wheel_carries_the_shipped_configs(tmp_path):
    """Build the wheel, install it into a folder of its own, and run from a directory outside the checkout."""
    source = tmp_path / "source"
    source.mkdir()
    shutil.copytree(REPO / "instrument", source / "instrument", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(source)], capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("torch_instrument-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)  # Apache-2.0 asks for its text
    for shipped in config.shipped_configs():
        assert f"instrument/configs/{shipped.name}.gin" in names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    # the command is `entry` (the process itself: its Ctrl-C handling lasts to the exit), not `main`
    assert "instrument = instrument.cli:entry" in zipfile.ZipFile(wheel).read(entry_points).decode()
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                              str(wheel)], capture_output=True, text=True, timeout=240)
    assert install.returncode == 0, install.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = _cli("list", cwd=elsewhere, pythonpath=str(site))
    assert out.returncode == 0 and re.search(r"^  nca +The growing", out.stdout, re.M), out.stderr
    (elsewhere / "mine.gin").write_text("include 'backends/tensorboard.gin'\ninclude 'tables/nca.gin'\n")
    probe = (
        "import instrument\n"
        "from instrument import config\n"
        "paths = instrument.parse_config(['nca', 'mine.gin'])\n"
        "print(instrument.__file__, paths[0])\n"
        "print([type(b).__name__ for b in config.backend_set()])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert first.startswith(str(site)) and first.split()[1] == str(site / "instrument" / "configs" / "nca.gin")
    assert second == "['TensorBoardBackend', 'ConsoleBackend', 'JsonlBackend']"


_BAD_FILES = {
    "unclosed.gin": "include 'nca.gin'\nInstrumentation.observers = [@IterationStats()\n"
                    "Instrumentation.log_interval = 5\n",
    "mismatched.gin": "include 'nca.gin'\nInstrumentation.hyperparams = {'a': [1, 2}\n",
    "unknown.gin": "include 'nca.gin'\nNoSuchThing.x = 1\n",
    "misspelt.gin": "include 'nca.gin'\nInstrumentation.log_intervl = 1\n",
    "wrongtype.gin": "include 'nca.gin'\nInstrumentation.log_interval = 'ten'\n",
    "include.gin": "include 'nca.gin'\ninclude 'missing.gin'\n",
    "negative.gin": "include 'nca.gin'\n\nInstrumentation.log_interval = -1\n",
    "mode.gin": "include 'nca.gin'\nWandbBackend.mode = 'offlin'\nbackend_set.wandb = @WandbBackend()\n",
    "macro.gin": "include 'nca.gin'\nSTEPS = 2\ntrain_nca.batch_size = [%STEPS, {'a': %STEP}]\n",
}


@pytest.mark.parametrize(
    "args, where, what, fix",
    [
        (["unclosed.gin"], "unclosed.gin, line 2", "never closed", "close the bracket"),
        (["mismatched.gin"], "mismatched.gin, line 2", "Expected ',' or ']'", "brackets"),
        (["unknown.gin"], "unknown.gin, line 2", "No configurable matching 'NoSuchThing'", "import the module"),
        (["misspelt.gin"], "misspelt.gin, line 2", "log_intervl", "did you mean 'log_interval'?"),
        (["wrongtype.gin"], "wrongtype.gin, line 2", "Instrumentation.log_interval expects int, got 'ten' (str)",
         "bind int there"),
        (["nca", "--bind", "train_nca.steps = 'ten'"], "--bind \"train_nca.steps = 'ten'\"",
         "train_nca.steps expects int, got 'ten'", "e.g. train_nca.steps = 300"),
        (["include.gin"], "include.gin, line 2", "missing.gin", "relative to the including file"),
        (["missing-file.gin"], "no config file 'missing-file.gin'", "no shipped config", "give a path"),
        (["negative.gin"], "negative.gin, line 3: Instrumentation.log_interval = -1", "got -1", "non-negative"),
        (["mode.gin"], "mode.gin, line 2: WandbBackend.mode = 'offlin'", "got 'offlin'", "'offline'"),
        (["macro.gin"], "macro.gin, line 3", "%STEP is used but never defined (defined: STEPS)",
         "did you mean %STEPS?"),
        (["nca", "--bind", "Instrumentation.log_interval = -1"], "--bind 'Instrumentation.log_interval = -1'",
         "got -1", "non-negative"),
        (["nca", "--bind", "Instrumentation.hyperparams = {'a': [1,"], "--bind", "never closed", "close the bracket"),
    ],
)
def test_every_kind_of_bad_config_names_where_what_and_the_fix(tmp_path, capsys, args, where, what, fix):
    for name, text in _BAD_FILES.items():
        (tmp_path / name).write_text(text)
    code, stdout, stderr = _main(capsys, "run", *args)
    assert code == 2 and where in stderr and what in stderr and fix in stderr, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 6, stderr
    assert not list(tmp_path.rglob("*.jsonl")) and not list(tmp_path.rglob("*tfevents*"))  # nothing trained


def test_a_run_piped_into_a_reader_that_has_left_ends_quietly_with_its_logs(tmp_path):
    """`instrument run nca | head -1` where the reader has already exited: the console's legend fails at
    open (no longer a reason not to train), the run finishes, and the closing summary's broken pipe is not a
    traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "instrument", "run", "nca", *TINY, "--bind",
                              "Instrumentation.run_name = 'piped'"], cwd=tmp_path, env=env, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=240)
    finally:
        os.close(write_end)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert list((tmp_path / "runs" / "piped").glob("events.out.tfevents.*"))


def test_a_binding_the_run_never_used_is_named_at_the_end(tmp_path, capsys):
    """quickstart.md says a mistyped WandbBackend.mode is reported; with no W&B backend in the run the binding
    did nothing and the run said nothing (a review found it). Bindings the run used are not named."""
    code, stdout, stderr = _main(
        capsys, "run", "nca", *TINY, "--bind", f"Instrumentation.log_dir = '{tmp_path / 'runs'}'",
        "--bind", "WandbBackend.mode = 'offlin'", "--bind", "WandbBackend.project = 'p'")
    assert code == 0, stderr
    lines = stderr.split("these bindings were never used", 1)[1].splitlines()[1:]
    named = [line for line in lines if line.startswith("  --bind")]
    assert named[0] == "  --bind \"WandbBackend.mode = 'offlin'\": WandbBackend.mode = 'offlin'"
    assert named[1] == "  --bind \"WandbBackend.project = 'p'\": WandbBackend.project = 'p'" and len(named) == 2
    assert "train_nca" not in stderr and "Instrumentation." not in "".join(named)
    # A secret bound in a file is named without its value, as the logged config shows it.
    (tmp_path / "mine.gin").write_text("include 'nca.gin'\nMlflowBackend.tags = {'api_token': 'sk-filesecret123'}\n")
    code, stdout, stderr = _main(capsys, "run", str(tmp_path / "mine.gin"), *TINY,
                                 "--bind", f"Instrumentation.log_dir = '{tmp_path / 'runs'}'")
    assert code == 0, stderr
    assert "mine.gin, line 2: MlflowBackend.tags = {'api_token': '<redacted>'}" in stderr
    assert "sk-filesecret123" not in stderr



def test_a_scoped_binding_of_a_scope_never_called_is_named_at_the_end(tmp_path):
    # A typo in the scope ('los' called, 'loss' bound): the binding did nothing and must be named. The scope
    # that was called, and an unscoped binding of what it built, are used.
    (tmp_path / "cols.gin").write_text(
        "include 'nca.gin'\nConsoleBackend.columns = [@los/Column()]\nlos/Column.key = 'train/loss'\n"
        "loss/Column.header = 'L'\nloss/Column.fmt = '.2e'\nColumn.width = 9\n")
    out = _cli("run", "cols.gin", *TINY, "--bind", "Instrumentation.run_name = 'c'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    named = out.stderr.split("these bindings were never used", 1)[1].splitlines()[1:]
    assert named == ["  cols.gin, line 4: loss/Column.header = 'L'", "  cols.gin, line 5: loss/Column.fmt = '.2e'"]

def test_an_unscoped_and_a_scoped_unused_binding_are_each_named_at_their_own_line(tmp_path):
    """A review found the unscoped binding reported at the scoped one's line (and so that line twice)."""
    (tmp_path / "u.gin").write_text("include 'nca.gin'\nColumn.header = 'y'\nloss/Column.header = 'x'\n"
                                    "Column.width = 9\n")
    config.clear_config()
    config.parse_config(["u.gin"])
    assert sorted(line for line in config.unused_bindings(["u.gin"]) if line.startswith("u.gin")) == [
        "u.gin, line 2: Column.header = 'y'", "u.gin, line 3: loss/Column.header = 'x'",
        "u.gin, line 4: Column.width = 9"]


def test_a_config_after_a_bind_is_a_config_and_run_without_one_shows_runs_usage(tmp_path, capsys):
    """A review found ``run nca --bind ... backends/wandb`` refused as "unrecognized arguments" under the
    top-level usage, and ``run`` alone answered with the top-level usage."""
    (tmp_path / "bad.gin").write_text("train_nca.steps = = 1\n")
    code, _, err = _main(capsys, "run", "nca", "--bind", "train_nca.steps = 1", "bad.gin")
    assert code == 2 and "configuration error in bad.gin, line 1" in err, err
    code, _, err = _main(capsys, "run")
    assert code == 2 and err.startswith("usage: instrument run ") and "run needs a config" in err, err
    code, _, err = _main(capsys, "run", "nca", "--bnd", "x")
    assert code == 2 and err.startswith("usage: instrument run ") and "unrecognized arguments: --bnd\n" in err


def test_extras_after_a_bind_double_dash_options_and_bindings_typed_without_bind(tmp_path, capsys):
    """A review found ``-- ok.gin`` after a --bind refused, ``ok.gin -x`` blamed whole, ``--bogus run`` answered
    with run's usage, and a binding typed without --bind read as a config name and echoed unredacted."""
    (tmp_path / "bad.gin").write_text("train_nca.steps = = 1\n")
    code, _, err = _main(capsys, "run", "nca", "--bind", "train_nca.steps = 1", "--", str(tmp_path / "bad.gin"))
    assert code == 2 and "configuration error in" in err and "bad.gin, line 1" in err, err
    code, _, err = _main(capsys, "run", "nca", "--bind", "train_nca.steps = 1", "ok.gin", "-x")
    assert code == 2 and err.startswith("usage: instrument run ") and "unrecognized arguments: -x\n" in err, err
    code, _, err = _main(capsys, "--bogus", "run", "nca")
    assert code == 2 and err.startswith("usage: instrument [") and "unrecognized arguments: --bogus\n" in err, err
    out = _cli("run", "nca", "--bind", "train_nca.steps = 2", "my_train.api_token = 'EXTRASECRET77'", cwd=tmp_path)
    assert out.returncode == 2 and "pass it with --bind" in out.stderr, out.stderr
    assert "EXTRASECRET77" not in out.stdout + out.stderr, out.stderr


@pytest.mark.parametrize("channels", [4, 16])
def test_the_nca_tables_alpha_column_shows_what_jsonl_has_for_any_channel_count(tmp_path, channels):
    # Channel 3 is c3 with 4 channels and c03 with 16: the shipped table matches either, not nan.
    out = _cli("run", "nca", *TINY, "--bind", f"train_nca.channels = {channels}",
               "--bind", "Instrumentation.run_name = 'a'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if re.match(r"^ +step +loss", line))
    column = lines[head].split().index("αmax")
    shown = {int(row.split()[0]): row.split()[column] for row in lines[head + 1:head + 3]}
    records = [json.loads(x) for x in (tmp_path / "runs" / "a" / "metrics.jsonl").read_text().splitlines()]
    key = f"iteration_stats/max/c{3 if channels <= 10 else '03'}"
    logged = {r["step"]: r["metrics"][key] for r in records if key in r.get("metrics", {})}
    assert sorted(shown) == sorted(logged) == [0, 2]
    assert shown == {step: f"{value:.2f}" for step, value in logged.items()}


def test_the_viewer_hint_is_a_command_a_shell_runs_as_printed(tmp_path):
    # '~' is the home folder, as the shell that runs the hint reads it (the run was in ./~/x), and a path with
    # a space is one argument (it was two).
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    for log_dir, where in (("~/x", home / "x"), ("my runs", work / "my runs")):
        out = _cli("run", "nca", *TINY, "--bind", f"Instrumentation.log_dir = '{log_dir}'",
                   "--bind", "Instrumentation.run_name = 'r'", cwd=work, home=home)
        assert out.returncode == 0, out.stderr
        (hint,) = [line for line in out.stdout.splitlines() if "tensorboard --logdir" in line]
        logs = [line for line in out.stdout.splitlines() if line.startswith("logs: ")]
        assert shlex.split(hint.split(": ", 1)[1]) == ["tensorboard", "--logdir", str(where) if "~" in log_dir
                                                      else log_dir]
        assert shlex.split(logs[0][len("logs: "):]) == [str(where / "r") if "~" in log_dir else f"{log_dir}/r"]
        assert list((where / "r").glob("events.out.tfevents.*"))
    assert not (work / "~").exists()


def test_a_config_file_that_is_not_utf8_is_named_with_its_line_and_the_fix(tmp_path, capsys):
    # gin's UnicodeDecodeError came with no line and "fix: see gin's message above", with nothing above.
    (tmp_path / "latin1.gin").write_bytes(b"include 'nca.gin'\n# caf\xe9\ntrain_nca.steps = 3\n")
    (tmp_path / "top.gin").write_text("import instrument.demos.nca\ninclude 'latin1.gin'\n")
    for name, where in (("latin1.gin", "latin1.gin, line 2"), ("top.gin", "latin1.gin, line 2 (included from ")):
        code, stdout, stderr = _main(capsys, "run", str(tmp_path / name))
        assert code == 2 and stdout == "", stderr
        assert where in stderr and "the file is not UTF-8: byte 0xe9 at byte offset 23" in stderr, stderr
        assert "# caf\\xe9" in stderr and "fix: save the file as UTF-8" in stderr and "above" not in stderr



def _wait_for_lines(proc, jsonl, steps: int = 3) -> None:
    """Until the running CLI has written ``steps`` step lines to ``jsonl`` (a bound, not a timing check): the
    file also holds a hyperparameters line, and the writer may write each step as soon as it is committed."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if jsonl.is_file() and jsonl.read_text().count('"step"') >= steps:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()

def test_ctrl_c_ends_a_run_with_its_folder_named_and_no_traceback(tmp_path):
    """Ctrl-C (a real SIGINT) during `instrument run`: exit status 130, one line saying so instead of a
    traceback, the run folder and viewer named as after a finished run, and every committed step kept."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    args = ["run", "nca", "--bind", "train_nca.steps = 100000", "--bind", "train_nca.batch_size = 2", "--bind",
            "train_nca.size = 12", "--bind", "Instrumentation.log_interval = 1", "--bind",
            "Instrumentation.run_name = 'stopped'"]
    proc = subprocess.Popen([sys.executable, "-m", "instrument", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    jsonl = tmp_path / "runs" / "stopped" / "metrics.jsonl"
    try:
        _wait_for_lines(proc, jsonl)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "interrupted (Ctrl-C)" in stderr, stderr
    assert "logs: runs/stopped" in stdout and "TensorBoard: tensorboard --logdir runs" in stdout, stdout
    steps = [json.loads(line)["step"] for line in jsonl.read_text().splitlines() if '"step"' in line]
    assert len(steps) >= 3 and steps == sorted(set(steps)), steps
    assert set(read_scalars(tmp_path / "runs" / "stopped")["train/loss"]) == set(steps)  # TensorBoard: the same


@pytest.mark.parametrize("binding, where", [
    (["--bind", "run.experiment = @train_nca()"], "in --bind 'run.experiment = @train_nca()'"),
    (["exp.gin"], "in exp.gin, line 3"),  # through a macro
])
def test_an_experiment_bound_as_a_call_is_refused_before_anything_runs(tmp_path, binding, where):
    """A review found ``run.experiment = @train_nca()`` (the parentheses make gin call it while building run's
    arguments) training the whole run uninstrumented, then a raw "'dict' object is not callable" traceback."""
    (tmp_path / "exp.gin").write_text("include 'nca.gin'\nEXP = @train_nca()\nrun.experiment = %EXP\n")
    out = _cli("run", *(["nca"] if binding[0] == "--bind" else []), *binding, "--bind", "train_nca.steps = 3",
               cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"instrument: configuration error {where}: run.experiment is bound to "
                                 "@train_nca(), a call"), out.stderr
    assert "fix: write run.experiment = @train_nca (no parentheses)" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "runs").exists() and out.stdout == ""
    fixed = _cli("run", "nca", *TINY, "--bind", "run.experiment = @train_nca", cwd=tmp_path)  # the fix works
    assert fixed.returncode == 0, fixed.stderr


def test_run_refuses_an_experiment_it_cannot_call_and_ends_the_session_failed(tmp_path):
    """The backstop behind the parse-time check: whatever run.experiment got, run names it and the fix."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    backend = instrument.MlflowBackend()
    inst = instrument.Instrumentation(backends=[backend], log_dir=str(tmp_path), run_name="r")
    with pytest.raises(config.ExperimentTypeError, match=r"run.experiment got dict \(\{'loss': 1.0\}\); expected "
                       r"the function that trains.*run.experiment = @train_nca \(no parentheses"):
        config.experiment.run(experiment={"loss": 1.0}, instrumentation=inst)
    run = MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id)  # closed, not left running
    assert run.info.status == "FAILED" and run.info.end_time is not None


def test_the_tensorboard_hint_names_the_folder_a_bound_log_dir_put_the_event_files_in(tmp_path):
    """A review found `tensorboard --logdir runs` printed when TensorBoardBackend.log_dir had put the event
    files elsewhere (runs/ held none)."""
    out = _cli("run", "nca", *TINY, "--bind", "TensorBoardBackend.log_dir = 'tb elsewhere'", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    (hint,) = [line for line in out.stdout.splitlines() if "tensorboard --logdir" in line]
    assert shlex.split(hint.split(": ", 1)[1]) == ["tensorboard", "--logdir", "tb elsewhere"], hint
    assert set(read_scalars(tmp_path / "tb elsewhere")["train/loss"]) == {0, 2}
    assert not list((tmp_path / "runs").rglob("events.out.tfevents.*"))


def test_a_second_ctrl_c_after_the_run_was_closed_still_exits_130(tmp_path):
    """A review found a second Ctrl-C that lands after the first one's close had finished (while the CLI says
    where the logs are, or while the interpreter exits) ending the process by the signal (-2) instead of
    exiting with 130; what was committed is saved either way."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "OMP_NUM_THREADS": "1"}
    args = ["run", "nca", "--bind", "train_nca.steps = 100000", "--bind", "train_nca.batch_size = 2", "--bind",
            "train_nca.size = 12", "--bind", "Instrumentation.log_interval = 1", "--bind",
            "Instrumentation.run_name = 'twice'"]
    jsonl = tmp_path / "runs" / "twice" / "metrics.jsonl"
    with open(tmp_path / "stdout.txt", "w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "instrument", *args], cwd=tmp_path, env=env, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_lines(proc, jsonl)
            proc.send_signal(signal.SIGINT)
            stderr = []
            for line in proc.stderr:  # the run is closed once the CLI says it was interrupted
                stderr.append(line)
                if "interrupted (Ctrl-C)" in line:
                    break
            proc.send_signal(signal.SIGINT)  # the second Ctrl-C, after the close
            stderr.append(proc.stderr.read())
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stderr.close()
    assert proc.returncode == 130, "".join(stderr)
    assert "Traceback" not in "".join(stderr) and "interrupted (Ctrl-C)" in "".join(stderr)
    steps = [json.loads(line)["step"] for line in jsonl.read_text().splitlines() if '"step"' in line]
    assert len(steps) >= 3 and steps == sorted(set(steps)), steps


@pytest.mark.parametrize("args", [
    ["WandbBackend.api_key=CLEARSEK81"], ["WandbBackend.api_key=CLEARSEK81", "--bind", "Foo.x=1"],
    ["--", "WandbBackend.api_key=CLEARSEK81"], ["--bind", "Foo.x=1", "--", "WandbBackend.api_key=CLEARSEK81"],
    ["WandbBackend.api_key=CLEARSEK81.gin"],
])
def test_a_binding_typed_as_a_config_anywhere_is_never_echoed(tmp_path, capsys, monkeypatch, args):
    """A review found a binding typed without --bind echoed in clear ('no config file ...') unless it came after
    a --bind: before one, alone, or after ``--``."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _main(capsys, "run", "nca", *args)
    assert code == 2 and "CLEARSEK81" not in out + err, err
    assert "pass it with --bind" in err or "no config file 'WandbBackend.api_key=" in err, err


def test_a_config_path_holding_an_equals_sign_is_a_config(tmp_path, capsys, monkeypatch):
    """A review found ``run nca --bind X.a=1 x=y.gin`` refused as 'a binding, not a config'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x=y.gin").write_text("train_nca.steps = = 1\n")
    (tmp_path / "a=b").write_text("train_nca.steps = = 1\n")
    for name in ("x=y.gin", "a=b"):
        code, _, err = _main(capsys, "run", "nca", "--bind", "train_nca.steps = 1", name)
        assert code == 2 and "is a binding" not in err and f"configuration error in {name}, line 1" in err, err
    code, _, err = _main(capsys, "run", "nca", "missing=y.gin")
    assert code == 2 and "no config file 'missing=y.gin'" in err, err
